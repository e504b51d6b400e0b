"""What the sampling parameters and log-probabilities cost per step: sample() on random logits of the
embedded model's vocabulary, per batch size and scenario, and whole requests through the engine with and
without logprobs / prompt logprobs.

    python3 -m benchmarks.sampler_cost --device cpu

Scenarios (every row of the batch uses them; "one_row" mixes one penalised row into a plain batch):
greedy, sampled (temperature 0.8, top_p 0.95), penalties (sampled + presence, frequency and repetition
penalties over a 512-token prompt and 128 generated tokens), greedy_penalties (the same penalties, greedy: the
ops' own cost, without top-p's sort), all (penalties + logit_bias, min_tokens, min_p,
top_k), logprobs5 (greedy + top-5 logprobs). Median and minimum milliseconds per call, the scenarios timed
round robin (JSON under benchmarks/results/).
"""
from __future__ import annotations

import argparse
import statistics
import time

import torch

from benchmarks._results import write_result
from diffkv_serve.engine import SamplingParams
from diffkv_serve.engine.logits_processors import TokenHistory
from diffkv_serve.engine.sampler import sample
from diffkv_serve.engine.flags import add_engine_flags

SCENARIOS = {
    "greedy": dict(temperature=0),
    "sampled": dict(temperature=0.8, top_p=0.95),
    "penalties": dict(temperature=0.8, top_p=0.95, presence_penalty=0.5, frequency_penalty=0.5,
                      repetition_penalty=1.2),
    "greedy_penalties": dict(temperature=0, presence_penalty=0.5, frequency_penalty=0.5, repetition_penalty=1.2),
    "all": dict(temperature=0.8, top_p=0.95, presence_penalty=0.5, frequency_penalty=0.5, repetition_penalty=1.2,
                logit_bias={i: 1.0 for i in range(10)}, min_tokens=200, max_tokens=256, min_p=0.05, top_k=50,
                eos_token_ids=(2,)),
    "logprobs5": dict(temperature=0, logprobs=5),
}


def _sync(device: str) -> None:
    if device.startswith("cuda"):
        torch.cuda.synchronize()


def time_sampler(device: str, vocab: int, batches: list[int], iters: int, prompt_len: int, out_len: int) -> list:
    rows = []
    g = torch.Generator().manual_seed(0)
    for B in batches:
        logits = (torch.randn(B, vocab, generator=g) * 3).to(device)
        hist = TokenHistory([torch.randint(0, vocab, (prompt_len,), generator=g).tolist() for _ in range(B)],
                            [torch.randint(0, vocab, (out_len,), generator=g).tolist() for _ in range(B)],
                            [out_len] * B)
        cases = {name: [SamplingParams(**kw)] * B for name, kw in SCENARIOS.items()}
        cases["one_row"] = [SamplingParams(**SCENARIOS["penalties"])] + [SamplingParams(**SCENARIOS["sampled"])] * (B - 1)
        gens = [torch.Generator(device=device).manual_seed(i) for i in range(B)]
        times: dict[str, list[float]] = {name: [] for name in cases}
        # Round robin over the scenarios, so load from other processes falls on all of them alike.
        for it in range(iters + 2):
            for name, params in cases.items():
                _sync(device)
                t0 = time.perf_counter()
                out = sample(logits, params, gens, hist)
                out.tokens.tolist()  # the host reads the tokens, as a step does
                _sync(device)
                if it >= 2:
                    times[name].append((time.perf_counter() - t0) * 1e3)
        row = {"batch": B, "ms": {n: round(statistics.median(t), 3) for n, t in times.items()},
               "min_ms": {n: round(min(t), 3) for n, t in times.items()}}
        print(B, row["ms"], row["min_ms"])
        rows.append(row)
    return rows


def time_engine(device: str, num_requests: int, max_tokens: int) -> dict:
    from diffkv_serve.engine import EngineConfig
    from diffkv_serve.engine.llm_engine import LLMEngine
    from diffkv_serve.engine.loader import load_checkpoint

    eng = LLMEngine(EngineConfig(device=device, cache={"kv_mode": "fp16", "num_pages": 6000}),
                    checkpoint=load_checkpoint(None))
    g = torch.Generator().manual_seed(1)
    prompts = [torch.randint(100, 20000, (128,), generator=g).tolist() for _ in range(num_requests)]
    modes = {"none": {}, "logprobs5": {"logprobs": 5}, "logprobs5_prompt5": {"logprobs": 5, "prompt_logprobs": 5}}
    secs: dict[str, list[float]] = {m: [] for m in modes}
    for rep in range(5):
        for m in (list(modes) if rep % 2 == 0 else list(modes)[::-1]):
            sp = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True, **modes[m])
            t0 = time.perf_counter()
            for i, p in enumerate(prompts):
                eng.add_request(f"{m}-{rep}-{i}", p, sp)
            while eng.has_unfinished_requests():
                eng.step()
            _sync(device)
            secs[m].append(time.perf_counter() - t0)
    med = {m: round(statistics.median(v), 3) for m, v in secs.items()}
    low = {m: round(min(v), 3) for m, v in secs.items()}
    return {"requests": num_requests, "prompt_tokens": 128, "max_tokens": max_tokens, "seconds": med,
            "min_seconds": low, "ratio_vs_none": {m: round(v / med["none"], 3) for m, v in med.items()},
            "min_ratio_vs_none": {m: round(v / low["none"], 3) for m, v in low.items()}}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_engine_flags(ap, only=("device",), defaults={"device": "cpu"})
    ap.add_argument("--vocab", type=int, default=49152)  # SmolLM2's
    ap.add_argument("--batches", default="1,8,32")
    ap.add_argument("--iters", type=int, default=20)
    ap.add_argument("--engine-requests", type=int, default=4)
    ap.add_argument("--smoke", action="store_true", help="tiny shapes, no engine run (tests)")
    ap.add_argument("--out")
    a = ap.parse_args()
    if a.smoke:
        a.vocab, a.batches, a.iters = 1000, "1,3", 2
    result = {"benchmark": "sampler_cost", "device": a.device, "vocab": a.vocab, "threads": torch.get_num_threads(),
              "scenarios": {k: {f: (v if not isinstance(v, dict) else len(v)) for f, v in kw.items()}
                            for k, kw in SCENARIOS.items()},
              "sampler": time_sampler(a.device, a.vocab, [int(b) for b in a.batches.split(",")], a.iters, 512, 128)}
    if not a.smoke:
        result["engine"] = time_engine(a.device, a.engine_requests, 16)
        print(result["engine"])
    name = "sampler_cost"
    device = a.device if not a.device.startswith("cuda") else torch.cuda.get_device_name()
    write_result(result, name, device, a.out, a.smoke)


if __name__ == "__main__":
    main()
