"""`diffkv serve` and `diffkv drain`: the service's configuration from flags and files, deployment with a progress
bar, the local Ray it starts, and the drain on SIGTERM / Ctrl-C (or from another process, as KubeRay's preStop
hook) before Serve and Ray stop. Ray and Serve are imported only when a command runs."""
from __future__ import annotations

import json
import sys
from typing import Optional

from diffkv_serve.service.config import API_KEY_ENV


def _serve_config(args):
    """ServiceConfig from --config (ServiceConfig fields, or a Serve config YAML whose first application's
    `args` are used) with the command-line flags on top."""
    from pathlib import Path

    from diffkv_serve.engine.flags import engine_settings
    from diffkv_serve.service.config import ServiceConfig, api_keys_from_env, nest_engine_fields

    data: dict = {}
    if args.config:
        text = Path(args.config).read_text()
        if args.config.endswith(".json"):
            data = json.loads(text)
        else:
            import yaml

            data = yaml.safe_load(text) or {}
        if "applications" in data:  # a Serve config file: take the app's args
            data = dict(data["applications"][0].get("args") or {})
    data = nest_engine_fields(data)  # a file's top-level engine fields into data["engine"], under the flags
    engine = dict(data.get("engine") or {})
    for key, value in engine_settings(args).items():
        engine[key] = {**(engine.get(key) or {}), **value} if isinstance(value, dict) else value
    if engine:
        data["engine"] = engine
    if args.num_replicas is not None:
        data["num_replicas"] = args.num_replicas
    if getattr(args, "chat_template", None) is not None:
        data["chat_template"] = args.chat_template
    if args.ttft_target is not None:
        data.setdefault("admission", {})["ttft_target_s"] = args.ttft_target
    if args.no_admission:
        data.setdefault("admission", {})["enabled"] = False
    if args.max_body_bytes is not None:
        data.setdefault("limits", {})["max_body_bytes"] = args.max_body_bytes
    if args.drain_timeout is not None:
        data["drain_timeout_s"] = args.drain_timeout
    keys = list(data.get("api_keys") or []) + (args.api_key or []) + api_keys_from_env()
    if keys:
        data["api_keys"] = list(dict.fromkeys(keys))
    return ServiceConfig.model_validate(data)


def _served_kv_mode(cfg) -> str:
    """The KV mode the engine replicas run: kv_mode 'auto' is resolved by each replica for its model, so ask one."""
    if cfg.engine.cache.kv_mode != "auto":
        return cfg.engine.cache.kv_mode
    from ray import serve

    from diffkv_serve.service.app import APP_NAME, ENGINE_DEPLOYMENT

    try:
        return serve.get_deployment_handle(ENGINE_DEPLOYMENT, APP_NAME).info.remote().result(timeout_s=30)["kv_mode"]
    except Exception as e:  # noqa: BLE001 - the banner must not stop a running server
        return f"auto, resolved by each replica (none answered: {e!r})"


def _deploy_with_progress(app, name: str, stop) -> None:
    """serve.run on a thread, with a progress bar over the deployments becoming healthy."""
    import threading
    import time

    from ray import serve
    from tqdm.auto import tqdm

    err: list[BaseException] = []

    def run():
        try:
            serve.run(app, name=name, route_prefix="/")
        except BaseException as e:  # noqa: BLE001 - re-raised on the main thread
            err.append(e)

    t = threading.Thread(target=run, daemon=True)
    t.start()
    with tqdm(total=2, desc="deploying (model load)", unit="deployment") as bar:
        while t.is_alive():
            t.join(1.0)
            if stop.is_set():
                raise KeyboardInterrupt
            try:
                deps = serve.status().applications[name].deployments
                healthy = sum(1 for d in deps.values() if str(d.status).endswith("HEALTHY"))
                bar.total = max(len(deps), 1)
                bar.n = healthy
                bar.refresh()
            except (KeyError, Exception):  # the app is not registered yet
                time.sleep(0.2)
    if err:
        raise err[0]


