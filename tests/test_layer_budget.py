"""Per-layer budgets (XKV allocation -> multipliers of DiffKV's alphas): the allocation, the engine config and
the settings file round trip, `python3 -m evals.cli calibrate --per-layer` on a tiny sample."""
import json
import shutil

import pytest
import torch

from diffkv_serve.engine.config import CacheConfig, EngineConfig
from diffkv_serve.engine.model_settings import SETTINGS_DIR, apply_model_settings, load_model_settings, settings_path
from evals.layer_budget import SCALE_MAX, allocate_top_n, plan_layer_budgets

SMOLLM = "SmolLM2-135M-Instruct-Q4_1"


def _kept_with_scale(values, scale, alpha):
    """Entries each layer keeps when layer l compares x with alpha * scale[l] (as the engine does)."""
    s = torch.tensor(scale, dtype=torch.float64).view(-1, 1)
    return sum(((x.flatten(1) >= alpha * s).sum(1) for x in values)).tolist()


def _sample(L, H, T, seed, spread=None):
    """Random profiles: importance sums to 1 per (layer, head); x = importance * T * spread[l]."""
    g = torch.Generator().manual_seed(seed)
    w = torch.rand(L, H, T, generator=g, dtype=torch.float64) ** 4
    imp = w / w.sum(-1, keepdim=True)
    spread = torch.ones(L, dtype=torch.float64) if spread is None else torch.tensor(spread, dtype=torch.float64)
    return imp, imp * T * spread.view(-1, 1, 1)


def test_equal_importance_equal_budgets():
    imp, x = _sample(1, 2, 50, seed=0)
    L = 4
    imps, xs = [imp.expand(L, -1, -1)], [x.expand(L, -1, -1)]
    b = plan_layer_budgets(imps, xs, alpha=2.0)
    assert len(set(b.kept)) == 1 and b.kept == b.kept_global and b.kept[0] > 0
    assert b.scale == [1.0] * L
    assert allocate_top_n(torch.ones(3, 5), 9).tolist() == [3, 3, 3]  # exact ties go round-robin
    assert allocate_top_n(torch.ones(3, 5), 7).tolist() == [3, 2, 2]


@pytest.mark.parametrize("seed", [1, 2, 3])
def test_budgets_sum_to_target_and_scales_reproduce_them(seed):
    L, alpha = 6, 3.0
    samples = [_sample(L, 3, T, seed=10 * seed + i, spread=[0.5, 1, 2, 1, 3, 0.7]) for i, T in enumerate((40, 77, 23))]
    imps, xs = [s[0] for s in samples], [s[1] for s in samples]
    b = plan_layer_budgets(imps, xs, alpha)
    assert sum(b.kept) == sum(b.kept_global) == sum(int((x >= alpha).sum()) for x in xs)
    # Per sample, the allocation is the global top-N of the normalized importance.
    for imp, x in zip(imps, xs):
        n = int((x >= alpha).sum())
        top = imp.flatten(1).flatten().topk(n).values.min()
        assert allocate_top_n(imp.flatten(1), n).sum() == n
        assert (imp.flatten(1) > top).sum(1).le(allocate_top_n(imp.flatten(1), n)).all()
    # The multipliers keep exactly the allocated share of each layer on the profile: same total memory.
    assert _kept_with_scale(xs, b.scale, alpha) == b.kept
    assert all(0 < s <= SCALE_MAX for s in b.scale)


def test_more_important_layer_gets_more():
    # Layer 0: 16 of 32 tokens hold 80% of its attention; layer 1: flat. The global alpha keeps 8 of each.
    T = 32
    imp = torch.tensor([[0.05] * 16 + [0.0125] * 16, [1 / T] * T], dtype=torch.float64).unsqueeze(1)
    x = torch.tensor([[3.0 - 0.01 * i for i in range(8)] + [1.5 - 0.01 * i for i in range(8)] + [0.5] * 16,
                      [2.0] * 8 + [1.0 - 0.01 * i for i in range(24)]], dtype=torch.float64).unsqueeze(1)
    b = plan_layer_budgets([imp], [x], alpha=2.0)
    assert b.kept_global == [8, 8] and b.kept == [16, 0]
    assert b.scale[0] < 1 < b.scale[1]
    assert _kept_with_scale([x], b.scale, 2.0) == [16, 0]


