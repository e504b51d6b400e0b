"""vLLM on exactly the workload of benchmarks/throughput.py: the baseline our engine is measured against.

Same prompts (throughput.py's load_prompts, given to vLLM as token ids), same new tokens per prompt (ignore_eos,
greedy), same KV pool bytes (vLLM's kv_cache_memory_bytes = --kv-memory-gb), same max_num_seqs and
max_num_batched_tokens, prefix caching off on both. A random:<preset> model runs with vLLM's dummy weights from a
config.json of the preset's shape (benchmarks/vllm_models/<preset>/config.json; written from the preset for the
others). Each cache dtype (bf16, fp8) runs in a process of its own, so a crash or timeout of one leaves the
other's row; the timed region is generate() alone, after vLLM's start-up (torch.compile, CUDA-graph capture) and
an untimed warm-up.

vLLM is never a dependency of this project: where it is not importable (CPU, CI) or there is no GPU, this prints
why, writes nothing and exits 0. scripts/device/vllm_compare.sh carries vLLM 0.26.0 to the GPU box.

Usage (GPU):  python benchmarks/vllm_baseline.py --workload long-decode --out vllm.json
Compare:      python benchmarks/vllm_baseline.py --compare vllm.json --ours ours_fp16.json ours_fp8.json
"""
from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from _results import write_result  # noqa: E402
from workloads import WORKLOADS, apply_workload  # noqa: E402

MODELS = Path(__file__).resolve().parent / "vllm_models"
# vLLM's kv_cache_dtype for each row, and the mode of benchmarks/throughput.py it is compared with
CACHE_DTYPES = {"bf16": ("auto", "fp16"), "fp8": ("fp8", "fp8")}
HF_ARCHITECTURES = {"llama": "LlamaForCausalLM", "mistral": "MistralForCausalLM", "qwen2": "Qwen2ForCausalLM",
                    "qwen3": "Qwen3ForCausalLM"}


def hf_config(arch) -> dict:
    """A Hugging Face config.json for a ModelArch: all vLLM's dummy weights need to build the same shape."""
    if arch.architecture not in HF_ARCHITECTURES:
        raise ValueError(f"architecture {arch.architecture!r} has no Hugging Face class here")
    cfg = {
        "architectures": [HF_ARCHITECTURES[arch.architecture]], "model_type": arch.architecture,
        "vocab_size": arch.vocab_size, "hidden_size": arch.hidden_size,
        "intermediate_size": arch.intermediate_size, "num_hidden_layers": arch.num_layers,
        "num_attention_heads": arch.num_heads, "num_key_value_heads": arch.num_kv_heads,
        "head_dim": arch.head_dim, "hidden_act": "silu", "rms_norm_eps": arch.rms_norm_eps,
        "rope_theta": arch.rope_theta,
        "rope_scaling": arch.rope_scaling.model_dump() if arch.rope_scaling else None,
        "max_position_embeddings": arch.max_position_embeddings,
        "tie_word_embeddings": arch.tie_word_embeddings, "torch_dtype": "bfloat16",
        "bos_token_id": arch.bos_token_id,
        "eos_token_id": arch.eos_token_ids[0] if len(arch.eos_token_ids) == 1 else (arch.eos_token_ids or None),
        "attention_dropout": 0.0, "initializer_range": 0.02, "use_cache": True,
    }
    if arch.architecture == "qwen2":  # Qwen2's q/k/v biases are implied by the class; no sliding window
        cfg.update({"use_sliding_window": False, "sliding_window": None, "max_window_layers": arch.num_layers})
    elif arch.attention_bias:
        cfg["attention_bias"] = True
    return cfg


def model_folder(model: str, scratch: Path) -> tuple[Path, bool]:
    """(folder vLLM loads, dummy weights?): random:<preset> -> the committed config.json of that preset (else one
    written from the preset into `scratch`); a local Hugging Face folder -> itself, real weights."""
    if model.startswith("random:"):
        from diffkv_serve.engine.loader.presets import ARCH_PRESETS

        preset = model.removeprefix("random:")
        if preset not in ARCH_PRESETS:
            raise ValueError(f"--model {model!r}: no preset {preset!r} (one of {sorted(ARCH_PRESETS)})")
        committed = MODELS / preset
        if (committed / "config.json").is_file():
            return committed, True
        folder = scratch / preset
        folder.mkdir(parents=True, exist_ok=True)
        (folder / "config.json").write_text(json.dumps(hf_config(ARCH_PRESETS[preset]), indent=2) + "\n")
        return folder, True
    path = Path(model)
    if not (path / "config.json").is_file():
        raise ValueError(f"--model {model!r}: expected random:<preset> or a folder with a config.json")
    return path, False


