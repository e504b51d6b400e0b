"""What the metrics export, read back from Ray's Prometheus endpoint: histogram means computed from the
exported series equal the true means (Ray's own `_sum` does not), and every counter is there at 0 from the
start."""
import pytest

from _cluster import parse_metrics, served, values, wait_for
from diffkv_serve.service.metrics import EXACT_SUM_SUFFIX, PROMETHEUS_PREFIX as P, Metrics


def _scraped(cluster, name, **labels):
    return sum(values(parse_metrics(cluster.scrape()), name, **labels))


def test_exported_histogram_mean_is_the_true_mean(cluster):
    """The issue's measurement: 112 steps at batch size 1 and 41 at 8 (Ray exports a `_sum` of 56 + 240.5)."""
    replica = "exact-mean-test"
    m = Metrics({"replica": replica})
    sizes = [1] * 112 + [8] * 41
    for b in sizes:
        m.observe("diffkv_batch_size", b)
    latencies = [0.0123, 0.0456, 0.789, 3.21]  # inside buckets, never on an edge
    for t in latencies:
        m.observe("diffkv_mm_seconds", t, rank="7")

    def scraped():
        count = _scraped(cluster, P + "diffkv_batch_size_count", replica=replica)
        return count == len(sizes) and _scraped(cluster, P + "diffkv_mm_seconds_count", replica=replica) == 4

    wait_for(scraped, 30, what="the observations in the scrape")
    exact = _scraped(cluster, P + "diffkv_batch_size" + EXACT_SUM_SUFFIX, replica=replica)
    count = _scraped(cluster, P + "diffkv_batch_size_count", replica=replica)
    assert exact / count == pytest.approx(sum(sizes) / len(sizes), rel=1e-9)
    approx = _scraped(cluster, P + "diffkv_batch_size_sum", replica=replica)
    assert approx != pytest.approx(sum(sizes)), "Ray's _sum became exact: the exact-sum counters can go"

    exact = _scraped(cluster, P + "diffkv_mm_seconds" + EXACT_SUM_SUFFIX, replica=replica, rank="7")
    count = _scraped(cluster, P + "diffkv_mm_seconds_count", replica=replica, rank="7")
    assert exact / count == pytest.approx(sum(latencies) / len(latencies), rel=1e-9)


def test_every_counter_is_exported_at_zero_from_the_start(cluster):
    """A fresh app, before any request: each counter of both deployments is in the scrape, at 0 (not "No
    data" until its first event), for every label value known up front; prefix-cache counters only with
    prefix caching on (here: fp16, whose 'auto' turns it on)."""
    from diffkv_serve.service.metrics import ENDPOINTS, FINISH_REASONS, REJECT_REASONS, SPECS

    config = {"device": "cpu", "model": "random:tiny", "kv_mode": "fp16", "default_max_tokens": 8}
    with served(cluster, config, "zero-counters", "/zero-counters") as s:
        rid = s["engine"].info.remote().result()["replica"]
        counters = [spec for spec in SPECS if spec.kind == "counter"]

        def all_there():
            samples = parse_metrics(cluster.scrape())
            engine = {spec.name: values(samples, P + spec.name, replica=rid)
                      for spec in counters if spec.where == "engine"}
            return (samples, engine) if all(engine.values()) else None

        samples, engine = wait_for(all_there, 30, what="every engine counter in the scrape")
        assert all(v == [0.0] for v in engine.values()), engine
        assert values(samples, P + "diffkv_mm_seconds" + EXACT_SUM_SUFFIX, replica=rid, rank="0") == [0.0]
        for endpoint in ENDPOINTS:
            assert values(samples, P + "diffkv_requests_admitted_total", endpoint=endpoint)
            for reason in REJECT_REASONS:
                assert values(samples, P + "diffkv_requests_rejected_total", endpoint=endpoint, reason=reason)
            for reason in FINISH_REASONS:
                assert values(samples, P + "diffkv_requests_finished_total", endpoint=endpoint, reason=reason)
            assert values(samples, P + "diffkv_time_to_first_token_seconds" + EXACT_SUM_SUFFIX, endpoint=endpoint)
