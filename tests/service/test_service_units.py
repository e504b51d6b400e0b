"""The service's pieces without a Ray cluster: the queueing formulas, the estimators, the admission
controller in a simulated M/M/c system under Poisson overload, the KV-headroom ranking and Serve router,
the engine deployment's options, and build_app's typed arguments."""
import asyncio
import math
import random
import types

import pytest

from diffkv_serve.service.admission import (AdmissionController, ArrivalRateEstimator, ReplicaLoad, ServiceMeter,
                               conditional_wait, erlang_c, max_sustainable_rate, mmc_mean_wait)
from diffkv_serve.service.config import AdmissionConfig
from diffkv_serve.service.router import headroom, rank_by_headroom


class Clock:
    def __init__(self):
        self.t = 0.0

    def __call__(self):
        return self.t


def test_erlang_c_known_values_and_mm1():
    assert erlang_c(1, 0.5) == pytest.approx(0.5)  # M/M/1: P(wait) = rho
    assert erlang_c(2, 1.0) == pytest.approx(1 / 3)  # textbook value
    assert erlang_c(3, 3.0) == 1.0 and erlang_c(4, 0.0) == 0.0
    # large c stays finite and in [0, 1] (the Erlang-B recursion does not overflow)
    assert 0 < erlang_c(500, 480.0) < 1
    lam, mu = 3.0, 4.0
    assert mmc_mean_wait(lam, 1, mu) == pytest.approx((lam / mu) / (mu - lam))
    assert mmc_mean_wait(8.0, 2, 4.0) == math.inf


def test_max_sustainable_rate_inverts_the_mean_wait():
    for c, mu, w in [(1, 2.0, 0.5), (4, 0.5, 2.0), (64, 0.2, 5.0)]:
        lam = max_sustainable_rate(c, mu, w)
        assert 0 < lam < c * mu
        assert mmc_mean_wait(lam, c, mu) == pytest.approx(w, rel=1e-3)
    assert max_sustainable_rate(4, 1.0, 0.0) == 0.0


def test_conditional_wait():
    assert conditional_wait(3, 4, 2.0) == 0.0  # a server is free
    assert conditional_wait(4, 4, 2.0) == pytest.approx(0.5)  # first departure
    assert conditional_wait(9, 4, 2.0) == pytest.approx(3.0)  # six departures at 2/s


@pytest.mark.parametrize("rate", [0.5, 5.0, 50.0])
def test_arrival_rate_estimate_converges(rate):
    rng = random.Random(1)
    estimates = []
    for _ in range(40):
        clock = Clock()
        est = ArrivalRateEstimator(tau=10.0, clock=clock)
        t = rng.expovariate(rate)
        while t < 60:
            clock.t = t
            est.observe()
            t += rng.expovariate(rate)
        estimates.append(est.rate(60.0))
    assert sum(estimates) / len(estimates) == pytest.approx(rate, rel=0.1)


def test_arrival_rate_estimate_right_after_start():
    rng = random.Random(2)
    vals = []
    for _ in range(300):
        clock = Clock()
        est = ArrivalRateEstimator(tau=10.0, clock=clock)
        t = rng.expovariate(4.0)
        while t < 3.0:  # only 3 s of a 10 s window: the bias correction matters here
            clock.t = t
            est.observe()
            t += rng.expovariate(4.0)
        vals.append(est.rate(3.0))
    assert sum(vals) / len(vals) == pytest.approx(4.0, rel=0.1)


