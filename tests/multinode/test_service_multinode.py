"""The service on a multi-node Ray cluster (a head and two worker nodes, each a raylet on this machine):
engine replicas (TP=2) spread one per worker node with their ranks packed on it, routing and admission
span the nodes, and when a worker node is killed with requests in flight, the requests that had no output
yet are re-sent to the surviving replica, the others end with a clean 503 / SSE error event, none is lost;
Serve replaces the replica on a fresh node (KubeRay's replacement pod) within RECOVERY_BOUND_S and no
replica holds a page afterwards."""
import asyncio
import json
import threading
import time

import httpx
import pytest

from _cluster import deploy, parse_metrics, values, wait_for
from _nodes import Nodes, placement, start_nodes, stop_nodes

APP = "multinode"
PREFIX = "/mn"
MAX_NUM_SEQS = 2  # per replica: a burst leaves requests queued in each engine, with no output yet
CONFIG = {
    "device": "cpu",
    "model": "random:tiny",
    "max_model_len": 256,
    "tensor_parallel_size": 2,
    "num_replicas": 2,
    "rank_resources": {"fake_gpu": 1},  # a worker node has 2: one replica of 2 ranks per node
    "ingress_resources": {"ingress": 1},  # only the head has it
    "scheduler": {"max_num_seqs": MAX_NUM_SEQS},
    "health_check_period_s": 1.0,
    "health_check_timeout_s": 10.0,
    "router": {"policy": "kv_headroom", "stats_period_s": 0.5},
    # loose: once both replicas have measured their service rate, it admits all of this file's load
    "admission": {"enabled": True, "ttft_target_s": 120.0},
    "retry": {"max_retries": 2, "backoff_s": 0.5},
}
# Kill -> both replicas RUNNING again and a request answered, measured on a 2-core CI box: the node is
# declared dead in ~3 s (tests/multinode/_nodes.py), the replica and its two ranks start and load in ~15-30 s.
RECOVERY_BOUND_S = 90.0


@pytest.fixture(scope="module")
def service():
    nodes = start_nodes(num_workers=2)
    try:
        engine = deploy(CONFIG, APP, PREFIX)
        base = f"http://127.0.0.1:{nodes.http_port}{PREFIX}"
        model = httpx.get(f"{base}/v1/models", timeout=60).json()["data"][0]["id"]
        yield {"base": base, "model": model, "engine": engine, "nodes": nodes}
    finally:
        stop_nodes(nodes)


def scrape(nodes: Nodes) -> list:
    """The head's metrics (the ingress runs there)."""
    r = httpx.get(f"http://127.0.0.1:{nodes.metrics_port}/metrics", timeout=10)
    return parse_metrics(r.text)


def replica_stats(service, n: int = 2) -> dict:
    """stats() of each of the n live engine replicas, by replica id (the router picks one per call)."""
    seen: dict = {}

    def all_seen():
        for _ in range(8):
            st = service["engine"].stats.remote().result(timeout_s=30)
            seen[st["replica"]] = st
        return len(seen) >= n
    wait_for(all_seen, 30, interval=0.1, what=f"stats from {n} replicas")
    return seen


def check_layout(service) -> dict:
    """One replica per worker node, its ranks on the same node in a STRICT_PACK group; the ingress on the
    head. Returns {replica node: its actors}."""
    nodes = service["nodes"]
    where = placement()
    worker_nodes = {n.node_id for n in nodes.workers}
    assert where["ingress"] == [nodes.head_id]
    assert len(where["replicas"]) == 2 and set(where["replicas"]) <= worker_nodes
    assert len(set(where["replicas"])) == 2, "both replicas landed on one node"
    engine_groups = [g for g in where["groups"] if len(g[1]) and g[1] <= worker_nodes]
    assert len(engine_groups) == 2
    for strategy, group_nodes in engine_groups:
        assert strategy == "STRICT_PACK" and len(group_nodes) == 1  # replica + its ranks on one node
    for node in where["replicas"]:
        assert where["workers"].count(node) == 2, f"node {node} lacks its replica's 2 ranks"
    return where


def test_replicas_spread_over_nodes_with_their_ranks_packed(service):
    check_layout(service)
    for st in replica_stats(service).values():
        assert st["tensor_parallel_size"] == 2 and [r["rank"] for r in st["ranks"]] == [0, 1]


