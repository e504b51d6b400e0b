"""Checks decode attention on caches of any precision (high section + optional low section): the Triton path
and the torch reference, outputs, per-token logits and lse, against float64 loops over the dequantized cache."""
from __future__ import annotations

import math
import os

import torch

from diffkv_serve.kernels.decode_attention import launch_config, mma_cuda, paged_decode_attention, paged_decode_attention_triton
from diffkv_serve.kernels.decode_attention.tiles import LOG2E
from diffkv_serve.kernels.quant import dequantize_fp8_ref, dequantize_ref

from _paged_cache import build_cache, formats

DEVICE = os.environ.get("DIFFKV_TEST_DEVICE", "cpu")
DTYPES = [torch.float32] + ([torch.float16, torch.bfloat16] if DEVICE.startswith("cuda") else [])

# Quantized pages (dequantized in fp32 by the kernel and the reference alike), outputs, logits and lse:
QTOL = {torch.float32: 1e-4, torch.float16: 4e-3, torch.bfloat16: 2e-2}  # atol and rtol alike
NMAX_PAD = 5  # logits_out columns past the longest head (must stay untouched)


def _token_kv(pool, fmt, cache_dtype, p, r):
    """Keys, values float64 [D] of one page row, decoded by plain slicing + dequantize_ref (dequantize_fp8_ref for
    e4m3 sides)."""
    D = fmt.head_dim
    out = []
    sides = (("k", fmt.key_bits, fmt.k_off, fmt.k_meta_off), ("v", fmt.value_bits, fmt.v_off, fmt.v_meta_off))
    for which, bits, off, moff in sides:
        if bits == 16:
            w = D * fmt.full_itemsize
            out.append(pool[p, off + r * w: off + (r + 1) * w].view(cache_dtype).double())
            continue
        w = D * bits // 8
        meta = pool[p, moff + 4 * r: moff + 4 * r + 4].view(torch.float16)
        codes = pool[p, off + r * w: off + (r + 1) * w]
        if fmt.side_float8(which):  # e4m3 codes x scale
            out.append(dequantize_fp8_ref(codes, meta[0]).double())
        else:
            out.append(dequantize_ref(codes, meta[0], meta[1], bits, D).double())
    return out


def _key_zero(pool, fmt, p, r) -> float:
    """The zero point of one page row's integer keys (0 for e4m3 or fp16 keys)."""
    if fmt.key_bits == 16 or fmt.side_float8("k"):
        return 0.0
    return float(pool[p, fmt.k_meta_off + 4 * r: fmt.k_meta_off + 4 * r + 4].view(torch.float16)[1])


