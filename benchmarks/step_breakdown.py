"""Where the time of an engine step goes, per prompt step and generation step of a random-weight model:
model execution, attention, compression policy, memory management, other device work, and the host.

Every device kernel (or, on CPU, every top-level torch op) of a profiled step gets one category: by its name
when KERNEL_CATEGORIES knows it, else by the innermost engine cost range (diffkv_serve/engine/profiling.py, "diffkv::<category>")
that was open on the host when it was launched. A CUDA-graph replay launches its kernels from inside the
range around the replay, so captured steps are covered too; kernels outside every range count as "other"
(input copies, the scheduler's reads). Host overhead = step wall time - device busy time (the union of the
step's kernel intervals); the wall time is taken without the profiler where the run has such steps
(all generation steps; prompt steps after the profiled ones), else from the profiled step. A step's kernels
are the ones its call launched, counted whole: with async scheduling (engine default on CUDA) they run while
the host is in the next call, so host overhead is then the part of a step's period the GPU waits for the host.

Usage (GPU):  python benchmarks/step_breakdown.py --preset llama3-8b --modes fp16 diffkv --batches 8 64 256 \\
                  --seq 1024 4096 --steps 8 --out step_breakdown.json
Smoke (CPU):  python benchmarks/step_breakdown.py --smoke
A (mode, batch, seq) whose KV pages (all-high worst case) do not fit the pool is skipped, with the reason.
"""
from __future__ import annotations

import argparse
import bisect
import gc
import re
import sys
import time
from collections import defaultdict
from dataclasses import dataclass
from pathlib import Path
from typing import Iterable, Optional

import torch
from torch.autograd import DeviceType
from torch.profiler import ProfilerActivity, profile, record_function

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from diffkv_serve.engine.config import KV_MODES  # noqa: E402
from _results import write_result  # noqa: E402
from diffkv_serve.engine import EngineConfig, SamplingParams  # noqa: E402
from diffkv_serve.engine.llm_engine import LLMEngine  # noqa: E402
from diffkv_serve.engine.loader import load_checkpoint  # noqa: E402
from diffkv_serve.engine.profiling import CATEGORIES as RANGE_CATEGORIES, PREFIX as RANGE_PREFIX  # noqa: E402
from diffkv_serve.engine.flags import add_engine_flags, engine_settings  # noqa: E402

# Kernel name -> category, checked before the launching range: the memory-management graph replays the
# policy's Algorithm 1 and the forward graph the attention and score-update kernels. Triton kernels by their
# function names in diffkv_serve/kernels/*.py; vendor attention kernels in case a backend brings them.
KERNEL_CATEGORIES: tuple[tuple[str, str], ...] = (
    (r"\b_?decode_\w*kernel|decode_attention|paged_attention", "attention"),
    (r"^decode_mma$", "attention"),  # the CUDA decode kernel (decode_mma.cu's extern "C" name)
    (r"\b_prefill_kernel|flash|fmha", "attention"),
    (r"\b_write_kv_kernel|\b_write_sections_kernel", "attention"),  # the layer's new K/V into its pages (and diffkv's prefix-cache copies)
    (r"\b_plan_kernel", "policy"),  # Algorithm 1 (diffkv_serve/kernels/compression_plan.py)
    (r"\b_score_kernel", "policy"),  # decode attention added to token scores (diffkv_serve/kernels/score_update.py;
    # its launch also writes the next layer's new K/V)
    (r"\b_lse_kernel|\b_sig_kernel", "policy"),  # prompt significance
    (r"\b_move_kernel", "memory"),  # token moves between sections (diffkv_serve/kernels/kv_move.py)
)
_KERNEL_PATTERNS = [(re.compile(p), c) for p, c in KERNEL_CATEGORIES]
CATEGORIES = (*RANGE_CATEGORIES, "other")  # device time; host time is the rest of the step
STEP_PREFIX = "step_breakdown::"  # one range per measured engine step: step_breakdown::<phase>
TARGETS = {"memory": 1.0, "host": 5.0}  # % of a generation step at batch >= TARGET_BATCH (issue 6)
TARGET_BATCH = 64


def kernel_category(name: str) -> Optional[str]:
    for pat, cat in _KERNEL_PATTERNS:
        if pat.search(name):
            return cat
    return None


