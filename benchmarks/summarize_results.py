"""Render docs/PERFORMANCE.md, its plots and the index benchmarks/results/README.md from the recorded runs.

Every number on the page comes from a JSON file in benchmarks/results/ (or the accuracy file it names); every
table says which GPU ran it, the exact command and the date. A file that is absent drops its section.

Usage: python benchmarks/summarize_results.py
"""
from __future__ import annotations

import gzip
import json
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
RESULTS = Path(__file__).parent / "results"
DOCS = ROOT / "docs"

ATTENTION = "attention_H200.json"  # the current kernels, judged against the GPU's own floor
KERNEL_AB = "decode_mma_vs_triton_H200.json"  # the CUDA decode kernel against the Triton kernels it replaces
DECODE_THROUGHPUT = "decode_throughput_llama3_8b_H100.json"
# int4 beside diffkv at the Qwen settings (alpha_low 0: low scores unread), one GPU, one run
STEP_BREAKDOWN_RUNS = ("step_breakdown_int4_diffkv_qwen2.5-1.5b_H100.json",)
MEMORY_MANAGER = "memory_manager_H100.json"
SERVE_SWEEP = "serve_sweep_smollm2_H200.json"
# throughput_qwen.py runs: tokens/s per KV mode beside the accuracy study's gsm_symbolic difference vs fp16
THROUGHPUT_AT_ACCURACY_RUNS = ("throughput_qwen2.5-1.5b_H200.json",
                               "throughput_natural_stop_qwen2.5-1.5b_H200.json")
# prompt_batching.py: the scheduler's prompt-step settings side by side on one engine per mode (natural stops)
PROMPT_BATCHING = "prompt_batching_natural_stop_qwen2.5-1.5b_H200.json"
# The run whose trace shows where each mode's pool goes (benchmarks/throughput_trace_plot.py draws its plot).
THROUGHPUT_TRACE = "throughput_trace_qwen2.5-1.5b_H100.json"
TENSOR_PARALLEL = "tensor_parallel_llama3_8b_H200.json"
# our engine beside vLLM on one box (scripts/device/vllm_compare.sh)
VLLM_RUNS = ("vllm_vs_ours_long-decode_qwen2.5-1.5b_H100.json", "vllm_vs_ours_serving_qwen2.5-1.5b_H100.json")
# one decode step of each engine, kernel by kernel (benchmarks/decode_step_profile.py through vllm_compare.sh profile)
DECODE_STEP_PROFILE = "decode_step_profile_qwen2.5-1.5b_H200.json"

