"""A rolling update under streaming load: the app is deployed again with a changed ServiceConfig (what `serve
deploy` or KubeRay does on a config change) while streams are in flight. The deployment arguments changed,
so Serve replaces every replica, one engine replica at a time; a replica being replaced takes no new requests
and runs those it holds to their end (drain_timeout_s). Every stream ends with [DONE] or an SSE error event,
none is cut, the replaced engine replicas stopped gracefully (not killed), and new requests see the new
settings. CPU, random:tiny, 2 engine replicas, loopback."""
import json
import threading
import time

import httpx
import pytest

from _cluster import deploy, served, wait_for

APP = "rolling"
BASE = {"device": "cpu", "model": "random:tiny", "num_replicas": 2, "max_model_len": 512, "drain_timeout_s": 30.0}
# what changes: a limit the ingress checks, the engine's prefix cache (shown in /v1/models), the TTFT target
OLD = {**BASE, "limits": {"max_prompt_chars": 400}, "cache": {"enable_prefix_caching": False},
       "admission": {"ttft_target_s": 60.0}}
NEW = {**BASE, "limits": {"max_prompt_chars": 200}, "cache": {"enable_prefix_caching": True},
       "admission": {"ttft_target_s": 90.0}}
IN_FLIGHT = 8  # streams kept running from before the update until every old replica is gone
MAX_STREAMS = 400  # bound on the streams started in all
MAX_TOKENS = 160
ROLLOUT_BOUND_S = 180.0


class _Load:
    """IN_FLIGHT streaming clients, each starting a new stream when its last one ended, until stop()."""

    def __init__(self, base: str, model: str):
        self.base, self.model = base, model
        self.results: list[dict] = []
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._threads = [threading.Thread(target=self._client, args=(i,)) for i in range(IN_FLIGHT)]
        self.generating: list[threading.Event] = [threading.Event() for _ in range(IN_FLIGHT)]

    def start(self):
        for t in self._threads:
            t.start()

    def stop(self, timeout: float):
        self._stop.set()
        for t in self._threads:
            t.join(timeout)
        assert not any(t.is_alive() for t in self._threads), "a stream did not end"

    def _client(self, i: int):
        n = 0
        while not self._stop.is_set():
            with self._lock:
                if len(self.results) >= MAX_STREAMS:
                    return
                rec = {"client": i, "seq": n, "t_start": time.monotonic(), "events": []}
                self.results.append(rec)
            n += 1
            _stream(self.base, self.model, rec, self.generating[i])


def _stream(base: str, model: str, rec: dict, generating: threading.Event, max_tokens: int = MAX_TOKENS):
    """One streaming completion into `rec`: its status, its SSE events, and whether it ended or was cut."""
    try:
        with httpx.stream("POST", base + "/v1/completions", timeout=120, json={
                "model": model, "stream": True, "max_tokens": max_tokens, "temperature": 0,
                "ignore_eos": True, "prompt": f"Client {rec['client']}, story {rec['seq']}:"}) as r:
            rec["status"] = r.status_code
            if r.status_code != 200:
                rec["body"] = r.read().decode()
                generating.set()
            for line in r.iter_lines():
                if line.startswith("data: "):
                    rec["events"].append(line[len("data: "):])
                    generating.set()
        rec["outcome"] = "ended"
    except Exception as e:  # noqa: BLE001 - a cut connection is what the test looks for
        rec["outcome"], rec["error"] = "broken", repr(e)
    rec["t_end"] = time.monotonic()


def _serve_replicas(deployment: str, app: str = APP) -> set:
    """Actor ids of the app's live replicas of `deployment`."""
    from ray._private import state

    return {actor_id for actor_id, info in state.actors().items()
            if info.get("ActorClassName") == f"ServeReplica:{app}:{deployment}" and info.get("State") == "ALIVE"}