# ---- profiler events -> per-step categories ------------------------------------------------------------------
@dataclass(frozen=True)
class Event:
    """What the analysis needs of one profiler event (times in microseconds on the profiler's clock).

    kind: "range" (an engine cost range or a step range), "op" (a torch op on the host), "runtime" (a CUDA
    runtime/driver call: a kernel, copy or graph launch), "device" (a kernel, memcpy or memset on the GPU)."""

    name: str
    start: float
    end: float
    kind: str
    corr: int = 0  # runtime <-> device: the CUDA correlation id they share; op: its own id
    linked: int = 0  # device/runtime: the id of the torch op that was open when it was launched


def events_from_profiler(events: Iterable) -> list[Event]:
    out = []
    for e in events:
        name, act = e.name, getattr(e, "activity_type", None)
        on_host = e.device_type == DeviceType.CPU
        user = bool(getattr(e, "is_user_annotation", False))
        if name.startswith((RANGE_PREFIX, STEP_PREFIX)):
            kind = "range" if on_host else None  # the GPU-side copy of a range is no work
        elif not on_host:
            kind = None if user or act == "gpu_user_annotation" else "device"
        elif act in ("cuda_runtime", "cuda_driver") or (act is None and name.startswith("cu") and "::" not in name):
            kind = "runtime"
        elif not user and act in (None, "cpu_op"):
            kind = "op"
        else:
            kind = None
        if kind is not None:
            out.append(Event(name, e.time_range.start, e.time_range.end, kind, int(e.id),
                             int(getattr(e, "linked_correlation_id", 0) or 0)))
    return out


class InnermostRange:
    """The innermost engine cost range open at a host time (ranges nest properly)."""

    def __init__(self, ranges: list[Event]):
        self.times, self.cats = [], []
        stack: list[tuple[float, str]] = []

        def close_until(t: float) -> None:
            while stack and stack[-1][0] <= t:
                end, _ = stack.pop()
                self._mark(end, stack[-1][1] if stack else None)

        for r in sorted(ranges, key=lambda r: (r.start, -r.end)):
            close_until(r.start)
            cat = r.name.removeprefix(RANGE_PREFIX)
            stack.append((r.end, cat))
            self._mark(r.start, cat)
        close_until(float("inf"))

    def _mark(self, t: float, cat: Optional[str]) -> None:
        self.times.append(t)
        self.cats.append(cat)

    def at(self, t: float) -> Optional[str]:
        i = bisect.bisect_right(self.times, t) - 1
        return self.cats[i] if i >= 0 else None


def union_length(intervals: list[tuple[float, float]]) -> float:
    total, cur_s, cur_e = 0.0, None, None
    for s, e in sorted(intervals):
        if cur_e is None or s > cur_e:
            if cur_e is not None:
                total += cur_e - cur_s
            cur_s, cur_e = s, e
        else:
            cur_e = max(cur_e, e)
    return total + (cur_e - cur_s if cur_e is not None else 0.0)


