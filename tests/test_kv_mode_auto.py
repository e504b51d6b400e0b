"""kv_mode 'auto' (the default): the engine resolves it once, from the model's settings file, to the mode measured
best for that model, or to fp16; everything after that sees the resolved mode."""
import json
import logging
from pathlib import Path

import pytest

from diffkv_serve.engine import CacheConfig, EngineConfig
from diffkv_serve.engine.llm_engine import LLMEngine
from diffkv_serve.engine.devices import on_cpu
from diffkv_serve.engine.model_settings import load_model_settings, resolve_kv_mode
from diffkv_serve.service.protocol import ModelCard

SMOLLM = "SmolLM2-135M-Instruct-Q4_1"  # the embedded model; its settings file names a kv_mode
GPU = {"device": "cuda"}  # the measured modes are GPU measurements (resolving one needs no GPU here)


def _write_settings(directory, name, **fields):
    path = directory / f"{name.lower()}.json"
    path.write_text(json.dumps({"model": name, "alpha_high": 1.0, "alpha_low": 0.02, **fields}))
    return path


def test_auto_is_the_default_and_is_not_a_resolved_mode():
    cache = CacheConfig()
    assert cache.kv_mode == "auto"
    with pytest.raises(ValueError, match="'auto' is not resolved"):
        cache.describe()


def test_auto_resolves_to_the_settings_files_mode(tmp_path):
    _write_settings(tmp_path, "Some-Model", kv_mode="int4")
    _write_settings(tmp_path, "Other-Model")  # calibrated, but no measured mode
    assert resolve_kv_mode(EngineConfig(**GPU), "Some-Model", tmp_path).cache.kv_mode == "int4"
    assert resolve_kv_mode(EngineConfig(**GPU), "Other-Model", tmp_path).cache.kv_mode == "fp16"
    assert resolve_kv_mode(EngineConfig(**GPU), "Unknown-Model", tmp_path).cache.kv_mode == "fp16"
    # the settings the user gave survive the resolution (and stay the only ones set)
    cache = resolve_kv_mode(EngineConfig(**GPU, cache={"num_pages": 64}), "Some-Model", tmp_path).cache
    assert cache.num_pages == 64 and cache.model_fields_set == {"num_pages", "kv_mode"}


def test_explicit_kv_mode_overrides_auto(tmp_path):
    _write_settings(tmp_path, "Some-Model", kv_mode="int4")
    cfg = EngineConfig(cache={"kv_mode": "int8"})
    assert resolve_kv_mode(cfg, "Some-Model", tmp_path) is cfg
    engine = LLMEngine(EngineConfig(device="cpu", cache={"kv_mode": "int8", "num_pages": 64}))
    assert engine.config.cache.describe()["kv_mode"] == "int8"


def test_invalid_kv_mode_in_a_settings_file_names_the_file_and_field(tmp_path):
    path = _write_settings(tmp_path, "Some-Model", kv_mode="int3")
    with pytest.raises(ValueError) as e:
        resolve_kv_mode(EngineConfig(**GPU), "Some-Model", tmp_path)
    assert str(path) in str(e.value) and "kv_mode='int3'" in str(e.value)


def test_auto_falls_back_to_fp16_where_the_mode_does_not_run(tmp_path, monkeypatch, caplog):
    from diffkv_serve.engine import model_settings

    _write_settings(tmp_path, "Some-Model", kv_mode="fp8")
    monkeypatch.setattr(model_settings, "unsupported_reason", lambda mode, device: f"{mode} needs sm_89")
    with caplog.at_level(logging.WARNING, logger=model_settings.__name__):
        cfg = resolve_kv_mode(EngineConfig(**GPU), "Some-Model", tmp_path)
    assert cfg.cache.kv_mode == "fp16"
    assert "measured mode fp8 does not run on this device (fp8 needs sm_89)" in caplog.text


def test_auto_on_the_cpu_is_fp16(tmp_path):
    """On the CPU quantized pages run through the torch references, slower per step than 16 bits: auto takes fp16
    there whatever the model's (GPU-measured) mode."""
    _write_settings(tmp_path, "Some-Model", kv_mode="int4")
    for device in ("cpu", "auto"):
        cfg = EngineConfig(device=device)
        if device == "auto" and not on_cpu("auto"):
            continue  # a visible GPU: 'auto' is not the CPU here
        assert resolve_kv_mode(cfg, "Some-Model", tmp_path).cache.kv_mode == "fp16"


def test_resolved_mode_that_contradicts_given_settings_says_so(tmp_path):
    _write_settings(tmp_path, "Some-Model", kv_mode="diffkv")
    cfg = EngineConfig(cache={"policy": "budget", "enable_prefix_caching": True})
    with pytest.raises(ValueError, match="kv_mode 'auto' resolved to 'diffkv'.*set kv_mode explicitly"):
        resolve_kv_mode(cfg.model_copy(update={"device": "cuda"}), "Some-Model", tmp_path)


def test_engine_card_and_stats_show_the_resolved_mode(monkeypatch):
    """The embedded model runs its measured mode (as it would on a GPU); a random-weight model (no settings file)
    runs fp16. The model card is built as EngineReplica.kv_cache_card builds it."""
    from diffkv_serve.engine import model_settings

    monkeypatch.setattr(model_settings, "on_cpu", lambda device: False)
    measured = load_model_settings(SMOLLM)["kv_mode"]
    for model, expected in [(None, measured), ("random:tiny", "fp16")]:
        engine = LLMEngine(EngineConfig(model=model, device="cpu", cache={"num_pages": 64}))
        assert engine.config.cache.kv_mode == expected
        assert engine.stats()["kv_mode"] == expected
        card = ModelCard(id="m", created=0, diffkv={**engine.config.cache.describe(),
                                                   "cache_dtype": engine.cache_dtype}).model_dump()
        assert card["diffkv"]["kv_mode"] == expected


def test_shipped_settings_name_a_mode_with_its_evidence():
    for name in (SMOLLM, "Qwen2.5-Coder-1.5B-Instruct-Q4_K_M"):
        settings = load_model_settings(name)
        evidence = settings["kv_mode_evidence"]
        assert settings["kv_mode"] in ("fp16", "int8", "int4", "fp8", "diffkv")
        assert {"rule", "gpu", "date", "files"} <= set(evidence)
        root = Path(__file__).resolve().parents[1]
        missing = [f for f in evidence["files"] if not (root / f).is_file()]
        assert not missing, f"{name}: evidence files not in the repository: {missing}"
