"""Decode attention over the paged, quantized KV cache: time, achieved bandwidth and distance to the floor per
page precision, at the head layouts of Llama-3-8B (32 query / 8 KV heads: GQA 4) and Qwen2.5-1.5B (12 / 2: GQA 6).

For every (heads, precision, batch, seq) it times `paged_decode_attention` (one new token per sequence; the kernel
the dispatch picks is recorded per row) and, beside it in the same run, torch SDPA on a contiguous fp16 cache
[B, Hkv, S, D] holding the same keys/values.

Bytes the kernel must read (the numerator of "GB/s"), per token and KV head:
    key data + value data                    (D*2 bytes at 16 bits, D*bits/8 packed bytes at 8/4/2 bits)
  + key scale/zero + value scale/zero        (2 x fp16 = 4 bytes per quantized side, none at 16 bits)
plus q [B, Hq, D] and the output [B, Hq, D] once (fp16). NOT counted: the page table, the score/position
segments and alignment padding of a page (decode never reads them), the unused tail of a sequence's last page,
and the split-K partial results (they stay in L2). SDPA's bytes are the fp16 K/V + q + output.
"% of 3.0 TB/s" = those compressed bytes / time / 3.0e12 (--bandwidth: an H100's copy bandwidth; --bandwidth floor
takes the bandwidth of the floor fitted below, SDPA's on this GPU, so the big-read target can be judged on any GPU).

The floor: a call that reads `bytes` cannot take less than t0 + bytes / BW, with t0 (the fixed cost of a call:
launch, first loads, the last wave's tail) and BW fitted in the same run to torch SDPA over the contiguous fp16
cache at every timed shape (the faster SDPA variant per shape), by least squares on relative error. A row's
"of floor" = floor time / its time (1.0: as fast as SDPA would be on that many bytes). A near-empty SDPA call
(B=1, 16 tokens) is timed beside it and reported, not fitted: its ~3 us is the graph launch alone, while every
call that reads data pays ~7 us (first DRAM round trips, ramp-up and tail), which the fit measures.

Targets (the verdict, on CUDA-graph times, every timing of a row; see TARGET_*):
  - every compressed precision (all but fp16) >= 0.85 of its floor at every shape with batch x seq >= 8 x 4096;
  - every compressed precision >= 85% of 3.0 TB/s where a call reads >= 256 MB;
  at both head layouts.

Cache: one layer, head_dim 128, fp16 cache dtype, page_bytes of a 16-token fp16 page (page_bytes_for(16, 128,
2)); random keys/values (never zeros) quantized by `write_kv`; page ids shuffled; `max_len` passed, so no device
sync. "mix" = per head a K8V4 high section of S/2 tokens + a K4V2 low section of S/2 tokens (fmt_low/len_low).
Before timing, every precision is checked once against the torch reference (impl="ref") on a small shape and the
fp16 kernel against SDPA at every timed shape; a mismatch aborts.

Timing: triton.testing.do_bench median (it flushes L2 before every call); caches smaller than 2x L2 are
rotated among copies so no call starts with its data in L2. "graph us" (unless --no-graph) is
triton.testing.do_bench_cudagraph median over a graph of back-to-back calls that rotate among the copies: no
launch gaps and no L2 flush (closer to a CUDA-graph decode step); --repeats N takes it N times per row and the
verdict judges the slowest. do_bench's time at small shapes is mostly the Python launch of two Triton kernels
(~120-160 us per call on an H100 with Triton 3.6), which a decode step never pays; it stays in the JSON.
Each row also records the SM clock and power nvidia-smi reported while it was timed (benchmarks/_gpu_power.py):
on an H200 the largest calls reach the 700 W power cap and run below the full clock.

Usage (GPU):  python benchmarks/attention.py [--heads llama3-8b qwen2.5-1.5b] [--batches 8 32 128]
                  [--seqs 1024 4096 16384] [--repeats 2] [--out PATH]
Smoke (CPU):  python benchmarks/attention.py --smoke --out /tmp/attention.json   (impl="ref" + SDPA, seconds)
"""
from __future__ import annotations

import argparse
import contextlib
import json
import math
import platform
import re
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from _gpu_power import PowerMonitor  # noqa: E402
from _results import write_result  # noqa: E402

from diffkv_serve.kernels.decode_attention import paged_decode_attention  # noqa: E402
from diffkv_serve.kernels.decode_attention import mma_cuda  # noqa: E402
from diffkv_serve.kernels.decode_attention.dispatch import pick_kernel  # noqa: E402
from diffkv_serve.kernels.kv_write import write_kv  # noqa: E402
from diffkv_serve.kernels.page_layout import PageFormat, page_bytes_for  # noqa: E402
from diffkv_serve.engine.flags import add_engine_flags  # noqa: E402

PRECISIONS = {"fp16": "K16V16", "K8V8": "K8V8", "fp8": "K8V8-e4m3", "int4": "K4V4", "K8V4": "K8V4",
              "K4V2": "K4V2", "mix": "K8V4+K4V2"}
SDPA_MODES = ("gqa", "fold")  # enable_gqa=True on q [B,Hq,1,D]; or q folded to [B,Hkv,G,D] (G rows per KV head)
# Head layouts (query heads, KV heads, head_dim) of diffkv_serve/engine/loader/presets.py's models (tests check they agree;
# this script imports no engine code, so it runs where only torch and Triton are installed).
HEADS = {"llama3-8b": (32, 8, 128), "qwen2.5-1.5b": (12, 2, 128)}
CHECK_TOL = 4e-3  # atol and rtol: Triton vs impl="ref" (same dequantized data, fp16 dots); fp16 ref vs SDPA
FULL_TOL = 1e-2  # fp16 kernel vs SDPA at the timed shapes (long fp16 reductions; a wrong page is off by ~0.1+)
TARGET_OF_FLOOR = 0.85  # every compressed precision, at batch x seq >= TARGET_MIN_TOKENS
TARGET_MIN_TOKENS = 8 * 4096
TARGET_BIG_READ = 256e6  # bytes of a call from which ...
TARGET_BIG_FRAC = 0.85  # ... every compressed precision reaches this share of --bandwidth
FLOOR_PROBE = (1, 16)  # batch, seq of the near-empty SDPA call reported beside the floor (launch cost alone)


