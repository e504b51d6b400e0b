"""Operations checks against the real service (one Serve app, embedded model, diffkv cache, loopback only):
the Grafana dashboard's series exist in a live scrape, a 20 s headless Locust run, the rate sweep at two small
rates, and a real Prometheus (Debian's package) scraping Ray's metrics port and answering the dashboard's
queries with real values."""
import asyncio
import csv
import json
import shutil
import subprocess
import sys
import threading
import time
import urllib.parse
import urllib.request

import httpx
import pytest

from _ops import REPO, load

sys.path.insert(0, str(REPO / "tests" / "service"))
from _cluster import free_port, served, start_cluster, stop_cluster, wait_for  # noqa: E402

dash = load("grafana/dashboard.py", "grafana_dashboard")
stream = load("loadtest/stream.py", "stream")

APP, PREFIX = "ops", "/ops"
CONFIG = {
    "device": "cpu",
    "kv_mode": "diffkv",
    "max_model_len": 512,
    "default_max_tokens": 8,
    # A small page pool: a burst of a few requests outgrows it, so the engine preempts (a dashboard series).
    # Thresholds set: the model's calibrated ones compress so much that no burst of this size would preempt.
    "cache": {"num_pages": 1000, "alpha_high": 1.0, "alpha_low": 0.02},
    "stats_period_s": 0.5,
    "admission": {"ttft_target_s": 60.0},  # a 2-core box: admit the small loads below, 429 only real overload
}


@pytest.fixture(scope="module")
def service():
    cluster = start_cluster()
    try:
        with served(cluster, CONFIG, APP, PREFIX) as s:
            yield s
    finally:
        stop_cluster()


@pytest.fixture(scope="module")
def prometheus(service, tmp_path_factory):
    """Debian's prometheus on loopback, scraping Ray's metrics export port every second."""
    binary = shutil.which("prometheus")
    assert binary, "prometheus is not installed (.ci/run installs Debian's package)"
    d = tmp_path_factory.mktemp("prometheus")
    (d / "prometheus.yml").write_text(
        "global:\n  scrape_interval: 1s\n  evaluation_interval: 1s\n"
        "scrape_configs:\n  - job_name: diffkv-serve\n    static_configs:\n"
        f"      - targets: ['127.0.0.1:{service['cluster'].metrics_port}']\n")
    port = free_port()
    log = open(d / "prometheus.log", "w")
    proc = subprocess.Popen([binary, f"--config.file={d / 'prometheus.yml'}", f"--storage.tsdb.path={d / 'data'}",
                             f"--web.listen-address=127.0.0.1:{port}", "--log.level=warn"],
                            stdout=log, stderr=subprocess.STDOUT)
    url = f"http://127.0.0.1:{port}"

    def ready():
        assert proc.poll() is None, (d / "prometheus.log").read_text()
        try:
            return urllib.request.urlopen(f"{url}/-/ready", timeout=2).status == 200
        except OSError:
            return False

    try:
        wait_for(ready, 60, what="prometheus to be ready")
        yield {"url": url, "dir": d}
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=20)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
        log.close()


def chat_body(service, text: str, max_tokens: int) -> dict:
    return stream.chat_request(service["model"], [{"role": "user", "content": text}], max_tokens)


async def _burst(service, n: int, max_tokens: int) -> list:
    """n streaming requests at once; returns their StreamResults."""
    url = service["base"] + "/v1/chat/completions"

    async def one(client, i):
        res = stream.StreamResult(t_start=time.monotonic())
        text = f"Write a long story about a lighthouse keeper named Ada, chapter {i}. Describe the sea in detail."
        async with client.stream("POST", url, json=chat_body(service, text, max_tokens), timeout=300) as r:
            res.status = r.status_code
            async for line in r.aiter_lines():
                res.feed(line, time.monotonic())
        return res

    async with httpx.AsyncClient() as client:
        return await asyncio.gather(*(one(client, i) for i in range(n)))


def burst(service, n: int, max_tokens: int) -> list:
    return asyncio.run(_burst(service, n, max_tokens))


def engine_idle(service) -> dict:
    def idle():
        st = service["engine"].stats.remote().result()
        return st if st["num_running"] == 0 and st["num_waiting"] == 0 and st["pages_used"] == 0 else None
    return wait_for(idle, 60, what="the engine to go idle with every KV page free")


