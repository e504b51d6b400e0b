"""The 16-bit decode kernel (diffkv_serve/kernels/decode_attention/f16.py: K16V16 pages, no low section) against the torch
reference and float64 loops over the cache: outputs, per-token logits and lse; lengths 0, 1, T, T + 1 per head,
one split and several, GQA groups 1 to 8, head_dim 32 to 128."""
import math
import os

import pytest
import torch

from diffkv_serve.kernels.decode_attention import (choose_num_splits, decode_kernel, paged_decode_attention,
                                      paged_decode_attention_ref, paged_decode_attention_triton)
from diffkv_serve.kernels.page_layout import PageFormat, page_bytes_for

from _paged_cache import build_cache, formats

# The interpreter reads scalar loads used as loop bounds through a deprecated numpy conversion.
pytestmark = pytest.mark.filterwarnings("ignore:Conversion of an array with ndim:DeprecationWarning")

DEVICE = os.environ.get("DIFFKV_TEST_DEVICE", "cpu")
TOL = {torch.float32: 1e-4, torch.float16: 2e-3, torch.bfloat16: 1.5e-2}  # atol and rtol alike
DTYPES = [torch.float32] + ([torch.float16, torch.bfloat16] if DEVICE.startswith("cuda") else [])
T = 16
LAYERS = 2


