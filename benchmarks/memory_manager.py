"""Memory-management time per step of the DiffKV cache (paper §5, "parallel KV compaction"), on the GPU and
with the same batched plan on the CPU, for a Llama-3-8B shape (32 layers x 8 KV heads), sequence 1024.

  prompt step:      reserve the all-high worst case, fit each layer's plan, finish (recycle unused pages)
  generation step:  Algorithm 1 for every (sequence, layer, head), page growth, token moves, append slots

With --engine, also full decode steps of a random-weight Llama-3-8B engine in diffkv mode at each of
--engine-batches, so the memory-management share of a step is measured side by side. One engine serves every
engine batch (one model build, one set of kernel compilations), with a pool sized for the largest batch's
all-high worst case (not 85% of the GPU, which would depend on what the isolated rows left cached). Each phase
prints as it ends (the prefill, the first decode step: graph capture and compilation, the timed steps), and
--time-limit skips the rows and steps that would not fit, still writing the JSON.

Usage (GPU): python benchmarks/memory_manager.py --batches 64 128 --cpu-batches 64 --engine --time-limit 540
Smoke (CPU): python benchmarks/memory_manager.py --smoke
"""
from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

START = time.perf_counter()  # --time-limit counts from here

import torch  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from _results import write_result  # noqa: E402
from diffkv_serve.engine.config import GRAPH_BATCH_CAP, CacheConfig  # noqa: E402
from diffkv_serve.engine.kv.layout import CacheShape  # noqa: E402
from diffkv_serve.engine.kv.policy import KVCache  # noqa: E402
from diffkv_serve.engine.kv.request_settings import KVRequestSettings  # noqa: E402
from diffkv_serve.engine.kv.reservation import worst_case_pages  # noqa: E402
from diffkv_serve.kernels.page_layout import PageFormat, page_bytes_for  # noqa: E402


def progress(msg: str) -> None:
    print(f"[{time.perf_counter() - START:6.1f} s] {msg}", flush=True)


def sync(dev: torch.device) -> None:
    if dev.type == "cuda":
        torch.cuda.synchronize(dev)