def build_prompts(args) -> list[list[int]]:
    """throughput.py's prompts for the same arguments (its load_prompts, its checkpoint's vocabulary)."""
    import throughput
    from diffkv_serve.engine.loader import load_checkpoint

    ckpt = load_checkpoint(args.model)
    return throughput.load_prompts(ckpt, args.num_prompts, args.prompts, args.seed, args.prompt_len)


def vllm_missing(site: str | None) -> str | None:
    """Why vLLM cannot run here (looked up on `site`, then this interpreter's path), or None."""
    from importlib.machinery import PathFinder

    if PathFinder.find_spec("vllm", ([site] if site else []) + sys.path) is None:
        return "vLLM is not importable here (it is no dependency of this project; scripts/device/vllm_compare.sh " \
               "brings it to the GPU box)"
    import torch

    if not torch.cuda.is_available():
        return "no CUDA device"
    return None


def vllm_llm(spec: dict, dtype: str, **kw):
    """vLLM as every comparison here configures it: bf16 weights from spec's folder (dummy ones where
    spec["dummy"]), the KV cache dtype of CACHE_DTYPES[dtype] in a pool of spec's kv_memory_gb, prefix caching
    off, spec's batch limits, max_model_len (where given) and seed; kw: further LLM arguments."""
    os.environ.setdefault("VLLM_USE_FLASHINFER_SAMPLER", "0")  # flashinfer is not carried; FA3 does attention
    from vllm import LLM

    if spec.get("max_model_len"):
        kw["max_model_len"] = spec["max_model_len"]
    return LLM(model=spec["folder"], load_format="dummy" if spec["dummy"] else "auto", skip_tokenizer_init=True,
               dtype="bfloat16", kv_cache_dtype=CACHE_DTYPES[dtype][0],
               kv_cache_memory_bytes=int(spec["kv_memory_gb"] * 2**30), enable_prefix_caching=False,
               max_num_seqs=spec["max_num_seqs"], max_num_batched_tokens=spec["max_num_batched_tokens"],
               seed=spec["seed"], **kw)


def run_one(spec: dict, dtype: str) -> dict:
    """One cache dtype in this process: start vLLM, warm up, time generate(). `spec` holds everything it needs
    (prompts, model folder, limits): this process imports vLLM and torch alone, never this project."""
    import torch
    import vllm
    from vllm import SamplingParams

    t0 = time.perf_counter()
    llm = vllm_llm(spec, dtype, disable_log_stats=False)  # stats on: get_metrics() counts preemptions
    startup = time.perf_counter() - t0
    inputs = [{"prompt_token_ids": ids} for ids in spec["prompts"]]
    sp = SamplingParams(max_tokens=spec["max_tokens"], ignore_eos=True, temperature=0)
    if spec["warmup"] == "full":
        llm.generate(inputs, sp, use_tqdm=False)
    else:
        llm.generate(inputs[: spec["max_num_seqs"]], SamplingParams(max_tokens=2, ignore_eos=True, temperature=0),
                     use_tqdm=False)
    torch.cuda.synchronize()
    counted = metric_totals(llm)
    t0 = time.perf_counter()
    outs = llm.generate(inputs, sp, use_tqdm=False)
    torch.cuda.synchronize()
    wall = time.perf_counter() - t0
    totals = metric_totals(llm)
    before, after = preemptions(counted), preemptions(totals)
    metrics = {k: v - counted.get(k, 0.0) for k, v in totals.items()}
    generated = sum(len(o.outputs[0].token_ids) for o in outs)
    return {"mode": f"vllm-{dtype}", "engine": f"vLLM {vllm.__version__}", "kv_cache_dtype": CACHE_DTYPES[dtype][0],
            "compare_with": CACHE_DTYPES[dtype][1], "tokens": generated, "seconds": wall,
            "tokens_per_s": generated / wall, "startup_s": startup, "device": torch.cuda.get_device_name(),
            "torch": torch.__version__, "vllm": vllm.__version__,
            "preemptions": None if before is None or after is None else after - before, "metrics": metrics}