def naive_sections(q, pool, fmt_hi, fmt_lo, cache_dtype, page_table, len_hi, len_lo, slots, layer, scale,
                   q_levels=None):
    """float64 loops: output [B, Hq, D], logits {(b, hq, idx): value}, lse [B, Hq]. q_levels (fmt -> levels or
    None, e.g. mma_cuda.query_levels): a section's keys meet q rounded as the CUDA kernel's integer q.k rounds it
    (mma_cuda.round_query), in their scaled codes (key - zero point) and, where mma_cuda.zero_term_rounded says
    so, in the zero point's term too (else that term takes q as given)."""
    pool, page_table, q = pool.cpu(), page_table.cpu(), q.double().cpu()
    B, Hq, D = q.shape
    Hkv = page_table.shape[2]
    G = Hq // Hkv
    P = page_table.shape[3] - 1
    out = torch.zeros(B, Hq, D, dtype=torch.float64)
    lse = torch.full((B, Hq), float("-inf"), dtype=torch.float64)
    logits = {}
    for b in range(B):
        s = int(slots[b])
        for h in range(Hkv):
            rows = []
            n_hi = int(len_hi[s, layer, h])
            rows += [(fmt_hi, int(page_table[s, layer, h, j // fmt_hi.tokens]), j % fmt_hi.tokens) for j in range(n_hi)]
            if fmt_lo is not None:
                T = fmt_lo.tokens
                rows += [(fmt_lo, int(page_table[s, layer, h, P - 1 - j // T]), j % T)
                         for j in range(int(len_lo[s, layer, h]))]
            if not rows:
                continue
            kv = [_token_kv(pool, f, cache_dtype, p, r) for f, p, r in rows]
            keys = torch.stack([k for k, _ in kv])
            vals = torch.stack([v for _, v in kv])
            levels = [q_levels(f) if q_levels else None for f, _, _ in rows]
            rounded = {lv: torch.tensor([v == lv for v in levels]) for lv in set(levels) - {None}}  # rows per level
            zeros = torch.tensor([_key_zero(pool, f, p, r) for f, p, r in rows], dtype=torch.float64)
            for hq in range(h * G, (h + 1) * G):
                x = keys @ q[b, hq]
                for lv, m in rounded.items():
                    qr = mma_cuda.round_query(q[b, hq], lv, scale * LOG2E)
                    if mma_cuda.zero_term_rounded(lv):  # the key as dequantized, times q as rounded
                        x[m] = keys[m] @ qr
                    else:
                        x[m] = (keys[m] - zeros[m, None]) @ qr + zeros[m] * q[b, hq].sum()
                x = x * scale
                lse[b, hq] = torch.logsumexp(x, 0)
                out[b, hq] = torch.softmax(x, 0) @ vals
                for i in range(len(rows)):
                    logits[(b, hq, i)] = float(x[i])  # idx: j for high, n_hi + j for low
    return out, logits, lse


def run_sections(spec, dtype, Hq, Hkv, D, lens_hi, lens_lo, slots, num_splits, layer, seed, block_n=None,
                 max_len=None, red=None, min_rows=None, key_pairs=None):
    isz = torch.empty((), dtype=dtype).element_size()
    fmt_hi, fmt_lo = formats(spec, D, isz)
    pool, page_table, len_hi, len_lo, _ = build_cache(fmt_hi, fmt_lo, dtype, Hkv, lens_hi, lens_lo, DEVICE, seed)
    slots = torch.tensor(slots, dtype=torch.int32, device=DEVICE)
    B = len(slots)
    q = torch.randn(B, Hq, D, device=DEVICE).to(dtype)
    scale = 1 / math.sqrt(D)
    total = len_hi + (len_lo if len_lo is not None else 0)
    nmax = int(total.max()) + NMAX_PAD
    args = (q, pool, fmt_hi, dtype, page_table, len_hi, slots, layer, scale)
    kw = dict(fmt_low=fmt_lo, len_low=len_lo, max_len=max_len)
    over = {k: v for k, v in dict(red=red, min_rows=min_rows, key_pairs=key_pairs).items() if v is not None}
    # launch-parameter overrides are the quartered kernel's: force it where the CUDA kernel would be picked
    tkw = dict(config=launch_config(fmt_hi, fmt_lo)._replace(**over), kernel="quartered") if over else {}
    res = {}
    for impl in ("triton", "ref"):
        out = torch.full_like(q, float("nan"))  # poison: every (batch, head) row must be written
        logits = torch.full((B, Hq, nmax), float("nan"), device=DEVICE)
        lse = torch.full((B, Hq), float("nan"), device=DEVICE)
        if impl == "triton":
            paged_decode_attention_triton(*args, num_splits=num_splits, block_n=block_n, out=out,
                                          logits_out=logits, lse_out=lse, **kw, **tkw)
        else:
            paged_decode_attention(*args, num_splits=num_splits, impl=impl, out=out, logits_out=logits,
                                   lse_out=lse, **kw)
        assert not out.isnan().any() and not lse.isnan().any()
        res[impl] = (out, logits, lse)
    # Plain call (no logits/lse) gives the same output, up to the compiler contracting the scale/zero
    # fold into FMAs differently when the logits are also stored (fp32 rounding, ~1e-7 relative); where the
    # CUDA kernel serves the call (mma_cuda.py: tensor-core dots in fp16), it is held to the tolerance below instead.
    plain = paged_decode_attention_triton(*args, num_splits=num_splits, block_n=block_n, **kw, **tkw)
    plain_cuda = mma_cuda.usable(fmt_hi, fmt_lo, q, Hq // Hkv) is None
    if not plain_cuda:
        torch.testing.assert_close(plain, res["triton"][0], atol=1e-6, rtol=1e-5)
    # Unforced calls the CUDA kernel can serve are its own: its integer q.k rounds q (mma_cuda.query_levels), so
    # they are held to float64 loops over that q, the torch reference to loops over q as given.
    cuda_serves = plain_cuda and not tkw
    tol = QTOL[dtype]
    want = {}
    for rounded in {False, cuda_serves}:
        n_out, n_logits, n_lse = naive_sections(q, pool, fmt_hi, fmt_lo, dtype, page_table, len_hi, len_lo,
                                                slots.cpu(), layer, scale,
                                                q_levels=mma_cuda.query_levels if rounded else None)
        expect_logits = torch.full((B, Hq, nmax), float("nan"), dtype=torch.float64)
        for (b, hq, i), x in n_logits.items():
            expect_logits[b, hq, i] = x
        want[rounded] = (n_out, expect_logits, n_lse)
    if plain_cuda:
        torch.testing.assert_close(plain.double().cpu(), want[cuda_serves][0], atol=tol, rtol=tol)
    for impl, (out, logits, lse) in res.items():
        n_out, expect_logits, n_lse = want[cuda_serves and impl == "triton"]
        torch.testing.assert_close(out.double().cpu(), n_out, atol=tol, rtol=tol)
        torch.testing.assert_close(lse.double().cpu(), n_lse, atol=tol, rtol=tol)  # -inf where no token
        torch.testing.assert_close(logits.double().cpu(), expect_logits, atol=tol, rtol=tol, equal_nan=True)
    if not cuda_serves:
        torch.testing.assert_close(res["triton"][0].double().cpu(), res["ref"][0].double().cpu(), atol=tol,
                                   rtol=tol)
    return res, total[slots.long(), layer]
