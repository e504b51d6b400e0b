"""What `pip install .` puts on the path: one top-level package of ours, diffkv_serve. kernels (Hugging Face's
kernel hub, imported by transformers), engine, service and evals are other projects' names on PyPI; a top-level
module by those names must never come from this checkout's wheel."""
import json
import os
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
FOREIGN_NAMES = ("kernels", "engine", "service", "evals", "benchmarks", "loadtest")


def _build_wheel(tmp_path: Path) -> Path:
    """The wheel of a copy of the checkout's packaged files (the build writes its scratch folders next to them)."""
    src = tmp_path / "src"
    src.mkdir()
    for name in ("pyproject.toml", "README.md", "LICENSE"):
        shutil.copy(ROOT / name, src / name)
    shutil.copytree(ROOT / "diffkv_serve", src / "diffkv_serve",
                    ignore=shutil.ignore_patterns("__pycache__", "*.pyc"))
    for name in ("evals", "benchmarks", "loadtest", "tests"):  # beside the package, as in a clone
        shutil.copytree(ROOT / name, src / name, ignore=shutil.ignore_patterns("__pycache__", "*.pyc", "results",
                                                                               "data"))
    out = tmp_path / "wheel"
    p = subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q",
                        "-w", str(out), str(src)], capture_output=True, text=True, timeout=300)
    assert p.returncode == 0, p.stdout + p.stderr
    (wheel,) = out.glob("diffkv_serve-*.whl")
    return wheel


def test_the_wheel_holds_one_top_level_package(tmp_path):
    with zipfile.ZipFile(_build_wheel(tmp_path)) as whl:
        names = whl.namelist()
        (top_level,) = [n for n in names if n.endswith(".dist-info/top_level.txt")]
        assert whl.read(top_level).decode().split() == ["diffkv_serve"]
    tops = {n.split("/")[0] for n in names}
    assert {t for t in tops if not t.endswith(".dist-info")} == {"diffkv_serve"}, sorted(tops)
    # the parts that run inside the package ship with it: engine, kernels (with the CUDA source), service
    for part in ("engine/llm_engine.py", "kernels/decode_attention/__init__.py", "service/cli.py",
                 "engine/model_settings/__init__.py"):
        assert f"diffkv_serve/{part}" in names, part
    assert any(n.startswith("diffkv_serve/kernels/decode_attention/") and n.endswith(".cu") for n in names)
    assert any(n.startswith("diffkv_serve/engine/model_settings/") and n.endswith(".json") for n in names)


def test_no_foreign_top_level_name_resolves_to_this_project(tmp_path):
    """Run from outside the checkout, as an installed user would: kernels, engine, service, evals, ... either do
    not import or come from another distribution; diffkv_serve comes from this project."""
    code = ("import importlib.util, json, sys\n"
            f"names = {FOREIGN_NAMES!r} + ('diffkv_serve',)\n"
            "specs = {n: importlib.util.find_spec(n) for n in names}\n"
            "print(json.dumps({n: (s.origin or list(s.submodule_search_locations or [''])[0]) if s else None "
            "for n, s in specs.items()}))\n")
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    p = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, cwd=tmp_path,
                       env=env)
    assert p.returncode == 0, p.stderr
    where = json.loads(p.stdout)
    assert where["diffkv_serve"] is not None and Path(where["diffkv_serve"]).name in ("__init__.py", "diffkv_serve")
    installed_from = Path(where["diffkv_serve"]).resolve().parents[1]  # a checkout under an editable install
    project_dirs = {ROOT.resolve()} | ({installed_from} if (installed_from / "pyproject.toml").exists() else set())
    for name in FOREIGN_NAMES:
        if where[name] is not None:
            origin = Path(where[name]).resolve()
            assert not any(origin.is_relative_to(d) for d in project_dirs), f"{name} resolves to {origin}"
