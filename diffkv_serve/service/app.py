"""The Serve application: an OpenAI ingress in front of engine replicas.

    from diffkv_serve.service.app import build_app
    serve.run(build_app({"kv_mode": "diffkv", "num_replicas": 2}))

or `serve run service.app:build_app kv_mode=diffkv`, or a Serve config YAML (KubeRay):

    applications:
      - name: diffkv
        import_path: service.app:build_app
        route_prefix: /
        args: {kv_mode: diffkv, tensor_parallel_size: 2, admission: {ttft_target_s: 2.0}}

Serve validates `args` into ServiceConfig (the type hint), so a bad argument fails the deploy with the
field's name. (No `from __future__ import annotations` here: Serve reads build_app's annotation as a class.)
"""
import logging
from typing import Any

from ray import serve
from ray.serve import Application

from diffkv_serve.service.api import OpenAIIngress
from diffkv_serve.service.config import ServiceConfig
from diffkv_serve.service.replica import EngineReplica

log = logging.getLogger(__name__)

APP_NAME = "diffkv"
ENGINE_DEPLOYMENT = "EngineReplica"
INGRESS_DEPLOYMENT = "OpenAIIngress"
# A stopping engine replica's time beyond drain_timeout_s: its __del__ (stop record, engine shutdown).
ENGINE_STOP_MARGIN_S = 5.0
# How long a stopping ingress replica waits for its requests. It does no generation itself: each request it
# holds ends when its engine replica finishes it, or, if that replica is stopped (drain_timeout_s + margin)
# or fails, with an SSE error event or a 503. Killing the ingress sooner would cut those streams, so the
# bound is far above any of that.
INGRESS_STOP_TIMEOUT_S = 3600.0


def engine_deployment_options(cfg: ServiceConfig) -> dict[str, Any]:
    """Resources, placement group, health checks and the router of the engine deployment."""
    gpu = cfg.uses_gpu()
    opts: dict[str, Any] = {
        "name": ENGINE_DEPLOYMENT,
        "max_ongoing_requests": cfg.max_ongoing_requests,
        "health_check_period_s": cfg.health_check_period_s,
        "health_check_timeout_s": cfg.health_check_timeout_s,
        # A replica Serve stops (redeploy, scale-down) gets no new requests and runs those it holds to their
        # end for up to drain_timeout_s, as a drained server does; then Serve kills it.
        "graceful_shutdown_timeout_s": cfg.drain_timeout_s + ENGINE_STOP_MARGIN_S,
        # how often a stopping replica looks for requests still running (Serve's 2 s would add up to 2 s to
        # every stop, when a drain has already finished them)
        "graceful_shutdown_wait_loop_s": 0.5,
    }
    if cfg.autoscaling:
        opts["autoscaling_config"] = cfg.autoscaling
    else:
        opts["num_replicas"] = cfg.num_replicas
    if cfg.uses_worker_actors():
        # Bundle 0 holds the replica (scheduler, tokenizer, no model); bundles 1..N one worker each, all on one
        # node (STRICT_PACK: PACK would split them when no node has room for all, and the ranks' all-reduce
        # would cross the network; then the replica waits for a node with room instead). The engine puts its
        # workers in this placement group.
        worker = {"GPU": 1.0, "CPU": cfg.worker_cpus} if gpu else {"CPU": cfg.worker_cpus}
        worker.update(cfg.rank_resources)
        ranks = cfg.engine.tensor_parallel_size
        opts["placement_group_bundles"] = [{"CPU": cfg.replica_cpus}] + [dict(worker) for _ in range(ranks)]
        opts["placement_group_strategy"] = "STRICT_PACK"
        opts["ray_actor_options"] = {"num_cpus": cfg.replica_cpus}
    else:
        opts["ray_actor_options"] = {"num_cpus": cfg.replica_cpus, "num_gpus": 1 if gpu else 0}
        if cfg.rank_resources:
            opts["ray_actor_options"]["resources"] = dict(cfg.rank_resources)
    router_class, router_kwargs = _request_router(cfg)
    if router_class is not None:
        from ray.serve.config import RequestRouterConfig

        opts["request_router_config"] = RequestRouterConfig(
            request_router_class=router_class, request_router_kwargs=router_kwargs,
            request_routing_stats_period_s=cfg.router.stats_period_s,
            request_routing_stats_timeout_s=max(5.0, 5 * cfg.router.stats_period_s))
    return opts


def _request_router(cfg: ServiceConfig) -> tuple[Any, dict[str, Any]]:
    """The RequestRouter class of router.policy and its initialize_state kwargs; None: Serve's default."""
    if cfg.router.policy == "pow2":
        return None, {}
    if cfg.router.policy == "prefix":
        from diffkv_serve.service.prefix_router import PrefixAwareRouter as router_class

        kwargs = cfg.router.prefix.model_dump()
    else:
        from diffkv_serve.service.router import KVHeadroomRouter as router_class

        kwargs = {}
    if router_class is None:  # pragma: no cover - Ray without the request-router extension point
        log.warning("this Ray has no RequestRouter extension point; using Serve's default router")
        return None, {}
    return router_class, kwargs


def build_app(args: ServiceConfig) -> Application:
    """`args`: a ServiceConfig, or a dict of its fields (validated here)."""
    cfg = args if isinstance(args, ServiceConfig) else ServiceConfig.model_validate(args or {})
    payload = cfg.deployment_args()  # the set fields only: the replica's engine fills the model's settings
    engine_payload = {k: v for k, v in payload.items() if k != "api_keys"}  # only the ingress checks keys
    engine = serve.deployment(EngineReplica).options(**engine_deployment_options(cfg)).bind(engine_payload)
    return OpenAIIngress.options(
        name=INGRESS_DEPLOYMENT, num_replicas=cfg.ingress_replicas,
        # Every request reaches the ingress at once, so admission control sees the real arrivals (Serve's
        # default of 5 would queue them in the proxy, invisibly).
        max_ongoing_requests=100_000, graceful_shutdown_wait_loop_s=0.5,
        graceful_shutdown_timeout_s=max(INGRESS_STOP_TIMEOUT_S, cfg.drain_timeout_s + 2 * ENGINE_STOP_MARGIN_S),
        ray_actor_options=ingress_actor_options(cfg), **ingress_surge()).bind(engine, payload)


def ingress_surge() -> dict[str, Any]:
    """A redeploy starts the new ingress replicas before it stops the old ones, so the proxy always has one to
    send requests to (an ingress costs a fraction of a CPU). Ray before max_surge_percent stops the old one
    first: requests then wait in the proxy until the new one runs."""
    import inspect

    from ray.serve.deployment import Deployment

    return {"max_surge_percent": 100} if "max_surge_percent" in inspect.signature(Deployment.options).parameters \
        else {}


def ingress_actor_options(cfg: ServiceConfig) -> dict[str, Any]:
    opts: dict[str, Any] = {"num_cpus": cfg.ingress_cpus}
    if cfg.ingress_resources:
        opts["resources"] = dict(cfg.ingress_resources)
    return opts
