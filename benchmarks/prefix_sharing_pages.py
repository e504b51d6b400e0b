"""Pages held and throughput when requests share a long system prompt: diffkv sharing its pinned prefix blocks,
diffkv without sharing (the default policy, and the same pinning rule with caching off), and int4.

    python3 -m benchmarks.prefix_sharing_pages --device cpu --num-prompts 8 --prefix-len 384 --suffix-len 80

Every configuration runs the same requests: the first alone (its prefill fills the cache), then the others
together. Reported per configuration: pages in use once every prompt ran its prefill, the most pages in use
at any step, cached prefix pages, prompt tokens read from the cache, wall seconds and generated tokens per
second (median of the repeats; each repeat draws fresh prompts, so nothing is cached across repeats). JSON
under benchmarks/results/.
"""
from __future__ import annotations

import argparse
import statistics
import time

import torch

from benchmarks._results import write_result
from diffkv_serve.engine.flags import add_engine_flags  # noqa: E402
from diffkv_serve.engine import EngineConfig, SamplingParams
from diffkv_serve.engine.llm_engine import LLMEngine
from diffkv_serve.engine.loader import load_checkpoint

CONFIGS = {
    "int4": {"kv_mode": "int4", "enable_prefix_caching": True},
    "diffkv": {"kv_mode": "diffkv", "enable_prefix_caching": False},
    "diffkv-pinned": {"kv_mode": "diffkv", "enable_prefix_caching": False, "pin_prompt_blocks": True},
    "diffkv-shared": {"kv_mode": "diffkv", "enable_prefix_caching": True},
    "diffkv-K4V4-shared": {"kv_mode": "diffkv", "high": "K4V4", "low": "K4V2", "enable_prefix_caching": True},
}


def make_prompts(n: int, prefix_len: int, suffix_len: int, vocab: int, seed: int) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    hi = min(20000, vocab)
    shared = torch.randint(100, hi, (prefix_len,), generator=g).tolist()
    return [shared + torch.randint(100, hi, (suffix_len,), generator=g).tolist() for _ in range(n)]


def run_once(eng: LLMEngine, reqs: list[list[int]], max_tokens: int, tag: str) -> dict:
    sp = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
    mm = eng.mm
    peak = after_prefills = 0
    t0 = time.perf_counter()
    for k, batch in enumerate((reqs[:1], reqs[1:])):
        for i, p in enumerate(batch):
            eng.add_request(f"{tag}-{len(p)}-{i}-{time.perf_counter()}", p, sp)
        while eng.has_unfinished_requests():
            eng.step()
            used = mm.num_pages - mm.free_pages()
            peak = max(peak, used)
            if k == 1 and not eng.scheduler.waiting and not after_prefills:
                after_prefills = used
    seconds = time.perf_counter() - t0
    st = eng.stats()
    return {"pages_after_prefills": after_prefills, "peak_pages": peak, "seconds": seconds,
            "tokens_per_s": len(reqs) * max_tokens / seconds, "prefix_cache_pages": st["prefix_cache_pages"]}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_engine_flags(ap, only=("model", "device"), defaults={"device": "cpu"})  # model: default the embedded SmolLM2
    ap.add_argument("--configs", default=",".join(CONFIGS))
    ap.add_argument("--num-prompts", type=int, default=8)
    ap.add_argument("--prefix-len", type=int, default=384)
    ap.add_argument("--suffix-len", type=int, default=80)
    ap.add_argument("--max-tokens", type=int, default=32)
    ap.add_argument("--num-pages", type=int, default=20000)
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    names = args.configs.split(",")
    unknown = sorted(set(names) - set(CONFIGS))
    if unknown:
        raise SystemExit(f"--configs: unknown {unknown}; choose from {sorted(CONFIGS)}")
    ckpt = load_checkpoint(args.model)
    engines = {}
    for name in names:
        cfg = EngineConfig(device=args.device, max_model_len=args.prefix_len + args.suffix_len + args.max_tokens + 8,
                           scheduler={"max_num_seqs": max(8, args.num_prompts)},
                           cache={**CONFIGS[name], "num_pages": args.num_pages})
        engines[name] = LLMEngine(cfg, checkpoint=ckpt)
    runs: dict[str, list[dict]] = {n: [] for n in names}
    for r in range(args.repeats):
        reqs = make_prompts(args.num_prompts, args.prefix_len, args.suffix_len, ckpt.arch.vocab_size, seed=r)
        order = names if r % 2 == 0 else names[::-1]
        for name in order:
            runs[name].append(run_once(engines[name], reqs, args.max_tokens, f"r{r}"))
            print(f"repeat {r} {name}: {runs[name][-1]}", flush=True)
            engines[name].reset_prefix_cache()
    rows = []
    for name in names:
        eng = engines[name]
        row = {"config": name, "page_bytes": eng.mm.page_bytes, "block_tokens": eng.mm.prefix_block_tokens,
               **{k: statistics.median(x[k] for x in runs[name]) for k in runs[name][0]}, "runs": runs[name]}
        row["kib_after_prefills"] = row["pages_after_prefills"] * row["page_bytes"] / 1024
        rows.append(row)
        print(f"{name:20s} pages after prefills {row['pages_after_prefills']:7.0f} "
              f"({row['kib_after_prefills']:8.0f} KiB)  peak {row['peak_pages']:7.0f}  "
              f"cached {row['prefix_cache_pages']:6.0f}  {row['seconds']:7.2f}s  {row['tokens_per_s']:7.1f} tok/s",
              flush=True)
    write_result({"device": args.device, "args": vars(args), "rows": rows}, "prefix_sharing_pages", args.device,
                 args.out, smoke=args.model is not None)


if __name__ == "__main__":
    main()
