"""Decode throughput of the engine on a random-weight model, next to its memory-bandwidth roofline.

Roofline of one decode step = (weight bytes + KV bytes read) / bandwidth; tokens/s roofline = batch / that.
Usage (GPU):  python benchmarks/decode_throughput.py --preset llama3-8b --batches 1 32 128
Key centering's decode cost: the same batches with centering off and on (the rotated k_proj bias: a model with one),
in the order off, on, on, off per repeat so drift shows as spread:
    python benchmarks/decode_throughput.py --preset qwen2.5-1.5b --kv-mode int4 --key-centering off bias
KV rotation's decode cost (engine.kv_rotation: one [tokens, heads, D] x [D, D] matmul per layer), the same way:
    python benchmarks/decode_throughput.py --preset qwen2.5-1.5b --kv-mode int4 --kv-rotation off hadamard
Smoke (CPU):  python benchmarks/decode_throughput.py --smoke
"""
from __future__ import annotations

import argparse
import platform
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from _results import write_result  # noqa: E402
from diffkv_serve.engine import EngineConfig, SamplingParams  # noqa: E402
from diffkv_serve.engine.llm_engine import LLMEngine  # noqa: E402
from diffkv_serve.engine.loader import load_checkpoint  # noqa: E402
from diffkv_serve.engine.flags import add_engine_flags  # noqa: E402


def run_batch(engine: LLMEngine, batch: int, prompt_len: int, new_tokens: int, seed: int) -> dict:
    g = torch.Generator().manual_seed(seed)
    V = engine.arch.vocab_size
    sp = SamplingParams(temperature=0, max_tokens=new_tokens, ignore_eos=True)
    for i in range(batch):
        engine.add_request(f"b{batch}-{i}", torch.randint(0, V, (prompt_len,), generator=g).tolist(), sp)
    t_prefill = time.perf_counter()
    # Prefill steps until every request has its first token, then time the decode steps alone.
    while engine.scheduler.waiting or any(not s.output_token_ids for s in engine.scheduler.running):
        engine.step()
    t0 = time.perf_counter()
    steps = 0
    while engine.has_unfinished_requests():
        engine.step()
        steps += 1
    t1 = time.perf_counter()
    decode_tokens = batch * (new_tokens - 1)
    return {"batch": batch, "prompt_len": prompt_len, "new_tokens": new_tokens, "decode_steps": steps,
            "prefill_s": t0 - t_prefill, "decode_s": t1 - t0, "decode_tok_s": decode_tokens / (t1 - t0),
            "step_ms": 1e3 * (t1 - t0) / max(steps, 1)}


def timed_batch(engine: LLMEngine, batch: int, prompt_len: int, new_tokens: int, seed: int) -> dict:
    """run_batch twice at the same shape, the second timed: the first pays what a new batch size costs once
    (CUDA graph capture, Triton compiles for its launch configs), which at 255 steps inflated batch 32's step
    time 1.8x on an H100."""
    run_batch(engine, batch, prompt_len, new_tokens, seed=seed + 10_000)
    return run_batch(engine, batch, prompt_len, new_tokens, seed=seed)


def roofline(engine: LLMEngine, batch: int, prompt_len: int, new_tokens: int, bw: float) -> dict:
    weight_bytes = sum(p.numel() * p.element_size() for p in engine.runner.model.parameters())
    a = engine.arch
    avg_ctx = prompt_len + new_tokens / 2
    kv_bytes = batch * avg_ctx * a.num_layers * a.num_kv_heads * a.head_dim * 2 * engine.mm.cache_dtype.itemsize
    step_s = (weight_bytes + kv_bytes) / bw
    return {"weight_bytes": weight_bytes, "kv_bytes_per_step": kv_bytes, "roofline_step_ms": 1e3 * step_s,
            "roofline_tok_s": batch / step_s}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--preset", default="llama3-8b")
    ap.add_argument("--batches", type=int, nargs="+", default=[1, 32, 128])
    ap.add_argument("--prompt-len", type=int, default=512)
    ap.add_argument("--new-tokens", type=int, default=256)
    ap.add_argument("--bandwidth", type=float, default=3.0e12, help="bytes/s (H100 copy bandwidth measured here)")
    add_engine_flags(ap, only=("device", "dtype", "kv_mode"),
                     defaults={"device": "auto", "dtype": "auto", "kv_mode": "fp16"})
    ap.add_argument("--block-size", type=int, default=16)
    ap.add_argument("--out", default=None, help="JSON path (default benchmarks/results/decode_throughput_<gpu>.json)")
    ap.add_argument("--key-centering", nargs="+", default=None, choices=("auto", "bias", "off"),
                    help="compare these key-centering modes side by side (an engine each, order A B B A)")
    ap.add_argument("--kv-rotation", nargs="+", default=None, choices=("auto", "hadamard", "off"),
                    help="compare these KV-rotation modes side by side (an engine each, order A B B A)")
    ap.add_argument("--smoke", action="store_true", help="tiny shapes on CPU (CI keeps the script alive)")
    args = ap.parse_args(argv)
    if args.key_centering and args.kv_rotation:
        ap.error("compare --key-centering or --kv-rotation, not both at once")
    if args.key_centering:
        return compare_cache_option(args, argv, "key_centering", args.key_centering, "key_centering_decode_cost")
    if args.kv_rotation:
        return compare_cache_option(args, argv, "kv_rotation", args.kv_rotation, "kv_rotation_decode_cost")
    if args.smoke:
        args.preset, args.batches, args.prompt_len, args.new_tokens = "tiny", [1, 3], 16, 6
        args.device = "cpu" if args.device == "auto" else args.device
    ckpt = load_checkpoint(f"random:{args.preset}")
    max_len = args.prompt_len + args.new_tokens + 16
    cfg = EngineConfig(device=args.device, dtype=args.dtype, max_model_len=max_len,
                       scheduler={"max_num_seqs": max(args.batches), "max_num_batched_tokens": 8192},
                       cache={"block_size": args.block_size})
    engine = LLMEngine(cfg, checkpoint=ckpt)
    dev = engine.runner.device
    gpu = torch.cuda.get_device_name(dev) if dev.type == "cuda" else platform.processor() or "cpu"
    rows = []
    for b in args.batches:
        r = timed_batch(engine, b, args.prompt_len, args.new_tokens, seed=b)
        r.update(roofline(engine, b, args.prompt_len, args.new_tokens, args.bandwidth))
        r["vs_roofline"] = r["step_ms"] / r["roofline_step_ms"]
        rows.append(r)
    print(f"{'batch':>6} {'decode tok/s':>13} {'step ms':>8} {'roofline ms':>12} {'roofline tok/s':>15} {'x roofline':>11}")
    for r in rows:
        print(f"{r['batch']:>6} {r['decode_tok_s']:>13.1f} {r['step_ms']:>8.2f} {r['roofline_step_ms']:>12.2f} "
              f"{r['roofline_tok_s']:>15.1f} {r['vs_roofline']:>11.2f}")
    result = {"benchmark": "decode_throughput", "device": gpu, "preset": args.preset, "dtype": str(engine.runner.dtype),
              "block_size": args.block_size, "bandwidth": args.bandwidth, "torch": torch.__version__,
              "command": " ".join(["python", "benchmarks/decode_throughput.py", *(argv or sys.argv[1:])]),
              "rows": rows}
    write_result(result, "decode_throughput", gpu, args.out, args.smoke)
    return 0