# Recorded runs no table shows: the measured alternatives behind kernel launch rules, cited from the code.
MEASURED_ALTERNATIVES = {
    "prompt_batching_natural_stop_learned_qwen2.5-1.5b_H200.json": "prompt_batching.py with --reservation learned "
        "(diffkv reserves each prompt's learned footprint): diffkv 24.4-31.7k tokens/s over the batching settings, "
        "not above the all-high reservation's 32.1-32.5k; int4 (which reserves exactly) 32.0-36.2k",
    "prompt_batching_ignore_eos_qwen2.5-1.5b_H200.json": "prompt_batching.py at 128 x 2,048 (ignore_eos, 0.98 GiB): "
        "prompt batching defers nothing there (every prompt is admitted at the start): int4 29.5-29.9k, diffkv "
        "28.1-28.2k tokens/s with and without it (diffkv's first run 24.8k: a first-run cost)",
    "attention_H100.json.gz": "benchmarks/attention.py on an H100 (floor 7 us + bytes / 3.1 TB/s) with the kernels "
                              "of 2026-11-28 morning (K8V8 on the q8 Triton kernel): of the floor min 0.76, big reads "
                              "min 82% of 3.0 TB/s",
    "decode_mma_vs_triton_H100.json": "decode_kernel_ab.py on an H100 before K8V8 moved to the CUDA kernel: 1.05-1.38x "
                                      "the quartered kernel; K8V8 under the quartered kernel's split rule 0.81-0.96x q8",
    "decode_splits_mma_cuda_llama3_8b_H200.json": "decode_splits.py, the CUDA kernel on K8V8 / fp8 pages at 1-32 "
                                                  "splits, Llama-3-8B heads, two tiles in flight: the automatic count "
                                                  "(mma_cuda.num_splits) was the fastest at every shape (batch 128 "
                                                  "now runs one stage unsplit: decode_stages_H200.json)",
    "decode_splits_mma_cuda_qwen2.5_1.5b_H200.json": "the same at Qwen2.5-1.5B's heads: the automatic count is the "
                                                     "fastest at every shape",
    "throughput_smollm2_H100.json.gz": "benchmarks/throughput.py on SmolLM2-135M (H100, 2026-11-22, an engine "
                                       "several scheduler and kernel changes ago): tokens/s per KV mode with a "
                                       "per-step trace",
    "throughput_smollm2_reversed_H100.json.gz": "the same command with the modes in reverse order",
    "step_breakdown_llama3_8b_H100.json": "benchmarks/step_breakdown.py at the Llama-3-8B shape, batches 64 and 256 "
                                          "(2026-11-25): diffkv's decode step 8.68 / 15.16 ms against int4's 7.82 / "
                                          "12.51 ms, policy 4.0% / 7.3% of it",
    "step_breakdown_diffkv_low_scores_read_qwen2.5-1.5b_H200.json": "step_breakdown.py, diffkv at alpha_low 1e-4 "
        "(low scores computed and read) on an H200: policy 7.1% (batch 128) and 9.0% (256) of the step, against "
        "4.3% and 4.7% at alpha_low 0",
    "throughput_diffkv_k8v4_k4v4_qwen2.5-1.5b_H100.json": "throughput_qwen.py, int4 against DiffKV K8V4/K4V4 a_h 16 "
                                                          "at 128 x 2,048: 24,437 vs 19,923 tokens/s",
    "throughput_serving_int4_diffkv_qwen2.5-1.5b_H100.json": "benchmarks/throughput.py --workload serving, int4 "
                                                             "against the default DiffKV (prompt steps of 16,384 "
                                                             "tokens, eager): 41,276 vs 34,769 tokens/s; prompt "
                                                             "steps 2.75 vs 2.91 s, decode steps at batch 509 "
                                                             "7.01 vs 9.01 ms",
    "vllm_baseline_long-decode_qwen2.5-1.5b_H100.json": "benchmarks/vllm_baseline.py: vLLM 0.26 alone, long-decode",
    "throughput_long-decode_qwen2.5-1.5b_int4_H100.json": "benchmarks/throughput.py, our int4 beside the vLLM "
                                                          "comparison (long-decode)",
    "graph_decode_check_2500_k4v4_untracked_H200.json": "benchmarks/graph_decode_check.py --variants lazy, 2,500 "
                                                        "problems, int4 on pages without score and position rows "
                                                        "(H200): 0.5108, 61 cut",
    "vllm_baseline_serving_qwen2.5-1.5b_H100.json": "benchmarks/vllm_baseline.py: vLLM 0.26 alone, serving workload",
    "throughput_long-decode_qwen2.5-1.5b_fp16_H100.json": "benchmarks/throughput.py, our fp16 row of the vLLM "
                                                          "comparison (long-decode)",
    "throughput_long-decode_qwen2.5-1.5b_fp8_H100.json": "benchmarks/throughput.py, our fp8 row of the vLLM "
                                                         "comparison (long-decode)",
    "throughput_long-decode_qwen2.5-1.5b_fp8_int4_H200.json": "benchmarks/throughput.py, the vLLM comparison's "
        "long-decode workload on an H200, ours alone, fp8 decoded by the CUDA kernel: fp8 18,985, int4 29,836 "
        "tokens/s (no vLLM run beside it)",
    "throughput_serving_qwen2.5-1.5b_fp16_H100.json": "benchmarks/throughput.py, our fp16 row of the vLLM comparison "
                                                      "(serving)",
    "throughput_serving_qwen2.5-1.5b_fp8_H100.json": "benchmarks/throughput.py, our fp8 row of the vLLM comparison "
                                                     "(serving)",
    "graph_decode_check_2500_k4v4_H100.json": "benchmarks/graph_decode_check.py, 2,500 problems + the 64 replays, "
                                              "int4 with the study's measured key centers: graphs 0.5132 (54 cut), "
                                              "eager 0.5132 (53 cut); fp16 0.5108",
    "graph_decode_check_2500_settings_centers_k4v4_H100.json": "the same with the settings file's key centers (the "
                                                               "served default): 0.5132, 54 cut",
    DECODE_THROUGHPUT: "benchmarks/decode_throughput.py, decode tokens/s against the roofline on the Llama-3-8B "
                       "shape (H100)",
    "prefix_sharing_pages_cpu.json": "benchmarks/prefix_sharing_pages.py, SmolLM2, 6 requests sharing a 296-token "
                                     "prefix: pages held by int4 1,170, diffkv without caching 2,235, diffkv sharing "
                                     "K8V4 1,257 / K4V4 1,170 (docs/PREFIX_CACHING.md)",
    "short_requests_bytes_cpu.json": "benchmarks/short_requests.py, SmolLM2, 24 chat requests x 128 tokens on 3,600 "
                                     "pages: KV bytes over fp16 bytes per held token, mean over steps: uniform K8V4 "
                                     "0.533, int4 0.373, DiffKV K8V4/K4V2 a_h 8 a_l 0 (Qwen's default shape) 0.420, "
                                     "DiffKV K8V4/K4V4 a_h 64 a_l 0 0.470 (low pages without score rows)",
    "graph_decode_check_k4v4_H100.json": "benchmarks/graph_decode_check.py: 256 gsm_symbolic problems, int4, decode "
                                         "steps eager / CUDA graphs captured lazily / warm / in a small pool: same "
                                         "accuracy (0.496 eager, 0.488 graphs) and cut generations (6, 5)",
    "graph_decode_check_study_flow_k4v4_H100.json": "benchmarks/graph_decode_check.py with the study's 64 teacher-forced "
                                                    "replays in the batch, 768 problems: eager 0.492 (18 cut), graphs "
                                                    "0.496 (19 cut)",
    "step_breakdown_llama3_8b_s4096_H100.json": "benchmarks/step_breakdown.py on the Llama-3-8B shape at 4,096 "
                                                "cached tokens (the 1,024-token run is in docs/PERFORMANCE.md)",
    "attention_triton_kernels_H100.json": "benchmarks/attention.py on an H100 with the quartered Triton kernel serving K8V4, K4V2 and "
                           "mix (before decode_mma.cu): of the floor K8V4 0.72-1.01, K4V2 0.65-1.02, mix 0.66-0.80",
    "decode_variants_H100.json": "decode-attention kernel variants tried for diffkv_serve/kernels/decode_attention/launch.py launch_config",
    "decode_kernel_variants_H200.json": "element-wise against quartered PTX unpacking in the decode kernel",
    "decode_splits_H200.json": "decode attention time per split count (diffkv_serve/kernels/decode_attention/launch.py)",
    "decode_splits_gqa6_H100.json": "decode attention time per split count at Qwen2.5-1.5B's heads (GQA 6): the "
                                    "automatic split count within 8% of the best at every shape",
    "tune_decode_attention_H200.json": "decode tile size / warps / stages sweep (benchmarks/tune_decode_attention.py)",
    "tune_decode_attention_q8_H100.json": "the q8 kernel's tile size / warps / split count sweep behind "
                                          "launch.q8_launch (benchmarks/tune_decode_attention.py --graph)",
    "decode_stages_H200.json": "benchmarks/decode_stages.py, Llama-3-8B heads, batch 128-192 x 1,024-16,384 "
                               "tokens: the CUDA kernel at one and two tiles in flight, 1 / 2 / 4 splits. The "
                               "automatic pick (mma_cuda.one_stage, num_splits) is the fastest or within 5.5%; "
                               "against two stages unsplit, DiffKV's mix at batch 160 runs 1.25-1.29x, K8V8 at "
                               "batch 128 x 1,024 1.21x (71.5 against 86.7 us)",
    "decode_merge_H200.json": "benchmarks/decode_merge.py: the split merge alone (CUDA graph), merge_launch's "
                              "32-wide slices of head_dim against whole rows a program: 1.6-2.1 us against 2.5-3.4",
    "q_precision_qwen2.5-coder-1.5b_cpu.json": "benchmarks/q_precision.py on Qwen2.5-Coder-1.5B (1,024 prompt "
        "tokens, served key centering, CPU): the 8-bit q the decode kernel takes against 4- and 2-bit keys adds "
        "2-9% of the attention-output error 4-bit K/V already cost (K4V2 / K4V4, rotation on or off; the total "
        "error rises 0.03-0.45%), 1.15-1.9x that with the zero points' term on q as given; its 16-bit q against "
        "8-bit keys adds 3-4% of K8V8's, where 8-bit q would add 91-153% (and 11-20% of K8V4's, DiffKV's high "
        "section: total +1.0-3.1%)",
    "p_precision_qwen2.5-coder-1.5b_cpu.json": "benchmarks/p_precision.py on Qwen2.5-Coder-1.5B (1,024 prompt "
        "tokens, served key centering, CPU): the p.v weights as 8-bit integers at one scale per 64-token tile, what "
        "an integer p.v mma would take, add 1.1-3.7% of the attention-output error 4-bit K/V cost and 6.5-7.4% of "
        "K8V4's (the total moving -0.01 to +0.29%) against the fp16 weights the decode kernel uses; 7 bits, twice that",
    "decode_sass_sm90.json": "main-loop instruction counts of the decode kernels compiled for sm_90 (the Triton "
                             "kernels and the CUDA kernel, decode_mma)",
    "prefix_cache_overhead_cpu.json": "prefix caching on/off, CPU (docs/PREFIX_CACHING.md)",
    "prefix_routing_cpu.json": "prefix-cache hit rate and TTFT, KV-headroom vs prefix-aware router "
                               "(loadtest/prefix_routing.py, docs/DESIGN.md)",
    "soak_cpu.json": "soak near capacity with an engine replica killed midway, CPU (docs/SOAK.md)",
    "throughput_learned_admission_qwen2.5-1.5b_H100.json": "throughput_qwen.py with --reservation learned: diffkv's "
                                                            "batch did not grow (80.6), its second run preempted more",
    "key_centering_decode_cost_H100.json": "decode step with key centering off / on (the rotated k_proj bias), "
                                           "random-weight Qwen2.5-1.5B shape, int4, engines in order A B B A",
    "sampler_cost_cpu.json": "benchmarks/sampler_cost.py, CPU (2 shared cores), vocab 49152, minimum ms: presence / "
                             "frequency / repetition penalties add 0.6 ms to greedy's 0.04 at batch 1, 12 ms to 0.5 at "
                             "32, and 12-20% to top-p sampling (its sort dominates); top-5 logprobs 0.2 / 1.9 ms; "
                             "whole requests with logprobs 0.98x, with 128-token prompt logprobs 1.67x",
    "grammar_libraries_cpu.json": "benchmarks/grammar_libraries.py: xgrammar, llguidance, outlines-core on the "
                                  "embedded 49k vocabulary (compile, per-token mask, install); llguidance chosen "
                                  "(docs/STRUCTURED_OUTPUTS.md)",
    "kv_rotation_decode_cost_H100.json": "decode step with the KV rotation off / on: +1.9% at batch 1, +1.0% at 32, "
                                         "+0.4% at 128 (random-weight Qwen2.5-1.5B shape, int4, order A B B A)",
}


