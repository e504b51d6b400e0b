"""The soak test's report: counts by status and outcome, the invariants (nothing lost, no other 5xx, bad
requests all 400, pages all free at the end, the killed replica replaced, replica memory flat), the RSS trend
of each replica process, and the figure."""
from __future__ import annotations

import json
import re
import sys
from pathlib import Path
from typing import Optional

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
from soak_requests import BAD, CLEAN_ERRORS, COMPLETED, INVALID, KINDS, LOST, OUTCOMES  # noqa: E402

MAX_LISTED = 50  # lost requests listed one by one in the JSON


def status_class(status: int) -> str:
    """The report's status buckets: 200, 429, 503, other 4xx, other 5xx, none (no response head)."""
    if status in (200, 429, 503):
        return str(status)
    if 400 <= status < 500:
        return "4xx"
    if status >= 500:
        return "other_5xx"
    return "none" if status == 0 else "other"


def rss_trend(samples: list[tuple[float, float]], warmup_s: float) -> dict:
    """One process's RSS samples (t seconds, MB): after its first `warmup_s` seconds, the least-squares slope
    (MB per minute) and max - min (MB). None where fewer than 3 samples remain."""
    samples = sorted(samples)
    if not samples:
        return {"samples": 0, "slope_mb_per_min": None, "max_minus_min_mb": None}
    start = samples[0][0]
    warm = [(t, mb) for t, mb in samples if t >= start + warmup_s]
    out = {"samples": len(samples), "first_s": start, "last_s": samples[-1][0], "warm_samples": len(warm),
           "warm_span_s": (warm[-1][0] - warm[0][0]) if warm else 0.0,
           "first_mb": samples[0][1], "last_mb": samples[-1][1], "peak_mb": max(mb for _, mb in samples),
           "slope_mb_per_min": None, "max_minus_min_mb": None}
    if len(warm) >= 3:
        t = np.array([s[0] for s in warm]) / 60.0
        mb = np.array([s[1] for s in warm])
        out["slope_mb_per_min"] = float(np.polyfit(t, mb, 1)[0]) if np.ptp(t) > 0 else 0.0
        out["max_minus_min_mb"] = float(np.ptp(mb))
    return out


def rss_summary(rss: list[dict], warmup_s: float, flat_mb_per_min: float, min_span_s: float) -> dict:
    """Per replica process (rss: {"t", "deployment", "replica", "pid", "mb"} samples). `flat`: every engine
    replica process with at least `min_span_s` seconds after warm-up grows slower than `flat_mb_per_min`
    (None: none had that long)."""
    by_proc: dict[tuple, list] = {}
    for s in rss:
        by_proc.setdefault((s["deployment"], s["replica"], s["pid"]), []).append((s["t"], s["mb"]))
    procs = []
    for (dep, rid, pid), samples in sorted(by_proc.items(), key=lambda kv: min(t for t, _ in kv[1])):
        procs.append({"deployment": dep, "replica": rid, "pid": pid, **rss_trend(samples, warmup_s)})
    judged = [p for p in procs if p["deployment"] == "EngineReplica" and p["slope_mb_per_min"] is not None
              and p["warm_span_s"] >= min_span_s]
    flat = None if not judged else all(abs(p["slope_mb_per_min"]) <= flat_mb_per_min for p in judged)
    slopes = [p["slope_mb_per_min"] for p in judged]
    return {"warmup_s": warmup_s, "flat_threshold_mb_per_min": flat_mb_per_min, "min_span_s": min_span_s,
            "flat": flat, "max_abs_slope_mb_per_min": max(map(abs, slopes)) if slopes else None,
            "max_minus_min_mb": max((p["max_minus_min_mb"] for p in judged), default=None), "processes": procs}


