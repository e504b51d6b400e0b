"""Generation throughput per KV mode on a real model, at that mode's measured task accuracy.

The accuracy study's prompts (eval split, chat template, the task's instruction) are all submitted at once and
generate --max-tokens each (ignore_eos; --natural-stop lets them end at EOS), on ONE KV page pool for every mode:
--kv-memory-gb, or by default the pool that holds --fp16-seqs sequences of the longest prompt + max_tokens in the
16-bit cache, so a mode that stores a token in fewer bytes keeps more sequences running. Each mode has its own
engine, built and warmed up (kernels compiled, every decode CUDA graph captured) before anything is timed, timed
--repeats times (noise shows as spread between a mode's runs), and freed before the next mode's engine is built:
one engine, with its pool and CUDA graphs, holds device memory at a time.

Each row carries the mode's accuracy difference vs fp16 on --accuracy-task with its paired 95% interval, read
from the accuracy study's committed summary (evals/results/<model>/summary.json, matched by model name), so the
table reads tokens/s AT accuracy: ratios vs fp16 and vs the fastest mode within --within points of fp16.

Modes (the study configuration each maps to): fp16 (fp16), fp8 (fp8, once the engine has that kv_mode), int8
(k8v8), k8v4 (uniform K8V4: diffkv with high = low = K8V4 and both alphas 0, as evals/configs.py), int4 (k4v4,
keys centered as the engine does by default), diffkv (the model's calibrated default); any other kv_mode of
engine.config runs as itself, and so does a configuration of evals/configs.py's parse_config (`uniform:K2V2`,
`diffkv:alpha_high=2,alpha_low=0.1,high=K4V4,low=K2V2`).

Every run keeps a trace (every --stats-every steps): sequences running and waiting, pages in use, pages the
running sequences hold, their tokens kept high / low / pruned and the preemptions so far, so where the pool goes
and why the batch is what it is can be read per mode (TRACE_FIELDS).

--time-limit (seconds since start) stops starting runs that would not finish in time and cuts a run that
overruns, and the JSON and table are written either way.

GPU (Qwen2.5-Coder-1.5B on the device box):
    bash scripts/device/qwen_run.sh python3 benchmarks/throughput_qwen.py --out "$OUT"
Smoke (CPU, tiny random model): python benchmarks/throughput_qwen.py --smoke
"""
from __future__ import annotations

import argparse
import json
import gc
import platform
import re
import statistics
import sys
import time
import typing
from pathlib import Path

START = time.perf_counter()  # --time-limit counts from here: imports and model loading are part of the call

import torch  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from _results import gpu_tag, write_result  # noqa: E402
from _step_loop import step_until_done  # noqa: E402
from study_accuracy import accuracy_vs_fp16, fastest_within, find_study, load_study  # noqa: E402
from diffkv_serve.engine import EngineConfig, SamplingParams  # noqa: E402
from diffkv_serve.engine.config import GRAPH_BATCH_CAP, KVMode  # noqa: E402
from diffkv_serve.engine.llm_engine import LLMEngine  # noqa: E402
from diffkv_serve.engine.loader import load_checkpoint  # noqa: E402
from diffkv_serve.engine.kv.reservation import worst_case_pages  # noqa: E402
from diffkv_serve.engine.model_runner import resolve_device, resolve_dtype  # noqa: E402
from evals.configs import baseline_configs, diffkv_config, parse_config  # noqa: E402
from evals.problems import load_problems  # noqa: E402
from evals.tasks import task_prompt  # noqa: E402
from diffkv_serve.kernels.page_layout import PageFormat, page_bytes_for  # noqa: E402
from diffkv_serve.engine.flags import add_engine_flags  # noqa: E402