def load(name: str):
    """A recorded run, or None; `.json.gz` files are the large ones (per-step traces) stored compressed."""
    p = RESULTS / name
    if not p.exists():
        return None
    raw = gzip.decompress(p.read_bytes()) if p.suffix == ".gz" else p.read_bytes()
    return json.loads(raw)


def provenance(d: dict, command: str | None = None) -> list[str]:
    """The line under every table heading: GPU, date, exact command."""
    return [f"{d['device']}, {d.get('date', 'undated')}: `{command or d['command']}`", ""]


def attention_section() -> list[str]:
    a = load(ATTENTION)
    if a is None:
        return []
    bw = a["config"]["bandwidth"] / 1e12
    fl = a["floor"]
    precisions = list(a["config"]["precisions"]) + ["sdpa-gqa"]
    out = ["## Decode attention: bandwidth and the floor per KV precision", "", *provenance(a),
           "One decode step's attention over the paged cache, head_dim 128, timed as CUDA-graph replays (each row "
           f"timed {a['config']['repeats']} times, the slowest kept). Cells: microseconds per call, the share of "
           f"{bw:.2f} TB/s that the bytes read represent (quantized data + scales + q + output), and the speed as a "
           f"fraction of the floor t0 + bytes / BW, fitted to torch SDPA in the same run: t0 = {fl['t0_us']:.1f} us, "
           f"BW = {fl['bw'] / 1e12:.2f} TB/s (largest SDPA residual {100 * fl['max_rel_residual']:.0f}%). `mix` is "
           "half K8V4, half K4V2 tokens; `sdpa-gqa` is torch SDPA on a contiguous fp16 cache.", ""]
    served = {}
    for r in a["rows"]:
        if r.get("kernel"):
            served.setdefault(r["precision"], r["kernel"])
    if served:
        out += ["Kernel serving each precision: " + ", ".join(f"{p} `{k}`" for p, k in served.items()) + ".", ""]
    for heads, h in a["config"]["heads"].items():
        cells = {(r["precision"], r["batch"], r["seq"]): r for r in a["rows"] if r["heads"] == heads}
        out += [f"{heads} heads ({h['hq']} query / {h['hkv']} KV, GQA {h['hq'] // h['hkv']}):", "",
                "| batch | tokens | " + " | ".join(precisions) + " |", "|---:|---:|" + "---:|" * len(precisions)]
        for b in a["config"]["batches"]:
            for s in a["config"]["seqs"]:
                row = [cells.get((p, b, s)) for p in precisions]
                out.append(f"| {b} | {s} | " + " | ".join(
                    "-" if r is None else f"{r['judged_us']:.0f} us, {100 * r['judged_frac_bw']:.0f}%, "
                                          f"{r['of_floor']:.2f}" for r in row) + " |")
        out.append("")
    t = a["targets"]
    f, big = t["of_floor"], t["big_reads"]
    below = sorted({tuple(x[:2]) for x in f["failing"]})
    below_text = "; below it: " + ", ".join(f"{p} ({h})" for h, p in below) if below else ""
    out += [f"Targets: every compressed precision at >= {f['target']} of the floor where batch x tokens >= "
            f"{f['min_tokens']}: {'met' if f['pass'] else 'not met'} (lowest {f['min']:.2f}{below_text}); "
            f">= {100 * big['target']:.0f}% of {bw:.2f} TB/s where a "
            f"call reads >= {big['min_bytes'] / 1e6:.0f} MB: {'met' if big['pass'] else 'not met'} (lowest "
            f"{100 * big['min']:.0f}%).", ""]
    out += gpu_state_lines(a)
    return out


