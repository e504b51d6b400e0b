"""Bring vLLM 0.26.0 (the baseline of benchmarks/vllm_baseline.py) to the GPU box as wheels carried in ignored
folders, one folder per device command: the working tree (about 8 MiB) plus one folder must stay under 64 MiB.

    python3 scripts/device/vllm_wheels.py build   # here: download vllm_requirements.txt, pack .carry/vllm1..N
    python3 scripts/device/vllm_wheels.py check   # here: every carried file matches the manifest, pieces rejoin
    python3 scripts/device/vllm_wheels.py install # on the box: stash what this command carried; install when whole

The vllm wheel (290 MiB) travels in PIECE-sized pieces that the box joins back (and checks against the whole
wheel's sha256); xgrammar's 65 MB static library, which nothing loads at run time, is dropped from its wheel
(and from its RECORD). `build` writes scripts/device/vllm_wheels.txt: every carried file with its folder and
sha256, and each split wheel with its sha256 and piece count. On the box, `install` copies the files of whatever
.carry/vllm* folders the command carried into a stash (kept while the machine stays warm), and once every file is
there it installs all wheels with `pip install --no-index --no-deps --target` (a marker makes a later call a
no-op). Exit 3 names the folders still to carry.
"""
from __future__ import annotations

import argparse
import hashlib
import re
import shutil
import subprocess
import sys
import tempfile
import time
import zipfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
CARRY = REPO / ".carry"
DOWNLOAD = CARRY / "_vdl"  # what pip downloads (not carried)
HERE = Path(__file__).resolve().parent
REQUIREMENTS = HERE / "vllm_requirements.txt"
MANIFEST = HERE / "vllm_wheels.txt"
PREFIX = "vllm"  # .carry/vllm1, vllm2, ...
MiB = 2**20
PIECE = 48 * MiB
FOLDER_LIMIT = 50 * MiB  # + the ~8 MiB tree (+ .carry/w's 9 MiB on the last call) under the 64 MiB a call carries

PLATFORM_ARGS = ["--only-binary=:all:", "--python-version", "3.12", "--implementation", "cp", "--abi", "cp312",
                 "--abi", "abi3", "--abi", "none"] + [
    a for p in ("manylinux1_x86_64", "manylinux2014_x86_64", "manylinux_2_5_x86_64", "manylinux_2_17_x86_64",
                "manylinux_2_26_x86_64", "manylinux_2_27_x86_64", "manylinux_2_28_x86_64",
                "manylinux_2_31_x86_64", "any") for a in ("--platform", p)]

# Members dropped from a wheel before carrying: {wheel name prefix: pattern of archive paths}
STRIP = {"xgrammar-": re.compile(r"^xgrammar/lib/libxgrammar\.a$")}


def requirements() -> list[str]:
    return [ln.strip() for ln in REQUIREMENTS.read_text().splitlines() if ln.strip() and not ln.startswith("#")]


def pin(filename: str) -> str:
    """'vllm-0.26.0-cp38-abi3-manylinux_2_28_x86_64.whl' -> 'vllm==0.26.0'."""
    name, version = filename.split("-")[:2]
    return f"{name}=={version}"


def sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(MiB), b""):
            h.update(block)
    return h.hexdigest()


def strip_wheel(src: Path, dst: Path, pattern: re.Pattern) -> int:
    """Copy a wheel without the members matching `pattern` and without their RECORD lines; the number dropped."""
    removed = 0
    with zipfile.ZipFile(src) as zin, zipfile.ZipFile(dst, "w", zipfile.ZIP_DEFLATED, compresslevel=9) as zout:
        for info in zin.infolist():
            if pattern.search(info.filename):
                removed += 1
                continue
            data = zin.read(info)
            if info.filename.endswith(".dist-info/RECORD"):
                data = "".join(ln for ln in data.decode().splitlines(keepends=True)
                               if not pattern.search(ln.split(",")[0])).encode()
            zout.writestr(info, data)  # the ZipInfo keeps each member's permissions
    return removed


def split_file(src: Path, dest: Path, piece: int) -> list[Path]:
    """NAME -> NAME.part-000, -001, ... of at most `piece` bytes each (joined in name order)."""
    parts = []
    with open(src, "rb") as f:
        for i in range(10**3):
            data = f.read(piece)
            if not data:
                break
            p = dest / f"{src.name}.part-{i:03d}"
            p.write_bytes(data)
            parts.append(p)
    return parts


def pack(files: list[Path], limit: int) -> list[list[Path]]:
    """First-fit decreasing into bins of at most `limit` bytes."""
    bins: list[list[Path]] = []
    used: list[int] = []
    for f in sorted(files, key=lambda p: (-p.stat().st_size, p.name)):
        size = f.stat().st_size
        if size > limit:
            raise SystemExit(f"{f.name} ({size / MiB:.1f} MiB) alone exceeds a folder's {limit / MiB:.0f} MiB")
        for i in range(len(bins)):
            if used[i] + size <= limit:
                bins[i].append(f)
                used[i] += size
                break
        else:
            bins.append([f])
            used.append(size)
    return bins


