"""diffkv prefix caching shares pinned high-precision pages (docs/PREFIX_CACHING.md): greedy outputs equal with
caching on and off under the same pinning rule, pinned prompt blocks stay high while the rest is demoted and
pruned, and requests sharing a prefix hold its pages once (as many as int4 at the same high precision)."""
import pytest
import torch

from diffkv_serve.engine import EngineConfig, SamplingParams
from diffkv_serve.engine.config import CacheConfig
from diffkv_serve.engine.kv.policy import KEPT_HIGH
from diffkv_serve.engine.llm_engine import LLMEngine
from diffkv_serve.engine.loader import load_checkpoint

from engine_helpers import TEST_DEVICE, assert_all_pages_free

# A short window on the tiny random model, so a dozen decode steps demote and prune; more significance queries
# than a hit leaves computed (the suffix scores its tokens with the queries it has).
DIFFKV = {"kv_mode": "diffkv", "window": 4, "alpha_high": 2.0, "alpha_low": 0.5, "significance_queries": 16}
AGGRESSIVE = {"alpha_high": 8.0, "alpha_low": 2.0}


@pytest.fixture(scope="module")
def tiny():
    return load_checkpoint("random:tiny")


def _engine(tiny, cache, num_pages=600):
    cfg = EngineConfig(device=TEST_DEVICE, max_model_len=512, enforce_eager=True,
                       scheduler={"max_num_seqs": 8, "max_num_batched_tokens": 2048},
                       cache={"num_pages": num_pages, "block_size": 4, **cache})
    return LLMEngine(cfg, checkpoint=tiny)


def _prompts(block_tokens, num_blocks, suffixes):
    """A prefix of num_blocks whole blocks plus 3 tokens, then each request's own suffix (distinct tokens)."""
    g = torch.Generator().manual_seed(7)
    prefix = torch.randint(1, 500, (num_blocks * block_tokens + 3,), generator=g).tolist()
    return prefix, [prefix + torch.randint(1, 500, (n,), generator=g).tolist() for n in suffixes]


def _run(eng, prompts, max_tokens, settings=None):
    """Request 0 runs alone for two steps (its prefill caches the prefix), the others join; returns the final
    outputs in order."""
    params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True, logprobs=0)
    done = {}

    def step():
        for out in eng.step():
            if out.finished:
                done[out.request_id] = out

    eng.add_request("0", prompt_token_ids=prompts[0], sampling=params)
    step()
    step()
    for i, p in enumerate(prompts[1:], 1):
        eng.add_request(str(i), prompt_token_ids=p, sampling=params, kv_compression=(settings or {}).get(i))
    while eng.has_unfinished_requests():
        step()
    return [done[str(i)] for i in range(len(prompts))]


