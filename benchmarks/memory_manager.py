"""Memory-management time per step of the DiffKV cache (paper §5, "parallel KV compaction"), on the GPU and
with the same batched plan on the CPU, for a Llama-3-8B shape (32 layers x 8 KV heads), sequence 1024.

  prompt step:      reserve the all-high worst case, fit each layer's plan, finish (recycle unused pages)
  generation step:  Algorithm 1 for every (sequence, layer, head), page growth, token moves, append slots

With --engine, also a full decode step of a random-weight Llama-3-8B engine in diffkv mode at the same
batch, so the memory-management share of a step is measured side by side.

Usage (GPU): python benchmarks/memory_manager.py --batches 1 8 32 64 128 256 --engine
Smoke (CPU): python benchmarks/memory_manager.py --smoke
"""
from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from _results import write_result  # noqa: E402
from engine.config import CacheConfig  # noqa: E402
from engine.kv_cache import KVCache  # noqa: E402
from engine.memory import CacheShape  # noqa: E402


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
    prompt_len = torch.full((B,), seq, dtype=torch.int32, device=dev)
    ah = torch.full((B,), 1.0, device=dev)
    al = torch.full((B,), 0.02, device=dev)
    gen_s = []
    n = seq
    for _ in range(steps):
        sync(dev)
        t0 = time.perf_counter()
        kv.prepare_decode(slots, torch.full((B,), n + 1, dtype=torch.int32, device=dev), prompt_len, ah, al)
        sync(dev)
        gen_s.append(time.perf_counter() - t0)
        n += 1
    mm.check_invariants(slots.tolist())
    med = lambda xs: sorted(xs)[len(xs) // 2]  # noqa: E731
    return {"device": dev.type, "batch": B, "seq": seq, "prompt_mm_ms": 1e3 * med(prompt_s),
            "gen_mm_ms": 1e3 * med(gen_s[1:] or gen_s)}


def engine_step(B: int, seq: int, steps: int) -> dict:
    """Full decode step of a random-weight Llama-3-8B in diffkv mode, and its memory-management time."""
    from engine import EngineConfig, SamplingParams
    from engine.llm_engine import LLMEngine
    from engine.loader import load_checkpoint

    eng = LLMEngine(EngineConfig(max_model_len=seq + steps + 16, cache={"kv_mode": "diffkv"},
                                 scheduler={"max_num_seqs": B, "max_num_batched_tokens": 16384}),
                    checkpoint=load_checkpoint("random:llama3-8b"))
    g = torch.Generator().manual_seed(0)
    sp = SamplingParams(temperature=0, max_tokens=steps + 8, ignore_eos=True)
    for i in range(B):
        eng.add_request(str(i), torch.randint(0, 128000, (seq,), generator=g).tolist(), sp)
    while eng.scheduler.waiting or any(not s.output_token_ids for s in eng.scheduler.running):
        eng.step()
    for _ in range(3):
        eng.step()
    step_s, mm_s = [], []
    for _ in range(steps):
        t0 = time.perf_counter()
        eng.step()
        step_s.append(time.perf_counter() - t0)
        mm_s.append(eng.runner.kv.mm_seconds())
    med = lambda xs: sorted(xs)[len(xs) // 2]  # noqa: E731
    while eng.has_unfinished_requests():
        for r in list(eng.requests):
            eng.abort(r)
    return {"batch": B, "seq": seq, "decode_step_ms": 1e3 * med(step_s), "engine_mm_ms": 1e3 * med(mm_s)}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--batches", type=int, nargs="+", default=[1, 8, 32, 64, 128, 256])
    ap.add_argument("--cpu-batches", type=int, nargs="+", default=None, help="default: same as --batches")
    ap.add_argument("--seq", type=int, default=1024)
    ap.add_argument("--steps", type=int, default=10)
    ap.add_argument("--engine", action="store_true", help="also time full diffkv decode steps of Llama-3-8B")
    ap.add_argument("--engine-batches", type=int, nargs="+", default=[64, 128])
    ap.add_argument("--out", default=None)
    ap.add_argument("--smoke", action="store_true")
    args = ap.parse_args(argv)
    cuda = torch.cuda.is_available() and not args.smoke
    rows = []
    if args.smoke:
        for B in (1, 2):
            rows.append(bench(B, torch.device("cpu"), 96, 3, L=2, H=2, D=64))
    else:
        for B in args.batches:
            if cuda:
                rows.append(bench(B, torch.device("cuda"), args.seq, args.steps))
        for B in args.cpu_batches or args.batches:
            rows.append(bench(B, torch.device("cpu"), args.seq, max(3, args.steps // 3)))
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
    eng_rows = [engine_step(B, args.seq, args.steps) for B in args.engine_batches] if args.engine and cuda else []
    for r in eng_rows:
        mm = next(x for x in rows if x["device"] == "cuda" and x["batch"] == r["batch"]) if any(
            x["device"] == "cuda" and x["batch"] == r["batch"] for x in rows) else None
        r["mm_share_engine"] = r["engine_mm_ms"] / r["decode_step_ms"]
        if mm:
            r["mm_share_isolated"] = mm["gen_mm_ms"] / r["decode_step_ms"]
        print(f"engine batch {r['batch']}: decode step {r['decode_step_ms']:.2f} ms, memory management "
              f"{r['engine_mm_ms']:.3f} ms in the engine ({100 * r['mm_share_engine']:.2f}% of the step)")
    gpu = torch.cuda.get_device_name() if cuda else "cpu"
    result = {"benchmark": "memory_manager", "device": gpu, "torch": torch.__version__,
              "command": " ".join(["python", "benchmarks/memory_manager.py", *(argv or sys.argv[1:])]),
              "rows": rows, "speedup_gpu_vs_cpu": speed, "engine": eng_rows}
    write_result(result, "memory_manager", gpu, args.out, args.smoke)
    return 0


if __name__ == "__main__":
    sys.exit(main())
