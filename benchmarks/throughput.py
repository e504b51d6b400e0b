"""Offline generation throughput per KV mode at a fixed KV memory budget (like vLLM's benchmark_throughput).

N chat prompts (gsm_symbolic questions from evals/data/problems.jsonl, or synthetic token ids) are all submitted at
once; the engine generates `--max-tokens` per prompt (`ignore_eos`, or natural stops with `--natural-stop`) for
every `--modes` entry in one run, each with the same `--kv-memory-gb` page pool, so a mode that stores a token in
fewer bytes keeps more sequences running. A mode may carry cache settings after a colon, e.g.
`diffkv:alpha_low=0.06` (settings left out keep the model's calibrated values). Reported per mode: generated tokens/s, mean and max running batch,
compression ratio (fp16 bytes / bytes held, averaged over steps), preemptions, steps; beside them Hugging Face
transformers' `generate` on the same weights and prompts (static batches of --hf-batch, what a user without a
server would run), unless --no-hf. `--reservation worst_case learned` runs diffkv once per prompt reservation rule
(SchedulerConfig.reservation), same prompts and pool, and adds the prefills redone after an estimate was too small.

Usage (GPU):  python benchmarks/throughput.py --num-prompts 96 --max-tokens 4096 --kv-memory-gb 2 --warmup full
Reservation:  python benchmarks/throughput.py --modes diffkv --reservation worst_case learned --no-hf
Smoke (CPU):  python benchmarks/throughput.py --smoke
"""
from __future__ import annotations

import argparse
import gc
import json
import platform
import statistics
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from _results import write_result  # noqa: E402
from _step_loop import step_until_done  # noqa: E402
from workloads import WORKLOADS, apply_workload  # noqa: E402
from diffkv_serve.engine import EngineConfig, SamplingParams  # noqa: E402
from diffkv_serve.engine.llm_engine import LLMEngine  # noqa: E402
from diffkv_serve.engine.config import KV_MODES, SchedulerConfig, parse_settings  # noqa: E402
from diffkv_serve.engine.config import GRAPH_BATCH_CAP  # noqa: E402
from diffkv_serve.engine.graph_memory import graph_memory_estimate  # noqa: E402
from diffkv_serve.engine.loader import load_checkpoint  # noqa: E402
from diffkv_serve.engine.flags import add_engine_flags  # noqa: E402

PROBLEMS = ROOT / "evals" / "data" / "problems.jsonl"
MODES = KV_MODES
# CacheConfig fields a --modes entry may set after a colon, with their types
MODE_SETTINGS = {"alpha_high": float, "alpha_low": float, "window": int, "high": str, "low": str}
PREFIX_CACHING = {"auto": "auto", "on": True, "off": False}  # --prefix-caching -> CacheConfig.enable_prefix_caching
# engine.stats() fields a --trace sample records, after the step count and the seconds since the start
TRACE_FIELDS = ("num_running", "num_waiting", "num_preemptions", "pages_used", "cached_tokens", "tokens_high",
                "tokens_low", "tokens_pruned")


def load_prompts(ckpt, n: int, source: str, seed: int, prompt_len: int | None = None) -> list[list[int]]:
    """Prompt token ids: chat-templated gsm_symbolic questions, or random ids (`synthetic`: 64-256 tokens, or
    exactly `prompt_len`). benchmarks/vllm_baseline.py gives vLLM these same ids."""
    if source == "gsm_symbolic":
        rows = [json.loads(line) for line in PROBLEMS.read_text().splitlines() if line.strip()]
        qs = [r["question"] for r in rows if r["task"] == "gsm_symbolic"]
        if not qs:
            raise ValueError(f"no gsm_symbolic problems in {PROBLEMS}")
        tok = ckpt.tokenizer
        return [tok.encode(tok.apply_chat_template([{"role": "user", "content": qs[i % len(qs)]}]),
                           add_special_tokens=False) for i in range(n)]
    g = torch.Generator().manual_seed(seed)
    V = ckpt.arch.vocab_size
    if prompt_len is not None:
        return [torch.randint(0, V, (prompt_len,), generator=g).tolist() for _ in range(n)]
    return [torch.randint(0, V, (int(torch.randint(64, 257, (1,), generator=g)),), generator=g).tolist()
            for _ in range(n)]


