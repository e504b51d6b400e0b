"""Compression becomes batch (issue 36): on one pool of bytes, a KV mode that holds fewer bytes per cached token
runs a proportionally larger mean batch while requests wait, so batch x bytes per token is (nearly) the pool's
bytes over a sequence's mean length, whatever the mode. A regression in prompt reservation, admission, decode
growth or page accounting that leaves the pool partly idle breaks the proportion for the modes it touches.

Each mode runs the same requests on random:tiny until POOL_BOUND_STEPS steps have had requests waiting, then aborts
the rest. The pool is bytes (kv_cache_memory_gb), not pages: single-precision pages carry no score / position rows,
so they are smaller than diffkv's."""
import statistics

import pytest
import torch

from diffkv_serve.engine import EngineConfig, LLMEngine, SamplingParams
from diffkv_serve.engine.loader import load_checkpoint
from engine_helpers import TEST_DEVICE, assert_all_pages_free

FP16_PAGE_BYTES = 1056  # a tracked 4-token fp32 page at head_dim 32
POOL_GB = 320 * FP16_PAGE_BYTES / 2**30  # fp16 runs about 4 sequences, diffkv about 29
POOL_BOUND_STEPS = 80  # about one request's lifetime (48-112 generated tokens)
# More than any mode's pool runs at once (diffkv_pruned's first admission takes 72), so pages, not the request
# count (max_num_seqs below), bound every batch: _run checks it.
NUM_REQUESTS = 96
DIFFKV = {"kv_mode": "diffkv", "high": "K4V4", "low": "K2V2", "window": 4, "alpha_high": 8.0}
MODES = {
    "fp16": {"kv_mode": "fp16"},
    "int8": {"kv_mode": "int8"},
    "int4": {"kv_mode": "int4"},
    # Beyond the window nearly every token goes low (K2V2) or is pruned (about 40%): about 0.85 of int4's bytes
    # per token on these short requests (each head's window keeps a mostly empty high page).
    "diffkv": {**DIFFKV, "alpha_low": 0.9},
    # The same under learned prompt reservation (SchedulerConfig.reservation): a quantile of what prompts kept
    "diffkv_learned": {**DIFFKV, "alpha_low": 0.9},
    # Half the tokens pruned, nearly none low: about 0.7 of int4's bytes per token.
    "diffkv_pruned": {**DIFFKV, "alpha_high": 2.0, "alpha_low": 1.0},
    # DiffKV's pruning alone (budget policy: each head keeps half its tokens, all at K8V8): int8's format, fewer
    # tokens. A policy that never demotes must reserve no low page (MemoryManager.low_grows).
    "diffkv_budget": {"kv_mode": "diffkv", "policy": "budget", "budget": 0.5, "high": "K8V8", "low": "K8V8",
                      "window": 4},
}
RESERVATION = {"diffkv_learned": "learned"}  # the others: worst_case
DIFFKV_MODES = ["diffkv", "diffkv_learned", "diffkv_pruned", "diffkv_budget"]
TINY = None


def _engine(cache: dict, reservation: str) -> LLMEngine:
    global TINY
    if TINY is None:
        TINY = load_checkpoint("random:tiny")
    cfg = EngineConfig(device=TEST_DEVICE, max_model_len=256, enforce_eager=True,
                       # every waiting prompt may be admitted in one step, whatever its length: only pages limit
                       scheduler={"max_num_seqs": NUM_REQUESTS, "max_num_batched_tokens": 4096,
                                  "reservation": reservation},
                       cache={"block_size": 4, "kv_cache_memory_gb": POOL_GB, "key_centering": "off",
                              "enable_prefix_caching": False, **cache})
    return LLMEngine(cfg, checkpoint=TINY)