def gpu_state_lines(a: dict) -> list[str]:
    """What nvidia-smi said while the rows were timed: the clock and how often the power cap held it down, with the
    largest calls (the last batch and length) apart, since they are the ones that reach the cap."""
    if not a.get("gpu_state"):
        return []
    b, s = max(a["config"]["batches"]), max(a["config"]["seqs"])
    big = {}
    for r in a["rows"]:
        if r.get("gpu") and r["batch"] == b and r["seq"] == s:
            big.setdefault(r["precision"], []).append(r["gpu"])
    cells = []
    for p, v in a["gpu_state"].items():
        cell = f"{p} {v['sm_mhz']:.0f} MHz, {100 * v['power_capped']:.0f}% capped"
        if big.get(p):
            cell += (f" (batch {b} x {s}: {min(g['sm_mhz'] for g in big[p]):.0f} MHz, "
                     f"{100 * max(g['power_capped'] for g in big[p]):.0f}%)")
        cells.append(cell)
    limit = next(iter(a["gpu_state"].values()))["power_limit_w"]
    return [f"GPU while timing (nvidia-smi, median SM clock and the share of samples at the {limit:.0f} W power cap): "
            + "; ".join(cells) + ".", ""]


def kernel_ab_section() -> list[str]:
    d = load(KERNEL_AB)
    if d is None:
        return []
    shapes = list(dict.fromkeys((r["B"], r["S"]) for r in d["rows"]))
    out = ["## Decode attention: the CUDA kernel against the Triton kernel", "", *provenance(d),
           "The same calls timed with `kernel=\"mma_cuda\"` (diffkv_serve/kernels/decode_attention/decode_mma.cu) and with the "
           "Triton kernel the dispatcher picks otherwise (`quartered`, or `q8` for K8V8 pages) in one run, "
           "CUDA-graph microseconds per call (CUDA / Triton, and the speedup), head_dim 128, 16-token fp16 page "
           "size. `K8V4+K4V2` is DiffKV's call (half the tokens in each section); `+logits` adds the per-token "
           "logits and lse its significance update reads. The dispatcher gives the CUDA kernel both Triton kernels' "
           "calls wherever it can serve them (K8V8 split by `mma_cuda.num_splits`).", "",
           "| heads | pages | " + " | ".join(f"B{b} S{s}" for b, s in shapes) + " |",
           "|---|---|" + "---:|" * len(shapes)]
    cells = {(r["heads"], r["spec"], r["B"], r["S"]): r for r in d["rows"]}
    for heads, spec in dict.fromkeys((r["heads"], r["spec"]) for r in d["rows"]):
        for suffix in ("", "+logits"):
            if suffix and "+" not in spec:
                continue
            row = []
            for b, s in shapes:
                r = cells.get((heads, spec, b, s))
                if r is None:
                    row.append("-")
                    continue
                base = r.get("baseline", "quartered")  # the Triton kernel the dispatcher would pick otherwise
                cuda, tri = r["mma_cuda" + suffix], r[base + suffix]
                row.append(f"{cuda:.1f} / {tri:.1f} ({tri / cuda:.2f}x)")
            out.append(f"| {heads} | {spec}{suffix} | " + " | ".join(row) + " |")
    return out + [""]


