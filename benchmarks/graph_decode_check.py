"""Greedy task outputs through replayed CUDA graphs against eager decode steps, on the real model.

A decode step replayed from a CUDA graph must produce what the same step run eagerly produces. This runs the
accuracy study's gsm_symbolic prompts (eval split, chat template, greedy, --max-tokens) in one KV configuration
under several engine variants and reports, per variant, task accuracy, generations cut at the token limit,
mean output tokens and the fraction of prompts whose output equals the eager run's token for token:

    eager        enforce_eager (no graphs): the reference
    lazy         graphs captured as batches first need them, mid-run (what serving and the study do)
    warm         every graph captured before the first request (what the throughput benchmarks do)
    lazy-small   lazy, in a small fixed pool (--small-pool-gb), so long runs preempt

    python benchmarks/graph_decode_check.py --model qwen2.5-coder-1.5b --config k4v4 --num-problems 256
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import torch  # noqa: E402

from diffkv_serve.engine import EngineConfig  # noqa: E402
from diffkv_serve.engine.flags import add_engine_flags  # noqa: E402
from diffkv_serve.engine.llm_engine import LLMEngine  # noqa: E402
from evals.configs import parse_config  # noqa: E402
from evals.fidelity import fidelity_prompts, teacher_forced_requests  # noqa: E402
from evals.problems import load_problems  # noqa: E402
from evals.runner import EvalModel, run_requests  # noqa: E402
from evals.tasks import extract_answer, is_correct, task_requests  # noqa: E402

VARIANTS = ("eager", "lazy", "warm", "lazy-small")


def build(model: EvalModel, cache: dict, variant: str, args) -> LLMEngine:
    cache = dict(cache)
    if variant == "lazy-small":
        cache["kv_cache_memory_gb"] = args.small_pool_gb
    cfg = EngineConfig(model=None, device=args.device, max_model_len=2048, enforce_eager=variant == "eager",
                       max_graph_batch_size=min(args.max_num_seqs, 512), cache=cache,
                       scheduler={"max_num_seqs": args.max_num_seqs, "max_num_batched_tokens": 16384})
    eng = LLMEngine(cfg, checkpoint=model.ckpt)
    if model.key_center is not None and cache.get("kv_mode", "fp16") != "fp16":
        eng.runner.use_key_centers(model.key_center)
    if variant == "warm" and eng.runner.graphs is not None:
        eng.runner.graphs.capture_all()
    return eng


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_engine_flags(ap, only=("model", "device"), defaults={"model": "qwen2.5-coder-1.5b", "device": "cuda"})
    ap.add_argument("--config", default="k4v4", help="evals.configs name")
    ap.add_argument("--num-problems", type=int, default=256)
    ap.add_argument("--max-tokens", type=int, default=512)
    ap.add_argument("--max-num-seqs", type=int, default=256)
    ap.add_argument("--small-pool-gb", type=float, default=1.0)
    ap.add_argument("--key-center", default=None, help="key_center.json of a study (as the study centers keys)")
    ap.add_argument("--references", default=None,
                    help="a study's references.json: its fidelity replays (teacher-forced) join the batch, as the "
                         "study runs them")
    ap.add_argument("--variants", nargs="+", default=list(VARIANTS), choices=VARIANTS)
    ap.add_argument("--out", default=None)
    args = ap.parse_args(argv)
    model = EvalModel(args.model, device=args.device, max_num_seqs=args.max_num_seqs)
    if args.key_center:
        model.key_center = torch.tensor(json.loads(Path(args.key_center).read_text())["key_center"])
    problems = load_problems(split="eval", tasks=("gsm_symbolic",), limit=args.num_problems)
    reqs = task_requests(model, problems, {"gsm_symbolic": args.max_tokens})
    fid = []
    if args.references:
        refs = json.loads(Path(args.references).read_text())["fidelity"]
        fid = teacher_forced_requests(fidelity_prompts(model, load_problems(split="fidelity", limit=len(refs))), refs)
    cache = dict(parse_config(args.config).cache)
    rows, ref = [], None
    for v in args.variants:
        eng = build(model, cache, v, args)
        t0 = time.perf_counter()
        outs = run_requests(eng, fid + reqs, v)[len(fid):]
        secs = time.perf_counter() - t0
        toks = [list(o.token_ids) for o in outs]
        ref = toks if ref is None else ref
        row = {"variant": v, "config": args.config, "seconds": secs,
               "accuracy": statistics.mean(is_correct(extract_answer(o.text), p.answer) for o, p in zip(outs, problems)),
               "truncated": sum(o.finish_reason == "length" for o in outs),
               "mean_output_tokens": statistics.mean(len(t) for t in toks),
               "equal_to_first": statistics.mean(a == b for a, b in zip(toks, ref)),
               "pages_total": eng.mm.num_pages}
        rows.append(row)
        print(json.dumps(row), flush=True)
        del eng
        torch.cuda.empty_cache()
    print(f"{'variant':12s} {'accuracy':>8s} {'cut':>5s} {'mean tok':>8s} {'= first':>8s} {'pages':>9s} {'s':>6s}")
    for r in rows:
        print(f"{r['variant']:12s} {r['accuracy']:8.3f} {r['truncated']:5d} {r['mean_output_tokens']:8.1f} "
              f"{r['equal_to_first']:8.3f} {r['pages_total']:9d} {r['seconds']:6.1f}")
    if args.out:
        Path(args.out).write_text(json.dumps({"benchmark": "graph_decode_check", "model": args.model,
                                              "problems": args.num_problems, "rows": rows}, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
