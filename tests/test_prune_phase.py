"""Pruning ablations on the tiny random model: which tokens may be pruned (CacheConfig.prune_phase, per request
kv_compression.prune_phase) and the per-(layer, KV head) record of what was pruned (CacheConfig.record_pruning,
LLMEngine.token_classes)."""
import pytest
import torch
from pydantic import ValidationError

from diffkv_serve.engine import EngineConfig, SamplingParams
from diffkv_serve.engine.errors import InvalidRequestError
from diffkv_serve.engine.kv.policy import KEPT_HIGH, KEPT_LOW, PRUNED
from diffkv_serve.engine.llm_engine import LLMEngine
from diffkv_serve.engine.loader import load_checkpoint
from engine_helpers import TEST_DEVICE, assert_all_pages_free, run_all

WINDOW = 4
STRICT = {"alpha_high": 2.0, "alpha_low": 2.0}  # no low section: everything below alpha_high / i is pruned
_TINY = None


def tiny(eager=True, **cache):
    global _TINY
    if _TINY is None:
        _TINY = load_checkpoint("random:tiny")
    cache = {"kv_mode": "diffkv", "block_size": 4, "window": WINDOW, "alpha_high": 2.0, "alpha_low": 0.8,
             "significance_queries": 8, "num_pages": 4096, "record_pruning": True, **cache}
    cfg = EngineConfig(device=TEST_DEVICE, max_model_len=256, enforce_eager=eager,
                       scheduler={"max_num_seqs": 4, "max_num_batched_tokens": 512}, cache=cache)
    return LLMEngine(cfg, checkpoint=_TINY)


def prompts(seed=0):
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(1, 512, (n,), generator=g).tolist() for n in (40, 23, 61)]


def run(engine, max_tokens, **kw):
    outs = run_all(engine, prompts(), SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True), **kw)
    assert_all_pages_free(engine)
    return outs


def classes(out):
    return out.kv_usage["token_classes"]


def pruned_at(out, lo=0, hi=None):
    """(layer, head, position) entries pruned among positions [lo, hi)."""
    return int((classes(out)[..., lo:hi] == PRUNED).sum())


def test_record_matches_token_counts_and_keeps_the_window():
    eng = tiny()
    L, H = eng.arch.num_layers, eng.arch.num_kv_heads
    kinds = set()
    for out in run(eng, 12):
        c = classes(out)
        n = len(out.prompt_token_ids) + len(out.token_ids) - 1  # the last token's K/V is never written
        assert c.dtype == torch.int8 and c.shape == (L, H, n) and c.device.type == "cpu"
        u = out.kv_usage
        assert int((c == KEPT_HIGH).sum()) == u["tokens_high"]
        assert int((c == KEPT_LOW).sum()) == u["tokens_low"]
        assert int((c == PRUNED).sum()) == u["tokens_pruned"]
        assert (c[..., -WINDOW:] == KEPT_HIGH).all()  # the recent window is always kept high
        kinds |= set(c.unique().tolist())
    assert kinds == {PRUNED, KEPT_LOW, KEPT_HIGH}


def test_record_does_not_change_the_outputs_and_is_off_by_default():
    off = run(tiny(record_pruning=False), 12)
    assert all("token_classes" not in o.kv_usage for o in off)
    on = run(tiny(), 12)
    assert [o.token_ids for o in on] == [o.token_ids for o in off]


def test_token_classes_of_a_running_request():
    eng = tiny()
    ids = prompts()[0]
    eng.add_request("r", ids, SamplingParams(temperature=0, max_tokens=6, ignore_eos=True))
    with pytest.raises(KeyError, match="not running"):
        eng.token_classes("r")  # queued: not prefilled yet
    eng.step()  # the prefill
    c = eng.token_classes("r")
    usage = eng.kv_usage(eng.requests["r"])
    assert c.shape[-1] == len(ids) and int((c == PRUNED).sum()) == usage["tokens_pruned"] > 0
    while eng.has_unfinished_requests():
        eng.step()
    with pytest.raises(KeyError):
        eng.token_classes("r")
    assert_all_pages_free(eng)


def test_record_needs_the_local_executor_and_synchronous_steps():
    with pytest.raises(ValueError, match="record_pruning"):
        EngineConfig(tensor_parallel_size=2, cache={"kv_mode": "diffkv", "record_pruning": True})
    with pytest.raises(ValueError, match="record_pruning"):
        EngineConfig(scheduler={"async_scheduling": "on"}, cache={"kv_mode": "diffkv", "record_pruning": True})