def decode_throughput_section() -> list[str]:
    d = load(DECODE_THROUGHPUT)
    if d is None:
        return []
    r0 = d["rows"][0]
    out = ["## Decode throughput against the roofline", "", *provenance(d),
           f"Random-weight `{d['preset']}` in {d['dtype'].removeprefix('torch.')}, fp16 KV mode, CUDA-graph decode, "
           f"prompt {r0['prompt_len']}, {r0['new_tokens']} new tokens. Roofline: (weights + KV read per step) / "
           f"{d['bandwidth'] / 1e12:.1f} TB/s.", "",
           "| batch | decode tok/s | step ms | roofline step ms | step / roofline |", "|---:|---:|---:|---:|---:|"]
    out += [f"| {r['batch']} | {r['decode_tok_s']:.0f} | {r['step_ms']:.2f} | {r['roofline_step_ms']:.2f} | "
            f"{r['vs_roofline']:.2f} |" for r in d["rows"]]
    return out + [""]


def study_caveat(study: str | None) -> str:
    """' Caveat: ...' where the accuracy study a table quotes carries one (docs/ACCURACY.md prints it too)."""
    path = ROOT / study if study else None
    if path is None or not path.is_file():
        return ""
    caveat = json.loads(path.read_text()).get("caveat")
    return f" The study's caveat (docs/ACCURACY.md): {caveat}" if caveat else ""