def test_same_relative_importance_equal_budget_whatever_the_raw_scale():
    # Layer 1's significance runs twice as high (x doubled) but its normalized importance equals layer 0's:
    # the global alpha keeps more of layer 1; the allocation splits evenly and scales layer 1's threshold up.
    imp, x = _sample(1, 2, 64, seed=5)
    b = plan_layer_budgets([imp.expand(2, -1, -1)], [torch.cat([x, 2 * x])], alpha=1.5)
    assert b.kept_global[1] > b.kept_global[0] and abs(b.kept[0] - b.kept[1]) <= 1
    assert b.scale[0] < 1 < b.scale[1]


def test_bad_inputs():
    with pytest.raises(ValueError, match="alpha"):
        plan_layer_budgets([torch.ones(1, 1, 2)], [torch.ones(1, 1, 2)], alpha=0.0)
    with pytest.raises(ValueError, match="budget"):
        allocate_top_n(torch.ones(2, 2), 5)


def test_cache_config_validates_layer_alpha_scale():
    with pytest.raises(ValueError, match=r"layer_alpha_scale\[1\]"):
        CacheConfig(kv_mode="diffkv", layer_alpha_scale=[1.0, 0.0])
    with pytest.raises(ValueError, match=r"layer_alpha_scale\[0\]"):
        CacheConfig(kv_mode="diffkv", layer_alpha_scale=[float("inf")])
    with pytest.raises(ValueError, match="layer_alpha_scale has 2 multipliers; the model has 30 layers"):
        CacheConfig(layer_alpha_scale=[1.0, 2.0]).check_num_layers(30)
    CacheConfig(layer_alpha_scale=[1.0] * 30).check_num_layers(30)


def test_settings_round_trip(tmp_path):
    shutil.copy(settings_path(SMOLLM, SETTINGS_DIR), tmp_path)
    path = settings_path(SMOLLM, tmp_path)
    s = json.loads(path.read_text())
    s["layer_alpha_scale"] = [0.5 + 0.1 * i for i in range(30)]
    path.write_text(json.dumps(s))
    cfg = apply_model_settings(EngineConfig(cache={"kv_mode": "diffkv"}), SMOLLM, tmp_path)
    assert cfg.cache.layer_alpha_scale == s["layer_alpha_scale"] and cfg.cache.alpha_high == s["alpha_high"]
    # Explicit None turns the per-layer budgets off; explicit alphas keep the file's multipliers.
    off = apply_model_settings(EngineConfig(cache={"kv_mode": "diffkv", "layer_alpha_scale": None}), SMOLLM, tmp_path)
    assert off.cache.layer_alpha_scale is None
    mine = apply_model_settings(EngineConfig(cache={"kv_mode": "diffkv", "alpha_high": 1.0, "alpha_low": 0.0}),
                                SMOLLM, tmp_path)
    assert mine.cache.alpha_high == 1.0 and mine.cache.layer_alpha_scale == s["layer_alpha_scale"]
    s["layer_alpha_scale"] = [1.0, -1.0]
    path.write_text(json.dumps(s))
    with pytest.raises(ValueError, match="damaged model settings.*layer_alpha_scale"):
        load_model_settings(SMOLLM, tmp_path)


def test_calibrate_per_layer_cli(tmp_path):
    # Tiny run: the model's alphas stay, 30 multipliers are written, and an engine loads and uses them.
    from evals.cli import main

    shutil.copy(settings_path(SMOLLM, SETTINGS_DIR), tmp_path)
    before = json.loads(settings_path(SMOLLM, tmp_path).read_text())
    assert main(["calibrate", "--per-layer", "--device", "cpu", "--generations", "1", "--gen-len", "2",
                 "--max-model-len", "512", "--max-num-seqs", "2", "--kv-cache-memory-gb", "0.1",
                 "--settings-dir", str(tmp_path)]) == 0
    after = json.loads(settings_path(SMOLLM, tmp_path).read_text())
    assert (after["alpha_high"], after["alpha_low"], after["calibration"]) == \
        (before["alpha_high"], before["alpha_low"], before["calibration"])
    scale = after["layer_alpha_scale"]
    assert len(scale) == 30 and all(s > 0 for s in scale) and len(set(scale)) > 1
    assert sum(after["layer_budget"]["kept_allocated"]) == sum(after["layer_budget"]["kept_global_alpha"])
    cfg = apply_model_settings(EngineConfig(cache={"kv_mode": "diffkv"}), SMOLLM, tmp_path)
    assert cfg.cache.layer_alpha_scale == scale