def test_prompt_phase_never_prunes_a_generated_token():
    outs, both = run(tiny(prune_phase="prompt", **STRICT), 24), run(tiny(**STRICT), 24)
    for o in outs:
        n0 = len(o.prompt_token_ids)
        assert pruned_at(o, n0) == 0
        assert pruned_at(o, 0, n0) > 0  # the prompt still loses tokens
    assert sum(pruned_at(b, len(b.prompt_token_ids)) for b in both) > 0  # where both phases prune them


def test_generation_phase_never_prunes_a_prompt_token():
    outs, both = run(tiny(prune_phase="generation", **STRICT), 24), run(tiny(**STRICT), 24)
    for o, b in zip(outs, both):
        n0 = len(o.prompt_token_ids)
        assert pruned_at(o, 0, n0) == 0
        assert pruned_at(b, 0, n0) > 0
    assert sum(pruned_at(o, len(o.prompt_token_ids)) for o in outs) > 0  # decode steps do prune generated ones
    # Right after the prefill nothing at all is pruned.
    assert all(pruned_at(o) == 0 for o in run(tiny(prune_phase="generation", **STRICT), 1))


def test_both_phases_is_the_default():
    a, b = run(tiny(), 16), run(tiny(prune_phase="both"), 16)
    assert [o.token_ids for o in a] == [o.token_ids for o in b]
    assert all(torch.equal(classes(x), classes(y)) for x, y in zip(a, b))
    assert sum(pruned_at(o) for o in a) > 0


@pytest.mark.parametrize("phase", ["prompt", "generation"])
def test_per_request_phase_equals_the_engine_setting(phase):
    want = run(tiny(prune_phase=phase, **STRICT), 16)
    got = run(tiny(**STRICT), 16, kv_compression={"prune_phase": phase})
    assert [o.token_ids for o in got] == [o.token_ids for o in want]
    assert all(torch.equal(classes(x), classes(y)) for x, y in zip(got, want))


def test_mixed_phases_in_one_batch():
    eng = tiny(**STRICT)
    sp = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    for i, (p, phase) in enumerate(zip(prompts(), ("prompt", "generation", "both"))):
        eng.add_request(str(i), p, sp, kv_compression={"prune_phase": phase})
    done = {}
    while eng.has_unfinished_requests():
        done.update((o.request_id, o) for o in eng.step() if o.finished)
    assert_all_pages_free(eng)
    n0 = [len(p) for p in prompts()]
    assert pruned_at(done["0"], n0[0]) == 0 and pruned_at(done["0"], 0, n0[0]) > 0
    assert pruned_at(done["1"], 0, n0[1]) == 0 and pruned_at(done["1"], n0[1]) > 0


@pytest.mark.skipif(not TEST_DEVICE.startswith("cuda"), reason="CUDA graphs exist on CUDA only")
@pytest.mark.parametrize("phase", ["prompt", "generation"])
def test_graph_replay_prunes_as_eager_steps(phase):
    # The captured plan reads each row's prunable range from the graph's static buffers.
    want = run(tiny(**STRICT), 24, kv_compression={"prune_phase": phase})
    got = run(tiny(eager=False, **STRICT), 24, kv_compression={"prune_phase": phase})
    assert [o.token_ids for o in got] == [o.token_ids for o in want]
    assert all(torch.equal(classes(x), classes(y)) for x, y in zip(got, want))


@pytest.mark.parametrize("bad", ["decode", 1, ""])
def test_per_request_phase_is_validated(bad):
    eng = tiny()
    with pytest.raises(InvalidRequestError) as e:
        eng.add_request("x", [1, 2, 3], SamplingParams(max_tokens=2), kv_compression={"prune_phase": bad})
    assert e.value.param == "kv_compression.prune_phase"
    assert not eng.has_unfinished_requests()


def test_phase_needs_the_thresholds_policy():
    with pytest.raises(ValueError, match="prune_phase"):
        EngineConfig(cache={"kv_mode": "diffkv", "policy": "budget", "prune_phase": "prompt"})
    eng = tiny(policy="budget", budget=0.5)
    with pytest.raises(InvalidRequestError) as e:
        eng.add_request("x", [1, 2, 3], SamplingParams(max_tokens=2), kv_compression={"prune_phase": "prompt"})
    assert e.value.param == "kv_compression.prune_phase"


def test_config_rejects_an_unknown_phase():
    with pytest.raises(ValueError, match="prune_phase"):
        EngineConfig(cache={"kv_mode": "diffkv", "prune_phase": "decode"})


def test_http_body_rejects_an_unknown_phase():
    from diffkv_serve.service.protocol import KVCompression

    assert KVCompression(prune_phase="prompt").prune_phase == "prompt"
    with pytest.raises(ValidationError) as e:
        KVCompression(prune_phase="decode")
    assert e.value.errors()[0]["loc"] == ("prune_phase",)