def _check_ports_free(host: str, ports: dict[str, Optional[int]]) -> None:
    """Refuse to start when a port is taken: Ray would time out 30 s later with "The current node timed out
    during startup", and the real cause (address in use) would show only in Ray's own log."""
    import socket

    for flag, port in ports.items():
        if not port:
            continue
        with socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET) as sock:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as the servers bind it: TIME_WAIT is free
            try:
                sock.bind((host, port))
            except OSError as e:
                raise ValueError(f"{flag} {port}: {host}:{port} is already in use ({e.strerror}); stop what holds "
                                 f"it (a server stopped a moment ago may still hold it) or choose another port")


# Ray's switch for the single-machine mode it uses on macOS/Windows: the node's address is loopback, so the
# metrics exporter binds loopback (ray.init's _node_ip_address turns 127.0.0.1 into the machine's address).
_RAY_LOOPBACK_NODE_ENV = "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER"


def _local_ray_env(args) -> dict[str, str]:
    """Environment for the Ray this command starts (set before Ray is imported: Ray reads it then, and its
    processes inherit it). A loopback --host keeps the whole node on loopback, so --metrics-port is bound
    there too rather than on every interface."""
    loopback = args.host in ("localhost", "::1") or args.host.startswith("127.")  # not Ray's: it reads the env
    return {_RAY_LOOPBACK_NODE_ENV: "0"} if loopback else {}


def _check_joined_port(args) -> None:
    """Joining a cluster: --port is checked only when Serve is not running there yet. A running Serve's proxies
    already listen on its HTTP port (a previous run's serve.delete leaves them up), and this app joins them."""
    from ray import serve

    if not serve.status().proxies:
        _check_ports_free(args.host, {"--port": args.port})


def _metrics_banner(args, node: Optional[dict] = None) -> str:
    """Where Prometheus finds the metrics, for the startup line. The local Ray binds --metrics-port on loopback
    only with a loopback --host (_local_ray_env), on every interface otherwise; a joined cluster's node exports
    on the port it was started with (`node`: this node's entry in ray.nodes()), whatever --metrics-port says."""
    if args.address:
        if node is None:
            return ""
        port = node["MetricsExportPort"]
        ignored = f"; --metrics-port {args.metrics_port} is ignored" if args.metrics_port not in (None, port) else ""
        return f", this node's Prometheus metrics on {node['NodeManagerAddress']}:{port}/metrics{ignored}"
    if not args.metrics_port:
        return ""
    if _local_ray_env(args):  # a loopback node
        return f", Prometheus metrics on {args.host}:{args.metrics_port}/metrics"
    return f", Prometheus metrics on 0.0.0.0:{args.metrics_port}/metrics (every interface)"


def _auth_banner(args, cfg) -> str:
    if cfg.all_api_keys():
        return "API key required"
    if _local_ray_env(args):
        return "no API key"
    return f"no API key: anyone who reaches {args.host}:{args.port} can generate (--api-key or {API_KEY_ENV})"


def _this_node() -> Optional[dict]:
    import ray

    me = ray.get_runtime_context().get_node_id()
    return next((n for n in ray.nodes() if n["NodeID"] == me), None)


def _local_ray_init_kwargs(args) -> dict:
    init: dict = {"include_dashboard": False}
    if args.num_cpus is not None:
        init["num_cpus"] = args.num_cpus
    if args.metrics_port is not None:
        init["_metrics_export_port"] = args.metrics_port
    return init


def _reap(procs: list, grace_s: float = 3.0) -> None:
    """Wait for the processes of the Ray this command started; terminate (then kill) what outlives ray.shutdown()
    by grace_s (its dashboard and runtime-env agents otherwise linger a minute, holding --metrics-port)."""
    import psutil

    _, alive = psutil.wait_procs(procs, timeout=grace_s)
    for p in alive:
        try:
            p.terminate()
        except psutil.NoSuchProcess:
            pass
    _, alive = psutil.wait_procs(alive, timeout=5.0)
    for p in alive:
        try:
            p.kill()
        except psutil.NoSuchProcess:
            pass
    psutil.wait_procs(alive, timeout=5.0)


