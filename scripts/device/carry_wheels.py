"""Bring Ray Serve (and the rest of what the service, the load test and the TP benchmark import) to the GPU box,
which has Python 3.12 with torch, triton and numpy but no network and no Ray: wheels, carried in ignored
folders of the working tree, each small enough to travel with one device command (the tree + one folder must
stay under 64 MiB).

    python3 scripts/device/carry_wheels.py build    # download (cp312 manylinux), strip ray, pack .carry/ray*
    python3 scripts/device/carry_wheels.py check    # prove the packed set resolves with no index (pip --dry-run)
    python3 scripts/device/carry_wheels.py install --target /tmp/site   # on the box (scripts/device/_wheels.sh)

`build` writes scripts/device/wheels.txt (folder, group, file, sha256 of every packed wheel). Groups: `core`
(needed by everything) and `plot` (matplotlib, only for drawing PNGs on the box; the JSONs can be drawn here
instead). On the box, one device command carries one folder: `install` stashes the wheels of whatever .carry/ray*
folders the tree has (so calls carrying ray1, then ray2, add up), and once a group's wheels are all stashed it
installs them with one `pip install --no-index --no-deps --target` (a marker makes it a no-op afterwards).
"""
from __future__ import annotations

import argparse
import hashlib
import json
import re
import shutil
import subprocess
import sys
import tempfile
import time
import zipfile
from importlib import metadata
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
CARRY = REPO / ".carry"
DOWNLOAD = CARRY / "_dl"  # everything pip downloads (not carried)
RESOLVE_ONLY = CARRY / "_resolve"  # wheels the box already has, needed only to prove the resolution here
MANIFEST = Path(__file__).resolve().parent / "wheels.txt"
FOLDER_LIMIT = 55 * 2**20

# What `diffkv serve`, loadtest/sweep.py and benchmarks/tensor_parallel.py import, on top of the box's own
# torch / triton / numpy (pyproject.toml's dependencies, plus the load test's httpx and the plot's matplotlib).
# typing_extensions: pydantic needs a newer one than torch may have brought.
CORE = ["ray[serve]", "fastapi", "uvicorn", "starlette", "httpx", "prometheus_client", "tokenizers", "safetensors",
        "jinja2", "pydantic", "gguf", "tqdm", "pyyaml", "typing_extensions"]
PLOT = ["matplotlib"]
ON_THE_BOX = {"numpy", "torch", "triton"}  # preinstalled there; never carried (nvidia-* neither)

PLATFORM_ARGS = ["--only-binary=:all:", "--python-version", "3.12", "--implementation", "cp", "--abi", "cp312",
                 "--abi", "abi3", "--abi", "none"] + [
    a for p in ("manylinux2014_x86_64", "manylinux_2_17_x86_64", "manylinux_2_24_x86_64", "manylinux_2_27_x86_64",
                "manylinux_2_28_x86_64", "any") for a in ("--platform", p)]

# Parts of the ray wheel that `diffkv serve` never touches: the Java jars (ray_dist.jar is 32 MB of the 76),
# source maps, and the dashboard's web UI (only the dashboard head serves it; we start Ray without one, and a
# missing build only logs a warning there).
RAY_STRIP = (re.compile(r"^ray/jars/"), re.compile(r"\.js\.map$"), re.compile(r"^ray/dashboard/client/build/"))


