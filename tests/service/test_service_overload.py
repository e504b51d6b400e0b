"""Overload: a bounded Poisson burst at several times the measured capacity against a small KV pool.
Only 200s and 429s (each 429 with Retry-After and an OpenAI error body), nothing hangs, every admitted
request completes, and afterwards every KV page is free again, read from the Prometheus metrics, which
by then show every metric of service.metrics with non-trivial values."""
import asyncio
import json
import random
import threading
import time

import httpx
import pytest

from _cluster import parse_metrics, served, values, wait_for
from diffkv_serve.service.metrics import PROMETHEUS_PREFIX, SPECS

APP = "overload"
PREFIX = "/overload"
MAX_TOKENS = 16
CONFIG = {
    "device": "cpu",
    "kv_mode": "diffkv",
    "default_max_tokens": MAX_TOKENS,
    # A few sequences' worth of KV pages (~200-300 pages each here): the KV capacity binds before the 8 slots,
    # and sequences growing into new pages force preemptions.
    "cache": {"num_pages": 1600, "block_size": 4},
    "scheduler": {"max_num_seqs": 8},
    "admission": {"ttft_target_s": 3.0, "rate_window_s": 5.0, "seed": 0},
    "stats_period_s": 0.25,
}
PROMPTS = ["Describe the ocean.", "List some fruits.", "What is a star?", "Tell me about trains.",
           "Why is the sky blue?", "Name a famous painter.", "How do birds fly?", "What is rain?"]

@pytest.fixture(scope="module")
def service(cluster):
    with served(cluster, CONFIG, APP, PREFIX) as s:
        s["replica"] = s["engine"].stats.remote().result()["replica"]
        yield s


async def stream_chat(client, service, prompt, timeout=180.0):
    """One streamed chat request: (status, ttft, usage, finish_reason, headers, error body)."""
    body = {"model": service["model"], "messages": [{"role": "user", "content": prompt}], "max_tokens": MAX_TOKENS,
            "temperature": 0, "stream": True, "stream_options": {"include_usage": True}}
    t0 = time.monotonic()
    async with asyncio.timeout(timeout):  # a hung request fails the test
        async with client.stream("POST", service["base"] + "/v1/chat/completions", json=body) as r:
            if r.status_code != 200:
                return r.status_code, None, None, None, r.headers, json.loads(await r.aread())
            ttft, usage, reason, done = None, None, None, False
            async for line in r.aiter_lines():
                if not line.startswith("data: "):
                    continue
                if line == "data: [DONE]":
                    done = True
                    break
                chunk = json.loads(line[6:])
                assert "error" not in chunk, chunk
                if chunk["choices"]:
                    if chunk["choices"][0]["delta"].get("content") and ttft is None:
                        ttft = time.monotonic() - t0
                    reason = chunk["choices"][0]["finish_reason"] or reason
                if chunk.get("usage"):
                    usage = chunk["usage"]
            assert done, "stream ended without [DONE]"
            return 200, ttft, usage, reason, r.headers, None


class Scraper(threading.Thread):
    """Scrapes the metrics endpoint during the burst and keeps each gauge's maximum."""

    def __init__(self, cluster, names):
        super().__init__(daemon=True)
        self.cluster, self.names, self.max = cluster, names, {n: 0.0 for n in names}
        self.stop = threading.Event()

    def run(self):
        while not self.stop.wait(0.5):
            try:
                samples = parse_metrics(self.cluster.scrape())
            except OSError:
                continue
            for n, _, v in samples:
                if n in self.max:
                    self.max[n] = max(self.max[n], v)


