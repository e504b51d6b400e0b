"""Where the host time of a generation step goes (issue 6: host overhead < 5% of a decode step at batch >= 64).

A decode step on the GPU is: schedule (including the scheduler's one device read), build the step's inputs,
launch the CUDA graphs, wait for the tokens (the GPU runs meanwhile), then per sequence append the token,
check stops and make its output. Everything but the wait leaves the GPU idle, because the next step is launched
only after this one's tokens are processed. This benchmark times each phase with perf_counter around the
engine's own methods (no profiler), per (mode, batch):

  schedule      Scheduler.schedule
  inputs        ModelRunner._decode without DecodeGraphs.run, plus DecodeGraphs.run without the graph replays
  launch        CUDAGraph.replay (graph launches)
  wait          ModelRunner._sample: the sampling launches and the wait for the tokens (the GPU's share)
  outputs       the rest of LLMEngine.step: per-sequence tokens, stop checks, outputs
  host          step - wait: what a step costs beyond the GPU (step_breakdown.py measures the same from the
                device side: wall - busy). With async scheduling (--async-scheduling on) the host's work overlaps
                the step in flight, "wait" is ModelRunner.collect and host is the host's own work, not GPU idle
                time (step_breakdown.py measures that).

Usage (GPU):  python benchmarks/host_overhead.py --preset llama3-8b --modes int4 diffkv --batches 64 256
Smoke (CPU):  python benchmarks/host_overhead.py --smoke   (eager steps: "wait" then includes the forward)
"""
from __future__ import annotations

import argparse
import sys
import time
from collections import defaultdict
from contextlib import contextmanager
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from diffkv_serve.engine.config import KV_MODES  # noqa: E402
from _results import write_result  # noqa: E402
from step_breakdown import abort_all, add_prompts, build_engine  # noqa: E402
from diffkv_serve.engine.cuda_graph import DecodeGraphs  # noqa: E402
from diffkv_serve.engine.llm_engine import LLMEngine  # noqa: E402
from diffkv_serve.engine.model_runner import ModelRunner  # noqa: E402
from diffkv_serve.engine.scheduler import Scheduler  # noqa: E402
from diffkv_serve.engine.flags import add_engine_flags  # noqa: E402

# (class, method, timer): the time inside each call is added to its timer.
TIMED = ((Scheduler, "schedule", "schedule"), (ModelRunner, "_decode", "decode"), (DecodeGraphs, "run", "graphs"),
         (torch.cuda.CUDAGraph, "replay", "launch"), (ModelRunner, "_sample", "wait"), (ModelRunner, "collect", "wait"),
         (LLMEngine, "step", "step"))
PHASES = ("schedule", "inputs", "launch", "wait", "outputs", "host")


@contextmanager
def timers():
    """Patch the TIMED methods to add their call times (seconds) to a dict; restored on exit."""
    acc: dict[str, float] = defaultdict(float)
    saved = []
    for cls, name, key in TIMED:
        fn = getattr(cls, name)
        saved.append((cls, name, fn))

        def timed(*a, _fn=fn, _key=key, **kw):
            t0 = time.perf_counter()
            try:
                return _fn(*a, **kw)
            finally:
                acc[_key] += time.perf_counter() - t0
        setattr(cls, name, timed)
    try:
        yield acc
    finally:
        for cls, name, fn in saved:
            setattr(cls, name, fn)


def phases(acc: dict[str, float], steps: int) -> dict[str, float]:
    """Exclusive ms per step of each phase from the (nested) method timers."""
    ms = {k: 1e3 * v / steps for k, v in acc.items()}
    step, launch, graphs = ms.get("step", 0.0), ms.get("launch", 0.0), ms.get("graphs", 0.0)
    out = {"step": step, "schedule": ms.get("schedule", 0.0), "launch": launch, "wait": ms.get("wait", 0.0),
           "inputs": ms.get("decode", 0.0) - launch}  # graphs.run and its replays happen inside _decode
    if graphs == 0:  # eager (CPU): _decode runs the forward itself; count it with the wait
        out["wait"] += out["inputs"]
        out["inputs"] = 0.0
    out["outputs"] = step - out["schedule"] - out["inputs"] - out["launch"] - out["wait"]
    out["host"] = step - out["wait"]
    return out


