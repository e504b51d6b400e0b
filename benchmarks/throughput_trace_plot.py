"""Where each mode's KV pool goes during a throughput_qwen run: a plot and a table from the run's trace.

Per mode (first complete run), against the decode step: sequences running, pages the running sequences hold per
cached token and (layer, KV head) (what the pool converts into batch: fewer pages per token, more sequences), and
the share of token entries kept high / low / pruned. The table gives the same per phase: while the first wave of
sequences generates, and after preempted sequences were recomputed (their prompts classified in one prefill).

Usage: python benchmarks/throughput_trace_plot.py benchmarks/results/throughput_trace_qwen2.5-1.5b_H100.json \
           --png docs/throughput_trace_qwen2.5-1.5b_H100.png
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path


def series(result: dict, row: dict) -> dict[str, list[float]]:
    """The trace of a mode's first complete run as columns, with pages per token-head and class shares added."""
    run = next(r for r in row["runs"] if not r["cut"] and r.get("trace"))
    fields = result["trace_fields"]
    cols = {f: [t[i] for t in run["trace"]] for i, f in enumerate(fields)}
    out = {**cols, "pages_per_token_head": [], "high": [], "low": [], "pruned": []}
    for i, tokens in enumerate(cols["cached_tokens"]):
        entries = cols["tokens_high"][i] + cols["tokens_low"][i] + cols["tokens_pruned"][i]
        out["pages_per_token_head"].append(cols["pages_running"][i] / entries if entries else float("nan"))
        for k in ("high", "low", "pruned"):
            out[k].append(cols[f"tokens_{k}"][i] / entries if entries else float("nan"))
    return out


def phases(s: dict) -> dict[str, dict]:
    """Means over the steps while preempted sequences wait (first wave) and after the queue emptied."""
    first_wave_end = max((i for i, w in enumerate(s["waiting"]) if w), default=None)
    spans = {"all": range(len(s["step"]))}
    if first_wave_end is not None:
        spans = {"while sequences wait": range(0, first_wave_end + 1),
                 "after the queue emptied": range(first_wave_end + 1, len(s["step"])), **spans}
    out = {}
    for name, idx in spans.items():
        idx = [i for i in idx if s["cached_tokens"][i]]
        if idx:
            out[name] = {k: statistics.mean(s[k][i] for i in idx)
                         for k in ("running", "pages_per_token_head", "high", "low", "pruned")}
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("result", type=Path, help="a benchmarks/throughput_qwen.py JSON whose runs carry a trace")
    ap.add_argument("--png", type=Path, default=None)
    args = ap.parse_args(argv)
    result = json.loads(args.result.read_text())
    data = {row["mode"]: series(result, row) for row in result["rows"]
            if any(r.get("trace") and not r["cut"] for r in row["runs"])}
    if not data:
        raise SystemExit(f"{args.result}: no complete run with a trace")
    print(f"{'mode':>10} {'phase':>24} {'running':>8} {'pages/token/head':>17} {'high':>6} {'low':>6} {'pruned':>7}")
    for mode, s in data.items():
        for name, p in phases(s).items():
            print(f"{mode[:10]:>10} {name:>24} {p['running']:8.1f} {p['pages_per_token_head']:17.5f} "
                  f"{100 * p['high']:5.1f}% {100 * p['low']:5.1f}% {100 * p['pruned']:6.1f}%")
    if args.png:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt

        fig, axes = plt.subplots(1, 3, figsize=(15, 4.2))
        for mode, s in data.items():
            axes[0].plot(s["step"], s["running"], label=mode)
            axes[1].plot(s["step"], s["pages_per_token_head"], label=mode)
            axes[2].plot(s["step"], s["high"], label=f"{mode}: high")
        axes[0].set_ylabel("sequences running")
        axes[1].set_ylabel("pages held per cached token and KV head")
        axes[2].set_ylabel("share of token entries kept high")
        for ax in axes:
            ax.set_xlabel("decode step")
            ax.grid(alpha=0.3)
            ax.legend(fontsize=8)
        fig.suptitle(f"{result['model']} on {result['device']}: {result['config']['num_prompts']} prompts x "
                     f"{result['config']['max_tokens']} tokens, one {result['kv_memory_gb']:.2f} GiB pool")
        fig.tight_layout()
        args.png.parent.mkdir(parents=True, exist_ok=True)
        fig.savefig(args.png, dpi=100)
        print(f"wrote {args.png}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
