"""What a newcomer's first try of the ops scripts does: --help prints usage and changes nothing, --check says
when all is well, a wrong argument is a usage error that names it."""
import subprocess
import sys

from _ops import REPO


def _run(*argv):
    return subprocess.run([sys.executable, *argv], capture_output=True, text=True, timeout=300, cwd=REPO)


def test_k8s_validate_help_and_a_wrong_folder():
    p = _run("k8s/validate.py", "--help")
    assert p.returncode == 0 and "usage: python3 k8s/validate.py" in p.stdout and "DIR" in p.stdout, p.stderr
    assert "Traceback" not in p.stderr
    p = _run("k8s/validate.py", "no/such/folder")
    assert p.returncode == 2 and "no/such/folder" in p.stderr and "kustomization.yaml" in p.stderr
    assert "Traceback" not in p.stderr


def test_grafana_dashboard_help_writes_nothing_and_check_says_ok():
    path = REPO / "grafana" / "dashboards" / "diffkv-serve.json"
    before = (path.read_bytes(), path.stat().st_mtime_ns)
    p = _run("grafana/dashboard.py", "--help")
    assert p.returncode == 0 and "--check" in p.stdout and "wrote" not in p.stdout, p.stderr
    p = _run("grafana/dashboard.py", "--chek")
    assert p.returncode == 2 and "--chek" in p.stderr
    assert (path.read_bytes(), path.stat().st_mtime_ns) == before  # neither rewrote the dashboard
    p = _run("grafana/dashboard.py", "--check")
    assert p.returncode == 0 and p.stdout.startswith("ok: diffkv-serve.json is current"), p.stdout + p.stderr
    assert (path.read_bytes(), path.stat().st_mtime_ns) == before
