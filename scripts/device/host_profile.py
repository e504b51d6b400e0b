"""cProfile of the host side of engine steps on the GPU box: one prompt step and a run of decode steps
(random-weight model), top functions by own time. Shows where a step's host time goes (step_breakdown.py only
says how much there is).

Usage: python scripts/device/host_profile.py --preset smollm2-135m --mode diffkv --batch 16 --prompt 1024
"""
from __future__ import annotations

import argparse
import cProfile
import io
import pstats
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from diffkv_serve.engine import EngineConfig, SamplingParams  # noqa: E402
from diffkv_serve.engine.llm_engine import LLMEngine  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--preset", default="smollm2-135m")
    ap.add_argument("--mode", default="diffkv")
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--prompt", type=int, default=1024)
    ap.add_argument("--decode-steps", type=int, default=30)
    ap.add_argument("--rows", type=int, default=25)
    args = ap.parse_args()
    cfg = EngineConfig(model=f"random:{args.preset}", cache={"kv_mode": args.mode, "kv_cache_memory_gb": 4},
                       scheduler={"max_num_seqs": 256, "max_num_batched_tokens": args.batch * args.prompt})
    eng = LLMEngine(cfg)
    sync = torch.cuda.synchronize if torch.cuda.is_available() else (lambda: None)
    g = torch.Generator().manual_seed(0)
    V = eng.arch.vocab_size

    def add(tag, n_tokens):
        for i in range(args.batch):
            eng.add_request(f"{tag}{i}", torch.randint(1, V, (args.prompt,), generator=g).tolist(),
                            SamplingParams(temperature=0, max_tokens=n_tokens, ignore_eos=True))

    add("w", 8)  # compile and capture
    while eng.has_unfinished_requests():
        eng.step()
    sync()
    add("p", args.decode_steps + 40)
    for what, steps in (("prompt", 1), ("decode", args.decode_steps)):
        if what == "decode":
            for _ in range(5):
                eng.step()
        sync()
        pr = cProfile.Profile()
        t0 = time.perf_counter()
        pr.enable()
        for _ in range(steps):
            eng.step()
        sync()
        pr.disable()
        dt = (time.perf_counter() - t0) / steps
        s = io.StringIO()
        pstats.Stats(pr, stream=s).sort_stats("tottime").print_stats(args.rows)
        print(f"==== {args.mode} {what} batch {args.batch} prompt {args.prompt}: {dt * 1e3:.2f} ms/step (profiled)")
        print("\n".join(s.getvalue().splitlines()[4:]))


if __name__ == "__main__":
    main()