KV_MODES = typing.get_args(KVMode)
# Benchmark mode -> the accuracy study's configuration of the same cache (evals/configs.py names).
STUDY_NAMES = {"fp16": "fp16", "fp8": "fp8", "int8": "k8v8", "k8v4": "k8v4", "int4": "k4v4", "diffkv": "diffkv"}
MODE_ORDER = ("fp16", "fp8", "int8", "k8v4", "int4", "diffkv")
# One row of a run's trace, every --stats-every steps (tokens_*: over (layer, KV head) pairs of running sequences).
TRACE_FIELDS = ("step", "running", "waiting", "pages_used", "pages_running", "cached_tokens", "tokens_high",
                "tokens_low", "tokens_pruned", "preemptions")


def mode_cache(mode: str) -> dict:
    """Cache settings of a benchmark mode: the study's own configuration where it has one."""
    if mode == "diffkv":
        return dict(diffkv_config(None, None).cache)  # alphas and precisions from the model's settings file
    study = {c.name: c for c in baseline_configs()}
    name = STUDY_NAMES.get(mode)
    if name in study:
        return dict(study[name].cache)
    if mode in KV_MODES:
        return {"kv_mode": mode}
    if ":" in mode:  # a frontier point: uniform:KxVy or diffkv:alpha_high=..,alpha_low=..[,high=..][,low=..]
        return dict(parse_config(mode).cache)
    raise ValueError(f"--modes {mode!r}: not a benchmark mode ({', '.join(MODE_ORDER)}), a kv_mode of this "
                     f"engine ({', '.join(KV_MODES)}) nor a configuration (uniform:KxVy, diffkv:alpha_high=..)")


def available_modes() -> list[str]:
    """The default --modes: every benchmark mode this engine can run (fp8 only where it is a kv_mode)."""
    return [m for m in MODE_ORDER if mode_cache_or_none(m) is not None]


def mode_cache_or_none(mode: str):
    try:
        cache = mode_cache(mode)
    except ValueError:
        return None
    return cache if cache["kv_mode"] in KV_MODES else None


def model_tag(name: str) -> str:
    """A short file-name tag of a model: 'Qwen2.5-Coder-1.5B-Instruct-Q4_K_M' -> 'qwen2.5-1.5b'."""
    m = re.match(r"(qwen[\d.]*)\D.*?(\d+(?:\.\d+)?b)\b", name.lower())
    if m:
        return f"{m[1]}-{m[2]}"
    return re.sub(r"[^a-z0-9.]+", "-", name.lower().removeprefix("random:")).strip("-")