# ---- Grafana: every dashboard series is in a live scrape ---------------------------------------------------------
def scrapes_during(service, fn):
    """fn()'s result, and the series (name -> labels) seen in scrapes taken every 0.5 s while it ran (and once
    after): a series only ever set while requests run still counts as exported. (Ray drops a gauge from its
    export when it has not been set for two report intervals.)"""
    seen: dict = {}
    stop = threading.Event()

    def scrape_once():
        try:
            for name, labels in dash.scraped_series(service["cluster"].scrape()).items():
                seen.setdefault(name, set()).update(labels)
        except OSError:
            pass

    def loop():
        while not stop.is_set():
            scrape_once()
            stop.wait(0.5)

    t = threading.Thread(target=loop, daemon=True)
    t.start()
    try:
        result = fn()
    finally:
        stop.set()
        t.join()
    scrape_once()
    return result, seen


def test_dashboard_series_are_exported_by_the_running_service(service):
    # Lazily created series appear on first use: a 400 (rejected, reason=invalid) and a burst that outgrows
    # the page pool (preemptions). Everything else comes with ordinary traffic.
    r = httpx.post(service["base"] + "/v1/chat/completions", json={"model": service["model"], "messages": []},
                   timeout=60)
    assert r.status_code == 400
    results, live = scrapes_during(service, lambda: burst(service, 6, 48))
    assert all(res.ok for res in results), [res.error for res in results]
    dashboard = dash.load()
    needed = {n for _, expr in dash.panel_queries(dashboard) for n in dash.selectors(dash.promql(expr))[0]}
    # Admission control predicts a TTFT when an arrival finds every server (KV capacity, measured from the
    # replicas' reports at the ends of requests) busy: a second, larger wave sets that gauge. It also gives
    # counters and histograms a report period to reach the agent.
    more, later = scrapes_during(service, lambda: (burst(service, 12, 4), time.sleep(2))[0])
    assert all(res.ok or res.rejected for res in more), [(res.status, res.error) for res in more]  # 429s are fine
    for name, labels in later.items():
        live.setdefault(name, set()).update(labels)
    # This diffkv service runs with prefix caching off (its 'auto' default), so those counters never appear.
    off = dash.feature_series({"enable_prefix_caching": False})
    assert set(off) <= needed and not set(off) & set(live)
    assert needed - set(live) - set(off) == set(), f"not in the live scrape: {sorted(needed - set(live) - set(off))}"
    assert dash.check(dashboard, {**off, **live}) == []
    assert service["engine"].stats.remote().result()["num_preemptions"] > 0  # the pool was outgrown
    engine_idle(service)


# ---- Locust: 20 s headless ---------------------------------------------------------------------------------------
def test_locust_headless_20s(service, tmp_path):
    csv_prefix = tmp_path / "run"
    cmd = [sys.executable, "-m", "locust", "-f", str(REPO / "loadtest/locustfile.py"), "--headless",
           "-H", service["base"], "-u", "1", "-r", "1", "-t", "20s", "--stop-timeout", "120",
           "--arrival-rate", "0.5", "--max-tokens", "8", "--num-prompts", "32", "--seed", "1",
           "--csv", str(csv_prefix), "--only-summary"]
    p = subprocess.run(cmd, capture_output=True, text=True, timeout=300, cwd=tmp_path)
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]  # locust exits 1 on any failure
    rows = {(r["Type"], r["Name"]): r for r in csv.DictReader(open(f"{csv_prefix}_stats.csv"))}
    assert all(int(r["Failure Count"]) == 0 for r in rows.values()), rows
    done = int(rows[("POST", "/v1/chat/completions")]["Request Count"])
    rejected = int(rows.get(("REJECTED", "429"), {"Request Count": 0})["Request Count"])
    ttft = rows[("TTFT", "chat")]
    assert 0 < int(ttft["Request Count"]) <= done and float(ttft["50%"]) > 0
    assert int(rows[("TPOT", "chat")]["Request Count"]) > 0
    # Poisson arrivals at 0.5/s for 20 s: 10 expected; a count outside 2..24 has probability < 1e-3.
    assert 2 <= done + rejected <= 24
    assert "[diffkv] arrivals" in p.stderr and "TTFT p50" in p.stderr
    engine_idle(service)


