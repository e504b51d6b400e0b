import math
import os

import pytest
import torch

from diffkv_serve.kernels.prefill_attention import prefill_attention, prefill_attention_triton

# The interpreter reads scalar loads used as loop bounds through a deprecated numpy conversion.
pytestmark = pytest.mark.filterwarnings("ignore:Conversion of an array with ndim:DeprecationWarning")

DEVICE = os.environ.get("DIFFKV_TEST_DEVICE", "cpu")
TOL = {torch.float32: 1e-4, torch.float16: 2e-3, torch.bfloat16: 1.5e-2}  # atol and rtol alike
DTYPES = [torch.float32] + ([torch.float16, torch.bfloat16] if DEVICE.startswith("cuda") else [])


def _inputs(seqlens, Hq, Hkv, D, dtype, seed):
    torch.manual_seed(seed)
    N = sum(seqlens)
    q = torch.randn(N, Hq, D, device=DEVICE).to(dtype)
    k = (torch.randn(N, Hkv, D, device=DEVICE) * 1.5).to(dtype)  # spread scores: non-uniform softmax
    v = (torch.randn(N, Hkv, D, device=DEVICE) + 0.3).to(dtype)
    cu = torch.tensor([0] + seqlens, dtype=torch.int32).cumsum(0).to(torch.int32).to(DEVICE)
    return q, k, v, cu


def _naive(q, k, v, cu, scale):
    q, k, v = q.double().cpu(), k.double().cpu(), v.double().cpu()
    group = q.shape[1] // k.shape[1]
    out = torch.zeros_like(q)
    cu = cu.tolist()
    for s, e in zip(cu[:-1], cu[1:]):
        for h in range(q.shape[1]):
            for i in range(s, e):
                w = torch.softmax(k[s:i + 1, h // group] @ q[i, h] * scale, 0)
                out[i, h] = w @ v[s:i + 1, h // group]
    return out


def _check(a, b, dtype):
    tol = TOL[dtype]
    torch.testing.assert_close(a.double().cpu(), b.double().cpu(), atol=tol, rtol=tol)


CASES = [  # seqlens, Hq, Hkv, D
    ([1, 17, 5, 70], 4, 4, 64),
    ([33, 1, 2], 6, 2, 64),
    ([80, 16], 8, 2, 64),
    ([20, 3], 4, 1, 128),
]


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("seqlens,Hq,Hkv,D", CASES)
def test_prefill_attention(dtype, seqlens, Hq, Hkv, D):
    q, k, v, cu = _inputs(seqlens, Hq, Hkv, D, dtype, seed=len(seqlens) * 100 + Hq)
    scale = 1 / math.sqrt(D)
    out = torch.full_like(q, float("nan"))  # poison: every row must be written
    prefill_attention(q, k, v, cu, scale, impl="triton", out=out)
    ref = prefill_attention(q, k, v, cu, scale, impl="ref")
    assert out.dtype == q.dtype and not out.isnan().any()
    _check(out, ref, dtype)
    _check(ref, _naive(q, k, v, cu, scale), dtype)


@pytest.mark.parametrize("D", [32, 48])
def test_prefill_small_blocks_and_odd_head_dim(D):
    """16x16 tiles: several query blocks per sequence, diagonal and off-diagonal key blocks; D=48 is masked."""
    dtype = DTYPES[-1]
    q, k, v, cu = _inputs([40, 1, 16, 17], 3, 1, D, dtype, seed=D)
    scale = 0.3
    out = torch.full_like(q, float("nan"))
    prefill_attention_triton(q, k, v, cu, scale, block_m=16, block_n=16, out=out)
    assert not out.isnan().any()
    _check(out, _naive(q, k, v, cu, scale), dtype)
    _check(prefill_attention(q, k, v, cu, scale, impl="ref"), out, dtype)


@pytest.mark.parametrize("impl", ["triton", "ref"])
def test_prefill_suffix_queries_over_cached_prefix(impl):
    """Only each sequence's last queries (a cached prefix precedes them, cu_seqlens_k): their rows equal the
    rows of the whole-sequence attention; small tiles put the query offset inside and across key blocks."""
    dtype = DTYPES[-1]
    seqlens, suffix = [40, 17, 5, 33], [3, 17, 1, 20]  # second: no prefix at all
    q, k, v, cu = _inputs(seqlens, 6, 2, 64, dtype, seed=7)
    full = prefill_attention(q, k, v, cu, 0.2, impl="ref")
    rows = torch.cat([torch.arange(e - n, e) for e, n in zip(cu[1:].tolist(), suffix)]).to(DEVICE)
    cu_q = torch.tensor([0] + suffix).cumsum(0).to(torch.int32).to(DEVICE)
    out = torch.full_like(q[rows], float("nan"))
    if impl == "triton":
        prefill_attention_triton(q[rows], k, v, cu_q, 0.2, block_m=16, block_n=16, out=out,
                                 cu_seqlens_k=cu)
    else:
        prefill_attention(q[rows], k, v, cu_q, 0.2, impl="ref", out=out, cu_seqlens_k=cu)
    assert not out.isnan().any()
    _check(out, full[rows], dtype)


def test_prefill_grid_covers_any_lengths_as_a_graph_replays_it():
    """The prompt-step CUDA graphs' layout: real sequences, one padding sequence up to the bucket's token count,
    then empty ones (20 sequences: past the 16-entry table the kernel starts with). Every real row equals the
    reference, whatever the counts the grid was sized by."""
    dtype = DTYPES[-1]
    seqlens = [5, 1, 40, 0, 17] + [3] * 12 + [2, 0, 9]
    n = sum(seqlens)
    T = 128  # the bucket
    q, k, v, _ = _inputs(seqlens + [T - n], 6, 2, 64, dtype, seed=11)
    cu = torch.tensor([0] + seqlens + [T - n] + [0] * 7).cumsum(0).to(torch.int32).to(DEVICE)
    out = torch.full_like(q, float("nan"))
    prefill_attention_triton(q, k, v, cu, 0.25, block_m=16, block_n=16, out=out)
    assert not out.isnan().any()
    real = torch.tensor([0] + seqlens).cumsum(0).to(torch.int32).to(DEVICE)
    ref = prefill_attention(q[:n], k[:n], v[:n], real, 0.25, impl="ref")
    _check(out[:n], ref, dtype)
