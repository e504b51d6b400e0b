"""Frontier configurations by name (evals.configs.parse_config) and the frontier's verdicts (evals.frontier)."""
import json

import pytest

from evals import frontier
from evals.configs import parse_config


def test_parse_config_names_uniform_and_diffkv_points():
    u = parse_config("uniform:k2v2")
    assert u.family == "uniform" and u.name == "uniform:k2v2"
    assert u.cache == {"kv_mode": "diffkv", "high": "K2V2", "low": "K2V2", "alpha_high": 0.0, "alpha_low": 0.0}
    d = parse_config("diffkv:alpha_high=16,alpha_low=0,high=K8V4,low=K4V4")
    assert d.cache == {"kv_mode": "diffkv", "high": "K8V4", "low": "K4V4", "alpha_high": 16.0, "alpha_low": 0.0}
    assert d.cache_config().low == "K4V4"
    assert parse_config("k4v4").cache["kv_mode"] == "int4"
    assert "alpha_high" not in parse_config("diffkv").cache  # the model's settings decide


@pytest.mark.parametrize("spec, words", [
    ("diffkv:alpha_high=2", "both alpha_high and alpha_low"),
    ("diffkv:alpha_high=2,alpha_low=0,high=K3V4", "high='K3V4' is not a precision"),
    ("uniform:K3V4", "K<bits>V<bits>"),
    ("uniform:", "expected one of"),
    ("int3", "expected one of"),
    ("diffkv:alpha_high=x,alpha_low=0", "not a number"),
])
def test_parse_config_names_what_is_wrong(spec, words):
    with pytest.raises(ValueError, match=words):
        parse_config(spec)


def _row(kv_mode, mem, top1, nll, high="K4V4", low="K4V4", ah=0.0, al=0.0):
    cache = {"kv_mode": kv_mode, "high": high, "low": low, "alpha_high": ah, "alpha_low": al}
    return {"label": kv_mode, "cache": cache, "memory_fraction": mem, "top1_agreement": top1, "nll": nll,
            "token_fractions": {"high": 1.0, "low": 0.0, "pruned": 0.0}}


def _run(configs, gen_len=2048):
    return {"model": "M", "command": "python -m evals.fidelity_compare ...", "fp16_nll": 0.15, "gpu": None,
            "settings": {"fidelity_n": 4, "gen_len": gen_len, "seed": 0}, "configs": configs}


def test_frontier_finds_dominating_points_and_the_uniform_curve(tmp_path):
    runs = [_run({"k4v4": _row("int4", 0.285, 0.9936, 0.150),
                  "k8v4": _row("diffkv", 0.406, 0.997, 0.145, "K8V4", "K8V4")}),
            _run({"k4v4": _row("int4", 0.285, 0.9936, 0.150),
                  "dk_above": _row("diffkv", 0.30, 0.996, 0.150, "K8V4", "K4V4", 16.0),
                  "dk_dominates": _row("diffkv", 0.28, 0.994, 0.149, "K8V4", "K4V4", 64.0),
                  "dk_worse": _row("diffkv", 0.28, 0.990, 0.149, "K4V4", "K4V2", 1.0, 0.02)})]
    merged = frontier.merge(runs)
    v = frontier.analyse(merged)
    assert v["family"] == {"k4v4": "uniform", "k8v4": "uniform", "dk_above": "diffkv", "dk_dominates": "diffkv",
                           "dk_worse": "diffkv"}
    # K8V4 is more accurate than every DiffKV point here (dk_above has fewer bytes, but a higher NLL)
    assert v["uniform_dominated_by"] == {"k4v4": ["dk_dominates"], "k8v4": []}
    # 30% sits 15/121 of the way from K4V4 to K8V4: the curve reads 0.9936 + 0.0034 * 15 / 121 there
    assert v["diffkv_above_uniform_curve"]["dk_above"] == pytest.approx(0.996 - (0.9936 + 0.0034 * 15 / 121))
    assert v["diffkv_above_uniform_curve"]["dk_worse"] is None  # below the uniform points measured
    md = frontier.markdown(merged, v)
    assert "matched or beaten by `dk_dominates`" in md and md.index("`dk_worse`") < md.index("`k4v4`")
    paths = []
    for i, r in enumerate(runs):
        paths.append(tmp_path / f"r{i}.json")
        paths[-1].write_text(json.dumps(r))
    out = tmp_path / "merged.json"
    assert frontier.main([*map(str, paths), "--out", str(out)]) == 0
    assert json.loads(out.read_text())["verdict"]["uniform_dominated_by"]["k4v4"] == ["dk_dominates"]


def test_frontier_refuses_runs_on_different_references():
    with pytest.raises(ValueError, match="do not share references"):
        frontier.merge([_run({}), _run({}, gen_len=512)])
