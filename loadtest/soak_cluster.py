"""The soak test's side of the Ray cluster: start a local Ray + Serve with the service's own app (or attach to
a running one), find the replica actors and their processes, kill one engine replica, wait for Serve to
replace it, and read the KV page gauges from the metrics endpoint. Loopback only."""
from __future__ import annotations

import os
import re
import socket
import time
import urllib.request
from dataclasses import dataclass
from typing import Optional

REPLICA_PREFIX = "SERVE_REPLICA::"  # Serve names each replica actor SERVE_REPLICA::<app>#<deployment>#<id>
PAGES_USED, PAGES_TOTAL = "ray_diffkv_kv_pages_used", "ray_diffkv_kv_pages_total"
IN_FLIGHT = "ray_diffkv_requests_in_flight"
RETRIED = "ray_diffkv_requests_retried_total"

# The service on a 2-core box: the embedded SmolLM2 (the service tests' default), diffkv cache, short answers.
# The page pool is allocated untouched and the circular free list walks all of it, so a replica's RSS grows
# until every page has been used once (the default pool, 537 MB here, takes ~20 minutes at this load): a pool
# of 8192 pages (68 MB, about 3x the peak use) is walked within the warm-up, after which RSS growth means a leak.
DEFAULT_SERVICE = {
    "device": "cpu",
    "kv_mode": "diffkv",
    "max_model_len": 512,
    "cache": {"num_pages": 8192},
    "default_max_tokens": 32,
    "health_check_period_s": 1.0,
    "stats_period_s": 0.5,
    "admission": {"ttft_target_s": 5.0, "seed": 0},
}


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


START_ATTEMPTS = 3


def on_a_free_port(start, attempts: int = START_ATTEMPTS):
    """(start(port), port) for a free loopback port. A port found free can be taken by another process before the
    Ray agent that start() launches binds it (seen right after another Ray node on the machine shut down): the agent
    fails, the node times out during startup, and start() is tried again on a new port, up to `attempts` times."""
    import ray

    for attempt in range(1, attempts + 1):
        port = free_port()
        try:
            return start(port), port
        except Exception as e:  # Ray raises a bare Exception when a node times out at startup
            ray.shutdown()
            if attempt == attempts:
                raise
            print(f"a Ray node failed to start ({str(e)[:200]}); starting again on a new port "
                  f"(attempt {attempt + 1} of {attempts})", flush=True)
    raise ValueError(f"on_a_free_port: attempts={attempts} (at least 1)")


def init_local_ray(num_cpus: int, attempts: int = START_ATTEMPTS) -> int:
    """ray.init of a new local node (no dashboard, metrics reported every second) exporting its metrics on a free
    loopback port (on_a_free_port); returns that port."""
    import ray

    def start(port: int) -> None:
        ray.init(address="local", num_cpus=num_cpus, include_dashboard=False, _metrics_export_port=port,
                 _system_config={"metrics_report_interval_ms": 1000}, logging_level="warning")

    return on_a_free_port(start, attempts)[1]


@dataclass
class Replica:
    deployment: str
    replica_id: str  # Serve's unique id: the `replica` label of the engine metrics
    pid: int
    actor_name: str


@dataclass
class Target:
    base_url: str
    metrics_url: Optional[str]
    app: str
    ray_attached: bool  # replicas can be listed, killed and sampled


def start_local(config: dict, app: str = "diffkv", num_cpus: int = 8) -> Target:
    """A local Ray (loopback HTTP, metrics reported every second) and the service app at /."""
    os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
    from ray import serve

    from diffkv_serve.service.app import build_app

    metrics_port = init_local_ray(num_cpus)
    http_port = free_port()
    quiet = {"enable_access_log": False, "log_level": "WARNING"}  # thousands of requests: no line for each
    serve.start(http_options={"host": "127.0.0.1", "port": http_port}, logging_config=quiet)
    serve.run(build_app(config), name=app, route_prefix="/", logging_config=quiet)
    return Target(f"http://127.0.0.1:{http_port}", f"http://127.0.0.1:{metrics_port}/metrics", app, True)