def _stop_on_signals(stop, hurry) -> None:
    """The first SIGINT / SIGTERM stops the service (after draining); a second one cuts the drain short."""
    import signal

    def handler(*_):
        (hurry if stop.is_set() else stop).set()

    for sig in (signal.SIGINT, signal.SIGTERM):  # also when started in the background (SIGINT ignored)
        signal.signal(sig, handler)


# After the last request's final bytes left the ingress, they still cross Serve's proxy to the client.
_DRAIN_FLUSH_S = 0.5
# Past the drain timeout the ingress ends what is left; that takes a poll period and a response or two.
_DRAIN_ABORT_GRACE_S = 5.0


def _drain(cfg, hurry) -> None:
    """diffkv_serve.service.drain: announce, then wait until every running ingress replica has nothing in flight. Also
    when the stop came during the deployment: an ingress replica serves as soon as it runs."""
    import time

    from diffkv_serve.service import drain
    from diffkv_serve.service.app import APP_NAME

    try:
        replicas = _running_ingress_replicas(APP_NAME)
    except Exception:  # noqa: BLE001 - Serve is not reachable: nothing to drain
        replicas = None
    if not replicas:
        return
    print(f"draining: new requests get 503; requests in flight get up to {cfg.drain_timeout_s:g}s to finish "
          f"(a second Ctrl-C stops at once)", file=sys.stderr, flush=True)
    drain.announce(APP_NAME, cfg.drain_timeout_s)
    took = drain.wait_drained(APP_NAME, replicas, cfg.drain_timeout_s + _DRAIN_ABORT_GRACE_S,
                              give_up=hurry.is_set)
    if took is None:
        print("drain incomplete: stopping with requests in flight", file=sys.stderr, flush=True)
    else:
        print(f"drained in {took:.1f}s", file=sys.stderr, flush=True)
        time.sleep(_DRAIN_FLUSH_S)


def _stop_serve(timeout_s: float = 30.0, hurry=None) -> None:
    """serve.shutdown() without its noise. serve.shutdown() waits on a controller call that can only end by
    failing (the controller kills itself), and Ray reports that failure as "Task
    ServeController.graceful_shutdown failed ... will be retried". Here the shutdown is requested without
    waiting, and the controller actor is waited for until it is gone (replicas still holding requests get
    their graceful-shutdown timeout, drain_timeout_s and a margin; a second Ctrl-C, `hurry`, stops waiting);
    any other Ray falls back to serve.shutdown()."""
    import time

    import ray
    from ray import serve

    try:
        from ray.serve._private.constants import SERVE_CONTROLLER_NAME, SERVE_NAMESPACE
        from ray.serve.context import _get_global_client, _set_global_client

        client = _get_global_client(raise_if_no_controller_running=False)
        controller = client._controller if client is not None else None
    except (ImportError, AttributeError):
        serve.shutdown()
        return
    if controller is None:
        return
    client.shutdown_cached_handles()
    ray.get(controller.graceful_shutdown.remote(False), timeout=timeout_s)
    deadline = time.monotonic() + timeout_s
    hurried = hurry.is_set if hurry is not None else (lambda: False)
    while time.monotonic() < deadline and not hurried():
        try:
            ray.get_actor(SERVE_CONTROLLER_NAME, namespace=SERVE_NAMESPACE)
        except ValueError:  # gone: Serve's applications, replicas and proxies are stopped
            break
        time.sleep(0.2)
    else:
        if not hurried():
            print(f"Serve's controller did not stop within {timeout_s:g}s", file=sys.stderr, flush=True)
    client._shutdown = True
    _set_global_client(None)


