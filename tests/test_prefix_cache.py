"""Prefix caching (diffkv_serve/engine/kv/prefix_cache.py): the index alone (LRU order, refcounts, chain keys),
greedy outputs equal with it on and off (fp16; diffkv in tests/test_diffkv_prefix_sharing.py), a repeated
1,000-token prefix computed once, and a property test of shared-prefix (fp16 and diffkv)
requests, aborts, preemptions and evictions that checks every page and reference after each operation."""
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from diffkv_serve.engine import EngineConfig, SamplingParams
from diffkv_serve.engine.llm_engine import LLMEngine
from diffkv_serve.engine.loader import load_checkpoint
from diffkv_serve.engine.kv.prefix_cache import PrefixCache, chain_keys

from engine_helpers import TEST_DEVICE, apply_op, assert_all_pages_free

GREEDY = SamplingParams(temperature=0, max_tokens=5, ignore_eos=True)
SHARED = ("You are a careful assistant. Answer briefly. Facts: the Nile is the longest river in Africa, Mount "
          "Everest is the highest mountain on Earth, water boils at 100 degrees Celsius. Question: ")
AGGRESSIVE = {"alpha_high": 6.0, "alpha_low": 1.5}  # most tokens leaving the window go low or are pruned


# ---- the index alone ---------------------------------------------------------------------------------------
def _insert_chain(pc, tokens):
    blocks = [pc.insert(*key) for key in chain_keys(tokens, pc.block_tokens, len(tokens) // pc.block_tokens)]
    pc.commit(blocks)
    return blocks


def test_lru_evicts_least_recently_released_and_children_first():
    pc = PrefixCache(block_tokens=2, max_blocks=8)
    a = _insert_chain(pc, [1, 2, 3, 4, 5, 6])  # 3 blocks, referenced by their writer
    b = _insert_chain(pc, [9, 9, 8, 8])  # another prompt: 2 blocks
    assert pc.num_evictable == 0 and pc.evict(5) == []  # referenced blocks never go
    pc.release(a)
    pc.release(b)
    # a was released first; within a prompt, its last block first (a child is useless without its parent)
    assert pc.num_evictable == 5
    hits, rest = pc.match([1, 2, 3, 4, 5, 6, 7], max_tokens=6)
    assert hits == a and rest == []
    pc.acquire(hits[:1])  # a's first block is read again: no longer evictable
    assert pc.evictable_excluding(a[1:]) == 2  # what scheduling a prompt could evict if it also read a[1:]
    assert pc.evict(3) == [a[2].block_id, a[1].block_id, b[1].block_id]
    pc.release(hits[:1])  # now the most recently used
    assert pc.evict(10) == [b[0].block_id, a[0].block_id]
    assert pc.num_cached == 0 and pc.match([1, 2, 3, 4], 4)[0] == []


def test_match_needs_the_whole_chain_ready_tokens_equal_and_respects_the_cap():
    pc = PrefixCache(block_tokens=2, max_blocks=2)
    keys = chain_keys([1, 2, 3, 4], 2, 2)
    first = pc.insert(*keys[0])
    assert pc.match([1, 2, 3, 4], 4)[0] == []  # written by a prefill that has not run yet
    pc.commit([first])
    pc.insert(*keys[1])
    assert pc.insert(*chain_keys([7, 7], 2, 1)[0]) is None  # no block id left
    hits, rest = pc.match([1, 2, 3, 4], 4)
    assert hits == [first] and [k[0] for k in rest] == [keys[1][0]]
    assert pc.match([1, 2, 3, 4], 3)[0] == [first]  # the cap counts whole blocks only
    assert pc.match([2, 1, 3, 4], 4)[0] == []  # same tokens, another order: another chain
    # a block under the same key with other tokens (a hash collision) is not a hit
    first.tokens = (5, 5)
    assert pc.match([1, 2, 3, 4], 4)[0] == []
    with pytest.raises(RuntimeError, match="released more often"):
        pc.release([first, first])


# ---- the engine on SmolLM2 ---------------------------------------------------------------------------------
def _run_shared_prefix(make_engine, cache, caching):
    """Request 0 runs alone; 1 (aggressive thresholds) and 2 arrive while it decodes and read its cached
    blocks, then all decode together. Returns the final outputs and the engine."""
    eng = make_engine(cache={**cache, "num_pages": 3000, "enable_prefix_caching": caching})
    eng.add_request("0", SHARED + "Which river is the longest?", GREEDY)
    done = {}

    def step():
        for out in eng.step():
            if out.finished:
                done[out.request_id] = out

    step()
    step()
    eng.add_request("1", SHARED + "What is the highest mountain?", GREEDY, kv_compression=AGGRESSIVE)
    eng.add_request("2", SHARED + "Where does water boil at 100 degrees?", GREEDY)
    while eng.has_unfinished_requests():
        step()
    return [done[str(i)] for i in range(3)], eng


def test_greedy_outputs_equal_with_caching_on_and_off(make_engine):
    cache = {"kv_mode": "fp16"}  # diffkv: tests/test_diffkv_prefix_sharing.py
    off, eng_off = _run_shared_prefix(make_engine, cache, False)
    on, eng = _run_shared_prefix(make_engine, cache, True)
    assert [o.token_ids for o in on] == [o.token_ids for o in off]
    st, st_off = eng.stats(), eng_off.stats()
    assert not st_off["prefix_cache_enabled"] and st_off["prefix_cache_queries"] == st_off["prefix_cache_blocks"] == 0
    assert eng_off.reset_prefix_cache() == 0
    assert st["prefix_cache_hits"] >= 2 * 32  # both later requests read at least two 16-token blocks
    assert st["prefill_tokens_computed"] == st_off["prefill_tokens_computed"] - st["prefix_cache_hits"]
    assert eng.runner.num_prefill_tokens == st["prefill_tokens_computed"]
    assert st["prefix_cache_pages"] > 0 and eng.mm.free_pages() < eng.mm.num_pages  # still cached
    assert eng.reset_prefix_cache() > 0
    assert eng.mm.free_pages() == eng.mm.num_pages and eng.stats()["prefix_cache_blocks"] == 0


def test_second_request_with_a_1000_token_prefix_computes_only_its_suffix(make_engine):
    eng = make_engine(cache={"kv_mode": "fp16", "num_pages": 6000, "enable_prefix_caching": True})
    prefix = (torch.arange(1000) * 7 % 5000 + 100).tolist()
    one = SamplingParams(temperature=0, max_tokens=1)
    eng.add_request("a", prefix + [11, 12, 13], one)
    while eng.has_unfinished_requests():
        eng.step()
    before, ran_before = eng.stats()["prefill_tokens_computed"], eng.runner.num_prefill_tokens
    assert before == 1003 == ran_before
    eng.add_request("b", prefix + [21, 22, 23, 24, 25], one)
    while eng.has_unfinished_requests():
        eng.step()
    st = eng.stats()
    # 62 whole 16-token blocks (992 tokens) are cached; the 8 prefix tokens of the partial block and the
    # 5-token suffix are computed
    assert st["prefix_cache_hits"] == 992 and st["prefix_cache_queries"] == 1003 + 1005
    assert st["prefill_tokens_computed"] - before == 13 == eng.runner.num_prefill_tokens - ran_before


def test_auto_turns_caching_on_for_single_precision_modes_only():
    from diffkv_serve.engine.config import CacheConfig

    assert CacheConfig(kv_mode="int4").prefix_caching() and CacheConfig(kv_mode="fp16").prefix_caching()
    assert not CacheConfig(kv_mode="diffkv").prefix_caching()
    assert CacheConfig(kv_mode="diffkv", enable_prefix_caching=True).prefix_caching()
    assert not CacheConfig(enable_prefix_caching=False).prefix_caching()


# ---- property test on a tiny random model --------------------------------------------------------------------
TINY = None
PREFIXES = [list(range(3, 3 + 13)), list(range(40, 40 + 9)), list(range(100, 100 + 22))]


def tiny_engine(mode, num_pages):
    global TINY
    if TINY is None:
        TINY = load_checkpoint("random:tiny")
    cache = {"kv_mode": mode, "num_pages": num_pages, "block_size": 4, "enable_prefix_caching": True}
    if mode == "diffkv":
        cache.update(window=4, alpha_high=2.0, alpha_low=0.5, significance_queries=4)
    cfg = EngineConfig(device=TEST_DEVICE, max_model_len=256, enforce_eager=True,
                       scheduler={"max_num_seqs": 4, "max_num_batched_tokens": 256}, cache=cache)
    return LLMEngine(cfg, checkpoint=TINY)


def _check_references(engine):
    """Each cached block is referenced exactly by the running sequences that hold it, and every rank's pages
    agree with that."""
    pc = engine.scheduler.prefix_cache
    held: dict[int, int] = {}
    for seq in engine.scheduler.running:
        for blk in seq.prefix_refs:
            held[blk.block_id] = held.get(blk.block_id, 0) + 1
    counts = pc.refcounts()
    assert {b: c for b, c in counts.items() if c} == held
    assert all(not s.prefix_refs for s in engine.scheduler.waiting)
    live = [s.slot for s in engine.scheduler.running if s.slot is not None]
    engine.mm.check_invariants(live, refcounts=counts)


ops = st.lists(st.one_of(
    st.tuples(st.just("add"), st.integers(0, 2), st.integers(0, 12), st.integers(1, 12)),
    st.tuples(st.just("step"), st.integers(1, 4), st.just(0), st.just(0)),
    st.tuples(st.just("abort"), st.integers(0, 9), st.just(0), st.just(0)),
    st.tuples(st.just("preempt"), st.just(0), st.just(0), st.just(0)),
    st.tuples(st.just("reset"), st.just(0), st.just(0), st.just(0)),
), max_size=25)


@pytest.mark.parametrize("mode", ["fp16", "diffkv"])
@settings(max_examples=20, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(op_list=ops, num_pages=st.integers(100, 300))
def test_shared_prefixes_aborts_preemptions_and_evictions_never_lose_a_page(mode, op_list, num_pages):
    engine = tiny_engine(mode, num_pages)
    g = torch.Generator().manual_seed(num_pages)
    ids = []
    for op, a, b, c in op_list:
        if op == "reset":
            engine.reset_prefix_cache()
        else:
            prompt = PREFIXES[a] + torch.randint(1, 500, (b,), generator=g).tolist() if op == "add" else None
            apply_op(engine, ids, op, a, prompt, c)
        _check_references(engine)
    while engine.has_unfinished_requests():
        engine.step()
        _check_references(engine)
    assert_all_pages_free(engine)
