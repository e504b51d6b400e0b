import math
import os

import pytest
import torch

from _paged_cache import build_cache, formats
from diffkv_serve.kernels.decode_attention import paged_decode_attention
from diffkv_serve.kernels.kv_write import KVWrite, write_kv_triton
from diffkv_serve.kernels.score_update import accumulate_scores, accumulate_scores_triton

pytestmark = pytest.mark.filterwarnings("ignore:Conversion of an array with ndim:DeprecationWarning")
DEVICE = os.environ.get("DIFFKV_TEST_DEVICE", "cpu")
# Scores are f32 sums of exp(logit - lse): compared to a float64 loop with these tolerances (atol = rtol).
TOL = {torch.float32: 1e-5, torch.float16: 1e-5, torch.bfloat16: 1e-5}  # keyed by cache dtype (scores are f32)
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
        for impl in ("triton", "short", "ref"):
            got = pool.clone()
            if impl == "short":  # the launch for short sections (high_only), on every case
                accumulate_scores(got, fmt_hi, page_table, len_hi, slots, layer, logits, lse, fmt_low=fmt_lo,
                                  len_low=len_lo, alpha_low_by_slot=alpha_low, high_only=True, impl="triton")
            elif impl == "triton":
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


@pytest.mark.parametrize("spec,high_only", [("K8V4+K4V2", True), ("K4V2", False)])
def test_score_update_writes_another_layers_tokens_in_its_launch(spec, high_only):
    """accumulate_scores(write=): the new tokens of another layer are written as write_kv writes them (the same
    bytes), and the scores are those of the update alone."""
    dtype = DTYPES[-1]
    isz = torch.empty((), dtype=dtype).element_size()
    fmt_hi, fmt_lo = formats(spec, 64, isz)
    Hkv, Hq = 2, 6
    lens_hi = [[3, 40], [17, 0], [0, 5]]
    lens_lo = None if fmt_lo is None else [[30, 0], [2, 90], [0, 0]]
    pool, page_table, len_hi, len_lo, _ = build_cache(fmt_hi, fmt_lo, dtype, Hkv, lens_hi, lens_lo, DEVICE, seed=11)
    slots = torch.tensor([1, 2, 0], dtype=torch.int32, device=DEVICE)
    B, layer, P = 3, 1, page_table.shape[3] - 1
    # Pages no head's sections use (build_cache leaves spares): the new tokens go there.
    used = set()
    for s in range(page_table.shape[0]):
        for lay in range(page_table.shape[1]):
            for h in range(Hkv):
                n_hi = -(-int(len_hi[s, lay, h]) // fmt_hi.tokens)
                n_lo = 0 if fmt_lo is None else -(-int(len_lo[s, lay, h]) // fmt_lo.tokens)
                cols = list(range(n_hi)) + list(range(P - n_lo, P))
                used |= {int(page_table[s, lay, h, c]) for c in cols}
    spare = [p for p in range(pool.shape[0]) if p not in used][:3]
    g = torch.Generator().manual_seed(5)
    N = 4
    k = torch.randn(N, Hkv, 64, generator=g).to(DEVICE, dtype)
    v = torch.randn(N, Hkv, 64, generator=g).to(DEVICE, dtype)
    dst_page = torch.tensor([[spare[0], spare[1]], [spare[2], -1], [spare[0], spare[2]], [spare[1], spare[1]]],
                            dtype=torch.int32, device=DEVICE)
    dst_row = torch.tensor([[0, 1], [2, 0], [3, 4], [5, 6]], dtype=torch.int32, device=DEVICE)
    positions = torch.tensor([7, 100, 3, 55], dtype=torch.int32, device=DEVICE)
    total = len_hi + (len_lo if len_lo is not None else 0)
    logits = torch.randn(B, Hq, int(total.max()) + 1, generator=g).to(DEVICE) * 3
    lse = torch.logsumexp(logits, -1)  # any finite lse will do: the scores follow it
    alpha_low = torch.tensor([0.0, 0.5, 0.0], device=DEVICE) if fmt_lo is not None else None
    written = pool.clone()
    write_kv_triton(written, fmt_hi, dtype, k, v, dst_page, dst_row, positions)
    skip = (0, 2) if alpha_low is not None else ()
    expect = _naive(written, fmt_hi, fmt_lo, page_table, len_hi, len_lo, slots.cpu(), layer, logits, lse, skip)
    got = pool.clone()
    accumulate_scores(got, fmt_hi, page_table, len_hi, slots, layer, logits, lse, fmt_low=fmt_lo, len_low=len_lo,
                      alpha_low_by_slot=alpha_low, high_only=high_only, impl="triton",
                      write=KVWrite(got, fmt_hi, dtype, k, v, dst_page, dst_row, positions))
    assert torch.equal(got[spare].cpu(), written[spare].cpu())
    assert not torch.equal(written[spare].cpu(), pool[spare].cpu())  # the write did happen
    torch.testing.assert_close(got.view(torch.float32).double().cpu(), expect, atol=TOL[dtype], rtol=TOL[dtype],
                               equal_nan=True)