def test_service_meter_littles_law_and_kv_capacity():
    clock = Clock()
    meter = ServiceMeter(tau=20.0, max_num_seqs=64, clock=clock)
    meter.pages_total = 1000
    # 4 requests always running, one leaves every 0.5 s: X = 2/s, L = 4, so S = L / X = 2 s
    meter.set_running(4)
    for i in range(1, 400):
        clock.t = 0.5 * i
        meter.finished(pages_used=50, ttft_s=0.1, found_free_slot=True)
    load = meter.snapshot("r")
    assert load.service_s == pytest.approx(2.0, rel=0.02)
    assert load.servers == pytest.approx(1000 / 50)  # KV capacity binds before max_num_seqs
    assert load.service_rate == pytest.approx(20 / 2.0, rel=0.02)
    assert load.prefill_s == pytest.approx(0.1)
    # compression: a fifth of the pages per request gives five times the servers, up to max_num_seqs
    for _ in range(200):
        meter.finished(pages_used=10, ttft_s=None, found_free_slot=False)
    assert meter.snapshot("r").servers == 64
    # once the engine leaves requests waiting, what it really runs at once is the capacity, and the
    # throughput measured meanwhile is the service rate: 5 running, one finishing every 0.25 s step
    t = clock.t
    for i in range(1, 200):
        clock.t = t + 0.25 * i
        meter.step(5, waiting=3, finished=1, seconds=0.25)
    load = meter.snapshot("r")
    assert load.servers == pytest.approx(5.0)
    assert load.saturated_rate == pytest.approx(4.0) and load.service_rate == pytest.approx(4.0)


def _load(servers=4.0, service_s=2.0, prefill_s=0.1, replica="r0"):
    return ReplicaLoad(replica, servers, service_s, prefill_s, 1000, 10.0, 64)


def test_controller_admits_while_servers_are_free_then_predicts_the_wait():
    clock = Clock()
    ctl = AdmissionController(AdmissionConfig(ttft_target_s=1.0, seed=0), default_servers=64, clock=clock)
    ctl.report(_load(servers=4, service_s=2.0, prefill_s=0.1))  # c mu = 2 req/s
    decisions = []
    for i in range(8):
        clock.t = 10.0 * i  # far apart: the arrival rate is low, only the state matters
        decisions.append(ctl.decide())
    # 4 servers free -> admitted; then waits of 0.5, 1.0 s (+0.1 prefill): 0.6 admitted, 1.1 rejected
    assert [d.admit for d in decisions[:5]] == [True] * 5
    assert decisions[5].admit is False and decisions[5].reason == "queue_delay"
    assert decisions[5].predicted_ttft_s == pytest.approx(1.1)
    assert decisions[5].retry_after_s >= 1
    assert ctl.in_flight == 5
    ctl.release()
    clock.t += 1
    assert ctl.decide().admit  # a departure made room
    # the Retry-After of a deep queue is how long it takes to drain under the target, capped
    ctl.in_flight = 1000
    d = ctl.decide()
    assert not d.admit and d.retry_after_s == ctl.config.max_retry_after_s


def test_reports_replace_each_other_and_expire():
    clock = Clock()
    ctl = AdmissionController(AdmissionConfig(), default_servers=64, max_replicas=2, clock=clock)
    for i, rid in enumerate(["a", "b", "c"]):  # c replaced a after a failure: only the newest two count
        clock.t = float(i)
        ctl.report(_load(servers=4, replica=rid))
    assert ctl.capacity()[0] == 8
    clock.t = 10_000.0
    assert ctl.capacity() == (64, None, 0.0)  # nothing heard for long: back to the configured defaults


def test_controller_disabled_admits_everything():
    ctl = AdmissionController(AdmissionConfig(enabled=False), default_servers=1)
    assert all(ctl.decide().admit for _ in range(100)) and ctl.in_flight == 100


def test_cold_start_admits_up_to_the_configured_slots():
    ctl = AdmissionController(AdmissionConfig(), default_servers=2, default_replicas=2)
    assert [ctl.decide().admit for _ in range(5)] == [True] * 4 + [False]


