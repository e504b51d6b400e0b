"""Per-request compression settings (diffkv_serve/engine/kv/request_settings.py): checked and resolved once, when a request is
added; the HTTP request model runs the same checks; a prefill writes them into the policy's per-slot table and
decode steps read them there, copying nothing per step."""
import dataclasses
import math

import pydantic
import pytest
import torch

from diffkv_serve.engine import CacheConfig, EngineConfig, SamplingParams, model_runner
from diffkv_serve.engine.errors import InvalidRequestError
from diffkv_serve.engine.kv import policy
from diffkv_serve.engine.kv.request_settings import KVRequestSettings, resolve
from diffkv_serve.engine.llm_engine import LLMEngine
from diffkv_serve.engine.loader import load_checkpoint
from engine_helpers import TEST_DEVICE, assert_all_pages_free
from diffkv_serve.kernels.compression_plan import BIG
from diffkv_serve.service.protocol import KVCompression

_TINY = None
# Two requests whose thresholds differ enough to keep different tokens (the second prunes only its prompt).
STRICT = {"alpha_high": 4.0, "alpha_low": 1.5}
LOOSE = {"alpha_high": 0.5, "alpha_low": 0.1, "prune_phase": "prompt"}


def _engine(eager=True):
    global _TINY
    if _TINY is None:
        _TINY = load_checkpoint("random:tiny")
    cache = {"kv_mode": "diffkv", "block_size": 4, "window": 4, "alpha_high": 2.0, "alpha_low": 0.8,
             "significance_queries": 8, "num_pages": 4096}
    cfg = EngineConfig(device=TEST_DEVICE, max_model_len=256, enforce_eager=eager,
                       scheduler={"max_num_seqs": 4, "max_num_batched_tokens": 512}, cache=cache)
    return LLMEngine(cfg, checkpoint=_TINY)


def _prompts():
    g = torch.Generator().manual_seed(7)
    return [torch.randint(1, 512, (n,), generator=g).tolist() for n in (37, 52)]


GREEDY = SamplingParams(temperature=0, max_tokens=20, ignore_eos=True)


# ---- resolving ---------------------------------------------------------------------------------------------------
def test_resolve_fills_what_a_request_leaves_out_from_the_cache_config():
    cache = CacheConfig(kv_mode="diffkv", alpha_high=3.0, alpha_low=0.05, prune_phase="prompt")
    assert resolve(None, cache) == resolve({}, cache) == KVRequestSettings(3.0, 0.05, "prompt")
    assert resolve({"alpha_low": 0.5}, cache) == KVRequestSettings(3.0, 0.5, "prompt")
    got = resolve({"alpha_high": 1, "alpha_low": None, "prune_phase": "generation"}, cache)
    assert got == KVRequestSettings(1.0, 0.05, "generation") and isinstance(got.alpha_high, float)
    assert got.prefill_alpha_low == 0.0 and resolve(None, cache).prefill_alpha_low == 0.05
    with pytest.raises(dataclasses.FrozenInstanceError):
        got.alpha_high = 2.0


@pytest.mark.parametrize("bad, param", [
    ({"alpha_high": -1}, "kv_compression.alpha_high"),
    ({"alpha_high": math.nan}, "kv_compression.alpha_high"),
    ({"alpha_high": math.inf}, "kv_compression.alpha_high"),
    ({"alpha_high": 2e6}, "kv_compression.alpha_high"),
    ({"alpha_low": True}, "kv_compression.alpha_low"),
    ({"alpha_low": "x"}, "kv_compression.alpha_low"),
    ({"alpha_low": 3.5}, "kv_compression.alpha_low"),  # above the config's alpha_high 3.0
    ({"alpha_high": 0.1, "alpha_low": 0.5}, "kv_compression.alpha_low"),
    ({"prune_phase": "decode"}, "kv_compression.prune_phase"),
    ({"beta": 1}, "kv_compression"),
    ([("alpha_high", 1.0)], "kv_compression"),
])
def test_resolve_names_the_bad_field(bad, param):
    with pytest.raises(InvalidRequestError) as e:
        resolve(bad, CacheConfig(kv_mode="diffkv", alpha_high=3.0, alpha_low=0.05))
    assert e.value.param == param and param.split(".")[-1] in str(e.value)


def test_prune_phase_needs_the_threshold_policy():
    budget = CacheConfig(kv_mode="diffkv", policy="budget", budget=0.5)
    assert resolve({"prune_phase": "both"}, budget).prune_phase == "both"
    with pytest.raises(InvalidRequestError) as e:
        resolve({"prune_phase": "prompt"}, budget)
    assert e.value.param == "kv_compression.prune_phase"


@pytest.mark.parametrize("bad", [{"alpha_high": math.nan}, {"alpha_low": -0.5}, {"prune_phase": "decode"},
                                 {"alpha_high": 0.1, "alpha_low": 0.5}])
def test_http_request_model_runs_the_engines_checks(bad):
    cache = CacheConfig(kv_mode="diffkv", alpha_high=3.0, alpha_low=0.05)
    with pytest.raises(InvalidRequestError) as engine_error:
        resolve(bad, cache)
    with pytest.raises(pydantic.ValidationError) as http_error:
        KVCompression(**bad)
    assert str(engine_error.value) in str(http_error.value)