def throughput_accuracy_section(name: str, header: bool = True) -> list[str]:
    """header: the section's title (the runs after the first share it)."""
    d = load(name)
    if d is None:
        return []
    c = d["config"]
    stop = "natural stops" if c["natural_stop"] else "ignore_eos"
    task = d["accuracy_task"]
    title = [f"## Generation throughput at accuracy: {d['model']}", ""] if header else []
    out = [*title, *provenance(d),
           f"{c['num_prompts']} {'/'.join(c['tasks'])} eval prompts x up to {c['max_tokens']} new tokens ({stop}), "
           f"one KV pool of {d['kv_memory_gb']:.2f} GiB for every mode; runs in the order "
           f"{' '.join(d['order'])} (repeat:mode). Accuracy: {task} difference vs fp16 with its paired 95% interval "
           f"from `{d['study'] or 'no study'}`; "
           f"x best = vs {d['best_within'] or 'none'}, the fastest mode within {c['within']:g} point(s) of fp16."
           f"{study_caveat(d['study'])}", "",
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
    split = [(r["mode"], r["runs"][0]["phases"]) for r in d["rows"] if r["runs"] and r["runs"][0].get("phases")]
    if split:  # steps that computed prompt tokens (new requests, recomputes after preemption) against the rest
        out.append("\nWhere each mode's first run went: " + "; ".join(
            f"{m} {p['prefill']['steps']:,} prompt steps {p['prefill']['seconds']:.1f} s "
            f"({p['prefill']['tokens']:,} tokens), {p['decode']['steps']:,} decode steps {p['decode']['seconds']:.1f} s "
            f"({1e3 * p['decode']['seconds'] / max(p['decode']['steps'], 1):.2f} ms each)" for m, p in split) + ".")
    return out + [""]


def pool_trace_section() -> list[str]:
    """Where each mode's pool goes in the traced run: batch against pages per cached token and KV head."""
    sys.path.insert(0, str(Path(__file__).parent))  # the plot script beside this one reads the trace
    from throughput_trace_plot import phases, series

    d = load(THROUGHPUT_TRACE)
    if d is None or "trace_fields" not in d:
        return []
    png = THROUGHPUT_TRACE.removesuffix(".json") + ".png"
    out = ["## Where the pool goes: pages per token against batch", "",
           f"The trace of `{THROUGHPUT_TRACE}` (above; every {d['config']['stats_every']} steps): sequences running, "
           "the pages the running sequences hold per cached token and (layer, KV head), and the share of token "
           "entries kept high / low / pruned, while preempted sequences wait and after the queue emptied (then the "
           f"recomputed sequences run, their prompts classified in one prefill). Plot: `python "
           f"benchmarks/throughput_trace_plot.py benchmarks/results/{THROUGHPUT_TRACE} --png docs/{png}`.", ""]
    if (DOCS / png).exists():
        out += [f"![pool trace]({png})", ""]
    out += ["| mode | phase | mean running | pages per token and KV head | high | low | pruned |",
            "|---|---|---:|---:|---:|---:|---:|"]
    for row in d["rows"]:
        if not any(r.get("trace") and not r["cut"] for r in row["runs"]):
            continue
        for name, p in phases(series(d, row)).items():
            out.append(f"| {row['mode']} | {name} | {p['running']:.1f} | {p['pages_per_token_head']:.5f} | "
                       f"{100 * p['high']:.1f}% | {100 * p['low']:.1f}% | {100 * p['pruned']:.1f}% |")
    return out + [""]


def step_breakdown_section() -> list[str]:
    runs = [(n, load(n)) for n in STEP_BREAKDOWN_RUNS if load(n) is not None]
    if not runs:
        return []
    cats = ("model", "attention", "policy", "memory", "host")
    out = ["## Where a step's time goes: memory management's share", ""]
    for _, d in runs:
        out += provenance(d)
    d0 = runs[0][1]
    out += [f"Random-weight `{d0['preset']}`, asynchronous scheduling. Each GPU kernel counts once, by its name or "
            "the engine range that launched it: `policy` is Algorithm 1 (significance, classification, planning), "
            "`memory` the memory manager (allocation, compaction, page table), `host` the step time the GPU waits "
            "for the host. Cells: % of the step; device ms: the step's kernel time. Decode steps (the prompt steps "
            "are in the JSON).", "",
            "| mode | batch | tokens | phase | step ms | device ms | " + " | ".join(cats) + " |",
            "|---|---:|---:|---|---:|---:|" + "---:|" * len(cats)]
    for _, d in runs:
        out += [f"| {_breakdown_mode(d, r['mode'])} | {r['batch']} | {r['seq']} | {r['phase']} | {r['wall_ms']:.2f} | "
                f"{r['busy_ms']:.2f} | " + " | ".join(f"{r['pct'][k]:.1f}" for k in cats) + " |"
                for r in d["rows"] if "skipped" not in r and r["phase"] == "decode"]
        out += [f"- skipped: {r['mode']} batch {r['batch']} tokens {r['seq']}: {r['skipped']}"
                for r in d["rows"] if "skipped" in r]
    return out + [""]


def _breakdown_mode(d: dict, mode: str) -> str:
    """The mode, with the diffkv thresholds and precisions the run gave on its command line."""
    knobs = d.get("config", {}).get("diffkv") or {}
    if mode != "diffkv" or not knobs:
        return mode
    names = (("high", "{}"), ("low", "/{}"), ("alpha_high", " a_h {:g}"), ("alpha_low", " a_l {:g}"))
    return mode + " " + "".join(f.format(knobs[k]) for k, f in names if k in knobs).strip()


def memory_manager_section() -> list[str]:
    m = load(MEMORY_MANAGER)
    if m is None:
        return []
    out = ["## The memory manager on its own, GPU against CPU", "", *provenance(m),
           "Per step, for a batch of 1024-token diffkv sequences of the Llama-3-8B shape (32 layers x 8 KV heads): "
           "a prompt step reserves, fits and finishes each layer's pages; a generation step plans every (sequence, "
           "layer, head), grows pages and moves tokens. The CPU row runs the same batched plan with torch on the "
           "host. Below the table, the memory manager's share of a whole decode step in the engine.", "",
           "| device | batch | prompt step ms | generation step ms |", "|---|---:|---:|---:|"]
    out += [f"| {r['device']} | {r['batch']} | {r['prompt_mm_ms']:.3f} | {r['gen_mm_ms']:.3f} |" for r in m["rows"]]
    out += [""] + [f"- inside the engine (CUDA graph), batch {e['batch']}: {e['engine_mm_ms']:.3f} ms of a "
                   f"{e['decode_step_ms']:.2f} ms decode step, {100 * e['mm_share_engine']:.2f}%" for e in m["engine"]]
    return out + [""]


def _sweep_module():
    """loadtest/sweep.py, by path: the SLO rule and the plot live there, next to the numbers they read."""
    import importlib.util
    import sys

    if "loadtest_sweep" not in sys.modules:
        spec = importlib.util.spec_from_file_location("loadtest_sweep", ROOT / "loadtest" / "sweep.py")
        mod = importlib.util.module_from_spec(spec)
        sys.modules[spec.name] = mod
        spec.loader.exec_module(mod)
    return sys.modules["loadtest_sweep"]


def serve_sweep_section() -> list[str]:
    s = load(SERVE_SWEEP)
    if s is None:
        return []
    setup, slo, runs = s.get("setup", {}), s["slo"], s["runs"]
    c = runs[0]["config"]
    meets = _sweep_module().meets_slo
    sustained = ", ".join(f"{label} {'none' if r is None else f'{r:g} req/s'}"
                          for label, r in s["sustained_rate"].items())
    out = ["## Serving: latency against Poisson request rate", "", *provenance(s, setup.get("command", "?")),
           f"`diffkv serve` (one engine replica) on loopback, {', '.join(s['models'])}: at each rate "
           f"{c['num_requests']} streaming chat requests (`{Path(str(c['prompts'])).name}`) of up to "
           f"{c['max_tokens']} new tokens (natural stops), KV pool {setup.get('kv_cache_memory_gb', '?')} GiB and "
           f"max_num_seqs {setup.get('max_num_seqs', '?')} for every mode, admission control "
           f"{'on' if setup.get('admission') else 'off'}, prefix caching "
           f"{'on' if setup.get('prefix_caching') else 'off'}. Per-token latency = end-to-end latency / output "
           "tokens, queueing included.", "",
           f"Highest rate sustained under the TTFT SLO (p{slo['percentile']} <= {slo['ttft_ms'] / 1000:g} s, every "
           f"request completed, at that rate and every lower one): {sustained}.", "",
           f"![per-token latency and TTFT vs request rate]({Path(SERVE_SWEEP).stem}.png)", "",
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


def tensor_parallel_section() -> list[str]:
    t = load(TENSOR_PARALLEL)
    if t is None:
        return []
    out = ["## Tensor parallelism", "", *provenance(t),
           f"Random-weight `{t['model']}`, kv_mode {t['kv_mode']}, {max(t['tp'])} GPUs of one host over NCCL "
           "(scripts/device/tp_bench.sh). Correctness: greedy tokens and prompt logits of TP=N against TP=1.", "",
           "| TP | check dtype | greedy tokens equal TP=1 | token match | max prompt-logit diff |",
           "|---:|---|---|---:|---:|"]
    out += [f"| {c['tp']} | {c['dtype']} | {c['tokens_equal']} | {c['token_match_fraction']:.3f} | "
            f"{c['prompt_logits_max_abs_diff']:.2e} |" for c in t["checks"]]
    out += ["", "Speed: one short run per shape (128 new tokens), so step times are noisy (TP=1 batch 32 is slower "
            "per step than batch 128).", "",
            "| TP | batch | decode tok/s | step ms | vs TP=1 |", "|---:|---:|---:|---:|---:|"]
    out += [f"| {r['tp']} | {r['batch']} | {r['decode_tok_s']:.0f} | {r['step_ms']:.2f} | {r['speedup_vs_tp1']:.2f} |"
            for r in t["rows"]]
    return out + [""]


WORKLOADS = {"long-decode": "128 prompts x 2,048 new tokens (ignore_eos), a 0.98 GiB KV pool",
             "serving": "1,024 prompts of 512 tokens x 256 new tokens (ignore_eos), an 8 GiB KV pool, up to 512 "
                        "sequences"}


def parts(d: dict) -> str:
    """The vllm_compare.sh parts a comparison ran, where they are not the default ones."""
    ours = {r["ours_mode"] for r in d["rows"] if r.get("ours_tokens_per_s")}
    return " vllm " + " ".join(f"ours-{m}" for m in ("fp16", "fp8", "int4") if m in ours) if "int4" in ours else ""


def prompt_batching_section() -> list[str]:
    """The scheduler's prompt-step settings side by side (benchmarks/prompt_batching.py)."""
    d = load(PROMPT_BATCHING)
    if d is None:
        return []
    c = d["config"]
    out = ["## Prompt steps under natural stops: batching them and keeping headroom", "", *provenance(d),
           f"{c['num_prompts']} gsm_symbolic prompts x up to {c['max_tokens']} new tokens (natural stops), "
           f"{d['kv_memory_gb']:.2f} GiB pool, one engine per mode with its scheduler settings swapped between runs "
           "(k = prefill_min_prompts, delay = prefill_max_delay_steps, w = prefill_watermark; the defaults are k 8, "
           "delay 16, w 0.01). A prompt step stops every running sequence for one forward; once the pool is full, "
           "pages come back a finished sequence at a time and each prompt step admitted one or two prompts, many "
           "preempted again a few steps later. The first setting runs again last (beside its first run): the gap is "
           "the run-to-run drift (a mode's first run is its slowest).", "",
           "| mode | settings | tokens/s | x first | prompt steps | prompt s | decode steps | decode s | preemptions "
           "| deferred steps | mean batch |", "|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
    again = {r["mode"]: r for r in d["rows"] if r["variant"].endswith("(again)")}
    for r in d["rows"]:
        if r["variant"].endswith("(again)"):
            continue
        first = r is next(x for x in d["rows"] if x["mode"] == r["mode"])
        tps = f"{r['tokens_per_s']:.0f}"
        if first and r["mode"] in again:
            tps += f" (again, last: {again[r['mode']]['tokens_per_s']:.0f})"
        out.append(f"| {r['mode']} | {r['resolved']} | {tps} | {r['vs_first']:.2f} | "
                   f"{r['prompt_steps']} | {r['prompt_seconds']:.2f} | {r['decode_steps']} | "
                   f"{r['decode_seconds']:.2f} | {r['preemptions']} | {r['deferred_steps']} | {r['mean_batch']:.1f} |")
    return out + [""]


def vllm_section() -> list[str]:
    """Our engine beside vLLM on the same workload, one device command (scripts/device/vllm_compare.sh)."""
    lines: list[str] = []
    for name in VLLM_RUNS:
        d = load(name)
        if d is None:
            continue
        lines += [f"## Against vLLM {d['vllm']}: {d['workload']} workload, {d['model']}", "",
                  f"{d['device']}, {d.get('date', 'undated')}: `bash scripts/device/vllm_compare.sh {d['workload']}"
                  f"{parts(d)}` "
                  "(benchmarks/vllm_baseline.py, then benchmarks/throughput.py per mode, on one box)", ""]
        lines += [f"{WORKLOADS.get(d['workload'], d['workload'])}, random weights of the model's shape, prefix "
                  "caching off in both engines, generate() timed after a warm-up.", "",
                  f"| cache | vLLM {d['vllm']} tok/s | ours tok/s | ours / vLLM | preemptions (vLLM / ours) |",
                  "|---|---:|---:|---:|---:|"]

        def num(x, spec=",.0f"):
            return "-" if x is None else format(x, spec)

        for r in d["rows"]:
            v, o = r.get("vllm_tokens_per_s"), r.get("ours_tokens_per_s")
            ratio = f"{r['ours_over_vllm']:.2f}" if r.get("ours_over_vllm") else "-"
            pre = f"{num(r.get('vllm_preemptions'))} / {num(r.get('ours_preemptions'))}"
            vcell = num(v) if v else (r.get("vllm_error") or "-")
            lines.append(f"| {r['cache']} ({r['ours_mode']}) | {vcell} | {num(o)} | {ratio} | {pre} |")
        lines.append("")
    return lines


def decode_step_profile_section() -> list[str]:
    """One decode step of our engine beside vLLM's on the same batch, by what its kernels do."""
    d = load(DECODE_STEP_PROFILE)
    if d is None:
        return []
    eng = {k: r for k, r in d["engines"].items() if "error" not in r}
    if not eng:
        return []
    sys.path.insert(0, str(Path(__file__).parent))  # the benchmark's own name rules
    from decode_step_profile import category, summarize

    for r in eng.values():  # categories by today's name rules (the recorded ones are as the run classified them)
        for k in r["kernels"]:
            k["category"] = category(k["kernel"])
        r["categories"] = summarize(r["kernels"])
    c = d["config"]
    names = list(eng)
    label = {k: (r.get("engine") if k == "vllm" else "ours") for k, r in eng.items()}
    out = ["## One decode step beside vLLM's, kernel by kernel", "", *provenance(d),
           f"{c['batch']} sequences of {c['prompt_len']} random prompt tokens, {c['cache']} KV cache, random weights "
           f"of the model's shape, each engine in its own process after its CUDA graphs were captured. Per decode "
           f"step: the wall time of generate() with {c['steps']} more tokens minus generate() with one, over "
           f"{c['steps']}; kernels from the same two calls under torch.profiler (calls and time, the longer run "
           "minus the shorter). Cells: ms per step (kernel launches per step). vLLM runs its engine core in its own "
           "process here (VLLM_ENABLE_V1_MULTIPROCESSING=0) so that the profiler sees its kernels: its wall time then "
           "includes host work that its default two-process mode overlaps; compare kernel times.", "",
           "| per decode step | " + " | ".join(label[n] for n in names) + " |", "|---|" + "---:|" * len(names),
           "| wall time | " + " | ".join(f"{eng[n]['wall_ms_per_step']:.3f} ms" for n in names) + " |",
           "| kernel time | " + " | ".join(f"{eng[n]['kernel_ms_per_step']:.3f} ms ({eng[n]['kernels_per_step']:.0f})"
                                          for n in names) + " |"]
    cats = sorted({k for r in eng.values() for k in r["categories"]},
                  key=lambda k: -max(r["categories"].get(k, {}).get("us", 0) for r in eng.values()))
    for k in cats:
        cells = []
        for n in names:
            x = eng[n]["categories"].get(k)
            cells.append(f"{x['us'] / 1e3:.3f} ms ({x['calls']:.0f})" if x else "-")
        out.append(f"| {k} | " + " | ".join(cells) + " |")
    out.append("")
    for n in names:
        top = eng[n]["kernels"][:6]
        out.append(f"Longest kernels, {label[n]}: " + "; ".join(
            f"`{r['kernel'][:60]}` {r['us']:.0f} us" for r in top) + ".")
        out.append("")
    return out


def render_performance() -> str:
    lines = ["# Performance", "",
             "Generated by `python benchmarks/summarize_results.py` from the recorded runs in `benchmarks/results/` "
             "(listed in its README). Each table names the GPU, the date and the exact command, run from the "
             "repository root; the numbers within a table come from one run on one GPU. CI runs every benchmark's "
             "`--smoke` mode on CPU.", ""]
    for i, name in enumerate(THROUGHPUT_AT_ACCURACY_RUNS):  # the headline: tokens/s per KV mode at its accuracy
        lines += throughput_accuracy_section(name, header=i == 0)
    lines += prompt_batching_section()
    lines += vllm_section()
    lines += decode_step_profile_section()
    lines += pool_trace_section()
    lines += attention_section() + kernel_ab_section()
    for section in (step_breakdown_section, memory_manager_section, serve_sweep_section,
                    tensor_parallel_section):
        lines += section()
    return "\n".join(lines)


def render_index() -> str:
    """benchmarks/results/README.md: every recorded file, what it measures, where, when."""
    shown = [ATTENTION, KERNEL_AB, *THROUGHPUT_AT_ACCURACY_RUNS, PROMPT_BATCHING, *VLLM_RUNS, DECODE_STEP_PROFILE,
             THROUGHPUT_TRACE, *STEP_BREAKDOWN_RUNS, MEMORY_MANAGER, SERVE_SWEEP, TENSOR_PARALLEL]
    lines = ["# Recorded results", "",
             "The runs behind [docs/PERFORMANCE.md](../../docs/PERFORMANCE.md), which shows them with their commands "
             "(`python benchmarks/summarize_results.py` writes both pages). A `.json.gz` file is the JSON its command "
             "wrote, gzipped (it holds a per-step trace).",
             "", "| file | device | date | shown as |", "|---|---|---|---|"]
    for name in shown:
        d = load(name)
        if d is not None:
            lines.append(f"| `{name}` | {d['device']} | {d.get('date', '-')} | docs/PERFORMANCE.md |")
    for name, what in MEASURED_ALTERNATIVES.items():
        d = load(name)
        if d is not None:
            lines.append(f"| `{name}` | {d.get('device', d.get('target', '-'))} | {d.get('date', '-')} | {what} |")
    return "\n".join(lines) + "\n"


def render() -> tuple[str, str]:
    """(benchmarks/results/README.md, docs/PERFORMANCE.md) as the recorded files give them."""
    return render_index(), render_performance()


def serve_sweep_plot(path: Path) -> bool:
    """The per-token latency / TTFT figure of the recorded serve sweep (loadtest/sweep.py's plot_per_token)."""
    s = load(SERVE_SWEEP)
    if s is None:
        return False
    _sweep_module().plot_per_token(s["runs"], path, s["slo"]["ttft_ms"], s["slo"]["percentile"])
    return True


def main() -> None:
    index, performance = render()
    (RESULTS / "README.md").write_text(index)
    (DOCS / "PERFORMANCE.md").write_text(performance)
    serve_sweep_plot(DOCS / f"{Path(SERVE_SWEEP).stem}.png")
    print(f"wrote {RESULTS / 'README.md'}, {DOCS / 'PERFORMANCE.md'} and its plots")


if __name__ == "__main__":
    main()
