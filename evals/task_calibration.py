"""Calibration by task accuracy: choose DiffKV's precision pair and thresholds as the most compressive point whose
accuracy on the `calib` problems (disjoint from the evaluation) stays within `tolerance_points` of the fp16 cache,
paired over the same problems. Teacher-forced top-1 agreement and NLL are recorded beside each point, as a
secondary number: on Qwen2.5-Coder-1.5B agreement within 0.01 of the best candidate chose a point that lost 13
points of gsm_symbolic accuracy (pruning the agreement replay never exercised), so it cannot be the criterion.

Every (high, low) precision pair runs on its own engine; its threshold points run as one batch, each request with
its own thresholds (the engine's per-request kv_compression). Keys are centered as the model's engines center
them (the measured centers when the caller set `model.key_center`).
"""
from __future__ import annotations

import json
import time
from pathlib import Path

from diffkv_serve.engine import kv_rotation
from diffkv_serve.engine.config import CacheConfig
from evals.fidelity import score_fidelity, teacher_forced_requests
from evals.harness import DEFAULT_MAX_TOKENS
from evals.runner import run_requests
from evals.stats import paired_diff
from evals.tasks import score_tasks, task_requests

PRECISION_PAIRS = (("K8V4", "K4V2"), ("K8V4", "K4V4"), ("K4V4", "K4V2"))
# Pairs a sweep may name beside the default ones: 8-bit values in the high tier, for models too small to keep
# top-1 agreement with 4-bit values (SmolLM2-135M: uniform K8V4 is at the 0.97 floor).
MORE_PAIRS = (("K8V8", "K8V4"), ("K8V8", "K4V4"), ("K8V4", "K8V4"))
# The fidelity floor of a chosen point: teacher-forced top-1 agreement with the fp16 cache on the calibration
# generations. Task accuracy alone cannot see a model's tokens drift on tasks it fails anyway.
MIN_AGREEMENT = 0.97
ALPHA_HIGH_GRID = (0.5, 1.0, 2.0, 4.0)
ALPHA_LOW_GRID = (0.0, 0.02)


def calib_pairs(names: list[str] | None) -> tuple[tuple[str, str], ...]:
    """Precision pairs named "HIGH/LOW" (e.g. K4V4/K4V2); None means every pair of PRECISION_PAIRS."""
    if not names:
        return PRECISION_PAIRS
    known = {f"{h}/{l}": (h, l) for h, l in PRECISION_PAIRS + MORE_PAIRS}
    bad = [n for n in names if n not in known]
    if bad:
        raise ValueError(f"calib_pairs: unknown precision pair(s) {bad}; choose from {sorted(known)}")
    return tuple(known[n] for n in names)


CRITERION = ("the lowest KV memory (measured on the calib problems) among points whose task accuracy on the "
             "calib split is within {tol:g} points of the fp16 cache's (paired over the same problems) and whose "
             "teacher-forced top-1 agreement is at least {floor}; ties go to the higher accuracy; if no point "
             "qualifies, the most accurate one")


def _accuracy(task_result: dict) -> tuple[float, list[int]]:
    """Accuracy over every task of a run and the per-problem correctness in problem order."""
    correct = [c for t in sorted(task_result) for c in task_result[t]["correct"]]
    return sum(correct) / len(correct), correct


def _pair_points(model, high: str, low: str, points, problems, prompts, refs, max_tokens) -> list[dict]:
    """Every (alpha_high, alpha_low) of one precision pair, in one batch of one engine."""
    reqs, spans = [], []
    for ah, al in points:
        kv = {"alpha_high": ah, "alpha_low": al}
        fid = teacher_forced_requests(prompts, refs, kv)
        tasks = task_requests(model, problems, max_tokens, kv)
        spans.append((len(reqs), len(fid), len(tasks)))
        reqs += fid + tasks
    with model.engine({"kv_mode": "diffkv", "high": high, "low": low}) as eng:
        outs = run_requests(eng, reqs, f"calibrate {high}/{low}")
        base = eng.config.cache
    result = []
    for (ah, al), (start, n_fid, n_tasks) in zip(points, spans):
        cache = base.model_copy(update={"alpha_high": ah, "alpha_low": al})
        tasks = score_tasks(cache, model.head_dim, problems, outs[start + n_fid:start + n_fid + n_tasks])
        point = {"high": high, "low": low, "alpha_high": ah, "alpha_low": al, "tasks": tasks}
        if n_fid:
            f = score_fidelity(cache, model.head_dim, refs, outs[start:start + n_fid], "calibrate")
            point["fidelity"] = {k: f[k] for k in ("top1_agreement", "nll", "memory_fraction", "token_fractions")}
        result.append(point)
    return result


def _fp16_reference(model, problems, max_tokens) -> dict:
    with model.engine({"kv_mode": "fp16"}) as eng:
        outs = run_requests(eng, task_requests(model, problems, max_tokens), "calibrate fp16")
        return score_tasks(eng.config.cache, model.head_dim, problems, outs)


