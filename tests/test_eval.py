"""Accuracy harness (evals/): `python3 -m evals.cli eval` smoke run on SmolLM2, answer extraction and scoring, paired
intervals, memory accounting, problem splits, the baselines as engine configurations, calibration choice,
per-model settings and the report."""
import json
import math

import pytest

from engine_helpers import run_all
from diffkv_serve.engine import EngineConfig, SamplingParams
from diffkv_serve.engine.model_settings import apply_model_settings, load_model_settings, settings_path
from evals.calibrate import _pick
from evals.configs import UNREACHABLE, baseline_configs, diffkv_config, prune_config
from evals.memory import fp16_token_bytes, memory_fraction, token_bytes
from evals.problems import SPLITS, TASKS, load_problems
from evals.stats import paired_diff
from evals.tasks import extract_answer, is_correct


# ---- scoring ---------------------------------------------------------------------------------------------
@pytest.mark.parametrize("text, expected", [
    ("First 3 + 4 = 7, then 7 * 2 = 14.\nAnswer: 14", "14"),
    ("so the answer is -1,250.", "-1250"),
    ("We get \\boxed{42} apples", "42"),
    ("Answer: 12. Check: 5 + 7 = 12, so 99 is wrong", "12"),
    ("the total is 3.5 then 7", "7"),
    ("no digits here", None),
])
def test_extract_answer(text, expected):
    assert extract_answer(text) == expected


def test_is_correct_compares_numbers():
    assert is_correct("14", "14") and is_correct("14.0", "14") and is_correct("-3", "-3")
    assert not is_correct("15", "14") and not is_correct(None, "14")


def test_paired_diff_interval():
    a, b = [1, 0, 1, 1, 0, 0, 1, 0], [1, 1, 1, 0, 0, 1, 1, 0]
    d = paired_diff(a, b)
    assert d["n"] == 8 and d["mean"] == pytest.approx(1 / 8) and d["ci_low"] < d["mean"] < d["ci_high"]
    same = paired_diff(a, a)
    assert same["mean"] == same["ci_low"] == same["ci_high"] == 0
    with pytest.raises(ValueError):
        paired_diff([1], [1, 0])


# ---- memory ------------------------------------------------------------------------------------------------
def test_memory_fraction_includes_metadata():
    D = 64
    fp16 = memory_fraction(EngineConfig(cache={"kv_mode": "fp16"}).cache, D, 100, 0, 0)
    assert fp16 == 1.0  # single-precision pages hold no score or position rows
    int4 = memory_fraction(EngineConfig(cache={"kv_mode": "int4"}).cache, D, 100, 0, 0)
    assert int4 == pytest.approx(token_bytes(4, 4, D, tracked=False) / fp16_token_bytes(D))
    assert token_bytes(4, 4, D, tracked=False) < token_bytes(4, 4, D)  # diffkv's pages keep score + position
    diff = diffkv_config(1.0, 0.02).cache_config()
    k8v4, k4v2 = token_bytes(8, 4, D), token_bytes(4, 2, D)
    assert memory_fraction(diff, D, 10, 20, 70) == pytest.approx((10 * k8v4 + 20 * k4v2) / (100 * fp16_token_bytes(D)))
    assert token_bytes(4, 4, D) < token_bytes(8, 4, D) == token_bytes(4, 8, D) < token_bytes(8, 8, D)
    with pytest.raises(ValueError):
        memory_fraction(diff, D, 0, 0, 0)


# ---- data ----------------------------------------------------------------------------------------------------
def test_problem_splits_are_disjoint_and_answered():
    seen = {}
    for split in SPLITS:
        probs = load_problems(split=split)
        assert probs and all(p.answer and p.question and p.task in TASKS for p in probs)
        seen[split] = {p.question for p in probs}
    assert not seen["eval"] & seen["calib"] and not seen["eval"] & seen["fidelity"]
    assert not seen["calib"] & seen["fidelity"]
    assert len(load_problems(split="eval", tasks=("gsm_symbolic",))) >= 200
    assert len(load_problems(split="eval", tasks=("chain_sum",), limit=5)) == 5
    with pytest.raises(ValueError):
        load_problems(split="train")


