"""Edges of the command line a newcomer meets first: Ctrl-C in `diffkv chat` ends it without a traceback, and
pytest's own output is not buried under Ray's pydantic deprecation warnings."""
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def _wait_for(proc, path: Path, needle: str, timeout: float) -> str:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        text = path.read_text()
        if needle in text:
            return text
        assert proc.poll() is None, text
        time.sleep(0.2)
    raise AssertionError(f"{needle!r} not seen in {timeout}s: {path.read_text()}")


def test_ctrl_c_in_chat_exits_cleanly(tmp_path):
    err = tmp_path / "stderr.txt"
    with open(err, "w") as stderr:
        proc = subprocess.Popen([sys.executable, "-m", "diffkv_serve.service.cli", "chat", "--device", "cpu",
                                 "--threads", "1", "--max-tokens", "2"], stdin=subprocess.PIPE,
                                stdout=subprocess.PIPE, stderr=stderr, text=True, cwd=ROOT,
                                env={**os.environ, "PYTHONPATH": str(ROOT)})
        try:
            _wait_for(proc, err, "Ctrl-C to quit", 180)  # the engine is built; the prompt reads stdin
            time.sleep(0.5)
            proc.send_signal(signal.SIGINT)
            out, _ = proc.communicate(timeout=60)
        finally:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
    text = err.read_text()
    assert proc.returncode == 0, text
    assert "Traceback" not in text and "KeyboardInterrupt" not in text, text
    assert out.startswith(">")  # the prompt was shown, then the chat ended


def test_pytest_output_has_no_ray_pydantic_deprecation_warnings(tmp_path):
    test = tmp_path / "test_imports_ray_serve.py"
    test.write_text("def test_serve_imports():\n    import ray.serve  # noqa: F401\n    import ray.serve.schema\n")
    p = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-c",
                        str(ROOT / "pyproject.toml"), "--rootdir", str(ROOT), str(test)],
                       capture_output=True, text=True, timeout=300, cwd=ROOT)
    assert p.returncode == 0, p.stdout + p.stderr
    assert "1 passed" in p.stdout and "warning" not in p.stdout.lower(), p.stdout
