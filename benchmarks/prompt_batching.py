"""Scheduler settings for prompt steps, swept side by side on one engine per KV mode: prompt batching
(SchedulerConfig.prefill_min_prompts / prefill_max_delay_steps) and the admission watermark (prefill_watermark).

Serving with natural stops keeps the pool full: pages come back one finished sequence at a time, and a prompt
step (which stops every running sequence's decoding for one forward) admits one or two prompts. This benchmark
runs throughput_qwen.py's workload (the accuracy study's prompts, one pool for every mode, natural stops by
default) once per variant on the same engine, built and warmed up once per mode: the variants differ only in the
scheduler's settings, which are swapped between runs. The first variant is run again last, so drift shows.

Each row: tokens/s and its ratio to the mode's first variant, prompt steps and their wall time, decode steps and
theirs, preemptions (each one recomputes a sequence in a later prompt step), decode steps a fitting prompt was
held back (deferred), the mean running batch.

GPU (Qwen2.5-Coder-1.5B on the device box):
    bash scripts/device/qwen_run.sh python3 benchmarks/prompt_batching.py --out "$OUT"
Smoke (CPU, tiny random model): python benchmarks/prompt_batching.py --smoke
"""
from __future__ import annotations

import argparse
import platform
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

import throughput_qwen as tq  # noqa: E402
from _results import write_result  # noqa: E402
from diffkv_serve.engine.config import SchedulerConfig  # noqa: E402
from diffkv_serve.engine.flags import add_engine_flags  # noqa: E402
from diffkv_serve.engine.loader import load_checkpoint  # noqa: E402
from diffkv_serve.engine.model_runner import resolve_device  # noqa: E402

KNOBS = {"k": "prefill_min_prompts", "delay": "prefill_max_delay_steps", "w": "prefill_watermark"}
DEFAULT_VARIANTS = ["k=1,w=0", "k=4,delay=8,w=0", "k=8,delay=16,w=0", "k=16,delay=32,w=0", "k=1,w=0.01",
                    "k=8,delay=16,w=0.01"]


def label(cfg: SchedulerConfig) -> str:
    """A variant as its resolved settings (what was not given is the default)."""
    return ",".join(f"{short}={getattr(cfg, field):g}" for short, field in KNOBS.items())


def parse_variant(spec: str) -> dict:
    """'k=8,delay=16,w=0.01' -> SchedulerConfig fields (k, delay, w, or the fields' own names), validated."""
    out = {}
    for part in filter(None, spec.split(",")):
        key, sep, value = part.partition("=")
        field = KNOBS.get(key.strip(), key.strip())
        if not sep or field not in SchedulerConfig.model_fields:
            raise ValueError(f"--variants {spec!r}: {part!r} is not k=.., delay=.., w=.. or a SchedulerConfig field")
        out[field] = float(value) if field == "prefill_watermark" else int(value)
    SchedulerConfig(**out)  # a bad value names its field
    return out


def parse_args(argv):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    add_engine_flags(ap, only=("model", "device", "dtype"),
                     defaults={"model": "qwen2.5-coder-1.5b", "device": "auto", "dtype": "auto"})
    ap.add_argument("--modes", nargs="+", default=["int4", "diffkv"])
    ap.add_argument("--variants", nargs="+", default=DEFAULT_VARIANTS,
                    help="scheduler settings per run: k (prefill_min_prompts), delay (prefill_max_delay_steps), w "
                         "(prefill_watermark), the defaults for what is not given; the first is the baseline, run "
                         "again last")
    tq.add_workload_flags(ap, num_prompts=1024, max_tokens=1024)
    ap.add_argument("--ignore-eos", action="store_true", help="every request generates --max-tokens")
    ap.add_argument("--time-limit", type=float, default=540.0, help="seconds: runs that would pass it are skipped")
    ap.add_argument("--quiet", action="store_true")
    ap.add_argument("--out", default=None, help="JSON path")
    ap.add_argument("--smoke", action="store_true", help="tiny random-weight model on CPU, short generations")
    args = ap.parse_args(argv)
    if args.smoke:
        args.model, args.device = "random:tiny-qwen2", "cpu"
        args.num_prompts, args.max_tokens, args.fp16_seqs, args.stats_every, args.quiet = 8, 10, 2, 1, True
        args.variants = ["k=1,w=0", "k=3,delay=4,w=0.05"]
        args.max_prompt_tokens = 24
    else:
        args.max_prompt_tokens = None
    args.natural_stop = not args.ignore_eos
    args.max_num_seqs = args.max_num_seqs or args.num_prompts
    args.max_model_len = None
    try:
        args.parsed = [parse_variant(v) for v in args.variants]
        for name in ("num_prompts", "max_tokens", "fp16_seqs", "max_num_seqs", "stats_every"):
            if getattr(args, name) < 1:
                raise ValueError(f"--{name.replace('_', '-')} {getattr(args, name)}: must be at least 1")
    except ValueError as e:
        ap.error(str(e))
    return args


def use_settings(eng, variant: dict) -> None:
    """Swap the engine's scheduler settings: its own, with `variant`'s fields replaced (validated)."""
    eng.scheduler.config = SchedulerConfig(**{**eng.config.scheduler.model_dump(), **variant})