# ---- configurations ----------------------------------------------------------------------------------------
def test_every_configuration_is_a_valid_cache_config():
    names = [c.name for c in baseline_configs()]
    assert names == ["fp16", "k8v8", "fp8", "k4v4", "k4v4_raw", "k4v4_norot", "k4v2_norot", "k8v4", "k4v8", "k4v2",
                     "k2v4", "kivi2", "prune50"]
    from diffkv_serve.engine import kv_rotation
    rotation = {c.name: kv_rotation.resolve_mode(c.cache_config()) for c in baseline_configs()}
    assert [n for n, m in rotation.items() if m == "off"] == ["fp16", "k4v4_raw", "k4v4_norot", "k4v2_norot",
                                                              "prune50"]
    assert [c.name for c in baseline_configs(attention_bias=True)][4:6] == ["k4v4_raw", "k4v4_bias"]
    fp8 = next(c for c in baseline_configs() if c.name == "fp8")
    assert fp8.cache == {"kv_mode": "fp8"} and fp8.cache_config().float8
    for c in baseline_configs(True) + [diffkv_config(2.0, 0.04), prune_config(0.27, "prune_eq")]:
        c.cache_config()
    with pytest.raises(ValueError):
        prune_config(0.0, "x")


def _usage(engine, prompt, n=24):
    return run_all(engine, [prompt], SamplingParams(temperature=0, max_tokens=n, ignore_eos=True))[0]


PROMPT = "Write a long and careful explanation of why the sky is blue, with examples. " * 4


@pytest.mark.slow
def test_uniform_through_diffkv_equals_the_uniform_mode(make_engine):
    """high = low = K8V8 with both alphas 0 keeps every token high: same tokens and pages as kv_mode int8."""
    # Prefix caching off (int8's 'auto' is on): a request's usage excludes the blocks it handed to the cache.
    a = _usage(make_engine(cache={"kv_mode": "int8", "enable_prefix_caching": False}), PROMPT)
    b = _usage(make_engine(cache={"kv_mode": "diffkv", "high": "K8V8", "low": "K8V8", "alpha_high": 0.0,
                                  "alpha_low": 0.0}), PROMPT)
    assert a.token_ids == b.token_ids
    assert b.kv_usage["tokens_low"] == b.kv_usage["tokens_pruned"] == 0
    assert a.kv_usage["pages_used"] == b.kv_usage["pages_used"]


@pytest.mark.slow
def test_kivi_like_keeps_only_the_window_high(make_engine):
    kivi = next(c for c in baseline_configs() if c.name == "kivi2")
    assert kivi.cache["alpha_high"] == UNREACHABLE
    engine = make_engine(cache={**kivi.cache, "window": 16})
    out = _usage(engine, PROMPT)
    heads = engine.arch.num_layers * engine.arch.num_kv_heads
    u = out.kv_usage
    assert u["tokens_high"] == 16 * heads and u["tokens_pruned"] == 0
    assert u["tokens_low"] == (u["tokens"] - 16) * heads


# ---- calibration choice ------------------------------------------------------------------------------------
def test_calibration_picks_the_most_compressive_value_within_tolerance():
    pts = [{"alpha_high": a, "top1_agreement": agr} for a, agr in ((0, .99), (1, .985), (2, .975), (3, .95))]
    assert _pick(pts, "alpha_high", 0.01)["alpha_high"] == 1
    assert _pick(pts, "alpha_high", 0.05)["alpha_high"] == 3


# ---- per-model settings ------------------------------------------------------------------------------------
def _settings(tmp_path, name, **values):
    path = settings_path(name, tmp_path)
    path.write_text(json.dumps({"model": name, **values}))
    return path


def test_model_settings_fill_only_unset_thresholds(tmp_path):
    _settings(tmp_path, "Some-Model", alpha_high=3.0, alpha_low=0.04)
    cfg = apply_model_settings(EngineConfig(cache={"kv_mode": "diffkv"}), "Some-Model", tmp_path)
    assert (cfg.cache.alpha_high, cfg.cache.alpha_low) == (3.0, 0.04)
    cfg = apply_model_settings(EngineConfig(cache={"kv_mode": "diffkv", "alpha_high": 5.0}), "some-model", tmp_path)
    assert (cfg.cache.alpha_high, cfg.cache.alpha_low) == (5.0, 0.04)
    for untouched in (EngineConfig(cache={"kv_mode": "fp16"}),
                      EngineConfig(cache={"kv_mode": "diffkv", "policy": "budget"})):
        assert apply_model_settings(untouched, "Some-Model", tmp_path) is untouched
    assert apply_model_settings(EngineConfig(cache={"kv_mode": "diffkv"}), "Other", tmp_path).cache.alpha_high == 1.0
    with pytest.raises(ValueError, match="do not fit together"):
        apply_model_settings(EngineConfig(cache={"kv_mode": "diffkv", "alpha_high": 0.03}), "Some-Model", tmp_path)
    _settings(tmp_path, "Broken", alpha_high="x", alpha_low=0.0)
    with pytest.raises(ValueError, match="damaged"):
        load_model_settings("Broken", tmp_path)


