import math
import os

import pytest
import torch

from kernels.decode_attention import (WIDE_SPLIT_TOKENS, choose_num_splits, launch_config, paged_decode_attention,
                                     paged_decode_attention_triton, tile_tokens)
from kernels.page_layout import PageFormat, page_bytes_for
from kernels.quant import dequantize_ref

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
    fmt = PageFormat.make(16, 16, D, page_bytes_for(T, D, isz), isz)
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


def test_choose_num_splits():
    dev = torch.device("cpu")
    assert choose_num_splits(64, 8, 4096, dev, 64) == 1  # batch * heads fills the GPU
    assert choose_num_splits(1, 8, 32, dev, 64) == 1  # too short to split
    assert 1 < choose_num_splits(1, 8, 32768, dev, 64) <= 64
    # SmolLM2's shape (3 KV heads, head_dim 64, 2-warp quantized programs): batch 64 alone starves the SMs
    assert choose_num_splits(64, 3, 8192, dev, 128, num_warps=2, head_dim=64) > 1
    assert choose_num_splits(16, 3, 1024, dev, 128, num_warps=2, head_dim=64) == 8  # one 128-token tile each
    assert choose_num_splits(32, 8, 4096, dev, 128, num_warps=4, head_dim=128) == 1


# ------------------------------------------------------------------ quantized pages, high + low sections

# Quantized pages (dequantized in fp32 by the kernel and the reference alike), outputs, logits and lse:
QTOL = {torch.float32: 1e-4, torch.float16: 4e-3, torch.bfloat16: 2e-2}  # atol and rtol alike
NMAX_PAD = 5  # logits_out columns past the longest head (must stay untouched)


def _token_kv(pool, fmt, cache_dtype, p, r):
    """Keys, values float64 [D] of one page row, decoded by plain slicing + dequantize_ref."""
    D = fmt.head_dim
    out = []
    for bits, off, moff in ((fmt.key_bits, fmt.k_off, fmt.k_meta_off), (fmt.value_bits, fmt.v_off, fmt.v_meta_off)):
        if bits == 16:
            w = D * fmt.full_itemsize
            out.append(pool[p, off + r * w: off + (r + 1) * w].view(cache_dtype).double())
        else:
            w = D * bits // 8
            meta = pool[p, moff + 4 * r: moff + 4 * r + 4].view(torch.float16)
            out.append(dequantize_ref(pool[p, off + r * w: off + (r + 1) * w], meta[0], meta[1], bits, D).double())
    return out