def simulate(arrival_rate, servers, service_rate_per_server, target, n_arrivals, seed=0, enabled=True):
    """Discrete-event M/M/c with the controller in front: returns (admitted TTFT waits, rejections, retry)."""
    rng = random.Random(seed)
    clock = Clock()
    ctl = AdmissionController(AdmissionConfig(ttft_target_s=target, seed=seed, enabled=enabled,
                                              rate_window_s=10.0), default_servers=servers, clock=clock)
    load = ReplicaLoad("r0", servers, 1 / service_rate_per_server, 0.0, 0, None, servers)
    ctl.report(load)
    busy_until = [0.0] * servers  # FCFS: each admitted request takes the earliest free server
    t, waits, rejected, retry_afters = 0.0, [], 0, []
    departures = []
    for _ in range(n_arrivals):
        t += rng.expovariate(arrival_rate)
        clock.t = t
        departures.sort()
        while departures and departures[0] <= t:
            departures.pop(0)
            ctl.release()
            ctl.report(load)  # the engine replica reports its load with every finished request
        d = ctl.decide()
        if not d.admit:
            rejected += 1
            retry_afters.append(d.retry_after_s)
            continue
        i = min(range(servers), key=lambda k: busy_until[k])
        start = max(t, busy_until[i])
        busy_until[i] = start + rng.expovariate(service_rate_per_server)
        departures.append(busy_until[i])
        waits.append(start - t)
    return waits, rejected, retry_afters


def test_poisson_overload_keeps_admitted_waits_under_target():
    c, mu, target = 4, 0.5, 2.0  # capacity c mu = 2 req/s
    waits, rejected, retry = simulate(arrival_rate=8.0, servers=c, service_rate_per_server=mu, target=target,
                                      n_arrivals=4000)
    assert rejected > 0.6 * 4000  # 4x overload: most arrivals must be turned away ...
    assert len(waits) > 0.15 * 4000  # ... but the system still runs near capacity (about 1/4 admitted)
    assert sum(waits) / len(waits) < target  # the admitted requests' mean wait meets the target
    assert min(retry) >= 1
    # without admission control the queue grows without bound
    waits_off, rejected_off, _ = simulate(8.0, c, mu, target, 4000, enabled=False)
    assert rejected_off == 0 and sum(waits_off) / len(waits_off) > 50 * target


def test_light_load_is_never_rejected():
    waits, rejected, _ = simulate(arrival_rate=0.5, servers=4, service_rate_per_server=0.5, target=2.0,
                                  n_arrivals=1000)
    assert rejected < 10 and sum(waits) / len(waits) < 0.5


def test_headroom_prefers_free_pages_and_short_queues():
    idle = {"pages_total": 1000, "pages_used": 0, "num_running": 0, "num_waiting": 0, "max_num_seqs": 64,
            "pages_per_request": 50}
    busy_pages = {**idle, "pages_used": 800, "num_running": 2}
    long_queue = {**idle, "pages_used": 100, "num_running": 2}
    assert headroom(idle, 0) == 1.0
    assert headroom(busy_pages, 2) == pytest.approx(0.2)
    # ten requests sent but not running yet will take ~50 pages each
    assert headroom(long_queue, 12) == pytest.approx(1 - (100 + 10 * 50) / 1000)
    assert headroom({**idle, "dead": True}, 0) == float("-inf")
    assert headroom({}, 32) == pytest.approx(0.5)  # no stats yet: the queue alone
    stats = {"a": busy_pages, "b": idle, "c": long_queue}
    queues = {"a": 2, "b": 0, "c": 12}
    order = rank_by_headroom(["a", "b", "c"], stats.get, queues.get, random.Random(0))
    assert order == ["b", "c", "a"]
    # ties are broken at random, so equal replicas share the load
    firsts = {rank_by_headroom(["x", "y"], lambda r: idle, lambda r: 0, random.Random(s))[0] for s in range(20)}
    assert firsts == {"x", "y"}


class _Replica:
    """What Serve's router hands a RequestRouter: an id, the replica's routing stats, its queue cap."""

    def __init__(self, name, **stats):
        from ray.serve._private.common import DeploymentID, ReplicaID

        self.name = name
        self.replica_id = ReplicaID(name, DeploymentID(name="EngineReplica", app_name="t"))
        self.routing_stats, self.max_ongoing_requests = stats, 1024