# vLLM's counters and histograms that say where the steps went: engine steps (iteration_tokens' count), prompt
# tokens computed (recomputes after preemption included), time per output token.
METRICS = ("iteration_tokens", "prompt_tokens", "generation_tokens", "time_per_output_token",
           "inter_token_latency", "num_preemptions", "prefill_time", "decode_time")


def metric_totals(llm) -> dict[str, float]:
    """{name: value} for counters, {name.count / name.sum} for histograms, summed over labels, of the METRICS
    that this vLLM exposes through LLM.get_metrics (empty where it cannot: the timed rows never depend on it)."""
    totals: dict[str, float] = {}
    try:
        for m in llm.get_metrics():
            if not any(k in m.name for k in METRICS):
                continue
            if hasattr(m, "count") and hasattr(m, "sum"):
                totals[m.name + ".count"] = totals.get(m.name + ".count", 0.0) + float(m.count)
                totals[m.name + ".sum"] = totals.get(m.name + ".sum", 0.0) + float(m.sum)
            elif isinstance(getattr(m, "value", None), (int, float)):
                totals[m.name] = totals.get(m.name, 0.0) + float(m.value)
    except Exception as e:  # noqa: BLE001 - a metrics API change loses these columns only
        print(f"vllm_baseline: metrics not read ({type(e).__name__}: {e})", file=sys.stderr)
    return totals


def preemptions(totals: dict[str, float]) -> float | None:
    """vLLM's preemption counter (its Prometheus metric) from metric_totals, or None where this vLLM exposes no
    metrics: the timed rows must not depend on it."""
    return sum(v for k, v in totals.items() if "num_preemptions" in k) if totals else None


def run_all(args, argv: list[str]) -> int:
    """Each dtype in a child process (a crash or hang loses that row only); one JSON with every row. The prompts
    are built here (this project's loader) and handed over in a file; the child's PYTHONPATH is --vllm-site alone
    where given, so vLLM meets only its own wheels and the interpreter's packages."""
    rows = []
    env = dict(os.environ)
    if args.vllm_site:
        env["PYTHONPATH"] = args.vllm_site
    with tempfile.TemporaryDirectory() as tmp:
        folder, dummy = model_folder(args.model, Path(tmp))
        spec = {"prompts": build_prompts(args), "folder": str(folder), "dummy": dummy,
                **{k: getattr(args, k) for k in ("max_model_len", "kv_memory_gb", "max_num_seqs",
                                                 "max_num_batched_tokens", "seed", "max_tokens", "warmup")}}
        spec_path = Path(tmp) / "spec.json"
        spec_path.write_text(json.dumps(spec))
        for dtype in args.cache_dtypes:
            out = Path(tmp) / f"row-{dtype}.json"
            cmd = [sys.executable, str(Path(__file__).resolve()), "--child", dtype, "--child-in", str(spec_path),
                   "--child-out", str(out)]
            print(f"vllm {dtype}: starting (limit {args.child_timeout:.0f} s)", flush=True)
            t0 = time.perf_counter()
            rc = run_child(cmd, args.child_timeout, env)
            if out.is_file():
                rows.append(json.loads(out.read_text()))
                print(f"vllm {dtype}: {rows[-1]['tokens_per_s']:.0f} tok/s ({rows[-1]['tokens']} tokens in "
                      f"{rows[-1]['seconds']:.1f} s; started in {rows[-1]['startup_s']:.0f} s)", flush=True)
                for k, v in sorted(rows[-1].get("metrics", {}).items()):
                    print(f"    {k}: {v:.4g}", flush=True)
            else:
                rows.append({"mode": f"vllm-{dtype}", "compare_with": CACHE_DTYPES[dtype][1], "error": f"exit {rc}",
                             "seconds_until_failure": time.perf_counter() - t0})
                print(f"vllm {dtype}: FAILED ({rows[-1]['error']})", flush=True)
    done = [r for r in rows if "error" not in r]
    device = done[0]["device"] if done else "unknown"
    result = {"benchmark": "vllm_baseline", "device": device, "model": args.model,
              "vllm": done[0]["vllm"] if done else None, "torch": done[0]["torch"] if done else None,
              "command": "python benchmarks/vllm_baseline.py " + " ".join(argv),
              "config": {k: v for k, v in vars(args).items() if k not in ("compare", "ours")},
              "rows": rows}
    print_table(rows)
    write_result(result, result_name(args), device, args.out, False)
    return 0 if done else 1