def test_engine_uses_the_shipped_settings_of_its_model(make_engine, smollm):
    settings = load_model_settings(smollm.name)
    assert settings is not None, f"no calibrated settings shipped for {smollm.name}"
    engine = make_engine(cache={"kv_mode": "diffkv"})
    assert (engine.config.cache.alpha_high, engine.config.cache.alpha_low) == (settings["alpha_high"],
                                                                               settings["alpha_low"])
    explicit = make_engine(cache={"kv_mode": "diffkv", "alpha_high": 0.5, "alpha_low": 0.0})
    assert (explicit.config.cache.alpha_high, explicit.config.cache.alpha_low) == (0.5, 0.0)


# ---- the command ------------------------------------------------------------------------------------------
@pytest.mark.slow
def test_diffkv_eval_smoke(tmp_path):
    """CI smoke: `python3 -m evals.cli eval` on a handful of problems with SmolLM2; the JSON's fields and ranges."""
    from evals.cli import main

    out = tmp_path / "eval.json"
    rc = main(["eval", "--device", "cpu", "--kv-mode", "diffkv", "--tasks", "chain_sum", "--limit", "3",
               "--max-tokens", "12", "--fidelity", "2", "--gen-len", "12", "--compare-fp16",
               "--kv-cache-memory-gb", "0.25", "--out", str(out)])
    assert rc == 0
    r = json.loads(out.read_text())
    assert r["model"] == "SmolLM2-135M-Instruct-Q4_1" and r["config"]["kv_mode"] == "diffkv"
    t = r["tasks"]["chain_sum"]
    assert t["n"] == 3 and len(t["correct"]) == 3 and 0 <= t["accuracy"] <= 1
    assert 0 < t["memory_fraction"] < 1 and math.isclose(sum(t["token_fractions"].values()), 1)
    f = r["fidelity"]
    assert f["n_generations"] == 2 and f["gen_tokens"] == 12
    assert 0 <= f["top1_agreement"] <= 1 and f["nll"] >= 0 and f["fp16_nll"] >= 0
    assert 0 < f["memory_fraction"] < 1 and math.isclose(sum(f["token_fractions"].values()), 1)
    lo, hi = f["nll_increase_ci"]
    assert lo <= f["nll_increase"] <= hi
    p = r["paired_vs_fp16"]["chain_sum"]
    assert p["n"] == 3 and p["ci95_points"][0] <= p["diff_points"] <= p["ci95_points"][1]
    assert -100 <= p["diff_points"] <= 100


def test_diffkv_eval_rejects_bad_arguments(capsys):
    from evals.cli import main

    assert main(["eval", "--device", "cpu", "--limit", "0"]) == 2
    assert "--limit" in capsys.readouterr().err


class _NoEngine:
    """A model whose calibration has every point recorded: building an engine is a test failure."""
    name = "M"

    def engine(self, cache):
        raise AssertionError("nothing left to measure: no engine needed")


def test_resumed_calibration_reuses_recorded_points(monkeypatch):
    """Every sweep point already measured: no engine is built and the choice is re-made from the record."""
    from evals import calibrate as cal

    pts = {(float(a), 0.0): {"alpha_high": float(a), "alpha_low": 0.0, "top1_agreement": agr}
           for a, agr in zip(range(6), (.99, .95, .96, .955, .94, .90))}
    pts.update({(3.0, al): {"alpha_high": 3.0, "alpha_low": al, "top1_agreement": agr}
                for al, agr in ((0.02, .953), (0.04, .951), (0.06, .93), (0.08, .92), (0.1, .91))})
    r = cal.calibrate(_NoEngine(), [[1]], [[2]], measured=pts)
    # alpha_high 0 is only the reference; among 1..5 the best is 0.96, within 0.01: 1, 2, 3 -> 3.
    assert (r["alpha_high"], r["alpha_low"]) == (3.0, 0.04)
    assert cal.measured_points(r) == pts


def test_calibration_turns_low_precision_off_when_it_breaks_the_model():
    """Every alpha_high candidate far below all-high (Qwen2.5 with 4-bit keys): low = high, alpha_low prunes."""
    from evals import calibrate as cal

    pts = {(float(a), 0.0): {"alpha_high": float(a), "alpha_low": 0.0, "top1_agreement": agr}
           for a, agr in zip(range(6), (.99, .75, .76, .77, .78, .77))}
    pts.update({(al, al, "K8V4"): {"alpha_high": al, "alpha_low": al, "top1_agreement": agr}
                for al, agr in ((0.0, .99), (0.02, .97), (0.04, .965), (0.06, .95), (0.08, .94), (0.1, .93))})
    r = cal.calibrate(_NoEngine(), [[1]], [[2]], measured=pts)
    # alpha_low 0 prunes nothing (the reference); best candidate 0.97, within 0.01: 0.02, 0.04 -> 0.04.
    assert (r["alpha_high"], r["alpha_low"], r["low"]) == (0.04, 0.04, "K8V4")
    assert r["calibration"]["low_precision_off"] is True
    assert cal.measured_points(r) == pts


