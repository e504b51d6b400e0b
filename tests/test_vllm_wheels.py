"""scripts/device/vllm_wheels.py with small stand-in wheels: strip, split, pack, the manifest, and the box's side
(one folder per device command into a stash, exit 3 until complete, then join, check and install once)."""
from __future__ import annotations

import argparse
import os
import sys
import zipfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "scripts" / "device"))

import vllm_wheels as vw  # noqa: E402


def make_wheel(folder: Path, name: str, version: str, files: dict[str, bytes]) -> Path:
    dist = f"{name}-{version}.dist-info"
    members = {**files, f"{dist}/METADATA": f"Metadata-Version: 2.1\nName: {name}\nVersion: {version}\n".encode(),
               f"{dist}/WHEEL": b"Wheel-Version: 1.0\nGenerator: test\nRoot-Is-Purelib: true\nTag: py3-none-any\n"}
    members[f"{dist}/RECORD"] = "".join(f"{m},,\n" for m in [*members, f"{dist}/RECORD"]).encode()
    path = folder / f"{name}-{version}-py3-none-any.whl"
    with zipfile.ZipFile(path, "w", zipfile.ZIP_STORED) as z:
        for m, data in members.items():
            z.writestr(m, data)
    return path


@pytest.fixture
def layout(tmp_path, monkeypatch):
    dl, carry = tmp_path / "carry" / "_vdl", tmp_path / "carry"
    dl.mkdir(parents=True)
    big = {"bigpkg/__init__.py": b"X = 1\n", "bigpkg/blob.bin": os.urandom(300_000)}  # split into 3 pieces
    xgr = {"xgrammar/__init__.py": b"", "xgrammar/lib/libxgrammar.a": b"a" * 5000}  # the static library is dropped
    wheels = [make_wheel(dl, "bigpkg", "1.0", big), make_wheel(dl, "xgrammar", "0.2.3", xgr),
              make_wheel(dl, "small", "2.0", {"small/__init__.py": b"Y = 2\n"})]
    req = tmp_path / "req.txt"
    req.write_text("# comment\n" + "\n".join(w.name for w in wheels) + "\n")
    for name, value in (("DOWNLOAD", dl), ("CARRY", carry), ("REQUIREMENTS", req),
                        ("MANIFEST", tmp_path / "manifest.txt")):
        monkeypatch.setattr(vw, name, value)
    return argparse.Namespace(piece=120_000, folder_limit=250_000), carry, tmp_path


def test_strip_drops_the_member_and_its_record_line(tmp_path):
    src = make_wheel(tmp_path, "xgrammar", "0.2.3", {"xgrammar/__init__.py": b"", "xgrammar/lib/libxgrammar.a": b"a"})
    dst = tmp_path / "out" / src.name
    dst.parent.mkdir()
    assert vw.strip_wheel(src, dst, vw.STRIP["xgrammar-"]) == 1
    with zipfile.ZipFile(dst) as z:
        names = z.namelist()
        record = z.read("xgrammar-0.2.3.dist-info/RECORD").decode()
    assert "xgrammar/lib/libxgrammar.a" not in names and "libxgrammar.a" not in record
    assert "xgrammar/__init__.py" in names and "xgrammar/__init__.py" in record


def test_pack_is_first_fit_decreasing_within_the_limit(tmp_path):
    files = []
    for i, size in enumerate([60, 50, 40, 30, 20, 10]):
        (tmp_path / f"f{i}").write_bytes(b"x" * size)
        files.append(tmp_path / f"f{i}")
    bins = vw.pack(files, 100)
    assert all(sum(f.stat().st_size for f in b) <= 100 for b in bins) and len(bins) == 3
    assert sorted(f.name for b in bins for f in b) == sorted(f.name for f in files)
    with pytest.raises(SystemExit, match="alone exceeds"):
        vw.pack(files, 55)


def test_build_then_the_box_installs_once_every_folder_came(layout, capsys):
    args, carry, tmp = layout
    assert vw.build(args) == 0  # also runs check: files, sizes, rejoined pieces, pip's dry run
    files, joins = vw.read_manifest()
    assert list(joins) == ["bigpkg-1.0-py3-none-any.whl"] and joins["bigpkg-1.0-py3-none-any.whl"][1] == 3
    folders = sorted({f for f, _ in files.values()})
    assert len(folders) >= 2
    for f in folders:
        assert sum(p.stat().st_size for p in (carry / f).iterdir()) <= args.folder_limit
    # the box: one folder per command; the others are not there
    hidden = tmp / "hidden"
    hidden.mkdir()
    for f in folders:
        (carry / f).rename(hidden / f)
    box = argparse.Namespace(stash=str(tmp / "stash"), target=str(tmp / "site"))
    for i, f in enumerate(folders):
        (hidden / f).rename(carry / f)
        rc = vw.install(box)
        (carry / f).rename(hidden / f)
        out = capsys.readouterr().out
        if i < len(folders) - 1:
            assert rc == 3 and "carry .carry/" in out and f".carry/{f}" not in out.split("carry ", 2)[-1]
            assert not (tmp / "site").exists()
        else:
            assert rc == 0 and "installed 3" in out
    site = tmp / "site"
    assert (site / "bigpkg" / "blob.bin").stat().st_size == 300_000 and (site / "small" / "__init__.py").is_file()
    assert not (site / "xgrammar" / "lib" / "libxgrammar.a").exists() and (site / "xgrammar").is_dir()
    assert list((tmp / "stash").glob("*.part-*")) == []  # the pieces went once joined
    assert vw.install(box) == 0 and "already installed" in capsys.readouterr().out


def test_a_changed_piece_is_refused(layout):
    args, carry, tmp = layout
    vw.build(args)
    files, _ = vw.read_manifest()
    name, (folder, _) = next((n, v) for n, v in files.items() if ".part-" in n)
    (carry / folder / name).write_bytes(b"corrupt")
    with pytest.raises(SystemExit, match="sha256 differs"):
        vw.install(argparse.Namespace(stash=str(tmp / "stash"), target=str(tmp / "site")))
    with pytest.raises(SystemExit, match="missing or changed"):
        vw.check(args)


def test_committed_manifest_covers_the_requirements():
    files, joins = vw.read_manifest()
    assert set(vw.wheel_names(files, joins)) == set(vw.requirements())
    assert len(vw.requirements()) == 79 and "vllm-0.26.0-cp38-abi3-manylinux_2_28_x86_64.whl" in joins
    assert all(f.startswith("vllm") for f, _ in files.values())