def test_kv_headroom_router_ranks_serve_candidates():
    import asyncio

    from ray.serve._private.common import DeploymentHandleSource, DeploymentID

    from diffkv_serve.service.router import KVHeadroomRouter

    router = KVHeadroomRouter(DeploymentID(name="EngineReplica", app_name="t"), DeploymentHandleSource.UNKNOWN,
                              use_replica_queue_len_cache=True)
    router.initialize_state(seed=0)
    full = _Replica("full", pages_total=1000, pages_used=900, num_running=3, max_num_seqs=8, pages_per_request=100)
    empty = _Replica("empty", pages_total=1000, pages_used=100, num_running=1, max_num_seqs=8, pages_per_request=100)
    ranks = asyncio.run(router.choose_replicas([full, empty]))
    assert [[r.name for r in rank] for rank in ranks] == [["empty"], ["full"]]
    # Serve's queue-length cache counts requests sent since the stats: 7 queued on "empty" take its pages
    router.on_new_queue_len_info(empty.replica_id, 8)
    router.on_new_queue_len_info(full.replica_id, 3)
    ranks = asyncio.run(router.choose_replicas([full, empty]))
    assert [rank[0].name for rank in ranks] == ["full", "empty"]
    assert asyncio.run(router.choose_replicas([])) == []


def test_engine_deployment_options():
    from diffkv_serve.service.app import engine_deployment_options, ingress_actor_options
    from diffkv_serve.service.config import ServiceConfig
    from diffkv_serve.service.router import KVHeadroomRouter

    tp2 = engine_deployment_options(ServiceConfig(device="cpu", tensor_parallel_size=2, num_replicas=3))
    assert tp2["placement_group_bundles"] == [{"CPU": 0.5}, {"CPU": 0.25}, {"CPU": 0.25}]
    assert tp2["placement_group_strategy"] == "STRICT_PACK" and tp2["ray_actor_options"] == {"num_cpus": 0.5}
    assert tp2["num_replicas"] == 3
    router = tp2["request_router_config"]
    assert router.request_router_class.endswith("PrefixAwareRouter") and KVHeadroomRouter is not None
    headroom_only = engine_deployment_options(ServiceConfig(device="cpu", router={"policy": "kv_headroom"}))
    assert headroom_only["request_router_config"].request_router_class.endswith("KVHeadroomRouter")
    tp1 = engine_deployment_options(ServiceConfig(device="cpu", router={"policy": "pow2"},
                                                  autoscaling={"min_replicas": 1, "max_replicas": 4}))
    assert "placement_group_bundles" not in tp1 and tp1["ray_actor_options"]["num_gpus"] == 0
    assert "request_router_config" not in tp1 and "num_replicas" not in tp1
    assert tp1["autoscaling_config"]["max_replicas"] == 4
    # custom resources pin ranks (TP workers, or the replica itself at TP=1) and the ingress to nodes
    pinned = ServiceConfig(device="cpu", tensor_parallel_size=2, rank_resources={"fake_gpu": 1})
    assert engine_deployment_options(pinned)["placement_group_bundles"] == [
        {"CPU": 0.5}, {"CPU": 0.25, "fake_gpu": 1}, {"CPU": 0.25, "fake_gpu": 1}]
    tp1_pinned = engine_deployment_options(ServiceConfig(device="cpu", rank_resources={"fake_gpu": 0.5}))
    assert tp1_pinned["ray_actor_options"] == {"num_cpus": 0.5, "num_gpus": 0, "resources": {"fake_gpu": 0.5}}
    assert ingress_actor_options(ServiceConfig(ingress_resources={"head": 1})) == {"num_cpus": 0.25,
                                                                                   "resources": {"head": 1}}
    for field, bad, words in (("rank_resources", {"GPU": 1}, "Ray's own resource"),
                              ("ingress_resources", {"head": 0}, "must be > 0"),
                              ("rank_resources", {"fake_gpu": -1}, "must be > 0")):
        with pytest.raises(ValueError, match=f"{field}: .*{words}"):
            ServiceConfig(**{field: bad})
    with pytest.raises(ValueError, match="retry.max_retries"):
        ServiceConfig(retry={"max_retries": 4})
    with pytest.raises(ValueError, match="tensor_parallel_size"):
        ServiceConfig(device="cpu", tensor_parallel_size=2, distributed_executor="local")
    with pytest.raises(ValueError):
        ServiceConfig(kv_mode="int3")
    assert ServiceConfig(kv_mode="diffkv").engine.cache.kv_mode == "diffkv"


