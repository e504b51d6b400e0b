"""The full-width 8-bit decode kernel (diffkv_serve/kernels/decode_attention/q8.py, K8V8 pages without a low section, integer
codes or e4m3 codes) against the torch reference: outputs, per-token logits and lse, one split and several, GQA
group 4."""
import math
import os

import pytest
import torch

from diffkv_serve.kernels.decode_attention import decode_kernel, paged_decode_attention_ref, paged_decode_attention_triton

from _paged_cache import build_cache, formats

pytestmark = pytest.mark.filterwarnings("ignore:Conversion of an array with ndim:DeprecationWarning")

DEVICE = os.environ.get("DIFFKV_TEST_DEVICE", "cpu")
DTYPES = [torch.float32] + ([torch.float16, torch.bfloat16] if DEVICE.startswith("cuda") else [])
# atol and rtol alike; e4m3 pages decode to the same numbers in both (exact in fp16), so the same tolerances hold.
TOL = {torch.float32: 1e-4, torch.float16: 4e-3, torch.bfloat16: 2e-2}
SPECS = ("K8V8/u", "K8V8-e4m3/u", "K8V8")  # kv_mode int8, kv_mode fp8 (untracked pages); tracked pages
NMAX_PAD = 3  # logits columns past the longest head: must stay untouched


def _compare(dtype, Hq, Hkv, D, lens, slots, num_splits, block_n, layer, seed, spec="K8V8"):
    isz = torch.empty((), dtype=dtype).element_size()
    fmt, _ = formats(spec, D, isz)
    assert decode_kernel(fmt, None) == "q8"
    pool, page_table, lengths, _, _ = build_cache(fmt, None, dtype, Hkv, lens, None, DEVICE, seed)
    slots = torch.tensor(slots, dtype=torch.int32, device=DEVICE)
    B = len(slots)
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(B, Hq, D, generator=g).to(DEVICE, dtype)
    scale = 1 / math.sqrt(D)
    nmax = int(lengths.max()) + NMAX_PAD
    res = {}
    for impl in ("q8", "ref"):
        out = torch.full_like(q, float("nan"))  # poison: every (batch, head) row must be written
        logits = torch.full((B, Hq, nmax), float("nan"), device=DEVICE)
        lse = torch.full((B, Hq), float("nan"), device=DEVICE)
        args = (q, pool, fmt, dtype, page_table, lengths, slots, layer, scale)
        if impl == "q8":
            paged_decode_attention_triton(*args, num_splits=num_splits, block_n=block_n, out=out, logits_out=logits,
                                          lse_out=lse, kernel="q8")
        else:
            out.copy_(paged_decode_attention_ref(*args, logits_out=logits, lse_out=lse))
        res[impl] = (out.double().cpu(), logits.double().cpu(), lse.double().cpu())
    tol = TOL[dtype]
    for got, want in zip(res["q8"], res["ref"]):
        torch.testing.assert_close(got, want, atol=tol, rtol=tol, equal_nan=True)  # NaN: logits never written
    out, _, lse = res["q8"]
    empty = (lengths[slots.long(), layer] == 0).repeat_interleave(Hq // Hkv, dim=1).cpu()
    assert not out.isnan().any() and (out[empty] == 0).all() and (lse[empty] == float("-inf")).all()
    return empty


@pytest.mark.parametrize("spec", SPECS)
@pytest.mark.parametrize("Hq,Hkv,num_splits", [(2, 2, 1), (8, 2, None), (8, 2, 3)])
def test_q8_edge_lengths(spec, Hq, Hkv, num_splits):
    """Lengths 0, 1, T, T + 1, 2T + 5 (T = 30 tokens per K8V8 page here), per head; slots shuffled."""
    isz = torch.empty((), dtype=DTYPES[0]).element_size()
    th = formats(spec, 64, isz)[0].tokens
    lens = [[1, th + 1], [th, 0], [0, 3], [2 * th + 5, 0]]
    for dtype in DTYPES:
        empty = _compare(dtype, Hq, Hkv, 64, lens, [2, 0, 3, 1], num_splits, None, layer=0, seed=Hq + Hkv,
                         spec=spec)
        assert empty.any()


@pytest.mark.parametrize("spec", SPECS)
@pytest.mark.parametrize("D,block_n,num_splits,layer", [(64, 16, None, 1), (128, 32, 5, 0), (128, None, 2, 1)])
def test_q8_long_multi_split(spec, D, block_n, num_splits, layer):
    """Long heads split several ways with several tiles per split (GQA 4), and the default tiles."""
    for dtype in DTYPES:
        _compare(dtype, 8, 2, D, [[300, 57], [45, 290]], [1, 0], num_splits, block_n, layer, seed=D + layer,
                 spec=spec)


@pytest.mark.parametrize("spec", SPECS)
def test_q8_full_group(spec):
    """16 query heads per KV head fill the dot's 16 rows: no padding row carries the top value scale."""
    for dtype in DTYPES:
        _compare(dtype, 16, 1, 64, [[100], [31], [0]], [2, 0, 1], 2, 32, layer=0, seed=5, spec=spec)
