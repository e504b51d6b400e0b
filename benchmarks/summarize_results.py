"""Write benchmarks/results/README.md from the recorded JSON files (nothing typed in by hand).

Usage: python benchmarks/summarize_results.py   (also writes docs/PERFORMANCE.md and its plot)
"""
from __future__ import annotations

import json
from pathlib import Path

RESULTS = Path(__file__).parent / "results"
DOCS = Path(__file__).resolve().parents[1] / "docs"


def load(name: str):
    p = RESULTS / name
    return json.loads(p.read_text()) if p.exists() else None


def decode_section(name: str) -> list[str]:
    d = load(name)
    if d is None:
        return []
    out = [f"### Decode throughput, {d['device']} (`{name}`)", "",
           f"Random-weight `{d['preset']}` in {d['dtype']}, 16-bit paged cache (block {d['block_size']}), CUDA-graph "
           f"decode, prompt {d['rows'][0]['prompt_len']}, {d['rows'][0]['new_tokens']} new tokens. Roofline = "
           f"(weights + KV read) / {d['bandwidth'] / 1e12:.1f} TB/s.", "", f"Command: `{d['command']}`", "",
           "| batch | decode tok/s | step ms | roofline step ms | step / roofline |", "|---:|---:|---:|---:|---:|"]
    out += [f"| {r['batch']} | {r['decode_tok_s']:.1f} | {r['step_ms']:.2f} | {r['roofline_step_ms']:.2f} | "
            f"{r['vs_roofline']:.2f} |" for r in d["rows"]]
    return out + [""]


ATTENTION_NOTES = {
    "attention_H100.json": "_Session 13 (kernels/decode_attention.py launch_config and tile_tokens: one-warp "
    "programs for the quartered kernel since session 12, 64-token tiles for K4V2 where a split covers >= 1024 "
    "tokens since session 13). Against session 12's run of this command (CUDA-graph us): K4V2 B=32 S=16384 "
    "219.8 -> 204.4, B=128 S=4096 209.7 -> 202.3, B=128 S=16384 874.7 -> 788.1 (now 71-74% of 3.0 TB/s); the "
    "other precisions within 2%. Short of 70%: batch 8 at 4096 tokens (every kernel pays a fixed ~7 us per call, "
    "torch SDPA too, which keeps K4V2's 27 MB and mix's 40 MB below 70% even if streamed at peak; K8V8 69%, K8V4 "
    "59%), K4V2 / mix at batch 8 with 16384 tokens (63 / 68%) and at batch 32 with 4096 (61 / 67%). Variants "
    "tried this session: benchmarks/results/decode_variants_session13_H100.json._",
}