def canonical(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def wheel_name(filename: str) -> str:
    return canonical(filename.split("-")[0])


def pinned(requirements: list[str]) -> list[str]:
    """Pin each requirement to the version installed here (what the tests ran against), when it is installed."""
    out = []
    for req in requirements:
        base = req.split("[")[0]
        try:
            out.append(f"{req}=={metadata.version(base)}")
        except metadata.PackageNotFoundError:
            out.append(req)
    return out


def constraints_file() -> Path:
    """This environment's versions as constraints, so the transitive closure matches what runs here too."""
    lines = []
    for dist in metadata.distributions():
        name = canonical(dist.metadata["Name"] or "")
        if name and name not in ON_THE_BOX and not name.startswith("nvidia-") and name != "diffkv-serve":
            lines.append(f"{name}=={dist.version}")
    path = Path(tempfile.mkstemp(suffix="-constraints.txt")[1])
    path.write_text("\n".join(sorted(set(lines))) + "\n")
    return path


def pip(*args: str) -> subprocess.CompletedProcess:
    cmd = [sys.executable, "-m", "pip", *args]
    print("+", " ".join(cmd), flush=True)
    return subprocess.run(cmd, check=True, text=True, capture_output=True)


def strip_ray(src: Path, dst: Path) -> tuple[int, int]:
    """Copy the ray wheel without RAY_STRIP's files, dropping their RECORD lines so pip installs it as is."""
    removed = 0
    with zipfile.ZipFile(src) as zin, zipfile.ZipFile(dst, "w", zipfile.ZIP_DEFLATED, compresslevel=9) as zout:
        for info in zin.infolist():
            name = info.filename
            if any(p.search(name) for p in RAY_STRIP):
                removed += 1
                continue
            data = zin.read(info)
            if name.endswith(".dist-info/RECORD"):
                keep = [ln for ln in data.decode().splitlines(keepends=True)
                        if not any(p.search(ln.split(",")[0]) for p in RAY_STRIP)]
                data = "".join(keep).encode()
            zout.writestr(info, data)  # the ZipInfo keeps permissions (raylet, gcs_server are executables)
    return removed, dst.stat().st_size


def pack(wheels: list[Path], prefix: str, start: int) -> dict[str, list[Path]]:
    """First-fit decreasing into folders of at most FOLDER_LIMIT bytes: {folder name: wheels}."""
    folders: list[list[Path]] = []
    sizes: list[int] = []
    for w in sorted(wheels, key=lambda p: -p.stat().st_size):
        size = w.stat().st_size
        if size > FOLDER_LIMIT:
            raise SystemExit(f"{w.name} ({size / 2**20:.1f} MiB) alone exceeds a folder's "
                             f"{FOLDER_LIMIT / 2**20:.0f} MiB")
        for i, used in enumerate(sizes):
            if used + size <= FOLDER_LIMIT:
                folders[i].append(w)
                sizes[i] += size
                break
        else:
            folders.append([w])
            sizes.append(size)
    return {f"{prefix}{start + i}": ws for i, ws in enumerate(folders)}


def sha256(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def resolve(requirements: list[str], folders: list[Path]) -> dict[str, str]:
    """{package: wheel file} that pip resolves `requirements` to from `folders` alone (no index), for the box."""
    report = Path(tempfile.mkstemp(suffix="-report.json")[1])
    links = [a for f in folders for a in ("--find-links", str(f))]
    with tempfile.TemporaryDirectory() as target:
        pip("install", "--dry-run", "--no-index", "--ignore-installed", "--target", target, "--report", str(report),
            *links, *PLATFORM_ARGS, *requirements)
    return {canonical(i["metadata"]["name"]): Path(i["download_info"]["url"].removeprefix("file://")).name
            for i in json.loads(report.read_text())["install"]}


def build(_args) -> int:
    DOWNLOAD.mkdir(parents=True, exist_ok=True)
    reqs = pinned(CORE + PLOT)
    pip("download", "-q", "--dest", str(DOWNLOAD), *PLATFORM_ARGS, "-c", str(constraints_file()), *reqs)
    core_names = set(resolve(pinned(CORE), [DOWNLOAD]))  # the plot group: what only matplotlib needs
    # Packages that need no carrying go to the resolve-only folder; the rest are sorted into the groups.
    RESOLVE_ONLY.mkdir(parents=True, exist_ok=True)
    core, plot = [], []
    staging = Path(tempfile.mkdtemp(prefix="carry-"))
    for w in sorted(DOWNLOAD.glob("*.whl")):
        name = wheel_name(w.name)
        if name in ON_THE_BOX or name.startswith("nvidia-"):
            shutil.copy2(w, RESOLVE_ONLY / w.name)
            continue
        if name == "ray":
            out = staging / w.name
            removed, size = strip_ray(w, out)
            print(f"ray: {w.stat().st_size / 2**20:.1f} MiB -> {size / 2**20:.1f} MiB ({removed} files stripped)")
            w = out
        (core if name in core_names else plot).append(w)
    for old in CARRY.glob("ray[0-9]*"):
        shutil.rmtree(old)
    layout = pack(core, "ray", 1)
    layout.update(pack(plot, "ray", len(layout) + 1))
    lines = ["# folder group file sha256 -- written by scripts/device/carry_wheels.py build"]
    for folder, ws in layout.items():
        (CARRY / folder).mkdir(parents=True)
        for w in sorted(ws, key=lambda p: p.name):
            shutil.copy2(w, CARRY / folder / w.name)
            group = "plot" if w in plot else "core"
            lines.append(f"{folder} {group} {w.name} {sha256(w)}")
        total = sum(w.stat().st_size for w in ws)
        print(f".carry/{folder}: {len(ws)} wheels, {total / 2**20:.1f} MiB")
    MANIFEST.write_text("\n".join(lines) + "\n")
    shutil.rmtree(staging)
    print(f"wrote {MANIFEST.relative_to(REPO)}")
    return check(_args)


def read_manifest() -> list[tuple[str, str, str, str]]:
    rows = []
    for ln in MANIFEST.read_text().splitlines():
        if ln.strip() and not ln.startswith("#"):
            folder, group, name, digest = ln.split()
            rows.append((folder, group, name, digest))
    return rows


def check(_args) -> int:
    """Resolve CORE + PLOT with no index from the packed folders (plus the box's own numpy): every requirement
    must resolve, to exactly the packed wheels, and every packed wheel must match the manifest."""
    rows = read_manifest()
    bad = [f"{folder}/{name}" for folder, _, name, digest in rows
           if not (CARRY / folder / name).is_file() or sha256(CARRY / folder / name) != digest]
    if bad:
        raise SystemExit(f"missing or changed wheels: {bad} (run build)")
    for folder in sorted({r[0] for r in rows}):
        size = sum(p.stat().st_size for p in (CARRY / folder).iterdir())
        if size > FOLDER_LIMIT:
            raise SystemExit(f".carry/{folder} is {size / 2**20:.1f} MiB > {FOLDER_LIMIT / 2**20:.0f} MiB")
    for group, reqs in (("core", CORE), ("core+plot", CORE + PLOT)):
        members = [r for r in rows if r[1] in group.split("+")]
        folders = [CARRY / f for f in sorted({r[0] for r in members})]
        resolved = resolve(pinned(reqs), folders + [RESOLVE_ONLY])
        packed = {wheel_name(name): name for _, _, name, _ in members}
        unexpected = sorted(n for n in resolved if n not in packed and n not in ON_THE_BOX)
        unused = sorted(n for n in packed if n not in resolved)
        wrong = sorted(n for n in packed if n in resolved and resolved[n] != packed[n])
        if unexpected or unused or wrong:
            raise SystemExit(f"{group}: resolution differs from the packed set: not packed {unexpected}, packed but "
                             f"unused {unused}, other file {wrong}")
        print(f"ok ({group}): {len(reqs)} requirements resolve with no index from "
              f"{', '.join('.carry/' + f.name for f in folders)} to their {len(members)} wheels "
              f"(+ the box's {', '.join(sorted(n for n in resolved if n in ON_THE_BOX))})")
    return 0


def _install_wheels(wheels: list[Path], target: Path, dry_run: bool = False) -> None:
    """pip when the interpreter has it; else unpack the wheels (what pip does for these: no build step).
    `dry_run`: only let pip check that it would install them on the box (Python 3.12, manylinux)."""
    import importlib.util

    if importlib.util.find_spec("pip") is not None:
        extra = ["--dry-run", *PLATFORM_ARGS] if dry_run else []
        subprocess.run([sys.executable, "-m", "pip", "install", "-q", "--no-index", "--no-deps", "--upgrade",
                        "--no-compile", "--disable-pip-version-check", *extra, "--target", str(target),
                        *map(str, wheels)], check=True)
        return
    if dry_run:
        raise SystemExit("--dry-run needs pip")
    print("no pip here: unpacking the wheels", flush=True)
    for w in wheels:
        with zipfile.ZipFile(w) as z:
            for info in z.infolist():
                parts = info.filename.split("/")
                if parts[0].endswith(".data"):  # purelib / platlib go to the top; scripts to bin/; data and headers
                    if len(parts) < 3 or parts[1] not in ("purelib", "platlib", "scripts"):  # are not needed
                        continue
                    dest = target / ("bin" if parts[1] == "scripts" else "") / "/".join(parts[2:])
                else:
                    dest = target / info.filename
                if info.is_dir():
                    continue
                dest.parent.mkdir(parents=True, exist_ok=True)
                dest.write_bytes(z.read(info))
                mode = (info.external_attr >> 16) & 0o777
                if mode:
                    dest.chmod(mode)  # raylet and gcs_server must stay executable


def install(args) -> int:
    """Stash the carried wheels; install each requested group once all its wheels are stashed. Exit 3 (with the
    folders still to carry) when a required group is incomplete."""
    rows = read_manifest()
    stash, target = Path(args.stash), Path(args.target)
    stash.mkdir(parents=True, exist_ok=True)
    for folder, _, name, digest in rows:
        src, dst = CARRY / folder / name, stash / name
        if src.is_file() and not (dst.is_file() and dst.stat().st_size == src.stat().st_size):
            if sha256(src) != digest:
                raise SystemExit(f"{src}: sha256 differs from wheels.txt (a partial copy? carry it again)")
            shutil.copyfile(src, dst)
    manifest_id = hashlib.sha256(MANIFEST.read_bytes()).hexdigest()[:16]
    status = 0
    for group in args.groups.split(","):
        members = [r for r in rows if r[1] == group]
        if not members:
            raise SystemExit(f"no wheels of group {group!r} in {MANIFEST.name}")
        marker = target / f".diffkv-wheels-{group}-{manifest_id}"
        if marker.exists():
            print(f"wheels ({group}): already installed in {target}")
            continue
        for _, _, name, digest in members:  # a stashed copy cut short (a command killed mid-copy) is dropped
            if (stash / name).is_file() and sha256(stash / name) != digest:
                (stash / name).unlink()
        missing = sorted({folder for folder, _, name, _ in members if not (stash / name).is_file()})
        if missing:
            optional = group in args.optional.split(",")
            folders = ", ".join(".carry/" + f for f in missing)
            print(f"wheels ({group}): {'skipped, ' if optional else ''}carry {folders} "
                  f"first (each in its own device command; the stash {stash} keeps what came before)", flush=True)
            status = status if optional else 3
            continue
        t0 = time.monotonic()
        target.mkdir(parents=True, exist_ok=True)
        _install_wheels([stash / name for _, _, name, _ in members], target, args.dry_run)
        if args.dry_run:
            print(f"wheels ({group}): pip would install the {len(members)} wheels (dry run)")
            continue
        marker.write_text("\n".join(name for _, _, name, _ in members) + "\n")
        print(f"wheels ({group}): installed {len(members)} into {target} in {time.monotonic() - t0:.0f} s")
    return status


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = ap.add_subparsers(dest="cmd", required=True)
    sub.add_parser("build", help="download, strip ray, pack .carry/ray*, write wheels.txt, then check")
    sub.add_parser("check", help="prove the packed wheels resolve with no index")
    ins = sub.add_parser("install", help="(GPU box) stash the carried wheels, install complete groups")
    ins.add_argument("--target", default="/tmp/site", help="pip --target directory (put it on PYTHONPATH)")
    ins.add_argument("--stash", default="/tmp/diffkv-wheels", help="where carried wheels accumulate across calls")
    ins.add_argument("--groups", default="core", help="comma-separated groups to install (core, plot)")
    ins.add_argument("--optional", default="plot", help="groups whose missing wheels are not an error")
    ins.add_argument("--dry-run", action="store_true", help="(here) pip checks the install for Python 3.12 only")
    args = ap.parse_args(argv)
    return {"build": build, "check": check, "install": install}[args.cmd](args)


if __name__ == "__main__":
    sys.exit(main())
