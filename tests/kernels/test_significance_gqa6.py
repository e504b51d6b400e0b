"""Significance under Qwen2.5-1.5B's GQA (12 query heads over 2 KV heads, a group of 6, head_dim 128): a KV
head's score is the max over its 6 query heads, in the prompt kernel and in the decode-step score update. Checked
against torch computations written here from the definition (one query head at a time, softmax over the head's
kept tokens), not against the kernels' own references."""
import math
import os

import pytest
import torch

from _paged_cache import build_cache, formats
from diffkv_serve.kernels.decode_attention import paged_decode_attention
from diffkv_serve.kernels.prompt_significance import prompt_significance
from diffkv_serve.kernels.quant import read_rows_ref
from diffkv_serve.kernels.score_update import accumulate_scores

pytestmark = pytest.mark.filterwarnings("ignore:Conversion of an array with ndim:DeprecationWarning")
DEVICE = os.environ.get("DIFFKV_TEST_DEVICE", "cpu")
HQ, HKV, D = 12, 2, 128
GROUP = HQ // HKV


def _prompt_sig_by_definition(q, k, cu, scale, nq):
    """float64: per KV head, sum over the last nq queries of max over its query heads of the causal softmax."""
    q, k = q.double().cpu(), k.double().cpu()
    out = torch.zeros(k.shape[0], HKV, dtype=torch.float64)
    bounds = cu.tolist()
    for s, e in zip(bounds[:-1], bounds[1:]):
        n = e - s
        for h in range(HKV):
            best = torch.zeros(min(nq, n), n, dtype=torch.float64)
            for hq in range(HQ):
                if hq // GROUP != h:  # HF repeat_kv: query head hq reads KV head hq // group
                    continue
                logits = (q[s:e, hq] @ k[s:e, h].T) * scale  # [n, n]
                causal = torch.ones(n, n, dtype=torch.bool).tril()
                p = logits.masked_fill(~causal, float("-inf")).softmax(-1)[n - min(nq, n):]
                best = torch.maximum(best, p)
            out[s:e, h] = best.sum(0)
    return out


@pytest.mark.parametrize("nq", [64, 16])
@pytest.mark.parametrize("impl", ["triton", "ref"])
def test_prompt_significance_gqa6(impl, nq):
    g = torch.Generator().manual_seed(nq)
    seqlens = [90, 7, 33]
    N = sum(seqlens)
    # A few query heads that look at one token each: the max over the group must pick them up.
    q = torch.randn(N, HQ, D, generator=g)
    k = torch.randn(N, HKV, D, generator=g)
    q[:, 5] = k[3, 0] * 0.3  # head 5 (KV head 0) attends token 3 of the first sequence
    q[:, 11] = k[100, 1] * 0.3  # head 11 (KV head 1) attends a token of the third sequence
    cu = torch.tensor([0] + list(torch.tensor(seqlens).cumsum(0)), dtype=torch.int32)
    scale = 1 / math.sqrt(D)
    want = _prompt_sig_by_definition(q, k, cu, scale, nq)
    got = prompt_significance(q.to(DEVICE), k.to(DEVICE), cu.to(DEVICE), scale, num_queries=nq, impl=impl)
    torch.testing.assert_close(got.double().cpu(), want, atol=2e-5, rtol=2e-5)
    # The planted heads dominate (a quarter of the counted queries' mass at least): the max is really taken.
    assert want[3, 0] > 0.25 * min(nq, 90) and want[100, 1] > 0.25 * min(nq, 33)


@pytest.mark.parametrize("impl", ["triton", "ref"])
def test_decode_score_update_gqa6(impl):
    """One decode step (attention logits and score update both by `impl`) over a high (K4V4) and a low (K4V2) section: each kept token's score grows by the max
    over the KV head's 6 query heads of its softmax probability among that head's kept tokens."""
    dtype = torch.float32
    fmt_hi, fmt_lo = formats("K4V4+K4V2", D, 4)
    lens_hi = [[70, 5], [1, 40], [0, 12]]
    lens_lo = [[30, 0], [2, 17], [9, 0]]
    pool, page_table, len_hi, len_lo, _ = build_cache(fmt_hi, fmt_lo, dtype, HKV, lens_hi, lens_lo, DEVICE, seed=6)
    slots = torch.tensor([2, 0, 1], dtype=torch.int32, device=DEVICE)
    layer, B = 1, 3
    g = torch.Generator().manual_seed(1)
    q = torch.randn(B, HQ, D, generator=g).to(DEVICE)
    scale = 1 / math.sqrt(D)
    nmax = int((len_hi + len_lo).max()) + 2
    logits = torch.full((B, HQ, nmax), float("nan"), device=DEVICE)
    lse = torch.full((B, HQ), float("nan"), device=DEVICE)
    paged_decode_attention(q, pool, fmt_hi, dtype, page_table, len_hi, slots, layer, scale, fmt_low=fmt_lo,
                           len_low=len_lo, logits_out=logits, lse_out=lse, impl=impl)
    before = pool.view(torch.float32).clone()
    accumulate_scores(pool, fmt_hi, page_table, len_hi, slots, layer, logits, lse, fmt_low=fmt_lo, len_low=len_lo,
                      impl=impl)
    after = pool.view(torch.float32)

    P = page_table.shape[-1] - 1
    for b in range(B):
        s = int(slots[b])
        for h in range(HKV):
            rows = [(fmt_hi, int(page_table[s, layer, h, j // fmt_hi.tokens]), j % fmt_hi.tokens)
                    for j in range(int(len_hi[s, layer, h]))]
            rows += [(fmt_lo, int(page_table[s, layer, h, P - 1 - j // fmt_lo.tokens]), j % fmt_lo.tokens)
                     for j in range(int(len_lo[s, layer, h]))]
            if not rows:
                continue
            keys = torch.stack([read_rows_ref(pool, f, dtype, "k", torch.tensor(p), torch.tensor(r))
                                for f, p, r in rows]).double()  # [n, D] dequantized, high then low
            probs = torch.stack([((q[b, hq].double() @ keys.T) * scale).softmax(-1)
                                 for hq in range(h * GROUP, (h + 1) * GROUP)])  # [6, n]
            want = probs.amax(0)
            got = torch.stack([after[p, f.score_off // 4 + r] - before[p, f.score_off // 4 + r] for f, p, r in rows])
            torch.testing.assert_close(got.double(), want, atol=1e-5, rtol=1e-4)