def test_untracked_low_pages_refuse_requests_that_would_prune_low_tokens():
    """At alpha_low 0 'auto' leaves score and position rows off low pages; only pruning a low token reads them, so a
    request asking to prune (alpha_low > 0) is refused, naming the field, and one at 0 passes."""
    cache = CacheConfig(kv_mode="diffkv", alpha_high=3.0, alpha_low=0.0)
    assert not cache.tracks_low_tokens() and cache.describe()["track_low"] is False
    assert resolve({"alpha_high": 8.0}, cache) == KVRequestSettings(8.0, 0.0, "both")
    with pytest.raises(InvalidRequestError) as e:
        resolve({"alpha_low": 0.1}, cache)
    assert e.value.param == "kv_compression.alpha_low" and "track_low" in str(e.value)
    tracked = cache.model_copy(update={"track_low": True})
    assert tracked.tracks_low_tokens() and resolve({"alpha_low": 0.1}, tracked).alpha_low == 0.1
    assert CacheConfig(kv_mode="diffkv", alpha_low=0.05).tracks_low_tokens()  # 'auto' with pruning on
    assert CacheConfig(kv_mode="diffkv", policy="budget", alpha_low=0.0).tracks_low_tokens()
    assert not CacheConfig(kv_mode="int4").tracks_low_tokens()
    with pytest.raises(pydantic.ValidationError, match="track_low"):
        CacheConfig(kv_mode="diffkv", alpha_low=0.02, track_low=False)
    with pytest.raises(ValueError, match="track_low"):  # alpha_low left to the settings file, checked when resolved
        CacheConfig(kv_mode="diffkv", track_low=False).tracks_low_tokens()


# ---- the per-slot table ------------------------------------------------------------------------------------------
def _run(engine, requests, usage=None):
    """Greedy token ids per request id; `usage` (a dict) collects each finished request's kv_usage."""
    for rid, ids, kv in requests:
        engine.add_request(rid, ids, GREEDY, kv_compression=kv)
    done = {}
    while engine.has_unfinished_requests():
        for o in engine.step():
            if o.finished:
                done[o.request_id] = o.token_ids
                if usage is not None:
                    usage[o.request_id] = o.kv_usage
    assert_all_pages_free(engine)
    return done


def test_prefill_writes_the_slot_table_and_decode_steps_copy_no_settings(monkeypatch):
    eng = _engine()
    runner, kv = eng.runner, eng.runner.kv
    writes, copies = [], []
    write = kv.write_slot_settings
    monkeypatch.setattr(kv, "write_slot_settings", lambda *a: (writes.append(a), write(*a))[1])
    to_device = runner._to_device
    monkeypatch.setattr(runner, "_to_device", lambda rows: (copies.append(len(rows)), to_device(rows))[1])
    float_copies = []  # any host -> device copy of floats (thresholds) by the runner or the policy
    for module in (model_runner, policy):
        def counted(values, dtype, device, _inner=module.to_device):
            if dtype.is_floating_point:
                float_copies.append(values)
            return _inner(values, dtype, device)
        monkeypatch.setattr(module, "to_device", counted)
    p = _prompts()
    eng.add_request("strict", p[0], GREEDY, kv_compression=STRICT)
    eng.add_request("loose", p[1], GREEDY, kv_compression=LOOSE)
    eng.step()  # both prompts' prefill
    assert len(writes) == 1 and len(float_copies) == 1  # the prefill's one copy of both sequences' thresholds
    seqs = eng.requests
    for rid, want, n0, (lo, hi) in (("strict", STRICT, len(p[0]), (0, BIG)), ("loose", LOOSE, len(p[1]), (0, len(p[1])))):
        slot = seqs[rid].slot
        assert kv.slot_alphas[:, slot].tolist() == pytest.approx([want["alpha_high"], want["alpha_low"],
                                                                   want["alpha_low"]])
        assert kv.slot_ranges[:, slot].tolist() == [n0, lo, hi]
        assert seqs[rid].kv_settings == KVRequestSettings(want["alpha_high"], want["alpha_low"],
                                                          want.get("prune_phase", "both"))
    writes.clear()
    copies.clear()
    float_copies.clear()
    done = _run(eng, [])
    # Each decode step copies its ids, positions, slots and lengths only: the settings stay in the table.
    assert writes == [] and float_copies == [] and copies and set(copies) == {4}
    # Each request keeps what it would keep alone.
    alone = {rid: _run(_engine(), [(rid, ids, kvc)])[rid]
             for rid, ids, kvc in (("strict", p[0], STRICT), ("loose", p[1], LOOSE))}
    assert done == alone
    # The settings matter: the same prompt keeps different tokens under the other request's thresholds.
    usage = {}
    _run(_engine(), [("strict", p[0], STRICT), ("loose", p[0], LOOSE)], usage)
    assert usage["strict"]["tokens_pruned"] > usage["loose"]["tokens_pruned"]


@pytest.mark.skipif(not TEST_DEVICE.startswith("cuda"), reason="CUDA graphs exist on CUDA only")
def test_graph_replays_read_each_slots_settings():
    p = _prompts()
    requests = [("strict", p[0], STRICT), ("loose", p[1], LOOSE)]
    assert _run(_engine(eager=False), requests) == _run(_engine(eager=True), requests)