def load_prompts(ckpt, tasks: list[str], n: int, max_prompt_tokens: int | None) -> list[list[int]]:
    """The study's prompts: eval-split problems of `tasks` in turn (task instruction, chat template with the
    assistant turn opened), `n` in all, each cut to max_prompt_tokens when given."""
    by_task = {t: load_problems(split="eval", tasks=(t,)) for t in tasks}
    for t, ps in by_task.items():
        if not ps:
            raise ValueError(f"--tasks {t!r}: no eval problems of that task in evals/data/problems.jsonl")
    tok = ckpt.tokenizer
    out = []
    for i in range(n):
        t = tasks[i % len(tasks)]
        p = by_task[t][(i // len(tasks)) % len(by_task[t])]
        text = task_prompt(t, p.question)
        if getattr(tok, "chat_template", None):
            ids = tok.encode(tok.apply_chat_template([{"role": "user", "content": text}], add_generation_prompt=True),
                             add_special_tokens=False)
        else:  # random-weight presets: a byte-level tokenizer without a template
            ids = tok.encode(text)
        out.append(ids[:max_prompt_tokens] if max_prompt_tokens else ids)
    return out


def pool_gb_for(ckpt, args, seq_tokens: int) -> float:
    """The pool (GiB) that holds args.fp16_seqs sequences of seq_tokens in the 16-bit cache (all pages counted)."""
    arch = ckpt.arch
    itemsize = torch.tensor([], dtype=resolve_dtype(args.dtype, resolve_device(args.device))).element_size()
    page_bytes = page_bytes_for(args.block_size, arch.head_dim, itemsize, tracked=False)  # the fp16 cache's pages
    tokens = PageFormat.make(16, 16, arch.head_dim, page_bytes, itemsize, tracked=False).tokens
    pages = args.fp16_seqs * worst_case_pages(arch.num_layers * arch.num_kv_heads, tokens, 0, seq_tokens) + 1
    return pages * page_bytes / 2**30


def fp16_token_bytes(arch) -> int:
    """One token's K and V over every layer and KV head at 16 bits (the reference of compression ratios)."""
    return 2 * 2 * arch.head_dim * arch.num_layers * arch.num_kv_heads


def build_engine(ckpt, mode: str, args) -> LLMEngine:
    cfg = EngineConfig(model=args.model, device=args.device, dtype=args.dtype, max_model_len=args.max_model_len,
                       max_graph_batch_size=min(args.max_num_seqs, GRAPH_BATCH_CAP),
                       cache={**mode_cache(mode), "block_size": args.block_size,
                              "kv_cache_memory_gb": args.kv_memory_gb},
                       scheduler={"max_num_seqs": args.max_num_seqs,
                                  "max_num_batched_tokens": args.max_num_batched_tokens,
                                  "reservation": args.reservation})
    return LLMEngine(cfg, checkpoint=ckpt)


def drain(engine: LLMEngine) -> None:
    """Abort whatever runs and let a step in flight land, so the engine is idle and its pages free."""
    for rid in list(engine.requests):
        engine.abort(rid)
    while engine.has_unfinished_requests():
        engine.step()


def warm_up(engine: LLMEngine, prompts: list[list[int]], seq_tokens: int, args) -> None:
    """Untimed: the prompts' prefill shapes, a prefill as long as a recomputed (preempted) sequence gets, and
    every decode CUDA graph bucket, so no run pays for compiling or capturing."""
    warm = SamplingParams(temperature=0, max_tokens=2, ignore_eos=True)
    for i, ids in enumerate(prompts[: args.max_num_seqs]):
        engine.add_request(f"warm{i}", ids, warm)
    long = (prompts[0] * (seq_tokens // len(prompts[0]) + 1))[: seq_tokens - 2]
    if engine.mm.pages_for_tokens(len(long) + 1) <= engine.mm.num_pages:
        engine.add_request("warm-long", long, warm)
    while engine.has_unfinished_requests():
        engine.step()
    graphs = getattr(engine.runner, "graphs", None)
    if graphs is not None:
        graphs.capture_all()
    engine.reset_prefix_cache()
    if getattr(args, "warmup", "short") == "full":
        # The whole workload once, untimed: Triton compiles a decode variant per split count as sequences grow,
        # which the short pass above never reaches; a mode's first timed run paid for it (25-35% slower on an H200).
        timed_run(engine, prompts, args, "warmup-full", float("inf"))


def timed_run(engine: LLMEngine, prompts: list[list[int]], args, tag: str, deadline: float) -> dict:
    """One pass of the workload; cut (and flagged) if it is still running at `deadline`."""
    engine.reset_prefix_cache()  # every run starts from the same empty prefix cache
    before = engine.stats()
    sp = SamplingParams(temperature=0, max_tokens=args.max_tokens, ignore_eos=not args.natural_stop)
    for i, ids in enumerate(prompts):
        engine.add_request(f"{tag}-{i}", ids, sp)

    def trace_row(st: dict, step: int, seconds: float) -> list:
        return [step, st["num_running"], st["num_waiting"], st["pages_used"], st["pages_running"], st["cached_tokens"],
                st["tokens_high"], st["tokens_low"], st["tokens_pruned"],
                st["num_preemptions"] - before["num_preemptions"]]

    run = step_until_done(engine, len(prompts) * args.max_tokens, tag, args.quiet, args.stats_every,
                          sample=trace_row, deadline=deadline, drain=lambda: drain(engine))
    st = engine.stats()
    return {**run, "preemptions": st["num_preemptions"] - before["num_preemptions"],
            "overflows": st["reservation"]["overflows"] - before["reservation"]["overflows"]}


def free_engine(engine: LLMEngine) -> None:
    """Stop an engine and destroy its CUDA graphs (they hold their pool until destroyed); the caller drops its
    last reference and calls release_memory() so the weights and page pool go back too."""
    engine.shutdown()
    graphs = getattr(getattr(engine, "runner", None), "graphs", None)
    if graphs is not None:
        graphs.graphs.clear()


def release_memory() -> None:
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


def should_start(now: float, expected_s: float | None, deadline: float) -> bool:
    """Start a run only if its expected length (the same mode's last run, else the longest run so far) fits."""
    return now + (expected_s or 0.0) <= deadline


def summarize(row: dict, runs: list[dict]) -> None:
    """Per-mode totals over its complete runs: median tokens/s and the spread (max - min) / median."""
    done = [r for r in runs if not r["cut"]]
    tps = [r["tokens_per_s"] for r in done]
    row["runs"] = runs
    row["tokens_per_s"] = statistics.median(tps) if tps else None
    row["spread"] = (max(tps) - min(tps)) / row["tokens_per_s"] if len(tps) > 1 and row["tokens_per_s"] else None
    for k in ("mean_batch", "max_batch", "compression_ratio", "preemptions", "overflows", "steps"):
        vals = [r[k] for r in done if r[k] is not None]
        row[k] = statistics.median(vals) if vals else None
    if row["compression_ratio"]:  # sequences of this length the pool holds at the compression measured
        row["seqs_fit_measured"] = int(row["pool_bytes"] * row["compression_ratio"] // row["fp16_seq_bytes"])


def add_ratios(rows: list[dict], within: float) -> dict | None:
    base = next((r for r in rows if r["mode"] == "fp16" and r["tokens_per_s"]), None)
    best = fastest_within(rows, within)
    for r in rows:
        tps = r["tokens_per_s"]
        r["vs_fp16"] = tps / base["tokens_per_s"] if tps and base else None
        r["vs_best_within"] = tps / best["tokens_per_s"] if tps and best else None
    return best


def print_table(rows: list[dict], best: dict | None, args) -> None:
    def f(v, spec):
        return format(v, spec) if v is not None else "-"

    def acc(a):
        if a["diff_points"] is None:
            return "not measured"
        lo, hi = a["ci95_points"]
        return f"{a['diff_points']:+.1f} [{lo:+.1f}, {hi:+.1f}]"

    print(f"\n{'mode':>8} {'study':>7} {args.accuracy_task + ' vs fp16 (pts)':>28} {'fit':>4} {'tok/s':>7} "
          f"{'spread':>7} {'x fp16':>7} {'x best':>7} {'batch':>6} {'compr.':>6} {'preempt':>7}  runs (tok/s)")
    for r in rows:
        runs = " ".join(f"{x['tokens_per_s']:.0f}{'*' if x['cut'] else ''}" for x in r["runs"]) or "skipped"
        spread = f"{100 * r['spread']:.1f}%" if r["spread"] is not None else "-"
        print(f"{r['mode']:>8} {r['accuracy']['study_config']:>7} {acc(r['accuracy']):>28} {r['seqs_fit']:>4} "
              f"{f(r['tokens_per_s'], '.0f'):>7} {spread:>7} {f(r['vs_fp16'], '.2f'):>7} "
              f"{f(r['vs_best_within'], '.2f'):>7} {f(r['mean_batch'], '.1f'):>6} "
              f"{f(r['compression_ratio'], '.2f'):>6} {f(r['preemptions'], '.0f'):>7}  {runs}")
    print(f"fit: sequences of prompt + {args.max_tokens} tokens the pool admits all-high; x best: vs "
          f"{best['mode'] if best else 'none'} (fastest within {args.within:g} point(s) of fp16); * = cut by "
          f"--time-limit (not in the median)")
    for r in rows:
        if r["accuracy"]["diff_points"] is None:
            print(f"  {r['mode']}: {r['accuracy']['why']}")


def add_workload_flags(ap: argparse.ArgumentParser, num_prompts: int, max_tokens: int) -> None:
    """The workload and the engine's pool and scheduling: what prompt_batching.py shares with this script."""
    ap.add_argument("--tasks", nargs="+", default=["gsm_symbolic"], help="eval tasks the prompts come from "
                    "(gsm_symbolic, chain_sum, basic_arithmetic), taken in turn")
    ap.add_argument("--num-prompts", type=int, default=num_prompts)
    ap.add_argument("--max-tokens", type=int, default=max_tokens)
    ap.add_argument("--fp16-seqs", type=int, default=16,
                    help="size the pool to hold this many sequences of the longest prompt + max_tokens in fp16")
    ap.add_argument("--kv-memory-gb", type=float, default=None, help="the pool, for every mode (overrides --fp16-seqs)")
    ap.add_argument("--reservation", choices=("worst_case", "learned"), default="worst_case",
                    help="diffkv prompt page reservation rule (SchedulerConfig.reservation)")
    ap.add_argument("--max-num-seqs", type=int, default=None,
                    help="default: --num-prompts (every prompt may run at once; CUDA graphs up to that batch)")
    ap.add_argument("--max-num-batched-tokens", type=int, default=16384)
    ap.add_argument("--block-size", type=int, default=16)
    ap.add_argument("--warmup", choices=("short", "full"), default="short",
                    help="untimed warm-up per mode: the prompts' prefills and every decode graph, or also the whole "
                         "workload once (compiles every kernel variant the run meets, so no run pays for it)")
    ap.add_argument("--stats-every", type=int, default=16, help="steps between batch / compression samples")


def parse_args(argv):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_engine_flags(ap, only=("model", "max_model_len", "device", "dtype"),
                     defaults={"model": "qwen2.5-coder-1.5b", "device": "auto", "dtype": "auto"})
    ap.add_argument("--modes", nargs="+", default=None, help=f"default: {' '.join(MODE_ORDER)} (those this engine has)")
    add_workload_flags(ap, num_prompts=32, max_tokens=2048)
    ap.add_argument("--natural-stop", action="store_true", help="stop at EOS instead of ignore_eos")
    ap.add_argument("--repeats", type=int, default=2, help="passes over the modes, every other one reversed")
    ap.add_argument("--time-limit", type=float, default=480.0,
                    help="seconds from the start after which no run starts or goes on (the JSON is still written)")
    ap.add_argument("--study", default=None, help="accuracy study summary (default: the one of this model)")
    ap.add_argument("--accuracy-task", default="gsm_symbolic")
    ap.add_argument("--within", type=float, default=1.0, help="accuracy points below fp16 a mode may be and "
                    "still count as fp16's accuracy (the 'x best' column)")
    ap.add_argument("--quiet", action="store_true")
    ap.add_argument("--annotate", default=None, metavar="JSON",
                    help="no run: refresh a recorded result's accuracy columns and ratios from the current study "
                         "(a configuration the study measured after the run)")
    ap.add_argument("--out", default=None, help="JSON path, or a folder for the default name")
    ap.add_argument("--smoke", action="store_true", help="tiny random-weight model on CPU, short generations")
    args = ap.parse_args(argv)
    if args.smoke:
        args.model, args.device, args.dtype = "random:tiny-qwen2", "cpu", "auto"
        args.num_prompts, args.max_tokens, args.fp16_seqs, args.max_prompt_tokens = 6, 12, 2, 24
        args.stats_every, args.quiet = 1, True
    else:
        args.max_prompt_tokens = None
    if args.max_num_seqs is None:
        args.max_num_seqs = args.num_prompts
    try:
        if args.modes is None:
            args.modes = available_modes()
        for m in args.modes:
            if mode_cache_or_none(m) is None:
                mode_cache(m)  # raises naming the mode when it is no mode at all
                raise ValueError(f"--modes {m!r}: kv_mode {mode_cache(m)['kv_mode']!r} is not one of this "
                                 f"engine's ({', '.join(KV_MODES)})")
        if len(set(args.modes)) != len(args.modes):
            raise ValueError(f"--modes {args.modes}: a mode is named twice")
        for name in ("num_prompts", "max_tokens", "fp16_seqs", "repeats", "max_num_seqs", "stats_every"):
            if getattr(args, name) < 1:
                raise ValueError(f"--{name.replace('_', '-')} {getattr(args, name)}: must be at least 1")
        if args.kv_memory_gb is not None and args.kv_memory_gb <= 0:
            raise ValueError(f"--kv-memory-gb {args.kv_memory_gb}: must be > 0")
        if args.time_limit <= 0:
            raise ValueError(f"--time-limit {args.time_limit}: must be > 0 seconds")
    except ValueError as e:
        ap.error(str(e))
    return args


def repo_path(path: Path) -> str:
    """A path as the repository names it (relative to its root) where it lies inside it."""
    try:
        return str(Path(path).resolve().relative_to(ROOT))
    except ValueError:
        return str(path)


def default_name(ckpt_name: str, args) -> str:
    return f"throughput{'_natural_stop' if args.natural_stop else ''}_{model_tag(ckpt_name)}"


def annotate(path: Path, args) -> int:
    """Re-read the accuracy study for a recorded run: each row's accuracy as the study now has it (matched on the
    cache settings the run resolved, as a live run does), then the ratios that depend on it."""
    from diffkv_serve.engine import EngineConfig
    from diffkv_serve.engine.model_settings import apply_model_settings

    d = json.loads(path.read_text())
    study_path = Path(args.study) if args.study else find_study(d["model"])
    study = load_study(study_path) if study_path else None
    for row in d["rows"]:
        cache = apply_model_settings(EngineConfig(cache=mode_cache(row["mode"])), d["model"]).cache
        if cache.describe() != row["cache"]:
            raise ValueError(f"{path}: mode {row['mode']!r} now resolves to {cache.describe()}, the run used "
                             f"{row['cache']}; rerun the benchmark instead")
        row["accuracy"] = accuracy_vs_fp16(study, d["model"], STUDY_NAMES.get(row["mode"], row["mode"]),
                                           cache.model_dump(), d["accuracy_task"])
    best = add_ratios(d["rows"], d["config"]["within"])
    d["best_within"] = best["mode"] if best else None
    d["study"] = repo_path(study_path) if study_path else None
    print_table(d["rows"], best, argparse.Namespace(**d["config"]))
    path.write_text(json.dumps(d, indent=1) + "\n")
    print(f"annotated {path}")
    return 0


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    args = parse_args(argv)
    if args.annotate:
        return annotate(Path(args.annotate), args)
    deadline = START + args.time_limit
    torch.manual_seed(0)
    ckpt = load_checkpoint(args.model)
    prompts = load_prompts(ckpt, args.tasks, args.num_prompts, args.max_prompt_tokens)
    seq_tokens = max(map(len, prompts)) + args.max_tokens
    args.max_model_len = args.max_model_len or seq_tokens + 1
    if args.kv_memory_gb is None:
        args.kv_memory_gb = pool_gb_for(ckpt, args, seq_tokens)
    study_path = Path(args.study) if args.study else find_study(ckpt.name)
    study = load_study(study_path) if study_path else None
    cuda = resolve_device(args.device).type == "cuda"
    gpu = torch.cuda.get_device_name() if cuda else (platform.processor() or "cpu")
    print(f"{gpu} | {ckpt.name} | {len(prompts)} {'/'.join(args.tasks)} prompts (mean "
          f"{statistics.mean(map(len, prompts)):.0f}, max {max(map(len, prompts))} tokens) x {args.max_tokens} new "
          f"({'natural stop' if args.natural_stop else 'ignore_eos'}) | KV pool {args.kv_memory_gb:.3f} GiB for every "
          f"mode | study {study_path or 'none'} | loaded in {time.perf_counter() - START:.0f} s", flush=True)

    rows, runs, skipped = {}, {}, []
    for mode in args.modes:
        t = time.perf_counter()
        if t > deadline:
            print(f"{mode}: not built, --time-limit reached", flush=True)
            continue
        eng = build_engine(ckpt, mode, args)
        warm_up(eng, prompts, seq_tokens, args)
        cache = eng.config.cache  # resolved: the model's calibrated diffkv settings applied
        fit = eng.mm.num_pages // eng.mm.pages_for_tokens(seq_tokens)
        st = eng.stats()
        rows[mode] = {"mode": mode, "kv_mode": cache.kv_mode, "cache": cache.describe(),
                      "key_centering": st["key_centering"]["mode"], "seqs_fit": fit,
                      "pages_total": st["pages_total"], "page_bytes": st["page_bytes"],
                      "pool_bytes": st["pages_total"] * st["page_bytes"],
                      "fp16_seq_bytes": seq_tokens * fp16_token_bytes(ckpt.arch),
                      "accuracy": accuracy_vs_fp16(study, ckpt.name, STUDY_NAMES.get(mode, mode), cache.model_dump(),
                                                   args.accuracy_task),
                      "build_warmup_s": time.perf_counter() - t}
        print(f"{mode}: {fit} sequences of {seq_tokens} tokens fit the pool all-high ({st['pages_total']} pages), "
              f"keys centered: {rows[mode]['key_centering']}, built and warmed up in "
              f"{rows[mode]['build_warmup_s']:.0f} s", flush=True)
        graphs = getattr(eng.runner, "graphs", None)
        rows[mode]["graph_memory_bytes"] = graphs.memory_bytes if graphs is not None else 0
        runs[mode] = []
        for rep in range(args.repeats):
            done = [x for m in runs for x in runs[m] if not x["cut"]]
            expected = runs[mode][-1]["seconds"] if runs[mode] else max((x["seconds"] for x in done), default=None)
            if not should_start(time.perf_counter(), expected, deadline):
                skipped.append({"repeat": rep, "mode": mode, "expected_s": expected})
                why = f"expected {expected:.0f} s would pass" if expected else "past"
                print(f"repeat {rep} {mode}: skipped, {why} --time-limit", flush=True)
                continue
            r = timed_run(eng, prompts, args, f"r{rep}-{mode}", deadline)
            r["repeat"] = rep
            runs[mode].append(r)
            print(f"repeat {rep} {mode}: {r['tokens_per_s']:.0f} tok/s, {r['tokens']} tokens in {r['seconds']:.1f} s, "
                  f"mean batch {r['mean_batch'] or 0:.1f}, preemptions {r['preemptions']}"
                  f"{' (cut by --time-limit)' if r['cut'] else ''}", flush=True)
        free_engine(eng)
        del eng, graphs
        release_memory()

    for mode, row in rows.items():
        summarize(row, runs[mode])
    table = list(rows.values())
    best = add_ratios(table, args.within)
    print_table(table, best, args)
    result = {"benchmark": "throughput_at_accuracy", "device": gpu, "torch": torch.__version__, "model": ckpt.name,
              "command": "python benchmarks/throughput_qwen.py " + " ".join(argv),
              "study": repo_path(study_path) if study_path else None, "accuracy_task": args.accuracy_task,
              "kv_memory_gb": args.kv_memory_gb, "seq_tokens": seq_tokens,
              "order": [f"{rep}:{m}" for m in rows for rep in range(args.repeats)],
              "best_within": best["mode"] if best else None, "skipped_runs": skipped,
              "seconds_total": time.perf_counter() - START,
              "config": {k: v for k, v in vars(args).items() if k != "quiet"}, "trace_fields": TRACE_FIELDS,
              "rows": table}
    name = default_name(ckpt.name, args)
    out = args.out
    if out and Path(out).is_dir():
        out = str(Path(out) / f"{name}_{'smoke' if args.smoke else gpu_tag(gpu)}.json")
    write_result(result, name, gpu, out, args.smoke)
    return 0


if __name__ == "__main__":
    sys.exit(main())
