"""The DiffKV Serve Grafana dashboard: built here from the service's metric definitions (diffkv_serve/service/metrics.py),
written to grafana/dashboards/diffkv-serve.json, and checked (every query parses as PromQL and names only
series the service exports, with labels those series carry).

    python3 grafana/dashboard.py            # rewrite the JSON after editing the panels below
    python3 grafana/dashboard.py --check    # the JSON is current and its queries are valid (CI does this)
"""
from __future__ import annotations

import json
import re
import sys
from pathlib import Path
from typing import Iterable, Optional

GRAFANA_DIR = Path(__file__).resolve().parent
REPO = GRAFANA_DIR.parent
DASHBOARD_PATH = GRAFANA_DIR / "dashboards" / "diffkv-serve.json"
UID = "diffkv-serve"
DS = {"type": "prometheus", "uid": "${datasource}"}
# Labels Prometheus adds to every scraped series (target labels; pod/ray_node_type come from the PodMonitor).
TARGET_LABELS = {"instance", "job", "pod", "ray_node_type", "namespace"}
HISTOGRAM_SUFFIXES = ("_bucket", "_sum", "_count")


def _metrics():
    if str(REPO) not in sys.path:
        sys.path.insert(0, str(REPO))
    from diffkv_serve.service import metrics

    return metrics


# ---- series names, from the service's own definitions ------------------------------------------------------
def series(name: str, suffix: str = "") -> str:
    """The scraped name of a metric defined in diffkv_serve/service/metrics.py ('diffkv_time_to_first_token_seconds', '_bucket')."""
    m = _metrics()
    spec = m.BY_NAME[name]  # KeyError: not a metric the service defines
    if suffix and (spec.kind != "histogram" or suffix not in HISTOGRAM_SUFFIXES):
        raise ValueError(f"{name} is a {spec.kind}: no {suffix} series")
    if spec.kind == "histogram" and not suffix:
        raise ValueError(f"{name} is a histogram: use one of {HISTOGRAM_SUFFIXES}")
    return m.PROMETHEUS_PREFIX + name + suffix


def exported_series() -> dict[str, set[str]]:
    """Every series name the service exports -> the labels it carries (its tags; 'le' on buckets)."""
    m = _metrics()
    out: dict[str, set[str]] = {}
    for s in m.SPECS:
        base = m.PROMETHEUS_PREFIX + s.name
        if s.kind == "histogram":
            out[base + "_bucket"] = set(s.tags) | {"le"}
            out[base + "_sum"] = set(s.tags)
            out[base + "_count"] = set(s.tags)
        else:
            out[base] = set(s.tags)
    return out


def feature_series(features: dict[str, bool]) -> dict[str, set[str]]:
    """Series (name -> labels) that a service exports only with an optional engine feature on (MetricSpec
    .feature), for the features switched off in `features` (counters appear on their first increment)."""
    m, exported = _metrics(), exported_series()
    return {m.PROMETHEUS_PREFIX + s.name: exported[m.PROMETHEUS_PREFIX + s.name] for s in m.SPECS
            if s.feature is not None and not features.get(s.feature, True)}


# ---- panels ----------------------------------------------------------------------------------------------------
RATE = "$__rate_interval"
ENGINE = '{replica=~"$replica"}'


def quantiles(name: str, qs=(0.5, 0.9, 0.99), by: str = "le", sel: str = "") -> list[dict]:
    bucket = series(name, "_bucket")
    extra = by.replace("le", "").strip(", ")
    legend = ("{{" + extra + "}} " if extra else "")
    return [{"expr": f"histogram_quantile({q}, sum by ({by}) (rate({bucket}{sel}[{RATE}])))",
             "legendFormat": f"{legend}p{int(q * 100)}"} for q in qs]


