"""One decode step of our engine beside one of vLLM's, kernel by kernel, on the same batch: where a step's time
goes in each engine (GEMMs, attention, norms, sampling, the rest) and how long the step takes on the wall.

Both engines get the same random prompt ids (--batch prompts of --prompt-len tokens), the same random-weight model
(random:<preset>; vLLM loads dummy weights from its config.json), a bf16 cache (or --cache fp8), greedy sampling,
prefix caching off. Each runs in a process of its own after a warm-up that captures its CUDA graphs:
- wall time per decode step = (time of generate(max_tokens=1 + N) - time of generate(max_tokens=1)) / N, the
  better of two runs each;
- kernels per decode step: the same two calls under torch.profiler (CUDA activity only; kernels replayed from a
  CUDA graph are recorded one by one), each kernel's calls and time in the longer run minus the shorter, over N.
So prefill work cancels and what remains is N decode steps at batch --batch and about --prompt-len cached tokens.
The short call alone is the prefill of every prompt (and its one token): its wall time and kernels are kept too.

vLLM's process sees only --vllm-site (it never imports this project) and runs its engine core in-process
(VLLM_ENABLE_V1_MULTIPROCESSING=0) so that the profiler sees its kernels. Where vLLM cannot run (CPU, CI) its row
says why. scripts/device/vllm_compare.sh carries vLLM to the GPU box (`profile` there runs this script).

Usage (GPU):  python benchmarks/decode_step_profile.py --engines ours vllm --batch 32 --prompt-len 1024 \\
                  --vllm-site /tmp/vsite --out decode_step_profile.json
Smoke (CPU):  python benchmarks/decode_step_profile.py --smoke
"""
from __future__ import annotations

import argparse
import json
import os
import re
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

# Neither imports anything of this project: the vLLM child uses them too.
from _results import write_result  # noqa: E402
from vllm_baseline import CACHE_DTYPES, model_folder, run_child, vllm_llm, vllm_missing  # noqa: E402

# Kernel name -> what it does, first match wins (case-insensitive). Attention before GEMMs: FlashAttention's Hopper
# kernels carry "Sm90" in their names as cuBLAS's do.
CATEGORIES: tuple[tuple[str, str], ...] = (
    ("attention", r"flash|fmha|attention|attn|decode_mma|decode_\w*kernel|merge|paged|reshape_and_cache|write_kv"),
    ("gemm", r"gemm|cutlass|xmma|nvjet|cublas|splitk|sm90_|sm80_|wgmma"),
    ("norm", r"rms|norm"),
    ("rope", r"rotary|rope"),
    ("activation", r"silu|act_and_mul|gelu|swiglu"),
    ("sampling", r"sort|topk|top_k|argmax|argmin|max_|reduce|softmax|sample|gumbel|exponential|multinomial|penalt"),
    ("copy", r"copy|memcpy|memset|fill|cat|index|gather|scatter|embedding"),
)
_PATTERNS = [(name, re.compile(p, re.IGNORECASE)) for name, p in CATEGORIES]


def category(kernel: str) -> str:
    for name, pat in _PATTERNS:
        if pat.search(kernel):
            return name
    return "other"


def kernel_totals(prof, cuda: bool) -> dict[str, list[float]]:
    """{kernel name: [calls, microseconds]} over the CUDA kernels of a torch.profiler run (on CPU: the ops, by
    their self time, so nested ops count once)."""
    from torch.autograd import DeviceType

    out: dict[str, list[float]] = {}
    for evt in prof.events():
        if evt.device_type != (DeviceType.CUDA if cuda else DeviceType.CPU):
            continue
        us = evt.device_time if cuda else evt.self_cpu_time_total
        row = out.setdefault(evt.name, [0, 0.0])
        row[0] += 1
        row[1] += us
    return out


def per_step(short: dict[str, list[float]], long: dict[str, list[float]], steps: int) -> list[dict]:
    """Each kernel's calls and microseconds per decode step: the long run minus the short one, over `steps`;
    kernels that only the short run has (prefill remainders) drop out; sorted by time."""
    rows = []
    for name, (calls, us) in long.items():
        c0, u0 = short.get(name, (0, 0.0))
        calls_step, us_step = (calls - c0) / steps, (us - u0) / steps
        if calls_step > 0 and us_step > 0:
            rows.append({"kernel": name, "category": category(name), "calls": calls_step, "us": us_step})
    return sorted(rows, key=lambda r: -r["us"])


def summarize(kernels: list[dict]) -> dict[str, dict]:
    cats: dict[str, dict] = {}
    for r in kernels:
        c = cats.setdefault(r["category"], {"calls": 0.0, "us": 0.0})
        c["calls"] += r["calls"]
        c["us"] += r["us"]
    return cats