def step_breakdown(events: list[Event]) -> tuple[list[dict], dict[str, dict], dict[str, dict]]:
    """Per measured step (a step_breakdown:: range): wall, busy and per-category device time in ms. Also the
    work items not classified by name: name -> {category, us, count} (to check KERNEL_CATEGORIES)."""
    steps = sorted((e for e in events if e.kind == "range" and e.name.startswith(STEP_PREFIX)),
                   key=lambda e: e.start)
    ranges = InnermostRange([e for e in events if e.kind == "range" and e.name.startswith(RANGE_PREFIX)])
    device = [e for e in events if e.kind == "device"]
    # Without device events (CPU) the work is the host's own torch ops; nested ops fall in the same category
    # as their parent (no range opens inside an op), so per-category unions count each moment once.
    work = device or [e for e in events if e.kind == "op"]
    launch = {e.corr: e.start for e in events if e.kind == "runtime"}
    op_start = {e.corr: e.start for e in events if e.kind == "op"}
    starts = [s.start for s in steps]
    per_step = [defaultdict(list) for _ in steps]
    no_launch = [0] * len(steps)  # device work whose launch was not found: placed by its own start instead
    unnamed: dict[str, dict] = {}
    named: dict[str, dict] = {}  # kernels KERNEL_CATEGORIES names: which of them a category's time is
    for w in work:
        t, found = w.start, True
        if device:  # the host moment it was launched: its runtime call, else the torch op it came from
            t = launch.get(w.corr, op_start.get(w.linked))
            t, found = (w.start, False) if t is None else (t, True)
        i = bisect.bisect_right(starts, t) - 1
        if i < 0 or t > steps[i].end:
            continue
        s = steps[i]
        no_launch[i] += not found
        cat = kernel_category(w.name) if device else None
        table = named
        if cat is None:
            cat, table = ranges.at(t) or "other", unnamed
        u = table.setdefault(w.name, {"category": cat, "us": 0.0, "count": 0})
        u["us"] += w.end - w.start
        u["count"] += 1
        # Counted whole, not clipped to the step's window: with async scheduling a step's kernels run while the
        # host is already in the next step's call (serialized on one stream, so steps' intervals do not overlap).
        per_step[i][cat].append((w.start, w.end))
    rows = []
    for s, cats, lost in zip(steps, per_step, no_launch):
        row = {"phase": s.name.removeprefix(STEP_PREFIX), "wall_ms": (s.end - s.start) / 1e3,
               "busy_ms": union_length([iv for ivs in cats.values() for iv in ivs]) / 1e3, "no_launch": lost}
        row.update({f"{c}_ms": union_length(cats.get(c, [])) / 1e3 for c in CATEGORIES})
        rows.append(row)
    return rows, unnamed, named


def summarize(steps: list[dict], unprofiled_wall_ms: list[float]) -> dict:
    """Mean over the profiled steps of one phase; host = wall - busy, the wall without the profiler if known."""
    n = len(steps)
    mean = {k: sum(s[k] for s in steps) / n for k in ("wall_ms", "busy_ms", *(f"{c}_ms" for c in CATEGORIES))}
    wall = sum(unprofiled_wall_ms) / len(unprofiled_wall_ms) if unprofiled_wall_ms else mean["wall_ms"]
    out = {"profiled_steps": n, "profiled_wall_ms": mean["wall_ms"], "busy_ms": mean["busy_ms"],
           "unprofiled_steps": len(unprofiled_wall_ms),
           "wall_source": "unprofiled" if unprofiled_wall_ms else "profiled", "wall_ms": wall}
    out.update({f"{c}_ms": mean[f"{c}_ms"] for c in CATEGORIES})
    out["host_ms"] = max(0.0, wall - mean["busy_ms"])
    out["no_launch_per_step"] = sum(s["no_launch"] for s in steps) / n
    out["pct"] = {c: 100 * out[f"{c}_ms"] / wall for c in (*CATEGORIES, "host")}
    return out


def top_unnamed(unnamed: dict[str, dict], steps: int, k: int = 12) -> list[dict]:
    top = sorted(unnamed.items(), key=lambda kv: -kv[1]["us"])[:k]
    return [{"name": n, "category": u["category"], "ms_per_step": u["us"] / 1e3 / steps, "count": u["count"]}
            for n, u in top]


# ---- running the engine --------------------------------------------------------------------------------------
def profiled_steps(engine: LLMEngine, n: int, phase: str, cuda: bool,
                   more=lambda: True) -> tuple[list[dict], dict, int]:
    """Up to n engine steps (while more()) under the profiler: their breakdown rows, the work not classified
    by name, and the sequences they stepped."""
    acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
    seqs = 0
    with profile(activities=acts) as prof:
        for _ in range(n):
            if not more():
                break
            with record_function(STEP_PREFIX + phase):
                seqs += len(engine.step())
    rows, unnamed, named = step_breakdown(events_from_profiler(prof.events()))
    return rows, unnamed, named, seqs


def timed_step(engine: LLMEngine) -> tuple[float, int]:
    t0 = time.perf_counter()
    n = len(engine.step())
    return 1e3 * (time.perf_counter() - t0), n


def abort_all(engine: LLMEngine) -> None:
    for rid in list(engine.requests):
        engine.abort(rid)
    engine.reset_prefix_cache()


