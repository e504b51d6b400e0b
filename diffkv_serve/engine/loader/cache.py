"""Where converted checkpoints live, and crash-safe writes into it."""
from __future__ import annotations

import hashlib
import json
import os
import tempfile
from pathlib import Path
from typing import Callable


def cache_dir() -> Path:
    """`$DIFFKV_CACHE_DIR`, else `~/.cache/diffkv` (read on every call so tests can monkeypatch it)."""
    env = os.environ.get("DIFFKV_CACHE_DIR")
    return Path(env).expanduser() if env else Path.home() / ".cache" / "diffkv"


def file_identity(path: Path) -> dict:
    """Cheap identity of a file: if any of these change we treat the file as a different file."""
    st = path.stat()
    return {"path": str(path.resolve()), "size": st.st_size, "mtime_ns": st.st_mtime_ns}


def identity_key(identity: dict) -> str:
    return hashlib.sha256(json.dumps(identity, sort_keys=True).encode()).hexdigest()[:16]


def sha256_file(path: Path, chunk: int = 1 << 22) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while block := f.read(chunk):
            h.update(block)
    return h.hexdigest()


def atomic_write(path: Path, write: Callable[[Path], None]) -> None:
    """Call `write(tmp)` on a temp file in the same directory, then rename it over `path`, so readers
    never see a half-written file (even if we crash or another process writes concurrently)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    os.close(fd)
    try:
        write(Path(tmp))
        os.chmod(tmp, 0o644)  # mkstemp makes 0600; cache files are meant to be shareable
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def atomic_write_text(path: Path, text: str) -> None:
    atomic_write(path, lambda p: p.write_text(text, encoding="utf-8"))