def test_routing_and_admission_span_the_nodes(service):
    """Before any request has finished, admission counts the servers of both nodes (2 replicas x
    MAX_NUM_SEQS) and turns away the rest of a burst with 429 + Retry-After; clients that retry get through,
    spread over both replicas by the router."""
    n, max_tokens = 12, 16
    first_status: list[int] = []

    async def one(client, i):
        for attempt in range(20):
            r = await client.post(service["base"] + "/v1/completions", json={
                "model": service["model"], "prompt": f"request {i}", "max_tokens": max_tokens, "temperature": 0})
            if attempt == 0:
                first_status.append(r.status_code)
            if r.status_code != 429:
                return r
            assert r.json()["error"]["code"] in ("queue_delay", "arrival_rate")
            await asyncio.sleep(int(r.headers["retry-after"]))
        return r

    async def burst():
        async with httpx.AsyncClient(timeout=120) as client:
            return await asyncio.gather(*(one(client, i) for i in range(n)))

    responses = asyncio.run(burst())
    assert [r.status_code for r in responses] == [200] * n, [r.text for r in responses if r.status_code != 200]
    assert first_status.count(200) >= 2 * MAX_NUM_SEQS and 429 in first_status, first_status
    tokens = sum(r.json()["usage"]["completion_tokens"] for r in responses)
    stats = replica_stats(service)
    generated = {rid: st["num_generated_tokens"] for rid, st in stats.items()}
    assert all(g > 0 for g in generated.values()), f"a replica got no request: {generated}"
    assert sum(generated.values()) == tokens
    # both replicas measured their service (admission's model: each reports it when a request ends)
    assert all(st["load"]["pages_total"] > 0 and 1 <= st["load"]["servers"] <= MAX_NUM_SEQS for st in stats.values())

    def admitted():
        s = scrape(service["nodes"])
        rejected = sum(values(s, "ray_diffkv_requests_rejected_total"))
        done = sum(values(s, "ray_diffkv_requests_admitted_total")) == n and rejected >= first_status.count(429)
        return done and sum(values(s, "ray_diffkv_requests_in_flight")) == 0
    wait_for(admitted, 20, what="the ingress's admission counters")


def measure_service(service) -> None:
    """Until both replicas have measured their service rate, admission lets only as many requests in as there are
    servers and turns the rest of a burst away; this file's burst must all be admitted (so that the victim has
    requests queued). Bursts of 2 x MAX_NUM_SEQS (always admitted) until both report, then two stats periods for
    the ingress's router to read them. A no-op after test_routing_and_admission_span_the_nodes."""
    def measured():
        if all(st["load"]["service_s"] for st in replica_stats(service).values()):
            return True

        async def burst():
            async with httpx.AsyncClient(timeout=120) as client:
                return await asyncio.gather(*(client.post(service["base"] + "/v1/completions", json={
                    "model": service["model"], "prompt": f"warm-up {i}", "max_tokens": 8, "temperature": 0})
                    for i in range(2 * MAX_NUM_SEQS)))
        assert all(r.status_code == 200 for r in asyncio.run(burst()))
        return False
    wait_for(measured, 60, interval=0.5, what="both replicas to measure their service")
    time.sleep(2 * CONFIG["router"]["stats_period_s"])


def _stream(base: str, body: dict, out: dict, t_kill: dict) -> None:
    """One SSE request; records its events and whether content had arrived before the kill. While it runs,
    out["content_at"] is set at its first content and out["ended"] once it ends (the test kills a node on them)."""
    events, got_content_at = [], None
    out["content_at"], out["ended"] = None, False
    try:
        with httpx.stream("POST", base + "/v1/completions", json={**body, "stream": True}, timeout=180) as r:
            out["status"] = r.status_code
            for line in r.iter_lines():
                if not line.startswith("data: "):
                    continue
                events.append(line[6:])
                if got_content_at is None and line[6:] != "[DONE]" and "error" not in json.loads(line[6:]):
                    got_content_at = out["content_at"] = time.monotonic()
    finally:
        out["ended"] = True
    out["events"] = events
    out["content_before_kill"] = got_content_at is not None and got_content_at < t_kill.get("t", float("inf"))