def parse_mode(spec: str) -> tuple[str, dict]:
    """'diffkv:alpha_low=0.06,window=32' -> ('diffkv', {'alpha_low': 0.06, 'window': 32}); ValueError naming
    the bad part."""
    mode, settings = parse_settings(spec, MODE_SETTINGS, "--modes")
    if mode not in MODES:
        raise ValueError(f"--modes {spec!r}: kv mode {mode!r} is not one of {MODES}")
    if settings and mode != "diffkv":
        raise ValueError(f"--modes {spec!r}: only diffkv takes settings ({mode} has one fixed precision)")
    return mode, settings


def run_mode(ckpt, spec: str, prompts: list[list[int]], args, reservation: str) -> dict:
    mode, settings = parse_mode(spec)
    cfg = EngineConfig(model=args.model, device=args.device, dtype=args.dtype, max_model_len=args.max_model_len,
                       max_graph_batch_size=args.max_graph_batch,
                       cache={"kv_mode": mode, "kv_cache_memory_gb": args.kv_memory_gb,
                              "enable_prefix_caching": PREFIX_CACHING[args.prefix_caching], **settings},
                       scheduler={"max_num_seqs": args.max_num_seqs,
                                  "max_num_batched_tokens": args.max_num_batched_tokens, "reservation": reservation})
    engine = LLMEngine(cfg, checkpoint=ckpt)
    sp = SamplingParams(temperature=0, max_tokens=args.max_tokens, ignore_eos=not args.natural_stop)
    # Warm-up outside the timed region: one batch of the prompts, two tokens each, so Triton compiles its
    # variants for these shapes here (not inside the first mode's timing) and learned reservation starts with
    # samples, as in a running server.
    # `--warmup full` runs the whole workload once untimed instead: Triton also compiles a decode variant per
    # split count as sequences grow, which the short warm-up does not reach (a cold cache favours later modes).
    full = args.warmup == "full"
    warm = sp if full else SamplingParams(temperature=0, max_tokens=2, ignore_eos=True)
    for i, ids in enumerate(prompts if full else prompts[: args.max_num_seqs]):
        engine.add_request(f"warmup{i}", ids, warm)
    while engine.has_unfinished_requests():
        engine.step()
    before = engine.stats()  # counters start at the warm-up's values: the row reports the timed run only
    for i, ids in enumerate(prompts):
        engine.add_request(f"r{i}", ids, sp)
    def trace_row(st: dict, step: int, seconds: float) -> list:  # where the pool goes over the run
        return [step, round(seconds, 4)] + [st[k] for k in TRACE_FIELDS]

    sync = torch.cuda.synchronize if args.device != "cpu" and torch.cuda.is_available() else None
    run = step_until_done(engine, len(prompts) * args.max_tokens, f"{_label(spec, reservation, args):>6}", args.quiet,
                          args.stats_every, sample=trace_row if args.trace else None, synchronize=sync)
    st = engine.stats()
    adm = st["reservation"]
    cc = engine.config.cache  # after the model's calibrated settings were applied
    res = {"mode": _label(spec, reservation, args), "kv_mode": mode, "reservation": reservation,
           "settings": {k: getattr(cc, k) for k in MODE_SETTINGS} if mode == "diffkv" else {},
           "overflows": adm["overflows"] - before["reservation"]["overflows"], "prompt_ratio": adm.get("prompt_ratio"),
           **{k: run[k] for k in ("tokens", "seconds", "tokens_per_s", "steps", "mean_batch", "max_batch",
                                  "compression_ratio", "phases", "stats_seconds")},
           "preemptions": st["num_preemptions"] - before["num_preemptions"], "pages_total": st["pages_total"],
           "page_bytes": st["page_bytes"]}
    if args.trace:
        res["trace"] = {"fields": ["step", "seconds"] + list(TRACE_FIELDS), "samples": run["trace"]}
    graphs = getattr(getattr(engine, "runner", None), "graphs", None)
    if graphs is not None:  # what capturing took beside the pool (diffkv_serve/engine/graph_memory.py)
        res["graph_memory_bytes"] = graphs.memory_bytes
        graphs.graphs.clear()  # captured graphs hold their pool until destroyed
    del graphs
    # Free this engine (weights, pool, graphs) before the next mode's is built: one engine on the device at a time.
    if hasattr(engine, "shutdown"):
        engine.shutdown()
    del engine
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()
    return res


def _label(spec: str, reservation: str, args) -> str:
    """A row's name: the --modes entry, with the reservation rule when several are compared."""
    return f"{spec}/{reservation}" if parse_mode(spec)[0] == "diffkv" and len(args.reservation) > 1 else spec


def _reservations(spec: str, args) -> list[str]:
    """Prompt reservation rules to run a mode under: only diffkv's footprint is unknown before its prefill."""
    return args.reservation if parse_mode(spec)[0] == "diffkv" else args.reservation[:1]