# ---- the serving benchmark at two small rates ------------------------------------------------------------------
def test_sweep_two_rates(service, tmp_path):
    out = tmp_path / "diffkv.json"
    cmd = [sys.executable, str(REPO / "loadtest/sweep.py"), "run", "--base-url", service["base"], "--rates", "0.5,2",
           "--num-requests", "4", "--max-tokens", "8", "--label", "diffkv", "--out", str(out),
           "--slo-ttft-ms", "60000", "--slo-tpot-ms", "10000"]
    p = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]
    assert "diffkv @ 2 req/s" in p.stderr  # the progress bar
    report = json.loads(out.read_text())
    assert report["label"] == "diffkv" and report["model"] == service["model"]
    assert [r["rate"] for r in report["results"]] == [0.5, 2.0]
    for r in report["results"]:
        assert r["num_requests"] == 4 and r["completed"] + r["rejected"] + r["failed"] == 4
        assert r["failed"] == 0 and r["completed"] > 0, r
        for key in ("request_throughput", "output_throughput", "total_token_throughput", "goodput",
                    "rejection_rate", "duration_s"):
            assert isinstance(r[key], float) and r[key] >= 0
        assert 0 < r["goodput"] <= r["request_throughput"]  # generous SLO: some requests meet it
        for lat in ("ttft", "tpot", "itl", "e2el"):
            assert {"mean", "p50", "p90", "p99"} <= set(r[lat])
        assert 0 < r["ttft"]["p50"] <= r["ttft"]["p99"] <= r["e2el"]["p99"]
    png = out.with_suffix(".png")
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and png.stat().st_size > 20_000
    # Two runs drawn together (as fp16 vs diffkv would be).
    other = tmp_path / "fp16.json"
    other.write_text(json.dumps(dict(report, label="fp16")))
    both = tmp_path / "both.png"
    p = subprocess.run([sys.executable, str(REPO / "loadtest/sweep.py"), "plot", str(other), str(out), "-o",
                        str(both)], capture_output=True, text=True, timeout=120)
    assert p.returncode == 0 and both.stat().st_size > 20_000, p.stderr
    engine_idle(service)


# ---- Prometheus -----------------------------------------------------------------------------------------------
def prom_query(prom, expr: str) -> list:
    url = f"{prom['url']}/api/v1/query?" + urllib.parse.urlencode({"query": expr})
    with urllib.request.urlopen(url, timeout=10) as r:
        body = json.loads(r.read())
    assert body["status"] == "success", body
    return body["data"]["result"]


def scalar(prom, expr: str):
    result = prom_query(prom, expr)
    values = [float(s["value"][1]) for s in result]
    return max(values) if values else None


def test_prometheus_scrapes_the_service_and_answers_the_dashboard(service, prometheus):
    # Traffic over several scrape intervals, so rate() has increases to work with.
    for _ in range(3):
        results = burst(service, 3, 16)
        assert all(r.ok for r in results), [r.error for r in results]
        time.sleep(1.0)
    client_ttft = sorted(r.ttft for r in results)
    assert scalar(prometheus, 'up{job="diffkv-serve"}') == 1.0
    s = dash.series  # scraped names from diffkv_serve/service/metrics.py
    queries = {
        "batch size (mean)": f"sum(rate({s('diffkv_batch_size_exact_sum_total')}[1m])) / "
                             f"sum(rate({s('diffkv_batch_size', '_count')}[1m]))",
        "page occupancy": f"max(max_over_time({s('diffkv_kv_page_occupancy')}[1m]))",
        "compaction p99": f"histogram_quantile(0.99, sum by (le) (rate({s('diffkv_mm_seconds', '_bucket')}[1m])))",
        "TTFT p50": f"histogram_quantile(0.5, sum by (le) "
                    f"(rate({s('diffkv_time_to_first_token_seconds', '_bucket')}[1m])))",
    }

    def values():
        got = {k: scalar(prometheus, q) for k, q in queries.items()}
        return got if all(v is not None and v == v and v > 0 for v in got.values()) else None  # v == v: not NaN

    try:
        got = wait_for(values, 60, interval=1.0, what="real values from prometheus")
    except TimeoutError:
        pytest.fail(f"prometheus answers: { {k: scalar(prometheus, q) for k, q in queries.items()} }")
    assert got["batch size (mean)"] >= 1.0
    assert 0 < got["page occupancy"] <= 1.0
    assert got["compaction p99"] < 1.0  # seconds; the largest bucket is 0.1 s
    assert 0 < got["TTFT p50"] <= 120
    # The histogram's median lies within a bucket of what the client saw.
    assert got["TTFT p50"] <= 2.5 * client_ttft[-1] + 0.25
    # Every dashboard query is PromQL the real Prometheus accepts (Grafana's variables filled in).
    for title, expr in dash.panel_queries(dash.load()):
        prom_query(prometheus, dash.promql(expr).replace("[1m]", "[5m]"))
    engine_idle(service)
