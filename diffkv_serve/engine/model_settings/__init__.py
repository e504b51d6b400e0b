"""Per-model DiffKV settings written by `python3 -m evals.cli calibrate` (one JSON file per model, shipped with the
package): the engine uses a model's calibrated alpha_high / alpha_low whenever the user did not set them.

A file `<model id>.json` holds {"model": <checkpoint name>, "alpha_high": .., "alpha_low": .., "calibration":
{how they were chosen}} and, when calibration had to change it, "low" (the low precision, e.g. "K8V4" =
the high one: low precision off, tokens are kept high or pruned, for models that 4-bit keys break); the
model id is the loaded checkpoint's name, lower-cased. `python3 -m evals.cli calibrate
--per-layer` adds "layer_alpha_scale" (one multiplier of both alphas per layer) and "layer_budget" (how).
"key_center" ([layers][kv_heads][head_dim], the mean post-RoPE key that calibration measured) is what
engine.key_centering subtracts from keys before quantizing them; "default_choice", when present, records why the
shipped thresholds / precisions differ from the calibration's pick.
"""
from __future__ import annotations

import json
from pathlib import Path
from typing import Optional

from diffkv_serve.engine.config import CacheConfig, EngineConfig, parse_precision

SETTINGS_DIR = Path(__file__).parent
THRESHOLDS = ("alpha_high", "alpha_low")
PRECISIONS = ("high", "low")  # optional in a settings file; applied with the thresholds they were calibrated for
LAYER_SCALE = "layer_alpha_scale"


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
    except (ValueError, KeyError) as e:
        raise ValueError(f"{path}: damaged model settings ({e}); rerun `python3 -m evals.cli calibrate` or "
                         f"delete it") from e
    return settings


def apply_model_settings(config: EngineConfig, model_name: str, directory: Path = SETTINGS_DIR) -> EngineConfig:
    """The config with the model's calibrated thresholds (and per-layer multipliers and precisions, if the file
    has them) in place of the defaults the user left unset."""
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