def run_hf(ckpt, prompts: list[list[int]], args) -> dict:
    """transformers generate, greedy, left-padded static batches, on the checkpoint's weights."""
    from diffkv_serve.engine.loader.hf_reference import hf_llama

    dev = "cuda" if args.device != "cpu" and torch.cuda.is_available() else "cpu"
    dtype = torch.bfloat16 if dev == "cuda" else torch.float32
    model = hf_llama(ckpt, dtype).to(dev)
    subset = prompts[: args.hf_prompts]
    generated, t0 = 0, time.perf_counter()
    with torch.no_grad():
        for i in range(0, len(subset), args.hf_batch):
            chunk = subset[i: i + args.hf_batch]
            width = max(map(len, chunk))
            ids = torch.zeros(len(chunk), width, dtype=torch.long)
            mask = torch.zeros_like(ids)
            for j, p in enumerate(chunk):
                ids[j, width - len(p):] = torch.tensor(p)
                mask[j, width - len(p):] = 1
            out = model.generate(ids.to(dev), attention_mask=mask.to(dev), max_new_tokens=args.max_tokens,
                                 min_new_tokens=0 if args.natural_stop else args.max_tokens, do_sample=False,
                                 pad_token_id=0)
            generated += (out.shape[1] - width) * len(chunk)
    if dev == "cuda":
        torch.cuda.synchronize()
    wall = time.perf_counter() - t0
    del model
    gc.collect()
    return {"mode": "hf-transformers", "tokens": generated, "seconds": wall, "tokens_per_s": generated / wall,
            "prompts": len(subset), "batch": args.hf_batch, "dtype": str(dtype)}