def measure(engine: LLMEngine, mode: str, batch: int, seq: int, steps: int) -> dict:
    add_prompts(engine, f"{mode}-{batch}", batch, seq, steps + 8)
    while engine.scheduler.waiting:
        engine.step()
    for _ in range(3):  # every sequence decoding; the first decode step of a batch size captures its graph
        engine.step()
    if engine.runner.device.type == "cuda":
        torch.cuda.synchronize()
    with timers() as acc:
        for _ in range(steps):
            engine.step()
    running = len(engine.scheduler.running)
    abort_all(engine)
    p = phases(acc, steps)
    return {"mode": mode, "batch": batch, "seq": seq, "steps": steps, "running": running,
            "ms": p, "pct": {k: 100 * p[k] / p["step"] for k in PHASES}}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--preset", default="llama3-8b")
    ap.add_argument("--modes", nargs="+", default=["int4", "diffkv"], choices=KV_MODES)
    ap.add_argument("--batches", type=int, nargs="+", default=[64, 256])
    ap.add_argument("--seq", type=int, default=1024, help="prompt length")
    ap.add_argument("--steps", type=int, default=16, help="decode steps timed per (mode, batch)")
    add_engine_flags(ap, only=("device",), defaults={"device": "auto"})
    ap.add_argument("--async-scheduling", nargs="+", default=["off", "on"], choices=["auto", "on", "off"],
                    help="engine settings measured, each on its own engine")
    ap.add_argument("--out", default=None, help="JSON path (default benchmarks/results/host_overhead_<gpu>.json)")
    ap.add_argument("--smoke", action="store_true", help="tiny model on CPU")
    args = ap.parse_args(argv)
    if args.smoke:
        args.preset, args.batches, args.seq, args.steps = "tiny", [2, 4], 16, 3
        args.device = "cpu" if args.device == "auto" else args.device
        torch.set_num_threads(1)
    args.dtype, args.eager, args.prefix_caching = "auto", False, "auto"
    args.num_pages, args.kv_cache_gb, args.max_batched_tokens = (64 if args.smoke else None), None, 8192
    rows, gpu = [], "cpu"
    for mode in args.modes:
        for setting in args.async_scheduling:
            engine = build_engine(mode, args, args.seq + args.steps + 32, setting)
            gpu = torch.cuda.get_device_name(engine.runner.device) if engine.runner.device.type == "cuda" else "cpu"
            rows += [{**measure(engine, mode, b, args.seq, args.steps), "async_scheduling": setting,
                      "async_steps": engine.executor.async_steps} for b in args.batches]
            engine.shutdown()
            del engine
            if torch.cuda.is_available():
                torch.cuda.empty_cache()
    print(f"{'mode':>7} {'async':>5} {'batch':>5} {'step ms':>8} " + " ".join(f"{p:>15}" for p in PHASES))
    for r in rows:
        cells = " ".join(f"{r['ms'][p]:7.3f} ({r['pct'][p]:4.1f}%)" for p in PHASES)
        print(f"{r['mode']:>7} {str(r['async_steps']):>5} {r['batch']:>5} {r['ms']['step']:8.3f} {cells}")
    result = {"benchmark": "host_overhead", "device": gpu, "preset": args.preset, "torch": torch.__version__,
              "command": " ".join(["python", "benchmarks/host_overhead.py", *(argv or sys.argv[1:])]),
              "phases": list(PHASES), "rows": rows}
    write_result(result, "host_overhead", gpu, args.out, args.smoke)
    return 0


if __name__ == "__main__":
    sys.exit(main())