def test_serve_builds_the_app_from_typed_args():
    """What `serve run service.app:build_app kv_mode=diffkv` and a Serve config YAML do with `args`."""
    import pydantic
    from ray.serve import Application
    from ray.serve._private.api import call_user_app_builder_with_args_if_necessary

    from diffkv_serve.service.app import build_app

    app = call_user_app_builder_with_args_if_necessary(build_app, {"kv_mode": "diffkv", "num_replicas": 2,
                                                                   "admission": {"ttft_target_s": 2.0}})
    assert isinstance(app, Application)
    with pytest.raises(pydantic.ValidationError, match="ttft_target_s"):
        call_user_app_builder_with_args_if_necessary(build_app, {"admission": {"ttft_target_s": -1}})
    with pytest.raises(pydantic.ValidationError, match="num_replica"):
        call_user_app_builder_with_args_if_necessary(build_app, {"num_replica": 2})  # a typo is an error


# ---- ingress failover: re-send before the first output, never after ----------------------------------------
class _FakeCall:
    """One replica call: yields its items in order; an exception item is raised (the replica failing)."""

    def __init__(self, items):
        self.items, self.cancelled = list(items), False

    async def __anext__(self):
        if not self.items:
            raise StopAsyncIteration
        item = self.items.pop(0)
        if isinstance(item, BaseException):
            raise item
        if item == "hang":  # a replica still generating: the next token never comes in the test's time
            await asyncio.sleep(3600)
        return item

    def cancel(self):
        self.cancelled = True


class _FakeIngress:
    """What _Stream uses of OpenAIIngress: the engine handle (one scripted call per send), config, metrics."""

    def __init__(self, scripts, max_retries):
        from diffkv_serve.service.config import ServiceConfig

        self.cfg = ServiceConfig(retry={"max_retries": max_retries, "backoff_s": 0})
        self.scripts, self.sent, self.calls, self.counted = list(scripts), [], [], []
        self._streams = set()
        self.engine = self
        self.generate = self
        self.admission = types.SimpleNamespace(report=lambda load: None, release=lambda: None)
        self.metrics = types.SimpleNamespace(inc=lambda name, value=1.0, **tags: self.counted.append((name, tags)),
                                             observe=lambda *a, **k: None)

    def options(self, **kw):
        return self

    def remote(self, req):
        self.sent.append(req)
        self.calls.append(_FakeCall(self.scripts.pop(0)))
        return self.calls[-1]

    def _publish_admission_gauges(self):
        pass


def _token(text, finish=None):
    return {"text": text, "tokens": 1, "finish_reason": finish, "prompt_tokens": 3, "completion_tokens": 1}


def _dead(status=503):
    return {"error": {"status": status, "message": "engine dead", "type": "service_unavailable", "param": None}}