def test_poisson_burst_at_several_times_capacity(service):
    async def measure_capacity():
        # 16 requests, 8 at a time (more than the KV pool runs at once): completed requests per second
        # under a queue. The engine replica measures its own saturated throughput meanwhile.
        async with httpx.AsyncClient(timeout=180) as client:
            t0, done = time.monotonic(), 0
            for _ in range(2):
                results = await asyncio.gather(*(stream_chat(client, service, p) for p in PROMPTS))
                assert {r[0] for r in results} <= {200, 429}, [r[5] for r in results]
                done += sum(r[0] == 200 for r in results)
            return done / (time.monotonic() - t0)

    capacity = asyncio.run(measure_capacity())
    rate = 4 * capacity
    n = 40
    rng = random.Random(0)
    gauges = [PROMETHEUS_PREFIX + g for g in ("diffkv_num_requests_running", "diffkv_num_requests_waiting",
                                              "diffkv_kv_pages_used", "diffkv_requests_in_flight")]
    scraper = Scraper(service["cluster"], gauges)
    scraper.start()

    async def burst():
        async with httpx.AsyncClient(timeout=180, limits=httpx.Limits(max_connections=200)) as client:
            tasks, t = [], 0.0
            start = time.monotonic()
            for i in range(n):
                t += rng.expovariate(rate)
                await asyncio.sleep(max(0.0, start + t - time.monotonic()))
                tasks.append(asyncio.create_task(stream_chat(client, service, PROMPTS[i % len(PROMPTS)])))
            return await asyncio.gather(*tasks)

    t0 = time.monotonic()
    results = asyncio.run(burst())
    elapsed = time.monotonic() - t0
    scraper.stop.set()
    scraper.join()

    statuses = [r[0] for r in results]
    assert set(statuses) <= {200, 429}, statuses
    ok = [r for r in results if r[0] == 200]
    rejected = [r for r in results if r[0] == 429]
    assert rejected, "a burst at 4x capacity must be partly rejected"
    assert len(ok) >= 4, "admission must keep serving near capacity"
    for _, _, _, _, headers, err in rejected:
        assert int(headers["retry-after"]) >= 1
        assert err["error"]["type"] == "rate_limit_error" and err["error"]["code"] in ("queue_delay", "arrival_rate")
    for _, ttft, usage, reason, _, _ in ok:  # every admitted request completed
        assert reason in ("stop", "length") and ttft is not None
        assert 1 <= usage["completion_tokens"] <= MAX_TOKENS
    ttfts = sorted(r[1] for r in ok)
    median_ttft = ttfts[len(ttfts) // 2]
    print(f"\ncapacity {capacity:.2f} req/s, burst {n} at {rate:.2f} req/s over {elapsed:.1f}s: "
          f"{len(ok)} admitted, {len(rejected)} rejected; admitted TTFT median {median_ttft:.2f}s "
          f"max {ttfts[-1]:.2f}s (target {CONFIG['admission']['ttft_target_s']}s)")
    assert median_ttft < 3 * CONFIG["admission"]["ttft_target_s"]
    # the burst really loaded the replica (seen by the metrics while it ran)
    assert scraper.max[PROMETHEUS_PREFIX + "diffkv_num_requests_running"] >= 2, scraper.max
    assert scraper.max[PROMETHEUS_PREFIX + "diffkv_kv_pages_used"] > 0

    # afterwards: every KV page free again, read from the metrics
    rid = service["replica"]

    def pages_free():
        s = parse_metrics(service["cluster"].scrape())
        used = values(s, PROMETHEUS_PREFIX + "diffkv_kv_pages_used", replica=rid)
        total = values(s, PROMETHEUS_PREFIX + "diffkv_kv_pages_total", replica=rid)
        running = values(s, PROMETHEUS_PREFIX + "diffkv_num_requests_running", replica=rid)
        in_flight = values(s, PROMETHEUS_PREFIX + "diffkv_requests_in_flight")  # admission released them all
        return (used and total and sum(used) == 0 and sum(total) > 0 and sum(running) == 0
                and in_flight and sum(in_flight) == 0)
    wait_for(pages_free, 30, what="diffkv_kv_pages_used == 0 and no request in flight, in the metrics")
    st = service["engine"].stats.remote().result()
    assert st["pages_used"] == 0 and st["num_running"] == 0 and st["num_waiting"] == 0


def test_metrics_endpoint_shows_every_metric_with_non_trivial_values(service):
    rid = service["replica"]
    # one bad request, so the rejection counter has its "invalid" reason too
    r = httpx.post(service["base"] + "/v1/completions", json={"model": service["model"], "prompt": "hi",
                                                              "temperature": 7}, timeout=30)
    assert r.status_code == 400

    def scrape_with_invalid():
        samples = parse_metrics(service["cluster"].scrape())
        invalid = values(samples, PROMETHEUS_PREFIX + "diffkv_requests_rejected_total", reason="invalid")
        return samples if invalid and sum(invalid) > 0 else None
    samples = wait_for(scrape_with_invalid, 15, what="the 400 in diffkv_requests_rejected_total")
    names = {n for n, _, _ in samples}
    P = PROMETHEUS_PREFIX
    for spec in SPECS:
        full = P + spec.name
        if spec.feature == "enable_prefix_caching":  # off: this service runs diffkv, whose 'auto' is off
            assert not values(samples, full, replica=rid), f"{full} exported with its feature off"
        elif spec.kind == "histogram":
            counts = values(samples, full + "_count")
            assert counts and sum(counts) > 0, f"{full}: no observations"
        else:
            assert full in names, f"{full} is not exported"
    v = lambda name, **lab: values(samples, P + name, **lab)  # noqa: E731
    assert sum(v("diffkv_requests_admitted_total")) > 0
    assert sum(v("diffkv_requests_rejected_total", reason="queue_delay") +
               v("diffkv_requests_rejected_total", reason="arrival_rate")) > 0
    assert sum(v("diffkv_requests_finished_total", reason="length") + v("diffkv_requests_finished_total",
                                                                           reason="stop")) > 0
    assert sum(v("diffkv_num_preemptions_total", replica=rid)) > 0, "the small pool should have preempted"
    assert sum(v("diffkv_generation_tokens_total", replica=rid)) > 0
    assert max(v("diffkv_arrival_rate")) > 0 and max(v("diffkv_admission_predicted_ttft_seconds")) > 0
    assert max(v("diffkv_service_rate", replica=rid)) > 0
    assert max(v("diffkv_kv_pages_total", replica=rid, rank="0")) == CONFIG["cache"]["num_pages"]
    assert 1.0 < max(v("diffkv_kv_compression_ratio", replica=rid))  # diffkv stores less than fp16
    fractions = [max(v(f"diffkv_kv_tokens_{k}_fraction", replica=rid)) for k in ("high", "low", "pruned")]
    assert sum(fractions) == pytest.approx(1.0, abs=1e-6) and fractions[0] > 0
    assert sum(values(samples, P + "diffkv_batch_size_count", replica=rid)) > 0
    assert sum(values(samples, P + "diffkv_mm_seconds_count", replica=rid, rank="0")) > 0
    # the bucket counts are cumulative and end at the count
    assert sum(v("diffkv_prompt_tokens_total", replica=rid)) > 0
    assert max(v("diffkv_kv_cache_usage_perc", replica=rid)) <= 1.0
    for name in ("diffkv_time_to_first_token_seconds", "diffkv_request_time_per_output_token_seconds",
                 "diffkv_e2e_request_latency_seconds", "diffkv_inter_token_latency_seconds",
                 "diffkv_request_queue_time_seconds"):
        inf = values(samples, P + name + "_bucket", le="+Inf")
        assert sum(inf) == sum(values(samples, P + name + "_count")) > 0
