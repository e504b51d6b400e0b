import math
import os

import pytest
import torch

from _paged_cache import build_cache, formats
from diffkv_serve.kernels.decode_attention import paged_decode_attention
from diffkv_serve.kernels.decode_attention.dispatch import paged_decode_attention_triton
from diffkv_serve.kernels.decode_attention.merge import SplitPartials, merge_splits_ref
from diffkv_serve.kernels.score_update import accumulate_scores, accumulate_scores_triton

pytestmark = pytest.mark.filterwarnings("ignore:Conversion of an array with ndim:DeprecationWarning")
DEVICE = os.environ.get("DIFFKV_TEST_DEVICE", "cpu")
# Scores are f32 sums of exp(logit - lse): compared to a float64 loop with these tolerances (atol = rtol).
TOL = {torch.float32: 1e-5, torch.float16: 1e-5, torch.bfloat16: 1e-5}  # keyed by cache dtype (scores are f32)
# The merged attention output (partials=) against merge_splits_ref's f32, by the output's dtype.
OUT_TOL = {torch.float32: 1e-5, torch.float16: 2e-3, torch.bfloat16: 1.6e-2}
DTYPES = [torch.float32] + ([torch.float16, torch.bfloat16] if DEVICE.startswith("cuda") else [])


def _naive(pool, fmt_hi, fmt_lo, page_table, len_hi, len_lo, slots, layer, logits, lse, skip_low=()):
    """float64 loop: expected score segment of every page after the update (slots in skip_low: high only)."""
    pool, page_table, logits, lse = pool.cpu(), page_table.cpu(), logits.double().cpu(), lse.double().cpu()
    scores = pool.view(torch.float32).double().clone()
    B, Hq, _ = logits.shape
    Hkv = page_table.shape[2]
    G = Hq // Hkv
    P = page_table.shape[3] - 1
    for b in range(B):
        s = int(slots[b])
        for h in range(Hkv):
            n_hi = int(len_hi[s, layer, h])
            rows = [(fmt_hi, int(page_table[s, layer, h, j // fmt_hi.tokens]), j % fmt_hi.tokens, j)
                    for j in range(n_hi)]
            if fmt_lo is not None and s not in skip_low:
                T = fmt_lo.tokens
                rows += [(fmt_lo, int(page_table[s, layer, h, P - 1 - j // T]), j % T, n_hi + j)
                         for j in range(int(len_lo[s, layer, h]))]
            for f, p, r, idx in rows:
                prob = max(math.exp(float(logits[b, g, idx] - lse[b, g])) for g in range(h * G, (h + 1) * G))
                scores[p, f.score_off // 4 + r] += prob
    return scores


@pytest.mark.parametrize("spec,gated", [("K16V16", False), ("K8V4", False), ("K4V2", False), ("K8V4+K4V2", False),
                                        ("K8V4+K4V2", True)])
@pytest.mark.parametrize("Hq,Hkv,num_splits", [(2, 2, None), (6, 2, 1), (8, 2, 3)])
def test_accumulate_scores(spec, gated, Hq, Hkv, num_splits):
    """gated: slots 2 and 3 decode at alpha_low 0, so their low sections' scores stay as they are."""
    for dtype in DTYPES:
        isz = torch.empty((), dtype=dtype).element_size()
        fmt_hi, fmt_lo = formats(spec, 64, isz)
        th = fmt_hi.tokens
        lens_hi = [[1, th + 1], [th, 0], [0, 3], [2 * th + 5, 0], [130, 90]]
        lens_lo = None if fmt_lo is None else [[fmt_lo.tokens, 1], [0, 2], [0, fmt_lo.tokens + 1], [3, 0],
                                               [70, 200]]
        pool, page_table, len_hi, len_lo, _ = build_cache(fmt_hi, fmt_lo, dtype, Hkv, lens_hi, lens_lo, DEVICE,
                                                          seed=Hq + len(spec))
        slots = torch.tensor([4, 2, 0, 3, 1], dtype=torch.int32, device=DEVICE)
        B, layer = len(slots), 1
        total = len_hi + (len_lo if len_lo is not None else 0)
        nmax = int(total.max()) + 3
        # Real logits / lse of a decode step (entries past a head's tokens stay NaN: never read).
        q = torch.randn(B, Hq, 64, device=DEVICE).to(dtype)
        logits = torch.full((B, Hq, nmax), float("nan"), device=DEVICE)
        lse = torch.full((B, Hq), float("nan"), device=DEVICE)
        paged_decode_attention(q, pool, fmt_hi, dtype, page_table, len_hi, slots, layer, fmt_low=fmt_lo,
                               len_low=len_lo, logits_out=logits, lse_out=lse)
        alpha_low = torch.tensor([0.02, 0.5, 0.0, 0.0, 1.0], device=DEVICE) if gated else None
        skip = (2, 3) if gated else ()
        expect = _naive(pool, fmt_hi, fmt_lo, page_table, len_hi, len_lo, slots.cpu(), layer, logits, lse, skip)
        for impl in ("triton", "ref"):
            got = pool.clone()
            if impl == "triton":
                accumulate_scores_triton(got, fmt_hi, page_table, len_hi, slots, layer, logits, lse, fmt_low=fmt_lo,
                                         len_low=len_lo, alpha_low_by_slot=alpha_low, num_splits=num_splits,
                                         block_n=32)
            else:
                accumulate_scores(got, fmt_hi, page_table, len_hi, slots, layer, logits, lse, fmt_low=fmt_lo,
                                  len_low=len_lo, alpha_low_by_slot=alpha_low, impl=impl)
            g = got.view(torch.float32).double().cpu()
            # Everything but the score words of cached tokens keeps its bytes (NaN poison included).
            changed = (g != pool.view(torch.float32).double().cpu()) & ~g.isnan()
            torch.testing.assert_close(g, expect, atol=TOL[dtype], rtol=TOL[dtype], equal_nan=True)
            counted = total.clone()
            for sl in skip:
                counted[sl] -= len_lo[sl]
            assert changed.sum() == int(counted[slots.long().cpu(), layer].sum())


@pytest.mark.parametrize("spec,gated,Hq,Hkv,attn_splits,num_splits", [
    ("K8V4+K4V2", True, 6, 2, 3, 2),  # GQA 6 (rows pad to 8), splits not a power of two, two score splits
    ("K8V4+K4V2", False, 8, 2, 32, 1),  # more splits than one step of the merge loop holds (16 at GQA 4, D 64)
    ("K4V2", False, 4, 4, 2, 3),  # one section, GQA 1
])
def test_merge_in_score_update(spec, gated, Hq, Hkv, attn_splits, num_splits):
    """accumulate_scores(partials=): the attention's splits merged in the score update's launch give merge.py's
    output and lse (torch reference), and the scores come from that lse."""
    dtype = DTYPES[-1]
    isz = torch.empty((), dtype=dtype).element_size()
    fmt_hi, fmt_lo = formats(spec, 64, isz)
    th = fmt_hi.tokens
    lens_hi = [[1, th + 1, 2, 3][:Hkv], [130, 0, 5, 1][:Hkv], [0, 3, 0, 2][:Hkv]]
    lens_lo = None if fmt_lo is None else [[fmt_lo.tokens, 1], [70, 200], [0, fmt_lo.tokens + 1]]
    pool, page_table, len_hi, len_lo, _ = build_cache(fmt_hi, fmt_lo, dtype, Hkv, lens_hi, lens_lo, DEVICE,
                                                      seed=attn_splits)
    slots = torch.tensor([2, 0, 1], dtype=torch.int32, device=DEVICE)
    B, D, layer = len(slots), 64, 1
    total = len_hi + (len_lo if len_lo is not None else 0)
    g = torch.Generator().manual_seed(Hq * 10 + attn_splits)
    logits = torch.randn(B, Hq, int(total.max()) + 2, generator=g).to(DEVICE) * 3
    acc = torch.randn(B, Hq, attn_splits, D, generator=g)
    ml = torch.stack([torch.randn(B, Hq, attn_splits, generator=g) * 4,
                      torch.rand(B, Hq, attn_splits, generator=g) * 10 + 0.5], -1)
    ml[1, 0, 1:, 1] = 0.0  # a row whose later splits hold no tokens
    acc[1, 0, 1:] = 0.0
    want_out, want_lse = merge_splits_ref(acc, ml)
    alpha_low = torch.tensor([0.0, 0.5, 0.0], device=DEVICE) if gated else None
    skip = (0, 2) if gated else ()
    expect = _naive(pool, fmt_hi, fmt_lo, page_table, len_hi, len_lo, slots.cpu(), layer, logits, want_lse, skip)
    for impl in ("triton", "ref"):
        got = pool.clone()
        out = torch.full((B, Hq, D), float("nan"), dtype=dtype, device=DEVICE)
        lse = torch.full((B, Hq), float("nan"), device=DEVICE)
        parts = SplitPartials(out, acc.to(DEVICE), ml.to(DEVICE), attn_splits)
        if impl == "triton":
            accumulate_scores_triton(got, fmt_hi, page_table, len_hi, slots, layer, logits, lse, fmt_low=fmt_lo,
                                     len_low=len_lo, alpha_low_by_slot=alpha_low, partials=parts,
                                     num_splits=num_splits, block_n=32)
        else:
            accumulate_scores(got, fmt_hi, page_table, len_hi, slots, layer, logits, lse, fmt_low=fmt_lo,
                              len_low=len_lo, alpha_low_by_slot=alpha_low, partials=parts, impl="ref")
        torch.testing.assert_close(out.float().cpu(), want_out, atol=OUT_TOL[dtype], rtol=OUT_TOL[dtype])
        torch.testing.assert_close(lse.cpu(), want_lse, atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(got.view(torch.float32).double().cpu(), expect, atol=TOL[dtype], rtol=TOL[dtype],
                                   equal_nan=True)


def test_unmerged_attention_then_score_update_matches_merged():
    """paged_decode_attention(merge=False) + accumulate_scores(partials=) == the merged call + the plain update:
    same output, lse and scores, through the Triton kernels (several attention splits)."""
    dtype = DTYPES[-1]
    isz = torch.empty((), dtype=dtype).element_size()
    fmt_hi, fmt_lo = formats("K8V4+K4V2", 64, isz)
    lens_hi, lens_lo = [[40, 3], [9, 70]], [[90, 0], [17, 33]]
    pool, page_table, len_hi, len_lo, _ = build_cache(fmt_hi, fmt_lo, dtype, 2, lens_hi, lens_lo, DEVICE, seed=7)
    slots = torch.tensor([1, 0], dtype=torch.int32, device=DEVICE)
    q = torch.randn(2, 4, 64, generator=torch.Generator().manual_seed(3)).to(DEVICE, dtype)
    nmax = int((len_hi + len_lo).max())
    results = []
    for merge in (True, False):
        got = pool.clone()
        logits = torch.full((2, 4, nmax), float("nan"), device=DEVICE)
        lse = torch.full((2, 4), float("nan"), device=DEVICE)
        kw = dict(fmt_low=fmt_lo, len_low=len_lo, logits_out=logits, lse_out=lse, num_splits=4, max_len=nmax)
        res = paged_decode_attention_triton(q, got, fmt_hi, dtype, page_table, len_hi, slots, 1, 0.125,
                                            merge=merge, kernel="quartered", **kw)
        parts = None if merge else res
        assert merge or (isinstance(res, SplitPartials) and res.num_splits == 4)
        accumulate_scores_triton(got, fmt_hi, page_table, len_hi, slots, 1, logits, lse, fmt_low=fmt_lo,
                                 len_low=len_lo, partials=parts, block_n=32)
        results.append((res if merge else res.out, lse, got.view(torch.float32)))
    for a, b in zip(*results):
        torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-5, equal_nan=True)