def test_greedy_outputs_equal_with_sharing_on_and_off_under_the_pinning_rule(tiny):
    on_eng = _engine(tiny, {**DIFFKV, "enable_prefix_caching": True, "record_pruning": True})
    off_eng = _engine(tiny, {**DIFFKV, "enable_prefix_caching": False, "pin_prompt_blocks": True,
                             "record_pruning": True})
    T = on_eng.mm.prefix_block_tokens
    assert on_eng.runner.kv.pins_prompt_blocks and off_eng.runner.kv.pins_prompt_blocks
    _, prompts = _prompts(T, 3, [9, 13, 17])
    on = _run(on_eng, prompts, 14, {1: AGGRESSIVE})
    off = _run(off_eng, prompts, 14, {1: AGGRESSIVE})
    assert [o.token_ids for o in on] == [o.token_ids for o in off]
    assert [o.logprobs for o in on] == [o.logprobs for o in off]  # bit-equal, not only the same argmax
    keys = ("tokens", "tokens_high", "tokens_low", "tokens_pruned")
    assert [[o.kv_usage[k] for k in keys] for o in on] == [[o.kv_usage[k] for k in keys] for o in off]
    for a, b in zip(on, off):
        assert torch.equal(a.kv_usage["token_classes"], b.kv_usage["token_classes"])
        # the same pages, shared or owned: a reader owns none of the prefix's pages
        assert a.kv_usage["pages_used"] + a.kv_usage["pages_shared"] == b.kv_usage["pages_used"]
        assert b.kv_usage["pages_shared"] == 0
    # every whole block of a prompt is the cache's (read or inserted), its pages shared
    full = [len(p) // T for p in prompts]
    assert [o.kv_usage["pages_shared"] for o in on] == [n * on_eng.mm.heads_per_seq for n in full]
    st = on_eng.stats()
    assert st["prefix_cache_hits"] == 2 * 3 * T and st["prefix_cache_blocks"] == 3 + sum(n - 3 for n in full)
    # Every prompt's whole blocks stayed high; the aggressive request demoted and pruned what came after.
    for o, p in zip(on, prompts):
        pinned = len(p) // T * T
        classes = o.kv_usage["token_classes"]
        assert bool((classes[..., :pinned] == KEPT_HIGH).all())
    assert bool((on[1].kv_usage["token_classes"][..., 3 * T:] != KEPT_HIGH).any())
    assert on[1].kv_usage["tokens_pruned"] > on[2].kv_usage["tokens_pruned"]
    for eng in (on_eng, off_eng):
        assert_all_pages_free(eng)


def _pages_after_prefills(eng, prompts):
    """Pages the pool has handed out once every prompt ran its prefill, and each request's kv_usage then."""
    params = SamplingParams(temperature=0, max_tokens=3, ignore_eos=True)
    eng.add_request("0", prompt_token_ids=prompts[0], sampling=params)
    eng.step()
    for i, p in enumerate(prompts[1:], 1):
        eng.add_request(str(i), prompt_token_ids=p, sampling=params)
    eng.step()
    seqs = [eng.requests[str(i)] for i in range(len(prompts))]
    assert all(s.num_cached >= len(p) for s, p in zip(seqs, prompts))
    used = eng.mm.num_pages - eng.mm.free_pages()
    usage = [eng.kv_usage(s) for s in seqs]
    while eng.has_unfinished_requests():
        eng.step()
    assert_all_pages_free(eng)
    return used, usage


def test_requests_sharing_a_prefix_hold_its_pages_once_like_int4(tiny):
    n_req, n_blocks = 4, 4
    int4 = _engine(tiny, {"kv_mode": "int4", "enable_prefix_caching": True})
    share = _engine(tiny, {**DIFFKV, "high": "K4V4", "low": "K4V2", "enable_prefix_caching": True})
    copies = _engine(tiny, {**DIFFKV, "high": "K4V4", "low": "K4V2", "enable_prefix_caching": False,
                            "pin_prompt_blocks": True})
    heads = int4.mm.heads_per_seq
    # The same high precision, but int4's pages leave out the score and position rows diffkv keeps, so its
    # blocks hold a few more tokens: each engine gets a prefix of n_blocks of its own blocks.
    T = share.mm.prefix_block_tokens
    assert int4.mm.prefix_block_tokens > T == copies.mm.prefix_block_tokens
    _, prompts = _prompts(T, n_blocks, [8, 9, 10, 11])
    _, prompts_int4 = _prompts(int4.mm.prefix_block_tokens, n_blocks, [8, 9, 10, 11])
    used_int4, usage_int4 = _pages_after_prefills(int4, prompts_int4)
    used_share, usage_share = _pages_after_prefills(share, prompts)
    used_copies, _ = _pages_after_prefills(copies, prompts)
    prefix_pages = n_blocks * heads
    # One copy of the prefix, read by all: the pool holds the cached blocks plus what each request owns.
    for used, usage in ((used_int4, usage_int4), (used_share, usage_share)):
        assert [u["pages_shared"] for u in usage] == [prefix_pages] * n_req
        assert used == prefix_pages + sum(u["pages_used"] for u in usage)
    assert used_copies - used_share == (n_req - 1) * prefix_pages
    # Each request owns only its suffix, at most what int4 holds for it (the same pages per head of K4V4 high
    # tokens; diffkv's low section may take one page per head and pruning saves some).
    for s, i in zip(usage_share, usage_int4):
        assert s["pages_used"] <= i["pages_used"] + heads


def test_pinning_rule_is_a_validated_setting():
    assert CacheConfig(kv_mode="diffkv", enable_prefix_caching=True).pins_prompt_blocks()
    assert not CacheConfig(kv_mode="diffkv").pins_prompt_blocks()  # auto: off with caching off
    assert CacheConfig(kv_mode="diffkv", pin_prompt_blocks=True).pins_prompt_blocks()
    assert not CacheConfig(kv_mode="int4", pin_prompt_blocks=True).pins_prompt_blocks()
    assert CacheConfig(kv_mode="diffkv", enable_prefix_caching=True).describe()["pin_prompt_blocks"] is True
    assert "pin_prompt_blocks" not in CacheConfig(kv_mode="diffkv").describe()
    with pytest.raises(ValueError, match="pin_prompt_blocks=False with enable_prefix_caching=True"):
        CacheConfig(kv_mode="diffkv", enable_prefix_caching=True, pin_prompt_blocks=False)
    with pytest.raises(ValueError, match="need policy 'thresholds'"):
        CacheConfig(kv_mode="diffkv", policy="budget", enable_prefix_caching=True)
    with pytest.raises(ValueError, match="reservation 'learned'"):
        EngineConfig(cache={"kv_mode": "diffkv", "enable_prefix_caching": True},
                     scheduler={"reservation": "learned"})