def measure(generate, prompts: list[list[int]], steps: int, synchronize) -> dict:
    """Wall time and kernels per decode step of `generate(prompts, max_tokens)` (which returns when done)."""
    import torch
    from torch.profiler import ProfilerActivity, profile

    cuda = torch.cuda.is_available()

    generate(prompts, 1 + steps)  # warm-up: CUDA graphs, compiled kernels
    generate(prompts, 1 + steps)

    def timed(max_tokens: int) -> float:
        synchronize()
        t0 = time.perf_counter()
        generate(prompts, max_tokens)
        synchronize()
        return time.perf_counter() - t0

    t_short = min(timed(1) for _ in range(2))
    t_long = min(timed(1 + steps) for _ in range(2))
    totals = []
    for max_tokens in (1, 1 + steps):
        with profile(activities=[ProfilerActivity.CUDA if cuda else ProfilerActivity.CPU]) as prof:
            generate(prompts, max_tokens)
            synchronize()
        totals.append(kernel_totals(prof, cuda))
    kernels = per_step(totals[0], totals[1], steps)
    prefill = per_step({}, totals[0], 1)  # the short run: the prompts' prefill and its one token
    return {"prefill_ms": t_short * 1e3, "prefill_tokens": sum(map(len, prompts)),
            "prefill_kernel_ms": sum(r["us"] for r in prefill) / 1e3, "prefill_kernels": prefill[:40],
            "prefill_categories": summarize(prefill),
            "wall_ms_per_step": (t_long - t_short) / steps * 1e3,
            "kernel_ms_per_step": sum(r["us"] for r in kernels) / 1e3,
            "kernels_per_step": sum(r["calls"] for r in kernels),
            "categories": summarize(kernels), "kernels": kernels}


# ---- the engines (each in its own process) -------------------------------------------------------------------
def run_ours(spec: dict) -> dict:
    import torch

    from diffkv_serve.engine import EngineConfig, SamplingParams
    from diffkv_serve.engine.llm_engine import LLMEngine
    from diffkv_serve.engine.loader import load_checkpoint

    ckpt = load_checkpoint(spec["model"])
    device = "cuda" if torch.cuda.is_available() else "cpu"
    mode = CACHE_DTYPES[spec["cache"]][1]
    cfg = EngineConfig(model=spec["model"], device=device, max_model_len=spec["max_model_len"],
                       cache={"kv_mode": mode, "kv_cache_memory_gb": spec["kv_memory_gb"],
                              "enable_prefix_caching": False},
                       scheduler={"max_num_seqs": spec["max_num_seqs"],
                                  "max_num_batched_tokens": spec["max_num_batched_tokens"]})
    engine = LLMEngine(cfg, checkpoint=ckpt)
    counter = iter(range(10**9))

    def generate(prompts, max_tokens):
        sp = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
        for ids in prompts:
            engine.add_request(f"p{next(counter)}", ids, sp)
        while engine.has_unfinished_requests():
            engine.step()

    sync = torch.cuda.synchronize if device == "cuda" else (lambda: None)
    res = measure(generate, spec["prompts"], spec["steps"], sync)
    return {"engine": "ours", "kv_mode": mode, "device": torch.cuda.get_device_name() if device == "cuda" else "cpu",
            "torch": torch.__version__, **res}


def run_vllm(spec: dict) -> dict:
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"  # engine core in this process: the profiler sees it
    import torch
    import vllm
    from vllm import SamplingParams

    llm = vllm_llm(spec, spec["cache"])

    def generate(prompts, max_tokens):
        llm.generate([{"prompt_token_ids": ids} for ids in prompts],
                     SamplingParams(max_tokens=max_tokens, ignore_eos=True, temperature=0), use_tqdm=False)

    res = measure(generate, spec["prompts"], spec["steps"], torch.cuda.synchronize)
    return {"engine": f"vLLM {vllm.__version__}", "kv_cache_dtype": spec["cache"],
            "device": torch.cuda.get_device_name(), "torch": torch.__version__, "vllm": vllm.__version__, **res}


# ---- driver --------------------------------------------------------------------------------------------------
def print_tables(rows: dict[str, dict], top: int) -> None:
    done = {k: r for k, r in rows.items() if "error" not in r}
    for k, r in rows.items():
        if "error" in r:
            print(f"{k}: not run ({r['error']})")
    if not done:
        return
    names = list(done)
    print("\nper decode step       " + "".join(f"{n:>16}" for n in names))
    print("wall ms               " + "".join(f"{done[n]['wall_ms_per_step']:>16.3f}" for n in names))
    print("kernel ms             " + "".join(f"{done[n]['kernel_ms_per_step']:>16.3f}" for n in names))
    print("kernels               " + "".join(f"{done[n]['kernels_per_step']:>16.0f}" for n in names))
    print("prefill ms (wall)     " + "".join(f"{done[n]['prefill_ms']:>16.2f}" for n in names))
    print("prefill ms (kernels)  " + "".join(f"{done[n]['prefill_kernel_ms']:>16.2f}" for n in names))
    cats = sorted({c for r in done.values() for c in r["categories"]})
    for c in cats:
        cells = "".join(f"{done[n]['categories'].get(c, {}).get('us', 0) / 1e3:>9.3f} ms"
                        f"{done[n]['categories'].get(c, {}).get('calls', 0):>4.0f}x" for n in names)
        print(f"  {c:<20}{cells}")
    for n in names:
        print(f"\n{n}: top {top} kernels per decode step")
        for r in done[n]["kernels"][:top]:
            print(f"  {r['us']:>9.1f} us {r['calls']:>6.1f}x  {r['category']:<10} {r['kernel'][:110]}")


