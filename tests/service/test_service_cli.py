"""`diffkv serve`: configuration from a file plus flags, and a real start / serve / Ctrl-C / clean exit."""
import os
import signal
import subprocess
import sys

import httpx
import pytest

from _cluster import free_port, wait_for
from service.cli import _serve_config, build_parser


def parse(*argv):
    return build_parser().parse_args(["serve", *argv])


def test_config_file_and_flags(tmp_path):
    plain = tmp_path / "svc.yaml"
    plain.write_text("kv_mode: int8\nnum_replicas: 3\nadmission: {ttft_target_s: 4.5}\n")
    cfg = _serve_config(parse("--config", str(plain), "--num-replicas", "2", "--ttft-target", "2"))
    assert (cfg.kv_mode, cfg.cache.kv_mode, cfg.num_replicas, cfg.admission.ttft_target_s) == ("int8", "int8", 2, 2.0)
    serve_file = tmp_path / "serve.yaml"  # a Serve config: the application's args are used
    serve_file.write_text("applications:\n  - name: diffkv\n    import_path: service.app:build_app\n"
                          "    args: {kv_mode: diffkv, tensor_parallel_size: 2}\n")
    cfg = _serve_config(parse("--config", str(serve_file), "--no-admission"))
    assert cfg.kv_mode == "diffkv" and cfg.tensor_parallel_size == 2 and not cfg.admission.enabled
    bad = tmp_path / "bad.yaml"
    bad.write_text("kv_mode: int3\n")
    with pytest.raises(ValueError, match="kv_mode"):
        _serve_config(parse("--config", str(bad)))


def test_serve_starts_serves_and_stops_on_ctrl_c(tmp_path):
    port, metrics = free_port(), free_port()
    env = {**os.environ, "RAY_USAGE_STATS_ENABLED": "0"}
    log = open(tmp_path / "serve.log", "w")
    proc = subprocess.Popen([sys.executable, "-m", "service.cli", "serve", "--device", "cpu", "--port", str(port),
                             "--metrics-port", str(metrics), "--num-cpus", "4", "--max-model-len", "128"],
                            stdout=log, stderr=subprocess.STDOUT, env=env)
    base = f"http://127.0.0.1:{port}"
    try:
        def healthy():
            assert proc.poll() is None, (tmp_path / "serve.log").read_text()[-3000:]
            try:
                return httpx.get(base + "/health", timeout=5).status_code == 200
            except httpx.HTTPError:
                return False
        wait_for(healthy, 180, interval=1.0, what="diffkv serve to come up")
        model = httpx.get(base + "/v1/models", timeout=30).json()["data"][0]["id"]
        r = httpx.post(base + "/v1/completions", timeout=60,
                       json={"model": model, "prompt": "Hello", "max_tokens": 3, "temperature": 0})
        assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] <= 3
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