def test_node_loss_retries_errors_cleanly_and_recovers(service):
    from ray import serve

    from diffkv_serve.service.app import ENGINE_DEPLOYMENT

    nodes = service["nodes"]
    before = check_layout(service)
    measure_service(service)
    body = {"model": service["model"], "prompt": "Count slowly: one, two, three,", "max_tokens": 48,
            "temperature": 0}
    n_stream, n_plain = 8, 4
    streams = [{} for _ in range(n_stream)]
    plain: list[dict] = [{} for _ in range(n_plain)]
    t_kill: dict = {}

    def post(out: dict) -> None:
        r = httpx.post(service["base"] + "/v1/completions", json=body, timeout=180)
        out.update(status=r.status_code, headers=r.headers, json=r.json())

    threads = [threading.Thread(target=_stream, args=(service["base"], body, s, t_kill)) for s in streams]
    threads += [threading.Thread(target=post, args=(p,)) for p in plain]
    for t in threads:
        t.start()
    # Each replica runs MAX_NUM_SEQS requests and queues the rest; kill once both are generating: more streams
    # than one replica runs at once have output and are still open, so the victim is mid-way through one (a
    # stream answered 200 may have no token yet: killed then, every request is re-sent and none fails).
    wait_for(lambda: sum(1 for s in streams if s.get("content_at") and not s.get("ended")) > MAX_NUM_SEQS, 60,
             interval=0.02, what="streams with output on both replicas")
    victim = before["replicas"][0]
    t_kill["t"] = t0 = time.monotonic()
    nodes.kill_worker(victim)
    nodes.add_worker()  # what KubeRay does for a lost worker pod: a fresh node joins
    for t in threads:
        t.join(180)
        assert not t.is_alive(), "a request hung after its node died"
    t_ended = time.monotonic() - t0

    # Every request either completed or ended with a clean error; an error only after output had arrived.
    failed = 0
    for s in streams:
        assert s["status"] == 200 and s["events"], s
        last = s["events"][-1]
        if last == "[DONE]":
            continue
        failed += 1
        err = json.loads(last)["error"]
        assert err["type"] == "service_unavailable" and err["message"] and err["code"] is None
        assert s["content_at"] is not None, "a stream failed before any output: it should have been re-sent"
    for p in plain:
        if p["status"] == 200:
            assert p["json"]["choices"][0]["finish_reason"] in ("stop", "length")
            continue
        failed += 1
        assert p["status"] == 503 and int(p["headers"]["retry-after"]) >= 1
        assert p["json"]["error"]["type"] == "service_unavailable"
    # Only requests the victim was running had output; everything it had queued was re-sent and completed.
    assert 1 <= failed <= MAX_NUM_SEQS, f"{failed} requests failed"
    # The victim had queued requests: they were re-sent. The ingress exports its counters every second
    # (tests/multinode/_nodes.py), so the count can trail the requests that just ended.
    retried = 0.0

    def counted_retries():
        nonlocal retried
        retried = sum(values(scrape(nodes), "ray_diffkv_requests_retried_total"))
        return retried >= 1
    wait_for(counted_retries, 15, interval=0.5, what="the ingress's count of re-sent requests")
    # The lost replica's death is named once, with its cause (diffkv_serve/service/replica_deaths.py).
    wait_for(lambda: sum(values(scrape(nodes), "ray_diffkv_replica_deaths_total", cause="node_lost")) == 1, 30,
             interval=0.5, what="the replica's death counted as node_lost")
    assert sum(values(scrape(nodes), "ray_diffkv_replica_deaths_total")) == 1

    # Serve replaces the lost replica on the fresh node; the service answers again.
    def recovered():
        status = serve.status().applications[APP].deployments[ENGINE_DEPLOYMENT]
        if status.replica_states.get("RUNNING") != 2:
            return False
        r = httpx.post(service["base"] + "/v1/completions", json={**body, "max_tokens": 4}, timeout=60)
        return r.status_code == 200
    wait_for(recovered, RECOVERY_BOUND_S, interval=1.0, what="Serve to replace the lost replica")
    recovery = time.monotonic() - t0
    print(f"\nnode loss: {failed} of {n_stream + n_plain} requests failed (had output), {retried:g} re-sent; "
          f"all ended {t_ended:.1f}s after the kill; service whole again {recovery:.1f}s after it")
    after = check_layout(service)
    assert victim not in after["replicas"]

    # No replica holds a page for a request once the load is gone (the survivor included): what is in use
    # is the prefix cache's blocks (reclaimable, shared by the next request with the same prompt).
    def idle():
        stats = replica_stats(service)
        return all(st["num_running"] == 0 and st["num_waiting"] == 0 and st["pages_used"] == st["prefix_cache_pages"]
                   and sum(r["pages_used"] for r in st["ranks"]) == st["pages_used"] for st in stats.values())
    wait_for(idle, 30, what="every replica idle with only prefix-cache pages in use")
