"""What the metrics export, read back from Ray's Prometheus endpoint: histogram means computed from the
exported series equal the true means (Ray's own `_sum` does not)."""
import pytest

from _cluster import parse_metrics, values, wait_for
from service.metrics import EXACT_SUM_SUFFIX, PROMETHEUS_PREFIX as P, Metrics


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