def mean(name: str, sel: str = "", by: str = "", legend: str = "mean") -> dict:
    """The mean of histogram `name` over the rate window, from its exact-sum counter (Ray's `_sum` is
    computed from bucket midpoints, so it is not used)."""
    m = _metrics()
    exact = m.PROMETHEUS_PREFIX + m.BY_NAME[name + m.EXACT_SUM_SUFFIX].name
    agg = f"sum by ({by}) " if by else "sum"
    return {"expr": f"{agg}(rate({exact}{sel}[{RATE}])) / {agg}(rate({series(name, '_count')}{sel}[{RATE}]))",
            "legendFormat": ("{{" + by + "}} " if by else "") + legend}


def panel(title: str, targets: list[dict], unit: str = "short", kind: str = "timeseries", desc: str = "",
          stack: bool = False, w: int = 8, h: int = 8, minimum: Optional[float] = 0,
          maximum: Optional[float] = None) -> dict:
    defaults: dict = {"unit": unit, "custom": {"fillOpacity": 10 if not stack else 60, "lineWidth": 1,
                                               "stacking": {"mode": "normal" if stack else "none"}}}
    if kind == "stat":
        defaults = {"unit": unit}
    if minimum is not None:
        defaults["min"] = minimum
    if maximum is not None:
        defaults["max"] = maximum
    return {"type": kind, "title": title, "description": desc, "datasource": DS,
            "gridPos": {"w": w, "h": h},
            "fieldConfig": {"defaults": defaults, "overrides": []},
            "options": ({"reduceOptions": {"calcs": ["lastNotNull"]}, "colorMode": "value"} if kind == "stat" else
                        {"legend": {"displayMode": "list", "placement": "bottom"},
                         "tooltip": {"mode": "multi", "sort": "desc"}}),
            "targets": [dict(t, refId=chr(ord("A") + i), datasource=DS) for i, t in enumerate(targets)]}


def row(title: str) -> dict:
    return {"type": "row", "title": title, "collapsed": False, "panels": [], "gridPos": {"w": 24, "h": 1}}


