import os

import pytest
import torch

from diffkv_serve.kernels.kv_move import move_tokens
from diffkv_serve.kernels.kv_write import write_kv
from diffkv_serve.kernels.page_layout import PageFormat, page_bytes_for
from diffkv_serve.kernels.quant import dequantize_ref, quantize_ref

pytestmark = pytest.mark.filterwarnings("ignore:Conversion of an array with ndim:DeprecationWarning")
DEVICE = os.environ.get("DIFFKV_TEST_DEVICE", "cpu")
# Moves are byte copies or a deterministic dequantize -> quantize: every implementation gives identical bytes.
TOL = {torch.float32: 0.0, torch.float16: 0.0, torch.bfloat16: 0.0}
DTYPES = [torch.float32] + ([torch.float16, torch.bfloat16] if DEVICE.startswith("cuda") else [])
BLOCK = 16


def _fmt(name, D, isz):
    """'K8V4', 'K8V8-e4m3' for e4m3 codes (kv_mode fp8), or 'K4V2-untracked' for pages without score and position
    rows (a diffkv cache's low pages at alpha_low 0, CacheConfig.track_low)."""
    name, _, code = name.partition("-")
    kb, vb = name[1:].split("V")
    return PageFormat.make(int(kb), int(vb), D, page_bytes_for(BLOCK, D, isz), isz, float8=code == "e4m3",
                           tracked=code != "untracked")


def _row(pool, fmt, cache_dtype, which, p, r):
    """(bits, data bytes, meta bytes) of one token row, read by plain slicing."""
    bits = fmt.key_bits if which == "k" else fmt.value_bits
    off = fmt.k_off if which == "k" else fmt.v_off
    moff = fmt.k_meta_off if which == "k" else fmt.v_meta_off
    D = fmt.head_dim
    rb = D * fmt.full_itemsize if bits == 16 else D * bits // 8
    data = pool[p, off + r * rb: off + (r + 1) * rb]
    meta = pool[p, moff + 4 * r: moff + 4 * (r + 1)] if bits < 16 else None
    return bits, data, meta


def _decode(bits, data, meta, cache_dtype, D):
    if bits == 16:
        return data.view(cache_dtype).float()
    m = meta.view(torch.float16)
    return dequantize_ref(data, m[0], m[1], bits, D)