def parse_args(argv):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_engine_flags(ap, only=("model", "max_num_seqs", "max_model_len", "device", "dtype"),
                     defaults={"max_num_seqs": 256, "device": "auto", "dtype": "auto"})
    ap.add_argument("--workload", choices=sorted(WORKLOADS),
                    help="named workload (benchmarks/workloads.py) setting the prompts, lengths and pool; "
                         "flags given beside it override")
    ap.add_argument("--modes", nargs="+", default=list(MODES),
                    help=f"KV modes {MODES}; diffkv may carry settings: diffkv:alpha_low=0.06,alpha_high=4")
    ap.add_argument("--num-prompts", type=int, default=96)
    ap.add_argument("--prompts", default="gsm_symbolic", choices=("gsm_symbolic", "synthetic"))
    ap.add_argument("--prompt-len", type=int, default=None,
                    help="synthetic prompts of exactly this many tokens (default: 64-256, random)")
    ap.add_argument("--max-tokens", type=int, default=4096)
    ap.add_argument("--natural-stop", action="store_true", help="stop at EOS instead of ignore_eos")
    ap.add_argument("--reservation", nargs="+", choices=("worst_case", "learned"),
                    default=[SchedulerConfig().reservation], help="diffkv prompt reservation rule(s), one row each")
    ap.add_argument("--kv-memory-gb", type=float, default=2.0, help="page pool size, the same for every mode")
    ap.add_argument("--max-num-batched-tokens", type=int, default=16384)
    ap.add_argument("--prefix-caching", choices=sorted(PREFIX_CACHING), default="auto",
                    help="the cache's enable_prefix_caching ('auto': the mode's default); the named workloads turn "
                         "it off, as benchmarks/vllm_baseline.py runs vLLM")
    ap.add_argument("--max-graph-batch", type=int, default=None,
                    help=f"largest decode batch captured in a CUDA graph (default: --max-num-seqs, at most "
                         f"{GRAPH_BATCH_CAP}); larger batches run eagerly")
    ap.add_argument("--no-hf", action="store_true", help="skip the transformers baseline")
    ap.add_argument("--hf-prompts", type=int, default=32, help="prompts given to transformers (a subset)")
    ap.add_argument("--hf-batch", type=int, default=32)
    ap.add_argument("--stats-every", type=int, default=8, help="steps between batch/compression samples (0: none, "
                    "nothing reads the device between steps; the mean batch from decode steps)")
    ap.add_argument("--trace", action="store_true",
                    help="record every stats sample (batch, queue, pages, tokens high/low/pruned) per mode")
    ap.add_argument("--warmup", choices=("short", "full"), default="short",
                    help="untimed warm-up per mode: one batch of 2-token requests, or the whole workload once "
                         "(compiles every kernel variant the run meets; use on a fresh GPU machine)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--quiet", action="store_true")
    ap.add_argument("--out", default=None)
    ap.add_argument("--smoke", action="store_true", help="random:tiny on CPU, a few short generations")
    args = apply_workload(ap, argv)
    if args.prompt_len is not None and (args.prompt_len < 1 or args.prompts != "synthetic"):
        ap.error(f"--prompt-len {args.prompt_len}: needs --prompts synthetic and at least 1 token")
    if args.max_graph_batch is None:
        args.max_graph_batch = min(args.max_num_seqs, GRAPH_BATCH_CAP)
    for m in args.modes:
        try:
            parse_mode(m)
        except ValueError as e:
            ap.error(str(e))
    if args.stats_every < 0:
        ap.error(f"--stats-every must be >= 0, got {args.stats_every}")
    if args.smoke:
        args.model = args.model or "random:tiny"
        args.device, args.prompts = "cpu", "synthetic"
        args.num_prompts, args.max_tokens, args.kv_memory_gb = 4, 16, 0.001
        args.modes = [m for m in args.modes if parse_mode(m)[0] in ("fp16", "diffkv")]
        args.reservation = ["worst_case", "learned"]
        args.hf_prompts, args.hf_batch, args.stats_every, args.trace = 2, 2, 1, True
    return args


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    args = parse_args(argv)
    torch.manual_seed(args.seed)
    ckpt = load_checkpoint(args.model)
    if ckpt.weights is None:
        args.no_hf = True  # random weights are initialised inside the engine: nothing to hand transformers
    prompts = load_prompts(ckpt, args.num_prompts, args.prompts, args.seed, args.prompt_len)
    cuda = args.device != "cpu" and torch.cuda.is_available()
    gpu = torch.cuda.get_device_name() if cuda else (platform.processor() or "cpu")
    print(f"{gpu} | model {ckpt.name} | {len(prompts)} prompts (mean {statistics.mean(map(len, prompts)):.0f} "
          f"tokens) x {args.max_tokens} new | KV pool {args.kv_memory_gb} GiB")
    rows = [run_mode(ckpt, m, prompts, args, a) for m in args.modes for a in _reservations(m, args)]
    if not args.no_hf:
        rows.append(run_hf(ckpt, prompts, args))
    for r in rows:
        if r.get("graph_memory_bytes"):
            est = graph_memory_estimate(ckpt.arch, args.max_graph_batch, 2 if cuda else 4)
            print(f"{r['mode']}: CUDA graphs up to batch {args.max_graph_batch} took "
                  f"{r['graph_memory_bytes'] / 2**20:.0f} MiB (budgeted {est / 2**20:.0f} MiB)")
    base = next((r["tokens_per_s"] for r in rows if r["mode"] == "fp16"), None)
    for r in rows:
        r["speedup_vs_fp16"] = r["tokens_per_s"] / base if base else None
    print(f"\n{'mode':>18} {'tok/s':>9} {'vs fp16':>8} {'mean batch':>10} {'max batch':>9} {'compr.':>7} "
          f"{'preempt':>7} {'overflow':>8} {'seconds':>8}")
    for r in rows:
        def f(k, spec):
            return format(r[k], spec) if r.get(k) is not None else "-"
        print(f"{r['mode']:>18} {r['tokens_per_s']:>9.0f} {f('speedup_vs_fp16', '.2f'):>8} "
              f"{f('mean_batch', '.1f'):>10} {f('max_batch', 'd'):>9} {f('compression_ratio', '.2f'):>7} "
              f"{f('preemptions', 'd'):>7} {f('overflows', 'd'):>8} {r['seconds']:>8.1f}")
    for r in rows:
        ph = r.get("phases")
        if ph:
            pf, dc = ph["prefill"], ph["decode"]
            print(f"{r['mode']}: {pf['steps']} prompt steps ({pf['tokens']} tokens) {pf['seconds']:.2f} s; "
                  f"{dc['steps']} decode steps {dc['seconds']:.2f} s "
                  f"({1e3 * dc['seconds'] / max(dc['steps'], 1):.3f} ms each); stats reads {r['stats_seconds']:.2f} s")
    result = {"benchmark": "throughput", "device": gpu, "torch": torch.__version__, "model": ckpt.name,
              "command": "python benchmarks/throughput.py " + " ".join(argv),
              "config": {k: v for k, v in vars(args).items() if k not in ("quiet",)}, "rows": rows}
    write_result(result, "throughput", gpu, args.out, args.smoke)
    return 0


if __name__ == "__main__":
    sys.exit(main())