def _summarize(point: dict, fp16_correct: list[int]) -> dict:
    """A point's accuracy, paired difference to fp16 (points) and memory, without the per-problem lists."""
    acc, correct = _accuracy(point["tasks"])
    d = paired_diff(fp16_correct, correct)
    tasks = point["tasks"]
    n = sum(t["n"] for t in tasks.values())
    memory = sum(t["memory_fraction"] * t["n"] for t in tasks.values()) / n
    out = {k: point[k] for k in ("high", "low", "alpha_high", "alpha_low")}
    out.update({"accuracy": acc, "diff_vs_fp16_points": 100 * d["mean"],
                "diff_ci95_points": [100 * d["ci_low"], 100 * d["ci_high"]], "memory_fraction": memory,
                "token_fractions": next(iter(tasks.values()))["token_fractions"] if len(tasks) == 1 else None})
    if "fidelity" in point:
        out["fidelity"] = point["fidelity"]
    return out


def pick(points: list[dict], tolerance_points: float, min_agreement: float | None = None) -> tuple[dict, bool]:
    """The chosen point and whether it met the tolerance and the agreement floor (see CRITERION). A point
    without a fidelity measurement passes the floor only when there is no floor."""
    def agrees(p: dict) -> bool:
        return min_agreement is None or p.get("fidelity", {}).get("top1_agreement", -1.0) >= min_agreement

    ok = [p for p in points if p["diff_vs_fp16_points"] >= -tolerance_points and agrees(p)]
    if ok:
        return min(ok, key=lambda p: (round(p["memory_fraction"], 4), -p["accuracy"])), True
    return max(points, key=lambda p: (p["accuracy"], p.get("fidelity", {}).get("top1_agreement", 0.0),
                                      -p["memory_fraction"])), False


def calibrate_on_tasks(model, problems, prompts=(), refs=(), max_tokens: dict | None = None,
                       tolerance_points: float = 1.0, pairs=PRECISION_PAIRS, alpha_high_grid=ALPHA_HIGH_GRID,
                       alpha_low_grid=ALPHA_LOW_GRID, progress: Path | None = None,
                       min_agreement: float | None = MIN_AGREEMENT) -> dict:
    """The settings-file fields (model, high, low, alpha_high, alpha_low, calibration) of the chosen point.
    `progress`: a JSON file where the fp16 reference and each finished precision pair are kept, so a run cut
    off by a time limit resumes at the next pair (the whole sweep takes ~10 GPU minutes at 200 problems)."""
    problems, prompts, refs = list(problems), list(prompts), list(refs)
    if len(problems) < 1:
        raise ValueError("calibrate_on_tasks: needs calibration problems (the calib split)")
    if tolerance_points < 0:
        raise ValueError(f"tolerance_points={tolerance_points}: must be >= 0")
    if min_agreement is not None and not 0.0 <= min_agreement <= 1.0:
        raise ValueError(f"min_agreement={min_agreement}: must be in [0, 1] (or None: no floor)")
    if min_agreement is not None and not refs:
        raise ValueError("min_agreement needs fidelity generations (prompts and refs) to measure agreement on")
    t0 = time.perf_counter()
    max_tokens = {**DEFAULT_MAX_TOKENS, **(max_tokens or {})}
    grid = [(ah, al) for ah in alpha_high_grid for al in alpha_low_grid if al <= ah]
    ids = [p.id for p in problems]
    state = json.loads(progress.read_text()) if progress is not None and progress.is_file() else {}
    if state.get("problems") != ids or state.get("grid") != grid:
        state = {"problems": ids, "grid": grid, "pairs": {}}  # another sweep: start over

    def save() -> None:
        if progress is not None:
            progress.parent.mkdir(parents=True, exist_ok=True)
            progress.write_text(json.dumps(state))

    if "fp16" not in state:
        state["fp16"] = _fp16_reference(model, problems, max_tokens)
        save()
    fp16 = state["fp16"]
    fp16_acc, fp16_correct = _accuracy(fp16)
    points = []
    for high, low in pairs:
        key = f"{high}/{low}"
        if key not in state["pairs"]:
            state["pairs"][key] = [_summarize(p, fp16_correct) for p in
                                   _pair_points(model, high, low, grid, problems, prompts, refs, max_tokens)]
            save()
        points += state["pairs"][key]
    chosen, within = pick(points, tolerance_points, min_agreement)
    return {
        "model": model.name, "high": chosen["high"], "low": chosen["low"],
        "alpha_high": chosen["alpha_high"], "alpha_low": chosen["alpha_low"],
        "calibration": {
            "split": "calib", "criterion": CRITERION.format(tol=tolerance_points, floor=min_agreement),
            "by": "task accuracy", "tolerance_points": tolerance_points, "min_agreement": min_agreement,
            "within_tolerance": within,
            "problems": len(problems), "tasks": sorted(fp16), "fp16_accuracy": fp16_acc,
            "fidelity_generations": len(refs), "gen_tokens": len(refs[0]) if refs else 0,
            "chosen": chosen, "points": points, "seconds": time.perf_counter() - t0,
            "kv_rotation": kv_rotation.resolve_mode(CacheConfig(kv_mode="diffkv", high=chosen["high"],
                                                                 low=chosen["low"])),  # 'auto', as the sweep ran
        },
    }