def summarize(records: list[dict], duration_s: float, rate: float) -> dict:
    """Counts over the request records ({"kind", "status", "outcome", "detail", ...})."""
    status = {k: 0 for k in ("200", "429", "503", "4xx", "other_5xx", "none", "other")}
    outcomes = {o: 0 for o in OUTCOMES}
    by_kind = {k: {o: 0 for o in OUTCOMES} for k in KINDS}
    for r in records:
        status[status_class(r["status"])] += 1
        outcomes[r["outcome"]] += 1
        by_kind[r["kind"]][r["outcome"]] += 1
    lost = [r for r in records if r["outcome"] == LOST]
    bad = [r for r in records if r["kind"] == BAD]
    valid_400 = [r for r in records if r["kind"] != BAD and r["outcome"] == INVALID]
    return {
        "duration_s": duration_s, "offered_rate": rate, "sent": len(records),
        "status_counts": status, "outcomes": outcomes, "outcomes_by_kind": by_kind,
        "clean_errors": sum(outcomes[o] for o in CLEAN_ERRORS),
        "completed_per_s": outcomes[COMPLETED] / max(duration_s, 1e-9),
        "bad_requests": {"sent": len(bad), "answered_400": sum(r["outcome"] == INVALID for r in bad),
                         "other": [f"{r.get('case')}: {r['detail']}" for r in bad if r["outcome"] != INVALID][:10]},
        "valid_requests_answered_400": [r["detail"] for r in valid_400][:10],
        "lost": [{k: r.get(k) for k in ("id", "kind", "t_send", "t_end", "status", "detail", "response_id")}
                 for r in lost[:MAX_LISTED]],
        "ttft_s": _percentiles([r["ttft"] for r in records if r["outcome"] == COMPLETED and r.get("ttft")]),
        "e2e_s": _percentiles([r["t_end"] - r["t_send"] for r in records if r["outcome"] == COMPLETED]),
    }


def _percentiles(values: list[float]) -> dict:
    if not values:
        return {"p50": None, "p90": None, "p99": None, "max": None, "count": 0}
    a = np.asarray(values)
    return {"p50": float(np.percentile(a, 50)), "p90": float(np.percentile(a, 90)),
            "p99": float(np.percentile(a, 99)), "max": float(a.max()), "count": int(a.size)}


def invariants(summary: dict, kill: Optional[dict], pages_end: Optional[dict], rss: dict) -> dict:
    """Each check: True (holds), False (broken) or None (not measured: no metrics URL, no Ray access, too short
    for a memory trend). `ok`: no check is False and the required ones were measured."""
    checks = {
        "nothing_lost": summary["outcomes"][LOST] == 0,
        "no_other_5xx": summary["status_counts"]["other_5xx"] == 0,
        "bad_requests_all_400": summary["bad_requests"]["sent"] > 0
        and summary["bad_requests"]["answered_400"] == summary["bad_requests"]["sent"],
        "valid_requests_never_400": not summary["valid_requests_answered_400"],
        "pages_all_free_at_end": None if pages_end is None else bool(pages_end.get("all_free")),
        "killed_replica_replaced": None if kill is None else kill.get("replaced_by") is not None,
        "replica_rss_flat": rss.get("flat"),
    }
    required = ("nothing_lost", "no_other_5xx", "bad_requests_all_400", "valid_requests_never_400")
    checks["ok"] = all(checks[k] for k in required) and all(v is not False for v in checks.values())
    return checks


# ---- the files ---------------------------------------------------------------------------------------------------
REQUEST_COLUMNS = ("id", "kind", "case", "t_send", "t_end", "status", "outcome", "ttft")


def request_rows(records: list[dict]) -> list[list]:
    """One compact row per request (REQUEST_COLUMNS), times rounded to milliseconds."""
    def cell(v):
        return round(v, 3) if isinstance(v, float) else v
    return [[cell(r.get(k)) for k in REQUEST_COLUMNS] for r in records]


def requests_of(report: dict) -> list[dict]:
    return [dict(zip(report["request_columns"], row)) for row in report["requests"]]


def to_json(report: dict) -> str:
    """Indented, except that each row of the long lists (requests, timeline samples) takes one line."""
    rows: dict[str, str] = {}

    def fold(obj):
        if isinstance(obj, list) and obj and all(isinstance(x, (list, dict)) for x in obj) and len(obj) > 8:
            out = []
            for x in obj:
                key = f"@@row{len(rows)}@@"
                rows[key] = json.dumps(_rounded(x), separators=(",", ":"))
                out.append(key)
            return out
        if isinstance(obj, dict):
            return {k: fold(v) for k, v in obj.items()}
        return obj

    text = json.dumps(fold(report), indent=1)
    return re.sub(r'"(@@row\d+@@)"', lambda m: rows[m.group(1)], text) + "\n"


