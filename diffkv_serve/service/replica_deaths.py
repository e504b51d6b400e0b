"""Why an engine replica died, told once: in the ingress log and in diffkv_replica_deaths_total{cause}.

Ray keeps every dead actor's death cause in the GCS. Each ingress replica reads the engine replicas' (of
its app) every few seconds; a death is claimed in the GCS key-value store, so that only one ingress replica
reports it. Two things the replicas leave there make the cause precise:
  * a stop record, written by the engine replica when Serve stops it gracefully (its __del__): a replica
    stopped on purpose (scale-down, redeploy, delete) is no death, and one stopped because its engine died
    is reported as engine_dead;
  * a memory sample (the replica's resident memory, its limit and its node's memory in use), refreshed with
    its stats: a process killed without a word (SIGKILL) from a nearly full node was most likely the kernel's
    OOM killer; one whose last sample is over its limit (replica_memory_limit_gib) ended itself for it.
"""
from __future__ import annotations

import json
import time
from dataclasses import dataclass
from typing import Any, Optional

NAMESPACE = "diffkv_replicas"
WATCH_PERIOD_S = 2.0
NODE_MEMORY_FULL = 0.90  # node memory in use at the last sample from which an unexplained kill counts as OOM
CAUSES = ("memory", "process_died", "killed", "engine_dead", "node_lost", "init_failed", "unschedulable",
          "owner_died", "unknown")


@dataclass(frozen=True)
class Death:
    actor_id: str
    replica: str  # Serve's replica id
    pid: int
    cause: str  # one of CAUSES
    detail: str


# ---- what the engine replica leaves behind ---------------------------------------------------------------
def _key(app: str, kind: str, actor_id: str) -> str:
    return f"{app}/{kind}/{actor_id}"


def _put(key: str, value: dict, overwrite: bool = True) -> bool:
    from ray.experimental.internal_kv import _internal_kv_put

    return bool(_internal_kv_put(key, json.dumps(value), overwrite=overwrite, namespace=NAMESPACE))


def _get(key: str) -> Optional[dict]:
    from ray.experimental.internal_kv import _internal_kv_get

    raw = _internal_kv_get(key, namespace=NAMESPACE)
    return None if raw is None else json.loads(raw)


def record_stop(app: str, actor_id: str, engine_dead: Optional[str]) -> None:
    """Called by an engine replica that Serve stops gracefully; engine_dead: why its engine died, if it did."""
    _put(_key(app, "stop", actor_id), {"engine_dead": engine_dead})


def memory_sample(limit_bytes: Optional[int]) -> dict:
    """This process's resident memory against its limit (None: no limit), and its node's memory in use."""
    import psutil

    vm = psutil.virtual_memory()
    return {"rss": psutil.Process().memory_info().rss, "limit": limit_bytes,
            "node_used": 1.0 - vm.available / vm.total, "t": time.time()}


def over_limit(sample: dict) -> bool:
    return sample.get("limit") is not None and sample["rss"] > sample["limit"]


def record_memory(app: str, actor_id: str, sample: dict) -> None:
    _put(_key(app, "memory", actor_id), sample)


# ---- naming the cause -------------------------------------------------------------------------------------
def _gib(n: float) -> str:
    return f"{n / 2**30:.2f} GiB"


