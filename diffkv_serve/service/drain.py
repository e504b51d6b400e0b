"""Drain before shutdown, announced through the GCS's key-value store so that every ingress replica hears it
(a Serve handle call reaches only one replica).

The process that stops the service (`diffkv serve` on SIGTERM / Ctrl-C) announces the drain with its
timeout; each ingress replica polls for the announcement, then refuses new requests (503, /health too),
lets those in flight finish until the timeout, ends the rest (503 / an SSE error event), and reports how
many it still has; the stopping process shuts Serve down once every replica reports none. Withdrawing the
announcement (clear) puts the replicas back to serving."""
from __future__ import annotations

import json
import time
from dataclasses import dataclass
from typing import Callable, Optional

NAMESPACE = "diffkv_drain"
POLL_S = 0.25  # how often an ingress replica looks for the announcement and reports (and the stopper reads)


def _announce_key(app: str) -> str:
    return f"{app}/announce"


def _report_prefix(app: str) -> str:
    return f"{app}/in_flight/"


@dataclass(frozen=True)
class Announcement:
    timeout_s: Optional[float]  # None: each ingress replica's own ServiceConfig.drain_timeout_s


def announce(app: str, timeout_s: Optional[float] = None) -> None:
    from ray.experimental.internal_kv import _internal_kv_put

    _internal_kv_put(_announce_key(app), json.dumps({"timeout_s": timeout_s}), overwrite=True, namespace=NAMESPACE)


def announced(app: str) -> Optional[Announcement]:
    from ray.experimental.internal_kv import _internal_kv_get

    raw = _internal_kv_get(_announce_key(app), namespace=NAMESPACE)
    if raw is None:
        return None
    timeout_s = json.loads(raw).get("timeout_s")
    return Announcement(None if timeout_s is None else float(timeout_s))


def report(app: str, replica_id: str, in_flight: int) -> None:
    from ray.experimental.internal_kv import _internal_kv_put

    _internal_kv_put(_report_prefix(app) + replica_id, str(in_flight), overwrite=True, namespace=NAMESPACE)


def forget_report(app: str, replica_id: str) -> None:
    from ray.experimental.internal_kv import _internal_kv_del

    _internal_kv_del(_report_prefix(app) + replica_id, namespace=NAMESPACE)


def reports(app: str) -> dict[str, int]:
    """Requests still in flight, by ingress replica, of the replicas that have heard the announcement."""
    from ray.experimental.internal_kv import _internal_kv_get, _internal_kv_list

    prefix = _report_prefix(app)
    out = {}
    for key in _internal_kv_list(prefix, namespace=NAMESPACE):
        raw = _internal_kv_get(key, namespace=NAMESPACE)
        if raw is not None:
            out[key.decode()[len(prefix):]] = int(raw)
    return out


def clear(app: str) -> None:
    """Forget an announcement and its reports (before deploying: a stopped run's drain must not stop this one)."""
    from ray.experimental.internal_kv import _internal_kv_del

    _internal_kv_del(f"{app}/", del_by_prefix=True, namespace=NAMESPACE)


def wait_drained(app: str, replicas: int, timeout_s: float, give_up: Callable[[], bool] = lambda: False,
                 poll_s: float = POLL_S) -> Optional[float]:
    """Wait until `replicas` ingress replicas report nothing in flight; returns the seconds it took, or None
    if timeout_s passed (or give_up() said so) first."""
    t0 = time.monotonic()
    while time.monotonic() - t0 < timeout_s and not give_up():
        seen = reports(app)
        if len(seen) >= replicas and not any(seen.values()):
            return time.monotonic() - t0
        time.sleep(poll_s)
    return None
