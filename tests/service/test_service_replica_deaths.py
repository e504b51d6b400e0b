"""Every engine replica death is explained: the cause named from Ray's record of the death and what the
replica left (a graceful stop, its memory), logged by the ingress and counted in
diffkv_replica_deaths_total{cause}. End to end: a replica SIGKILLed (process_died), one killed with
ray.kill (killed) and one grown past its memory limit (memory); the OOM-killer and engine causes from Ray's
own death records."""
import os
import signal
from pathlib import Path

import pytest

from _cluster import parse_metrics, served, values, wait_for
from diffkv_serve.service.metrics import PROMETHEUS_PREFIX as P
from diffkv_serve.service.replica_deaths import classify

APP = "deaths"


def _cause(**kw):
    from ray.core.generated import common_pb2

    return common_pb2.ActorDeathCause(**kw)


def _died(reason, message=""):
    from ray.core.generated import common_pb2

    ctx = common_pb2.ActorDiedErrorContext(reason=common_pb2.ActorDiedErrorContext.Reason.Value(reason),
                                           error_message=message)
    return _cause(actor_died_error_context=ctx)


SIGKILLED = ("The actor is dead because its worker process has died. Worker exit type: SYSTEM_ERROR Worker exit "
             "detail: Worker unexpectedly exits with a connection error code 2. End of file.")


def test_causes_from_ray_death_records():
    from ray.core.generated import common_pb2

    oom = _cause(oom_context=common_pb2.OomContext(error_message="Task was killed due to the node running low on "
                                                                 "memory. Memory on the node was 23.1GB / 24GB"))
    assert classify(oom, None, None, 100.0)[0] == "memory"
    calm = {"rss": 2**30, "node_used": 0.41, "t": 99.5}
    full = {"rss": 20 * 2**30, "node_used": 0.97, "t": 99.5}
    cause, detail = classify(_died("WORKER_DIED", SIGKILLED), None, calm, 100.0)
    assert cause == "process_died" and "SIGKILL" in detail and "41%" in detail and "1.00 GiB" in detail
    cause, detail = classify(_died("WORKER_DIED", SIGKILLED), None, full, 100.0)
    assert cause == "memory" and "OOM killer" in detail and "97%" in detail and "0.5s before" in detail
    over = {**calm, "rss": 3 * 2**30, "limit": 2 * 2**30}
    cause, detail = classify(_died("WORKER_DIED", SIGKILLED), None, over, 100.0)
    assert cause == "memory" and "3.00 GiB > 2.00 GiB" in detail and "replica_memory_limit_gib" in detail
    assert classify(_died("WORKER_DIED", SIGKILLED), None, {**calm, "limit": 2 * 2**30}, 1.0)[0] == "process_died"
    assert classify(_died("WORKER_DIED", "Worker exit type: NODE_OUT_OF_MEMORY"), None, None, 1.0)[0] == "memory"
    assert classify(_died("RAY_KILL", "killed by `ray.kill`"), None, None, 1.0)[0] == "killed"
    assert classify(_died("NODE_DIED", "node 10.0.0.3 lost"), None, None, 1.0)[0] == "node_lost"
    # a graceful stop: on purpose (no death), or because the replica's engine had died
    assert classify(_died("RAY_KILL"), {"engine_dead": None}, calm, 1.0) is None
    cause, detail = classify(_died("RAY_KILL"), {"engine_dead": "rank 1 lost"}, calm, 1.0)
    assert cause == "engine_dead" and "rank 1 lost" in detail


@pytest.fixture(scope="module")
def service(cluster):
    with served(cluster, {"device": "cpu", "model": "random:tiny", "admission": {"ttft_target_s": 60.0}},
                APP, "/" + APP) as s:
        yield s


def _engine_actor(alive_not, app=APP):
    """(actor id, pid) of the running engine replica of `app`, other than `alive_not`."""
    from ray._private import state

    for actor_id, info in state.actors().items():
        if info.get("ActorClassName") == f"ServeReplica:{app}:EngineReplica" and info.get("State") == "ALIVE" \
                and actor_id != alive_not:
            return actor_id, info["Pid"]
    return None


def _deaths(cluster, cause):
    return sum(values(parse_metrics(cluster.scrape()), P + "diffkv_replica_deaths_total", cause=cause))


def _ingress_log_lines(app=APP):
    import ray

    logs = Path(ray._private.worker._global_node.get_session_dir_path()) / "logs" / "serve"
    return [line for p in logs.glob(f"replica_{app}_OpenAIIngress_*.log") for line in p.read_text().splitlines()
            if "died:" in line]


def _answered(service):
    import httpx

    r = httpx.post(service["base"] + "/v1/completions", timeout=60,
                   json={"model": service["model"], "prompt": "Hi", "max_tokens": 2})
    return r.status_code == 200


