"""Decode throughput of the engine on a random-weight model, next to its memory-bandwidth roofline.

Roofline of one decode step = (weight bytes + KV bytes read) / bandwidth; tokens/s roofline = batch / that.
Usage (GPU):  python benchmarks/decode_throughput.py --preset llama3-8b --batches 1 32 128
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
from engine import EngineConfig, SamplingParams  # noqa: E402
from engine.llm_engine import LLMEngine  # noqa: E402
from engine.loader import load_checkpoint  # noqa: E402


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
    ap.add_argument("--device", default="auto")
    ap.add_argument("--dtype", default="auto")
    ap.add_argument("--block-size", type=int, default=16)
    ap.add_argument("--out", default=None, help="JSON path (default benchmarks/results/decode_throughput_<gpu>.json)")
    ap.add_argument("--smoke", action="store_true", help="tiny shapes on CPU (CI keeps the script alive)")
    args = ap.parse_args(argv)
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
    run_batch(engine, 1, min(args.prompt_len, 32), 4, seed=0)  # warm-up: kernels compile, allocator settles
    rows = []
    for b in args.batches:
        r = run_batch(engine, b, args.prompt_len, args.new_tokens, seed=b)
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


if __name__ == "__main__":
    sys.exit(main())
