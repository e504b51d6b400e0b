import math
import os

import pytest
import torch

from diffkv_serve.kernels.prompt_significance import (prompt_significance, prompt_significance_count, significance_count)

# The interpreter reads scalar loads used as loop bounds through a deprecated numpy conversion.
pytestmark = pytest.mark.filterwarnings("ignore:Conversion of an array with ndim:DeprecationWarning")

DEVICE = os.environ.get("DIFFKV_TEST_DEVICE", "cpu")
# Sums of up to Q probabilities (each <= 1): absolute and relative tolerance alike.
TOL = {torch.float32: 1e-4, torch.float16: 3e-3, torch.bfloat16: 2e-2}
DTYPES = [torch.float32] + ([torch.float16, torch.bfloat16] if DEVICE.startswith("cuda") else [])
SEQLENS = [1, 5, 64, 65, 200]


def _inputs(seqlens, Hq, Hkv, D, dtype, seed):
    torch.manual_seed(seed)
    N = sum(seqlens)
    q = torch.randn(N, Hq, D, device=DEVICE).to(dtype)
    k = (torch.randn(N, Hkv, D, device=DEVICE) * 1.5).to(dtype)  # spread logits: peaked, non-uniform softmax
    cu = torch.tensor([0] + seqlens).cumsum(0).to(torch.int32).to(DEVICE)
    return q, k, cu


