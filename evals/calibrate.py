"""Per-model calibration of alpha_high / alpha_low (paper §7.2) on the `calib` split, disjoint from the
evaluation: sweep alpha_high over 0..5 with alpha_low = 0, fix the chosen alpha_high, then sweep alpha_low
over 0..0.1, and write the result where the engine finds it (diffkv_serve/engine/model_settings/<model id>.json).

As in the paper, alpha_high is chosen among 1..5 (alpha_high = 0 keeps every token high: it is measured as
the uncompressed reference of the sweep, not a candidate) and alpha_low among 0..0.1. The paper picks the
value with the best calibration accuracy; with the few hundred calibration problems a small model affords,
accuracy cannot separate neighbouring values, so each value is scored by its teacher-forced top-1 agreement
with the fp16 cache over long generations (task accuracy is recorded when problems are given), and the
most compressive value within `tolerance` of the best candidate wins (larger alphas keep fewer tokens high /
low). A stage's points run as one batch of one engine, each request with its own thresholds (the engine's
per-request kv_compression); points already measured (`measured`, e.g. from an interrupted run) are reused.
"""
from __future__ import annotations

import json
import time
from contextlib import ExitStack
from pathlib import Path

from diffkv_serve.engine.config import CacheConfig
from diffkv_serve.engine.model_settings import SETTINGS_DIR, settings_path
from evals.fidelity import score_fidelity, teacher_forced_requests
from evals.harness import DEFAULT_MAX_TOKENS
from evals.runner import run_requests
from evals.tasks import score_tasks, task_requests

ALPHA_HIGH_GRID = (0.0, 1.0, 2.0, 3.0, 4.0, 5.0)
ALPHA_LOW_GRID = (0.0, 0.02, 0.04, 0.06, 0.08, 0.1)
LOW_OFF_MARGIN = 0.05  # top-1 agreement lost by every alpha_high candidate that turns low precision off


def _sweep(model, eng, points: list[tuple[float, float]], prompts, refs, problems, max_tokens, desc) -> list[dict]:
    """All sweep points in one batch of one engine: each request carries its point's thresholds."""
    reqs, spans = [], []
    for ah, al in points:
        kv = {"alpha_high": ah, "alpha_low": al}
        fid = teacher_forced_requests(prompts, refs, kv)
        tasks = task_requests(model, problems, {**DEFAULT_MAX_TOKENS, **(max_tokens or {})}, kv) if problems else []
        spans.append((len(reqs), len(fid), len(tasks)))
        reqs += fid + tasks
    outs = run_requests(eng, reqs, desc)
    result = []
    for (ah, al), (start, n_fid, n_tasks) in zip(points, spans):
        cache = eng.config.cache.model_copy(update={"alpha_high": ah, "alpha_low": al})
        f = score_fidelity(cache, model.head_dim, refs, outs[start:start + n_fid], desc)
        point = {"alpha_high": ah, "alpha_low": al, "top1_agreement": f["top1_agreement"], "nll": f["nll"],
                 "memory_fraction": f["memory_fraction"], "token_fractions": f["token_fractions"]}
        if n_tasks:
            t = score_tasks(cache, model.head_dim, problems, outs[start + n_fid:start + n_fid + n_tasks])
            point["accuracy"] = {k: v["accuracy"] for k, v in t.items()}
        result.append(point)
    return result


def _pick(points: list[dict], key: str, tolerance: float) -> dict:
    best = max(p["top1_agreement"] for p in points)
    ok = [p for p in points if p["top1_agreement"] >= best - tolerance]
    return max(ok, key=lambda p: p[key])


def measured_points(calibration: dict) -> dict:
    """(alpha_high, alpha_low[, low precision if not the default]) -> point of a recorded calibration result (to
    resume without re-measuring)."""
    c = calibration.get("calibration", {})
    off = calibration.get("low") if c.get("low_precision_off") else None
    points = {(p["alpha_high"], p["alpha_low"]): p for p in c.get("sweep_alpha_high", [])}
    for p in c.get("sweep_alpha_low", []):
        points[(p["alpha_high"], p["alpha_low"]) + ((off,) if off else ())] = p
    return points


