"""Two engine replicas behind the KV-headroom router (Serve's request-router extension point): concurrent
requests are spread over both, and each replica's routing stats reach the router."""
import asyncio

import httpx
import pytest

from _cluster import parse_metrics, served, values, wait_for

APP = "route"
PREFIX = "/route"
CONFIG = {"device": "cpu", "model": "random:tiny", "num_replicas": 2, "default_max_tokens": 24,
          "router": {"policy": "kv_headroom", "stats_period_s": 0.5}, "admission": {"enabled": False}}


@pytest.fixture(scope="module")
def service(cluster):
    with served(cluster, CONFIG, APP, PREFIX) as s:
        yield s


def test_requests_spread_over_both_replicas(service):
    from ray import serve

    from diffkv_serve.service.app import ENGINE_DEPLOYMENT

    status = serve.status().applications[APP].deployments[ENGINE_DEPLOYMENT]
    assert status.replica_states.get("RUNNING") == 2
    # what each replica publishes to the router
    routing = service["engine"].record_routing_stats.remote().result()
    assert routing["pages_total"] > 0 and routing["max_num_seqs"] == 64 and routing["dead"] is False

    async def burst():
        async with httpx.AsyncClient(timeout=120) as client:
            return await asyncio.gather(*(client.post(service["base"] + "/v1/completions", json={
                "model": service["model"], "prompt": f"request {i}", "max_tokens": 24, "temperature": 0})
                for i in range(16)))

    assert all(r.status_code == 200 for r in asyncio.run(burst()))

    def both_served():
        seen = {}
        for _ in range(12):
            st = service["engine"].stats.remote().result()
            seen[st["replica"]] = st["num_generated_tokens"]
        return seen if len(seen) == 2 and all(v > 0 for v in seen.values()) else None
    served = wait_for(both_served, 30, what="both replicas to have generated tokens")
    assert sum(served.values()) == 16 * 24  # random weights never stop early: every token accounted for

    def per_replica_series():  # the metrics carry one series per replica
        samples = parse_metrics(service["cluster"].scrape())
        return all(sum(values(samples, "ray_diffkv_generation_tokens_total", replica=rid)) == n
                   for rid, n in served.items())
    wait_for(per_replica_series, 15, what="per-replica generated-token counters")
