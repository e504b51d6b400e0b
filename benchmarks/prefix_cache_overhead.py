"""Prefix caching on vs off: wall time of the same requests, when prompts share nothing (the overhead:
hashing, inserting blocks; in diffkv also the pinning of each prompt's full blocks) and when they share a prefix.

    python3 -m benchmarks.prefix_cache_overhead --device cpu --repeats 3

Each mode builds one engine with caching off and one with it on; every repeat draws fresh prompts (no hit
across repeats) and runs them on both engines, in alternating order. The median seconds are reported with
on/off ratios (JSON under benchmarks/results/).
"""
from __future__ import annotations

import argparse
import statistics
import time

import torch

from benchmarks._results import write_result
from diffkv_serve.engine import EngineConfig, SamplingParams
from diffkv_serve.engine.llm_engine import LLMEngine
from diffkv_serve.engine.loader import load_checkpoint
from diffkv_serve.engine.flags import add_engine_flags


def prompts(scenario: str, n: int, length: int, seed: int) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    if scenario == "distinct":
        return [torch.randint(100, 20000, (length,), generator=g).tolist() for _ in range(n)]
    shared = torch.randint(100, 20000, (length - 16,), generator=g).tolist()
    return [shared + torch.randint(100, 20000, (16,), generator=g).tolist() for _ in range(n)]


def make_engine(ckpt, device: str, mode: str, caching: bool) -> LLMEngine:
    eng = LLMEngine(EngineConfig(device=device, cache={"kv_mode": mode, "num_pages": 6000,
                                                       "enable_prefix_caching": caching}), checkpoint=ckpt)
    eng.add_request("warm", list(range(100, 108)), SamplingParams(temperature=0, max_tokens=2))
    while eng.has_unfinished_requests():
        eng.step()
    return eng


def run_once(eng: LLMEngine, device: str, reqs: list[list[int]], max_tokens: int) -> float:
    sp = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
    t0 = time.perf_counter()
    # the first request alone (it fills the cache), then the rest together
    for batch in (reqs[:1], reqs[1:]):
        for i, p in enumerate(batch):
            eng.add_request(f"{len(p)}-{i}-{time.perf_counter()}", p, sp)
        while eng.has_unfinished_requests():
            eng.step()
    if device.startswith("cuda"):
        torch.cuda.synchronize()
    return time.perf_counter() - t0


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_engine_flags(ap, only=("device",), defaults={"device": "cpu"})
    ap.add_argument("--modes", default="fp16,diffkv")
    ap.add_argument("--scenarios", default="distinct,shared")
    ap.add_argument("--num-prompts", type=int, default=4)
    ap.add_argument("--prompt-len", type=int, default=256)
    ap.add_argument("--max-tokens", type=int, default=8)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    ckpt = load_checkpoint(None)
    rows = []
    for mode in args.modes.split(","):
        engines = {c: make_engine(ckpt, args.device, mode, c) for c in (False, True)}
        for scenario in args.scenarios.split(","):
            times = {False: [], True: []}
            for r in range(args.repeats):
                reqs = prompts(scenario, args.num_prompts, args.prompt_len, seed=1000 * r + len(scenario))
                for caching in ((False, True) if r % 2 == 0 else (True, False)):
                    times[caching].append(run_once(engines[caching], args.device, reqs, args.max_tokens))
            off, on = statistics.median(times[False]), statistics.median(times[True])
            rows.append({"mode": mode, "scenario": scenario, "off_s": off, "on_s": on, "on_over_off": on / off,
                         "runs_off": times[False], "runs_on": times[True]})
            print(f"{mode:7s} {scenario:9s} off {off:7.3f}s  on {on:7.3f}s  on/off {on / off:.3f}", flush=True)
    write_result({"device": args.device, "args": vars(args), "rows": rows}, "prefix_cache_overhead", args.device,
                 args.out, smoke=False)


if __name__ == "__main__":
    main()
