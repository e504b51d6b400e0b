"""scripts/device: the carried-wheel tooling (strip, pack, stash-and-install) and the device scripts' arguments.
The scripts themselves run on the GPU box; scripts/device/serve_sweep.sh and tp_bench.sh were also run here on
CPU with DIFFKV_SKIP_WHEELS=1 (see their headers)."""
import stat
import subprocess
import zipfile

import pytest

from _ops import REPO, load

cw = load("scripts/device/carry_wheels.py", "carry_wheels")


def _wheel(path, files: dict, executable=()):
    with zipfile.ZipFile(path, "w") as z:
        for name, data in files.items():
            info = zipfile.ZipInfo(name)
            info.external_attr = (0o755 if name in executable else 0o644) << 16
            z.writestr(info, data)
    return path


def test_strip_ray_drops_jars_maps_and_the_web_ui_and_their_record_lines(tmp_path):
    files = {"ray/__init__.py": "x", "ray/jars/ray_dist.jar": "j" * 1000, "ray/core/src/ray/raylet/raylet": "elf",
             "ray/dashboard/client/build/index.html": "<html>", "ray/dashboard/modules/a.js.map": "{}",
             "ray/dashboard/agent.py": "agent"}
    record = "".join(f"{n},sha256=abc,1\n" for n in files) + "ray-2.0.dist-info/RECORD,,\n"
    src = _wheel(tmp_path / "ray-2.0-cp312-cp312-manylinux2014_x86_64.whl",
                 {**files, "ray-2.0.dist-info/RECORD": record}, executable={"ray/core/src/ray/raylet/raylet"})
    removed, _ = cw.strip_ray(src, tmp_path / "out.whl")
    assert removed == 3
    with zipfile.ZipFile(tmp_path / "out.whl") as z:
        names = set(z.namelist())
        assert names == {"ray/__init__.py", "ray/core/src/ray/raylet/raylet", "ray/dashboard/agent.py",
                         "ray-2.0.dist-info/RECORD"}
        kept = [ln.split(",")[0] for ln in z.read("ray-2.0.dist-info/RECORD").decode().splitlines()]
        assert kept == ["ray/__init__.py", "ray/core/src/ray/raylet/raylet", "ray/dashboard/agent.py",
                        "ray-2.0.dist-info/RECORD"]  # every RECORD line names a file the wheel has
        assert (z.getinfo("ray/core/src/ray/raylet/raylet").external_attr >> 16) & 0o111  # still executable


def test_pack_fills_folders_under_the_limit(tmp_path, monkeypatch):
    monkeypatch.setattr(cw, "FOLDER_LIMIT", 100)
    sizes = {"a": 70, "b": 60, "c": 30, "d": 25, "e": 10}
    wheels = []
    for name, size in sizes.items():
        (tmp_path / f"{name}.whl").write_bytes(b"x" * size)
        wheels.append(tmp_path / f"{name}.whl")
    layout = cw.pack(wheels, "ray", 1)
    assert list(layout) == ["ray1", "ray2"]  # 195 bytes: two folders of at most 100
    assert all(sum(w.stat().st_size for w in ws) <= 100 for ws in layout.values())
    assert sorted(w.stem for ws in layout.values() for w in ws) == sorted(sizes)
    (tmp_path / "big.whl").write_bytes(b"x" * 101)
    with pytest.raises(SystemExit, match="alone exceeds"):
        cw.pack([tmp_path / "big.whl"], "ray", 1)


def test_install_stashes_across_calls_then_installs_once(tmp_path, monkeypatch, capsys):
    """One device command carries one folder: the first call stashes and says what is missing (exit 3), the
    second completes the group and installs it (here by unpacking, the path for a Python without pip)."""
    carry, site, stash = tmp_path / "carry", tmp_path / "site", tmp_path / "stash"
    (carry / "ray1").mkdir(parents=True)
    (carry / "ray2").mkdir()
    a = _wheel(carry / "ray1" / "pkga-1.0-py3-none-any.whl", {"pkga/__init__.py": "A = 1\n",
                                                              "pkga/bin_tool": "#!", "pkga-1.0.dist-info/RECORD": ""},
               executable={"pkga/bin_tool"})
    b = _wheel(carry / "ray2" / "pkgb-1.0-py3-none-any.whl", {"pkgb.py": "B = 2\n", "pkgb-1.0.data/scripts/pkgb": "#!",
                                                              "pkgb-1.0.dist-info/RECORD": ""})
    manifest = tmp_path / "wheels.txt"
    manifest.write_text(f"# header\nray1 core {a.name} {cw.sha256(a)}\nray2 core {b.name} {cw.sha256(b)}\n")
    monkeypatch.setattr(cw, "CARRY", carry)
    monkeypatch.setattr(cw, "MANIFEST", manifest)
    import importlib.util

    real_find_spec = importlib.util.find_spec  # no pip: the unpacking path
    monkeypatch.setattr(importlib.util, "find_spec",
                        lambda name, *args: None if name == "pip" else real_find_spec(name, *args))
    argv = ["install", "--target", str(site), "--stash", str(stash)]
    moved = tmp_path / "later"
    (carry / "ray2").rename(moved)  # the first call carries ray1 only
    assert cw.main(argv) == 3
    assert "carry .carry/ray2 first" in capsys.readouterr().out and not site.exists()
    (carry / "ray1" / a.name).unlink()  # the next call carries ray2 only: ray1's wheel is in the stash
    moved.rename(carry / "ray2")
    assert cw.main(argv) == 0
    assert (site / "pkga" / "__init__.py").read_text() == "A = 1\n" and (site / "pkgb.py").is_file()
    assert (site / "pkga" / "bin_tool").stat().st_mode & stat.S_IXUSR
    assert (site / "bin" / "pkgb").is_file()  # .data/scripts go to bin/
    assert cw.main(argv) == 0 and "already installed" in capsys.readouterr().out
    for marker in site.glob(".diffkv-wheels-*"):
        marker.unlink()
    (stash / a.name).write_bytes(b"cut short")  # a stashed copy that is not the manifest's wheel is dropped
    assert cw.main(argv) == 3 and not (stash / a.name).exists()
    (carry / "ray1" / a.name).write_bytes(b"other bytes")  # a changed carried file is refused, not stashed
    with pytest.raises(SystemExit, match="sha256 differs"):
        cw.main(argv)


def test_manifest_matches_the_carry_groups():
    rows = cw.read_manifest()
    names = {cw.wheel_name(name): group for _, group, name, _ in rows}
    assert names["ray"] == "core" and names["fastapi"] == "core" and names["matplotlib"] == "plot"
    assert not {"torch", "triton", "numpy"} & set(names) and not any(n.startswith("nvidia-") for n in names)
    assert {folder for folder, _, _, _ in rows} == {"ray1", "ray2", "ray3"}


@pytest.mark.parametrize("script", ["serve_sweep.sh", "tp_bench.sh"])
def test_device_scripts_parse(script):
    assert subprocess.run(["bash", "-n", str(REPO / "scripts" / "device" / script)]).returncode == 0


def test_serve_sweep_rejects_unknown_arguments_before_doing_anything(tmp_path):
    p = subprocess.run(["bash", str(REPO / "scripts/device/serve_sweep.sh"), "--no-such-flag", "1"],
                       capture_output=True, text=True, env={"PATH": "/usr/bin:/bin", "OUT": str(tmp_path)}, timeout=60)
    assert p.returncode == 2 and "unknown argument: --no-such-flag" in p.stderr and "--rates" in p.stderr
    assert not (tmp_path / "serve_sweep").exists()