def build(B: int, L: int, H: int, D: int, seq: int, dev: torch.device, window: int) -> KVCache:
    cfg = CacheConfig(kv_mode="diffkv", block_size=16, window=window)
    shape = CacheShape(L, H, D, B, seq + 256, 16)
    per_seq = L * H * (-(-(seq + 256) // 16) + 1)
    return KVCache(cfg, shape, B * per_seq + 64, torch.float16, dev, 4 * H)


def prompt_step(kv: KVCache, slots: torch.Tensor, seq: int, n_high: torch.Tensor, n_low: torch.Tensor) -> None:
    mm = kv.mm
    mm.reserve(slots, torch.full_like(slots, seq), -(-seq // mm.fmt_high.tokens))
    for layer in range(mm.shape.num_layers):
        mm.fit_prompt_plan(slots, layer, n_high[:, layer], n_low[:, layer])
    mm.finish_prompt(slots, n_high, n_low)


def fill_sections(kv: KVCache, slots: torch.Tensor, seq: int, g: torch.Generator) -> None:
    """Positions and scores for every kept token: the newest n_high positions in the high section (the
    window among them), older ones in the low section; scores random. K/V bytes are left as they are:
    the memory manager never reads them."""
    mm = kv.mm
    for side, fmt, lens in (("high", mm.fmt_high, mm.len_high), ("low", mm.fmt_low, mm.len_low)):
        n = lens[slots]  # [B, L, H]
        m = int(n.max())
        if m == 0:
            continue
        j = torch.arange(m, device=mm.device)
        idx = torch.where(j < n.unsqueeze(-1), j, torch.full_like(j, -1))
        B, L, H = n.shape
        flat_slots = slots.repeat_interleave(L * H * m)
        layers = torch.arange(L, device=mm.device).repeat_interleave(H * m).repeat(B)
        heads = torch.arange(H, device=mm.device).repeat_interleave(m).repeat(B * L)
        T = fmt.tokens
        col = (idx.clamp_min(0) // T).flatten()
        if side == "low":
            col = mm.max_pages - 1 - col
        page = mm.page_table[flat_slots, layers, heads, col]
        ok = idx.flatten() >= 0
        page, row = page[ok].long(), (idx.flatten() % T)[ok].long()
        if side == "high":
            pos = (seq - mm.len_high[slots].unsqueeze(-1) + j).flatten()[ok]
        else:
            pos = j.expand(B, L, H, m).flatten()[ok]
        pool_i32, pool_f32 = mm.pool.view(torch.int32), mm.pool.view(torch.float32)
        pool_i32[page, fmt.pos_off // 4 + row] = pos.int()
        pool_f32[page, fmt.score_off // 4 + row] = torch.rand(page.shape, generator=g, device="cpu").to(mm.device)


def bench(B: int, dev: torch.device, seq: int, steps: int, L: int = 32, H: int = 8, D: int = 128) -> dict:
    g = torch.Generator().manual_seed(B)
    window = 64
    kv = build(B, L, H, D, seq, dev, window)
    mm = kv.mm
    slots = torch.tensor([mm.alloc_slot() for _ in range(B)], dtype=torch.int32, device=dev)
    # Random per-head plans: the window and a random share of the rest high, a random share low.
    n_high = (window + torch.rand(B, L, H, generator=g) * (seq - window) * 0.5).int()
    n_low = (torch.rand(B, L, H, generator=g) * (seq - n_high)).int()
    n_high, n_low = n_high.to(dev), n_low.to(dev)
    prompt_s = []
    for _ in range(3):
        sync(dev)
        t0 = time.perf_counter()
        prompt_step(kv, slots, seq, n_high, n_low)
        sync(dev)
        prompt_s.append(time.perf_counter() - t0)
        mm.free(slots.tolist())
        for s in slots.tolist():
            mm.alloc_slot()
    prompt_step(kv, slots, seq, n_high, n_low)
    fill_sections(kv, slots, seq, g)
    kv.write_slot_settings(slots, [KVRequestSettings(1.0, 0.02, "both")] * B, [seq] * B)
    gen_s = []
    n = seq
    for _ in range(steps):
        sync(dev)
        t0 = time.perf_counter()
        kv.prepare_decode(slots, torch.full((B,), n + 1, dtype=torch.int32, device=dev))
        sync(dev)
        gen_s.append(time.perf_counter() - t0)
        n += 1
    mm.check_invariants(slots.tolist())
    med = lambda xs: sorted(xs)[len(xs) // 2]  # noqa: E731
    return {"device": dev.type, "batch": B, "seq": seq, "prompt_mm_ms": 1e3 * med(prompt_s),
            "gen_mm_ms": 1e3 * med(gen_s[1:] or gen_s)}


def engine_pool_gb(arch, batch: int, tokens: int, itemsize: int = 2) -> float:
    """A pool that admits `batch` sequences of `tokens` all-high: counted at 16 bits, which no diffkv high
    precision exceeds, plus the prompt's extra page per head."""
    page_bytes = page_bytes_for(16, arch.head_dim, itemsize)
    per_token = PageFormat.make(16, 16, arch.head_dim, page_bytes, itemsize).tokens
    pages = batch * worst_case_pages(arch.num_layers * arch.num_kv_heads, per_token, 1, tokens) + 64
    return pages * page_bytes / 2**30


def engine_steps(batches: list[int], seq: int, steps: int, deadline: float, preset: str = "llama3-8b",
                 device: str = "auto") -> list[dict]:
    """Full diffkv decode steps of a random-weight model at each batch, and their memory-management time."""
    from diffkv_serve.engine import EngineConfig, SamplingParams
    from diffkv_serve.engine.llm_engine import LLMEngine
    from diffkv_serve.engine.loader import load_checkpoint
    from diffkv_serve.engine.model_runner import resolve_device, resolve_dtype

    if time.perf_counter() > deadline:  # no model build for nothing
        progress(f"engine batches {batches}: skipped, --time-limit reached")
        return [{"batch": B, "seq": seq, "skipped": "time limit"} for B in batches]
    ckpt = load_checkpoint(f"random:{preset}")
    itemsize = torch.tensor([], dtype=resolve_dtype("auto", resolve_device(device))).element_size()
    new_tokens = 3 + steps + 8  # warm-up steps, timed steps, and room so no sequence finishes while timed
    max_len = seq + new_tokens + 16
    B_max = max(batches)
    pool_gb = engine_pool_gb(ckpt.arch, B_max, max_len, itemsize)
    eng = LLMEngine(EngineConfig(device=device, max_model_len=max_len, max_graph_batch_size=min(B_max, GRAPH_BATCH_CAP),
                                 cache={"kv_mode": "diffkv", "kv_cache_memory_gb": pool_gb},
                                 scheduler={"max_num_seqs": B_max, "max_num_batched_tokens": 16384}),
                    checkpoint=ckpt)
    progress(f"engine: random {preset}, diffkv, pool {eng.mm.num_pages} pages ({pool_gb:.1f} GiB), built")
    g = torch.Generator().manual_seed(0)
    rows = []
    for B in batches:
        if time.perf_counter() > deadline:
            progress(f"engine batch {B}: skipped, --time-limit reached")
            rows.append({"batch": B, "seq": seq, "skipped": "time limit"})
            continue
        sp = SamplingParams(temperature=0, max_tokens=new_tokens, ignore_eos=True)
        for i in range(B):
            eng.add_request(f"b{B}-{i}", torch.randint(0, ckpt.arch.vocab_size, (seq,), generator=g).tolist(), sp)
        t0 = time.perf_counter()
        while eng.scheduler.waiting or any(not s.output_token_ids for s in eng.scheduler.running):
            eng.step()
        t1 = time.perf_counter()
        progress(f"engine batch {B}: prefill of {B} x {seq} tokens in {t1 - t0:.1f} s")
        eng.step()  # the first decode step of this batch size captures its CUDA graph (and compiles)
        t2 = time.perf_counter()
        for _ in range(2):
            eng.step()
        progress(f"engine batch {B}: first decode step (graph capture) {t2 - t1:.1f} s; timing {steps} steps")
        step_s, mm_s = [], []
        for _ in range(steps):
            if time.perf_counter() > deadline:
                break
            t = time.perf_counter()
            eng.step()
            step_s.append(time.perf_counter() - t)
            mm_s.append(eng.runner.kv.mm_seconds())
        for rid in list(eng.requests):
            eng.abort(rid)
        while eng.has_unfinished_requests():
            eng.step()
        if not step_s:
            rows.append({"batch": B, "seq": seq, "skipped": "time limit"})
            continue
        med = lambda xs: sorted(xs)[len(xs) // 2]  # noqa: E731
        rows.append({"batch": B, "seq": seq, "decode_step_ms": 1e3 * med(step_s), "engine_mm_ms": 1e3 * med(mm_s),
                     "steps": len(step_s), "prefill_s": t1 - t0, "first_decode_s": t2 - t1})
        progress(f"engine batch {B}: decode step {rows[-1]['decode_step_ms']:.2f} ms, memory management "
                 f"{rows[-1]['engine_mm_ms']:.3f} ms (median of {len(step_s)})")
    eng.shutdown()
    return rows


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--batches", type=int, nargs="+", default=[1, 8, 32, 64, 128, 256])
    ap.add_argument("--cpu-batches", type=int, nargs="*", default=None, help="default: same as --batches")
    ap.add_argument("--seq", type=int, default=1024)
    ap.add_argument("--steps", type=int, default=10)
    ap.add_argument("--engine", action="store_true", help="also time full diffkv decode steps of Llama-3-8B")
    ap.add_argument("--engine-batches", type=int, nargs="+", default=[64, 128])
    ap.add_argument("--engine-seq", type=int, default=None, help="engine prompt length (default: --seq)")
    ap.add_argument("--time-limit", type=float, default=540.0,
                    help="seconds from the start after which no row starts and timing stops (the JSON is still written)")
    ap.add_argument("--out", default=None)
    ap.add_argument("--smoke", action="store_true")
    args = ap.parse_args(argv)
    for name in ("batches", "cpu_batches", "engine_batches"):
        bad = [b for b in getattr(args, name) or () if b < 1]
        if bad:
            ap.error(f"--{name.replace('_', '-')} {bad}: batches must be at least 1")
    for name in ("seq", "steps", "engine_seq", "time_limit"):
        v = getattr(args, name)
        if v is not None and v <= 0:
            ap.error(f"--{name.replace('_', '-')} {v}: must be > 0")
    deadline = START + args.time_limit
    cuda = torch.cuda.is_available() and not args.smoke
    rows, skipped = [], []

    def row(B: int, dev: str, *shape) -> None:
        if time.perf_counter() > deadline:
            skipped.append({"device": dev, "batch": B})
            progress(f"{dev} batch {B}: skipped, --time-limit reached")
            return
        rows.append(bench(B, torch.device(dev), *shape))
        r = rows[-1]
        progress(f"{dev} batch {B}: prompt MM {r['prompt_mm_ms']:.3f} ms, generation MM {r['gen_mm_ms']:.3f} ms")

    if args.smoke:
        for B in (1, 2):
            row(B, "cpu", 96, 3, 2, 2, 64)
    else:
        for B in args.batches:
            if cuda:
                row(B, "cuda", args.seq, args.steps)
        if cuda:
            torch.cuda.empty_cache()  # the isolated pools go back before the engine takes its own
        for B in args.batches if args.cpu_batches is None else args.cpu_batches:
            row(B, "cpu", args.seq, max(3, args.steps // 3))
    print(f"{'device':>6} {'batch':>6} {'prompt MM ms':>13} {'gen MM ms':>10}")
    for r in rows:
        print(f"{r['device']:>6} {r['batch']:>6} {r['prompt_mm_ms']:>13.3f} {r['gen_mm_ms']:>10.3f}")
    speed = {}
    for r in rows:
        if r["device"] == "cuda":
            cpu = next((c for c in rows if c["device"] == "cpu" and c["batch"] == r["batch"]), None)
            if cpu:
                speed[r["batch"]] = {"prompt": cpu["prompt_mm_ms"] / r["prompt_mm_ms"],
                                     "gen": cpu["gen_mm_ms"] / r["gen_mm_ms"]}
    for b, sp in speed.items():
        print(f"batch {b}: GPU is {sp['prompt']:.1f}x (prompt) / {sp['gen']:.1f}x (generation) faster than CPU")
    eng_rows = []
    if args.engine and (cuda or args.smoke):
        eng_rows = (engine_steps([2, 3], 24, 3, deadline, "tiny", "cpu") if args.smoke else
                    engine_steps(args.engine_batches, args.engine_seq or args.seq, args.steps, deadline))
    for r in eng_rows:
        if "skipped" in r:
            continue
        mm = next((x for x in rows if x["device"] == ("cpu" if args.smoke else "cuda") and x["batch"] == r["batch"]),
                  None)
        r["mm_share_engine"] = r["engine_mm_ms"] / r["decode_step_ms"]
        if mm:
            r["mm_share_isolated"] = mm["gen_mm_ms"] / r["decode_step_ms"]
        print(f"engine batch {r['batch']}: decode step {r['decode_step_ms']:.2f} ms, memory management "
              f"{r['engine_mm_ms']:.3f} ms in the engine ({100 * r['mm_share_engine']:.2f}% of the step)")
    gpu = torch.cuda.get_device_name() if cuda else "cpu"
    result = {"benchmark": "memory_manager", "device": gpu, "torch": torch.__version__,
              "command": " ".join(["python", "benchmarks/memory_manager.py", *(argv or sys.argv[1:])]),
              "rows": rows, "speedup_gpu_vs_cpu": speed, "engine": eng_rows, "skipped": skipped,
              "seconds_total": time.perf_counter() - START}
    write_result(result, "memory_manager", gpu, args.out, args.smoke)
    return 0


if __name__ == "__main__":
    sys.exit(main())
