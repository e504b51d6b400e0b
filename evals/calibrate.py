"""Per-model calibration of alpha_high / alpha_low (paper §7.2) on the `calib` split, disjoint from the
evaluation: sweep alpha_high over 0..5 with alpha_low = 0, fix the chosen alpha_high, then sweep alpha_low
over 0..0.1, and write the result where the engine finds it (engine/model_settings/<model id>.json).

The paper picks the value with the best calibration accuracy. With the few hundred calibration problems a
small model affords, accuracy cannot separate neighbouring values, so each stage scores a value by its
teacher-forced top-1 agreement with the fp16 cache over long generations (and records task accuracy when
problems are given), and picks the most compressive value whose agreement is within `tolerance` of the
stage's best (larger alphas keep fewer tokens high / low).
"""
from __future__ import annotations

import json
import time
from pathlib import Path

from tqdm.auto import tqdm

from engine.model_settings import SETTINGS_DIR, settings_path
from evals.configs import diffkv_config
from evals.harness import evaluate_config

ALPHA_HIGH_GRID = (0.0, 1.0, 2.0, 3.0, 4.0, 5.0)
ALPHA_LOW_GRID = (0.0, 0.02, 0.04, 0.06, 0.08, 0.1)


def _point(model, ah, al, prompts, refs, problems, max_tokens) -> dict:
    r = evaluate_config(model, diffkv_config(ah, al, name=f"calib-ah{ah:g}-al{al:g}"), problems, prompts, refs,
                        max_tokens)
    f = r["fidelity"]
    point = {"alpha_high": ah, "alpha_low": al, "top1_agreement": f["top1_agreement"], "nll": f["nll"],
             "memory_fraction": f["memory_fraction"], "token_fractions": f["token_fractions"]}
    if "tasks" in r:
        point["accuracy"] = {t: v["accuracy"] for t, v in r["tasks"].items()}
    return point


def _pick(points: list[dict], key: str, tolerance: float) -> dict:
    best = max(p["top1_agreement"] for p in points)
    ok = [p for p in points if p["top1_agreement"] >= best - tolerance]
    return max(ok, key=lambda p: p[key])


def calibrate(model, prompts, refs, problems=(), max_tokens=None, tolerance: float = 0.01,
              alpha_high_grid=ALPHA_HIGH_GRID, alpha_low_grid=ALPHA_LOW_GRID) -> dict:
    if not refs:
        raise ValueError("calibrate: needs fp16 reference generations of the calibration prompts")
    t0 = time.perf_counter()
    stage1 = [_point(model, ah, 0.0, prompts, refs, problems, max_tokens)
              for ah in tqdm(alpha_high_grid, desc="calibrate alpha_high")]
    ah = _pick(stage1, "alpha_high", tolerance)["alpha_high"]
    lows = [al for al in alpha_low_grid if al <= ah]
    stage2 = [next(p for p in stage1 if p["alpha_high"] == ah)]  # alpha_low = 0 was measured in stage 1
    stage2 += [_point(model, ah, al, prompts, refs, problems, max_tokens)
               for al in tqdm([a for a in lows if a > 0], desc="calibrate alpha_low")]
    chosen = _pick(stage2, "alpha_low", tolerance)
    return {
        "model": model.name, "alpha_high": chosen["alpha_high"], "alpha_low": chosen["alpha_low"],
        "calibration": {
            "split": "calib", "criterion": f"most compressive value within {tolerance} top-1 agreement of the "
                                           "stage's best (teacher forcing vs the fp16 cache)",
            "tolerance": tolerance, "generations": len(refs), "gen_tokens": len(refs[0]),
            "problems": len(problems), "chosen": chosen, "sweep_alpha_high": stage1, "sweep_alpha_low": stage2,
            "seconds": time.perf_counter() - t0,
        },
    }


def write_settings(result: dict, directory: Path = SETTINGS_DIR) -> Path:
    path = settings_path(result["model"], directory)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(result, indent=1) + "\n")
    return path