@pytest.mark.slow
def test_engine_uniform_scale_equals_scaled_alphas(make_engine):
    # Prompt classification and the decode plan both use alpha * scale[l]: scale 2 everywhere is alpha doubled;
    # uneven scales move tokens between layers.
    from diffkv_serve.engine import SamplingParams
    from engine_helpers import PROMPTS, run_all

    prompts = [PROMPTS[-1] * 4]  # 92 tokens: past the 64-token window, so prompt and decode plans both classify
    sp = SamplingParams(temperature=0, max_tokens=3)
    base = {"kv_mode": "diffkv", "kv_cache_memory_gb": 0.1}
    outs = []
    for cache in ({"alpha_high": 1.0, "alpha_low": 0.1, "layer_alpha_scale": [2.0] * 30},
                  {"alpha_high": 2.0, "alpha_low": 0.2, "layer_alpha_scale": None},
                  {"alpha_high": 1.0, "alpha_low": 0.1, "layer_alpha_scale": [0.25, 8.0] * 15}):
        eng = make_engine(max_model_len=512, cache={**base, **cache})
        outs.append([(o.token_ids, o.kv_usage) for o in run_all(eng, prompts, sp)])
    assert outs[0] == outs[1]
    assert [u for _, u in outs[2]] != [u for _, u in outs[1]]


def _fid(ah, mem, agree, nll):
    return {"alpha_high": ah, "alpha_low": 0.0, "n_generations": 2, "gen_tokens": 8, "top1_agreement": agree,
            "nll": nll, "memory_fraction": mem, "token_fractions": {"high": 0.4, "low": 0.6, "pruned": 0.0},
            "agreement_change": agree - 1, "agreement_change_ci": [agree - 1.1, agree - 0.9],
            "nll_increase": nll - 0.4, "nll_increase_ci": [nll - 0.5, nll - 0.3]}


def test_equal_memory_alpha_and_report_section():
    from evals.layer_study import _alpha_at_memory
    from evals.report import per_layer_section

    grid = [_fid(2.0, 0.34, 0.9, 0.6), _fid(4.0, 0.32, 0.88, 0.62), _fid(8.0, 0.31, 0.86, 0.64)]
    assert _alpha_at_memory(grid, 0.32) == pytest.approx(4.0)
    assert 2.0 < _alpha_at_memory(grid, 0.33) < 4.0
    with pytest.raises(ValueError, match="grid"):
        _alpha_at_memory(grid, 0.30)
    r = {"model": SMOLLM, "settings": {"device": "cpu", "fidelity_n": 2}, "alpha_high": 4.0, "layer_alpha_scale": [0.5, 2.0],
         "layer_budget": {"sequences": 2, "gen_tokens": 8, "tokens_outside_window": 100,
                          "kept_fraction_global_alpha": 0.01, "kept_global_alpha": [3, 1], "kept_allocated": [1, 3]},
         "per_layer": _fid(4.0, 0.32, 0.9, 0.55), "global_equal_memory": _fid(3.5, 0.32, 0.88, 0.62),
         "global_grid": grid, "per_layer_minus_global": {"agreement": 0.02, "agreement_ci": [0.01, 0.03],
                                                         "nll": -0.07, "nll_ci": [-0.1, -0.04], "memory": 0.0}}
    text = "\n".join(per_layer_section(r))
    assert "python3 -m evals.layer_study" in text and "--fidelity-n 2" in text
    assert "| per-layer, alpha_high = 4 x multipliers | 32.0% | 0.9000 |" in text
    assert "top-1 agreement +2.00 pts [+1.00, +3.00] (per-layer better)" in text
    assert "NLL -0.0700 [-0.1000, -0.0400] (per-layer better)" in text
    assert "| multiplier | 0.50 | 2.00 |" in text and "| kept, allocated | 1 | 3 |" in text
    assert "The shipped settings file (`diffkv_serve/engine/model_settings/smollm2-135m-instruct-q4_1.json`)" in text