def calibrate(model, prompts, refs, problems=(), max_tokens=None, tolerance: float = 0.01,
              alpha_high_grid=ALPHA_HIGH_GRID, alpha_low_grid=ALPHA_LOW_GRID, measured: dict | None = None) -> dict:
    if not refs:
        raise ValueError("calibrate: needs fp16 reference generations of the calibration prompts")
    if not any(a > 0 for a in alpha_high_grid):
        raise ValueError("calibrate: alpha_high_grid needs a candidate > 0")
    t0 = time.perf_counter()
    prompts, refs, problems = list(prompts), list(refs), list(problems)
    measured = dict(measured or {})

    high, default_low = CacheConfig().high, CacheConfig().low
    low = default_low
    with ExitStack() as stack:
        engines = {}  # per low precision, built on first use: a resumed calibration may have nothing to measure

        def sweep(points, desc, low_precision=default_low):
            key = (lambda pt: pt) if low_precision == default_low else (lambda pt: (*pt, low_precision))
            todo = [pt for pt in points if key(pt) not in measured]
            if todo:
                if low_precision not in engines:  # thresholds per request, precisions per engine
                    engines[low_precision] = stack.enter_context(
                        model.engine({"kv_mode": "diffkv", "high": high, "low": low_precision}))
                points_done = _sweep(model, engines[low_precision], todo, prompts, refs, problems, max_tokens, desc)
                measured.update(zip(map(key, todo), points_done))
            return [measured[key(pt)] for pt in points]

        stage1 = sweep([(ah, 0.0) for ah in alpha_high_grid], "calibrate alpha_high")
        candidates = [p for p in stage1 if p["alpha_high"] > 0]
        all_high = [p for p in stage1 if p["alpha_high"] == 0]
        low_off = bool(all_high) and (max(p["top1_agreement"] for p in candidates)
                                      < all_high[0]["top1_agreement"] - LOW_OFF_MARGIN)
        if low_off:
            # Every threshold loses far more than the tolerance against keeping all tokens high: the low
            # precision itself breaks this model (the paper's Qwen2.5-7B, 4-bit keys, §7.2). Turn it off (low =
            # high: tokens are kept high or pruned) and calibrate the pruning threshold alone; alpha_low = 0
            # (nothing pruned) is the stage's uncompressed reference, not a candidate, as alpha_high = 0 above.
            low = high
            stage2 = sweep([(al, al) for al in alpha_low_grid], "calibrate alpha_low (low precision off)", low)
            chosen = _pick([p for p in stage2 if p["alpha_low"] > 0], "alpha_low", tolerance)
        else:
            ah = _pick(candidates, "alpha_high", tolerance)["alpha_high"]
            stage2 = sweep([(ah, al) for al in alpha_low_grid if al <= ah], "calibrate alpha_low")
            chosen = _pick(stage2, "alpha_low", tolerance)
    result = {
        "model": model.name, "alpha_high": chosen["alpha_high"], "alpha_low": chosen["alpha_low"],
        "calibration": {
            "split": "calib", "criterion": f"alpha_high in 1..5, then alpha_low in 0..0.1: the most compressive "
                                           f"value within {tolerance} top-1 agreement of the stage's best candidate "
                                           "(teacher forcing vs the fp16 cache); if every alpha_high candidate is "
                                           f"more than {LOW_OFF_MARGIN} below keeping all tokens high, low "
                                           "precision is turned off and alpha_low (= alpha_high) only prunes",
            "tolerance": tolerance, "generations": len(refs), "gen_tokens": len(refs[0]),
            "problems": len(problems), "chosen": chosen, "sweep_alpha_high": stage1, "sweep_alpha_low": stage2,
            "low_precision_off": low_off, "seconds": time.perf_counter() - t0,
        },
    }
    if low_off:
        result["low"] = low
    return result


def calibrate_layers(model, prompts, refs, alpha_high: float) -> dict:
    """Per-layer budgets (XKV): multipliers of the alphas from the significance profile of the calibration
    sequences, each prompt with its fp16 continuation (what generation attends to). Settings-file fields."""
    from evals.layer_budget import plan_layer_budgets
    from evals.layer_profile import profile_significance

    prof = profile_significance(model, [list(p) + list(r) for p, r in zip(prompts, refs)])
    budget = plan_layer_budgets(prof.importance, prof.values, alpha_high)
    return {"layer_alpha_scale": budget.scale,
            "layer_budget": {**budget.summary(), "split": "calib", "sequences": len(prompts),
                             "gen_tokens": len(refs[0]) if refs else 0, "tokens_outside_window": prof.tokens}}


def write_settings(result: dict, directory: Path = SETTINGS_DIR) -> Path:
    path = settings_path(result["model"], directory)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(result, indent=1) + "\n")
    return path


def main(argv: list[str] | None = None) -> int:
    """Install a recorded calibration (e.g. a study's calibration.json from a GPU run) as the model's settings."""
    import argparse

    ap = argparse.ArgumentParser(description="write diffkv_serve/engine/model_settings/<model id>.json from a calibration.json")
    ap.add_argument("calibration", type=Path, help="calibration.json written by evals.study")
    ap.add_argument("--settings-dir", type=Path, default=SETTINGS_DIR)
    args = ap.parse_args(argv)
    result = json.loads(args.calibration.read_text())
    for k in ("model", "alpha_high", "alpha_low"):
        if k not in result:
            raise SystemExit(f"{args.calibration}: not a calibration result (no {k!r})")
    print(f"wrote {write_settings(result, args.settings_dir)}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
