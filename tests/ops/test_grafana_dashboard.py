"""The Grafana dashboard is generated from diffkv_serve/service/metrics.py, shows every metric the service defines, and its
queries are PromQL naming only those series and their labels; a broken copy fails. (The check against a live
scrape of the running service is in test_live_service.py.)"""
import copy
import json

import pytest
import yaml

from _ops import REPO, load

dash = load("grafana/dashboard.py", "grafana_dashboard")


@pytest.fixture(scope="module")
def dashboard():
    return dash.load()


def test_committed_json_is_generated_and_valid(dashboard):
    assert dash.DASHBOARD_PATH.read_text() == dash.render(), "run python3 grafana/dashboard.py"
    assert dash.check_static(dashboard) == []
    assert dash.main(["--check"]) == 0


def test_panels_cover_the_operations_views(dashboard):
    from diffkv_serve.service.metrics import PROMETHEUS_PREFIX as P

    exprs = {title: [] for title, _ in dash.panel_queries(dashboard)}
    for title, expr in dash.panel_queries(dashboard):
        exprs[title].append(expr)
    joined = {t: " ".join(e) for t, e in exprs.items()}
    assert "histogram_quantile(0.99" in joined["Time to first token"]
    assert {"0.5", "0.9", "0.99"} <= {q for q in ("0.5", "0.9", "0.99")
                                        if f"histogram_quantile({q}," in joined["Time per output token"]}
    assert "by (reason)" in joined["Admitted vs rejected"]
    assert "by (replica, rank)" in joined["KV page occupancy per replica and rank"]
    assert f"{P}diffkv_arrival_rate" in joined["Arrival rate vs capacity"]
    assert f"{P}diffkv_service_rate" in joined["Arrival rate vs capacity"]
    compaction = joined["Compaction latency (memory management per step)"]
    assert "histogram_quantile(0.5" in compaction and "histogram_quantile(0.99" in compaction
    assert all(p["datasource"] == dash.DS for p in dashboard["panels"] if p["type"] != "row")
    variables = {v["name"]: v for v in dashboard["templating"]["list"]}
    assert variables["datasource"]["query"] == "prometheus"


def test_provisioning_files():
    ds = yaml.safe_load((REPO / "grafana/provisioning/datasources/prometheus.yaml").read_text())
    (source,) = ds["datasources"]
    assert source["type"] == "prometheus" and source["access"] == "proxy"
    prov = yaml.safe_load((REPO / "grafana/provisioning/dashboards/diffkv-serve.yaml").read_text())
    (provider,) = prov["providers"]
    assert provider["type"] == "file" and provider["options"]["path"].startswith("/")


def _replace_expr(dashboard, old, new):
    broken = copy.deepcopy(dashboard)
    hits = 0
    for p in broken["panels"]:
        for t in p.get("targets", []):
            if old in t["expr"]:
                t["expr"] = t["expr"].replace(old, new)
                hits += 1
    assert hits, old
    return broken


@pytest.mark.parametrize("old,new,words", [
    ("ray_diffkv_time_to_first_token_seconds_bucket", "ray_diffkv_ttft_bucket", ["ray_diffkv_ttft_bucket",
                                                                          "not exported"]),
    ("ray_diffkv_kv_page_occupancy", "diffkv_kv_page_occupancy", ["diffkv_kv_page_occupancy", "not exported"]),
    ("by (replica, rank)", "by (replica, tp_rank)", ["'tp_rank'", "not a label"]),
    ("by (reason)", "by (reasons)", ["'reasons'"]),
    ("ray_diffkv_batch_size_exact_sum_total", "ray_diffkv_batch_size_sum", ["bucket midpoints",
                                                                             "ray_diffkv_batch_size_exact_sum_total"]),
    ("sum by (le) (rate(ray_diffkv_inter_token_latency_seconds_bucket", "sum by (le) (rate(ray_diffkv_inter_token_latency_seconds_bucket[",
     ["not PromQL"]),
])
def test_broken_query_fails(dashboard, old, new, words):
    errors = "\n".join(dash.check_static(_replace_expr(dashboard, old, new)))
    for w in words:
        assert w in errors, errors


def test_missing_metric_fails(dashboard):
    broken = copy.deepcopy(dashboard)
    broken["panels"] = [p for p in broken["panels"] if p.get("title") != "Preemptions and tokens"]
    errors = dash.check_static(broken)
    assert "no panel shows ray_diffkv_num_preemptions_total" in errors
    assert "no panel shows ray_diffkv_generation_tokens_total" in errors


def test_broken_json_file_fails_the_cli(tmp_path, monkeypatch, dashboard):
    bad = tmp_path / "diffkv-serve.json"
    bad.write_text(json.dumps(_replace_expr(dashboard, "ray_diffkv_batch_size_exact_sum_total",
                                            "ray_diffkv_batch_exact_sum_total")))
    monkeypatch.setattr(dash, "DASHBOARD_PATH", bad)
    assert dash.main(["--check"]) == 1