def panels() -> list[dict]:
    s = series
    admitted, rejected = s("diffkv_requests_admitted_total"), s("diffkv_requests_rejected_total")
    finished = s("diffkv_requests_finished_total")
    return [
        row("Overview"),
        panel("Request rate", [{"expr": f"sum(rate({admitted}[{RATE}])) + sum(rate({rejected}[{RATE}]))",
                                "legendFormat": "arrivals"}], unit="reqps", kind="stat", w=6, h=4,
              desc="Requests reaching the ingress per second (admitted + rejected)."),
        panel("TTFT p99", quantiles("diffkv_time_to_first_token_seconds", (0.99,)), unit="s", kind="stat", w=6, h=4),
        panel("Max KV page occupancy", [{"expr": f"max(max_over_time({s('diffkv_kv_page_occupancy')}{ENGINE}"
                                                 f"[{RATE}]))", "legendFormat": "occupancy"}],
              unit="percentunit", kind="stat", w=6, h=4, maximum=1),
        panel("KV compression ratio", [{"expr": f"avg(avg_over_time({s('diffkv_kv_compression_ratio')}{ENGINE}"
                                                f"[{RATE}]))", "legendFormat": "fp16 bytes / used"}],
              unit="none", kind="stat", w=6, h=4),

        row("Traffic and admission"),
        panel("Request rate by endpoint", [
            {"expr": f"sum by (endpoint) (rate({admitted}[{RATE}]))", "legendFormat": "admitted {{endpoint}}"},
            {"expr": f"sum by (endpoint, reason) (rate({finished}[{RATE}]))",
             "legendFormat": "finished {{endpoint}} ({{reason}})"},
            {"expr": f"sum by (endpoint) (rate({s('diffkv_requests_retried_total')}[{RATE}]))",
             "legendFormat": "re-sent {{endpoint}}"}], unit="reqps",
              desc="Admitted requests, how admitted requests ended (stop, length, abort, error), and re-sends "
                   "to another replica after theirs failed before any output (a replica or node lost)."),
        panel("Admitted vs rejected", [
            {"expr": f"sum(rate({admitted}[{RATE}]))", "legendFormat": "admitted"},
            {"expr": f"sum by (reason) (rate({rejected}[{RATE}]))", "legendFormat": "rejected: {{reason}}"}],
              unit="reqps", stack=True,
              desc="Rejections by reason: queue_delay / arrival_rate are admission control's 429s, invalid is "
                   "a 400, engine_dead a 503, unauthorized a 401, too_large a 413, draining a 503 while the "
                   "service shuts down."),
        panel("Arrival rate vs capacity", [
            {"expr": f"sum({s('diffkv_arrival_rate')})", "legendFormat": "arrival rate (Poisson estimate)"},
            {"expr": f"sum({s('diffkv_service_rate')}{ENGINE})", "legendFormat": "capacity (sum of replicas' c*mu)"},
            {"expr": f"sum({s('diffkv_requests_in_flight')})", "legendFormat": "in flight"}], unit="reqps",
              desc="Admission control keeps the arrival rate under what the replicas complete at their KV "
                   "capacity; in flight is a count."),

        panel("Engine replica deaths", [
            {"expr": f"sum by (cause) (increase({s('diffkv_replica_deaths_total')}[{RATE}]))",
             "legendFormat": "{{cause}}"}], unit="short", stack=True, w=24, h=6,
              desc="Engine replicas that died, by cause (memory, process_died, killed, engine_dead, node_lost, "
                   "...); the ingress log has each one's detail. Replicas Serve stops on purpose are not counted."),

        row("Latency"),
        panel("Time to first token", quantiles("diffkv_time_to_first_token_seconds") + [
            {"expr": f"max({s('diffkv_admission_predicted_ttft_seconds')})",
             "legendFormat": "predicted by admission control"}, mean("diffkv_time_to_first_token_seconds")], unit="s"),
        panel("Time per output token", quantiles("diffkv_request_time_per_output_token_seconds")
              + [mean("diffkv_request_time_per_output_token_seconds")], unit="s",
              desc="Per request: (end - first token) / (tokens - 1)."),
        panel("Inter-token latency", quantiles("diffkv_inter_token_latency_seconds", (0.5, 0.99))
              + [mean("diffkv_inter_token_latency_seconds"),
                 dict(mean("diffkv_time_per_output_token_seconds"), legendFormat="mean (vLLM's older name)")],
              unit="s", desc="Per token: the gap between consecutive output tokens at the ingress."),
        panel("Queue time", quantiles("diffkv_request_queue_time_seconds", sel=ENGINE)
              + [mean("diffkv_request_queue_time_seconds", ENGINE)], unit="s",
              desc="From a request's arrival at an engine replica to its first scheduling."),
        panel("End-to-end latency", quantiles("diffkv_e2e_request_latency_seconds") + [mean("diffkv_e2e_request_latency_seconds")],
              unit="s"),

        row("Engine"),
        panel("Batch size", quantiles("diffkv_batch_size", (0.5, 0.9), sel=ENGINE) + [
            mean("diffkv_batch_size", ENGINE)],
              desc="Sequences per engine step (prefill or decode)."),
        panel("Running and waiting requests", [
            {"expr": f"sum by (replica) ({s('diffkv_num_requests_running')}{ENGINE})",
             "legendFormat": "running {{replica}}"},
            {"expr": f"sum by (replica) ({s('diffkv_num_requests_waiting')}{ENGINE})",
             "legendFormat": "waiting {{replica}}"}]),
        panel("Preemptions and tokens", [
            {"expr": f"sum by (replica) (rate({s('diffkv_prompt_tokens_total')}{ENGINE}[{RATE}]))",
             "legendFormat": "prompt tokens/s {{replica}}"},
            {"expr": f"sum by (replica) (rate({s('diffkv_num_preemptions_total')}{ENGINE}[{RATE}]))",
             "legendFormat": "preemptions/s {{replica}}"},
            {"expr": f"sum by (replica) (rate({s('diffkv_generation_tokens_total')}{ENGINE}[{RATE}]))",
             "legendFormat": "generation tokens/s {{replica}}"}], unit="short",
              desc="Preemptions (recompute for lack of KV pages), prompt and generated tokens per second."),
        panel("Prefix cache hit rate", [
            {"expr": f"sum by (replica) (rate({s('diffkv_prefix_cache_hits_total')}{ENGINE}[{RATE}])) / "
                     f"clamp_min(sum by (replica) (rate({s('diffkv_prefix_cache_queries_total')}{ENGINE}[{RATE}])), "
                     "1e-9)", "legendFormat": "hit rate {{replica}}"}], unit="percentunit", maximum=1,
              desc="Prompt tokens read from cached prefix blocks / prompt tokens looked up (docs/PREFIX_CACHING.md)."),

        row("KV cache (DiffKV)"),
        panel("KV cache usage per replica", [
            {"expr": f"max by (replica) ({s('diffkv_kv_cache_usage_perc')}{ENGINE})",
             "legendFormat": "{{replica}}"}], unit="percentunit", maximum=1,
              desc="Fraction of the replica's KV page pool in use (vLLM's kv_cache_usage_perc)."),
        panel("KV page occupancy per replica and rank", [
            {"expr": f"max by (replica, rank) ({s('diffkv_kv_page_occupancy')}{ENGINE})",
             "legendFormat": "{{replica}} rank {{rank}}"}], unit="percentunit", maximum=1,
              desc="Ranks differ: sparsity is per KV head, and each rank holds its own heads."),
        panel("KV pages used / total", [
            {"expr": f"sum by (replica, rank) ({s('diffkv_kv_pages_used')}{ENGINE})",
             "legendFormat": "used {{replica}} rank {{rank}}"},
            {"expr": f"sum by (replica, rank) ({s('diffkv_kv_pages_total')}{ENGINE})",
             "legendFormat": "total {{replica}} rank {{rank}}"}]),
        panel("Compaction latency (memory management per step)",
              quantiles("diffkv_mm_seconds", (0.5, 0.99), sel=ENGINE)
              + quantiles("diffkv_mm_seconds", (0.99,), by="le, rank", sel=ENGINE)
              + [mean("diffkv_mm_seconds", ENGINE)], unit="s",
              desc="Page allocation, recycling and page-table updates of a decode step (parallel KV compaction)."),
        panel("Compression ratio", [
            {"expr": f"max by (replica, kv_mode) ({s('diffkv_kv_compression_ratio')}{ENGINE})",
             "legendFormat": "{{replica}} ({{kv_mode}})"}], unit="none", w=12,
              desc="Bytes an fp16 cache would use / bytes used, over the running requests."),
        panel("Token precision: high / low / pruned", [
            {"expr": f"avg by (kv_mode) ({s('diffkv_kv_tokens_high_fraction')}{ENGINE})",
             "legendFormat": "high ({{kv_mode}})"},
            {"expr": f"avg by (kv_mode) ({s('diffkv_kv_tokens_low_fraction')}{ENGINE})",
             "legendFormat": "low ({{kv_mode}})"},
            {"expr": f"avg by (kv_mode) ({s('diffkv_kv_tokens_pruned_fraction')}{ENGINE})",
             "legendFormat": "pruned ({{kv_mode}})"}], unit="percentunit", stack=True, maximum=1, w=12),
    ]