class Mismatch(RuntimeError):
    pass


# ------------------------------------------------------------------------------------------------ formats

def parse_spec(spec: str, head_dim: int, page_bytes: int, isz: int) -> tuple[PageFormat, PageFormat | None]:
    """'K8V4' -> (K8V4, None); 'K8V4+K4V2' -> (K8V4 high, K4V2 low); 'K8V8-e4m3': fp8 codes (kv_mode fp8).
    Pages as the engine lays them out: score and position rows only where there are two sections (a diffkv
    cache), so a single precision fits its pages as served."""
    names = spec.split("+")
    fmts = []
    for name in names:
        m = re.fullmatch(r"K(\d+)V(\d+)(-e4m3)?", name)
        if not m:
            raise ValueError(f"precision {spec!r}: expected KxVy, KxVy-e4m3 or KaVb+KcVd")
        fmts.append(PageFormat.make(int(m[1]), int(m[2]), head_dim, page_bytes, isz, float8=bool(m[3]),
                                    tracked=len(names) > 1))
    if len(fmts) > 2:
        raise ValueError(f"precision {spec!r}: at most a high and a low section")
    return fmts[0], (fmts[1] if len(fmts) == 2 else None)


def section_lengths(S: int, has_low: bool) -> tuple[int, int]:
    return (S - S // 2, S // 2) if has_low else (S, 0)


def side_bytes(bits: int, D: int, isz: int) -> int:
    """Bytes the kernel reads for one token's keys (or values) of one head: data + fp16 scale/zero."""
    return D * isz if bits == 16 else D * bits // 8 + 4


def token_bytes(fmt: PageFormat) -> int:
    D, isz = fmt.head_dim, fmt.full_itemsize
    return side_bytes(fmt.key_bits, D, isz) + side_bytes(fmt.value_bits, D, isz)


def pages_per_head(fmt_hi, fmt_lo, S) -> tuple[int, int]:
    s_hi, s_lo = section_lengths(S, fmt_lo is not None)
    return math.ceil(s_hi / fmt_hi.tokens), (math.ceil(s_lo / fmt_lo.tokens) if fmt_lo is not None else 0)


def read_bytes(fmt_hi, fmt_lo, B, Hq, Hkv, S, isz) -> tuple[int, int]:
    """(K/V bytes incl. scale/zero, q + output bytes) one call must read/write."""
    s_hi, s_lo = section_lengths(S, fmt_lo is not None)
    kv = B * Hkv * (s_hi * token_bytes(fmt_hi) + (s_lo * token_bytes(fmt_lo) if fmt_lo is not None else 0))
    return kv, 2 * B * Hq * fmt_hi.head_dim * isz


# -------------------------------------------------------------------------------------------------- data

def make_kv(B, Hkv, S, D, dtype, device, seed):
    """Random contiguous keys/values [B, Hkv, S, D] (never zero: normal noise plus offsets) and q [B, Hq, D]."""
    g = torch.Generator(device=device).manual_seed(seed)
    K = torch.randn(B, Hkv, S, D, generator=g, device=device, dtype=dtype).mul_(1.5)
    K += (torch.randn(1, Hkv, 1, D, generator=g, device=device) * 0.5).to(dtype)
    V = torch.randn(B, Hkv, S, D, generator=g, device=device, dtype=dtype).add_(0.3)
    return K, V


def build_paged(K, V, fmt_hi, fmt_lo, cache_dtype, seed, impl):
    """Writes K/V [B, Hkv, S, D] into shuffled pages of one layer with write_kv (quantizing where needed).

    Token j < S_hi -> high section (fmt_hi, page_table[b, 0, h, j // T]); token S_hi + j -> low token j
    (fmt_lo, page_table[b, 0, h, P - 1 - j // T_lo]). Column P is the trash column. Rows never written are NaN.
    Returns pool, page_table int32 [B, 1, Hkv, P + 1], lengths int32 [B, 1, Hkv], len_low (or None).
    """
    B, Hkv, S, D = K.shape
    dev = K.device
    s_hi, s_lo = section_lengths(S, fmt_lo is not None)
    a, bl = pages_per_head(fmt_hi, fmt_lo, S)
    P = a + bl
    num_pages = B * Hkv * P
    g = torch.Generator().manual_seed(seed)
    ids = torch.randperm(num_pages, generator=g).to(device=dev, dtype=torch.int32).view(B, Hkv, P)
    pool = torch.empty(num_pages, fmt_hi.page_bytes, dtype=torch.uint8, device=dev)
    pool.view(torch.float32).fill_(float("nan"))  # a kernel reading an unwritten row would show NaN
    page_table = torch.full((B, 1, Hkv, P + 1), -1, dtype=torch.int32, device=dev)
    page_table[:, 0, :, :a] = ids[..., :a]
    if bl:
        page_table[:, 0, :, P - bl:P] = ids[..., a:].flip(-1)  # low page c sits in column P - 1 - c
    sections = [(fmt_hi, 0, s_hi, False)] + ([(fmt_lo, s_hi, s_lo, True)] if fmt_lo is not None else [])
    heads = torch.arange(Hkv, device=dev)
    for fmt, start, n, low in sections:
        T = fmt.tokens
        j = torch.arange(n, device=dev)
        cols = (P - 1 - j // T) if low else j // T
        rows = (j % T).to(torch.int32)[:, None].expand(n, Hkv).contiguous()
        pos = (start + j).to(torch.int32)
        for b in range(B):
            pages = page_table[b, 0][heads[None, :], cols[:, None]].contiguous()  # [n, Hkv]
            k = K[b, :, start:start + n].transpose(0, 1)  # [n, Hkv, D], stride(2) == 1
            v = V[b, :, start:start + n].transpose(0, 1)
            write_kv(pool, fmt, cache_dtype, k, v, pages, rows, pos, impl=impl)
    lengths = torch.full((B, 1, Hkv), s_hi, dtype=torch.int32, device=dev)
    len_low = torch.full((B, 1, Hkv), s_lo, dtype=torch.int32, device=dev) if fmt_lo is not None else None
    return pool, page_table, lengths, len_low


def sdpa(q, K, V, mode):
    """q [B, Hq, D], K/V [B, Hkv, S, D] -> [B, Hq, D] (fp16 SDPA, one query token, no mask)."""
    B, Hq, D = q.shape
    Hkv = K.shape[1]
    if mode == "gqa":
        return F.scaled_dot_product_attention(q.unsqueeze(2), K, V, enable_gqa=True).view(B, Hq, D)
    # Query head h*G + g attends KV head h (as enable_gqa's repeat_interleave): the G heads of a group become G
    # query rows of one KV head, unmasked, so every fused backend applies and nothing is repeated.
    return F.scaled_dot_product_attention(q.view(B, Hkv, Hq // Hkv, D), K, V).view(B, Hq, D)


# ------------------------------------------------------------------------------------------------ timing

def copies_for(footprint: int, l2_bytes: int, max_copies: int = 32) -> int:
    """Enough copies that one rotation covers >= 4x L2 when the data is within 2x L2; else 1."""
    if l2_bytes <= 0 or footprint >= 2 * l2_bytes:
        return 1
    return max(2, min(max_copies, math.ceil(4 * l2_bytes / max(footprint, 1))))


def decode_inputs(fmt_hi, fmt_lo, B: int, Hq: int, Hkv: int, S: int, dtype, device, l2_bytes: int, seed: int = 0):
    """One layer's paged cache of S random tokens a (sequence, KV head), in enough copies to rotate past L2
    (l2_bytes 0: one), and a decode call's buffers: pools, page_table, lengths, len_low, q, slots, out, logits and
    lse (the last two where there is a low section, as the engine's diffkv decode writes them), and the bytes one
    call reads (kv_bytes, qo_bytes)."""
    from types import SimpleNamespace
    D = fmt_hi.head_dim
    K, V = make_kv(B, Hkv, S, D, dtype, device, seed=seed)
    pool, pt, lens, len_lo = build_paged(K, V, fmt_hi, fmt_lo, dtype, 0, impl="auto")
    del K, V
    kv_bytes, qo_bytes = read_bytes(fmt_hi, fmt_lo, B, Hq, Hkv, S, torch.empty((), dtype=dtype).element_size())
    n = copies_for(pool.numel(), int(l2_bytes))
    q = torch.randn(B, Hq, D, device=device, dtype=dtype)
    diffkv = fmt_lo is not None
    return SimpleNamespace(
        pools=[pool] + [pool.clone() for _ in range(n - 1)], page_table=pt, lengths=lens, len_low=len_lo, q=q,
        slots=torch.arange(B, dtype=torch.int32, device=device), out=torch.empty_like(q),
        logits=torch.empty(B, Hq, S, dtype=torch.float32, device=device) if diffkv else None,
        lse=torch.empty(B, Hq, dtype=torch.float32, device=device) if diffkv else None,
        kv_bytes=kv_bytes, qo_bytes=qo_bytes)


def decode_cases(precisions, batches, seqs, Hq: int, Hkv: int, head_dim: int, block_size: int, dtype, device,
                 l2_bytes: int):
    """(precision, fmt_hi, fmt_lo, batch, seq, decode_inputs(...)) for every precision x batch x seq of a sweep,
    pages sized as a fp16 page of block_size tokens; each case's cache is built as it is reached."""
    page_bytes = page_bytes_for(block_size, head_dim, 2)
    for prec in precisions:
        fmt_hi, fmt_lo = parse_spec(PRECISIONS.get(prec, prec), head_dim, page_bytes, 2)
        for B in batches:
            for S in seqs:
                yield prec, fmt_hi, fmt_lo, B, S, decode_inputs(fmt_hi, fmt_lo, B, Hq, Hkv, S, dtype, device, l2_bytes)


def agrees_with_first(ref, out, what: str):
    """A sweep's check that every configuration computes the same call: returns the reference (out's copy when
    ref is None, the first configuration); raises naming `what` where out differs from it beyond 4e-3 relative."""
    got = out.float().clone()
    if ref is None:
        return got
    err = float((got - ref).abs().max())
    if err > 4e-3 * (1 + float(ref.abs().max())):
        raise RuntimeError(f"{what} differs from the first configuration by {err:.3e}")
    return ref


def rotating(fn, n):
    i = [0]

    def call():
        k = i[0] % n
        i[0] += 1
        return fn(k)

    return call


def sweep_us(call, cuda: bool, rep: float) -> float:
    """A kernel sweep's time of one configuration, in microseconds: do_bench_cudagraph's median on a GPU (rep ms),
    one wall-clock call on the CPU (--smoke runs)."""
    if not cuda:
        t0 = time.perf_counter()
        call()
        return 1e6 * (time.perf_counter() - t0)
    import triton.testing
    return 1e3 * triton.testing.do_bench_cudagraph(call, rep=rep, return_mode="median")


def time_us(call, args, cuda: bool) -> tuple[float, list[float]]:
    """(do_bench median us, [do_bench_cudagraph median us] x --repeats, or [] without graphs); CPU:
    perf_counter median, no graph."""
    if not cuda:
        call()
        ts = []
        for _ in range(args.cpu_reps):
            t0 = time.perf_counter()
            call()
            ts.append(time.perf_counter() - t0)
        return 1e6 * statistics.median(ts), []
    import triton.testing

    t = triton.testing.do_bench(call, warmup=args.warmup, rep=args.rep, return_mode="median")
    graphs = [] if args.no_graph else [
        1e3 * triton.testing.do_bench_cudagraph(call, rep=args.graph_rep, return_mode="median")
        for _ in range(args.repeats)]
    return 1e3 * t, graphs


def fit_floor(points: list[tuple[float, float]]) -> dict:
    """t = t0 + bytes / bw fitted to (bytes, us) points by least squares on relative error (every shape counts
    alike). Returns t0_us, bw (bytes/s) and the largest relative residual."""
    import numpy as np

    b = np.array([p[0] for p in points], dtype=np.float64)
    t = np.array([p[1] for p in points], dtype=np.float64)
    (t0, slope), *_ = np.linalg.lstsq(np.stack([1 / t, b / t], 1), np.ones_like(t), rcond=None)
    # A floor has no negative fixed cost and no negative time per byte. Noisy timings (a busy CPU, a handful of
    # tiny shapes) can fit either; then the best fit with that term held at zero is the floor.
    if t0 < 0:
        t0, slope = 0.0, float(np.sum(b / t) / np.sum((b / t) ** 2))
    elif slope <= 0:
        t0, slope = float(np.sum(1 / t) / np.sum((1 / t) ** 2)), 0.0
    resid = np.abs(t0 + slope * b - t) / t
    return {"t0_us": float(t0), "bw": float(1e6 / slope) if slope > 0 else float("inf"),
            "max_rel_residual": float(resid.max()), "points": len(points)}


# -------------------------------------------------------------------------------------------- correctness

def _close(name, got, want, tol=CHECK_TOL):
    got, want = got.float(), want.float()
    if not torch.isfinite(got).all():
        raise Mismatch(f"{name}: non-finite output")
    err = (got - want).abs()
    bad = err > tol + tol * want.abs()
    if bad.any():
        raise Mismatch(f"{name}: {int(bad.sum())}/{bad.numel()} elements off, max abs err {float(err.max()):.3e} "
                       f"(atol = rtol = {tol})")
    return float(err.max())


def reference_for(kernel: str, ref, q, pool, fmt_hi, dt, pt, lens, slots, max_len=None, fmt_low=None,
                  len_low=None):
    """The reference output a decode kernel is held to (default scale, layer 0): `ref` (impl='ref' over q as given)
    for the Triton kernels; for the CUDA kernel, whose integer q.k rounds q per section (mma_cuda.query_levels), the
    reference over that q."""
    if kernel != "mma_cuda":
        return ref
    return mma_cuda.kernel_reference(q, pool, fmt_hi, dt, pt, lens, slots, 0, 1.0 / math.sqrt(q.shape[-1]),
                                     max_len=max_len, fmt_low=fmt_low, len_low=len_low).to(ref.dtype)


def check_small(args, heads, device, impl, page_bytes) -> list[dict]:
    """Each precision once on a small shape: Triton (default splits and num_splits=1) vs impl='ref', the fp16
    reference vs SDPA (same data), and every format's error vs SDPA (informational). Raises Mismatch."""
    B, S = args.check_shape  # S: not a multiple of any page's tokens; B * Hkv < #SMs -> the split-K path
    name, (Hq, Hkv, D) = heads
    dt = torch.float16
    K, V = make_kv(B, Hkv, S, D, dt, device, seed=args.seed + 7)
    q = torch.randn(B, Hq, D, device=device, dtype=dt)
    want = {m: sdpa(q, K, V, m) for m in args.sdpa}
    slots = torch.arange(B, dtype=torch.int32, device=device)
    out = []
    for prec in args.precisions:
        fmt_hi, fmt_lo = parse_spec(PRECISIONS.get(prec, prec), D, page_bytes, 2)
        pool, pt, lens, len_lo = build_paged(K, V, fmt_hi, fmt_lo, dt, args.seed, impl="auto")
        kw = dict(max_len=S, fmt_low=fmt_lo, len_low=len_lo)
        ref = paged_decode_attention(q, pool, fmt_hi, dt, pt, lens, slots, 0, impl="ref", **kw)
        row = {"heads": name, "precision": prec, "batch": B, "seq": S}
        if impl == "triton":
            kernel_ref = reference_for(pick_kernel(fmt_hi, fmt_lo, q, Hq // Hkv), ref, q, pool, fmt_hi, dt, pt,
                                       lens, slots, **kw)
            for splits in (None, 1):
                got = paged_decode_attention(q, pool, fmt_hi, dt, pt, lens, slots, 0, impl="triton",
                                             num_splits=splits, **kw)
                row[f"triton_vs_ref_splits_{splits or 'auto'}"] = _close(
                    f"{prec} triton (num_splits={splits}) vs ref", got, kernel_ref)
        for m in args.sdpa:
            if fmt_hi.key_bits == fmt_hi.value_bits == 16 and fmt_lo is None:
                row[f"ref_vs_sdpa_{m}"] = _close(f"{prec} ref vs SDPA ({m})", ref, want[m])
            else:
                row[f"ref_vs_sdpa_{m}"] = float((ref.float() - want[m].float()).abs().max())
        out.append(row)
        errs = ", ".join(f"{k}={v:.2e}" for k, v in row.items() if k.startswith(("tri", "ref")))
        print(f"  check {name} {prec:>5}: {errs}")
    return out


# -------------------------------------------------------------------------------------------------- main

def parse_args(argv):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--precisions", nargs="+", default=list(PRECISIONS),
                    help="fp16 K8V8 fp8 K8V4 K4V2 mix, or any KxVy / KxVy-e4m3 / KaVb+KcVd (high+low halves)")
    ap.add_argument("--heads", nargs="+", default=None, choices=list(HEADS),
                    help=f"head layouts to time (default: all of {list(HEADS)}; smoke: a small one)")
    ap.add_argument("--batches", type=int, nargs="+", default=None, help="default 8 32 128 (smoke: 2)")
    ap.add_argument("--seqs", type=int, nargs="+", default=None, help="default 1024 4096 16384 (smoke: 50 200)")
    ap.add_argument("--block-size", type=int, default=16, help="page_bytes = a fp16 page of this many tokens")
    ap.add_argument("--sdpa", nargs="*", default=list(SDPA_MODES), choices=SDPA_MODES,
                    help="SDPA baselines: gqa (enable_gqa=True), fold (G query heads as G query rows)")
    ap.add_argument("--warmup", type=float, default=25, help="do_bench warmup (ms)")
    ap.add_argument("--rep", type=float, default=100, help="do_bench rep (ms)")
    ap.add_argument("--graph-rep", type=float, default=20, help="do_bench_cudagraph rep (ms)")
    ap.add_argument("--repeats", type=int, default=1, help="CUDA-graph timings per row (the verdict judges the "
                                                           "slowest)")
    ap.add_argument("--no-graph", action="store_true", help="skip the CUDA-graph timing column")
    ap.add_argument("--cpu-reps", type=int, default=3, help="timed calls per row on CPU")
    ap.add_argument("--bandwidth", default=None,
                    help="bytes/s for the %% column and the big-read target (default 3.0e12, an H100's copy "
                         "bandwidth; --from-json: the recorded run's), or 'floor': the floor's fitted bandwidth "
                         "(SDPA's on this GPU)")
    ap.add_argument("--l2-bytes", type=float, default=50e6, help="L2 size: smaller caches rotate among copies")
    ap.add_argument("--mem-fraction", type=float, default=0.85, help="skip shapes needing more of free memory")
    ap.add_argument("--check-shape", type=int, nargs=2, default=None, metavar=("B", "S"),
                    help="shape of the Triton-vs-ref check of every precision before timing (default 3 1000; "
                         "smoke: 2 300)")
    add_engine_flags(ap, only=("device",), defaults={"device": "auto"})
    ap.add_argument("--impl", default="auto", choices=("auto", "triton", "ref"),
                    help="paged kernel: auto = triton on CUDA, ref (torch) on CPU")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", default=None, help="JSON path (default benchmarks/results/attention_<gpu>.json)")
    ap.add_argument("--smoke", action="store_true", help="tiny shapes on CPU, impl='ref' + SDPA (CI)")
    ap.add_argument("--from-json", default=None, metavar="PATH",
                    help="no timing: re-derive the floor, tables and verdict of a recorded run (rewritten in place "
                         "unless --out)")
    args = ap.parse_args(argv)
    if args.repeats < 1:
        ap.error("--repeats: at least 1")
    if args.bandwidth is None and not args.from_json:
        args.bandwidth = 3.0e12
    if args.bandwidth not in (None, "floor"):
        try:
            args.bandwidth = float(args.bandwidth)
        except ValueError:
            ap.error(f"--bandwidth: bytes/s or 'floor', got {args.bandwidth!r}")
        if not args.bandwidth > 0:
            ap.error("--bandwidth: must be > 0")
    if args.smoke:
        defaults = {"batches": [2], "seqs": [50, 200], "check_shape": [2, 300]}
        args.device = "cpu" if args.device == "auto" else args.device
        torch.set_num_threads(1)  # tiny ops: a shared CPU's thread pool only adds contention (10x slower here)
    else:
        defaults = {"batches": [8, 32, 128], "seqs": [1024, 4096, 16384], "check_shape": [3, 1000]}
    for k, v in defaults.items():
        if getattr(args, k) is None:
            setattr(args, k, v)
    if args.heads is None:
        args.heads = ["smoke"] if args.smoke else list(HEADS)
    args.head_layouts = [(h, SMOKE_HEADS if h == "smoke" else HEADS[h]) for h in args.heads]
    if args.device == "auto":
        args.device = "cuda" if torch.cuda.is_available() else "cpu"
    for _, (_, _, D) in args.head_layouts:
        for p in args.precisions:
            parse_spec(PRECISIONS.get(p, p), D, page_bytes_for(args.block_size, D, 2), 2)
    return args


SMOKE_HEADS = (8, 2, 128)  # GQA 4 at head_dim 128 on a CPU: few heads keep the smoke run to seconds


def timed(call, args, cuda: bool, power: PowerMonitor | None) -> tuple[float, list[float], dict]:
    """time_us, and the GPU's clock and power while it ran ({"gpu": ...} where they were sampled)."""
    t0 = time.monotonic()
    t, tg = time_us(call, args, cuda)
    state = power.window(t0, time.monotonic()) if power is not None else None
    return t, tg, ({"gpu": state} if state else {})


def measure_heads(args, heads, device, impl, cuda, power=None) -> tuple[list[dict], list[dict]]:
    """Times SDPA and every precision at every (batch, seq) of one head layout: (rows, skipped)."""
    name, (Hq, Hkv, D) = heads
    dt, isz = torch.float16, 2
    page_bytes = page_bytes_for(args.block_size, D, isz)
    rows, skipped = [], []
    slots_all = torch.arange(max(args.batches), dtype=torch.int32, device=device)
    l2 = int(args.l2_bytes) if cuda else 0  # CPU: no rotation (copies_for -> 1)
    fp16_hi, _ = parse_spec("K16V16", D, page_bytes, isz)
    for B in args.batches:
        for S in args.seqs:
            kv_contig = 2 * B * Hkv * S * D * isz
            fp16_pool = B * Hkv * math.ceil(S / fp16_hi.tokens) * page_bytes
            need = kv_contig + fp16_pool + (1 << 30)
            if cuda:
                free = torch.cuda.mem_get_info(device)[0]
                if need > args.mem_fraction * free:
                    msg = f"needs ~{need / 1e9:.1f} GB, {free / 1e9:.1f} GB free"
                    print(f"skip {name} B={B} S={S}: {msg}")
                    skipped.append({"heads": name, "batch": B, "seq": S, "reason": msg})
                    continue
            K, V = make_kv(B, Hkv, S, D, dt, device, seed=args.seed + 1000 * B + S)
            q = torch.randn(B, Hq, D, device=device, dtype=dt,
                            generator=torch.Generator(device=device).manual_seed(args.seed + B + S))
            slots = slots_all[:B]
            qo = 2 * B * Hq * D * isz
            base = dict(heads=name, hq=Hq, hkv=Hkv, head_dim=D, batch=B, seq=S, qo_bytes=qo)
            sdpa_out = {}
            n_kv = copies_for(kv_contig, l2)
            Ks = [K] + [K.clone() for _ in range(n_kv - 1)]
            Vs = [V] + [V.clone() for _ in range(n_kv - 1)]
            for m in args.sdpa:
                try:
                    sdpa_out[m] = sdpa(q, K, V, m)
                    t, tg, gpu_state = timed(rotating(lambda k, m=m: sdpa(q, Ks[k], Vs[k], m), n_kv), args,
                                             cuda, power)
                except torch.cuda.OutOfMemoryError as e:
                    print(f"skip {name} sdpa-{m} B={B} S={S}: OOM")
                    skipped.append({"heads": name, "precision": f"sdpa-{m}", "batch": B, "seq": S,
                                    "reason": f"OOM: {e}"[:200]})
                    continue
                rows.append(dict(base, precision=f"sdpa-{m}", kv_bytes=kv_contig, bytes=kv_contig + qo,
                                 footprint_bytes=kv_contig, copies=n_kv, time_us=t, graph_runs_us=tg,
                                 **gpu_state))
            del Ks, Vs
            for prec in args.precisions:
                fmt_hi, fmt_lo = parse_spec(PRECISIONS.get(prec, prec), D, page_bytes, isz)
                kv, _ = read_bytes(fmt_hi, fmt_lo, B, Hq, Hkv, S, isz)
                a, bl = pages_per_head(fmt_hi, fmt_lo, S)
                footprint = B * Hkv * (a + bl) * page_bytes
                n = copies_for(footprint, l2)
                try:
                    pool, pt, lens, len_lo = build_paged(K, V, fmt_hi, fmt_lo, dt, args.seed + S + B, impl)
                    pools = [pool] + [pool.clone() for _ in range(n - 1)]
                    out = torch.empty_like(q)
                    kw = dict(impl=impl, max_len=S, out=out, fmt_low=fmt_lo, len_low=len_lo)

                    def run(k, pools=pools, pt=pt, lens=lens, fmt_hi=fmt_hi, kw=kw):
                        return paged_decode_attention(q, pools[k], fmt_hi, dt, pt, lens, slots, 0, **kw)

                    res = run(0).clone()
                    is_fp16 = fmt_hi.key_bits == fmt_hi.value_bits == 16 and fmt_lo is None
                    errs = {}
                    for m, want in sdpa_out.items():
                        if is_fp16:  # same fp16 data: must agree at every timed shape
                            errs[m] = _close(f"{name} fp16 {impl} vs SDPA ({m}) at B={B} S={S}", res, want,
                                             FULL_TOL)
                        else:
                            errs[m] = float((res.float() - want.float()).abs().max())
                    if not torch.isfinite(res).all():
                        raise Mismatch(f"{name} {prec} B={B} S={S}: non-finite output")
                    t, tg, gpu_state = timed(rotating(run, n), args, cuda, power)
                except torch.cuda.OutOfMemoryError as e:
                    print(f"skip {name} {prec} B={B} S={S}: OOM")
                    skipped.append({"heads": name, "precision": prec, "batch": B, "seq": S,
                                    "reason": f"OOM: {e}"[:200]})
                    continue
                finally:
                    run = pools = pool = None  # free this precision's pages before the next is built
                    if cuda:
                        torch.cuda.empty_cache()
                kernel = pick_kernel(fmt_hi, fmt_lo, q, Hq // Hkv) if impl == "triton" else impl
                rows.append(dict(base, precision=prec, spec=PRECISIONS.get(prec, prec), kernel=kernel, kv_bytes=kv,
                                 bytes=kv + qo,
                                 footprint_bytes=footprint, copies=n, time_us=t, graph_runs_us=tg, **gpu_state,
                                 **{f"max_abs_err_vs_sdpa_{m}": e for m, e in errs.items()}))
            del K, V, sdpa_out
            if cuda:
                torch.cuda.empty_cache()
    return rows, skipped


def floor_probe(args, device, cuda) -> dict | None:
    """SDPA on a near-empty cache (FLOOR_PROBE) at the first head layout: a call's launch cost alone (reported
    beside the floor, not fitted: see the module doc)."""
    if not cuda or args.no_graph or not args.sdpa:
        return None
    B, S = FLOOR_PROBE
    Hq, Hkv, D = args.head_layouts[0][1]
    K, V = make_kv(B, Hkv, S, D, torch.float16, device, seed=args.seed)
    q = torch.randn(B, Hq, D, device=device, dtype=torch.float16)
    runs = {m: time_us(lambda m=m: sdpa(q, K, V, m), args, cuda)[1] for m in args.sdpa}
    best = min(statistics.median(r) for r in runs.values())
    return {"batch": B, "seq": S, "bytes": 2 * B * Hkv * S * D * 2 + 2 * B * Hq * D * 2, "graph_us": best}


def derive(rows: list[dict], args, graphs: bool) -> None:
    """Per-row bandwidth, speedups (same head layout, batch and seq) and the timing the targets judge."""
    by = {(r["heads"], r["precision"], r["batch"], r["seq"]): r for r in rows}
    for r in rows:
        r["graph_us"] = statistics.median(r["graph_runs_us"]) if r["graph_runs_us"] else None
        r["graph_worst_us"] = max(r["graph_runs_us"]) if r["graph_runs_us"] else None
    for r in rows:
        r["gb_s"] = r["bytes"] / r["time_us"] / 1e3
        if r["graph_us"]:
            r["graph_gb_s"] = r["bytes"] / r["graph_us"] / 1e3
        key = (r["heads"], r["batch"], r["seq"])
        f16 = by.get((key[0], "fp16", *key[1:]))
        r["speedup_vs_fp16"] = f16["time_us"] / r["time_us"] if f16 else None
        has_graph = f16 and f16["graph_us"] and r["graph_us"]
        r["graph_speedup_vs_fp16"] = f16["graph_us"] / r["graph_us"] if has_graph else None
        sd = [by[(key[0], f"sdpa-{m}", *key[1:])]["time_us"] for m in args.sdpa
              if (key[0], f"sdpa-{m}", *key[1:]) in by]
        r["speedup_vs_sdpa"] = min(sd) / r["time_us"] if sd else None  # vs the faster SDPA variant
        # What the targets judge: the slowest CUDA-graph timing where there are graphs, else do_bench's.
        r["judged_us"] = r["graph_worst_us"] if graphs else r["time_us"]


def share_of_bandwidth(rows: list[dict], bandwidth: float) -> None:
    """Each row's share of `bandwidth` (bytes/s), by do_bench's time and by the judged one."""
    for r in rows:
        r["frac_bw"] = r["bytes"] / (r["time_us"] * 1e-6) / bandwidth
        r["judged_frac_bw"] = r["bytes"] / (r["judged_us"] * 1e-6) / bandwidth


def floor_of(rows: list[dict], probe: dict | None, graphs: bool) -> dict | None:
    """The floor fitted to the fastest SDPA variant per (head layout, batch, seq); the probe rides along."""
    best: dict = {}
    for r in rows:
        if r["precision"].startswith("sdpa-"):
            k = (r["heads"], r["batch"], r["seq"])
            t = r["graph_us"] if graphs else r["time_us"]
            if k not in best or t < best[k][1]:
                best[k] = (r["bytes"], t)
    points = list(best.values())
    if len(points) < 2:
        return None
    fit = fit_floor(points)
    fit["probe"] = probe
    return fit


def compressed(precision: str) -> bool:
    """Whether a row's precision is one the targets judge: every page precision but fp16, no SDPA baseline."""
    return precision != "fp16" and not precision.startswith("sdpa-")


def verdict(rows: list[dict], floor: dict | None, args) -> dict:
    """The targets (module doc) on every compressed row; each lists its failing (heads, precision, B, S)."""
    comp = [r for r in rows if compressed(r["precision"])]
    out: dict = {}
    if floor is not None:
        for r in rows:
            r["floor_us"] = floor["t0_us"] + r["bytes"] / floor["bw"] * 1e6
            r["of_floor"] = r["floor_us"] / r["judged_us"]
        sel = [r for r in comp if r["batch"] * r["seq"] >= TARGET_MIN_TOKENS]
        fails = [r for r in sel if r["of_floor"] < TARGET_OF_FLOOR]
        out["of_floor"] = {"target": TARGET_OF_FLOOR, "min_tokens": TARGET_MIN_TOKENS, "rows": len(sel),
                           "min": min((r["of_floor"] for r in sel), default=None),
                           "pass": (not fails) if sel else None,
                           "failing": [[r["heads"], r["precision"], r["batch"], r["seq"], round(r["of_floor"], 3)]
                                       for r in fails]}
    sel = [r for r in comp if r["bytes"] >= TARGET_BIG_READ]
    fails = [r for r in sel if r["judged_frac_bw"] < TARGET_BIG_FRAC]
    out["big_reads"] = {"target": TARGET_BIG_FRAC, "bandwidth": args.bandwidth, "min_bytes": TARGET_BIG_READ,
                        "rows": len(sel), "min": min((r["judged_frac_bw"] for r in sel), default=None),
                        "pass": (not fails) if sel else None,
                        "failing": [[r["heads"], r["precision"], r["batch"], r["seq"], round(r["judged_frac_bw"], 3)]
                                    for r in fails]}
    return out


def print_tables(rows: list[dict], args, floor: dict | None) -> None:
    def fmt_x(x):
        return f"{x:.2f}x" if x is not None else "-"

    hdr = (f"{'heads':>12} {'precision':>10} {'batch':>5} {'seq':>6} {'MB read':>9} {'time us':>9} {'graph us':>9} "
           f"{'GB/s':>7} {'% ' + f'{args.bandwidth / 1e12:.1f}TB/s':>10} {'of floor':>8} {'vs fp16':>8} "
           f"{'vs SDPA':>8}")
    print("\n" + hdr)
    print("-" * len(hdr))
    for r in rows:
        g = f"{r['graph_us']:.1f}" if r["graph_us"] else "-"
        fl = f"{r['of_floor']:.2f}" if "of_floor" in r else "-"
        print(f"{r['heads']:>12} {r['precision']:>10} {r['batch']:>5} {r['seq']:>6} {r['bytes'] / 1e6:>9.2f} "
              f"{r['time_us']:>9.1f} {g:>9} {r['gb_s']:>7.0f} {100 * r['frac_bw']:>9.1f}% {fl:>8} "
              f"{fmt_x(r['speedup_vs_fp16']):>8} {fmt_x(r['speedup_vs_sdpa']):>8}")
    if floor is None:
        return
    print(f"\nfloor: t0 {floor['t0_us']:.2f} us + bytes / {floor['bw'] / 1e12:.3f} TB/s (fitted to SDPA, "
          f"{floor['points']} points, largest residual {100 * floor['max_rel_residual']:.1f}%)")
    shapes = sorted({(r["batch"], r["seq"]) for r in rows})
    for heads in dict.fromkeys(r["heads"] for r in rows):
        cells = {(r["precision"], r["batch"], r["seq"]): r for r in rows if r["heads"] == heads}
        print(f"\n{heads}: speed as a fraction of the floor (slowest timing; * below {TARGET_OF_FLOOR} where "
              f"batch x seq >= {TARGET_MIN_TOKENS})")
        print(f"{'precision':>10} " + " ".join(f"{f'B{b} S{s}':>12}" for b, s in shapes))
        for prec in dict.fromkeys(r["precision"] for r in rows if r["heads"] == heads):
            line = []
            for b, s in shapes:
                r = cells.get((prec, b, s))
                if r is None:
                    line.append(f"{'-':>12}")
                    continue
                judged = compressed(prec) and b * s >= TARGET_MIN_TOKENS
                mark = "*" if judged and r["of_floor"] < TARGET_OF_FLOOR else " "
                line.append(f"{r['of_floor']:>11.2f}{mark}")
            print(f"{prec:>10} " + " ".join(line))


def judge(rows: list[dict], args, probe: dict | None) -> tuple[dict | None, dict]:
    """Derived columns, the floor and the verdict of timed rows; prints the tables and the verdict."""
    graphs = bool(rows) and all(r["graph_runs_us"] for r in rows)
    derive(rows, args, graphs)
    floor = floor_of(rows, probe, graphs)
    if args.bandwidth == "floor":
        if floor is None:
            raise SystemExit("--bandwidth floor: no floor was fitted (it needs SDPA rows timed on a GPU)")
        args.bandwidth = floor["bw"]
    share_of_bandwidth(rows, args.bandwidth)
    targets = verdict(rows, floor, args)
    targets["timing"] = f"CUDA-graph, slowest of {args.repeats}" if graphs else "do_bench"
    print_tables(rows, args, floor)

    def word(v):
        return {True: "PASS", False: "FAIL", None: "(no rows at these shapes)"}[v["pass"]]

    print(f"\nverdict ({targets['timing']} times; bytes = K/V data + scale/zero + q + out):")
    if "of_floor" in targets:
        v = targets["of_floor"]
        low = "-" if v["min"] is None else f"{v['min']:.3f}"
        print(f"  every compressed precision >= {TARGET_OF_FLOOR} of its floor at batch x seq >= "
              f"{TARGET_MIN_TOKENS}: min {low} over {v['rows']} rows  {word(v)}"
              + (f"  (below: {v['failing']})" if v["failing"] else ""))
    v = targets["big_reads"]
    low = "-" if v["min"] is None else f"{100 * v['min']:.1f}%"
    print(f"  every compressed precision >= {100 * TARGET_BIG_FRAC:.0f}% of {args.bandwidth / 1e12:.1f} TB/s where a "
          f"call reads >= {TARGET_BIG_READ / 1e6:.0f} MB: min {low} over {v['rows']} rows  {word(v)}"
          + (f"  (below: {v['failing']})" if v["failing"] else ""))
    return floor, targets


def gpu_state_summary(rows: list[dict]) -> dict | None:
    """Per precision: the median SM clock over its rows' timings and the share of samples at the power cap
    (rows timed on a GPU with nvidia-smi only); printed and recorded beside the floor."""
    by: dict[str, list[dict]] = {}
    for r in rows:
        if r.get("gpu"):
            by.setdefault(r["precision"], []).append(r["gpu"])
    if not by:
        return None
    out = {}
    for prec, states in by.items():
        n = sum(s["samples"] for s in states)
        out[prec] = {"sm_mhz": statistics.median(s["sm_mhz"] for s in states),
                     "sm_mhz_min": min(s["sm_mhz_min"] for s in states),
                     "power_w_max": max(s["power_w_max"] for s in states),
                     "power_limit_w": states[-1]["power_limit_w"],
                     "power_capped": sum(s["power_capped"] * s["samples"] for s in states) / n}
    print("\nGPU while timing (nvidia-smi): " + "; ".join(
        f"{p} {v['sm_mhz']:.0f} MHz, {100 * v['power_capped']:.0f}% at the {v['power_limit_w']:.0f} W cap"
        for p, v in out.items()))
    return out


def rejudge(args) -> int:
    """--from-json: the floor, tables and verdict of a recorded run, from its rows' timings."""
    path = Path(args.from_json)
    result = json.loads(path.read_text())
    args.repeats = result["config"].get("repeats", 1)
    if args.bandwidth is None:
        args.bandwidth = result["config"]["bandwidth"]
    args.sdpa = result["config"]["sdpa"]
    probe = (result.get("floor") or {}).get("probe")
    result["floor"], result["targets"] = judge(result["rows"], args, probe)
    result["config"]["bandwidth"] = args.bandwidth
    out = Path(args.out) if args.out else path
    out.write_text(json.dumps(result, indent=1) + "\n")
    print(f"wrote {out}")
    return 0


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    args = parse_args(argv)
    if args.from_json:
        return rejudge(args)
    device = torch.device(args.device)
    cuda = device.type == "cuda"
    impl = args.impl if args.impl != "auto" else ("triton" if cuda else "ref")
    gpu = torch.cuda.get_device_name(device) if cuda else (platform.processor() or "cpu")
    try:
        import triton
        triton_version = triton.__version__
    except ImportError:  # pragma: no cover
        triton_version = None
    command = " ".join(["python", "benchmarks/attention.py", *argv])
    print(f"device {gpu} | torch {torch.__version__} | triton {triton_version} | impl {impl} | heads "
          + ", ".join(f"{n} ({hq}/{hkv}, D {d})" for n, (hq, hkv, d) in args.head_layouts) + " | fp16 cache")

    rows, skipped, checks = [], [], []
    with PowerMonitor(gpu=device.index or 0) if cuda else contextlib.nullcontext() as power:
        for heads in args.head_layouts:
            page_bytes = page_bytes_for(args.block_size, heads[1][2], 2)
            print(f"correctness ({heads[0]}, small shape, B={args.check_shape[0]} S={args.check_shape[1]}):")
            try:
                checks += check_small(args, heads, device, impl, page_bytes)
                r, sk = measure_heads(args, heads, device, impl, cuda, power)
            except Mismatch as e:
                print(f"\n!!! CORRECTNESS MISMATCH: {e}\n!!! aborting", file=sys.stderr)
                return 2
            rows += r
            skipped += sk
    floor, targets = judge(rows, args, floor_probe(args, device, cuda))
    gpu_states = gpu_state_summary(rows)
    if skipped:
        print(f"skipped: {len(skipped)} (see JSON)")

    result = {"benchmark": "attention", "device": gpu, "torch": torch.__version__, "triton": triton_version,
              "cuda": torch.version.cuda, "impl": impl, "command": command,
              "config": {"heads": {n: {"hq": hq, "hkv": hkv, "head_dim": d} for n, (hq, hkv, d) in args.head_layouts},
                         "cache_dtype": "float16", "block_size": args.block_size, "batches": args.batches,
                         "seqs": args.seqs, "precisions": {p: PRECISIONS.get(p, p) for p in args.precisions},
                         "sdpa": args.sdpa, "warmup_ms": args.warmup, "rep_ms": args.rep,
                         "graph_rep_ms": args.graph_rep, "repeats": args.repeats, "graph": cuda and not args.no_graph,
                         "bandwidth": args.bandwidth, "l2_bytes": int(args.l2_bytes) if cuda else 0},
              "bytes_counted": "per token and KV head: K data + V data (D*2 B at 16 bits, D*bits/8 packed) + fp16 "
                               "scale/zero (4 B) per quantized side; plus q and output (fp16) once. Excluded: page "
                               "table, score/position segments, page padding, split-K partials.",
              "timing": "time_us: triton.testing.do_bench median (L2 flushed per call); graph_runs_us: "
                        "do_bench_cudagraph medians (back-to-back calls in a CUDA graph), --repeats of them; both "
                        "rotate among `copies` copies of the cache when it is within 2x L2. CPU (smoke): "
                        "perf_counter median.",
              "floor": floor, "gpu_state": gpu_states, "checks": checks, "targets": targets, "rows": rows,
              "skipped": skipped}
    write_result(result, "attention", gpu, args.out, args.smoke)
    return 0


if __name__ == "__main__":
    sys.exit(main())