def test_settings_file_low_precision_applies_unless_set(tmp_path):
    from diffkv_serve.engine.config import EngineConfig
    from diffkv_serve.engine.model_settings import apply_model_settings

    (tmp_path / "m.json").write_text(json.dumps({"model": "M", "alpha_high": 0.04, "alpha_low": 0.04, "low": "K8V4"}))
    c = apply_model_settings(EngineConfig(cache={"kv_mode": "diffkv"}), "M", tmp_path).cache
    assert (c.low, c.alpha_high, c.alpha_low) == ("K8V4", 0.04, 0.04)
    c = apply_model_settings(EngineConfig(cache={"kv_mode": "diffkv", "low": "K4V2"}), "M", tmp_path).cache
    assert c.low == "K4V2"
    (tmp_path / "m.json").write_text(json.dumps({"model": "M", "alpha_high": 1, "alpha_low": 0, "low": "K3V2"}))
    with pytest.raises(ValueError, match="damaged model settings"):
        apply_model_settings(EngineConfig(cache={"kv_mode": "diffkv"}), "M", tmp_path)


def test_diffkv_eval_of_fp16_itself(tmp_path):
    """fp16 against itself: full agreement, no NLL increase, and its task results are reported."""
    from evals.cli import main

    out = tmp_path / "fp16.json"
    assert main(["eval", "--device", "cpu", "--kv-mode", "fp16", "--tasks", "chain_sum", "--limit", "2",
                 "--max-tokens", "4", "--fidelity", "1", "--gen-len", "6", "--kv-cache-memory-gb", "0.25",
                 "--out", str(out)]) == 0
    r = json.loads(out.read_text())
    assert r["tasks"]["chain_sum"]["n"] == 2 and r["fidelity"]["top1_agreement"] == 1.0
    assert r["fidelity"]["nll_increase"] == 0.0
    assert r["fidelity"]["memory_fraction"] == 1.0  # single-precision pages hold no score or position rows


@pytest.mark.slow
def test_fidelity_compare_configs_and_run(tmp_path):
    """evals/fidelity_compare.py: config names and diffkv:alpha_high=A,alpha_low=B parse (bad ones name the part),
    and a tiny run writes each configuration's fidelity with its paired difference from the baseline."""
    from evals.fidelity_compare import main, parse_config

    assert parse_config("k4v4").cache == {"kv_mode": "int4"}
    kvc = parse_config("diffkv:alpha_high=4,alpha_low=0.06")
    assert kvc.cache == {"kv_mode": "diffkv", "alpha_high": 4.0, "alpha_low": 0.06}
    for bad, words in (("k3v3", "expected one of"), ("diffkv:beta=1", "beta"), ("diffkv:alpha_high=4", "both"),
                       ("diffkv:alpha_high=x,alpha_low=0", "not a number")):
        with pytest.raises(ValueError, match=words):
            parse_config(bad)
    out = tmp_path / "fc.json"
    assert main(["--configs", "diffkv:alpha_high=1,alpha_low=0.5", "--baseline", "k8v8", "--fidelity-n", "1",
                 "--gen-len", "4", "--max-num-seqs", "4", "--kv-cache-memory-gb", "0.05", "--out", str(out)]) == 0
    d = json.loads(out.read_text())
    assert list(d["configs"]) == ["k8v8", "diffkv:alpha_high=1,alpha_low=0.5"]
    row = d["configs"]["diffkv:alpha_high=1,alpha_low=0.5"]
    assert 0 < row["memory_fraction"] < 1 and 0 <= row["top1_agreement"] <= 1
    assert "vs_baseline" in row and "vs_baseline" not in d["configs"]["k8v8"]
    assert row["cache"]["alpha_low"] == 0.5


def test_study_max_tokens_option():
    """--max-tokens takes N for every task or a per-task JSON object; anything else is a usage error naming it."""
    from evals.study import parse_max_tokens

    assert parse_max_tokens("300")["gsm_symbolic"] == 300 and len(set(parse_max_tokens("300").values())) == 1
    assert parse_max_tokens('{"chain_sum": 20}') == {"chain_sum": 20}
    for bad in ("x", "0", "-3", "true", '{"nope": 3}', '{"chain_sum": 0}', "[1]"):
        with pytest.raises(ValueError, match="--max-tokens"):
            parse_max_tokens(bad)