def test_sigkill_and_ray_kill_are_named(service, cluster):
    import ray

    def answered():
        return _answered(service)

    before = {c: _deaths(cluster, c) for c in ("process_died", "killed")}
    actor_id, pid = wait_for(lambda: _engine_actor(None), 30, what="the engine replica")
    os.kill(pid, signal.SIGKILL)
    wait_for(lambda: _deaths(cluster, "process_died") == before["process_died"] + 1, 60, interval=1.0,
             what="the SIGKILL counted as process_died")
    line = wait_for(lambda: [ln for ln in _ingress_log_lines() if "process_died" in ln], 30, what="the log line")
    assert f"(pid {pid}) died: process_died: its process ended without a word (SIGKILL" in line[0], line
    assert "of its memory" in line[0]  # the replica's last memory sample is in the report

    second, _ = wait_for(lambda: _engine_actor(actor_id), 120, what="Serve's replacement replica")
    wait_for(answered, 60, what="the replacement to serve")
    ray.kill(ray.get_actor(f"SERVE_REPLICA::{APP}#EngineReplica#" + _replica_tag(second), namespace="serve"))
    wait_for(lambda: _deaths(cluster, "killed") == before["killed"] + 1, 60, interval=1.0,
             what="the ray.kill counted as killed")
    wait_for(lambda: [ln for ln in _ingress_log_lines() if "died: killed" in ln], 30, what="the log line")
    wait_for(lambda: _engine_actor(second), 120, what="Serve's second replacement")
    wait_for(answered, 60, what="the second replacement to serve")
    assert _deaths(cluster, "process_died") == before["process_died"] + 1  # each death counted once


def _replica_tag(actor_id):
    from ray._private import state

    return state.actors()[actor_id]["Name"].rsplit("#", 1)[-1]


def test_a_graceful_stop_is_recorded_as_a_stop(cluster):
    """Serve stopping a replica on purpose (here: deleting the app) runs its __del__, which records the stop,
    so the watchers (classify: None) do not take it for a death."""
    from ray import serve

    from _cluster import deploy
    from diffkv_serve.service import replica_deaths

    app = "deaths_stop"
    deploy({"device": "cpu", "model": "random:tiny"}, app, "/" + app)
    from ray._private import state

    (actor_id,) = [a for a, info in state.actors().items()
                   if info.get("ActorClassName") == f"ServeReplica:{app}:EngineReplica" and info["State"] == "ALIVE"]
    serve.delete(app)
    stop = replica_deaths._get(replica_deaths._key(app, "stop", actor_id))
    assert stop == {"engine_dead": None}
    assert classify(state.actors()[actor_id]["DeathCause"], stop, None, 0.0) is None


def test_the_memory_hook_is_off_unless_enabled_and_bounded(monkeypatch):
    from diffkv_serve.service import testing_hooks

    monkeypatch.delenv(testing_hooks.ENV, raising=False)
    with pytest.raises(RuntimeError, match=testing_hooks.ENV):
        testing_hooks.hold_memory(0.01)
    monkeypatch.setenv(testing_hooks.ENV, "1")
    for gib in (0, -1, testing_hooks.MAX_HOLD_GIB + 1):
        with pytest.raises(ValueError, match="gib"):
            testing_hooks.hold_memory(gib)


MEMORY_APP = "deaths_memory"
LIMIT_GIB = 2.0  # a tiny random model's replica holds well under half of it


@pytest.mark.slow  # ~25 s: a deploy, the death, Serve's replacement
def test_a_replica_past_its_memory_limit_ends_itself_and_is_named_memory(cluster):
    """A serving replica is made (service.testing_hooks) to hold memory until its resident memory passes
    replica_memory_limit_gib: at its next memory sample it records the sample and SIGKILLs itself; the
    ingress names the death `memory` with both figures, counts it once, and Serve's replacement serves."""
    import psutil
    import ray

    margin = 1.0  # GiB beyond the limit that must stay free on the machine
    free = psutil.virtual_memory().available
    if free < (LIMIT_GIB + margin) * 2**30:
        pytest.skip(f"the replica grows to {LIMIT_GIB + 0.5:g} GiB; this machine has only "
                    f"{free / 2**30:.1f} GiB available")
    config = {"device": "cpu", "model": "random:tiny", "replica_memory_limit_gib": LIMIT_GIB}
    with served(cluster, config, MEMORY_APP, "/" + MEMORY_APP) as service:
        before = {c: _deaths(cluster, c) for c in ("memory", "process_died")}
        actor_id, pid = wait_for(lambda: _engine_actor(None, MEMORY_APP), 30, what="the engine replica")
        rss = psutil.Process(pid).memory_info().rss
        assert rss < (LIMIT_GIB - 0.25) * 2**30, f"the replica already holds {rss / 2**30:.2f} GiB"
        hold_gib = LIMIT_GIB - rss / 2**30 + 0.5
        try:
            held = service["engine"].hold_memory_for_test.remote(hold_gib).result(timeout_s=60)
            assert held >= hold_gib * 2**30 - 1
        except ray.exceptions.RayActorError:
            pass  # a memory sample fell while it was still allocating: it ended itself mid-call

        wait_for(lambda: _deaths(cluster, "memory") == before["memory"] + 1, 60, interval=1.0,
                 what="the death counted as memory")
        assert not psutil.pid_exists(pid) or psutil.Process(pid).status() == psutil.STATUS_ZOMBIE
        line = wait_for(lambda: [ln for ln in _ingress_log_lines(MEMORY_APP) if "died: memory" in ln], 30,
                        what="the log line")
        assert len(line) == 1, line
        assert f"(pid {pid}) died: memory: its resident memory passed its limit (replica_memory_limit_gib) " \
               f"at its last sample: " in line[0], line
        assert f"> {LIMIT_GIB:.2f} GiB, so it ended itself (SIGKILL)" in line[0], line

        wait_for(lambda: _engine_actor(actor_id, MEMORY_APP), 120, what="Serve's replacement replica")
        wait_for(lambda: _answered(service), 60, what="the replacement to serve")
        assert _deaths(cluster, "memory") == before["memory"] + 1  # counted once, and the replacement lives
        assert _deaths(cluster, "process_died") == before["process_died"]
