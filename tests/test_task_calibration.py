"""Calibration by task accuracy (evals.task_calibration): the pick rule, and the sweep end to end on a tiny model."""
from __future__ import annotations

import pytest

from evals import task_calibration as tc
from evals.problems import load_problems
from evals.runner import EvalModel
from engine_helpers import TEST_DEVICE


def _point(mem, diff, acc, name="p"):
    return {"name": name, "memory_fraction": mem, "diff_vs_fp16_points": diff, "accuracy": acc}


def test_pick_lowest_memory_within_tolerance():
    pts = [_point(0.25, -3.0, 0.45, "too lossy"), _point(0.27, -0.5, 0.49, "ok small"),
           _point(0.27, +0.5, 0.50, "ok small, better"), _point(0.35, +1.0, 0.51, "ok big")]
    chosen, within = tc.pick(pts, tolerance_points=1.0)
    assert within and chosen["name"] == "ok small, better"
    chosen, within = tc.pick(pts, tolerance_points=5.0)
    assert within and chosen["name"] == "too lossy"
    chosen, within = tc.pick([_point(0.25, -3.0, 0.45, "a"), _point(0.3, -2.0, 0.46, "b")], tolerance_points=1.0)
    assert not within and chosen["name"] == "b"  # nothing within: the most accurate


def test_pick_keeps_the_agreement_floor():
    """A point within the accuracy tolerance whose tokens drift from fp16 (top-1 below the floor) is not chosen:
    task accuracy cannot see drift on tasks the model fails anyway."""
    drift = {**_point(0.25, 0.0, 0.03, "drifts"), "fidelity": {"top1_agreement": 0.95}}
    keeps = {**_point(0.40, 0.0, 0.03, "keeps"), "fidelity": {"top1_agreement": 0.975}}
    assert tc.pick([drift, keeps], 1.0, min_agreement=0.97) == (keeps, True)
    assert tc.pick([drift, keeps], 1.0, min_agreement=None) == (drift, True)
    # Nothing meets the floor: the most accurate point, then the one that agrees most.
    chosen, within = tc.pick([drift, {**keeps, "fidelity": {"top1_agreement": 0.96}}], 1.0, min_agreement=0.97)
    assert not within and chosen["name"] == "keeps"


def test_calibrate_on_tasks_end_to_end(tmp_path):
    """Every precision pair x threshold point is measured on the same problems as fp16, paired, with fidelity
    beside it; the settings-file fields name the chosen precisions and thresholds."""
    from test_key_centering import planted_checkpoint

    model = EvalModel(device=TEST_DEVICE, max_model_len=256, max_num_seqs=16, checkpoint=planted_checkpoint())
    problems = load_problems(split="calib", tasks=("chain_sum",), limit=2)
    prompts = [[5, 6, 7, 8] * 4, [9, 10, 11] * 5]
    refs = [[20 + i for i in range(6)], [40 + i for i in range(6)]]
    pairs = (("K8V4", "K4V2"), ("K4V4", "K4V2"))
    kw = dict(tolerance_points=1.0, alpha_high_grid=(1.0, 4.0), alpha_low_grid=(0.0, 0.5),
              progress=tmp_path / "progress.json", min_agreement=0.5)
    # A run cut off after its first pair resumes at the second: the first pair's points are read back.
    first = tc.calibrate_on_tasks(model, problems, prompts, refs, {"chain_sum": 4}, pairs=pairs[:1], **kw)
    r = tc.calibrate_on_tasks(model, problems, prompts, refs, {"chain_sum": 4}, pairs=pairs, **kw)
    assert r["calibration"]["points"][:4] == first["calibration"]["points"]
    c = r["calibration"]
    assert c["by"] == "task accuracy" and c["problems"] == 2 and len(c["points"]) == 2 * 4
    assert {(p["high"], p["low"]) for p in c["points"]} == set(pairs)
    for p in c["points"]:
        assert 0 < p["memory_fraction"] < 1 and "top1_agreement" in p["fidelity"]
        lo, hi = p["diff_ci95_points"]
        assert lo <= p["diff_vs_fp16_points"] <= hi
    chosen = c["chosen"]
    assert (r["high"], r["low"], r["alpha_high"], r["alpha_low"]) == (
        chosen["high"], chosen["low"], chosen["alpha_high"], chosen["alpha_low"])
    assert chosen == tc.pick(c["points"], 1.0, 0.5)[0] and c["min_agreement"] == 0.5
    with pytest.raises(ValueError, match="tolerance_points"):
        tc.calibrate_on_tasks(model, problems, tolerance_points=-1)
    with pytest.raises(ValueError, match="min_agreement"):
        tc.calibrate_on_tasks(model, problems, min_agreement=1.5)
    with pytest.raises(ValueError, match="min_agreement needs fidelity"):
        tc.calibrate_on_tasks(model, problems, min_agreement=0.97)


def test_calib_pairs_by_name():
    from evals.task_calibration import PRECISION_PAIRS, calib_pairs
    assert calib_pairs(None) == PRECISION_PAIRS
    assert calib_pairs(["K4V4/K4V2", "K8V4/K4V2"]) == (("K4V4", "K4V2"), ("K8V4", "K4V2"))
    assert calib_pairs(["K8V8/K8V4"]) == (("K8V8", "K8V4"),)  # named beyond the default sweep
    with pytest.raises(ValueError, match="calib_pairs"):
        calib_pairs(["K2V2/K4V4"])