@pytest.mark.slow
def test_config_update_under_streaming_load_loses_nothing(cluster):
    from diffkv_serve.service import replica_deaths

    with served(cluster, OLD, APP, "/" + APP) as s:
        base = s["base"]
        old_engines, old_ingress = _serve_replicas("EngineReplica"), _serve_replicas("OpenAIIngress")
        assert len(old_engines) == 2 and len(old_ingress) == 1
        long_prompt = "word " * 60  # 300 characters: within the old limit, over the new one
        r = httpx.post(base + "/v1/completions", timeout=60, json={"model": s["model"], "prompt": long_prompt,
                                                                   "max_tokens": 2})
        assert r.status_code == 200, r.text

        load = _Load(base, s["model"])
        load.start()
        try:
            assert all(e.wait(60) for e in load.generating), "every client should be streaming before the update"
            t_update = time.monotonic()
            deploy(NEW, APP, "/" + APP)
            # serve.run returns once the app runs the new version; the old replicas may still be finishing
            wait_for(lambda: not (_serve_replicas("EngineReplica") & old_engines)
                     and not (_serve_replicas("OpenAIIngress") & old_ingress), ROLLOUT_BOUND_S, interval=0.5,
                     what="every old replica to stop")
            rollout_s = time.monotonic() - t_update
        finally:
            load.stop(120)
        engines, ingress = _serve_replicas("EngineReplica"), _serve_replicas("OpenAIIngress")

        results = load.results
        broken = [rec for rec in results if rec["outcome"] == "broken"]
        assert not broken, broken
        across = [rec for rec in results if rec["t_start"] < t_update < rec["t_end"]]
        assert len(across) >= IN_FLIGHT, "the update should begin with every client's stream in flight"
        done = errored = 0
        for rec in results:
            assert rec["status"] == 200, rec
            last = rec["events"][-1]
            if last == "[DONE]":
                done += 1
            else:  # ended by the server, not cut: an SSE error event is the last thing the client read
                assert "error" in last, rec
                errored += 1
        # every stream ran within the drain timeout, so each one finished on the replica it started on
        assert errored == 0, [rec["events"][-1] for rec in results if rec["events"][-1] != "[DONE]"]

        # Serve replaced every replica and stopped the old engine replicas gracefully: the ingress's death
        # watcher found their stop records and counted no death
        assert len(engines) == 2 and not engines & old_engines and len(ingress) == 1 and not ingress & old_ingress
        for actor_id in old_engines:
            claim = wait_for(lambda: replica_deaths._get(replica_deaths._key(APP, "death", actor_id)), 30,
                             what="the death watcher to look at the stopped replica")
            assert claim == {"cause": "stopped"}, (actor_id, claim)

        # the new settings are live for new requests
        card = httpx.get(base + "/v1/models", timeout=30).json()["data"][0]["diffkv"]
        assert card["prefix_caching"] is True, card
        r = httpx.post(base + "/v1/completions", timeout=60, json={"model": s["model"], "prompt": long_prompt,
                                                                   "max_tokens": 2})
        assert r.status_code == 400 and r.json()["error"]["code"] == "prompt_too_long", r.text
        assert "at most 200 " in r.json()["error"]["message"], r.text
        print(f"rolling update: {len(results)} streams ({len(across)} across the update start), {done} [DONE], "
              f"{errored} error events, {len(broken)} broken; every old replica gone {rollout_s:.1f}s after the "
              f"update began")


@pytest.mark.slow
def test_a_stream_outlasting_the_drain_timeout_ends_with_an_error_event(cluster):
    """A request still running when its replaced engine replica's stop runs out (drain_timeout_s and a margin)
    ends with an SSE error event when Serve kills that replica; the old ingress outlives it, so the stream is
    not cut. Serve's kill counts as a `killed` death. One engine replica: Serve stops it before starting its
    replacement, so the next request waits for the new one."""
    from diffkv_serve.service import replica_deaths
    from diffkv_serve.service.app import ENGINE_STOP_MARGIN_S

    app, drain_s = "rolling_slow", 2.0
    # the embedded model: slow enough on CPU that the stream outlasts the replaced replica's stop
    config = {"device": "cpu", "max_model_len": 1024, "drain_timeout_s": drain_s, "admission": {"enabled": False}}
    with served(cluster, config, app, "/" + app) as s:
        (old_engine,) = _serve_replicas("EngineReplica", app)
        rec, generating = {"client": 0, "seq": 0, "t_start": time.monotonic(), "events": []}, threading.Event()
        stream = threading.Thread(target=_stream, args=(s["base"], s["model"], rec, generating),
                                  kwargs={"max_tokens": 900})
        stream.start()
        assert generating.wait(60) and rec.get("status") == 200, rec
        t_update = time.monotonic()
        deploy({**config, "default_max_tokens": 32}, app, "/" + app)
        stream.join(120)
        assert not stream.is_alive()
        assert rec["outcome"] == "ended" and rec["status"] == 200, rec
        err = json.loads(rec["events"][-1])["error"]
        assert err["type"] == "service_unavailable", err
        assert rec["t_end"] - t_update >= drain_s, "the stream should have had drain_timeout_s to finish"
        assert rec["t_end"] - t_update < drain_s + ENGINE_STOP_MARGIN_S + 30
        claim = wait_for(lambda: replica_deaths._get(replica_deaths._key(app, "death", old_engine)), 30,
                         what="the death watcher to look at the killed replica")
        assert claim == {"cause": "killed"}, claim
        r = httpx.post(s["base"] + "/v1/completions", timeout=60,
                       json={"model": s["model"], "prompt": "Hi", "max_tokens": 2})
        assert r.status_code == 200, r.text
        print(f"rolling update past the drain timeout: the long stream ended with an error event "
              f"{rec['t_end'] - t_update:.1f}s after the update began ({len(rec['events'])} events), not cut")