def test_ingress_resends_a_request_whose_replica_fails_before_any_output():
    from diffkv_serve.service.api_error import APIError
    from diffkv_serve.service.streaming import _Stream

    req = {"request_id": "req-abc"}
    # the replica's actor dies (an exception from the handle), then a survivor answers
    ing = _FakeIngress([[RuntimeError("ActorDiedError: node lost")], [_token("hi"), _token("!", "length")]], 1)
    stream = _Stream(ing, req, "completions", 0.0)
    first = asyncio.run(stream.first())
    assert first["text"] == "hi" and stream.attempts == 1 and ing.calls[0].cancelled
    assert [r["request_id"] for r in ing.sent] == ["req-abc", "req-abc-r1"] and stream.rid == "cmpl-abc"
    assert ("diffkv_requests_retried_total", {"endpoint": "completions"}) in ing.counted
    assert not any(name == "diffkv_requests_rejected_total" for name, _ in ing.counted)

    # an in-band 503 (the replica alive, its engine dead) is retried too, up to max_retries, then surfaces
    ing = _FakeIngress([[_dead()], [_dead()], [_dead()]], 2)
    with pytest.raises(APIError) as e:
        asyncio.run(_Stream(ing, req, "chat", 0.0).first())
    assert e.value.status == 503 and e.value.retry_after >= 1 and len(ing.sent) == 3
    assert [n for n, _ in ing.counted].count("diffkv_requests_retried_total") == 2
    assert ("diffkv_requests_rejected_total", {"endpoint": "chat", "reason": "engine_dead"}) in ing.counted

    # max_retries 0: the first failure is the client's; a replica that ends without output counts as failed
    ing = _FakeIngress([[]], 0)
    with pytest.raises(APIError, match="without output"):
        asyncio.run(_Stream(ing, req, "completions", 0.0).first())
    assert len(ing.sent) == 1

    # a 400 is the request's fault: never re-sent
    ing = _FakeIngress([[_dead(400)]], 3)
    with pytest.raises(APIError) as e:
        asyncio.run(_Stream(ing, req, "completions", 0.0).first())
    assert e.value.status == 400 and len(ing.sent) == 1


def test_ingress_never_resends_after_output():
    from diffkv_serve.service.api_error import APIError
    from diffkv_serve.service.streaming import _Stream

    ing = _FakeIngress([[_token("partial"), RuntimeError("ActorDiedError: node lost")]], 3)
    stream = _Stream(ing, {"request_id": "req-x"}, "completions", 0.0)

    async def run():
        first = await stream.first()
        rest = [item async for item in stream.rest()]
        return first, rest

    with pytest.raises(APIError) as e:
        asyncio.run(run())
    assert e.value.status == 503 and e.value.type == "service_unavailable"
    assert len(ing.sent) == 1 and stream.attempts == 0 and stream.failed


def test_drain_timeout_ends_a_request_with_503_and_never_resends_it():
    from diffkv_serve.service.api_error import APIError
    from diffkv_serve.service.streaming import _Stream

    async def run(stream, waiting_for_first):
        async def end_soon():
            await asyncio.sleep(0.05)
            stream.abort(APIError(503, "shut down", "service_unavailable"))
        asyncio.get_running_loop().create_task(end_soon())
        if waiting_for_first:
            await stream.first()
        else:
            await stream.first()
            [item async for item in stream.rest()]

    for script, waiting_for_first in (([_token("a"), "hang"], False), (["hang"], True)):
        ing = _FakeIngress([script, [_token("b", "length")]], 3)
        stream = _Stream(ing, {"request_id": "req-d"}, "chat", 0.0)
        assert ing._streams == {stream}
        with pytest.raises(APIError) as e:
            asyncio.run(asyncio.wait_for(run(stream, waiting_for_first), 5))
        assert e.value.status == 503 and e.value.message == "shut down"
        assert len(ing.sent) == 1  # ended by the server: not sent to another replica
        asyncio.run(stream.close())
        assert ing._streams == set() and ing.calls[0].cancelled


def test_background_polls_end_quietly_when_the_replica_stops():
    """A poll that fails because the replica's thread pool was shut down (Serve stopping it) ends the watcher
    without a traceback; any other failure is logged and retried."""
    from diffkv_serve.service.api import _replica_stopping

    assert _replica_stopping(RuntimeError("cannot schedule new futures after shutdown"))
    assert not _replica_stopping(RuntimeError("GCS unreachable"))
    assert not _replica_stopping(ConnectionError("after shutdown"))