def _naive_sections(q, pool, fmt_hi, fmt_lo, cache_dtype, page_table, len_hi, len_lo, slots, layer, scale):
    """float64 loops: output [B, Hq, D], logits {(b, hq, idx): value}, lse [B, Hq]."""
    pool, page_table, q = pool.cpu(), page_table.cpu(), q.double().cpu()
    B, Hq, D = q.shape
    Hkv = page_table.shape[2]
    G = Hq // Hkv
    P = page_table.shape[3] - 1
    out = torch.zeros(B, Hq, D, dtype=torch.float64)
    lse = torch.full((B, Hq), float("-inf"), dtype=torch.float64)
    logits = {}
    for b in range(B):
        s = int(slots[b])
        for h in range(Hkv):
            rows = []
            n_hi = int(len_hi[s, layer, h])
            rows += [(fmt_hi, int(page_table[s, layer, h, j // fmt_hi.tokens]), j % fmt_hi.tokens) for j in range(n_hi)]
            if fmt_lo is not None:
                T = fmt_lo.tokens
                rows += [(fmt_lo, int(page_table[s, layer, h, P - 1 - j // T]), j % T)
                         for j in range(int(len_lo[s, layer, h]))]
            if not rows:
                continue
            kv = [_token_kv(pool, f, cache_dtype, p, r) for f, p, r in rows]
            keys = torch.stack([k for k, _ in kv])
            vals = torch.stack([v for _, v in kv])
            for hq in range(h * G, (h + 1) * G):
                x = keys @ q[b, hq] * scale
                lse[b, hq] = torch.logsumexp(x, 0)
                out[b, hq] = torch.softmax(x, 0) @ vals
                for i in range(len(rows)):
                    logits[(b, hq, i)] = float(x[i])  # idx: j for high, n_hi + j for low
    return out, logits, lse


def _run_sections(spec, dtype, Hq, Hkv, D, lens_hi, lens_lo, slots, num_splits, layer, seed, block_n=None,
                  max_len=None, red=None, min_rows=None, key_pairs=None):
    isz = torch.empty((), dtype=dtype).element_size()
    fmt_hi, fmt_lo = formats(spec, D, isz)
    pool, page_table, len_hi, len_lo, _ = build_cache(fmt_hi, fmt_lo, dtype, Hkv, lens_hi, lens_lo, DEVICE, seed)
    slots = torch.tensor(slots, dtype=torch.int32, device=DEVICE)
    B = len(slots)
    q = torch.randn(B, Hq, D, device=DEVICE).to(dtype)
    scale = 1 / math.sqrt(D)
    total = len_hi + (len_lo if len_lo is not None else 0)
    nmax = int(total.max()) + NMAX_PAD
    args = (q, pool, fmt_hi, dtype, page_table, len_hi, slots, layer, scale)
    kw = dict(fmt_low=fmt_lo, len_low=len_lo, max_len=max_len)
    over = {k: v for k, v in dict(red=red, min_rows=min_rows, key_pairs=key_pairs).items() if v is not None}
    tkw = dict(config=launch_config(fmt_hi, fmt_lo)._replace(**over)) if over else {}
    res = {}
    for impl in ("triton", "ref"):
        out = torch.full_like(q, float("nan"))  # poison: every (batch, head) row must be written
        logits = torch.full((B, Hq, nmax), float("nan"), device=DEVICE)
        lse = torch.full((B, Hq), float("nan"), device=DEVICE)
        if impl == "triton":
            paged_decode_attention_triton(*args, num_splits=num_splits, block_n=block_n, out=out,
                                          logits_out=logits, lse_out=lse, **kw, **tkw)
        else:
            paged_decode_attention(*args, num_splits=num_splits, impl=impl, out=out, logits_out=logits,
                                   lse_out=lse, **kw)
        assert not out.isnan().any() and not lse.isnan().any()
        res[impl] = (out, logits, lse)
    # Plain call (no logits/lse) gives the same output, up to the compiler contracting the scale/zero
    # fold into FMAs differently when the logits are also stored (fp32 rounding, ~1e-7 relative).
    plain = paged_decode_attention_triton(*args, num_splits=num_splits, block_n=block_n, **kw, **tkw)
    torch.testing.assert_close(plain, res["triton"][0], atol=1e-6, rtol=1e-5)

    n_out, n_logits, n_lse = _naive_sections(q, pool, fmt_hi, fmt_lo, dtype, page_table, len_hi, len_lo,
                                             slots.cpu(), layer, scale)
    tol = QTOL[dtype]
    expect_logits = torch.full((B, Hq, nmax), float("nan"), dtype=torch.float64)
    for (b, hq, i), x in n_logits.items():
        expect_logits[b, hq, i] = x
    for impl, (out, logits, lse) in res.items():
        torch.testing.assert_close(out.double().cpu(), n_out, atol=tol, rtol=tol)
        torch.testing.assert_close(lse.double().cpu(), n_lse, atol=tol, rtol=tol)  # -inf where no token
        torch.testing.assert_close(logits.double().cpu(), expect_logits, atol=tol, rtol=tol, equal_nan=True)
    torch.testing.assert_close(res["triton"][0].double().cpu(), res["ref"][0].double().cpu(), atol=tol, rtol=tol)
    return res, total[slots.long(), layer]


SPECS = ["K8V8", "K4V4", "K8V4", "K4V2", "K8V4+K4V2"]


@pytest.mark.parametrize("spec", SPECS)
@pytest.mark.parametrize("Hq,Hkv,num_splits", [(2, 2, None), (6, 2, 1), (8, 2, 3)])
def test_decode_quantized_sections(spec, Hq, Hkv, num_splits):
    """Lengths 0, 1, T, T+1 per section (T of that section's format), different per head, slots shuffled;
    logits_out / lse_out against float64 loops over the dequantized cache."""
    isz = torch.empty((), dtype=DTYPES[0]).element_size()
    fmt_hi, fmt_lo = formats(spec, 64, isz)
    th = fmt_hi.tokens
    lens_hi = [[1, th + 1], [th, 0], [0, 3], [2 * th + 5, 0]]
    if fmt_lo is None:
        lens_lo = None
    else:
        tl_ = fmt_lo.tokens
        lens_lo = [[tl_, 1], [0, tl_ + 1], [0, 5], [3, 0]]  # slot 3 head 1: both sections empty
    for dtype in DTYPES:
        res, total = _run_sections(spec, dtype, Hq, Hkv, 64, lens_hi, lens_lo, [2, 0, 3, 1], num_splits,
                                   layer=0, seed=Hq + len(spec))
        out = res["triton"][0]
        empty = (total == 0).repeat_interleave(Hq // Hkv, dim=1)
        assert empty.any() and (out[empty] == 0).all()
        assert (res["triton"][2][empty] == float("-inf")).all()


@pytest.mark.parametrize("spec,D,block_n,num_splits", [("K8V4+K4V2", 64, 16, None), ("K8V4+K4V2", 64, 32, 5),
                                                       ("K4V2", 128, 16, None), ("K16V16+K8V4", 64, None, 4),
                                                       ("K8V4+K4V2", 32, 32, None), ("K16V16+K4V2", 32, 16, 3),
                                                       ("K2V2", 128, None, 2)])
def test_decode_quantized_long_multi_split(spec, D, block_n, num_splits):
    """Long sections split many ways (several tiles per split), GQA 4, two head_dim 128 cases (one in
    launch_config's own tiles); head_dim 32 pads each quarter of the head dimension to the dot's minimum width
    of 16."""
    assert choose_num_splits(2, 2, 600, torch.device(DEVICE), 16) > 1
    lens_hi = [[300, 57], [45, 290]]
    lens_lo = [[250, 260], [0, 131]] if "+" in spec else None
    for dtype in DTYPES:
        _run_sections(spec, dtype, 8, 2, D, lens_hi, lens_lo, [1, 0], num_splits, layer=1, seed=D + len(spec),
                      block_n=block_n)


def test_decode_wide_tiles():
    """2-bit values with keys of <= 4 bits take 64-token tiles where a split may cover WIDE_SPLIT_TOKENS tokens
    (tile_tokens), 32 elsewhere; such a launch (max_len 4096 over 2 splits) equals the references."""
    isz = torch.empty((), dtype=DTYPES[0]).element_size()
    for spec, wide in (("K4V2", 64), ("K2V2", 64), ("K4V4", 32), ("K8V4", 32)):
        cfg = launch_config(formats(spec, 128, isz)[0], None)
        assert tile_tokens(cfg, 16 * WIDE_SPLIT_TOKENS, 16) == wide and tile_tokens(cfg, 4096, 1) == wide
        assert tile_tokens(cfg, 4096, 16) == 32  # batch 8's 16 splits of 256 tokens
    for dtype in DTYPES:
        _run_sections("K2V2", dtype, 8, 2, 128, [[300, 57], [45, 290]], None, [1, 0], 2, layer=1, seed=7,
                      max_len=2 * WIDE_SPLIT_TOKENS)


@pytest.mark.parametrize("red", [0, 1])
@pytest.mark.parametrize("spec,Hq,Hkv,D,block_n,num_splits", [("K8V4+K4V2", 8, 2, 64, 16, 3),
                                                               ("K16V16+K4V2", 16, 1, 32, 16, None)])
def test_decode_row_sum_modes(red, spec, Hq, Hkv, D, block_n, num_splits):
    """Both ways of reducing a tile's rows (LaunchConfig.red): several tiles per split, both sections; GQA 16
    fills the dot's rows (no padding row for the top value scale), a 16-bit high section has no value scales."""
    lens_hi = [[90, 37], [45, 0]]
    lens_lo = [[70, 3], [0, 41]]
    for dtype in DTYPES:
        _run_sections(spec, dtype, Hq, Hkv, D, [r[:Hkv] for r in lens_hi],
                      [r[:Hkv] for r in lens_lo], [1, 0], num_splits, layer=1, seed=D + red, block_n=block_n,
                      red=red)


@pytest.mark.parametrize("min_rows", [1, 4, 16])
@pytest.mark.parametrize("spec,Hq,Hkv,D", [("K8V4+K4V2", 6, 2, 64), ("K8V8", 8, 2, 64), ("K16V16", 9, 3, 32),
                                           ("K4V2", 8, 2, 128)])
def test_decode_group_rows(min_rows, spec, Hq, Hkv, D):
    """The query group's tile padded to other row counts than the default (LaunchConfig.min_rows): unpadded
    (groups 3 and 4 in 4 rows; 1 -> the group's power of two), and 16; every kernel (quartered, q8, f16)."""
    lens_hi = [[50, 37, 3], [45, 0, 20]]
    lens_lo = [[30, 3, 0], [0, 41, 9]] if "+" in spec else None
    for dtype in DTYPES:
        _run_sections(spec, dtype, Hq, Hkv, D, [r[:Hkv] for r in lens_hi],
                      None if lens_lo is None else [r[:Hkv] for r in lens_lo], [1, 0], 2, layer=1,
                      seed=D + min_rows, block_n=16, min_rows=min_rows)


@pytest.mark.parametrize("key_pairs", [False, True])
@pytest.mark.parametrize("spec,Hq,Hkv", [("K8V4+K4V2", 8, 2), ("K16V16+K4V2", 8, 2), ("K4V4", 6, 2), ("K2V2", 2, 2)])
def test_decode_key_pairs(key_pairs, spec, Hq, Hkv):
    """Quantized keys read as byte pairs against a zero-padded q (LaunchConfig.key_pairs, the head_dim >= 128
    default) and the byte path: every key width (8/4/2 bits; 16-bit sections keep the byte-free path), GQA 4,
    3 and 1, several tiles per split, both sections."""
    lens_hi = [[90, 37], [45, 0]]
    lens_lo = [[70, 3], [0, 41]] if "+" in spec else None
    for dtype in DTYPES:
        _run_sections(spec, dtype, Hq, Hkv, 128, lens_hi, lens_lo, [1, 0], 2, layer=1, seed=len(spec) + key_pairs,
                      block_n=16, key_pairs=key_pairs)


def test_decode_key_pairs_needs_head_dim_128():
    isz = torch.empty((), dtype=DTYPES[0]).element_size()
    fmt_hi, _ = formats("K4V2", 64, isz)
    pool = torch.zeros(2, fmt_hi.page_bytes, dtype=torch.uint8, device=DEVICE)
    pt = torch.zeros(1, 1, 1, 3, dtype=torch.int32, device=DEVICE)
    lens = torch.ones(1, 1, 1, dtype=torch.int32, device=DEVICE)
    q = torch.randn(1, 2, 64, device=DEVICE).to(DTYPES[0])
    cfg = launch_config(fmt_hi, None)._replace(key_pairs=True)
    with pytest.raises(ValueError, match="key_pairs"):
        paged_decode_attention_triton(q, pool, fmt_hi, DTYPES[0], pt, lens, torch.zeros(1, dtype=torch.int32,
                                                                                          device=DEVICE), 0, 0.125,
                                      config=cfg)


def test_decode_low_section_needs_format():
    isz = torch.empty((), dtype=DTYPES[0]).element_size()
    fmt_hi, fmt_lo = formats("K8V4+K4V2", 64, isz)
    q = torch.randn(1, 2, 64, device=DEVICE).to(DTYPES[0])
    pool = torch.zeros(2, fmt_hi.page_bytes, dtype=torch.uint8, device=DEVICE)
    pt = torch.zeros(1, 1, 1, 3, dtype=torch.int32, device=DEVICE)
    lens = torch.zeros(1, 1, 1, dtype=torch.int32, device=DEVICE)
    slots = torch.zeros(1, dtype=torch.int32, device=DEVICE)
    for impl in ("triton", "ref"):
        with pytest.raises(ValueError):
            paged_decode_attention(q, pool, fmt_hi, DTYPES[0], pt, lens, slots, 0, impl=impl, len_low=lens)