def classify(death_cause: Any, stop: Optional[dict], memory: Optional[dict],
             end_time_s: float) -> Optional[tuple[str, str]]:
    """(cause, detail) of a dead engine replica, or None if Serve stopped it on purpose. death_cause: Ray's
    ActorDeathCause protobuf; stop / memory: what the replica recorded (see above)."""
    if stop is not None:
        if stop.get("engine_dead"):
            return "engine_dead", f"its engine died ({stop['engine_dead']}); Serve stopped the replica to replace it"
        return None
    if death_cause is None:
        return "unknown", "Ray recorded no cause"
    which = death_cause.WhichOneof("context")
    if which == "oom_context":
        return "memory", f"Ray's memory monitor killed it: {death_cause.oom_context.error_message}"
    if which == "creation_task_failure_context":
        return "init_failed", "its constructor raised (model load?); see the replica's log"
    if which in ("actor_unschedulable_context", "runtime_env_failed_context"):
        return "unschedulable", getattr(death_cause, which).error_message
    ctx = death_cause.actor_died_error_context
    reason = type(ctx).Reason.Name(ctx.reason)
    message = ctx.error_message
    if reason == "NODE_DIED":
        return "node_lost", f"its node died ({message})"
    if reason == "OWNER_DIED":
        return "owner_died", "its owner (Serve's controller) died"
    if reason == "RAY_KILL":
        return "killed", ("killed with ray.kill without a graceful stop: what Serve does to a replica whose health "
                          "check timed out (hung) or to a replaced one still running requests at the end of its "
                          "stop (drain_timeout_s), or an operator's ray.kill")
    if reason == "WORKER_DIED":
        if "NODE_OUT_OF_MEMORY" in message:
            return "memory", f"Ray's memory monitor killed its process: {message}"
        seen = ""
        if memory is not None and over_limit(memory):
            return "memory", (f"its resident memory passed its limit (replica_memory_limit_gib) at its last "
                              f"sample: {_gib(memory['rss'])} > {_gib(memory['limit'])}, so it ended itself "
                              f"(SIGKILL) before the node ran out")
        if memory is not None:
            ago = max(0.0, end_time_s - memory["t"])
            seen = (f"; {ago:.1f}s before, it used {_gib(memory['rss'])} and its node "
                    f"{memory['node_used']:.0%} of its memory")
            if memory["node_used"] >= NODE_MEMORY_FULL:
                return "memory", f"its process was killed with its node nearly out of memory: most likely the " \
                                 f"kernel's OOM killer (dmesg on the node says){seen}"
        return "process_died", f"its process ended without a word (SIGKILL, or a crash such as a segfault){seen}"
    return "unknown", message or reason


# ---- the watcher (in each ingress replica) ----------------------------------------------------------------
class DeathWatcher:
    """Engine replica deaths of one app since the watcher started, each returned once per watcher and, through
    a claim in the key-value store, by one watcher only."""

    def __init__(self, app: str, deployment: str):
        self.app, self.class_name = app, f"ServeReplica:{app}:{deployment}"
        self.since_s = time.time()
        self._seen: set[str] = set()

    def new_deaths(self) -> list[Death]:
        from ray._private import state
        from ray.experimental.internal_kv import _internal_kv_del

        out = []
        for actor_id, info in state.actors().items():
            if info.get("ActorClassName") != self.class_name or info.get("State") != "DEAD" \
                    or actor_id in self._seen:
                continue
            self._seen.add(actor_id)
            end_s = (info.get("EndTime") or 0) / 1000
            if end_s < self.since_s:
                continue  # died before this ingress replica started: another one reported it
            stop, memory = _get(_key(self.app, "stop", actor_id)), _get(_key(self.app, "memory", actor_id))
            named = classify(info.get("DeathCause"), stop, memory, end_s)
            # claimed (the key was new): this watcher tells it; a purposeful stop is claimed too, so that
            # no other watcher, finding the stop record gone, takes it for a kill
            already = _put(_key(self.app, "death", actor_id), {"cause": named[0] if named else "stopped"},
                           overwrite=False)
            if already:
                continue
            for kind in ("stop", "memory"):
                _internal_kv_del(_key(self.app, kind, actor_id), namespace=NAMESPACE)
            if named is not None:
                replica = (info.get("Name") or actor_id).rsplit("#", 1)[-1]  # SERVE_REPLICA::app#dep#<id>
                out.append(Death(actor_id, replica, info.get("Pid") or 0, *named))
        return out