def _rounded(x):
    if isinstance(x, float):
        return round(x, 3)
    if isinstance(x, dict):
        return {k: _rounded(v) for k, v in x.items()}
    if isinstance(x, list):
        return [_rounded(v) for v in x]
    return x


# ---- the figure ------------------------------------------------------------------------------------------------
_COLORS = {"completed": "#2b8a3e", "rejected": "#f59f00", "unavailable": "#c92a2a", "stream_error": "#e8590c",
           "invalid": "#1971c2", "disconnected": "#868e96", "lost": "#000000"}


def plot(report: dict, path) -> None:
    """Four panels over the run: requests by outcome (per time bin of their send), TTFT of completed ones,
    KV pages in use per replica (scraped), and replica RSS; the kill and the replacement are marked."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    records = requests_of(report)
    duration = report["summary"]["duration_s"]
    width = max(5.0, duration / 60)
    edges = np.arange(0.0, duration + width, width)
    fig, axes = plt.subplots(4, 1, figsize=(11, 12), sharex=True)
    ax = axes[0]
    bottom = np.zeros(len(edges) - 1)
    for outcome in OUTCOMES:
        ts = [r["t_send"] for r in records if r["outcome"] == outcome]
        counts = np.histogram(ts, bins=edges)[0] / width
        if counts.any():
            ax.bar(edges[:-1], counts, width=width, bottom=bottom, align="edge", color=_COLORS[outcome],
                   label=f"{outcome} ({len(ts)})")
            bottom += counts
    ax.set_ylabel("requests/s (by send time)")
    ax.set_title("Outcomes")
    ax = axes[1]
    done = [(r["t_send"], r["ttft"]) for r in records if r["outcome"] == "completed" and r.get("ttft")]
    if done:
        ax.plot([t for t, _ in done], [v for _, v in done], ".", ms=3, alpha=0.5, color="#2b8a3e",
                label="completed requests")
    ax.set_ylabel("TTFT (s)")
    ax.set_title("Time to first token")
    ax = axes[2]
    pages = report["timeline"]["pages"]
    for rid in sorted({p["replica"] for p in pages}):
        pts = [(p["t"], p["used"]) for p in pages if p["replica"] == rid]
        ax.plot([t for t, _ in pts], [u for _, u in pts], "-", lw=1, label=f"replica {rid[:8]}")
    ax.set_ylabel("KV pages in use")
    ax.set_title("KV pages in use per engine replica (metrics endpoint)")
    ax = axes[3]
    for proc in report["rss"]["processes"]:
        pts = sorted((s["t"], s["mb"]) for s in report["timeline"]["rss"] if s["pid"] == proc["pid"])
        slope = proc["slope_mb_per_min"]
        label = f"{proc['deployment']} {proc['replica'][:8]}" + ("" if slope is None else f" ({slope:+.2f} MB/min)")
        ax.plot([t for t, _ in pts], [m for _, m in pts], "-", lw=1.2, label=label)
    ax.set_ylabel("RSS (MB)")
    ax.set_xlabel("seconds since the soak started")
    ax.set_title("Replica process memory")
    kill = report.get("kill")
    for ax in axes:
        if kill:
            ax.axvline(kill["t"], color="#c92a2a", ls="--", lw=1)
            if kill.get("t_replaced") is not None:
                ax.axvline(kill["t_replaced"], color="#2b8a3e", ls=":", lw=1)
        ax.grid(alpha=0.3)
        if ax.lines or ax.patches:
            ax.legend(fontsize=7, loc="upper right")
    inv = report["invariants"]
    verdict = "PASS" if inv["ok"] else "FAIL"
    fig.suptitle(f"Soak: {report['model']}, {duration / 60:.1f} min at {report['summary']['offered_rate']:.2f} req/s"
                 f" — {verdict}, lost {report['summary']['outcomes']['lost']}"
                 + (f"; replica killed at {kill['t']:.0f} s (dashed), replaced at "
                    f"{kill['t_replaced']:.0f} s (dotted)" if kill and kill.get("t_replaced") is not None else ""),
                 fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
