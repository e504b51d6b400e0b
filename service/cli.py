"""`diffkv` command line: serve (the OpenAI API on Ray Serve), generate (one prompt), chat (interactive), and
eval / calibrate (accuracy, evals/), on the embedded model by default."""
from __future__ import annotations

import argparse
import copy
import functools
import json
import sys
from typing import Optional

from engine.config import KV_MODES
from service.config import API_KEY_ENV


PACKAGE = "diffkv-serve"
THREADS_HELP = "torch CPU threads (default on CPU: the cores not busy with other processes, 1 to 4)"


class HelpFormatter(argparse.ArgumentDefaultsHelpFormatter):
    """--help shows each option's default, also for options without help text; options whose default is
    None or off say nothing (their help says what None means)."""

    _NO_HELP = "\0"  # stands in for a missing help text: argparse prints no help line for an empty one

    @staticmethod
    def _shows_default(action: argparse.Action) -> bool:
        d = action.default
        return bool(action.option_strings) and not (d is None or d is False or d == [] or d is argparse.SUPPRESS)

    def _format_action(self, action: argparse.Action) -> str:
        if not action.help and self._shows_default(action):
            action = copy.copy(action)
            action.help = self._NO_HELP
        return super()._format_action(action)

    def _get_help_string(self, action: argparse.Action) -> str:
        text = (action.help or "").replace(self._NO_HELP, "")
        if "%(default)" in text or not self._shows_default(action):
            return text
        return f"{text} (default: %(default)s)".lstrip()


def version() -> str:
    from importlib.metadata import PackageNotFoundError
    from importlib.metadata import version as package_version

    try:
        return package_version(PACKAGE)
    except PackageNotFoundError:  # run from a checkout that was never installed
        return "unknown (not installed)"


def _engine_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", default=None, help="HF folder, .gguf file or random:<preset> (default: embedded SmolLM2)")
    p.add_argument("--device", default="auto", help="auto | cpu | cuda | cuda:N")
    p.add_argument("--dtype", default="auto", choices=["auto", "float32", "float16", "bfloat16"],
                   help="weights and unquantized cache values; auto: bfloat16 on CUDA, float32 on CPU")
    p.add_argument("--max-model-len", type=int, default=None, help="context length (default: the model's)")
    p.add_argument("--kv-mode", default="fp16", choices=KV_MODES,
                   help="fp16: uncompressed, in --dtype; fp8: e4m3 with a scale per token and KV head")
    p.add_argument("--alpha-high", type=float, default=None,
                   help="diffkv: high-precision threshold (default: the model's calibrated value)")
    p.add_argument("--alpha-low", type=float, default=None,
                   help="diffkv: low-precision threshold (default: the model's calibrated value)")
    p.add_argument("--threads", type=int, default=None, help=THREADS_HELP)


def _sampling_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--max-tokens", type=int, default=128)
    p.add_argument("--temperature", type=float, default=0.0, help="0 = greedy")
    p.add_argument("--top-p", type=float, default=1.0)
    p.add_argument("--top-k", type=int, default=0)
    p.add_argument("--seed", type=int, default=None)
    p.add_argument("--stop", action="append", default=[], help="stop string (repeatable)")
    p.add_argument("--ignore-eos", action="store_true")


def _engine_config(args):
    """The flags' EngineConfig; thresholds left out stay unset, for the engine to take the model's."""
    from engine import EngineConfig

    cache = {"kv_mode": args.kv_mode}
    cache.update({k: v for k, v in (("alpha_high", args.alpha_high), ("alpha_low", args.alpha_low)) if v is not None})
    return EngineConfig(model=args.model, device=args.device, dtype=args.dtype, max_model_len=args.max_model_len,
                        cache=cache)


def _build_engine(args):
    from engine.llm_engine import LLMEngine
    from engine.threads import set_threads

    set_threads(args.threads, args.device)
    return LLMEngine(_engine_config(args))


def _sampling(args):
    from engine import SamplingParams

    return SamplingParams(max_tokens=args.max_tokens, temperature=args.temperature, top_p=args.top_p,
                          top_k=args.top_k, seed=args.seed, stop=args.stop, ignore_eos=args.ignore_eos)


def _prompt_ids(engine, text: str, raw: bool, history: Optional[list] = None) -> list[int]:
    tok = engine.tokenizer
    if raw or not getattr(tok, "chat_template", None):
        return tok.encode(text)
    messages = (history or []) + [{"role": "user", "content": text}]
    return tok.encode(tok.apply_chat_template(messages, add_generation_prompt=True), add_special_tokens=False)


def _run(engine, ids: list[int], sampling, stream) -> "object":
    engine.add_request("cli", ids, sampling)
    final = None
    while engine.has_unfinished_requests():
        for out in engine.step():
            if stream is not None and out.delta_text:
                stream.write(out.delta_text)
                stream.flush()
            if out.finished:
                final = out
    return final


