"""Profile decode steps of a random-weight model: top operators by CUDA and CPU time (torch.profiler).

Usage: python benchmarks/profile_step.py --preset llama3-8b --batch 1 --prompt-len 512
"""
from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import torch
from torch.profiler import ProfilerActivity, profile

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from diffkv_serve.engine import EngineConfig, SamplingParams  # noqa: E402
from diffkv_serve.engine.llm_engine import LLMEngine  # noqa: E402
from diffkv_serve.engine.loader import load_checkpoint  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--preset", default="llama3-8b")
    ap.add_argument("--batch", type=int, nargs="+", default=[1])
    ap.add_argument("--prompt-len", type=int, default=512)
    ap.add_argument("--steps", type=int, default=10)
    ap.add_argument("--rows", type=int, default=15)
    args = ap.parse_args()
    ckpt = load_checkpoint(f"random:{args.preset}")
    engine = LLMEngine(EngineConfig(max_model_len=args.prompt_len + 64, scheduler={"max_num_seqs": max(args.batch)}),
                       checkpoint=ckpt)
    for b in args.batch:
        sp = SamplingParams(temperature=0, max_tokens=args.steps + 8, ignore_eos=True)
        for i in range(b):
            engine.add_request(f"{b}-{i}", torch.randint(0, 1000, (args.prompt_len,)).tolist(), sp)
        while engine.scheduler.waiting or any(not s.output_token_ids for s in engine.scheduler.running):
            engine.step()
        for _ in range(3):
            engine.step()
        torch.cuda.synchronize()
        with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
            t0 = time.perf_counter()
            for _ in range(args.steps):
                engine.step()
            dt = (time.perf_counter() - t0) / args.steps
        print(f"\n=== batch {b}: {dt * 1e3:.2f} ms/step wall ===")
        print(prof.key_averages().table(sort_by="cuda_time_total", row_limit=args.rows))
        print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=args.rows))
        while engine.has_unfinished_requests():
            engine.step()


if __name__ == "__main__":
    main()
