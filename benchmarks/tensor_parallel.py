"""Tensor parallelism: do TP=N ranks give TP=1's greedy tokens, and what decode throughput do they reach?

For each TP size: (1) a correctness check in --check-dtype (float32 by default, so that bf16 rounding of a
random-weight model's near-tied logits does not hide real differences): greedy tokens of a few prompts and
the largest next-token logit difference against TP=1; (2) decode throughput per batch size in --dtype,
timed like benchmarks/decode_throughput.py. TP=1 runs in-process (--tp1-executor ray puts it on one Ray
actor, the same per-step path as TP>1); TP>1 runs one Ray actor per GPU.

Usage (GPU, 2 GPUs):  python benchmarks/tensor_parallel.py --model random:llama3-8b --tp 1 2
Smoke (CPU):          python benchmarks/tensor_parallel.py --smoke
"""
from __future__ import annotations

import argparse
import gc
import os
import platform
import sys
import time
from pathlib import Path

import torch
from tqdm.auto import tqdm

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from _results import write_result  # noqa: E402
from decode_throughput import timed_batch  # noqa: E402
from diffkv_serve.engine import EngineConfig, SamplingParams  # noqa: E402
from diffkv_serve.engine.llm_engine import LLMEngine  # noqa: E402
from diffkv_serve.engine.flags import add_engine_flags  # noqa: E402


def build(args, tp: int, dtype: str, max_len: int, max_seqs: int) -> LLMEngine:
    executor = "ray" if tp > 1 else args.tp1_executor
    cfg = EngineConfig(model=args.model, device=args.device, dtype=dtype, max_model_len=max_len,
                       tensor_parallel_size=tp, distributed_executor=executor, enforce_eager=args.eager,
                       scheduler={"max_num_seqs": max_seqs, "max_num_batched_tokens": 8192},
                       cache={"block_size": args.block_size, "kv_mode": args.kv_mode})
    return LLMEngine(cfg)


def release(engine: LLMEngine) -> None:
    """Free the engine's devices before the next one starts (Ray ranks die; in-process memory is collected)."""
    engine.shutdown()
    del engine
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


def check_prompts(vocab: int, n: int, length: int, seed: int = 1234) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, vocab, (length + 3 * i,), generator=g).tolist() for i in range(n)]


def greedy_check(engine: LLMEngine, prompts: list[list[int]], new_tokens: int) -> dict:
    sp = SamplingParams(temperature=0, max_tokens=new_tokens, ignore_eos=True)
    for i, p in enumerate(prompts):
        engine.add_request(f"check-{i}", p, sp)
    done = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                done[out.request_id] = out.token_ids
    tokens = [done[f"check-{i}"] for i in range(len(prompts))]
    logits = engine.prompt_logits(prompts[0])
    return {"tokens": tokens, "logits": logits}