def read_manifest(path: Path | None = None) -> tuple[dict[str, tuple[str, str]], dict[str, tuple[str, int]]]:
    """({carried file: (folder, sha256)}, {split wheel: (sha256, pieces)}) of `path` (default MANIFEST)."""
    path = path or MANIFEST
    files, joins = {}, {}
    for ln in path.read_text().splitlines():
        if not ln.strip() or ln.startswith("#"):
            continue
        kind, *rest = ln.split()
        if kind == "file":
            folder, name, digest = rest
            files[name] = (folder, digest)
        elif kind == "join":
            name, digest, count = rest
            joins[name] = (digest, int(count))
        else:
            raise SystemExit(f"{path.name}: unknown line {ln!r}")
    return files, joins


def wheel_names(files: dict, joins: dict) -> list[str]:
    """The wheels to install: every carried .whl plus every joined one."""
    return sorted([n for n in files if n.endswith(".whl")] + list(joins))


def build(args) -> int:
    DOWNLOAD.mkdir(parents=True, exist_ok=True)
    wanted = requirements()
    missing = [w for w in wanted if not (DOWNLOAD / w).is_file()]
    if missing:
        cmd = [sys.executable, "-m", "pip", "download", "-q", "--no-deps", "--dest", str(DOWNLOAD), *PLATFORM_ARGS,
               *map(pin, missing)]
        print("+", " ".join(cmd[:8]), f"... ({len(missing)} wheels)", flush=True)
        subprocess.run(cmd, check=True)
    absent = [w for w in wanted if not (DOWNLOAD / w).is_file()]
    if absent:
        raise SystemExit(f"pip did not bring these exact files (another build was picked?): {absent}")
    staging = Path(tempfile.mkdtemp(prefix="vllm-carry-"))
    items, joins = [], []
    for w in wanted:
        src = DOWNLOAD / w
        for prefix, pattern in STRIP.items():
            if w.startswith(prefix):
                out = staging / w
                n = strip_wheel(src, out, pattern)
                print(f"{w}: {src.stat().st_size / MiB:.1f} -> {out.stat().st_size / MiB:.1f} MiB ({n} dropped)")
                src = out
        if src.stat().st_size > args.piece:
            parts = split_file(src, staging, args.piece)
            joins.append(f"join {w} {sha256(src)} {len(parts)}")
            print(f"{w}: {src.stat().st_size / MiB:.1f} MiB in {len(parts)} pieces")
            items.extend(parts)
        else:
            items.append(src)
    for old in CARRY.glob(f"{PREFIX}[0-9]*"):
        shutil.rmtree(old)
    lines = ["# kind folder file sha256 / kind wheel sha256 pieces -- written by scripts/device/vllm_wheels.py build"]
    for i, group in enumerate(pack(items, args.folder_limit), start=1):
        folder = CARRY / f"{PREFIX}{i}"
        folder.mkdir(parents=True)
        for f in sorted(group, key=lambda p: p.name):
            shutil.copy2(f, folder / f.name)
            lines.append(f"file {folder.name} {f.name} {sha256(f)}")
        print(f".carry/{folder.name}: {len(group)} files, {sum(f.stat().st_size for f in group) / MiB:.1f} MiB")
    MANIFEST.write_text("\n".join(lines + joins) + "\n")
    shutil.rmtree(staging)
    print(f"wrote {MANIFEST}")
    return check(args)


def check(args) -> int:
    """Every carried file is there and unchanged, folders within the limit, split wheels rejoin to their sha256,
    and pip would install the whole set for Python 3.12 on manylinux x86-64 (a dry run; no dependencies)."""
    files, joins = read_manifest()
    bad = [f"{folder}/{name}" for name, (folder, digest) in files.items()
           if not (CARRY / folder / name).is_file() or sha256(CARRY / folder / name) != digest]
    if bad:
        raise SystemExit(f"missing or changed files: {bad} (run build)")
    folders = sorted({folder for folder, _ in files.values()}, key=lambda f: int(f.removeprefix(PREFIX)))
    for folder in folders:
        size = sum(p.stat().st_size for p in (CARRY / folder).iterdir())
        if size > args.folder_limit:
            raise SystemExit(f".carry/{folder} is {size / MiB:.1f} MiB > {args.folder_limit / MiB:.0f} MiB")
        print(f".carry/{folder}: {size / MiB:.1f} MiB")
    with tempfile.TemporaryDirectory() as tmp:
        stash = Path(tmp)
        for name, (folder, _) in files.items():
            (stash / name).symlink_to(CARRY / folder / name)
        joined = join_pieces(stash, joins)
        wheels = [stash / n for n in wheel_names(files, joins)]
        expected = set(requirements())
        if {w.name for w in wheels} != expected:
            raise SystemExit(f"manifest wheels differ from {REQUIREMENTS.name}: "
                             f"{sorted({w.name for w in wheels} ^ expected)}")
        with tempfile.TemporaryDirectory() as target:
            subprocess.run([sys.executable, "-m", "pip", "install", "-q", "--dry-run", "--no-index", "--no-deps",
                            "--disable-pip-version-check", "--target", target, *PLATFORM_ARGS, *map(str, wheels)],
                           check=True)
    print(f"ok: {len(files)} files in {len(folders)} folders ({', '.join('.carry/' + f for f in folders)}); "
          f"{', '.join(joined)} rejoined; pip would install the {len(wheels)} wheels for cp312 manylinux")
    return 0