def cmd_generate(args) -> int:
    from engine.errors import InvalidRequestError

    engine = _build_engine(args)
    try:
        ids = _prompt_ids(engine, args.prompt, args.raw)
        out = _run(engine, ids, _sampling(args), None if args.json else sys.stdout)
    except InvalidRequestError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    if args.json:
        kv = out.kv_usage or {}
        counts = ("bytes_used", "bytes_fp16", "bytes_uncompressed", "pages_used", "pages_shared", "tokens_high",
                  "tokens_low", "tokens_pruned")
        print(json.dumps({"text": out.text, "token_ids": out.token_ids, "finish_reason": out.finish_reason,
                          "prompt_tokens": len(out.prompt_token_ids),
                          "kv": {"kv_mode": engine.config.cache.kv_mode, "cache_dtype": engine.cache_dtype,
                                 **{k: kv.get(k, 0) for k in counts}, "pages_total": engine.mm.num_pages,
                                 "mm_seconds": engine.runner.kv.mm_seconds()}}))
    else:
        print()
    return 0


def cmd_chat(args) -> int:
    from engine.errors import InvalidRequestError

    engine = _build_engine(args)
    history: list[dict] = []
    print("Chat with the model (empty line or Ctrl-D to quit).", file=sys.stderr)
    while True:
        try:
            text = input("> ").strip()
        except EOFError:
            break
        if not text:
            break
        try:
            out = _run(engine, _prompt_ids(engine, text, False, history), _sampling(args), sys.stdout)
        except InvalidRequestError as e:
            print(f"error: {e}", file=sys.stderr)
            continue
        print()
        history += [{"role": "user", "content": text}, {"role": "assistant", "content": out.text}]
    return 0


def _serve_config(args):
    """ServiceConfig from --config (ServiceConfig fields, or a Serve config YAML whose first application's
    `args` are used) with the command-line flags on top."""
    from pathlib import Path

    from service.config import ServiceConfig, api_keys_from_env

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
    flags = {"model": args.model, "device": args.device, "max_model_len": args.max_model_len,
             "num_replicas": args.num_replicas, "tensor_parallel_size": args.tensor_parallel_size,
             "kv_mode": args.kv_mode}
    data.update({k: v for k, v in flags.items() if v is not None})
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
    """service.drain: announce, then wait until every running ingress replica has nothing in flight. Also
    when the stop came during the deployment: an ingress replica serves as soon as it runs."""
    import time

    from service import drain
    from service.app import APP_NAME

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