def parse_args(argv):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--engines", nargs="+", default=["ours", "vllm"], choices=["ours", "vllm"])
    ap.add_argument("--model", default="random:qwen2.5-1.5b", help="random:<preset>")
    ap.add_argument("--cache", default="bf16", choices=sorted(CACHE_DTYPES), help="KV cache format of both engines")
    ap.add_argument("--batch", type=int, default=32, help="sequences decoding together")
    ap.add_argument("--prompt-len", type=int, default=1024, help="tokens cached when decoding starts")
    ap.add_argument("--steps", type=int, default=32, help="decode steps measured")
    ap.add_argument("--kv-memory-gb", type=float, default=4.0, help="KV pool of each engine (fits the batch)")
    ap.add_argument("--max-num-batched-tokens", type=int, default=16384)
    ap.add_argument("--top", type=int, default=20, help="kernels listed per engine")
    ap.add_argument("--vllm-site", default=os.environ.get("VLLM_SITE"), help="folder vLLM's wheels are installed in")
    ap.add_argument("--child-timeout", type=float, default=400.0)
    ap.add_argument("--out", default=None, help="JSON path (default benchmarks/results/decode_step_profile_<gpu>.json)")
    ap.add_argument("--smoke", action="store_true", help="our engine alone on CPU, random:tiny, a few steps")
    ap.add_argument("--child", default=None, help=argparse.SUPPRESS)
    ap.add_argument("--child-in", default=None, help=argparse.SUPPRESS)
    ap.add_argument("--child-out", default=None, help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.smoke:
        args.engines, args.model, args.batch, args.prompt_len, args.steps = ["ours"], "random:tiny", 4, 32, 4
        args.kv_memory_gb = 0.05
    for name in ("batch", "prompt_len", "steps"):
        if getattr(args, name) < 1:
            raise ValueError(f"--{name.replace('_', '-')} must be >= 1, got {getattr(args, name)}")
    if not args.model.startswith("random:"):
        raise ValueError(f"--model {args.model!r}: only random:<preset> (both engines use random weights)")
    return args


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    args = parse_args(argv)
    if args.child:  # one engine in this process
        spec = json.loads(Path(args.child_in).read_text())
        row = run_vllm(spec) if args.child == "vllm" else run_ours(spec)
        Path(args.child_out).write_text(json.dumps(row))
        return 0
    import random

    from diffkv_serve.engine.loader.presets import ARCH_PRESETS

    vocab = ARCH_PRESETS[args.model.removeprefix("random:")].vocab_size
    rng = random.Random(0)
    prompts = [[rng.randrange(vocab // 8, vocab) for _ in range(args.prompt_len)] for _ in range(args.batch)]
    rows: dict[str, dict] = {}
    with tempfile.TemporaryDirectory() as tmp:
        folder, dummy = model_folder(args.model, Path(tmp))
        spec = {"prompts": prompts, "folder": str(folder), "dummy": dummy, "model": args.model, "cache": args.cache,
                "steps": args.steps, "max_num_seqs": max(args.batch, 8), "seed": 0, "kv_memory_gb": args.kv_memory_gb,
                "max_model_len": args.prompt_len + args.steps + 8,
                "max_num_batched_tokens": args.max_num_batched_tokens}
        spec_path = Path(tmp) / "spec.json"
        spec_path.write_text(json.dumps(spec))
        for name in args.engines:
            why = vllm_missing(args.vllm_site) if name == "vllm" else None
            if why:
                rows[name] = {"error": why}
                continue
            env = dict(os.environ)
            if name == "vllm" and args.vllm_site:
                env["PYTHONPATH"] = args.vllm_site
            out = Path(tmp) / f"{name}.json"
            cmd = [sys.executable, str(Path(__file__).resolve()), "--child", name, "--child-in", str(spec_path),
                   "--child-out", str(out)] + (["--smoke"] if args.smoke else [])
            print(f"{name}: starting (limit {args.child_timeout:.0f} s)", flush=True)
            rc = run_child(cmd, args.child_timeout, env)
            rows[name] = json.loads(out.read_text()) if out.is_file() else {"error": f"exit {rc}"}
    print_tables(rows, args.top)
    done = [r for r in rows.values() if "error" not in r]
    device = done[0]["device"] if done else "unknown"
    result = {"benchmark": "decode_step_profile", "device": device, "model": args.model,
              "command": "python benchmarks/decode_step_profile.py " + " ".join(argv),
              "config": {k: v for k, v in vars(args).items() if not k.startswith("child")}, "engines": rows}
    write_result(result, "decode_step_profile", device, args.out, args.smoke)
    return 0 if done else 1


if __name__ == "__main__":
    sys.exit(main())
