"""Bytes per token of short chat requests: where partly filled pages cost more than a low tier saves.

N chat requests (the eval split's gsm_symbolic questions, chat template) × M new tokens (ignore_eos) run on one page
pool with the embedded SmolLM2 (CPU is fine). After every step the running sequences' pages (their own plus the
prefix blocks they read) × page bytes are divided by the fp16 bytes of the tokens they hold; the table gives the
mean over steps, the per-entry bytes of each mode's formats for comparison, and the pages each sequence holds
per (layer, KV head) and section.

    python benchmarks/short_requests.py [--num-requests 24] [--max-tokens 128] [--num-pages 3600] [--block-size 16]
        [--configs uniform:K8V4 diffkv:alpha_high=1,alpha_low=0.02,high=K8V4,low=K4V2 ...]
"""
from __future__ import annotations

import argparse
import statistics
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from tqdm import tqdm  # noqa: E402

from benchmarks._results import write_result  # noqa: E402
from diffkv_serve.engine import LLMEngine, SamplingParams  # noqa: E402
from diffkv_serve.engine.config import EngineConfig  # noqa: E402
from evals.configs import parse_config  # noqa: E402
from evals.problems import load_problems  # noqa: E402
from diffkv_serve.engine.flags import add_engine_flags  # noqa: E402

DEFAULT_CONFIGS = ["uniform:K8V4", "uniform:K4V4", "diffkv:alpha_high=1,alpha_low=0.02,high=K8V4,low=K4V2",
                   "diffkv"]


def prompts(engine: LLMEngine, n: int) -> list[list[int]]:
    tok = engine.tokenizer
    qs = [p.question for p in load_problems(split="eval", tasks=("gsm_symbolic",), limit=n)]
    return [tok.encode(tok.apply_chat_template([{"role": "user", "content": q}]), add_special_tokens=False)
            for q in qs]


def run(name: str, cache: dict, args) -> dict:
    eng = LLMEngine(EngineConfig(model=args.model, device=args.device,
                                 cache={**cache, "num_pages": args.num_pages, "block_size": args.block_size},
                                 scheduler={"max_num_seqs": args.num_requests}))
    sp = SamplingParams(temperature=0, max_tokens=args.max_tokens, ignore_eos=True)
    ids = prompts(eng, args.num_requests)
    for i, p in enumerate(ids):
        eng.add_request(str(i), p, sp)
    ratios, per_entry, steps = [], [], 0
    bar = tqdm(total=args.num_requests * args.max_tokens, desc=name, disable=args.quiet)
    while eng.has_unfinished_requests():
        out = eng.step()
        steps += 1
        bar.update(sum(len(o.new_token_ids) for o in out))
        st = eng.stats()
        if st["bytes_fp16"]:
            ratios.append(st["pages_running"] * st["page_bytes"] / st["bytes_fp16"])
            per_entry.append(st["pages_running"] / (st["cached_tokens"] * eng._heads_per_seq()))
    bar.close()
    return {"config": name, "cache": cache, "bytes_ratio": statistics.mean(ratios),
            "bytes_ratio_last": ratios[-1] if ratios else None,
            "pages_per_token_head": statistics.mean(per_entry), "steps": steps,
            "prompt_tokens_mean": statistics.mean(len(p) for p in ids), "page_bytes": eng.mm.page_bytes,
            "fp16_token_bytes": eng._fp16_token_bytes()}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_engine_flags(ap, only=("model", "device"), defaults={"device": "cpu"})
    ap.add_argument("--num-requests", type=int, default=24)
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--num-pages", type=int, default=3600)
    ap.add_argument("--block-size", type=int, default=16,
                    help="tokens a full-precision page holds (fp32 on CPU, bf16/fp16 on GPU): the page's bytes; "
                         "smaller pages leave less partly empty")
    ap.add_argument("--configs", nargs="+", default=DEFAULT_CONFIGS, help="evals.configs names")
    ap.add_argument("--out", default=None, help="default: benchmarks/results/short_requests_bytes_<device>.json")
    ap.add_argument("--quiet", action="store_true")
    args = ap.parse_args(argv)
    rows = []
    print(f"{'config':58s} {'bytes/fp16':>10s} {'at end':>8s} {'pages/tok/head':>15s}", flush=True)
    for name in args.configs:
        rows.append(run(name, dict(parse_config(name).cache), args))
        r = rows[-1]
        print(f"{r['config']:58s} {r['bytes_ratio']:10.3f} {r['bytes_ratio_last']:8.3f} {r['pages_per_token_head']:15.5f}",
              flush=True)
    write_result({"benchmark": "short_requests", "num_requests": args.num_requests, "max_tokens": args.max_tokens,
                  "num_pages": args.num_pages, "block_size": args.block_size, "rows": rows},
                 "short_requests_bytes", args.device, args.out, False)
    return 0


if __name__ == "__main__":
    sys.exit(main())