def run_row(eng, prompts, args, mode: str, spec: str, variant: dict, deadline: float) -> dict:
    """One timed pass of the workload under `variant` (the engine's scheduler settings, swapped in)."""
    use_settings(eng, variant)
    deferred = eng.scheduler.num_deferred_steps
    r = tq.timed_run(eng, prompts, args, f"{mode}-{spec}", deadline)
    ph = r["phases"]
    return {"mode": mode, "variant": spec, "settings": variant, "resolved": label(eng.scheduler.config),
            "tokens_per_s": r["tokens_per_s"],
            "seconds": r["seconds"], "tokens": r["tokens"], "cut": r["cut"], "steps": r["steps"],
            "prompt_steps": ph["prefill"]["steps"], "prompt_seconds": ph["prefill"]["seconds"],
            "prompt_tokens": ph["prefill"]["tokens"], "decode_steps": ph["decode"]["steps"],
            "decode_seconds": ph["decode"]["seconds"], "preemptions": r["preemptions"],
            "deferred_steps": eng.scheduler.num_deferred_steps - deferred, "mean_batch": r["mean_batch"],
            "compression_ratio": r["compression_ratio"]}


def print_table(rows: list[dict]) -> None:
    print(f"\n{'mode':>7} {'settings':>22} {'tok/s':>7} {'x first':>7} {'prompt steps':>12} {'prompt s':>8} "
          f"{'decode steps':>12} {'decode s':>8} {'preempt':>7} {'deferred':>8} {'batch':>6}")
    for r in rows:
        x = f"{r['vs_first']:.3f}" if r.get("vs_first") else "-"
        again = " (again)" if r["variant"].endswith("(again)") else ""
        print(f"{r['mode']:>7} {r['resolved'] + again:>22} {r['tokens_per_s']:>7.0f} {x:>7} {r['prompt_steps']:>12} "
              f"{r['prompt_seconds']:>8.2f} {r['decode_steps']:>12} {r['decode_seconds']:>8.2f} "
              f"{r['preemptions']:>7} {r['deferred_steps']:>8} {r['mean_batch'] or 0:>6.1f}"
              f"{' (cut)' if r['cut'] else ''}")


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    args = parse_args(argv)
    start = time.perf_counter()
    deadline = start + args.time_limit
    torch.manual_seed(0)
    ckpt = load_checkpoint(args.model)
    prompts = tq.load_prompts(ckpt, args.tasks, args.num_prompts, args.max_prompt_tokens)
    seq_tokens = max(map(len, prompts)) + args.max_tokens
    args.max_model_len = seq_tokens + 1
    if args.kv_memory_gb is None:
        args.kv_memory_gb = tq.pool_gb_for(ckpt, args, seq_tokens)
    cuda = resolve_device(args.device).type == "cuda"
    gpu = torch.cuda.get_device_name() if cuda else (platform.processor() or "cpu")
    print(f"{gpu} | {ckpt.name} | {len(prompts)} prompts (mean {statistics.mean(map(len, prompts)):.0f} tokens) x "
          f"{args.max_tokens} new ({'natural stop' if args.natural_stop else 'ignore_eos'}) | KV pool "
          f"{args.kv_memory_gb:.3f} GiB | variants {' | '.join(args.variants)}", flush=True)
    order = list(zip(args.variants, args.parsed)) + [(args.variants[0] + " (again)", args.parsed[0])]
    rows, skipped = [], []
    for mode in args.modes:
        eng = tq.build_engine(ckpt, mode, args)
        use_settings(eng, args.parsed[0])  # a full warm-up runs under the first variant
        tq.warm_up(eng, prompts, seq_tokens, args)
        cache = eng.config.cache.describe()
        last = None
        for spec, variant in order:
            if time.perf_counter() + (last or 0.0) > deadline:
                skipped.append({"mode": mode, "variant": spec})
                print(f"{mode} {spec}: skipped, --time-limit", flush=True)
                continue
            row = run_row(eng, prompts, args, mode, spec, variant, deadline)
            row["cache"] = cache
            rows.append(row)
            last = row["seconds"]
            print(f"{mode} {spec}: {row['tokens_per_s']:.0f} tok/s, prompt steps {row['prompt_steps']} "
                  f"({row['prompt_seconds']:.2f} s), preemptions {row['preemptions']}, deferred "
                  f"{row['deferred_steps']}", flush=True)
        tq.free_engine(eng)
        del eng
        tq.release_memory()
    for r in rows:
        first = next(x for x in rows if x["mode"] == r["mode"])
        r["vs_first"] = r["tokens_per_s"] / first["tokens_per_s"] if first["tokens_per_s"] else None
    print_table(rows)
    result = {"benchmark": "prompt_batching", "device": gpu, "torch": torch.__version__, "model": ckpt.name,
              "command": "python benchmarks/prompt_batching.py " + " ".join(argv),
              "kv_memory_gb": args.kv_memory_gb, "seq_tokens": seq_tokens, "skipped_runs": skipped,
              "seconds_total": time.perf_counter() - start,
              "config": {k: v for k, v in vars(args).items() if k not in ("quiet", "parsed")}, "rows": rows}
    write_result(result, f"prompt_batching_{tq.model_tag(ckpt.name)}", gpu, args.out, args.smoke)
    return 0


if __name__ == "__main__":
    sys.exit(main())