def _run(cache: dict, reservation: str) -> dict:
    """Mean running batch, bytes held per cached token (ratio of the sums) and pool use over the steps with
    requests waiting."""
    eng = _engine(cache, reservation)
    g = torch.Generator().manual_seed(0)
    for i in range(NUM_REQUESTS):
        prompt = torch.randint(1, 500, (int(torch.randint(16, 49, (1,), generator=g)),), generator=g).tolist()
        gen = 48 + 8 * (i * 7 % 9)  # lengths interleaved: neighbours in the queue finish at different steps
        eng.add_request(str(i), prompt, SamplingParams(temperature=0, max_tokens=gen, ignore_eos=True))
    batch, held, tokens, use, steps = [], 0, 0, [], 0
    while len(batch) < POOL_BOUND_STEPS:
        eng.step()
        steps += 1
        assert steps <= 2 * POOL_BOUND_STEPS, f"{cache}: only {len(batch)} of {steps} steps had requests waiting"
        st = eng.stats()
        assert st["num_running"] < NUM_REQUESTS, f"{cache}: the request count, not the pool, bounds the batch"
        if not st["num_waiting"]:
            continue
        batch.append(st["num_running"])
        held += st["pages_used"] * st["page_bytes"]
        tokens += st["cached_tokens"]
        use.append(st["pages_used"] / st["pages_total"])
    for i in range(NUM_REQUESTS):
        eng.abort(str(i))
    assert_all_pages_free(eng)
    mean_batch, bytes_per_token = statistics.mean(batch), held / tokens
    return {"batch": mean_batch, "bytes_per_token": bytes_per_token, "product": mean_batch * bytes_per_token,
            "use": statistics.mean(use)}


@pytest.fixture(scope="module")
def runs():
    # One thread: random:tiny's ops are too small to split, and on a busy 2-core machine a second thread makes
    # each step several times slower (about 4 s for all modes instead of 30).
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        out = {m: _run(c, RESERVATION.get(m, "worst_case")) for m, c in MODES.items()}
    finally:
        torch.set_num_threads(threads)
    for m, r in out.items():
        print(f"{m:14s} batch {r['batch']:6.2f}  bytes/token {r['bytes_per_token']:7.1f}  product {r['product']:7.0f}"
              f"  pool use {r['use']:.3f}")
    return out


def test_fewer_bytes_per_token_in_mode_order(runs):
    """The premise: each mode holds measurably fewer bytes per cached token than the one before it (measured:
    int8 0.31 of fp16, int4 0.60 of int8, diffkv 0.86 (either reservation) and diffkv_pruned 0.68 of int4)."""
    r = {m: runs[m]["bytes_per_token"] for m in runs}
    assert r["int8"] < 0.5 * r["fp16"] and r["int4"] < 0.8 * r["int8"], r
    assert max(r["diffkv"], r["diffkv_learned"]) < 0.92 * r["int4"] and r["diffkv_pruned"] < 0.8 * r["int4"], r


@pytest.mark.parametrize("mode", ["fp16", "int8", "int4", *DIFFKV_MODES])
def test_waiting_requests_find_the_pool_used(runs, mode):
    """While requests wait, the running sequences hold most of the pool. fp16 runs 4-5 sequences of 64-160 pages
    each in 330: a prompt it cannot fit yet leaves up to that much idle (measured 0.90, the others 0.94-0.97)."""
    assert runs[mode]["use"] >= 0.85, runs[mode]


@pytest.mark.parametrize("mode", ["fp16", "int8", *DIFFKV_MODES])
def test_batch_follows_bytes_per_token(runs, mode):
    """Batch x bytes per token within 15% of int4's: the batch grows in proportion to the bytes a token no longer
    holds. Measured within 14% (fp16 0.92, for its idle share above; diffkv 1.01; diffkv_pruned 1.13, whose
    first admission takes 72 fresh, short sequences); the margin covers float sums that differ with the thread
    count (other tokens and significances), never a pool left a fifth idle."""
    ratio = runs[mode]["product"] / runs["int4"]["product"]
    assert 0.85 <= ratio <= 1.15, (mode, runs[mode], runs["int4"])


def test_pruning_runs_a_larger_batch_than_its_format(runs):
    """The budget policy keeps half the tokens in int8's format: fewer bytes per token, a clearly larger batch."""
    b, q = runs["diffkv_budget"], runs["int8"]
    assert b["bytes_per_token"] < 0.9 * q["bytes_per_token"] and b["batch"] > 1.2 * q["batch"], (b, q)


@pytest.mark.parametrize("mode", DIFFKV_MODES[:3])
def test_diffkv_runs_a_larger_batch_than_int4(runs, mode):
    """DiffKV's extra compression over int4 becomes batch: more sequences, by at least 85% of the bytes ratio."""
    d, q = runs[mode], runs["int4"]
    assert d["batch"] > q["batch"], (d, q)
    assert d["batch"] / q["batch"] >= 0.85 * q["bytes_per_token"] / d["bytes_per_token"], (d, q)