def device_name(engine: LLMEngine) -> str:
    devices = getattr(engine.executor, "devices", None)
    if devices:
        return devices[0]
    dev = engine.runner.device
    return torch.cuda.get_device_name(dev) if dev.type == "cuda" else platform.processor() or "cpu"


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_engine_flags(ap, only=("model", "kv_mode", "device", "dtype"),
                     defaults={"model": "random:llama3-8b", "kv_mode": "fp16", "device": "auto", "dtype": "auto"})
    ap.add_argument("--tp", type=int, nargs="+", default=[1, 2], help="tensor-parallel sizes (TP=1 is the reference)")
    ap.add_argument("--batches", type=int, nargs="+", default=[1, 32, 128])
    ap.add_argument("--prompt-len", type=int, default=512)
    ap.add_argument("--new-tokens", type=int, default=128)
    ap.add_argument("--check-dtype", default="float32", help="correctness check runs")
    ap.add_argument("--check-prompts", type=int, default=4)
    ap.add_argument("--check-tokens", type=int, default=32)
    ap.add_argument("--block-size", type=int, default=16)
    ap.add_argument("--tp1-executor", default="local", choices=["local", "ray"])
    ap.add_argument("--eager", action="store_true", help="no CUDA graphs (enforce_eager)")
    ap.add_argument("--skip-check", action="store_true")
    ap.add_argument("--out", default=None, help="JSON path (default benchmarks/results/tensor_parallel_<gpu>.json)")
    ap.add_argument("--smoke", action="store_true", help="random:tiny on CPU, TP 1 and 2, tiny shapes")
    args = ap.parse_args(argv)
    if args.smoke:
        args.model, args.tp, args.batches = "random:tiny", [1, 2], [1, 3]
        args.prompt_len, args.new_tokens, args.check_prompts, args.check_tokens = 16, 6, 3, 8
        args.device = "cpu" if args.device == "auto" else args.device
        args.dtype = args.check_dtype = "float32"  # one engine per TP size does both parts
    os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
    if 1 not in args.tp:
        ap.error("--tp must include 1 (the reference)")
    tps = [1] + sorted(set(args.tp) - {1})
    max_len = max(args.prompt_len, args.check_tokens + 3 * args.check_prompts + 64) + args.new_tokens + 16
    check_len = 48

    checks, rows, device = {}, [], None
    reference = None
    bar = tqdm(total=len(tps) * ((0 if args.skip_check else 1) + 1), desc="tensor parallel", disable=None)
    # tqdm steps: per TP size, the check (if any), then the timing
    shared = args.dtype == args.check_dtype  # one engine serves the check and the timing
    max_seqs = max(args.batches + [args.check_prompts])
    for tp in tps:
        eng = None
        if not args.skip_check:
            t0 = time.perf_counter()
            eng = build(args, tp, args.check_dtype, max_len, max_seqs if shared else args.check_prompts)
            prompts = check_prompts(eng.arch.vocab_size, args.check_prompts, check_len)
            got = greedy_check(eng, prompts, args.check_tokens)
            if not shared:
                release(eng)
                eng = None
            if reference is None:
                reference = got
            pairs = [(a, b) for ta, tb in zip(got["tokens"], reference["tokens"]) for a, b in zip(ta, tb)]
            diverge = [next((j for j, (a, b) in enumerate(zip(ta, tb)) if a != b), None)
                       for ta, tb in zip(got["tokens"], reference["tokens"])]
            checks[tp] = {"tp": tp, "dtype": args.check_dtype, "tokens_equal": got["tokens"] == reference["tokens"],
                          "token_match_fraction": sum(a == b for a, b in pairs) / max(len(pairs), 1),
                          "first_divergence": diverge,
                          "prompt_logits_max_abs_diff": float((got["logits"] - reference["logits"]).abs().max()),
                          "seconds": time.perf_counter() - t0}
            bar.update(1)
        if eng is None:
            eng = build(args, tp, args.dtype, max_len, max_seqs)
        device = device or device_name(eng)
        dtype = str(eng.runner.dtype) if eng.runner is not None else eng.executor.dtype
        for b in args.batches:
            r = timed_batch(eng, b, args.prompt_len, args.new_tokens, seed=b)
            r.update({"tp": tp, "dtype": dtype, "pages_per_rank": [x["pages_total"] for x in eng.stats()["ranks"]]})
            rows.append(r)
        release(eng)
        bar.update(1)
    bar.close()

    base = {r["batch"]: r["decode_tok_s"] for r in rows if r["tp"] == 1}
    for r in rows:
        r["speedup_vs_tp1"] = r["decode_tok_s"] / base[r["batch"]]
    if checks:
        print(f"{'tp':>3} {'tokens equal':>13} {'match':>7} {'max |dlogit|':>13}   ({args.check_dtype})")
        for c in checks.values():
            print(f"{c['tp']:>3} {str(c['tokens_equal']):>13} {c['token_match_fraction']:>7.3f} "
                  f"{c['prompt_logits_max_abs_diff']:>13.2e}")
    print(f"{'tp':>3} {'batch':>6} {'decode tok/s':>13} {'step ms':>8} {'x TP=1':>7}")
    for r in rows:
        print(f"{r['tp']:>3} {r['batch']:>6} {r['decode_tok_s']:>13.1f} {r['step_ms']:>8.2f} {r['speedup_vs_tp1']:>7.2f}")
    result = {"benchmark": "tensor_parallel", "device": device, "model": args.model, "kv_mode": args.kv_mode,
              "tp": tps, "tp1_executor": args.tp1_executor, "eager": args.eager, "torch": torch.__version__,
              "command": " ".join(["python", "benchmarks/tensor_parallel.py", *(argv if argv is not None else sys.argv[1:])]),
              "checks": list(checks.values()), "rows": rows}
    write_result(result, "tensor_parallel", device or "cpu", args.out, args.smoke)
    ok = all(c["tokens_equal"] for c in checks.values())
    if not ok:
        print("greedy tokens differ from TP=1 (see checks)")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
