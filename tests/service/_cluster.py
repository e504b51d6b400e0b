"""Start Ray + Serve for the service tests (loopback, fractional CPUs) and deploy apps on it."""
from __future__ import annotations

import os
import subprocess
import time
import urllib.request
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Optional

# One Prometheus text parser, one port picker and one local Ray start (the soak uses them too).
from loadtest.soak_cluster import free_port, init_local_ray, on_a_free_port, parse_metrics  # noqa: F401  (re-exported)

os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
os.environ.setdefault("DIFFKV_CACHE_DIR", os.path.expanduser("~/.cache/diffkv"))
# Ray workers inherit the driver's environment: the engine replicas of these tests take
# service.testing_hooks calls (a replica made to outgrow its memory limit).
os.environ.setdefault("DIFFKV_TEST_HOOKS", "1")


@dataclass
class Cluster:
    http_port: int
    metrics_port: int

    @property
    def metrics_url(self) -> str:
        return f"http://127.0.0.1:{self.metrics_port}/metrics"

    def scrape(self) -> str:
        with urllib.request.urlopen(self.metrics_url, timeout=10) as r:
            return r.read().decode()


def start_cluster(num_cpus: int = 8) -> Cluster:
    from ray import serve

    metrics_port = init_local_ray(num_cpus)
    http_port = free_port()
    serve.start(http_options={"host": "127.0.0.1", "port": http_port})
    return Cluster(http_port, metrics_port)


def stop_cluster() -> None:
    import ray
    from ray import serve

    serve.shutdown()
    ray.shutdown()


def deploy(config: dict, name: str, route_prefix: str):
    """Deploy build_app(config) as app `name` under route_prefix; returns the engine deployment's handle."""
    from ray import serve

    from diffkv_serve.service.app import ENGINE_DEPLOYMENT, build_app

    serve.run(build_app(config), name=name, route_prefix=route_prefix)
    return serve.get_deployment_handle(ENGINE_DEPLOYMENT, app_name=name)


@contextmanager
def served(cluster, config: dict, name: str, route_prefix: str, headers: Optional[dict] = None):
    """deploy() the app, give the handles a module's tests use (base URL, served model id, engine handle,
    cluster), and delete the app afterwards. `headers`: what /v1/models needs (an API key)."""
    import httpx
    from ray import serve

    engine = deploy(config, name, route_prefix)
    base = f"http://127.0.0.1:{cluster.http_port}{route_prefix}"
    model = httpx.get(f"{base}/v1/models", headers=headers, timeout=60).json()["data"][0]["id"]
    try:
        yield {"base": base, "model": model, "engine": engine, "cluster": cluster}
    finally:
        serve.delete(name)


def wait_for(pred, timeout: float, interval: float = 0.5, what: str = "condition"):
    deadline = time.monotonic() + timeout
    while True:
        value = pred()
        if value:
            return value
        if time.monotonic() > deadline:
            raise TimeoutError(f"timed out after {timeout}s waiting for {what}")
        time.sleep(interval)


def wait_serve_healthy(proc, base: str, log_path, interval: float = 0.5, timeout: float = 180) -> str:
    """Wait until a `diffkv serve` subprocess answers /health (failing with its log's tail if it exits), then
    return the served model's name."""
    import httpx

    def healthy():
        assert proc.poll() is None, log_path.read_text()[-3000:]
        try:
            return httpx.get(base + "/health", timeout=5).status_code == 200
        except httpx.HTTPError:
            return False
    wait_for(healthy, timeout, interval=interval, what="diffkv serve to come up")
    return httpx.get(base + "/v1/models", timeout=30).json()["data"][0]["id"]


def stop_process(proc, timeout: float = 60) -> None:
    """Stop a server subprocess the clean way (SIGTERM, so the Ray it started goes too), killing it if it hangs."""
    proc.terminate()
    try:
        proc.wait(timeout=timeout)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()


def values(samples, name, **labels):
    """Values of the samples of one series whose labels include `labels`."""
    return [v for n, lab, v in samples if n == name and all(lab.get(k) == val for k, val in labels.items())]