_running: subprocess.Popen | None = None  # the child of run_child, ended with this process on SIGTERM


def _end_child_and_exit(signum, _frame) -> None:
    if _running is not None:
        try:
            os.killpg(_running.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    raise SystemExit(128 + signum)


def run_child(cmd: list[str], timeout: float, env: dict | None = None) -> int | str:
    """Run `cmd` in a process group of its own; afterwards (or at the timeout) end that group, vLLM's engine-core
    process included, so the next dtype starts on a free GPU. A SIGTERM to this process (an outer `timeout`)
    ends the group too."""
    global _running
    signal.signal(signal.SIGTERM, _end_child_and_exit)
    proc = _running = subprocess.Popen(cmd, start_new_session=True, env=env)
    try:
        rc: int | str = proc.wait(timeout=timeout)
    except subprocess.TimeoutExpired:
        rc = "timeout"
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass
    proc.wait()
    _running = None
    return rc


def result_name(args) -> str:
    """What the file measures: vllm_baseline_<workload or prompts x tokens>_<model>."""
    what = args.workload or f"{args.num_prompts}x{args.max_tokens}"
    return f"vllm_baseline_{what}_{args.model.removeprefix('random:')}"


def compare(vllm_json: dict, ours: list[dict]) -> list[dict]:
    """Rows pairing each vLLM cache dtype with our mode of the same format: ours / vLLM tokens/s."""
    our_rows = {r["mode"]: r for d in ours for r in d["rows"] if "tokens_per_s" in r}
    table = []
    for v in vllm_json["rows"]:
        o = our_rows.get(v["compare_with"])
        vt, ot = v.get("tokens_per_s"), (o or {}).get("tokens_per_s")
        table.append({"cache": v["mode"].removeprefix("vllm-"), "ours_mode": v["compare_with"], "vllm_tokens_per_s": vt,
                      "ours_tokens_per_s": ot, "ours_over_vllm": ot / vt if vt and ot else None,
                      "vllm_preemptions": v.get("preemptions"), "ours_preemptions": (o or {}).get("preemptions"),
                      "vllm_error": v.get("error")})
    for mode, o in our_rows.items():  # our modes vLLM has no counterpart of (int4, diffkv)
        if mode not in {v["compare_with"] for v in vllm_json["rows"]}:
            table.append({"cache": mode, "ours_mode": mode, "vllm_tokens_per_s": None,
                          "ours_tokens_per_s": o["tokens_per_s"], "ours_over_vllm": None, "vllm_preemptions": None,
                          "ours_preemptions": o.get("preemptions"), "vllm_error": None})
    return table


def print_table(rows: list[dict]) -> None:
    print(f"\n{'engine / cache':>22} {'tok/s':>9} {'tokens':>9} {'seconds':>8} {'startup s':>9}")
    for r in rows:
        if "error" in r:
            print(f"{r['mode']:>22} {'failed: ' + r['error']:>9}")
            continue
        print(f"{r['mode']:>22} {r['tokens_per_s']:>9.0f} {r['tokens']:>9} {r['seconds']:>8.1f} "
              f"{r['startup_s']:>9.0f}")


def run_compare(args) -> int:
    vllm_json = json.loads(Path(args.compare).read_text())
    ours = []
    for p in args.ours:
        if Path(p).is_file():
            ours.append(json.loads(Path(p).read_text()))
        else:
            print(f"compare: {p} is missing (that run failed?); its rows stay empty")
    table = compare(vllm_json, ours)
    print(f"\n{'cache':>6} {'vLLM ' + str(vllm_json.get('vllm')):>12} {'ours':>9} {'ours/vLLM':>9}")
    for r in table:
        def f(k, spec):
            return format(r[k], spec) if r.get(k) is not None else "-"
        print(f"{r['cache']:>6} {f('vllm_tokens_per_s', ',.0f'):>12} {f('ours_tokens_per_s', ',.0f'):>9} "
              f"{f('ours_over_vllm', '.2f'):>9}")
    device = vllm_json.get("device") or next((d.get("device") for d in ours), "unknown")
    result = {"benchmark": "vllm_vs_ours", "device": device, "vllm": vllm_json.get("vllm"),
              "model": vllm_json.get("model"), "workload": vllm_json.get("config", {}).get("workload"),
              "commands": [vllm_json.get("command")] + [d.get("command") for d in ours], "rows": table,
              "vllm_rows": vllm_json["rows"], "ours_rows": [r for d in ours for r in d["rows"]]}
    name = "vllm_vs_ours_" + (result["workload"] or "custom") + "_" + str(result["model"]).removeprefix("random:")
    write_result(result, name, device, args.out, False)
    return 0


def parse_args(argv: list[str]):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="random:qwen2.5-1.5b", help="random:<preset> (dummy weights) or a HF folder")
    ap.add_argument("--workload", choices=sorted(WORKLOADS), help="named workload (benchmarks/workloads.py)")
    ap.add_argument("--prompts", default="synthetic", choices=("gsm_symbolic", "synthetic"))
    ap.add_argument("--prompt-len", type=int, default=None, help="synthetic prompts of exactly this many tokens")
    ap.add_argument("--num-prompts", type=int, default=128)
    ap.add_argument("--max-tokens", type=int, default=2048)
    ap.add_argument("--kv-memory-gb", type=float, default=0.98, help="KV pool (vLLM's kv_cache_memory_bytes)")
    ap.add_argument("--max-num-seqs", type=int, default=256)
    ap.add_argument("--max-num-batched-tokens", type=int, default=16384)
    ap.add_argument("--max-model-len", type=int, default=None, help="default: the model's (as throughput.py)")
    ap.add_argument("--cache-dtypes", nargs="+", choices=sorted(CACHE_DTYPES), default=["bf16", "fp8"])
    ap.add_argument("--warmup", choices=("short", "full"), default="short",
                    help="untimed: one batch of 2-token requests, or the whole workload once")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--child-timeout", type=float, default=600.0, help="seconds for one cache dtype, start-up too")
    ap.add_argument("--out", default=None, help="JSON path (default benchmarks/results/<what>_<gpu>.json)")
    ap.add_argument("--compare", default=None, help="a vllm_baseline JSON: pair it with --ours and print the ratios")
    ap.add_argument("--ours", nargs="*", default=[], help="benchmarks/throughput.py JSONs of the same workload")
    ap.add_argument("--vllm-site", default=os.environ.get("VLLM_SITE"),
                    help="folder holding vLLM's wheels installed (pip --target): the vLLM processes' PYTHONPATH")
    args = apply_workload(ap, argv)
    if args.prompt_len is not None and (args.prompt_len < 1 or args.prompts != "synthetic"):
        ap.error(f"--prompt-len {args.prompt_len}: needs --prompts synthetic and at least 1 token")
    for name in ("num_prompts", "max_tokens", "max_num_seqs", "max_num_batched_tokens"):
        if getattr(args, name) < 1:
            ap.error(f"--{name.replace('_', '-')} must be at least 1, got {getattr(args, name)}")
    if args.kv_memory_gb <= 0:
        ap.error(f"--kv-memory-gb must be positive, got {args.kv_memory_gb}")
    return args


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    if "--child" in argv:  # a vLLM process of run_all: its spec file holds everything
        ap = argparse.ArgumentParser()
        for flag in ("--child", "--child-in", "--child-out"):
            ap.add_argument(flag, required=True)
        args = ap.parse_args(argv)
        row = run_one(json.loads(Path(args.child_in).read_text()), args.child)
        Path(args.child_out).write_text(json.dumps(row))
        sys.stdout.flush()
        os._exit(0)  # the row is written; vLLM's teardown may hang, and the parent ends the process group anyway
    args = parse_args(argv)
    if args.compare:
        return run_compare(args)
    why = vllm_missing(args.vllm_site)
    if why:
        print(f"vllm_baseline: skipped: {why}")
        return 0
    return run_all(args, argv)


if __name__ == "__main__":
    sys.exit(main())