def _naive(q, k, cu, scale, num_queries):
    """float64, one full causal probability matrix per sequence and query head."""
    q, k = q.double().cpu(), k.double().cpu()
    Hq, Hkv = q.shape[1], k.shape[1]
    group = Hq // Hkv
    out = torch.zeros(q.shape[0], Hkv, dtype=torch.float64)
    cu = cu.tolist()
    for s, e in zip(cu[:-1], cu[1:]):
        n = e - s
        if n == 0:
            continue
        causal = torch.ones(n, n, dtype=torch.bool).tril()
        probs = torch.stack([
            ((q[s:e, h] @ k[s:e, h // group].T) * scale).masked_fill(~causal, float("-inf")).softmax(-1)
            for h in range(Hq)])  # [Hq, n, n]
        last = probs[:, n - min(num_queries, n):]  # counted queries only
        out[s:e] = last.view(Hkv, group, -1, n).amax(1).sum(1).T
    return out


def _check(a, b, dtype):
    tol = TOL[dtype]
    torch.testing.assert_close(a.double().cpu(), b.double().cpu(), atol=tol, rtol=tol)


CASES = [  # Hq, Hkv, D, num_queries
    (2, 2, 64, 64),
    (6, 2, 64, 8),
    (8, 2, 128, 64),
    (4, 4, 128, 8),
    (3, 1, 64, 64),
]


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("Hq,Hkv,D,nq", CASES)
def test_matches_naive(dtype, Hq, Hkv, D, nq):
    q, k, cu = _inputs(SEQLENS, Hq, Hkv, D, dtype, seed=Hq * 10 + D + nq)
    scale = 1 / math.sqrt(D)
    want = _naive(q, k, cu, scale, nq)
    out = torch.full((q.shape[0], Hkv), float("nan"), device=DEVICE)  # poison: every row must be written
    prompt_significance(q, k, cu, scale, num_queries=nq, impl="triton", out=out)
    _check(out, want, dtype)
    _check(prompt_significance(q, k, cu, scale, num_queries=nq, impl="ref"), want, dtype)


@pytest.mark.parametrize("impl", ["triton", "ref"])
def test_given_lse(impl):
    """A caller-supplied natural-log lse (e.g. from prefill attention) gives the same sums as pass 1."""
    Hq, Hkv, D, nq = 4, 2, 64, 16
    q, k, cu = _inputs(SEQLENS, Hq, Hkv, D, torch.float32, seed=7)
    scale = 1 / math.sqrt(D)
    lse = torch.empty(q.shape[0], Hq, device=DEVICE)
    for s, e in zip(cu.tolist()[:-1], cu.tolist()[1:]):
        logits = torch.einsum("ihd,jhd->hij", q[s:e], k[s:e].repeat_interleave(Hq // Hkv, 1)) * scale
        causal = torch.ones(e - s, e - s, dtype=torch.bool, device=DEVICE).tril()
        lse[s:e] = logits.masked_fill(~causal, float("-inf")).logsumexp(-1).T
    got = prompt_significance(q, k, cu, scale, num_queries=nq, impl=impl, lse=lse, max_seqlen=max(SEQLENS))
    _check(got, _naive(q, k, cu, scale, nq), torch.float32)


def test_sums_and_counts():
    """Each counted query row contributes probabilities summing to 1 per head; max over a group of 1 keeps
    that, so a sequence's sums total exactly Q; counts are min(n - i, Q)."""
    q, k, cu = _inputs([1, 5, 70], 2, 2, 64, torch.float32, seed=3)
    sig = prompt_significance(q, k, cu, num_queries=8, impl="triton")
    for (s, e) in [(0, 1), (1, 6), (6, 76)]:
        torch.testing.assert_close(sig[s:e].sum(0).cpu(), torch.full((2,), float(min(8, e - s))))
    cnt = prompt_significance_count(cu, 8).cpu()
    assert cnt.tolist() == [1] + [5, 4, 3, 2, 1] + [8] * 62 + list(range(8, 0, -1))
    # Generation-time count: prompt of 10, 13 tokens processed, Q = 4.
    pos = torch.arange(13)
    assert significance_count(pos, 10, 13, 4).tolist() == [7] * 7 + [6, 5, 4] + [3, 2, 1]


def test_empty_sequence():
    q, k, cu = _inputs([3, 0, 4], 2, 1, 64, torch.float32, seed=5)
    got = prompt_significance(q, k, cu, num_queries=64, impl="triton")
    _check(got, _naive(q, k, cu, 1 / 8, 64), torch.float32)


def _suffix_significance(q, k, cu, seqlens, suffix, Q, impl):
    """Sums from each sequence's last `suffix` queries only (cu_seqlens_q), as after a prefix-cache hit: the
    rows of those queries and the sums."""
    rows = torch.cat([torch.arange(e - n, e) for e, n in zip(cu[1:].tolist(), suffix)]).to(DEVICE)
    cu_q = torch.tensor([0] + suffix).cumsum(0).to(torch.int32).to(DEVICE)
    return rows, prompt_significance(q[rows].contiguous(), k, cu, 0.15, num_queries=Q, impl=impl,
                                     max_seqlen=max(seqlens), cu_seqlens_q=cu_q)


@pytest.mark.parametrize("impl", ["triton", "ref"])
def test_significance_with_only_suffix_queries(impl):
    """q holds only each sequence's last queries (cu_seqlens_q; a cached prefix precedes them): the sums
    equal those computed from the whole sequence's queries."""
    dtype = DTYPES[-1]
    seqlens, suffix, Q = [70, 9, 130], [8, 9, 20], 8
    q, k, cu = _inputs(seqlens, 6, 2, 64, dtype, seed=3)
    whole = prompt_significance(q, k, cu, 0.15, num_queries=Q, impl="ref")
    rows, got = _suffix_significance(q, k, cu, seqlens, suffix, Q, impl)
    _check(got, whole, dtype)
    _check(whole, _naive(q, k, cu, 0.15, Q), dtype)


@pytest.mark.parametrize("impl", ["triton", "ref"])
def test_suffix_shorter_than_the_counted_queries_scores_its_own_tokens_in_full(impl):
    """Fewer computed queries than Q (a cached prefix covers the rest): the counted queries are the computed
    ones, and the suffix tokens' sums equal those from every query (the missing ones precede them)."""
    dtype = DTYPES[-1]
    seqlens, suffix, Q = [70, 40, 130], [3, 1, 20], 32
    q, k, cu = _inputs(seqlens, 6, 2, 64, dtype, seed=5)
    whole = prompt_significance(q, k, cu, 0.15, num_queries=Q, impl="ref")
    rows, got = _suffix_significance(q, k, cu, seqlens, suffix, Q, impl)
    _check(got[rows], whole[rows], dtype)
    assert bool((got != whole).any())  # the prefix tokens lost the queries inside the prefix


@pytest.mark.parametrize("impl", ["triton", "ref"])
def test_trailing_empty_sequences_and_a_larger_length_bound(impl):
    """A graphed prompt step's layout: empty sequences after the real ones and max_seqlen the bucket's size."""
    seqlens = [5, 70, 3]
    q, k, cu, = _inputs(seqlens, 4, 2, 64, torch.float32, seed=11)
    cu_pad = torch.cat([cu, cu[-1:].repeat(3)])
    got = prompt_significance(q, k, cu_pad, num_queries=64, impl=impl, max_seqlen=256)
    _check(got, _naive(q, k, cu, 1 / 8, 64), torch.float32)
