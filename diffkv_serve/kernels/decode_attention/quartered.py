"""The quartered decode kernel: pages of any integer precision (16/8/4/2-bit keys and values), a high section and
an optional low section per (sequence, KV head). dispatch.py sends it every call that the full-width kernels
(f16.py: 16-bit pages only; q8.py: K8V8 pages without a low section) do not take.

One program per (batch entry, KV head, split) reads each page once for the whole query group. 16-bit sides load
the cache dtype; 8/4/2-bit sides load packed bytes and fp16 scale/zero and dequantize on the fly (planar
layout, diffkv_serve/kernels/quant.py). The head dimension is worked in quarters, so packed rows reach the tensor cores
without a reshape (_attend_section). A high section takes pages from the left of its page-table row, a low
section (fmt_low) from the right; each program walks its share of high tokens, then of low tokens. Optional
per-token logits and per-head lse feed the generation-phase significance update (diffkv_serve/kernels/score_update.py). All
of it hides behind constexpr branches: a K16V16 call without a low section compiles to a plain loop.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from diffkv_serve.kernels._common import next_pow2, seg_offsets
from diffkv_serve.kernels.decode_attention.tiles import (LOG2E, even_odd, group_rows, load_scale_zero, max_and_top_scale,
                                            natural_lse, pad_rows, pair_planes, plane_codes, program_span, top_rows)
from diffkv_serve.kernels.page_layout import PageFormat
from diffkv_serve.kernels.sections import section_page, split_range


@triton.jit
def _dot(a, b, acc, DOT_FP32: tl.constexpr):
    if DOT_FP32:
        return tl.dot(a.to(tl.float32), b.to(tl.float32), acc, input_precision="ieee")
    else:
        return tl.dot(a, b, acc)


BIAS = tl.constexpr(1024.0)  # codes reach the dots as fp16 numbers 1024 + c * 2^s (see tiles.planes_ptx)


@triton.jit
def _bias(DOT_FP32: tl.constexpr):
    """What _operands adds to every code: 1024 for the fp16 dots, nothing for the fp32 ones."""
    if DOT_FP32:
        return 0.0
    else:
        return BIAS


@triton.jit
def _operands(chunk, BITS: tl.constexpr, DT: tl.constexpr, DOT_FP32: tl.constexpr, PURE: tl.constexpr = False):
    """Every plane of a loaded chunk as a dot operand (a tuple): the cache-dtype values at 16 bits, else plane
    p's codes c as 1024 + c * 2^(p * BITS) in fp16 (by PTX, on the GPU), or c * 2^(p * BITS) in fp32
    (interpreter / fp32 caches: no bias, whose cancellation would cost fp32 digits there; see _bias)."""
    if BITS == 16:
        if DOT_FP32:
            return (chunk.to(tl.float32),)
        else:
            return (chunk.to(DT),)
    else:
        return plane_codes(chunk, BITS, DOT_FP32, PURE)


@triton.jit
def _pick(x0, x1, x2, x3, i: tl.constexpr):
    if i == 0:
        return x0
    elif i == 1:
        return x1
    elif i == 2:
        return x2
    else:
        return x3


@triton.jit
def _load_chunk(pool_c, pool_u8, page, row, tmask, page_elems, page_bytes, off, c: tl.constexpr,
                BITS: tl.constexpr, D: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_Q: tl.constexpr):
    """Chunk c of rows `row` of pages `page`: [BLOCK_N, BLOCK_Q] cache-dtype elements at 16 bits (quarter c),
    else D/4 packed bytes (uint8) holding the planes of several quarters (see _attend_section). Columns past
    D/4 (BLOCK_Q pads a quarter to the dot's minimum of 16) read as 0."""
    DQ: tl.constexpr = D // 4
    j = tl.arange(0, BLOCK_Q)
    mask = tmask[:, None] & (j < DQ)[None, :] if BLOCK_Q > DQ else tmask[:, None]
    if BITS == 16:
        return tl.load(pool_c + off + (page * page_elems + row * D + c * DQ)[:, None] + j[None, :],
                       mask=mask, other=0.0)
    else:
        RB: tl.constexpr = D * BITS // 8
        return tl.load(pool_u8 + (page * page_bytes + off + row * RB + c * DQ)[:, None] + j[None, :],
                       mask=mask, other=0)


@triton.jit
def _load_key_pairs(pool_u8, page, row, tmask, page_bytes, off, c: tl.constexpr, BITS: tl.constexpr,
                    D: tl.constexpr):
    """Chunk c of key rows `row` of pages `page` as uint16 byte pairs [N, D / 8]. Every offset is even: segments
    start at multiples of 16 bytes, rows and chunks are D * BITS / 8 and D / 4 bytes long."""
    DQ: tl.constexpr = D // 4
    RB: tl.constexpr = D * BITS // 8
    j = tl.arange(0, DQ // 2)
    base = (page * page_bytes + off + row * RB + c * DQ) // 2
    return tl.load(pool_u8.to(tl.pointer_type(tl.uint16)) + base[:, None] + j[None, :], mask=tmask[:, None],
                   other=0)


@triton.jit
def _sum3(a0, b0, c0, a1, b1, c1):
    return a0 + a1, b0 + b1, c0 + c1


@triton.jit
def _attend_section(
    q0, q1, q2, q3, qsum, m_i, l_i, a0, a1, a2, a3, lo, hi, pt_row, col0,
    pool_c, pool_u8, pool_w, page_elems, page_bytes, k_off, k_meta, v_off, v_meta,
    qk_scale, sm_scale, gmask, logit_rows, logit_base,
    KB: tl.constexpr, VB: tl.constexpr, T: tl.constexpr, LOW: tl.constexpr, WRITE_LOGITS: tl.constexpr,
    GROUP: tl.constexpr, BLOCK_G: tl.constexpr, BLOCK_N: tl.constexpr, D: tl.constexpr, BLOCK_Q: tl.constexpr,
    DOT_FP32: tl.constexpr, PURE_K: tl.constexpr = False, PURE_V: tl.constexpr = False, V_EARLY: tl.constexpr = False,
    RED: tl.constexpr = 0, KEY_PAIRS: tl.constexpr = False,
):
    """Online softmax over tokens [lo, hi) of one section (the high one, or the low one read from the right).

    The head dimension is split into four quarters, which is what lets packed rows reach the tensor cores
    without any reshape: a row of b < 16 bits is b/2 chunks of D/4 bytes, and plane p of chunk c (bits
    p*b..p*b+b-1 of each byte, planar packing in diffkv_serve/kernels/quant.py) holds exactly quarter p*(b/2) + c. So every
    quarter is one load (shared by its chunk's planes), a shift and a mask, and feeds its own dots:
        q . k_n       = sum_quarters q_Q . k_n,Q
        (p V)[:, Q]   = p @ V[:, Q]          (a0..a3 are the four quarters of the output accumulator)
    Quantized sides never materialize dequantized tiles: with x = c * scale + zero per token,
        q . k_n      = scale_n * (q . c_n) + zero_n * sum(q)
        sum_n p_n v_n = sum_n (p_n scale_n) c_n + sum_n p_n zero_n
    so the dots run on the integer codes (exact in fp16; q0..q3 are fp16 then) and scale/zero act on [G, N]
    only. The value weights p_n scale_n are divided by the tile's largest scale before the fp16 cast.

    RED picks how a tile's per-row sums (softmax denominator, value zero points, the value codes' bias) and
    its top value scale are taken; each reduction across the warps costs a shared-memory round trip and a
    barrier. 0: one reduction each (five per tile, with the logit max); 1: the top scale rides in a padding row
    of the logit max and the three sums are one tuple reduction (two per tile). (Keeping the sums [G, N] until
    the section ends, as q8.py does, took 168-255 registers here and was slower.)

    KEY_PAIRS (quantized keys only): the key dots take q padded with zero rows to twice BLOCK_G and the key
    codes read as uint16 byte pairs, split into even and odd dims (two dots per plane, in two mma chains). An
    8-row operand is replicated into the mma's 16 rows, and byte-loaded codes make Triton pick kWidth 4, under
    which the q fragments cannot come from ldmatrix; together they cost ~100 register moves per tile. With 16
    distinct rows and 16-bit loads (kWidth 2) they are gone (benchmarks/decode_sass.py)."""
    DT = pool_c.dtype.element_ty
    KR: tl.constexpr = 1 if KB == 16 else 8 // KB  # planes per chunk
    KC: tl.constexpr = 4 // KR  # chunks per row
    VR: tl.constexpr = 1 if VB == 16 else 8 // VB
    VC: tl.constexpr = 4 // VR
    # A padding row of the [G, N] logits that carries the value scales, so their max comes with the logits'.
    TOP_ROW: tl.constexpr = BLOCK_G - 1 if RED == 1 and VB != 16 and BLOCK_G > GROUP else -1
    page_words = page_bytes // 4
    g = tl.arange(0, BLOCK_G)
    s0 = tl.zeros([BLOCK_G, BLOCK_N], tl.float32)
    if KB != 16:
        # Quarter i holds plane i // KC, whose biased codes are 1024 + c * 2^s: q's quarter is scaled by 2^-s
        # (exact) and the dots start from -1024 * sum(scaled q), so they sum q . c. fp16 whatever the cache dtype.
        QT = tl.float32 if DOT_FP32 else tl.float16
        q0 = q0.to(QT)
        q1 = (q1 * (2.0 ** -((1 // KC) * KB))).to(QT)
        q2 = (q2 * (2.0 ** -((2 // KC) * KB))).to(QT)
        q3 = (q3 * (2.0 ** -((3 // KC) * KB))).to(QT)
        qb = (tl.sum(q0.to(tl.float32), 1) + tl.sum(q1.to(tl.float32), 1) + tl.sum(q2.to(tl.float32), 1)
              + tl.sum(q3.to(tl.float32), 1))
        s0 = s0 - _bias(DOT_FP32) * qb[:, None]
    PAIRED: tl.constexpr = KEY_PAIRS and KB != 16
    if PAIRED:
        q0 = pad_rows(q0)
        q1 = pad_rows(q1)
        q2 = pad_rows(q2)
        q3 = pad_rows(q3)
    for t0 in range(lo, hi, BLOCK_N):
        t = t0 + tl.arange(0, BLOCK_N)
        tmask = t < hi
        page = section_page(pt_row, col0, t, tmask, T, LOW)
        row = t % T
        s = s0
        if V_EARLY:  # value loads issued before the key math, so they are in flight during it
            w0 = _load_chunk(pool_c, pool_u8, page, row, tmask, page_elems, page_bytes, v_off, 0, VB, D, BLOCK_N,
                             BLOCK_Q)
            w1 = w0
            w2 = w0
            w3 = w0
            if VC > 1:
                w1 = _load_chunk(pool_c, pool_u8, page, row, tmask, page_elems, page_bytes, v_off, 1, VB, D, BLOCK_N,
                                 BLOCK_Q)
            if VC > 2:
                w2 = _load_chunk(pool_c, pool_u8, page, row, tmask, page_elems, page_bytes, v_off, 2, VB, D, BLOCK_N,
                                 BLOCK_Q)
                w3 = _load_chunk(pool_c, pool_u8, page, row, tmask, page_elems, page_bytes, v_off, 3, VB, D, BLOCK_N,
                                 BLOCK_Q)
        if PAIRED:
            s_even = tl.zeros([2 * BLOCK_G, BLOCK_N], tl.float32)
            s_odd = tl.zeros([2 * BLOCK_G, BLOCK_N], tl.float32)
            for c in tl.static_range(KC):
                codes = pair_planes(_load_key_pairs(pool_u8, page, row, tmask, page_bytes, k_off, c, KB, D), KB,
                                    DOT_FP32)
                for p in tl.static_range(KR):
                    k_even = codes[2 * p]
                    k_odd = codes[2 * p + 1]
                    q_even, q_odd = even_odd(_pick(q0, q1, q2, q3, p * KC + c))
                    s_even = _dot(q_even, tl.trans(k_even), s_even, DOT_FP32)
                    s_odd = _dot(q_odd, tl.trans(k_odd), s_odd, DOT_FP32)
            s = s + top_rows(s_even + s_odd)
        else:
            for c in tl.static_range(KC):
                chunk = _load_chunk(pool_c, pool_u8, page, row, tmask, page_elems, page_bytes, k_off, c, KB, D,
                                    BLOCK_N, BLOCK_Q)
                k_planes = _operands(chunk, KB, DT, DOT_FP32, PURE_K)
                for p in tl.static_range(KR):
                    s = _dot(_pick(q0, q1, q2, q3, p * KC + c), tl.trans(k_planes[p]), s, DOT_FP32)
        if KB != 16:
            ks, kz = load_scale_zero(pool_w, page, row, tmask, page_words, k_meta)
            s = s * ks[None, :] + qsum[:, None] * kz[None, :]
        if WRITE_LOGITS:
            tl.store(logit_rows[:, None] + (logit_base + t)[None, :], s * sm_scale,
                     mask=gmask[:, None] & tmask[None, :])
        s = tl.where(tmask[None, :], s * qk_scale, float("-inf"))  # log2 domain: exp2 below
        if VB != 16:
            vs, vz = load_scale_zero(pool_w, page, row, tmask, page_words, v_meta)
            s, tile_max, top = max_and_top_scale(s, vs, g, TOP_ROW)
        else:
            tile_max = tl.max(s, 1)
        m_new = tl.maximum(m_i, tile_max)
        p_ = tl.exp2(s - m_new[:, None])
        alpha = tl.exp2(m_i - m_new)
        a0 = a0 * alpha[:, None]
        a1 = a1 * alpha[:, None]
        a2 = a2 * alpha[:, None]
        a3 = a3 * alpha[:, None]
        if VB == 16:
            pv = p_.to(tl.float32) if DOT_FP32 else p_.to(DT)
        else:
            rtop = 1.0 / top  # one division per tile, not one per token and row
            pv = p_ * (vs * rtop)[None, :]
            pv = pv.to(tl.float32) if DOT_FP32 else pv.to(tl.float16)
        # Plane p's dot gives 1024 * sum(pv) + 2^s * (pv . c); with zb = -1024 * sum(pv) and zt = sum(p * zero)
        # / top, starting it from zb + 2^s * zt leaves 2^s * (pv . c + zt), which one multiply by top * 2^-s
        # turns into p . v.
        if RED == 1 and VB != 16:
            ls, zs, ws = tl.reduce((p_, p_ * vz[None, :], pv.to(tl.float32)), 1, _sum3)
            l_i = l_i * alpha + ls
            zt = tl.zeros([BLOCK_G, BLOCK_Q], tl.float32) + (zs * rtop)[:, None]
            zb = tl.zeros([BLOCK_G, BLOCK_Q], tl.float32) - _bias(DOT_FP32) * ws[:, None]
        else:
            l_i = l_i * alpha + tl.sum(p_, 1)
            if VB != 16:
                zt = tl.zeros([BLOCK_G, BLOCK_Q], tl.float32) + (tl.sum(p_ * vz[None, :], 1) * rtop)[:, None]
                zb = tl.zeros([BLOCK_G, BLOCK_Q], tl.float32) - _bias(DOT_FP32) * tl.sum(pv.to(tl.float32), 1)[:, None]
        for c in tl.static_range(VC):
            if V_EARLY:
                chunk = _pick(w0, w1, w2, w3, c)
            else:
                chunk = _load_chunk(pool_c, pool_u8, page, row, tmask, page_elems, page_bytes, v_off, c, VB, D,
                                    BLOCK_N, BLOCK_Q)
            v_planes = _operands(chunk, VB, DT, DOT_FP32, PURE_V)
            for p in tl.static_range(VR):
                v = v_planes[p]
                if VB == 16:
                    if p * VC + c == 0:
                        a0 = _dot(pv, v, a0, DOT_FP32)
                    elif p * VC + c == 1:
                        a1 = _dot(pv, v, a1, DOT_FP32)
                    elif p * VC + c == 2:
                        a2 = _dot(pv, v, a2, DOT_FP32)
                    else:
                        a3 = _dot(pv, v, a3, DOT_FP32)
                else:
                    part = _dot(pv, v, zb + zt * (2.0 ** (p * VB)), DOT_FP32) * (top * (2.0 ** -(p * VB)))
                    if p * VC + c == 0:
                        a0 = a0 + part
                    elif p * VC + c == 1:
                        a1 = a1 + part
                    elif p * VC + c == 2:
                        a2 = a2 + part
                    else:
                        a3 = a3 + part
        m_i = m_new
    return m_i, l_i, a0, a1, a2, a3


@triton.jit
def _q_quarter(q_ptr, hq, gmask, i: tl.constexpr, D: tl.constexpr, BLOCK_Q: tl.constexpr, DOT_FP32: tl.constexpr,
               DT: tl.constexpr):
    j = tl.arange(0, BLOCK_Q)
    q = tl.load(q_ptr + hq[:, None] + (i * (D // 4) + j)[None, :], mask=gmask[:, None] & (j < D // 4)[None, :],
                other=0.0)
    return q.to(tl.float32) if DOT_FP32 else q.to(DT)


@triton.jit
def _store_quarters(ptr, rows, gmask, a0, a1, a2, a3, D: tl.constexpr, BLOCK_Q: tl.constexpr):
    """a0..a3 [G, BLOCK_Q] (the quarters of the head dimension) -> ptr + rows[:, None] + column, in ptr's dtype."""
    j = tl.arange(0, BLOCK_Q)
    ty = ptr.dtype.element_ty
    mask = gmask[:, None] & (j < D // 4)[None, :]
    tl.store(ptr + rows[:, None] + j[None, :], a0.to(ty), mask=mask)
    tl.store(ptr + rows[:, None] + (D // 4 + j)[None, :], a1.to(ty), mask=mask)
    tl.store(ptr + rows[:, None] + (2 * (D // 4) + j)[None, :], a2.to(ty), mask=mask)
    tl.store(ptr + rows[:, None] + (3 * (D // 4) + j)[None, :], a3.to(ty), mask=mask)


@triton.jit(do_not_specialize=["num_splits"])  # one variant whatever the split count
def _decode_split_kernel(
    q_ptr, pool_c, pool_u8, pool_w, pt_ptr, len_ptr, lenlo_ptr, slots_ptr, o_ptr, mid_acc, mid_ml,
    logits_ptr, lse_ptr,
    stride_qb, stride_qh, stride_ob, stride_oh,
    stride_pts, stride_ptl, stride_pth, stride_ls, stride_ll, stride_lh,
    stride_lls, stride_lll, stride_llh, stride_gb, stride_gh, stride_eb, stride_eh,
    layer, qk_scale, sm_scale, Hq, low_col0, num_splits,
    page_elems, page_bytes,
    k_off, k_meta, v_off, v_meta,  # high section format (16 bits: cache-dtype elements; else bytes / 4-byte words)
    lk_off, lk_meta, lv_off, lv_meta,  # low section format
    GROUP: tl.constexpr, T: tl.constexpr, SPLIT: tl.constexpr,
    BLOCK_G: tl.constexpr, BLOCK_N: tl.constexpr, D: tl.constexpr, BLOCK_Q: tl.constexpr, DOT_FP32: tl.constexpr,
    KB: tl.constexpr = 16, VB: tl.constexpr = 16,
    HAS_LOW: tl.constexpr = False, KB_LO: tl.constexpr = 16, VB_LO: tl.constexpr = 16, T_LO: tl.constexpr = 1,
    WRITE_LOGITS: tl.constexpr = False, WRITE_LSE: tl.constexpr = False,
    PURE_K: tl.constexpr = False, PURE_V: tl.constexpr = False, V_EARLY: tl.constexpr = False,
    RED: tl.constexpr = 0, KEY_PAIRS: tl.constexpr = False,
):
    b, h, split, slot, length, pt_row, lo, hi = program_span(
        slots_ptr, len_ptr, pt_ptr, stride_pts, stride_ptl, stride_pth, stride_ls, stride_ll, stride_lh, layer,
        num_splits, BLOCK_N)
    _, hq, gmask = group_rows(h, GROUP, BLOCK_G)
    DT = pool_c.dtype.element_ty
    q_rows = q_ptr + b * stride_qb
    q0 = _q_quarter(q_rows, hq * stride_qh, gmask, 0, D, BLOCK_Q, DOT_FP32, DT)
    q1 = _q_quarter(q_rows, hq * stride_qh, gmask, 1, D, BLOCK_Q, DOT_FP32, DT)
    q2 = _q_quarter(q_rows, hq * stride_qh, gmask, 2, D, BLOCK_Q, DOT_FP32, DT)
    q3 = _q_quarter(q_rows, hq * stride_qh, gmask, 3, D, BLOCK_Q, DOT_FP32, DT)
    # sum(q) in the precision the codes' dots see it (fp16 on the GPU): folds key zero points into the dot
    if DOT_FP32:
        qsum = tl.sum(q0, 1) + tl.sum(q1, 1) + tl.sum(q2, 1) + tl.sum(q3, 1)
    else:
        qsum = (tl.sum(q0.to(tl.float16).to(tl.float32), 1) + tl.sum(q1.to(tl.float16).to(tl.float32), 1)
                + tl.sum(q2.to(tl.float16).to(tl.float32), 1) + tl.sum(q3.to(tl.float16).to(tl.float32), 1))
    logit_rows = logits_ptr + b * stride_gb + hq * stride_gh  # only used with WRITE_LOGITS

    m_i = tl.full([BLOCK_G], -1.0e30, tl.float32)  # finite, so empty splits merge without NaN
    l_i = tl.zeros([BLOCK_G], tl.float32)
    a0 = tl.zeros([BLOCK_G, BLOCK_Q], tl.float32)
    a1 = tl.zeros([BLOCK_G, BLOCK_Q], tl.float32)
    a2 = tl.zeros([BLOCK_G, BLOCK_Q], tl.float32)
    a3 = tl.zeros([BLOCK_G, BLOCK_Q], tl.float32)
    m_i, l_i, a0, a1, a2, a3 = _attend_section(
        q0, q1, q2, q3, qsum, m_i, l_i, a0, a1, a2, a3, lo, hi, pt_row, 0, pool_c, pool_u8, pool_w,
        page_elems, page_bytes, k_off, k_meta, v_off, v_meta, qk_scale, sm_scale, gmask, logit_rows, 0,
        KB, VB, T, False, WRITE_LOGITS, GROUP, BLOCK_G, BLOCK_N, D, BLOCK_Q, DOT_FP32, PURE_K, PURE_V, V_EARLY,
        RED, KEY_PAIRS)
    if HAS_LOW:
        # The low section (its own format, pages from the right end of the row), split the same way.
        length_lo = tl.load(lenlo_ptr + slot * stride_lls + layer * stride_lll + h * stride_llh)
        lo_lo, hi_lo = split_range(length_lo, split, num_splits, BLOCK_N)
        m_i, l_i, a0, a1, a2, a3 = _attend_section(
            q0, q1, q2, q3, qsum, m_i, l_i, a0, a1, a2, a3, lo_lo, hi_lo, pt_row, low_col0, pool_c, pool_u8,
            pool_w, page_elems, page_bytes, lk_off, lk_meta, lv_off, lv_meta, qk_scale, sm_scale, gmask,
            logit_rows, length, KB_LO, VB_LO, T_LO, True, WRITE_LOGITS, GROUP, BLOCK_G, BLOCK_N, D, BLOCK_Q,
            DOT_FP32, PURE_K, PURE_V, V_EARLY, RED, KEY_PAIRS)

    if SPLIT:
        idx = (b * Hq + hq) * num_splits + split  # mid_* are contiguous [B, Hq, num_splits, ...]
        _store_quarters(mid_acc, idx * D, gmask, a0, a1, a2, a3, D, BLOCK_Q)
        tl.store(mid_ml + idx * 2, m_i, mask=gmask)
        tl.store(mid_ml + idx * 2 + 1, l_i, mask=gmask)
    else:
        inv = 1.0 / tl.where(l_i > 0, l_i, 1.0)[:, None]  # length 0 -> zeros
        _store_quarters(o_ptr + b * stride_ob, hq * stride_oh, gmask, a0 * inv, a1 * inv, a2 * inv, a3 * inv, D,
                        BLOCK_Q)
        if WRITE_LSE:
            tl.store(lse_ptr + b * stride_eb + hq * stride_eh, natural_lse(m_i, l_i), mask=gmask)


def _word_meta(fmt: PageFormat, which: str) -> tuple[int, int]:
    """seg_offsets with the scale/zero offset in 4-byte words: a token's (scale, zero) is one word, which
    cp.async can stream (it copies 4 bytes or more)."""
    off, meta = seg_offsets(fmt, which)
    return off, meta // 2


def launch_quartered(q, pc, pool, page_table, lengths, lenlo, slots, out, mid_acc, mid_ml, logits, lse, layer, scale,
                     num_splits, fmt, low, has_low, block_n, dot_fp32, cfg, warps, stages, write_logits, write_lse):
    """Launches the quartered kernel on the (batch, KV head, split) grid; pc is the pool viewed as the cache
    dtype, low the low section's format (fmt again without one), lenlo its lengths (lengths without one)."""
    (B, Hq, D), Hkv, T = q.shape, page_table.shape[2], fmt.tokens
    group = Hq // Hkv
    if cfg.key_pairs and D < 128:
        raise ValueError(f"LaunchConfig.key_pairs needs head_dim >= 128 (a dot over D / 8 >= 16 dims), got {D}")
    _decode_split_kernel[(B, Hkv, num_splits)](
        q, pc, pool, pool.view(torch.int32), page_table, lengths, lenlo, slots, out, mid_acc, mid_ml,
        logits, lse,
        q.stride(0), q.stride(1), out.stride(0), out.stride(1),
        page_table.stride(0), page_table.stride(1), page_table.stride(2),
        lengths.stride(0), lengths.stride(1), lengths.stride(2),
        lenlo.stride(0), lenlo.stride(1), lenlo.stride(2), logits.stride(0), logits.stride(1),
        lse.stride(0), lse.stride(1),
        layer, scale * LOG2E, scale, Hq, page_table.shape[3] - 2, num_splits,
        fmt.page_bytes // fmt.full_itemsize, fmt.page_bytes,
        *_word_meta(fmt, "k"), *_word_meta(fmt, "v"), *_word_meta(low, "k"), *_word_meta(low, "v"),
        GROUP=group, T=T, SPLIT=num_splits > 1,
        BLOCK_G=max(cfg.min_rows, next_pow2(group)), BLOCK_N=block_n, D=D, BLOCK_Q=max(16, D // 4),
        DOT_FP32=dot_fp32,
        KB=fmt.key_bits, VB=fmt.value_bits,
        HAS_LOW=has_low, KB_LO=low.key_bits, VB_LO=low.value_bits, T_LO=low.tokens if has_low else 1,
        WRITE_LOGITS=write_logits, WRITE_LSE=write_lse,
        PURE_K=cfg.pure_k, PURE_V=cfg.pure_v, V_EARLY=cfg.v_early, RED=cfg.red, KEY_PAIRS=cfg.key_pairs,
        num_warps=warps, num_stages=stages, **({} if cfg.maxnreg is None else dict(maxnreg=cfg.maxnreg)),
    )