def _layout(items: list[dict]) -> list[dict]:
    """Ids and grid positions, left to right, wrapping at Grafana's 24 columns."""
    x = y = row_h = 0
    for i, p in enumerate(items, start=1):
        p["id"] = i
        w, h = p["gridPos"]["w"], p["gridPos"]["h"]
        if p["type"] == "row" or x + w > 24:
            x, y, row_h = 0, y + row_h, 0
        p["gridPos"] = {"x": x, "y": y, "w": w, "h": h}
        x += w
        row_h = max(row_h, h)
        if p["type"] == "row":
            x, y, row_h = 0, y + h, 0
    return items


def build() -> dict:
    replica_query = f"label_values({series('diffkv_num_requests_running')}, replica)"
    return {
        "uid": UID, "title": "DiffKV Serve", "tags": ["diffkv", "llm", "ray-serve"],
        "description": "Traffic, admission, latency, batching and the DiffKV-compressed KV cache of DiffKV Serve. "
                       "Generated by grafana/dashboard.py from diffkv_serve/service/metrics.py.",
        "editable": True, "graphTooltip": 1, "refresh": "10s", "schemaVersion": 39, "version": 1,
        "time": {"from": "now-30m", "to": "now"}, "timezone": "browser",
        "templating": {"list": [
            {"name": "datasource", "label": "Prometheus", "type": "datasource", "query": "prometheus",
             "current": {}, "hide": 0},
            {"name": "replica", "label": "Engine replica", "type": "query", "datasource": DS,
             "query": {"query": replica_query, "refId": "replica"}, "definition": replica_query,
             "includeAll": True, "multi": True, "allValue": ".*", "refresh": 2, "current": {}, "hide": 0,
             "sort": 1},
        ]},
        "annotations": {"list": []},
        "panels": _layout(panels()),
    }


