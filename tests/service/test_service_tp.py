"""Tensor parallelism through the service: an engine replica with TP=2 (two Ray worker actors in the
replica's placement group, gloo on CPU) answers with the same greedy tokens as a TP=1 engine, and when a
worker actor is killed mid-run its in-flight requests get a clear 503 (no hang), Serve replaces the
replica and later requests succeed."""
import json
import os
import signal
import threading
import time

import httpx
import pytest

from _cluster import served, wait_for

APP = "tp"
PREFIX = "/tp"
CONFIG = {
    "device": "cpu",
    "kv_mode": "fp16",
    "tensor_parallel_size": 2,
    "default_max_tokens": 8,
    "cache": {"num_pages": 4096},
    "health_check_period_s": 1.0,
    "admission": {"enabled": False},
}
PROMPTS = ["The quick brown fox", "In 1492, Columbus", "A list of colors: red, green,"]


@pytest.fixture(scope="module")
def service(cluster):
    with served(cluster, CONFIG, APP, PREFIX) as s:
        yield s


def complete(service, prompt, max_tokens=12, timeout=120):
    return httpx.post(service["base"] + "/v1/completions", timeout=timeout,
                      json={"model": service["model"], "prompt": prompt, "max_tokens": max_tokens, "temperature": 0})


def test_tp2_replica_gives_the_greedy_tokens_of_tp1(service, smollm):
    from diffkv_serve.engine import EngineConfig, SamplingParams
    from diffkv_serve.engine.llm_engine import LLMEngine

    st = service["engine"].stats.remote().result()
    assert st["tensor_parallel_size"] == 2 and [r["rank"] for r in st["ranks"]] == [0, 1]
    reference = LLMEngine(EngineConfig(device="cpu", cache={"kv_mode": "fp16", "num_pages": 4096}), checkpoint=smollm)
    for i, prompt in enumerate(PROMPTS):
        reference.add_request(str(i), prompt, SamplingParams(temperature=0, max_tokens=12))
    want = {}
    while reference.has_unfinished_requests():
        for out in reference.step():
            if out.finished:
                want[int(out.request_id)] = out
    for i, prompt in enumerate(PROMPTS):
        r = complete(service, prompt)
        assert r.status_code == 200, r.text
        got = r.json()
        assert got["choices"][0]["text"] == want[i].text
        assert got["usage"]["completion_tokens"] == len(want[i].token_ids)
        assert got["choices"][0]["finish_reason"] == want[i].finish_reason
    st = service["engine"].stats.remote().result()
    assert st["pages_used"] == 0 and all(r["pages_used"] == 0 for r in st["ranks"])


def worker_pids() -> list[int]:
    """Processes of the live tensor-parallel worker actors (engine.worker.Worker)."""
    import ray._private.state as state

    return [a["Pid"] for a in state.actors().values() if a["ActorClassName"] == "Worker" and a["State"] == "ALIVE"]


def test_killed_worker_gives_503_then_the_replica_comes_back(service):
    old_replica = service["engine"].stats.remote().result()["replica"]
    pids = worker_pids()
    assert len(pids) == 2
    body = {"model": service["model"], "prompt": "Count slowly: one, two, three,", "max_tokens": 150,
            "temperature": 0}
    results: dict[str, object] = {}
    streaming = threading.Event()

    def stream():
        events = []
        with httpx.stream("POST", service["base"] + "/v1/completions", json={**body, "stream": True},
                          timeout=120) as r:
            results["stream_status"] = r.status_code
            for line in r.iter_lines():
                if line.startswith("data: "):
                    events.append(line[6:])
                    streaming.set()
        results["stream_events"] = events

    def plain():
        r = httpx.post(service["base"] + "/v1/completions", json=body, timeout=120)
        results["plain"] = (r.status_code, r.headers, r.json())

    threads = [threading.Thread(target=stream), threading.Thread(target=plain)]
    for t in threads:
        t.start()
    assert streaming.wait(60), "the stream never started"
    os.kill(pids[1], signal.SIGKILL)  # rank 1 dies mid-generation
    t0 = time.monotonic()
    for t in threads:
        t.join(90)
        assert not t.is_alive(), "a request hung after its worker died"
    print(f"\nin-flight requests failed {time.monotonic() - t0:.2f}s after the kill")

    status, headers, err = results["plain"]
    assert status == 503 and err["error"]["type"] == "service_unavailable" and int(headers["retry-after"]) >= 1
    events = results["stream_events"]
    assert results["stream_status"] == 200 and events[-1] != "[DONE]"
    last = json.loads(events[-1])
    assert last["error"]["type"] == "service_unavailable" and last["error"]["message"]
    assert last["error"]["code"] is None  # OpenAI's error object: a string or null, never the status

    # Serve sees the failed health check, replaces the replica (new engine, new workers); later requests work
    t1 = time.monotonic()

    def recovered():
        try:
            r = complete(service, "The capital of France is", max_tokens=4, timeout=60)
        except httpx.TimeoutException:
            return False
        assert r.status_code in (200, 503), r.text  # a clear answer while the replica restarts, never a hang
        return r.status_code == 200
    wait_for(recovered, 180, interval=1.0, what="a request to succeed after the replica restart")
    print(f"replica back {time.monotonic() - t1:.1f}s later")
    st = service["engine"].stats.remote().result()
    assert st["replica"] != old_replica and len(st["ranks"]) == 2
    assert len(worker_pids()) == 2 and pids[0] not in worker_pids()
