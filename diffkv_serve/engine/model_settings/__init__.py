"""Per-model DiffKV settings written by `python3 -m evals.cli calibrate` (one JSON file per model, shipped with the
package): the engine uses a model's calibrated alpha_high / alpha_low whenever the user did not set them.

A file `<model id>.json` holds {"model": <checkpoint name>, "alpha_high": .., "alpha_low": .., "calibration":
{how they were chosen}} and, when calibration had to change it, "low" (the low precision, e.g. "K8V4" =
the high one: low precision off, tokens are kept high or pruned, for models that 4-bit keys break); the
model id is the loaded checkpoint's name, lower-cased. `python3 -m evals.cli calibrate
--per-layer` adds "layer_alpha_scale" (one multiplier of both alphas per layer) and "layer_budget" (how).
"key_center" ([layers][kv_heads][head_dim], the mean post-RoPE key that calibration measured) is what
engine.key_centering subtracts from keys before quantizing them; "default_choice", when present, records why the
shipped thresholds / precisions differ from the calibration's pick. "kv_mode" is the mode kv_mode 'auto' runs for
this model: the fastest one whose task accuracy measured within a point of fp16's (paired 95% interval's lower end
>= -2 points) and whose teacher-forced fidelity held; "kv_mode_evidence" holds those numbers, their files, GPU and
date. A model without the entry (or without a file) runs fp16 under 'auto'.
"""
from __future__ import annotations

import json
import logging
from pathlib import Path
from typing import Optional

from diffkv_serve.engine.config import KV_MODES, CacheConfig, EngineConfig, parse_precision
from diffkv_serve.engine.devices import on_cpu
from diffkv_serve.engine.kv_mode_support import unsupported_reason

log = logging.getLogger(__name__)

SETTINGS_DIR = Path(__file__).parent
THRESHOLDS = ("alpha_high", "alpha_low")
PRECISIONS = ("high", "low")  # optional in a settings file; applied with the thresholds they were calibrated for
LAYER_SCALE = "layer_alpha_scale"
KV_MODE = "kv_mode"  # optional: the measured best mode, what kv_mode 'auto' resolves to


def model_id(model_name: str) -> str:
    return model_name.strip().lower()


def settings_path(model_name: str, directory: Path = SETTINGS_DIR) -> Path:
    return directory / f"{model_id(model_name)}.json"


def load_model_settings(model_name: str, directory: Path = SETTINGS_DIR) -> Optional[dict]:
    """The model's settings, or None if it was never calibrated. A damaged file is an error, not a default."""
    path = settings_path(model_name, directory)
    if not path.is_file():
        return None
    try:
        settings = json.loads(path.read_text())
        for k in THRESHOLDS:
            if not isinstance(settings[k], (int, float)) or settings[k] < 0:
                raise ValueError(f"{k} must be a number >= 0")
        for k in PRECISIONS:
            if k in settings:
                parse_precision(settings[k], k)
        scale = settings.get(LAYER_SCALE)
        if scale is not None and (not isinstance(scale, list) or not scale or
                                  not all(isinstance(x, (int, float)) and x > 0 for x in scale)):
            raise ValueError(f"{LAYER_SCALE} must be a list of numbers > 0")
        if KV_MODE in settings and settings[KV_MODE] not in KV_MODES:
            raise ValueError(f"{KV_MODE}={settings[KV_MODE]!r} must be one of {', '.join(KV_MODES)}")
    except (ValueError, KeyError) as e:
        raise ValueError(f"{path}: damaged model settings ({e}); rerun `python3 -m evals.cli calibrate` or "
                         f"delete it") from e
    return settings


def resolve_kv_mode(config: EngineConfig, model_name: str, directory: Path = SETTINGS_DIR) -> EngineConfig:
    """The config with kv_mode 'auto' replaced by the model's measured mode (its settings file's "kv_mode"), or
    fp16 on the CPU, for a model without one, or where that mode does not run on the config's device (logged). An
    explicit kv_mode is returned as it is."""
    cache = config.cache
    if cache.kv_mode != "auto":
        return config
    settings = load_model_settings(model_name, directory)
    mode, source = "fp16", f"{model_name} has no measured kv_mode"
    if on_cpu(config.device):
        # The measured modes are GPU measurements. On the CPU quantized pages run through the torch references
        # and a step costs more than at 16 bits (SmolLM2, 8 x 64 tokens: fp16 84, fp8 70, int4 73 tokens/s).
        source = "the CPU: its fastest mode"
    elif settings and KV_MODE in settings:
        mode, source = settings[KV_MODE], f"measured, {settings_path(model_name, directory)}"
        reason = unsupported_reason(mode, config.device)
        if reason:
            log.warning("kv_mode auto: %s's measured mode %s does not run on this device (%s); using fp16",
                        model_name, mode, reason)
            mode, source = "fp16", f"{settings[KV_MODE]} does not run here"
    log.info("kv_mode auto -> %s (%s)", mode, source)
    try:
        new_cache = CacheConfig(**{**cache.model_dump(include=cache.model_fields_set), "kv_mode": mode})
        return EngineConfig(**{**config.model_dump(include=config.model_fields_set - {"cache"}),
                               "cache": new_cache, "scheduler": config.scheduler})
    except ValueError as e:
        raise ValueError(f"cache.kv_mode 'auto' resolved to {mode!r} ({source}), which does not fit the other "
                         f"settings; set kv_mode explicitly: {e}") from e


def apply_model_settings(config: EngineConfig, model_name: str, directory: Path = SETTINGS_DIR) -> EngineConfig:
    """The config with kv_mode 'auto' resolved (resolve_kv_mode) and the model's calibrated thresholds (and
    per-layer multipliers and precisions, if the file has them) in place of the defaults the user left unset."""
    config = resolve_kv_mode(config, model_name, directory)
    cache = config.cache
    if cache.kv_mode != "diffkv" or cache.policy != "thresholds":
        return config
    unset = [k for k in THRESHOLDS if k not in cache.model_fields_set]
    scale_unset = LAYER_SCALE not in cache.model_fields_set
    precisions_unset = [k for k in PRECISIONS if k not in cache.model_fields_set]
    settings = load_model_settings(model_name, directory) if unset or scale_unset or precisions_unset else None
    if not settings:
        return config
    values = {**cache.model_dump(include=cache.model_fields_set), **{k: float(settings[k]) for k in unset}}
    values.update({k: settings[k] for k in precisions_unset if k in settings})
    if scale_unset and settings.get(LAYER_SCALE) is not None:
        values[LAYER_SCALE] = [float(x) for x in settings[LAYER_SCALE]]
    try:
        new_cache = CacheConfig(**values)
    except ValueError as e:
        raise ValueError(f"cache: your {', '.join(sorted(cache.model_fields_set & set(THRESHOLDS)))} and "
                         f"{model_name}'s calibrated {', '.join(unset)} ({settings_path(model_name, directory)}) "
                         f"do not fit together; set both alphas: {e}") from e
    return config.model_copy(update={"cache": new_cache})