# ---- checks ----------------------------------------------------------------------------------------------------
_GRAFANA_RANGES = re.compile(r"\$__(rate_interval|interval|range)\b|\$\{__(rate_interval|interval|range)\}")
_GRAFANA_VARS = re.compile(r"\$\{(\w+)(?::\w+)?\}|\$(\w+)")


def promql(expr: str) -> str:
    """A panel query with Grafana's variables filled in as Prometheus would receive it."""
    return _GRAFANA_VARS.sub(".*", _GRAFANA_RANGES.sub("1m", expr))


def panel_queries(dashboard: dict) -> list[tuple[str, str]]:
    """(panel title, expr) for every target of every panel, rows' nested panels included."""
    out = []

    def walk(ps):
        for p in ps:
            for t in p.get("targets", []):
                if "expr" in t:
                    out.append((p.get("title", "?"), t["expr"]))
            walk(p.get("panels", []))

    walk(dashboard.get("panels", []))
    for v in dashboard.get("templating", {}).get("list", []):
        if v.get("type") == "query":
            q = v.get("query")
            q = q.get("query") if isinstance(q, dict) else q
            m = re.fullmatch(r"label_values\((\w+),\s*(\w+)\)", q or "")
            if m:  # Grafana's own function, not PromQL: check as a selector of that metric with that label
                out.append((f"variable {v['name']}", f'count by ({m.group(2)}) ({m.group(1)})'))
            elif q:
                out.append((f"variable {v['name']}", q))
    return out


def selectors(expr: str) -> tuple[set[str], set[str]]:
    """(metric names, label names used in matchers and by/without clauses) of a PromQL expression."""
    import promql_parser as pp

    names: set[str] = set()
    labels: set[str] = set()

    def walk(node):
        if node is None:
            return
        if isinstance(node, pp.VectorSelector):
            if node.name:
                names.add(node.name)
            for m in node.matchers.matchers:
                if m.name != "__name__":
                    labels.add(m.name)
                elif m.value:
                    names.add(m.value)
            return
        if isinstance(node, pp.AggregateExpr) and node.modifier is not None:
            labels.update(node.modifier.labels)
        for attr in ("expr", "vector_selector", "param", "lhs", "rhs"):
            child = getattr(node, attr, None)
            if child is not None and not isinstance(child, (str, int, float)):
                walk(child)
        for arg in getattr(node, "args", None) or []:
            walk(arg)

    walk(pp.parse(expr))
    return names, labels


