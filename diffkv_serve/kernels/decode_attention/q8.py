"""Decode attention over K8V8 pages without a low section (kv_mode int8, and fp8 with FP8): the full head
dimension in one tile per token block, like f16.py.

Scale and zero (x = c * scale + zero per token) act outside the dots, on [G, N]; the dots run on the codes:
    q . k_n       = scale_n * (q . c_n) + zero_n * sum(q)
    sum_n p_n v_n = top * ((p * scale / top) @ C) + sum_n p_n zero_n
top is the tile's largest value scale: it keeps the fp16 value weights in [0, 1]. On the GPU the codes reach the
dots as the fp16 numbers 1024 + c (0x64XX, one prmt per two codes); the 1024 comes off in the same [G, N] terms.

What makes it fast (on an H100): the [BLOCK_N, D] byte tiles are plain loads, which Triton's pipeliner streams
through shared memory with cp.async; num_stages 5 gives two buffers per tile (its stage count is split between
the page-table load and the loads it addresses). Value codes are unpacked before the shared-memory transpose that
feeds the value dot (ldmatrix.trans on fp16), not after it (one byte per shared load). The running sums (softmax
denominator, zero-point terms) stay [G, N] across the loop and are reduced once at the end, and the tile's top
scale rides in a padding row of the logit max: one cross-warp reduction per tile instead of five.

FP8 (e4m3 codes, zero point 0): the codes reach the dots as their own values in fp16 (one conversion per two
codes, exact), so the bias and the zero-point terms drop out; the scales act on [G, N] as above. Value codes are
converted by asm kept before the transpose, as the integer ones are unpacked: converted after it, they were read
as single bytes (128 shared loads per tile) and fp8 ran at 0.79-0.88 of the decode floor where K8V8 ran at
0.85-0.96; now both run alike (benchmarks/attention.py, docs/PERFORMANCE.md).
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from diffkv_serve.kernels._common import next_pow2
from diffkv_serve.kernels.decode_attention.tiles import (LOG2E, group_rows, load_scale_zero, max_and_top_scale, planes_ptx,
                                            program_span, store_result)
from diffkv_serve.kernels.quant import e4m3_values
from diffkv_serve.kernels.sections import section_page

# Four codes (bytes of $2) -> fp16 pairs 1024 + c: each byte under an 0x64 exponent byte.
_PRMT = tl.constexpr(planes_ptx(8))
# Four e4m3 codes (bytes of $2) -> their values as two fp16 pairs (sm_89+, as Triton's own fp8 conversion).
_E4M3 = tl.constexpr("{\n.reg .b16 lo, hi;\nmov.b32 {lo, hi}, $2;\ncvt.rn.f16x2.e4m3x2 $0, lo;\n"
                     "cvt.rn.f16x2.e4m3x2 $1, hi;\n}")


@triton.jit
def _codes(x, DOT_FP32: tl.constexpr, PURE: tl.constexpr, FP8: tl.constexpr):
    """uint8 tile -> dot operand: c in fp32 (interpreter), else 1024 + c in fp16; e4m3 codes as their values
    (fp32 or fp16). PURE lets Triton unpack after its shared-memory layout change (the keys: their dot reads
    rows as they lie); not pure keeps it before (the values: the dot needs them transposed, which
    ldmatrix.trans does on 16-bit data only; converted after it, e4m3 values cost 128 single-byte shared
    loads per tile)."""
    if FP8 and (DOT_FP32 or PURE):
        return e4m3_values(x, tl.float32 if DOT_FP32 else tl.float16)
    elif FP8:  # asm kept before the transpose, like the integer codes: the pure form read single bytes after it
        return tl.inline_asm_elementwise(_E4M3, "=r,=r,r", [x], dtype=tl.float16, is_pure=False, pack=4)
    elif DOT_FP32:
        return x.to(tl.float32)
    else:
        return tl.inline_asm_elementwise(_PRMT, "=r,=r,r", [x], dtype=tl.float16, is_pure=PURE, pack=4)


@triton.jit
def _dot(a, b, DOT_FP32: tl.constexpr):
    if DOT_FP32:
        return tl.dot(a, b, input_precision="ieee")
    else:
        return tl.dot(a, b)


@triton.jit(do_not_specialize=["num_splits"])  # one variant whatever the split count
def decode_q8_kernel(
    q_ptr, pool_u8, pool_w, pt_ptr, len_ptr, slots_ptr, o_ptr, mid_acc, mid_ml, logits_ptr, lse_ptr,
    stride_qb, stride_qh, stride_ob, stride_oh, stride_pts, stride_ptl, stride_pth, stride_ls, stride_ll, stride_lh,
    stride_gb, stride_gh, stride_eb, stride_eh,
    layer, qk_scale, sm_scale, Hq, num_splits, page_bytes, k_off, k_meta_w, v_off, v_meta_w,
    GROUP: tl.constexpr, T: tl.constexpr, SPLIT: tl.constexpr, BLOCK_G: tl.constexpr, BLOCK_N: tl.constexpr,
    D: tl.constexpr, DOT_FP32: tl.constexpr, WRITE_LOGITS: tl.constexpr, WRITE_LSE: tl.constexpr,
    FP8: tl.constexpr = False,
):
    """k_off, v_off in bytes; k_meta_w, v_meta_w in 4-byte words; D a power of two (a row is D bytes);
    FP8: the codes are e4m3."""
    b, h, split, slot, length, pt_row, lo, hi = program_span(
        slots_ptr, len_ptr, pt_ptr, stride_pts, stride_ptl, stride_pth, stride_ls, stride_ll, stride_lh, layer,
        num_splits, BLOCK_N)
    page_words = page_bytes // 4

    g, hq, gmask = group_rows(h, GROUP, BLOCK_G)
    d = tl.arange(0, D)
    q = tl.load(q_ptr + b * stride_qb + hq[:, None] * stride_qh + d[None, :], mask=gmask[:, None], other=0.0)
    QT = tl.float32 if DOT_FP32 else tl.float16
    q = q.to(QT)  # fp16 whatever the cache dtype: the codes are exact in it
    qsum = tl.sum(q.to(tl.float32), 1)  # the dots' view of sum(q): folds key zero points (and the bias)
    BIAS: tl.constexpr = 0.0 if DOT_FP32 or FP8 else 1024.0
    TOP_ROW: tl.constexpr = BLOCK_G - 1 if BLOCK_G > GROUP else -1  # a padding row that carries the top scale
    logit_rows = logits_ptr + b * stride_gb + hq * stride_gh
    m_i = tl.full([BLOCK_G], -1.0e30, tl.float32)  # finite, so empty splits merge without NaN
    l_n = tl.zeros([BLOCK_G, BLOCK_N], tl.float32)  # softmax denominator, per column until the end
    z_n = tl.zeros([BLOCK_G, BLOCK_N], tl.float32)  # value zero-point and bias terms, likewise
    acc = tl.zeros([BLOCK_G, D], tl.float32)
    for t0 in range(lo, hi, BLOCK_N):
        t = t0 + tl.arange(0, BLOCK_N)
        tmask = t < hi
        page = section_page(pt_row, 0, t, tmask, T, False)
        row = t % T
        rows = (page * page_bytes + row * D)[:, None] + d[None, :]
        kc = tl.load(pool_u8 + k_off + rows, mask=tmask[:, None], other=0)
        s = _dot(q, tl.trans(_codes(kc, DOT_FP32, True, FP8)), DOT_FP32)  # q . c + BIAS * sum(q)
        ks, kz = load_scale_zero(pool_w, page, row, tmask, page_words, k_meta_w)
        if FP8:
            s = s * ks[None, :]
        else:
            s = s * ks[None, :] + qsum[:, None] * (kz - BIAS * ks)[None, :]
        if WRITE_LOGITS:
            tl.store(logit_rows[:, None] + t[None, :], s * sm_scale, mask=gmask[:, None] & tmask[None, :])
        s = tl.where(tmask[None, :], s * qk_scale, float("-inf"))  # log2 domain: exp2 below
        vs, vz = load_scale_zero(pool_w, page, row, tmask, page_words, v_meta_w)
        s, tile_max, top = max_and_top_scale(s, vs, g, TOP_ROW)
        m_new = tl.maximum(m_i, tile_max)
        p = tl.exp2(s - m_new[:, None])
        alpha = tl.exp2(m_i - m_new)
        l_n = l_n * alpha[:, None] + p
        pv = (p * (vs * (1.0 / top))[None, :]).to(QT)
        vc = tl.load(pool_u8 + v_off + rows, mask=tmask[:, None], other=0)
        acc = acc * alpha[:, None] + _dot(pv, _codes(vc, DOT_FP32, False, FP8), DOT_FP32) * top
        if not FP8:
            z_n = z_n * alpha[:, None] + (p * vz[None, :] - (BIAS * top) * pv.to(tl.float32))
        m_i = m_new

    acc = acc + tl.sum(z_n, 1)[:, None]
    l_i = tl.sum(l_n, 1)
    store_result(acc, m_i, l_i, b, hq, gmask, gmask[:, None], d, split, num_splits, Hq, o_ptr, stride_ob, stride_oh,
                 mid_acc, mid_ml, lse_ptr, stride_eb, stride_eh, D, SPLIT, WRITE_LSE)


def launch_q8(q, pool, page_table, lengths, slots, out, mid_acc, mid_ml, logits, lse, layer, scale, num_splits, fmt,
              block_n, dot_fp32, cfg, warps, stages, write_logits, write_lse):
    """Launches decode_q8_kernel on the (batch, KV head, split) grid (K8V8 pages, no low section)."""
    (B, Hq, D), Hkv = q.shape, page_table.shape[2]
    group = Hq // Hkv
    decode_q8_kernel[(B, Hkv, num_splits)](
        q, pool, pool.view(torch.int32), page_table, lengths, slots, out, mid_acc, mid_ml, logits, lse,
        q.stride(0), q.stride(1), out.stride(0), out.stride(1),
        page_table.stride(0), page_table.stride(1), page_table.stride(2),
        lengths.stride(0), lengths.stride(1), lengths.stride(2), logits.stride(0), logits.stride(1),
        lse.stride(0), lse.stride(1),
        layer, scale * LOG2E, scale, Hq, num_splits, fmt.page_bytes,
        fmt.k_off, fmt.k_meta_off // 4, fmt.v_off, fmt.v_meta_off // 4,
        GROUP=group, T=fmt.tokens, SPLIT=num_splits > 1, BLOCK_G=max(cfg.min_rows, next_pow2(group)),
        BLOCK_N=block_n, D=D,
        DOT_FP32=dot_fp32, WRITE_LOGITS=write_logits, WRITE_LSE=write_lse, FP8=fmt.float8,
        num_warps=warps, num_stages=stages,
    )