def _engine(args, option: dict) -> LLMEngine:
    ckpt = load_checkpoint(f"random:{args.preset}")
    max_len = args.prompt_len + args.new_tokens + 16
    cfg = EngineConfig(device=args.device, dtype=args.dtype, max_model_len=max_len,
                       scheduler={"max_num_seqs": max(args.batches), "max_num_batched_tokens": 8192},
                       cache={"block_size": args.block_size, "kv_mode": args.kv_mode, **option})
    return LLMEngine(cfg, checkpoint=ckpt)


def compare_cache_option(args, argv, field: str, modes: list[str], benchmark: str) -> int:
    """Decode step time per batch with each value of one cache option (key_centering, kv_rotation), engines built
    one at a time in the order A B ... B A (so a drifting clock or thermal state shows as spread, not as a
    difference)."""
    import gc

    if args.smoke:
        args.preset, args.batches, args.prompt_len, args.new_tokens = "tiny-qwen2", [2], 16, 6
        args.device = "cpu" if args.device == "auto" else args.device
    order = list(modes) + list(reversed(modes))
    runs: dict[str, list[dict]] = {m: [] for m in modes}
    gpu = "cpu"
    for mode in order:
        engine = _engine(args, {field: mode})
        dev = engine.runner.device
        gpu = torch.cuda.get_device_name(dev) if dev.type == "cuda" else platform.processor() or "cpu"
        runs[mode].append({field: engine.stats()[field],
                           "rows": [timed_batch(engine, b, args.prompt_len, args.new_tokens, seed=b)
                                    for b in args.batches]})
        del engine
        gc.collect()
        if torch.cuda.is_available():
            torch.cuda.empty_cache()
    base = modes[0]
    print(f"{'batch':>6} " + " ".join(f"{m + ' step ms':>22}" for m in modes)
          + " " + " ".join(f"{m + ' / ' + base:>14}" for m in modes[1:]))
    rows = []
    for i, b in enumerate(args.batches):
        ms = {m: [r["rows"][i]["step_ms"] for r in runs[m]] for m in modes}
        mean = {m: sum(v) / len(v) for m, v in ms.items()}
        rows.append({"batch": b, "step_ms": ms, "mean_step_ms": mean,
                     "ratio_vs_" + base: {m: mean[m] / mean[base] for m in modes}})
        print(f"{b:>6} " + " ".join(f"{mean[m]:>10.3f} ({min(ms[m]):.3f}-{max(ms[m]):.3f})" for m in modes)
              + " " + " ".join(f"{mean[m] / mean[base]:>14.3f}" for m in modes[1:]))
    result = {"benchmark": benchmark, "device": gpu, "preset": args.preset, "kv_mode": args.kv_mode,
              "prompt_len": args.prompt_len, "new_tokens": args.new_tokens, "order": order, "torch": torch.__version__,
              "command": " ".join(["python", "benchmarks/decode_throughput.py", *(argv or sys.argv[1:])]),
              "modes": {m: [r[field] for r in runs[m]][0] for m in modes}, "rows": rows}
    write_result(result, benchmark, gpu, args.out, args.smoke)
    return 0


if __name__ == "__main__":
    sys.exit(main())