def check(dashboard: dict, available: dict[str, set[str]], require_all: Iterable[str] = ()) -> list[str]:
    """Problems with the dashboard: unparsable queries, series not in `available` (name -> labels), labels
    those series do not carry, duplicate panel ids, metrics in `require_all` that no panel shows."""
    errors, shown = [], set()
    ids = [p.get("id") for p in dashboard.get("panels", [])]
    if len(ids) != len(set(ids)):
        errors.append(f"duplicate panel ids: {sorted(i for i in ids if ids.count(i) > 1)}")
    for title, expr in panel_queries(dashboard):
        try:
            names, labels = selectors(promql(expr))
        except ValueError as e:  # promql_parser's syntax errors
            errors.append(f"{title!r}: not PromQL: {expr!r}: {e}")
            continue
        if not names:
            errors.append(f"{title!r}: names no metric: {expr!r}")
        for n in sorted(names):
            if n.endswith("_sum") and n[:-4] + "_bucket" in available:
                errors.append(f"{title!r}: {n} is approximated from bucket midpoints by Ray; use "
                              f"{n[:-4]}{_metrics().EXACT_SUM_SUFFIX} ({expr!r})")
            elif n not in available:
                errors.append(f"{title!r}: {n} is not exported by the service ({expr!r})")
        carried = set().union(*(available.get(n, set()) for n in names)) | TARGET_LABELS
        for label in sorted(labels - carried):
            errors.append(f"{title!r}: label {label!r} is not a label of {sorted(names)} ({expr!r})")
        shown |= names
    for n in sorted(set(require_all) - shown):
        errors.append(f"no panel shows {n}")
    return errors


def check_static(dashboard: dict) -> list[str]:
    """Against the service's definitions: every exported metric on some panel, nothing else."""
    available = exported_series()
    m = _metrics()
    # a histogram is shown by its mean (its _count); its exact-sum counter is a metric of its own
    required = {m.PROMETHEUS_PREFIX + s.name + ("_count" if s.kind == "histogram" else "") for s in m.SPECS}
    return check(dashboard, available, required)


def scraped_series(text: str) -> dict[str, set[str]]:
    """Series names -> label names in a Prometheus text exposition (a /metrics scrape)."""
    from prometheus_client.parser import text_string_to_metric_families

    out: dict[str, set[str]] = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            out.setdefault(sample.name, set()).update(sample.labels)
    return out


def load(path: Path = DASHBOARD_PATH) -> dict:
    return json.loads(Path(path).read_text())


def render() -> str:
    return json.dumps(build(), indent=2) + "\n"


def main(argv: Optional[list[str]] = None) -> int:
    import argparse

    # the path it writes, as the repository names it (a path outside it, e.g. a test's copy, as it is)
    written = DASHBOARD_PATH.relative_to(REPO) if DASHBOARD_PATH.is_relative_to(REPO) else DASHBOARD_PATH
    ap = argparse.ArgumentParser(prog="python3 grafana/dashboard.py", description=__doc__.split("\n\n")[0],
                                 epilog=f"Without --check: rewrite {written}.")
    ap.add_argument("--check", action="store_true", help="check that the JSON is current and its queries are valid "
                                                        "(writes nothing)")
    args = ap.parse_args(argv)
    if args.check:
        dashboard = load()
        errors = check_static(dashboard)
        if DASHBOARD_PATH.read_text() != render():
            errors.append(f"{DASHBOARD_PATH} is stale: run python3 grafana/dashboard.py")
        for e in errors:
            print(e, file=sys.stderr)
        if not errors:
            print(f"ok: {DASHBOARD_PATH.name} is current and its {len(panel_queries(dashboard))} queries are valid")
        return 1 if errors else 0
    errors = check_static(build())
    if errors:
        print("\n".join(errors), file=sys.stderr)
        return 1
    DASHBOARD_PATH.parent.mkdir(parents=True, exist_ok=True)
    DASHBOARD_PATH.write_text(render())
    print(f"wrote {DASHBOARD_PATH} ({len(panel_queries(build()))} queries)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