def _stop_serve(timeout_s: float = 30.0) -> None:
    """serve.shutdown() without its noise. serve.shutdown() waits on a controller call that can only end by
    failing (the controller kills itself), and Ray reports that failure as "Task
    ServeController.graceful_shutdown failed ... will be retried". Here the shutdown is requested without
    waiting, and the controller actor is waited for until it is gone; any other Ray falls back to
    serve.shutdown()."""
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
    while time.monotonic() < deadline:
        try:
            ray.get_actor(SERVE_CONTROLLER_NAME, namespace=SERVE_NAMESPACE)
        except ValueError:  # gone: Serve's applications, replicas and proxies are stopped
            break
        time.sleep(0.2)
    else:
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

    from service import drain
    from service.app import APP_NAME, build_app

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
        print(f"DiffKV Serve: OpenAI API on http://{args.host}:{args.port}/v1 (kv_mode={cfg.kv_mode}, "
              f"replicas={cfg.num_replicas}, tp={cfg.tensor_parallel_size}{metrics}; {_auth_banner(args, cfg)}). "
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
                _stop_serve()
        finally:
            ray.shutdown()
            _reap(ours)
    return 0


def _running_ingress_replicas(app: str) -> Optional[int]:
    from ray import serve

    from service.app import INGRESS_DEPLOYMENT

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

    from service import drain

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


class CommandParser(argparse.ArgumentParser):
    """A subcommand's parser whose arguments may be added only when it is used (parsed or its help shown):
    eval / calibrate live in the evaluation package, which the serving commands should not import."""

    def __init__(self, *args, populate=None, **kwargs):
        super().__init__(*args, **kwargs)
        self._populate = populate

    def _ensure_populated(self) -> None:
        if self._populate is not None:
            populate, self._populate = self._populate, None
            populate(self)

    def parse_known_args(self, args=None, namespace=None):
        self._ensure_populated()
        return super().parse_known_args(args, namespace)

    def format_usage(self) -> str:
        self._ensure_populated()
        return super().format_usage()

    def format_help(self) -> str:
        self._ensure_populated()
        return super().format_help()


def _eval_command(p: argparse.ArgumentParser) -> None:
    from evals import cli as evals_cli

    evals_cli.add_eval_args(p)
    p.set_defaults(func=evals_cli.cmd_eval)


def _calibrate_command(p: argparse.ArgumentParser) -> None:
    from evals import cli as evals_cli

    evals_cli.add_calibrate_args(p)
    p.set_defaults(func=evals_cli.cmd_calibrate)


def _service_default(field: str):
    """ServiceConfig's default of a field (serve's flags default to None: --config's value comes first)."""
    from service.config import ServiceConfig

    return ServiceConfig.model_fields[field].get_default(call_default_factory=True)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="diffkv", description="DiffKV Serve: LLM serving with a compressed KV cache",
                                     formatter_class=HelpFormatter)
    parser.add_argument("--version", action="version", version=f"%(prog)s {version()}")
    sub = parser.add_subparsers(dest="command", required=True, parser_class=CommandParser)
    add = functools.partial(sub.add_parser, formatter_class=HelpFormatter)
    g = add("generate", help="generate a completion for one prompt")
    g.add_argument("--prompt", required=True)
    g.add_argument("--raw", action="store_true", help="do not apply the model's chat template")
    g.add_argument("--json", action="store_true", help="print one JSON object (text, token_ids, finish_reason, kv)")
    _engine_args(g)
    _sampling_args(g)
    g.set_defaults(func=cmd_generate)
    c = add("chat", help="interactive chat in the terminal")
    _engine_args(c)
    _sampling_args(c)
    c.set_defaults(func=cmd_chat)
    s = add("serve", help="serve the OpenAI-compatible API on Ray Serve (Ctrl-C stops)",
            description="Engine flags left out take --config's value, else ServiceConfig's default.")
    s.add_argument("--config", default=None, help="YAML/JSON of ServiceConfig fields (or a Serve config file)")
    s.add_argument("--model", default=None, help="HF folder, .gguf file or random:<preset> (default: embedded)")
    s.add_argument("--device", default=None, help=f"auto | cpu | cuda (default: {_service_default('device')})")
    s.add_argument("--max-model-len", type=int, default=None, help="context length (default: the model's)")
    s.add_argument("--kv-mode", default=None, choices=KV_MODES,
                   help=f"(default: {_service_default('cache').kv_mode})")
    s.add_argument("--host", default="127.0.0.1")
    s.add_argument("--port", type=int, default=8000)
    s.add_argument("--num-replicas", type=int, default=None,
                   help=f"engine replicas (default: {_service_default('num_replicas')})")
    s.add_argument("--tensor-parallel-size", type=int, default=None,
                   help=f"worker actors per engine replica (default: {_service_default('tensor_parallel_size')})")
    s.add_argument("--ttft-target", type=float, default=None,
                   help=f"admission control's TTFT target in seconds (default: "
                        f"{_service_default('admission').ttft_target_s})")
    s.add_argument("--no-admission", action="store_true", help="admit every request (no 429s)")
    s.add_argument("--api-key", action="append", default=None, metavar="KEY",
                   help=f"require 'Authorization: Bearer KEY' on /v1/* (repeat it to accept several keys while "
                        f"rotating; {API_KEY_ENV}, comma-separated, adds keys without putting them on the command "
                        f"line)")
    s.add_argument("--max-body-bytes", type=int, default=None,
                   help=f"largest request body; larger ones get 413 before they are parsed (default: "
                        f"{_service_default('limits').max_body_bytes})")
    s.add_argument("--drain-timeout", type=float, default=None,
                   help=f"seconds requests in flight get to finish on SIGTERM / Ctrl-C (default: "
                        f"{_service_default('drain_timeout_s')})")
    s.add_argument("--address", default=None, help="join this Ray cluster instead of starting a local one")
    s.add_argument("--num-cpus", type=float, default=None, help="CPUs of the local Ray (default: detected)")
    s.add_argument("--metrics-port", type=int, default=None,
                   help="Prometheus export port of the local Ray (on loopback when --host is)")
    s.set_defaults(func=cmd_serve)
    d = add("drain", help="drain a running app before its cluster stops (a KubeRay preStop hook)",
            description="New requests get 503, requests in flight get the drain timeout to finish, the rest end "
                        "with 503 / an SSE error event; returns once every ingress replica has none left.")
    d.add_argument("--address", default="auto", help="the Ray cluster")
    d.add_argument("--app", default="diffkv", help="the Serve application")  # service.app.APP_NAME
    d.add_argument("--timeout", type=float, default=None,
                   help="seconds requests in flight get (default: the app's ServiceConfig.drain_timeout_s)")
    d.add_argument("--max-wait", type=float, default=300.0, help="give up waiting after this many seconds")
    d.add_argument("--cancel", action="store_true", help="withdraw a drain: the ingress replicas serve again")
    d.add_argument("--follow", action="store_true",
                   help="announce nothing: wait for a drain another process announces within --follow-s (a worker "
                        "pod's preStop: its engine replica keeps serving while the head drains)")
    d.add_argument("--follow-s", type=float, default=15.0)
    d.set_defaults(func=cmd_drain)
    # the evaluation package is imported only when one of these is parsed or its help shown
    add("eval", help="task accuracy and fidelity vs the fp16 cache of one KV configuration (JSON)",
        populate=_eval_command)
    add("calibrate", help="calibrate alpha_high / alpha_low for a model and write its settings file",
        populate=_calibrate_command)
    return parser


def main(argv: Optional[list[str]] = None) -> int:
    import logging

    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    args = build_parser().parse_args(argv)
    try:
        return args.func(args)
    except (FileNotFoundError, ValueError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