def add_prompts(engine: LLMEngine, tag: str, batch: int, seq: int, max_tokens: int) -> None:
    g = torch.Generator().manual_seed(1000 * batch + seq)
    sp = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
    for i in range(batch):
        engine.add_request(f"{tag}-{i}", torch.randint(0, engine.arch.vocab_size, (seq,), generator=g).tolist(), sp)


def pages_needed(engine: LLMEngine, batch: int, seq: int, new_tokens: int) -> int:
    """Pages the scheduler plans for `batch` sequences over the whole run (all-high worst case)."""
    return batch * engine.mm.pages_for_tokens(seq + new_tokens + 1)


def warm_up(engine: LLMEngine, seqs: list[int], cuda: bool) -> None:
    """Compile kernels and settle the allocator on one full prompt step per length, start the profiler once."""
    budget = engine.config.scheduler.max_num_batched_tokens
    for i, seq in enumerate(seqs):
        n = min(max(1, budget // seq), engine.config.scheduler.max_num_seqs,
                engine.mm.free_pages() // engine.mm.pages_for_tokens(seq + 4))
        if n < 1:
            continue
        add_prompts(engine, f"warm{seq}", n, seq, 3)
        engine.step()
        engine.step()
        if i == 0:
            profiled_steps(engine, 1, "warm", cuda)  # the profiler's own first-use costs stay out of the runs
        abort_all(engine)


def measure(engine: LLMEngine, mode: str, batch: int, seq: int, args, cuda: bool) -> list[dict]:
    """Rows for one (mode, batch, seq): its prompt phase and its generation phase, or why it was skipped."""
    base = {"mode": mode, "batch": batch, "seq": seq}
    new_tokens = args.warmup_steps + 2 * args.steps + 2
    need, free = pages_needed(engine, batch, seq, new_tokens), engine.mm.free_pages()
    reason = None
    if batch > engine.config.scheduler.max_num_seqs:
        reason = f"batch {batch} > max_num_seqs {engine.config.scheduler.max_num_seqs}"
    elif seq + new_tokens > engine.max_model_len:
        reason = f"seq {seq} + {new_tokens} new tokens > max_model_len {engine.max_model_len}"
    elif need > free:
        reason = f"needs {need} KV pages (all-high worst case), the pool has {free} free"
    if reason:
        print(f"skip {mode} batch {batch} seq {seq}: {reason}")
        return [{**base, "skipped": reason, "pages_needed": need, "pages_free": free}]
    preempted = engine.scheduler.num_preemptions
    add_prompts(engine, f"{mode}-{batch}-{seq}", batch, seq, new_tokens)
    # Prompt steps (each admits the next prompts while any wait): the first ones profiled, the rest timed
    # without the profiler; those of the same size give the unprofiled wall time.
    waiting = lambda: bool(engine.scheduler.waiting)  # noqa: E731
    p_rows, p_unnamed, p_named, p_seqs = profiled_steps(engine, args.prompt_steps, "prompt", cuda, waiting)
    per_step = p_seqs / len(p_rows)
    p_walls = []
    while waiting():
        ms, n = timed_step(engine)
        if n == per_step:
            p_walls.append(ms)
    for _ in range(args.warmup_steps):  # the first one captures this batch's CUDA graph
        engine.step()
    d_walls, mm_ms = [], []
    for _ in range(args.steps):
        ms, n = timed_step(engine)
        d_walls.append(ms)
        if engine.runner is not None:
            mm_ms.append(1e3 * engine.runner.kv.mm_seconds())
    running = len(engine.scheduler.running)
    d_rows, d_unnamed, d_named, _ = profiled_steps(engine, args.steps, "decode", cuda)
    preempted = engine.scheduler.num_preemptions - preempted
    abort_all(engine)
    prompt = {**base, "phase": "prompt", "seqs_per_step": per_step, "tokens_per_step": per_step * seq,
              **summarize(p_rows, p_walls), "unnamed": top_unnamed(p_unnamed, len(p_rows), args.top),
              "named": top_unnamed(p_named, len(p_rows), args.top)}
    decode = {**base, "phase": "decode", "seqs_per_step": running, **summarize(d_rows, d_walls),
              "mm_timer_ms": sum(mm_ms) / len(mm_ms) if mm_ms else None, "preemptions": preempted,
              "unnamed": top_unnamed(d_unnamed, len(d_rows), args.top),
              "named": top_unnamed(d_named, len(d_rows), args.top)}
    return [prompt, decode]


def build_engine(mode: str, args, max_len: int, async_scheduling: str = "auto") -> LLMEngine:
    # diffkv's thresholds and precisions where given (--alpha-high ...; the other modes ignore them)
    knobs = engine_settings(args).get("cache", {}) if mode == "diffkv" else {}
    cache = {"kv_mode": mode, "enable_prefix_caching": args.prefix_caching, **knobs}
    if args.num_pages:
        cache["num_pages"] = args.num_pages
    elif args.kv_cache_gb:
        cache["kv_cache_memory_gb"] = args.kv_cache_gb
    cfg = EngineConfig(device=args.device, dtype=args.dtype, max_model_len=max_len, enforce_eager=args.eager,
                       cache=cache, scheduler={"max_num_seqs": max(args.batches),
                                               "max_num_batched_tokens": args.max_batched_tokens,
                                               "async_scheduling": async_scheduling})
    return LLMEngine(cfg, checkpoint=load_checkpoint(f"random:{args.preset}"))


def run_mode(mode: str, args, max_len: int) -> tuple[list[dict], dict, str]:
    """Every (batch, seq) of one KV mode on its own engine; the engine is gone when this returns."""
    engine = build_engine(mode, args, max_len)
    dev = engine.runner.device
    cuda = dev.type == "cuda"
    pool = {"pages": engine.mm.num_pages, "page_bytes": engine.mm.page_bytes,
            "cuda_graphs": engine.runner.graphs is not None}
    print(f"{mode}: {engine.mm.num_pages} KV pages of {engine.mm.page_bytes} bytes on {dev}")
    warm_up(engine, sorted(set(args.seq)), cuda)
    rows = [r for seq in args.seq for batch in args.batches for r in measure(engine, mode, batch, seq, args, cuda)]
    engine.shutdown()
    return rows, pool, torch.cuda.get_device_name(dev) if cuda else "cpu"


# ---- report --------------------------------------------------------------------------------------------------
def targets(rows: list[dict]) -> dict:
    """Issue 6: memory management < 1% and host overhead < 5% of a generation step at batch >= 64."""
    sel = [r for r in rows if r.get("phase") == "decode" and r["batch"] >= TARGET_BATCH]
    out = {"batch_at_least": TARGET_BATCH, "rows": len(sel)}
    for cat, limit in TARGETS.items():
        worst = max((r["pct"][cat] for r in sel), default=None)
        out[cat] = {"limit_pct": limit, "max_pct": worst, "pass": None if worst is None else worst < limit}
    return out


def print_table(rows: list[dict], verbose: bool) -> None:
    cols = (*CATEGORIES, "host")
    print(f"{'mode':>7} {'batch':>5} {'seq':>5} {'phase':>7} {'step ms':>9} " + " ".join(f"{c:>16}" for c in cols))
    for r in rows:
        if "skipped" in r:
            print(f"{r['mode']:>7} {r['batch']:>5} {r['seq']:>5}  skipped: {r['skipped']}")
            continue
        cells = " ".join(f"{r[f'{c}_ms']:>8.3f} ({r['pct'][c]:>4.1f}%)" for c in cols)
        print(f"{r['mode']:>7} {r['batch']:>5} {r['seq']:>5} {r['phase']:>7} {r['wall_ms']:>9.3f} {cells}")
        if verbose:
            if r["no_launch_per_step"]:
                print(f"{'':>28} {r['no_launch_per_step']:.0f} kernels per step without a launch record: "
                      "categorized at their device start time")
            for u in r.get("named", []):
                print(f"{'':>28} {u['category']:>9}: {u['name'][:90]!r} ({u['ms_per_step']:.3f} ms/step, "
                      f"{u['count']}x)")
            for u in r["unnamed"]:
                print(f"{'':>28} not in KERNEL_CATEGORIES: {u['name'][:90]!r} -> {u['category']} "
                      f"({u['ms_per_step']:.3f} ms/step, {u['count']}x)")


def target_line(t: dict) -> str:
    if not t["rows"]:
        return f"targets: no generation rows at batch >= {t['batch_at_least']}"
    parts = [f"{cat} < {v['limit_pct']:g}%: {'PASS' if v['pass'] else 'FAIL'} (max {v['max_pct']:.2f}%)"
             for cat, v in t.items() if isinstance(v, dict)]
    return f"targets (generation steps, batch >= {t['batch_at_least']}): " + ", ".join(parts)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--preset", default="llama3-8b")
    ap.add_argument("--modes", nargs="+", default=["fp16", "diffkv"], choices=KV_MODES)
    ap.add_argument("--batches", type=int, nargs="+", default=[8, 64, 256])
    ap.add_argument("--seq", type=int, nargs="+", default=[1024, 4096], help="prompt lengths")
    ap.add_argument("--steps", type=int, default=8, help="generation steps timed, then as many profiled")
    ap.add_argument("--prompt-steps", type=int, default=2, help="prompt steps profiled (the rest only timed)")
    ap.add_argument("--warmup-steps", type=int, default=2, help="generation steps before timing (graph capture)")
    ap.add_argument("--max-batched-tokens", type=int, default=8192, help="prompt tokens per prompt step")
    ap.add_argument("--prefix-caching", default="auto", choices=["auto", "on", "off"])
    ap.add_argument("--kv-cache-gb", type=float, default=None, help="KV pool size (default: the engine's)")
    ap.add_argument("--num-pages", type=int, default=None, help="KV pool in pages (overrides --kv-cache-gb)")
    ap.add_argument("--eager", action="store_true", help="no CUDA graphs for generation steps")
    add_engine_flags(ap, only=("device", "dtype", "alpha_high", "alpha_low", "high", "low"),
                     defaults={"device": "auto", "dtype": "auto"})
    ap.add_argument("--verbose", action="store_true", help="list each step's kernels, by name, with their times")
    ap.add_argument("--top", type=int, default=12, help="kernels listed per step and kind (named, unnamed)")
    ap.add_argument("--out", default=None, help="JSON path (default benchmarks/results/step_breakdown_<gpu>.json)")
    ap.add_argument("--smoke", action="store_true", help="tiny shapes on CPU; a small pool skips one combination")
    args = ap.parse_args(argv)
    if args.steps < 1 or args.prompt_steps < 1:
        ap.error("--steps and --prompt-steps must be at least 1")
    if args.smoke:
        args.preset, args.batches, args.seq, args.steps = "tiny", [2, 3], [16, 64], 2
        # 48 pages hold every combination but fp16 3 x 64; 32-token prompt steps make prompts of 64 run one
        # per step, so a prompt phase has steps timed without the profiler too.
        args.prompt_steps, args.warmup_steps, args.num_pages, args.max_batched_tokens = 1, 1, 48, 32
        args.device = "cpu" if args.device == "auto" else args.device
        torch.set_num_threads(1)  # tiny ops: intra-op threads only wait for each other (and for a busy box)
    args.prefix_caching = {"on": True, "off": False}.get(args.prefix_caching, args.prefix_caching)
    new_tokens = args.warmup_steps + 2 * args.steps + 2
    rows, pools, gpu = [], {}, "cpu"
    for mode in args.modes:
        mode_rows, pools[mode], gpu = run_mode(mode, args, max(args.seq) + new_tokens + 8)
        rows += mode_rows
        gc.collect()  # the previous engine's weights, pool and graphs go before the next sizes its pool
        if torch.cuda.is_available():
            torch.cuda.empty_cache()
    print_table(rows, args.verbose)
    t = targets([r for r in rows if "skipped" not in r])
    print(target_line(t))
    result = {"benchmark": "step_breakdown", "device": gpu, "preset": args.preset, "torch": torch.__version__,
              "command": " ".join(["python", "benchmarks/step_breakdown.py", *(argv or sys.argv[1:])]),
              "config": {"steps": args.steps, "prompt_steps": args.prompt_steps, "warmup_steps": args.warmup_steps,
                         "max_batched_tokens": args.max_batched_tokens, "prefix_caching": args.prefix_caching,
                         "dtype": args.dtype, "diffkv": engine_settings(args).get("cache", {}), "pools": pools},
              "kernel_categories": [list(kc) for kc in KERNEL_CATEGORIES], "rows": rows, "targets": t}
    write_result(result, "step_breakdown", gpu, args.out, args.smoke)
    return 0


if __name__ == "__main__":
    sys.exit(main())