def attach(ray_address: str) -> None:
    import ray

    ray.init(address=ray_address, logging_level="warning")


def stop_local() -> None:
    import ray
    from ray import serve

    if ray.is_initialized():
        serve.shutdown()
        ray.shutdown()


def replicas(app: str) -> list[Replica]:
    """The live replica actors of `app` (every deployment), with their processes."""
    import ray._private.state as state

    out = []
    for a in state.actors().values():
        name = a.get("Name") or ""
        if a.get("State") != "ALIVE" or not name.startswith(REPLICA_PREFIX):
            continue
        parts = name[len(REPLICA_PREFIX):].split("#")
        if len(parts) == 3 and parts[0] == app:
            out.append(Replica(parts[1], parts[2], int(a["Pid"]), name))
    return sorted(out, key=lambda r: (r.deployment, r.replica_id))


def running_replicas(app: str, deployment: str) -> int:
    """Replicas of a deployment that Serve counts RUNNING (started and passing health checks)."""
    from ray import serve

    status = serve.status().applications.get(app)
    if status is None or deployment not in status.deployments:
        return 0
    return int(status.deployments[deployment].replica_states.get("RUNNING", 0))


def kill_replica(replica: Replica) -> None:
    """Kill the replica's actor outright (no graceful shutdown): what a crashed process looks like to Serve."""
    import ray

    ray.kill(ray.get_actor(replica.actor_name, namespace="serve"), no_restart=True)


def rss_bytes(pid: int) -> Optional[int]:
    import psutil

    try:
        return psutil.Process(pid).memory_info().rss
    except (psutil.NoSuchProcess, psutil.AccessDenied, psutil.ZombieProcess):
        return None


# ---- metrics -----------------------------------------------------------------------------------------------
_LINE = re.compile(r'^(?P<name>[a-zA-Z_:][a-zA-Z0-9_:]*)(?:\{(?P<labels>[^}]*)\})? (?P<value>\S+)$')


def parse_metrics(text: str) -> list[tuple[str, dict, float]]:
    """Prometheus text format -> (series name, labels, value) per sample."""
    out = []
    for line in text.splitlines():
        m = _LINE.match(line)
        if m:
            labels = dict(re.findall(r'(\w+)="([^"]*)"', m["labels"] or ""))
            out.append((m["name"], labels, float(m["value"])))
    return out


def scrape(metrics_url: str, timeout: float = 10.0) -> list[tuple[str, dict, float]]:
    with urllib.request.urlopen(metrics_url, timeout=timeout) as r:
        return parse_metrics(r.read().decode())


def pages_by_replica(samples: list[tuple[str, dict, float]]) -> dict[str, dict[str, float]]:
    """replica id -> {"used", "total"}: the KV page gauges summed over tensor-parallel ranks."""
    out: dict[str, dict[str, float]] = {}
    for name, labels, value in samples:
        key = {PAGES_USED: "used", PAGES_TOTAL: "total"}.get(name)
        if key and "replica" in labels:
            slot = out.setdefault(labels["replica"], {"used": 0.0, "total": 0.0})
            slot[key] += value
    return out


def in_flight(samples: list[tuple[str, dict, float]]) -> Optional[float]:
    """Admitted requests not yet finished, summed over ingress replicas (None: not exported)."""
    vals = [v for n, _, v in samples if n == IN_FLIGHT]
    return sum(vals) if vals else None


def retried(samples: list[tuple[str, dict, float]]) -> Optional[float]:
    """Admitted requests the ingress re-sent to another replica after theirs failed (None: not exported)."""
    vals = [v for n, _, v in samples if n == RETRIED]
    return sum(vals) if vals else None


def wait_until(pred, timeout: float, interval: float = 1.0):
    """pred()'s first truthy value within `timeout` seconds, else None."""
    deadline = time.monotonic() + timeout
    while True:
        value = pred()
        if value:
            return value
        if time.monotonic() >= deadline:
            return None
        time.sleep(interval)