def _cache(cache_dtype, Hkv, D, lengths_bhl, max_pages, seed):
    """Pool with K/V rows only where t < length; everything else stays NaN (must never be read).

    lengths_bhl: per slot a list of per-KV-head lengths (used for every layer, layer 1 shifted a bit).
    """
    torch.manual_seed(seed)
    isz = torch.empty((), dtype=cache_dtype).element_size()
    fmt = PageFormat.make(16, 16, D, page_bytes_for(T, D, isz, tracked=False), isz, tracked=False)  # kv_mode fp16
    S = len(lengths_bhl)
    lengths = torch.zeros(S, LAYERS, Hkv, dtype=torch.int32)
    for s, per_head in enumerate(lengths_bhl):
        for layer in range(LAYERS):
            lengths[s, layer] = torch.tensor([max(0, n - layer) for n in per_head])
    need = [(s, l, h, -(-int(lengths[s, l, h]) // T)) for s in range(S) for l in range(LAYERS) for h in range(Hkv)]
    num_pages = sum(n for *_, n in need) + 7
    ids = torch.randperm(num_pages)  # shuffled: pages of one head are scattered over the pool
    pool = torch.empty(num_pages, fmt.page_bytes, dtype=torch.uint8)
    pc = pool.view(cache_dtype)
    pc.fill_(float("nan"))
    # Unused page-table entries: -1 or stale ids of other pages (whose rows may be NaN).
    page_table = torch.where(torch.rand(S, LAYERS, Hkv, max_pages) < 0.5, -1,
                             torch.randint(0, num_pages, (S, LAYERS, Hkv, max_pages))).to(torch.int32)
    nxt = 0
    for s, l, h, n in need:
        page_table[s, l, h, :n] = ids[nxt:nxt + n].to(torch.int32)
        nxt += n
        for t in range(int(lengths[s, l, h])):
            p, r = int(page_table[s, l, h, t // T]), t % T
            pc[p, fmt.k_off // isz + r * D: fmt.k_off // isz + (r + 1) * D] = (torch.randn(D) * 1.5).to(cache_dtype)
            pc[p, fmt.v_off // isz + r * D: fmt.v_off // isz + (r + 1) * D] = (torch.randn(D) + 0.3).to(cache_dtype)
    return fmt, pool.to(DEVICE), page_table.to(DEVICE), lengths.to(DEVICE)


def _naive(q, pool, fmt, cache_dtype, page_table, lengths, slots, layer, scale):
    pc = pool.cpu().view(cache_dtype)
    q = q.double().cpu()
    B, Hq, D = q.shape
    Hkv = page_table.shape[2]
    isz = fmt.full_itemsize
    out = torch.zeros_like(q)
    for b in range(B):
        s = int(slots[b])
        for hq in range(Hq):
            h = hq // (Hq // Hkv)
            n = int(lengths[s, layer, h])
            if n == 0:
                continue
            rows = [(int(page_table[s, layer, h, t // T]), t % T) for t in range(n)]
            keys = torch.stack([pc[p, fmt.k_off // isz + r * D: fmt.k_off // isz + (r + 1) * D] for p, r in rows])
            vals = torch.stack([pc[p, fmt.v_off // isz + r * D: fmt.v_off // isz + (r + 1) * D] for p, r in rows])
            w = torch.softmax(keys.double() @ q[b, hq] * scale, 0)
            out[b, hq] = w @ vals.double()
    return out


def _check(a, b, dtype):
    tol = TOL[dtype]
    torch.testing.assert_close(a.double().cpu(), b.double().cpu(), atol=tol, rtol=tol)


def _run(dtype, Hq, Hkv, D, lengths_bhl, slots, num_splits, max_len=None, layer=1, seed=0, block_n=None):
    max_pages = -(-max(max(x) for x in lengths_bhl) // T) + 2
    fmt, pool, page_table, lengths, = _cache(dtype, Hkv, D, lengths_bhl, max_pages, seed)
    assert decode_kernel(fmt, None) == "f16"
    slots = torch.tensor(slots, dtype=torch.int32, device=DEVICE)
    q = torch.randn(len(slots), Hq, D, device=DEVICE).to(dtype)
    scale = 1 / math.sqrt(D)
    args = (q, pool, fmt, dtype, page_table, lengths, slots, layer, scale)
    out = torch.full_like(q, float("nan"))  # poison: every (batch, head) row must be written
    if block_n is None:
        paged_decode_attention(*args, num_splits=num_splits, max_len=max_len, impl="triton", out=out)
    else:
        paged_decode_attention_triton(*args, num_splits=num_splits, max_len=max_len, block_n=block_n, out=out)
    ref = paged_decode_attention(*args, max_len=max_len, impl="ref")
    assert out.dtype == q.dtype and not out.isnan().any()
    _check(out, ref, dtype)
    _check(ref, _naive(*args), dtype)
    return out, lengths[slots.long(), layer]


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("Hq,Hkv", [(2, 2), (6, 2), (8, 2)])
@pytest.mark.parametrize("num_splits", [None, 1, 3])
def test_decode_edge_lengths(dtype, Hq, Hkv, num_splits):
    """Lengths 1, T, T+1, 0 (a pruned head -> zeros), different per head; slots out of order."""
    lengths_bhl = [[1, T + 1], [T, 0], [2 * T + 5, 3], [7, 2 * T]]
    out, lens = _run(dtype, Hq, Hkv, 64, lengths_bhl, [2, 0, 3, 1], num_splits, seed=Hq + Hkv)
    group = Hq // Hkv
    empty = (lens == 0).repeat_interleave(group, dim=1)  # [B, Hq]
    assert empty.any() and (out[empty] == 0).all()


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("max_len", [None, 300])
def test_decode_long_multi_split(dtype, max_len):
    """A long context split many ways, head_dim 128, group 4; small tiles so splits hold several tiles."""
    lengths_bhl = [[300, 257], [45, 290]]
    assert choose_num_splits(2, 2, 300, torch.device(DEVICE), 16) > 1  # auto splits a tiny batch
    _run(dtype, 8, 2, 128, lengths_bhl, [1, 0], None, max_len=max_len, layer=0, seed=7, block_n=16)
    _run(dtype, 8, 2, 128, lengths_bhl, [1, 0], 5, layer=1, seed=8, block_n=32)
    _run(dtype, 8, 2, 128, lengths_bhl, [0, 1], None, max_len=max_len, layer=1, seed=9)  # default tiles


NMAX_PAD = 3  # logits columns past the longest head: must stay untouched


def _compare_logits(dtype, Hq, Hkv, D, lens, slots, num_splits, block_n, layer, seed):
    """The f16 kernel (forced) and the reference on one cache: outputs, logits and lse within TOL[dtype]."""
    isz = torch.empty((), dtype=dtype).element_size()
    fmt, _ = formats("K16V16", D, isz)
    pool, page_table, lengths, _, _ = build_cache(fmt, None, dtype, Hkv, lens, None, DEVICE, seed)
    slots = torch.tensor(slots, dtype=torch.int32, device=DEVICE)
    B = len(slots)
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(B, Hq, D, generator=g).to(DEVICE, dtype)
    args = (q, pool, fmt, dtype, page_table, lengths, slots, layer, 1 / math.sqrt(D))
    nmax = int(lengths.max()) + NMAX_PAD
    res = {}
    for impl in ("f16", "ref"):
        out = torch.full_like(q, float("nan"))  # poison: every (batch, head) row must be written
        logits = torch.full((B, Hq, nmax), float("nan"), device=DEVICE)
        lse = torch.full((B, Hq), float("nan"), device=DEVICE)
        if impl == "f16":
            paged_decode_attention_triton(*args, num_splits=num_splits, block_n=block_n, out=out, logits_out=logits,
                                          lse_out=lse, kernel="f16")
        else:
            out.copy_(paged_decode_attention_ref(*args, logits_out=logits, lse_out=lse))
        res[impl] = (out.double().cpu(), logits.double().cpu(), lse.double().cpu())
    tol = TOL[dtype]
    for got, want in zip(res["f16"], res["ref"]):
        torch.testing.assert_close(got, want, atol=tol, rtol=tol, equal_nan=True)  # NaN: logits never written
    out, logits, lse = res["f16"]
    empty = (lengths[slots.long(), layer] == 0).repeat_interleave(Hq // Hkv, dim=1).cpu()
    assert not out.isnan().any() and (out[empty] == 0).all() and (lse[empty] == float("-inf")).all()
    assert not lse[~empty].isinf().any() and not logits[..., 0][~empty].isnan().any()  # every head with tokens


@pytest.mark.parametrize("B,Hq,Hkv,D,num_splits,block_n", [
    (1, 1, 1, 64, 1, None),  # one sequence, no GQA
    (3, 3, 1, 32, None, 16),  # GQA 3 padded to the tile's rows, several tiles per split
    (4, 8, 2, 128, 3, 32),  # GQA 4, three splits merged
    (5, 16, 2, 64, 2, 16),  # GQA 8
])
def test_f16_logits_and_lse(B, Hq, Hkv, D, num_splits, block_n):
    """Batch, length and GQA shapes on fresh random caches and queries; lengths 0, 1, T, T + 1 and longer."""
    th = formats("K16V16", D, 4)[0].tokens
    per_head = [0, 1, th, th + 1, 2 * th + 5, 3 * th - 1, 70]
    lens = [[per_head[(s * Hkv + h) % len(per_head)] for h in range(Hkv)] for s in range(B + 1)]
    slots = list(range(B + 1))[::-1][:B]  # shuffled, one slot unused
    for dtype in DTYPES:
        _compare_logits(dtype, Hq, Hkv, D, lens, slots, num_splits, block_n, layer=B % 2, seed=B + Hq + D)