def _setup(src, dst, cache_dtype, D, M, seed):
    torch.manual_seed(seed)
    isz = torch.empty((), dtype=cache_dtype).element_size()
    fs, fd = _fmt(src, D, isz), _fmt(dst, D, isz)
    n_src, n_dst = 3, 3  # pages 0..2 hold the source rows (fs), pages 3..5 the destinations (fd)
    pool = torch.empty(n_src + n_dst, fs.page_bytes, dtype=torch.uint8)
    pool.view(torch.float32).fill_(float("nan"))
    sr = torch.randperm(n_src * fs.tokens)[:M]
    sp, sr = (sr // fs.tokens).to(torch.int32), (sr % fs.tokens).to(torch.int32)
    k = torch.randn(M, 1, D) * 2 + torch.randn(M, 1, 1)
    v = torch.randn(M, 1, D) - 0.5
    write_kv(pool, fs, cache_dtype, k.to(cache_dtype), v.to(cache_dtype), sp[:, None].contiguous(),
             sr[:, None].contiguous(), torch.randint(0, 9999, (M,), dtype=torch.int32), impl="ref",
             scores=torch.rand(M, 1) + 0.1)
    dr = torch.randperm(n_dst * fd.tokens)[:M]
    dp, dr = (dr // fd.tokens + n_src).to(torch.int32), (dr % fd.tokens).to(torch.int32)
    skip = torch.rand(M) < 0.25
    skip[0] = True
    sp_in, dp_in = sp.clone(), dp.clone()
    sp_in[skip & (torch.rand(M) < 0.5)] = -1
    dp_in[skip & (sp_in >= 0)] = -1
    return fs, fd, pool, (sp_in, sr, dp_in, dr), ~skip


@pytest.mark.parametrize("cache_dtype", DTYPES)
@pytest.mark.parametrize("src,dst", [("K8V4", "K8V4"), ("K4V2", "K4V2"), ("K16V16", "K16V16"),
                                     ("K8V4", "K4V2"), ("K8V8", "K4V4"), ("K16V16", "K8V4"), ("K4V2", "K16V16"),
                                     ("K8V4", "K8V2"), ("K8V8-e4m3", "K8V8-e4m3"), ("K8V4", "K4V2-untracked"),
                                     ("K4V4", "K4V4-untracked")])
@pytest.mark.parametrize("D", [64, 128])
def test_move_tokens(cache_dtype, src, dst, D):
    fs, fd, pool, (sp, sr, dp, dr), moved = _setup(src, dst, cache_dtype, D, 37, seed=len(src + dst) + D)
    out = {}
    for impl in ("triton", "ref"):
        out[impl] = pool.clone().to(DEVICE)
        move_tokens(out[impl], fs, fd, cache_dtype, *(x.to(DEVICE) for x in (sp, sr, dp, dr)), impl=impl)
        out[impl] = out[impl].cpu()
    assert TOL[cache_dtype] == 0.0
    assert torch.equal(out["triton"], out["ref"]), "triton differs from the reference"
    res = out["ref"]
    # Only destination rows change: source pages are untouched, and so is everything of skipped rows.
    assert torch.equal(res[:3], pool[:3])
    changed = torch.zeros_like(pool, dtype=torch.bool)
    for m in range(len(sp)):
        s_p, s_r, d_p, d_r = int(sp[m]), int(sr[m]), int(dp[m]), int(dr[m])
        if not moved[m]:
            continue
        for which in ("k", "v"):
            sbits, sdata, smeta = _row(pool, fs, cache_dtype, which, s_p, s_r)
            dbits, ddata, dmeta = _row(res, fd, cache_dtype, which, d_p, d_r)
            if sbits == dbits:  # same precision on this side: the exact bytes
                assert torch.equal(ddata, sdata) and (smeta is None or torch.equal(dmeta, smeta))
            else:  # dequantize the source, quantize it in the destination precision
                x = _decode(sbits, sdata, smeta, cache_dtype, D)
                if dbits == 16:
                    assert torch.equal(ddata.view(cache_dtype), x.to(cache_dtype))
                else:
                    packed, scale, zero = quantize_ref(x, dbits)
                    assert torch.equal(ddata, packed)
                    assert torch.equal(dmeta.view(torch.float16), torch.stack([scale, zero]))
        if fd.tracked:
            for so, do in ((fs.score_off, fd.score_off), (fs.pos_off, fd.pos_off)):
                assert torch.equal(res[d_p, do + 4 * d_r: do + 4 * d_r + 4],
                                   pool[s_p, so + 4 * s_r: so + 4 * s_r + 4])
        # mark the destination row's bytes
        for which in ("k", "v"):
            bits = fd.key_bits if which == "k" else fd.value_bits
            off = fd.k_off if which == "k" else fd.v_off
            rb = D * fd.full_itemsize if bits == 16 else D * bits // 8
            changed[d_p, off + d_r * rb: off + (d_r + 1) * rb] = True
            if bits < 16:
                moff = fd.k_meta_off if which == "k" else fd.v_meta_off
                changed[d_p, moff + 4 * d_r: moff + 4 * d_r + 4] = True
        for o in (fd.score_off, fd.pos_off) if fd.tracked else ():  # untracked: no other byte may change
            changed[d_p, o + 4 * d_r: o + 4 * d_r + 4] = True
    assert changed.any() and torch.equal(res[~changed], pool[~changed])  # bytes outside moved rows unchanged


@pytest.mark.parametrize("src,dst", [("K8V8-e4m3", "K8V8"), ("K8V8", "K8V8-e4m3"), ("K8V8-e4m3", "K4V4"),
                                     ("K16V16", "K8V8-e4m3")])
def test_e4m3_rows_move_only_to_e4m3_rows(src, dst):
    """e4m3 bytes copied as integer codes (or the reverse) would decode to garbage: refused, naming both formats."""
    fs, fd, pool, (sp, sr, dp, dr), _ = _setup(src, dst, torch.float32, 64, 5, seed=7)
    for impl in ("triton", "ref"):
        with pytest.raises(ValueError, match="e4m3 rows move only to e4m3 rows"):
            move_tokens(pool.to(DEVICE), fs, fd, torch.float32, *(x.to(DEVICE) for x in (sp, sr, dp, dr)), impl=impl)
