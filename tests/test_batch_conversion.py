"""Compression becomes batch: on one page pool, a cache that holds fewer pages per token runs proportionally more
sequences, and while requests wait the running sequences hold (nearly) the whole pool, whatever the KV mode."""
import statistics

import pytest

from diffkv_serve.engine import LLMEngine, SamplingParams
from diffkv_serve.engine.config import EngineConfig
from engine_helpers import TEST_DEVICE, assert_all_pages_free

POOL = 60  # pages: memory-bound for 16 sequences of 16 + 64 tokens in every mode below
MODES = {
    "int8": {"kv_mode": "int8"},
    "int4": {"kv_mode": "int4"},
    # DiffKV's pruning alone (budget policy: each head keeps half its tokens, all at K8V8): int8's format, fewer
    # tokens; before the growth bound knew the policy, an empty low side reserved a page per head and step.
    "diffkv_budget": {"kv_mode": "diffkv", "policy": "budget", "budget": 0.5, "high": "K8V8", "low": "K8V8",
                      "window": 4},
    # Algorithm 1 with both sections in use
    "diffkv": {"kv_mode": "diffkv", "high": "K8V8", "low": "K4V4", "alpha_high": 1.0, "alpha_low": 0.5,
               "window": 4},
}


def _run(cache: dict) -> dict:
    eng = LLMEngine(EngineConfig(model="random:tiny", device=TEST_DEVICE,
                                 cache={**cache, "num_pages": POOL, "key_centering": "off"},
                                 scheduler={"max_num_seqs": 32}))
    sp = SamplingParams(temperature=0, max_tokens=64, ignore_eos=True)
    for i in range(16):
        eng.add_request(str(i), list(range(1 + i, 17 + i)), sp)
    use, batch, per_token, generated = [], [], [], 0
    while eng.has_unfinished_requests():
        generated += sum(len(o.new_token_ids) for o in eng.step())
        st = eng.stats()
        if st["num_waiting"] and st["cached_tokens"]:  # memory-bound: someone waits for pages
            use.append(st["pages_running"] / st["pages_total"])
            batch.append(st["num_running"])
            per_token.append(st["pages_running"] / st["cached_tokens"])
    assert generated == 16 * 64  # nothing dropped, whatever was preempted
    assert_all_pages_free(eng)
    return {"use": statistics.mean(use), "batch": statistics.mean(batch), "pages_per_token": statistics.mean(per_token)}


@pytest.fixture(scope="module")
def runs():
    return {m: _run(c) for m, c in MODES.items()}


@pytest.mark.parametrize("mode", list(MODES))
def test_waiting_requests_find_the_pool_full(runs, mode):
    """The scheduler reserves only what the next step can take: while requests wait, running sequences hold at
    least 90% of the pool."""
    assert runs[mode]["use"] >= 0.9, runs[mode]


@pytest.mark.parametrize("mode", ["int4", "diffkv_budget", "diffkv"])
def test_batch_follows_pages_per_token(runs, mode):
    """Mean batch against int8's grows (at least 90%) in proportion to how many fewer pages a token holds."""
    base, r = runs["int8"], runs[mode]
    assert r["batch"] / base["batch"] >= 0.9 * base["pages_per_token"] / r["pages_per_token"], (mode, r, base)


def test_pruning_runs_a_larger_batch_than_its_format(runs):
    """The budget policy keeps half the tokens in int8's format: it must run a clearly larger batch than int8."""
    assert runs["diffkv_budget"]["pages_per_token"] < 0.9 * runs["int8"]["pages_per_token"]
    assert runs["diffkv_budget"]["batch"] > 1.2 * runs["int8"]["batch"]