def attention_section(name: str) -> list[str]:
    a = load(name)
    if a is None:
        return []
    t = a["targets"]
    timing = t.get("timing", "do_bench")
    note = [ATTENTION_NOTES[name], ""] if name in ATTENTION_NOTES else []
    out = [f"### Decode attention kernel, {a['device']} (`{name}`)", "", f"Command: `{a['command']}`", "", *note,
           "Bytes = K/V data + their fp16 scale/zero + q + output; `% BW` is of 3.0 TB/s (the H100 figure; an "
           "H200 reads faster, so its fp16 rows exceed 100%). `time us`: triton do_bench (L2 flushed, includes "
           "the Python launch); `graph us`: back-to-back calls replayed in a CUDA graph, as a decode step runs "
           f"them. `% BW` and the speedups below use the {timing} times.", "",
           "| precision | batch | seq | time us | graph us | GB/s | % BW | vs our fp16 | vs SDPA |",
           "|---|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for r in a["rows"]:
        g = r.get("graph_us")
        frac = r.get("target_frac_bw", r["frac_bw"])
        sp = r.get("target_speedup_vs_fp16", r["speedup_vs_fp16"])
        gbs = r["graph_gb_s"] if timing == "CUDA-graph" else r["gb_s"]
        out.append(f"| {r['precision']} | {r['batch']} | {r['seq']} | {r['time_us']:.1f} | "
                   f"{f'{g:.1f}' if g else '-'} | {gbs:.0f} | {100 * frac:.1f} | {sp:.2f} | "
                   f"{r['speedup_vs_sdpa']:.2f} |")
    k8 = t["k8v8_speedup_vs_fp16"]
    out += ["", f"Targets at seq >= 4096 ({timing} times): K8V8 vs fp16 {k8['min']:.2f}x min / "
            f"{k8['geomean']:.2f}x geomean (target 1.7x, byte ratio {k8['bytes_ratio']:.2f}x): "
            f"{'PASS' if k8['pass'] else 'FAIL'}; bandwidth share min / median "
            + ", ".join(f"{k.removeprefix('frac_bw_')} {100 * v['min']:.0f}% / {100 * v['median']:.0f}%"
                        f"{'' if v['pass'] else ' (FAIL)'}" for k, v in t.items() if k.startswith("frac_bw_"))
            + " (target 70%).", ""]
    return out


def mm_section(name: str, title: str) -> list[str]:
    m = load(name)
    if m is None:
        return []
    out = [f"### Memory management, {m['device']}: {title} (`{name}`)", "", f"Command: `{m['command']}`", "",
           "| device | batch | prompt step ms | generation step ms |", "|---|---:|---:|---:|"]
    out += [f"| {r['device']} | {r['batch']} | {r['prompt_mm_ms']:.3f} | {r['gen_mm_ms']:.3f} |" for r in m["rows"]]
    out += [""] + [f"- batch {b}: GPU {s['prompt']:.1f}x (prompt) / {s['gen']:.1f}x (generation) faster than the CPU "
                   "path" for b, s in m["speedup_gpu_vs_cpu"].items()]
    out += [f"- engine (Llama-3-8B shape, diffkv, batch {e['batch']}, seq {e['seq']}): decode step "
            f"{e['decode_step_ms']:.2f} ms, memory management {e['engine_mm_ms']:.3f} ms = "
            f"{100 * e['mm_share_engine']:.2f}% of the step" for e in m["engine"]]
    return out + [""]


# Teacher-forced fidelity of the settings a throughput run compares (evals/fidelity_compare.py), shown below it
_FIDELITY = DOCS.parent / "evals" / "results" / "smollm2-135m" / "fidelity_compare.json"
FIDELITY_FOR = {name: _FIDELITY for name in ("throughput_session10_H100.json", "throughput_session9_H100.json",
                                             "throughput_session8_H100.json", "throughput_session7_H100.json")}


def fidelity_lines(path: Path) -> list[str]:
    """Each configuration's KV memory and top-1 agreement, and its paired difference from the baseline."""
    if not path.is_file():
        return []
    d = json.loads(path.read_text())
    base = d["baseline"]
    out = [f"Fidelity on the eval split ({d['settings']['fidelity_n']} generations x {d['settings']['gen_len']} "
           f"tokens, teacher forced against the fp16 cache; `{d['command']}`):", ""]
    for name, r in d["configs"].items():
        b = r.get("vs_baseline")
        vs = (f"; vs {base}: {100 * b['agreement_change']:+.2f} pts [95% CI {100 * b['agreement_change_ci'][0]:+.2f}, "
              f"{100 * b['agreement_change_ci'][1]:+.2f}], NLL {b['nll_increase']:+.3f} "
              f"[{b['nll_increase_ci'][0]:+.3f}, {b['nll_increase_ci'][1]:+.3f}]") if b else ""
        out.append(f"- `{name}`: {100 * r['memory_fraction']:.1f}% of fp16's KV memory, top-1 agreement "
                   f"{r['top1_agreement']:.4f}{vs}")
    return out + [""]


def throughput_section(name: str, title: str = "Generation throughput per KV mode") -> list[str]:
    t = load(name)
    if t is None:
        return []
    c = t["config"]
    hf = "" if c.get("no_hf") else (f"; transformers on {c['hf_prompts']} of the prompts in batches of "
                                     f"{c['hf_batch']}")
    out = [f"### {title}, {t['device']} (`{name}`)", "",
           f"{t['model']}, {c['num_prompts']} {c.get('prompts', 'gsm_symbolic')} chat prompts x up to "
           f"{c['max_tokens']} new tokens ({'natural stops' if c['natural_stop'] else 'ignore_eos'}), KV pool "
           f"{c['kv_memory_gb']} GiB for every mode, max_num_seqs {c['max_num_seqs']}{hf}.", "",
           f"Command: `{t['command']}`", "", *run_note(name),
           "| mode | tokens/s | vs fp16 | mean batch | max batch | compression | preemptions | prefills redone |",
           "|---|---:|---:|---:|---:|---:|---:|---:|"]

    def f(x, spec):
        return "-" if x is None else format(x, spec)
    for r in t["rows"]:
        out.append(f"| {r['mode']} | {r['tokens_per_s']:.0f} | {f(r.get('speedup_vs_fp16'), '.2f')} | "
                   f"{f(r.get('mean_batch'), '.1f')} | {f(r.get('max_batch'), 'd')} | "
                   f"{f(r.get('compression_ratio'), '.2f')} | {f(r.get('preemptions'), 'd')} | "
                   f"{f(r.get('overflows'), 'd')} |")
    return out + [""] + (fidelity_lines(FIDELITY_FOR[name]) if name in FIDELITY_FOR else [])


def host_overhead_section(name: str) -> list[str]:
    """benchmarks/host_overhead.py: host time per decode step by phase, synchronous vs async steps."""
    d = load(name)
    if d is None:
        return []
    phases = d["phases"]
    out = [f"### Host time per decode step, {d['device']} (`{name}`)", "",
           f"Random-weight `{d['preset']}`, perf_counter around the engine's own methods (no profiler). Synchronous "
           "steps: the GPU idles for all of `host`. Async steps: `wait` is the wait for the previous step's tokens "
           "while the GPU runs this one, and `host` is the host's own work, overlapped with the GPU.", "",
           f"Command: `{d['command']}`", "",
           "| mode | async | batch | step ms | " + " | ".join(phases) + " |", "|---|---|---:|---:|" + "---:|" * len(phases)]
    out += [f"| {r['mode']} | {'on' if r.get('async_steps') else 'off'} | {r['batch']} | {r['ms']['step']:.2f} | "
            + " | ".join(f"{r['ms'][p]:.2f} ({r['pct'][p]:.1f}%)" for p in phases) + " |" for r in d["rows"]]
    return out + [""]


def step_breakdown_section(name: str) -> list[str]:
    """benchmarks/step_breakdown.py: per prompt / generation step, device time per category and host overhead."""
    d = load(name)
    if d is None:
        return []
    c = d["config"]
    cats = ("model", "attention", "policy", "memory", "other", "host")
    out = [f"### Step breakdown, {d['device']} (`{name}`)", "",
           f"Random-weight `{d['preset']}`; prompt steps of up to {c['max_batched_tokens']} prompt tokens, "
           f"{c['steps']} generation steps timed and {c['steps']} profiled per row. Each kernel counts for one "
           "category, by its name or else by the engine range that launched it (CUDA-graph replays included); "
           "`other` is device work outside every range (input copies, the scheduler's reads); host = step wall "
           "time - device busy time (the wall time without the profiler where the row has such steps). "
           "Cells: ms per step (% of the step). " + d.get("note", "") + STEP_BREAKDOWN_NOTES.get(name, ""), "",
           f"Command: `{d['command']}`", "",
           "| mode | batch | seq | phase | step ms | " + " | ".join(cats) + " |",
           "|---|---:|---:|---|---:|" + "---:|" * len(cats)]
    rows = [r for r in d["rows"] if "skipped" not in r]
    out += [f"| {r['mode']} | {r['batch']} | {r['seq']} | {r['phase']} | {r['wall_ms']:.2f} | "
            + " | ".join(f"{r[f'{k}_ms']:.2f} ({r['pct'][k]:.1f}%)" for k in cats) + " |" for r in rows]
    out += [""] + [f"- skipped: {r['mode']} batch {r['batch']} seq {r['seq']}: {r['skipped']}"
                   for r in d["rows"] if "skipped" in r]
    t = d["targets"]
    if t["rows"]:
        out += [f"- targets (generation steps, batch >= {t['batch_at_least']}): " + ", ".join(
            f"{k} < {v['limit_pct']:g}%: {'PASS' if v['pass'] else 'FAIL'} (max {v['max_pct']:.2f}%)"
            for k, v in t.items() if isinstance(v, dict))]
    return out + [""]


STEP_BREAKDOWN_NOTES = {
    "step_breakdown_8b_async_H100.json": " Session 9: async scheduling (the engine's default on CUDA) launches "
    "each decode step before the previous one's tokens are read; a step's kernels are counted whole, so host is "
    "the part of a step's period the GPU waits for the host. The same shape with synchronous steps: "
    "`step_breakdown_8b_s8_H100.json` below.",
    "step_breakdown_8b_s4096_async_H100.json": " Session 9, async scheduling as above, 4096-token prompts (batch "
    "256 does not fit an fp16 cache of this shape on one H100).",
    "step_breakdown_8b_s4096_one_warp_H100.json": " Session 12, the same command after the quartered decode kernel "
    "went to one-warp programs (kernels/decode_attention.launch_config): generation-step attention at batch 64 "
    "int4 5.70 -> 4.11 ms, diffkv 6.71 -> 5.53 ms (step 13.26 -> 11.74 and 15.82 -> 14.69 ms); fp16 (other "
    "kernel) 12.59 -> 12.55 ms.",
    "step_breakdown_8b_s4096_score512_H100.json": " Session 12, the same command after the score update went to "
    "512-token tiles (kernels/score_update.BLOCK_N): its kernel 1.21 -> 0.80 ms per generation step at batch 64 "
    "(policy 1.41 -> 1.01 ms, step 14.69 -> 14.34 ms).",
}
STEP_BREAKDOWN_RUNS = ("step_breakdown_8b_async_H100.json", "step_breakdown_8b_s4096_async_H100.json",
                       "step_breakdown_8b_s4096_one_warp_H100.json", "step_breakdown_8b_s4096_score512_H100.json",
                       "step_breakdown_8b_s8_H100.json", "step_breakdown_H200.json", "step_breakdown_smollm2_H200.json",
                       "step_breakdown_smollm2_s6_before_H200.json", "step_breakdown_smollm2_s6_after_H200.json")

# (file, title, plot label, how the run was taken: Triton compiles kernel variants (per KV format and split
# count) the first time a shape appears and caches them on disk, so a mode's first run on a fresh machine pays
# its compiles inside the timing)
THROUGHPUT_RUNS = (
    ("throughput_session10_H100.json", "Generation throughput after the 8-row decode tiles",
     "session 10, 8-row decode tiles", "Session 10, H100, the session-9 workload and order: the decode kernels "
     "pad SmolLM2's GQA group of 3 to 8 rows instead of 16 (kernels/decode_attention.py launch_config: its "
     "quantized decode attention 1.4-1.9x faster at batch 16-128). --warmup full; preemptions count the timed "
     "run only."),
    ("throughput_session10_reversed_H100.json", "The same comparison, modes in reverse order",
     "session 10, reverse order", "Same machine, about an hour later (other decode-kernel runs in between), modes "
     "in reverse order: within 4% of the run above for every mode. Between the two, a one-warp variant of the "
     "small-head decode kernel (12-29% faster in the kernel benchmark at batch 48-128) ran the same command at "
     "int4 15960 / diffkv 15380 tok/s and was dropped (kernels/decode_attention.py launch_config)."),
    ("throughput_session9_H100.json", "Generation throughput with async scheduling",
     "session 9, async steps", "Session 9, H100, the session-8 workload and order: decode steps are launched "
     "before the previous step's tokens are read (async scheduling, the engine's default on CUDA), so the host's "
     "per-step work overlaps the GPU; decode attention splits aim for two programs per SM. --warmup full; "
     "preemptions count the timed run only."),
    ("throughput_session8_H100.json", "Generation throughput after the fused decode-step page work",
     "session 8", "Session 8, H100, the same workload as session 7 plus int8 (now served by the full-width K8V8 "
     "decode kernel): the decode step's page work runs in two launches (kernels/decode_pages.py) instead of ~40, "
     "with the step inputs staged in pinned buffers. `diffkv:alpha_low=0.06` is the setting measured at int4's "
     "fidelity (session 7, below the session-7 table); the calibrated diffkv prunes nothing. --warmup full; "
     "preemptions count the timed run only."),
    ("throughput_session8_reversed_H100.json", "The same comparison, modes in reverse order", "session 8, reverse "
     "order", "Same machine, minutes later, modes in reverse order."),
    ("throughput_session7_H100.json", "Generation throughput with diffkv at int4's accuracy",
     "session 7, diffkv at int4's accuracy", "Session 7, H100: `diffkv:alpha_low=0.06` is SmolLM2's calibrated "
     "setting (alpha_high 4) with alpha_low raised to 0.06, which prunes ~15% of tokens; its fidelity against "
     "int4's is below the table. Every mode ran the workload once untimed first (--warmup full); this run's "
     "preemption counts include that warm-up (throughput.py reports the timed run only since)."),
    ("throughput_session7_reversed_H100.json", "The same comparison, modes in reverse order",
     "session 7, reverse order", "Same machine, minutes later, modes in reverse order: diffkv at int4's "
     "accuracy and int4 trade places between the two runs (level within the run-to-run spread); the calibrated "
     "diffkv (alpha_low 0, nothing pruned) stays behind both."),
    ("throughput_session6_H200.json", "Generation throughput after the session-6 step-cost fixes, with a trace",
     "session 6, short warm-up", "Session 6: the score update split by work in flight (policy 0.49 -> 0.20 ms "
     "per decode step at batch 64), a diffkv prompt layer's writes in one kernel (prompt step 41.5 -> 35.0 ms at "
     "8 x 1024 tokens), diffkv decode steps planned with their exact page growth (recorded in the decode graph): "
     "mean batch 53.5 -> 54.7. --trace sampled the run (docs/throughput_trace_H200.png): diffkv stores 80 B per "
     "token and head in steady state against int4's 83 (SmolLM2's calibrated alpha_low is 0: nothing is pruned, "
     "35% K8V4 + 65% K4V2 is int4's size), so both keep the same batch and the gap is diffkv's step cost."),
    ("throughput_session5_H200.json", "Generation throughput after the split-count fix, warm kernel cache",
     "split-count fix, warm", "Session 5: decode split count from work in flight per SM (SmolLM2's 3 KV heads "
     "and head_dim 64 left most SMs idle at batch 16-64; decode_splits_H200.json) and the diffkv prompt "
     "classification's prefix sum fixed (a scan over the outer dim, 35 ms of a 16k-token prompt step)."),
    ("throughput_session5_prompt_H200.json", "Generation throughput after the fused prompt kernels, warm kernel cache",
     "fused prompt kernels, warm", "Session 5, same machine, a few minutes later: also the prompt classification "
     "and the prompt page fit as one kernel each (a diffkv prompt step of 16 x 1024 tokens 123 -> 62 ms "
     "profiled). diffkv is unchanged within noise; fp16 and int4 differ from the run above by 9-13% "
     "(run-to-run spread of these ~20-45 s runs)."),
    ("throughput_warm_cache_H200.json", "Generation throughput, fp16 vs diffkv, warm kernel cache",
     "fp16 vs diffkv, warm cache", "Taken after other runs on the same machine, so every kernel variant was "
     "already compiled: the cleanest fp16 vs diffkv ratio recorded."),
    ("throughput_quartered_H200.json", "Generation throughput after the decode-kernel rewrite, warm kernel cache",
     "after kernel rewrite, warm", "Session 4, after the quartered PTX-unpacking decode kernel: every mode ran the "
     "workload once untimed first (--warmup full). Preemption counts include that warm-up run. SmolLM2's head_dim "
     "64 is where the new kernel gains least (decode_kernel_variants_H200.json), so diffkv is not faster here than "
     "in the warm-cache run above (different machine; ~5% run-to-run spread)."),
    ("throughput_H200.json", "Generation throughput per KV mode, long generations", "KV modes, cold cache",
     "Fresh machine: each mode compiled its own kernel variants inside its timing (cold Triton cache), which "
     "penalises the quantized modes; compare with the warm-cache run above."),
    ("throughput_natural_stop_H200.json", "Generation throughput per KV mode, natural stops",
     "KV modes, natural stops, cold cache", "Cold Triton cache as above; SmolLM2 often runs to the limit "
     "anyway, so batches stay small and the cache size matters less."),
    ("throughput_admission_H200.json", "Prompt admission rules (diffkv), long generations",
     "admission rules, warm cache", "Each rule run twice, alternating, on a warm kernel cache. Short prompts "
     "(~100 tokens) make the all-high prompt reservation cheap, so the learned rule has little to win here."),
    ("throughput_admission_cold_H200.json", "Prompt admission rules, cold cache, learned second",
     "admission, cold, learned 2nd", "The same comparison on a cold kernel cache: the rule run second looks faster."),
    ("throughput_admission_reversed_H200.json", "Prompt admission rules, cold cache, worst-case second",
     "admission, cold, worst-case 2nd", "Order reversed: now worst-case looks faster. The order (compilation), "
     "not the rule, made the difference in these two cold runs."),
)


TENSOR_PARALLEL_RUNS = ("tensor_parallel_H200.json",)
TRACE_RUN = "throughput_session6_H200.json"  # the --trace run docs/throughput_trace_H200.png shows


def tensor_parallel_section(name: str) -> list[str]:
    t = load(name)
    if t is None:
        return []
    lines = [f"### Tensor parallelism, {t['device']} x {max(t['tp'])} (`{name}`)", "",
             f"Random-weight `{t['model']}`, kv_mode {t['kv_mode']}, NCCL with NVLink multicast off "
             "(scripts/device/tp_bench.sh). Log: `tensor_parallel_H200.log`.", "", f"Command: `{t['command']}`", "",
             "| TP | check dtype | greedy tokens equal TP=1 | token match | max prompt-logit diff |",
             "|---:|---|---|---:|---:|"]
    for c in t["checks"]:
        lines.append(f"| {c['tp']} | {c['dtype']} | {c['tokens_equal']} | {c['token_match_fraction']:.3f} | "
                     f"{c['prompt_logits_max_abs_diff']:.2e} |")
    lines += ["", "| TP | batch | decode tok/s | step ms | vs TP=1 |", "|---:|---:|---:|---:|---:|"]
    for r in t["rows"]:
        lines.append(f"| {r['tp']} | {r['batch']} | {r['decode_tok_s']:.1f} | {r['step_ms']:.2f} | "
                     f"{r['speedup_vs_tp1']:.2f} |")
    return lines + ["", "_One short run per shape (128 new tokens); the step times move a lot between batch sizes "
                        "(TP=1 batch 32 slower per step than batch 128), so the throughput columns are indicative "
                        "only; the correctness check is the result._", ""]


def run_note(name: str) -> list[str]:
    return [f"_{note}_" for n, _, _, note in THROUGHPUT_RUNS if n == name] + [""]


def throughput_plot(path: Path) -> bool:
    """Tokens/s per KV mode relative to fp16 in the same run, one panel per run that compares KV modes."""
    runs = [(label, load(name)) for name, _, label, _ in THROUGHPUT_RUNS
            if load(name) is not None and not load(name)["config"].get("admission", [None])[1:]]  # KV modes only
    if not runs:
        return False
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, len(runs), figsize=(4.5 * len(runs), 3.6), squeeze=False)
    for ax, (title, t) in zip(axes[0], runs):
        rows = [r for r in t["rows"] if r.get("speedup_vs_fp16") is not None]
        ax.bar([r["mode"] for r in rows], [r["speedup_vs_fp16"] for r in rows],
               color=["#888" if r["mode"] == "fp16" else "#3b7dd8" for r in rows])
        ax.axhline(1.0, color="k", lw=0.8)
        ax.set_title(f"{title}\n{t['device']}", fontsize=9)
        ax.set_ylabel("tokens/s vs fp16 (same run, same KV pool)")
        ax.tick_params(axis="x", labelrotation=30, labelsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return True


# The service on a GPU (scripts/device/serve_sweep.sh): per KV mode, latency vs Poisson request rate and the
# highest rate sustained under the recorded TTFT SLO; its plot is drawn from the JSON (docs/<name>.png).
SERVE_SWEEP_RUNS = ("serve_sweep_H200.json",)


def _sweep_module():
    """loadtest/sweep.py, by path: the SLO rule and the plot live there, next to the numbers they read."""
    import importlib.util
    import sys

    if "loadtest_sweep" not in sys.modules:
        path = Path(__file__).resolve().parents[1] / "loadtest" / "sweep.py"
        spec = importlib.util.spec_from_file_location("loadtest_sweep", path)
        mod = importlib.util.module_from_spec(spec)
        sys.modules[spec.name] = mod
        spec.loader.exec_module(mod)
    return sys.modules["loadtest_sweep"]


def serve_sweep_section(name: str) -> list[str]:
    s = load(name)
    if s is None:
        return []
    setup, slo, runs = s.get("setup", {}), s["slo"], s["runs"]
    c = runs[0]["config"]
    meets = _sweep_module().meets_slo
    sustained = ", ".join(f"{label} {'none' if r is None else f'{r:g} req/s'}"
                          for label, r in s["sustained_rate"].items())
    out = [f"### The service: latency vs Poisson request rate, {s['device']} (`{name}`)", "",
           f"`diffkv serve` (one engine replica) on loopback, {', '.join(s['models'])}: at each rate "
           f"{c['num_requests']} streaming chat requests (`{Path(str(c['prompts'])).name}`, Poisson arrivals) of up to "
           f"{c['max_tokens']} new tokens (natural stops), KV pool {setup.get('kv_cache_memory_gb', '?')} GiB and "
           f"max_num_seqs {setup.get('max_num_seqs', '?')} for every mode, admission control "
           f"{'on' if setup.get('admission') else 'off'}, prefix caching "
           f"{'on' if setup.get('prefix_caching') else 'off'}. "
           "Per-token latency = end-to-end latency / output tokens, queueing included (the DiffKV paper's Figure 16 "
           "metric).", "", f"Command: `{setup.get('command', '?')}`", "",
           f"![per-token latency and TTFT vs request rate](/docs/{Path(name).stem}.png)", "",
           f"Highest rate sustained under the TTFT SLO (p{slo['percentile']} <= {slo['ttft_ms'] / 1000:g} s, every "
           f"request completed, at that rate and every lower one): {sustained}.", "",
           "| rate (req/s) | mode | completed | req/s | output tok/s | per-token ms | TTFT p50 ms | "
           f"TTFT p{slo['percentile']} ms | TPOT p50 ms | E2E p90 ms | SLO |",
           "|---:|---|---:|---:|---:|---:|---:|---:|---:|---:|---|"]

    def f(block, key):
        return "-" if (block or {}).get(key) is None else f"{block[key]:.0f}"
    rows = sorted(((r["rate"], i, run["label"], r) for i, run in enumerate(runs) for r in run["results"]
                   if r["rate"] != "inf"), key=lambda t: t[:2])
    for rate, _, label, r in rows:
        out.append(f"| {rate:g} | {label} | {r['completed']}/{r['num_requests']} | {r['request_throughput']:.2f} | "
                   f"{r['output_throughput']:.0f} | {f(r.get('per_token_latency'), 'mean')} | {f(r['ttft'], 'p50')} | "
                   f"{f(r['ttft'], 'p' + str(slo['percentile']))} | {f(r['tpot'], 'p50')} | {f(r['e2el'], 'p90')} | "
                   f"{'meets' if meets(r, slo['ttft_ms'], slo['percentile']) else 'misses'} |")
    skipped = [f"{run['label']} {', '.join(map(str, run['skipped_rates']))}" for run in runs
               if run.get("skipped_rates")]
    if skipped:
        out += ["", f"Rates skipped for time: {'; '.join(skipped)}."]
    return out + [""]


def serve_sweep_plot(name: str, path: Path) -> bool:
    """The per-token latency / TTFT figure of a recorded serve sweep (loadtest/sweep.py's plot_per_token)."""
    s = load(name)
    if s is None:
        return False
    _sweep_module().plot_per_token(s["runs"], path, s["slo"]["ttft_ms"], s["slo"]["percentile"])
    return True


def decode_sass_section(name: str) -> list[str]:
    d = load(name)
    if d is None:
        return []
    out = [f"### Decode kernels' SASS, {d['target']} compiled without a GPU (`{name}`)", "",
           f"Command: `{d['command']}` (Triton {d['triton']})", "",
           "Instructions of each kernel's main loop (one tile of `block n` tokens per program of `warps` warps) as "
           "ptxas emits them for an H100; `moves` are register copies (IMAD.MOV / MOV), most of them building "
           "mma operands. Defaults since session 10: 16 rows for fp16, 8 for the others (launch_config).", "",
           "| precision | kernel | min rows | block n | warps | registers | shared KB | loop | per token | HMMA "
           "| moves |",
           "|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
    out += [f"| {r['precision']} | {r['kernel']} | {r['min_rows']} | {r['block_n']} | {r['num_warps']} | "
            f"{r['registers']} | {r['shared_bytes'] / 1024:.1f} | {r['loop']} | {r['loop_per_token']:.1f} | "
            f"{r['hmma']} | {r['moves']} |" for r in d["rows"]]
    return out + [""]


def decode_splits_section(name: str) -> list[str]:
    """benchmarks/decode_splits.py: decode attention time per split count, in CUDA graphs."""
    d = load(name)
    if d is None:
        return []
    splits = sorted({int(k) for r in d["rows"] for k in r["us"]})
    out = [f"### Decode attention vs split count, {d['device']} (`{name}`)", "",
           "do_bench_cudagraph median us per call at each num_splits; `auto` = the split rule at the time of the "
           "run (the rule was changed after it: kernels/decode_attention.py:choose_num_splits). "
           + d.get("note", ""), ""]
    out += [f"Command: `{c}`" for c in d.get("commands", [d["command"]])] + [""]
    out += ["| precision | batch | seq | auto | " + " | ".join(f"s={k}" for k in splits) + " | best |",
            "|---|---:|---:|---:|" + "---:|" * (len(splits) + 1)]
    out += [f"| {r['precision']} | {r['batch']} | {r['seq']} | {r['auto_splits']} | "
            + " | ".join(f"{r['us'][str(k)]:.1f}" if str(k) in r["us"] else "" for k in splits)
            + f" | {r['best_splits']} |" for r in d["rows"]]
    scored = [r for r in d["rows"] if "score" in r]
    if scored:  # --score-splits: the generation-phase score update per split count
        ks = sorted({int(k) for r in scored for k in r["score"]["us"]})
        out += ["", "Score update (kernels/score_update.py) on the logits of the same call, us per split count; "
                "`auto` = choose_score_splits:", "",
                "| precision | batch | seq | auto | " + " | ".join(f"s={k}" for k in ks) + " | best | auto / best |",
                "|---|---:|---:|---:|" + "---:|" * (len(ks) + 2)]
        out += [f"| {r['precision']} | {r['batch']} | {r['seq']} | {r['score']['auto_splits']} | "
                + " | ".join(f"{r['score']['us'][str(k)]:.1f}" if str(k) in r["score"]["us"] else "" for k in ks)
                + f" | {r['score']['best_splits']} | {r['score']['auto_us'] / r['score']['best_us']:.2f} |"
                for r in scored]
    return out + [""]


def trace_plot(name: str, path: Path) -> bool:
    """A --trace throughput run: running batch and pages held over time, one line per KV mode."""
    d = load(name)
    runs = [r for r in (d or {}).get("rows", []) if "trace" in r]
    if not runs:
        return False
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(11, 4))
    for r in runs:
        f = r["trace"]["fields"]
        cols = list(zip(*r["trace"]["samples"]))
        t = cols[f.index("seconds")]
        ax1.plot(t, cols[f.index("num_running")], label=r["mode"])
        ax2.plot(t, [p / r["pages_total"] for p in cols[f.index("pages_used")]], label=r["mode"])
    ax1.set(xlabel="seconds", ylabel="running sequences", title="batch")
    ax2.set(xlabel="seconds", ylabel="fraction of the page pool held", title="pages", ylim=(0, 1.05))
    ax1.legend()
    fig.suptitle(f"{d['model']}, {d['device']}: {d['command'].split('throughput.py ')[-1]}", fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=90)
    plt.close(fig)
    return True


# throughput_qwen.py runs: tokens/s per KV mode beside the accuracy study's gsm_symbolic difference vs fp16
THROUGHPUT_AT_ACCURACY_RUNS = ("throughput_qwen2.5-1.5b_H100.json", "throughput_natural_stop_qwen2.5-1.5b_H100.json")


def throughput_accuracy_section(name: str) -> list[str]:
    d = load(name)
    if d is None:
        return []
    c = d["config"]
    stop = "natural stops" if c["natural_stop"] else "ignore_eos"
    task = d["accuracy_task"]
    out = [f"### Generation throughput at accuracy, {d['model']}, {d['device']} (`{name}`)", "",
           f"{c['num_prompts']} {'/'.join(c['tasks'])} eval prompts x up to {c['max_tokens']} new tokens ({stop}), "
           f"one KV pool of {d['kv_memory_gb']:.2f} GiB for every mode; runs in the order "
           f"{' '.join(d['order'])} (repeat:mode). Accuracy: {task} difference vs fp16 with its paired 95% interval "
           f"from `{d['study'] or 'no study'}`; "
           f"x best = vs {d['best_within'] or 'none'}, the fastest mode within {c['within']:g} point(s) of fp16.", "",
           f"Command: `{d['command']}`", "",
           f"| mode | study config | {task} vs fp16 (points) | sequences fit | tokens/s (median) | runs | spread | "
           f"vs fp16 | x best | mean batch | compression | preemptions |",
           "|---|---|---|---:|---:|---|---:|---:|---:|---:|---:|---:|"]

    def f(x, spec):
        return format(x, spec) if x is not None else "-"

    for r in d["rows"]:
        a = r["accuracy"]
        acc = (f"{a['diff_points']:+.1f} [{a['ci95_points'][0]:+.1f}, {a['ci95_points'][1]:+.1f}]"
               if a["diff_points"] is not None else "not measured")
        runs = " / ".join(f"{x['tokens_per_s']:.0f}{' (cut)' if x['cut'] else ''}" for x in r["runs"]) or "skipped"
        spread = f"{100 * r['spread']:.1f}%" if r["spread"] is not None else "-"
        out.append(f"| {r['mode']} | {a['study_config']} | {acc} | {r['seqs_fit']} | {f(r['tokens_per_s'], '.0f')} | "
                   f"{runs} | {spread} | {f(r['vs_fp16'], '.2f')} | {f(r['vs_best_within'], '.2f')} | "
                   f"{f(r['mean_batch'], '.1f')} | {f(r['compression_ratio'], '.2f')} | {f(r['preemptions'], '.0f')} |")
    skipped = ", ".join(f"{s['repeat']}:{s['mode']}" for s in d.get("skipped_runs", []))
    if skipped:
        out.append(f"\nRuns not started for --time-limit: {skipped}.")
    return out + [""]


def results_sections() -> list[str]:
    lines = decode_section("decode_throughput_H100.json") + decode_section("decode_throughput_H200.json")
    for name in THROUGHPUT_AT_ACCURACY_RUNS:
        lines += throughput_accuracy_section(name)
    for name, title, _, _ in THROUGHPUT_RUNS:
        lines += throughput_section(name, title)
    lines += attention_section("attention_H100.json")
    lines += attention_section("attention_H200.json")
    lines += decode_sass_section("decode_sass_sm90.json")
    lines += decode_splits_section("decode_splits_H200.json")
    lines += decode_splits_section("decode_splits_score_smollm2_H200.json")
    lines += decode_splits_section("decode_splits_score_8b_H200.json")
    lines += mm_section("memory_manager_H100.json", "session 8: the decode step's page work in two launches "
                        "(kernels/decode_pages.py), timed apart from Algorithm 1 (policy)")
    lines += mm_section("memory_manager_H200_eager.json", "memory management run eagerly (before CUDA graphs)")
    lines += mm_section("memory_manager_H200.json", "memory management captured in the decode CUDA graph")
    for name in STEP_BREAKDOWN_RUNS:
        lines += step_breakdown_section(name)
    lines += host_overhead_section("host_overhead_H100.json")
    for name in SERVE_SWEEP_RUNS:
        lines += serve_sweep_section(name)
    for name in TENSOR_PARALLEL_RUNS:
        lines += tensor_parallel_section(name)
    return lines


PERFORMANCE_INTRO = [
    "# Performance", "",
    "Generated by `python benchmarks/summarize_results.py` from the JSON files in `benchmarks/results/` (nothing "
    "typed in by hand); each table names the GPU and the exact command, and every comparison in a table was "
    "measured side by side in one run on one GPU. GPU runs happen on the lent H100/H200 machines from the "
    "repository root; CI runs each benchmark's `--smoke` mode on CPU.", "",
    "![tokens/s relative to fp16](throughput_H200.png)", "",
    "![running batch and pages held over a throughput run](throughput_trace_H200.png)", "",
]
PERFORMANCE_OPEN = [
    "## Not measured yet", "",
    "- Tensor parallelism on 2 GPUs (`python benchmarks/tensor_parallel.py --model random:llama3-8b --tp 1 2` on a "
    "2 x H200 machine, Ray carried as wheels).",
    "- The service on a GPU (`diffkv serve` + `loadtest/sweep.py`, fp16 vs diffkv latency vs Poisson rate).",
    "- A per-category step breakdown (model, attention, policy, memory management, host) of the 8B shape.",
    "- Generation throughput at accuracy on Qwen2.5-Coder-1.5B (`benchmarks/throughput_qwen.py` through "
    "`scripts/device/qwen_run.sh`).", "",
]


def render() -> tuple[str, str]:
    """(benchmarks/results/README.md, docs/PERFORMANCE.md) as the recorded JSON files give them."""
    lines = ["# Recorded results", "", "Generated by `python benchmarks/summarize_results.py` from the JSON files here.",
             "GPU runs happen on the lent H100/H200 machines from the repository root; CPU-only CI runs each script's "
             "`--smoke` mode.", ""]
    lines += results_sections()
    lines += ["CUDA test logs: `cuda_tests_H100.log` (engine + kernels, H100), `kernels_cuda_H200.log` (all kernels, "
              "H200), `engine_cuda_H200_before_dummy_fix.log` (the run that exposed the padding-row page leak, "
              "fixed afterwards), `engine_cuda_graphs_H200.log` (the CUDA-graph engine tests after the fix), "
              "`kernels_cuda_decode_H200.log` (decode attention + score update after the kernel rewrite: 46 passed, "
              "the run was stopped by its time limit before printing its summary).", ""]
    has_plot = any(load(run[0]) is not None for run in THROUGHPUT_RUNS)
    intro = PERFORMANCE_INTRO if has_plot else PERFORMANCE_INTRO[:4]
    body = [ln.replace("### ", "## ", 1) if ln.startswith("### ") else ln for ln in results_sections()]
    measured = any(load(name) is not None for name in STEP_BREAKDOWN_RUNS)
    still_open = [ln for ln in PERFORMANCE_OPEN if not (measured and ln.startswith("- A per-category step breakdown"))]
    tp_measured = any(load(name) is not None for name in TENSOR_PARALLEL_RUNS)
    still_open = [ln for ln in still_open if not (tp_measured and ln.startswith("- Tensor parallelism on 2 GPUs"))]
    serve_measured = any(load(name) is not None for name in SERVE_SWEEP_RUNS)
    still_open = [ln for ln in still_open if not (serve_measured and ln.startswith("- The service on a GPU"))]
    qwen_measured = any(load(name) is not None for name in THROUGHPUT_AT_ACCURACY_RUNS)
    still_open = [ln for ln in still_open if not (qwen_measured and ln.startswith("- Generation throughput at accuracy"))]
    return "\n".join(lines), "\n".join(intro + body + still_open)


def main() -> None:
    readme, performance = render()
    (RESULTS / "README.md").write_text(readme)
    print(f"wrote {RESULTS / 'README.md'}")
    throughput_plot(DOCS / "throughput_H200.png")
    trace_plot(TRACE_RUN, DOCS / "throughput_trace_H200.png")
    for name in SERVE_SWEEP_RUNS:
        serve_sweep_plot(name, DOCS / f"{Path(name).stem}.png")
    (DOCS / "PERFORMANCE.md").write_text(performance)
    print(f"wrote {DOCS / 'PERFORMANCE.md'}")


if __name__ == "__main__":
    main()
