"""Task accuracy of a KV configuration as the accuracy study measured it (evals/results/<model>/summary.json),
for benchmarks that report speed at accuracy.

A benchmark mode names the study configuration it corresponds to; the lookup also checks that the study ran
that configuration with the settings the benchmark's engine runs (a recalibrated default or another model's
study would otherwise lend its number to a different cache), and says why when it reports nothing.
"""
from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Optional

ROOT = Path(__file__).resolve().parents[1]
STUDY_RESULTS = ROOT / "evals" / "results"
NOT_MEASURED = "not measured"
# Cache fields that decide how a diffkv cache keeps tokens; single-precision modes are decided by the first two.
_MODE_FIELDS = ("kv_mode", "key_centering")
_DIFFKV_FIELDS = ("high", "low", "alpha_high", "alpha_low", "window", "significance_queries", "policy", "budget",
                  "layer_alpha_scale")


def find_study(model_name: str, results: Path = STUDY_RESULTS) -> Optional[Path]:
    """The committed study summary whose model is `model_name`, or None."""
    for path in sorted(results.glob("*/summary.json")):
        try:
            if json.loads(path.read_text()).get("model") == model_name:
                return path
        except (OSError, ValueError):
            continue  # an unreadable summary is no study of this model
    return None


def load_study(path: Path) -> dict:
    """A study summary, with a ValueError naming the file when it lacks what the lookup reads."""
    try:
        summary = json.loads(Path(path).read_text())
    except (OSError, ValueError) as e:
        raise ValueError(f"--study {path}: not a readable JSON study summary ({e})") from e
    if not isinstance(summary.get("configs"), dict) or not isinstance(summary.get("model"), str):
        raise ValueError(f"--study {path}: expected a study summary with 'model' and 'configs'")
    return summary


def _settings_differ(study_cache: dict, engine_cache: dict) -> list[str]:
    fields = _MODE_FIELDS + (_DIFFKV_FIELDS if engine_cache.get("kv_mode") == "diffkv" else ())
    return [f for f in fields if study_cache.get(f) != engine_cache.get(f)]


def accuracy_vs_fp16(summary: Optional[dict], model_name: str, config_name: str, engine_cache: dict,
                     task: str) -> dict[str, Any]:
    """{'study_config', 'diff_points', 'ci95_points', 'n', 'accuracy'} of `config_name` on `task`, or
    {'study_config', 'diff_points': None, 'why'} when the study has no such measurement for this cache."""
    out: dict[str, Any] = {"study_config": config_name, "diff_points": None, "ci95_points": None, "n": None}
    if summary is None:
        return {**out, "why": f"{NOT_MEASURED}: no accuracy study of {model_name}"}
    if summary["model"] != model_name:
        return {**out, "why": f"{NOT_MEASURED}: the study is of {summary['model']}, not {model_name}"}
    cfg = summary["configs"].get(config_name)
    if cfg is None:
        return {**out, "why": f"{NOT_MEASURED}: the study has no {config_name!r} configuration"}
    differ = _settings_differ(cfg.get("cache", {}), engine_cache)
    if differ:
        ran = ", ".join(f"{f}={cfg.get('cache', {}).get(f)!r}" for f in differ)
        return {**out, "why": f"{NOT_MEASURED}: the study's {config_name!r} ran {ran}"}
    t = cfg.get("tasks", {}).get(task)
    if not t or t.get("diff_vs_fp16_points") is None:
        return {**out, "why": f"{NOT_MEASURED}: the study's {config_name!r} has no {task} accuracy"}
    return {**out, "diff_points": t["diff_vs_fp16_points"], "ci95_points": list(t["diff_ci95_points"]),
            "n": t["n"], "accuracy": t["accuracy"]}


def fastest_within(rows: list[dict], points: float, speed_key: str = "tokens_per_s") -> Optional[dict]:
    """The fastest row whose accuracy is at most `points` below fp16's (measured rows with a speed only)."""
    ok = [r for r in rows if r.get(speed_key) and r["accuracy"]["diff_points"] is not None
          and r["accuracy"]["diff_points"] >= -points]
    return max(ok, key=lambda r: r[speed_key], default=None)