def join_pieces(stash: Path, joins: dict[str, tuple[str, int]]) -> list[str]:
    """Join every split wheel whose pieces are all in `stash` (checked against its sha256); the wheels joined."""
    done = []
    for name, (digest, count) in joins.items():
        whole = stash / name
        if whole.is_file() and sha256(whole) == digest:
            done.append(name)
            continue
        parts = [stash / f"{name}.part-{i:03d}" for i in range(count)]
        if not all(p.is_file() for p in parts):
            continue
        tmp = stash / f"{name}.joining"
        with open(tmp, "wb") as out:
            for p in parts:
                with open(p, "rb") as f:
                    shutil.copyfileobj(f, out, 16 * MiB)
        if sha256(tmp) != digest:
            tmp.unlink()
            raise SystemExit(f"{name}: the joined pieces do not match its sha256 (a piece changed? run check here)")
        tmp.replace(whole)
        done.append(name)
    return done


def install(args) -> int:
    files, joins = read_manifest()
    stash, target = Path(args.stash), Path(args.target)
    stash.mkdir(parents=True, exist_ok=True)
    marker = target / f".vllm-wheels-{sha256(MANIFEST)[:16]}"
    if marker.exists():
        print(f"vllm wheels: already installed in {target}")
        return 0
    for name, (folder, digest) in files.items():
        src, dst = CARRY / folder / name, stash / name
        if dst.is_file() and dst.stat().st_size == (src.stat().st_size if src.is_file() else -1):
            continue
        if src.is_file():
            if sha256(src) != digest:
                raise SystemExit(f"{src}: sha256 differs from {MANIFEST.name} (a partial copy? carry it again)")
            shutil.copyfile(src, stash / f"{name}.copying")
            (stash / f"{name}.copying").replace(dst)  # never a half-copied file under the real name
    have = {name for name, (_, digest) in files.items() if (stash / name).is_file()}
    missing = sorted({folder for name, (folder, _) in files.items() if name not in have},
                     key=lambda f: int(f.removeprefix(PREFIX)))
    print(f"vllm wheels: {len(have)} of {len(files)} carried files stashed in {stash}", flush=True)
    if missing:
        print(f"vllm wheels: carry {', '.join('.carry/' + f for f in missing)} first (one folder per device "
              f"command; the stash keeps what came before while the machine stays warm)", flush=True)
        return 3
    t0 = time.monotonic()
    join_pieces(stash, joins)
    wheels = [str(stash / n) for n in wheel_names(files, joins)]
    target.mkdir(parents=True, exist_ok=True)
    subprocess.run([sys.executable, "-m", "pip", "install", "-q", "--no-index", "--no-deps", "--upgrade",
                    "--no-compile", "--disable-pip-version-check", "--target", str(target), *wheels], check=True)
    marker.write_text("\n".join(Path(w).name for w in wheels) + "\n")
    for p in stash.glob("*.part-*"):  # the joined wheel stays; its pieces are no longer needed
        p.unlink()
    print(f"vllm wheels: installed {len(wheels)} into {target} in {time.monotonic() - t0:.0f} s")
    return 0


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = ap.add_subparsers(dest="cmd", required=True)
    for name, helptext in (("build", "download, strip xgrammar, split vllm, pack .carry/vllm*, write the manifest"),
                           ("check", "verify the packed folders against the manifest (here)")):
        p = sub.add_parser(name, help=helptext)
        p.add_argument("--piece", type=int, default=PIECE, help="bytes per piece of a split wheel")
        p.add_argument("--folder-limit", type=int, default=FOLDER_LIMIT, help="bytes per carried folder")
    ins = sub.add_parser("install", help="(GPU box) stash the carried files; install once all are stashed")
    ins.add_argument("--target", default="/tmp/vsite", help="pip --target directory (put it on PYTHONPATH)")
    ins.add_argument("--stash", default="/tmp/vllm-stash", help="where carried files accumulate across calls")
    args = ap.parse_args(argv)
    return {"build": build, "check": check, "install": install}[args.cmd](args)


if __name__ == "__main__":
    sys.exit(main())