def cmd_serve(args) -> int:
    import os
    import threading

    import psutil

    cfg = _serve_config(args)
    os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
    if not args.address:
        for key, value in _local_ray_env(args).items():
            os.environ.setdefault(key, value)
    import ray
    from ray import serve

    from diffkv_serve.service import drain
    from diffkv_serve.service.app import APP_NAME, build_app

    stop, hurry = threading.Event(), threading.Event()
    _stop_on_signals(stop, hurry)
    if args.address:
        ray.init(address=args.address)
        _check_joined_port(args)
    else:
        _check_ports_free(args.host, {"--port": args.port, "--metrics-port": args.metrics_port})
        ray.init(**_local_ray_init_kwargs(args))
    # again: Ray's core worker installs its own SIGTERM handler (a crash report, then exit) in ray.init
    _stop_on_signals(stop, hurry)
    deploying = False
    try:
        serve.start(http_options={"host": args.host, "port": args.port})
        drain.clear(APP_NAME)  # a drain announced by an earlier run on this cluster is not this run's
        deploying = True
        _deploy_with_progress(build_app(cfg), APP_NAME, stop)
        metrics = _metrics_banner(args, _this_node() if args.address else None)
        print(f"DiffKV Serve: OpenAI API on http://{args.host}:{args.port}/v1 (kv_mode={_served_kv_mode(cfg)}, "
              f"replicas={cfg.num_replicas}, tp={cfg.engine.tensor_parallel_size}{metrics}; "
              f"{_auth_banner(args, cfg)}). "
              f"Ctrl-C stops.", file=sys.stderr, flush=True)
        while not stop.wait(0.5):
            pass
    except KeyboardInterrupt:
        pass
    finally:
        print("shutting down...", file=sys.stderr, flush=True)
        ours = [] if args.address else psutil.Process().children(recursive=True)  # the Ray we started
        try:
            if deploying:
                _drain(cfg, hurry)
            if args.address:
                serve.delete(APP_NAME)  # a shared cluster: remove only our app
                drain.clear(APP_NAME)
            else:
                _stop_serve(hurry=hurry)
        finally:
            ray.shutdown()
            _reap(ours)
    return 0


def _running_ingress_replicas(app: str) -> Optional[int]:
    from ray import serve

    from diffkv_serve.service.app import INGRESS_DEPLOYMENT

    status = serve.status().applications.get(app)
    if status is None:
        return None
    ingress = status.deployments.get(INGRESS_DEPLOYMENT)
    states = ingress.replica_states if ingress is not None else {}
    return sum(n for state, n in states.items() if str(getattr(state, "value", state)).endswith("RUNNING"))


def cmd_drain(args) -> int:
    """Drain a running app (a KubeRay head pod's preStop hook runs this before the pod is stopped): its
    ingress replicas refuse new requests and finish or end those in flight; nothing is shut down here."""
    import os
    import time

    os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
    import ray

    from diffkv_serve.service import drain

    ray.init(address=args.address, logging_level="error", log_to_driver=False)
    try:
        if args.cancel:
            drain.clear(args.app)
            print(f"drain of {args.app!r} withdrawn: its ingress replicas serve again", file=sys.stderr)
            return 0
        replicas = _running_ingress_replicas(args.app)
        if replicas is None:
            print(f"error: no Serve application {args.app!r} on this cluster", file=sys.stderr)
            return 2
        t0 = time.monotonic()
        if args.follow:  # a worker pod: wait only for a drain the head announces (the whole cluster stops)
            while drain.announced(args.app) is None:
                if time.monotonic() - t0 > args.follow_s:
                    print("no drain announced: nothing to wait for", file=sys.stderr)
                    return 0
                time.sleep(drain.POLL_S)
        else:
            drain.announce(args.app, args.timeout)
        timeout = f"{args.timeout:g}s" if args.timeout is not None else "the app's drain_timeout_s"
        print(f"draining {args.app!r} ({replicas} ingress replicas): requests in flight get {timeout}",
              file=sys.stderr, flush=True)
        took = drain.wait_drained(args.app, max(replicas, 1), args.max_wait)
        if took is None:
            print(f"not drained after {time.monotonic() - t0:.1f}s", file=sys.stderr)
            return 1
        print(f"drained in {took:.1f}s", file=sys.stderr)
        return 0
    finally:
        ray.shutdown()
