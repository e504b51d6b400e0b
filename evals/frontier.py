"""Accuracy against KV bytes per token: uniform caches against DiffKV configurations, from fidelity_compare runs.

Reads one or more `evals.fidelity_compare` results made on the same fp16 references (same model, generations and
length), merges their rows, and answers the two questions a frontier asks:

- per uniform point: which DiffKV configurations hold no more bytes per token and are no less accurate (top-1
  agreement with the fp16 cache no lower, NLL of the fp16 tokens no higher)?
- per DiffKV point: is it above the uniform curve (the top-1 agreement uniform caches reach at its bytes, linear
  between the two uniform points around it)?

It prints the table as markdown, writes the merged JSON and draws the plot (matplotlib PNG).

Usage: python -m evals.frontier RUN.json [RUN.json ...] --out merged.json --png docs/frontier.png
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from evals.configs import is_uniform_diffkv

FP16_FAMILY = "fp16"


def family(name: str, row: dict) -> str:
    """uniform (every token at one precision, fp8 included) or diffkv (thresholds over two precisions)."""
    cache = row["cache"]
    if cache["kv_mode"] in ("int8", "int4", "fp8"):
        return "uniform"
    if cache["kv_mode"] == "fp16":
        return FP16_FAMILY
    if is_uniform_diffkv(cache):
        return "uniform"
    return "diffkv"


def merge(runs: list[dict]) -> dict:
    """One result holding every run's rows; runs must share the model and the fidelity settings."""
    first = runs[0]
    keys = ("fidelity_n", "gen_len", "seed")
    for r in runs[1:]:
        if r["model"] != first["model"] or any(r["settings"][k] != first["settings"][k] for k in keys):
            raise ValueError(f"runs differ in model or fidelity settings ({keys}): they do not share references")
    configs = {}
    for r in runs:
        configs.update(r["configs"])
    return {"benchmark": "fidelity_frontier", "model": first["model"], "gpu": first.get("gpu"),
            "fidelity_n": first["settings"]["fidelity_n"], "gen_len": first["settings"]["gen_len"],
            "fp16_nll": first["fp16_nll"], "commands": [r["command"] for r in runs], "configs": configs}


def uniform_curve(points: list[tuple[float, float]], memory: float) -> float | None:
    """Top-1 agreement of the uniform curve at `memory` (linear between neighbours; None outside its range)."""
    pts = sorted(points)
    for (m0, a0), (m1, a1) in zip(pts, pts[1:]):
        if m0 <= memory <= m1:
            return a0 if m1 == m0 else a0 + (a1 - a0) * (memory - m0) / (m1 - m0)
    return None


def analyse(merged: dict) -> dict:
    rows = merged["configs"]
    fam = {n: family(n, r) for n, r in rows.items()}
    uniform = [n for n in rows if fam[n] == "uniform"]
    diffkv = [n for n in rows if fam[n] == "diffkv"]
    curve = [(rows[n]["memory_fraction"], rows[n]["top1_agreement"]) for n in uniform]
    dominated_by = {u: [d for d in diffkv
                        if rows[d]["memory_fraction"] <= rows[u]["memory_fraction"]
                        and rows[d]["top1_agreement"] >= rows[u]["top1_agreement"]
                        and rows[d]["nll"] <= rows[u]["nll"]] for u in uniform}
    above = {}
    for d in diffkv:
        at = uniform_curve(curve, rows[d]["memory_fraction"])
        above[d] = None if at is None else rows[d]["top1_agreement"] - at
    return {"family": fam, "uniform_dominated_by": dominated_by, "diffkv_above_uniform_curve": above}


def markdown(merged: dict, verdict: dict) -> str:
    rows = merged["configs"]
    lines = ["| configuration | family | KV bytes vs fp16 | top-1 agreement | NLL | vs uniform curve (top-1 pts) "
             "| high / low / pruned |", "|---|---|---|---|---|---|---|"]
    for n, r in sorted(rows.items(), key=lambda kv: kv[1]["memory_fraction"]):
        gap = verdict["diffkv_above_uniform_curve"].get(n)
        t = r["token_fractions"]
        lines.append(f"| `{n}` | {verdict['family'][n]} | {100 * r['memory_fraction']:.1f}% | "
                     f"{r['top1_agreement']:.4f} | {r['nll']:.4f} | "
                     f"{'-' if gap is None else f'{100 * gap:+.2f}'} | "
                     f"{100 * t['high']:.1f}% / {100 * t['low']:.1f}% / {100 * t['pruned']:.1f}% |")
    lines.append("")
    for u, ds in verdict["uniform_dominated_by"].items():
        r = rows[u]
        lines.append(f"- uniform `{u}` ({100 * r['memory_fraction']:.1f}%, top-1 {r['top1_agreement']:.4f}): "
                     + (f"matched or beaten by {', '.join(f'`{d}`' for d in ds)}" if ds else
                        "no DiffKV configuration with no more bytes is as accurate"))
    return "\n".join(lines)


def plot(merged: dict, verdict: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = merged["configs"]
    fig, axes = plt.subplots(1, 2, figsize=(12, 4.8))
    for ax, key, label in ((axes[0], "top1_agreement", "top-1 agreement with the fp16 cache"),
                           (axes[1], "nll", "NLL of the fp16 tokens")):
        uni = sorted((r["memory_fraction"], r[key], n) for n, r in rows.items() if verdict["family"][n] == "uniform")
        ax.plot([100 * m for m, _, _ in uni], [v for _, v, _ in uni], "o-", color="tab:gray", label="uniform")
        for m, v, n in uni:
            ax.annotate(rows[n]["label"].removeprefix("uniform "), (100 * m, v), fontsize=7,
                        textcoords="offset points", xytext=(3, -9))
        dk = [(r["memory_fraction"], r[key], n) for n, r in rows.items() if verdict["family"][n] == "diffkv"]
        ax.scatter([100 * m for m, _, _ in dk], [v for _, v, _ in dk], color="tab:red", marker="^", zorder=3,
                   label="DiffKV (high / low, thresholds)")
        ax.set_xlabel("KV bytes per token, % of fp16")
        ax.set_ylabel(label)
        ax.grid(alpha=0.3)
    axes[0].set_ylim(0.9, 1.0)  # the usable region; points below it are in the table
    axes[1].set_ylim(merged["fp16_nll"] * 0.98, merged["fp16_nll"] * 1.35)
    axes[0].legend(loc="lower right")
    fig.suptitle(f"{merged['model']}: {merged['fidelity_n']} fp16 generations x {merged['gen_len']} tokens, "
                 f"teacher forced ({merged.get('gpu') or 'cpu'})")
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("runs", nargs="+", type=Path, help="evals.fidelity_compare results (or one merged frontier)")
    ap.add_argument("--out", type=Path, default=None, help="merged JSON with the verdicts")
    ap.add_argument("--png", type=Path, default=None)
    args = ap.parse_args(argv)
    loaded = [json.loads(p.read_text()) for p in args.runs]
    merged = loaded[0] if loaded[0].get("benchmark") == "fidelity_frontier" else merge(loaded)
    verdict = analyse(merged)
    merged["verdict"] = verdict
    print(markdown(merged, verdict))
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(merged, indent=1) + "\n")
    if args.png:
        plot(merged, verdict, args.png)
    return 0


if __name__ == "__main__":
    sys.exit(main())
