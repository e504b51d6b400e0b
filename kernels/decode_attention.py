"""One-token-per-sequence attention over paged KV caches (decode), split along the sequence.

Kernel 1 runs one program per (batch entry, KV head, split): all query heads of the GQA group share each
key/value tile, so every page is read once. With one split it writes the output directly; otherwise it writes
partial (max, sum, acc) and kernel 2 merges the splits (flash-decoding).

Pages of any precision (DiffKV): 16-bit sides load the cache dtype; 8/4/2-bit sides load packed bytes and fp16
scale/zero and dequantize on the fly (planar layout, kernels/quant.py). Two full-width kernels take the common
single-precision caches (decode_kernel): 16-bit pages (kernels/decode_attention_f16.py) and K8V8 pages
(kernels/decode_attention_q8.py); the quartered kernel here takes everything else. A (sequence, head) may own a high
section (fmt, pages from the left of its page-table row) and a low section (fmt_low, pages from the right);
each program walks its share of high tokens, then of low tokens. Optional per-token logits and per-head lse
feed the generation-phase significance update (kernels/score_update.py). All of it hides behind constexpr
branches: a K16V16 call without a low section compiles to the same loop as before.
"""
from __future__ import annotations

import math
from typing import NamedTuple

import numpy as np
import torch
import triton
import triton.language as tl

from kernels._common import check_supported, dot_in_fp32, next_pow2, num_sms, seg_offsets, use_triton
from kernels.page_layout import PageFormat
from kernels.quant import read_pages_ref
from kernels.decode_attention_f16 import decode_f16_kernel
from kernels.decode_attention_q8 import decode_q8_kernel
from kernels.decode_tiles import (even_odd, load_scale_zero, max_and_top_scale, pad_rows, pair_planes, plane_codes,
                                  top_rows)
from kernels.sections import section_columns, section_page, split_range

LOG2E = 1.4426950408889634
# Work in flight per SM that the split count aims for, in warps x (head_dim / 64): a decode program streams one
# (sequence, KV head) serially, so batch x KV heads alone leaves SMs idle or starved of loads. Measured
# (benchmarks/results/decode_splits_H200.json): at SmolLM2's 3 KV heads and head_dim 64, batch 16 ran 3x faster
# split 8 ways than 2 ways, batch 64 1.4x faster split 2 ways than unsplit. On an H100 at the 8B shape (8 KV
# heads, head_dim 128) batch >= 32 is fastest unsplit (2 splits: 9-30% slower) and batch 8 at 4 splits for every
# precision (256 programs on 132 SMs; K8V8 at 16384 tokens 105 us against 129 us at 3 splits, whose 192
# programs leave 72 SMs with one program). 16 = two 4-warp programs of head_dim 128 per SM. The quartered
# kernel's one-warp programs (launch_config) get four times the splits from the same target (batch 8: 16,
# batch 32: 4), which its own sweep confirmed.
TARGET_WARP_DIMS_PER_SM = 16
MAX_SPLITS = 64


@triton.jit
def _dot(a, b, acc, DOT_FP32: tl.constexpr):
    if DOT_FP32:
        return tl.dot(a.to(tl.float32), b.to(tl.float32), acc, input_precision="ieee")
    else:
        return tl.dot(a, b, acc)


BIAS = tl.constexpr(1024.0)  # codes reach the dots as fp16 numbers 1024 + c * 2^s (see decode_tiles.planes_ptx)


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
    p*b..p*b+b-1 of each byte, planar packing in kernels/quant.py) holds exactly quarter p*(b/2) + c. So every
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
    the section ends, as kernels/decode_attention_q8.py does, took 168-255 registers here and was slower.)

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
    b, h, split = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    slot = tl.load(slots_ptr + b).to(tl.int64)
    length = tl.load(len_ptr + slot * stride_ls + layer * stride_ll + h * stride_lh)
    pt_row = pt_ptr + slot * stride_pts + layer * stride_ptl + h * stride_pth
    # This split's token range, in whole BLOCK_N blocks; lengths differ per (sequence, head). The split count
    # is a runtime value: one compiled variant serves every sequence length.
    lo, hi = split_range(length, split, num_splits, BLOCK_N)

    g = tl.arange(0, BLOCK_G)
    hq = h * GROUP + g
    gmask = g < GROUP
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
            lse = tl.where(l_i > 0, (m_i + tl.log2(tl.where(l_i > 0, l_i, 1.0))) * 0.6931471805599453,
                           float("-inf"))  # natural-log lse; -inf without tokens
            tl.store(lse_ptr + b * stride_eb + hq * stride_eh, lse, mask=gmask)


@triton.jit(do_not_specialize=["num_splits"])  # one variant whatever the split count
def _decode_reduce_kernel(
    mid_acc, mid_ml, o_ptr, stride_ob, stride_oh, Hq, D, num_splits,
    BLOCK_S: tl.constexpr, BLOCK_D: tl.constexpr,
    lse_ptr=None, stride_eb=0, stride_eh=0, WRITE_LSE: tl.constexpr = False,
):
    b, hq = tl.program_id(0), tl.program_id(1)
    s = tl.arange(0, BLOCK_S)
    d = tl.arange(0, BLOCK_D)
    smask = s < num_splits
    idx = (b * Hq + hq) * num_splits + s
    m = tl.load(mid_ml + idx * 2, mask=smask, other=-1.0e30)
    l = tl.load(mid_ml + idx * 2 + 1, mask=smask, other=0.0)
    m_max = tl.max(m, 0)
    w = tl.exp2(m - m_max)  # empty splits have l = 0 and acc = 0, so any weight is harmless
    total = tl.sum(w * l, 0)
    acc = tl.load(mid_acc + idx[:, None] * D + d[None, :], mask=smask[:, None] & (d[None, :] < D), other=0.0)
    out = tl.sum(w[:, None] * acc, 0) / tl.where(total > 0, total, 1.0)
    tl.store(o_ptr + b * stride_ob + hq * stride_oh + d, out.to(o_ptr.dtype.element_ty), mask=d < D)
    if WRITE_LSE:
        lse = tl.where(total > 0, (m_max + tl.log2(tl.where(total > 0, total, 1.0))) * 0.6931471805599453,
                       float("-inf"))
        tl.store(lse_ptr + b * stride_eb + hq * stride_eh, lse)


class LaunchConfig(NamedTuple):
    block_n: int
    num_warps: int
    num_stages: int
    pure_k: bool = False  # unpacking may be scheduled freely (see decode_tiles.plane_codes)
    pure_v: bool = False
    v_early: bool = False  # value loads issued before the key math
    red: int = 0  # how _attend_section reduces a tile's rows (0: five reductions, 1: two; see there)
    maxnreg: int | None = None  # register cap per thread (ptxas), for more programs per SM
    min_rows: int = 8  # the query group's tile has max(min_rows, next_pow2(group)) rows (see launch_config)
    key_pairs: bool = False  # quartered kernel: quantized keys as uint16 byte pairs against a zero-padded q
    # (head_dim >= 128; see _attend_section)
    wide_block_n: int | None = None  # tokens per tile where a split covers WIDE_SPLIT_TOKENS or more (tile_tokens)


# A split this long keeps a one-warp program in 64-token tiles through its pipeline (5 stages of copies in flight)
# with tiles to spare; a shorter one (batch 8 at 4096 tokens: 16 splits of 256) ran 7% slower in them.
WIDE_SPLIT_TOKENS = 1024


KERNELS = ("f16", "q8", "quartered")


def decode_kernel(fmt: PageFormat, fmt_low: PageFormat | None) -> str:
    """Which kernel serves a call: "f16" (16-bit pages only), "q8" (K8V8 pages, integer or e4m3 codes, no low
    section; kernels/decode_attention_q8.py) or "quartered" (any integer precision, high + low sections)."""
    if fmt_low is None and fmt.key_bits == fmt.value_bits == 16:
        return "f16"
    if fmt_low is None and fmt.key_bits == fmt.value_bits == 8:
        return "q8"
    return "quartered"


def launch_config(fmt: PageFormat, fmt_low: PageFormat | None, kernel: str | None = None) -> LaunchConfig:
    """Launch parameters of `kernel` (default: decode_kernel's pick), chosen by CUDA-graph timing on H100 / H200
    at the Llama-3-8B shape (32 query / 8 KV heads, head_dim 128) and SmolLM2's (9 / 3, head_dim 64).

    f16: 128-token tiles, 4 warps, 2 stages (99% of HBM bandwidth at B=128 S=4096; other stage counts and
    64-token tiles within 1%). q8: 128-token tiles, 4 warps, 5 stages, the fewest that double-buffer its cp.async
    tiles. Quartered, head_dim >= 128: one warp per program over 32-token tiles (no cross-warp reductions, four
    times the splits for the same work target), freely scheduled unpacking, one tuple reduction of the row sums
    (red 1), key codes as uint16 pairs (key_pairs), 5 stages for keys of 4 bits or fewer and 3 for wider ones;
    64-token tiles where the high section is K4V2 / K2V2 and a split covers WIDE_SPLIT_TOKENS or more. Smaller
    heads: 2 warps, one stage, value loads first. GQA groups pad to 8 rows (16 for f16).

    Measured alternatives, each slower or no faster (benchmarks/results/decode_variants_H100.json,
    decode_kernel_variants_H200.json, tune_decode_attention_H200.json): 4 warps over 128-token tiles for the
    quartered kernel (1-20% slower); a full-width or transposed-dot path for quantized pages (0.6-0.86x the speed, more
    shared memory per program); value codes unpacked before the shared-memory transpose (5-24% slower); value
    codes as token pairs in the page (fewer instructions, three programs per SM instead of four); the split
    merge done by the last split to finish, or by programmatic dependent launch (within 2%, and slower for many
    splits); split counts that are not powers of two, or twice as many; register caps; 7 stages. Fewer
    instructions per tile stopped buying time once the loop is bound by fixed-latency dependency waits (ncu,
    K4V2 B=32 S=16384: 57% of issue slots busy)."""
    kernel = kernel or decode_kernel(fmt, fmt_low)
    if kernel == "f16":
        return LaunchConfig(128, 4, 2, min_rows=16)
    if kernel == "q8":
        return LaunchConfig(128, 4, 5)
    if fmt.head_dim >= 128:
        narrow_keys = fmt.key_bits <= 4
        wide = 64 if narrow_keys and fmt.value_bits == 2 else None  # long splits of K4V2 / K2V2
        return LaunchConfig(32, 1, 5 if narrow_keys else 3, pure_k=True, pure_v=True, red=1, key_pairs=True,
                            wide_block_n=wide)
    return LaunchConfig(128, 2, 1, v_early=True)


def tile_tokens(cfg: LaunchConfig, max_len: int, num_splits: int) -> int:
    """Tokens per tile: cfg.wide_block_n where each split may cover WIDE_SPLIT_TOKENS or more (max_len is a bound
    on a head's tokens), else cfg.block_n."""
    if cfg.wide_block_n and max_len >= WIDE_SPLIT_TOKENS * num_splits:
        return cfg.wide_block_n
    return cfg.block_n


def choose_num_splits(batch: int, kv_heads: int, max_len: int, device: torch.device, block_n: int,
                      num_warps: int = 4, head_dim: int = 128) -> int:
    """Splits per (sequence, KV head) so that about TARGET_WARP_DIMS_PER_SM warps x head_dim / 64 run per SM;
    at least one BLOCK_N tile per split (of max_len tokens), at most MAX_SPLITS."""
    if max_len <= 0:
        return 1
    work = batch * kv_heads * num_warps * max(1, head_dim // 64)
    wanted = TARGET_WARP_DIMS_PER_SM * num_sms(device) // max(work, 1)
    return max(1, min(wanted, triton.cdiv(max_len, block_n), MAX_SPLITS))


def _check_low(fmt: PageFormat, fmt_low: PageFormat | None, len_low, cache_dtype, for_triton: bool) -> bool:
    """Validates the optional low section; True when there is one."""
    if len_low is None:
        return False
    if fmt_low is None:
        raise ValueError("len_low needs fmt_low (the low section's page format)")
    check_supported(fmt_low, cache_dtype, for_triton)
    if (fmt_low.page_bytes, fmt_low.head_dim, fmt_low.full_itemsize) != (fmt.page_bytes, fmt.head_dim,
                                                                        fmt.full_itemsize):
        raise ValueError(f"formats {fmt.name} and {fmt_low.name} must share page_bytes, head_dim and itemsize")
    return True


def gather_section_ref(pool, fmt: PageFormat, cache_dtype, page_table, slots, layer, lens, n_tokens: int,
                       low: bool):
    """Keys, values float32 [B, Hkv, n, D] of section tokens 0..n-1 (dequantized) and their validity [B, Hkv, n]
    (j < lens). High token j: page_table[..., j // T]; low token j: page_table[..., P - 1 - j // T]."""
    T = fmt.tokens
    n_pages = triton.cdiv(n_tokens, T)
    cols = section_columns(torch.arange(n_pages, device=pool.device) * T, T, low, page_table.shape[3])
    # Entries past a head's length are garbage (-1, stale): clamp so the gather stays in bounds, mask later.
    pages = page_table[slots, layer][:, :, cols].long().clamp(0, pool.shape[0] - 1)  # [B, Hkv, n_pages]
    B, H = pages.shape[:2]
    D = fmt.head_dim
    keys = read_pages_ref(pool, fmt, cache_dtype, "k", pages).reshape(B, H, n_pages * T, D)
    vals = read_pages_ref(pool, fmt, cache_dtype, "v", pages).reshape(B, H, n_pages * T, D)
    j = torch.arange(n_pages * T, device=pool.device)
    valid = j < lens[..., None]
    return keys, vals, valid


def paged_decode_attention_ref(q, pool, fmt: PageFormat, cache_dtype, page_table, lengths, slots, layer,
                               scale, max_len=None, fmt_low=None, len_low=None, logits_out=None, lse_out=None):
    """Vectorized torch: gather + dequantize both sections -> [B, Hkv, n, D], mask by length, GQA attention
    in fp32."""
    check_supported(fmt, cache_dtype)
    has_low = _check_low(fmt, fmt_low, len_low, cache_dtype, False)
    B, Hq, D = q.shape
    Hkv = page_table.shape[2]
    group = Hq // Hkv
    sl = slots.long()
    lens = lengths[sl, layer].long()  # [B, Hkv]
    lens_lo = len_low[sl, layer].long() if has_low else torch.zeros_like(lens)
    if max_len is None:
        max_len = int((lens + lens_lo).max()) if lens.numel() else 0
    # The reference gathers only as far as the longest section really reaches (one sync; CPU/tests only).
    n_hi = min(max_len, page_table.shape[3] * fmt.tokens, int(lens.max()) if lens.numel() else 0)
    parts = [gather_section_ref(pool, fmt, cache_dtype, page_table, sl, layer, lens, n_hi, False)]
    index = [torch.arange(parts[0][2].shape[-1], device=q.device).expand_as(parts[0][2])]
    if has_low:
        n_lo = min(max_len, (page_table.shape[3] - 1) * fmt_low.tokens, int(lens_lo.max()) if lens.numel() else 0)
        parts.append(gather_section_ref(pool, fmt_low, cache_dtype, page_table, sl, layer, lens_lo, n_lo, True))
        index.append(lens[..., None] + torch.arange(parts[1][2].shape[-1], device=q.device))
    keys = torch.cat([p[0] for p in parts], 2)
    vals = torch.cat([p[1] for p in parts], 2)
    valid = torch.cat([p[2] for p in parts], 2)  # [B, Hkv, n]
    index = torch.cat(index, 2)  # where each token's logit goes in logits_out
    vals = vals.masked_fill(~valid[..., None], 0.0)  # rows past the length may hold NaN garbage
    qg = q.float().view(B, Hkv, group, D)
    scores = (qg @ keys.transpose(-1, -2)) * scale  # [B, Hkv, G, n]
    scores = scores.masked_fill(~valid[:, :, None, :], float("-inf"))
    if logits_out is not None:
        bi, hi, ji = valid.nonzero(as_tuple=True)
        logits_out.unflatten(1, (Hkv, group))[bi, hi, :, index[bi, hi, ji]] = scores[bi, hi, :, ji]
    if lse_out is not None:
        lse_out.copy_(torch.logsumexp(scores, -1).view(B, Hq))  # no token: -inf
    empty = (lens + lens_lo == 0)[:, :, None, None]
    probs = scores.softmax(-1).masked_fill(empty, 0.0)  # all -inf -> NaN -> 0
    return (probs @ vals).view(B, Hq, D).to(q.dtype)


def _word_meta(fmt: PageFormat, which: str) -> tuple[int, int]:
    """seg_offsets with the scale/zero offset in 4-byte words: a token's (scale, zero) is one word, which
    cp.async can stream (it copies 4 bytes or more)."""
    off, meta = seg_offsets(fmt, which)
    return off, meta // 2


def _launch_quartered(q, pc, pool, page_table, lengths, lenlo, slots, out, mid_acc, mid_ml, logits, lse, layer, scale,
                      num_splits, fmt, low, has_low, block_n, dot_fp32, cfg, warps, stages, write_logits, write_lse):
    """The quartered kernel (any precision, high + low sections)."""
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


def _launch_q8(q, pool, page_table, lengths, slots, out, mid_acc, mid_ml, logits, lse, layer, scale, num_splits, fmt,
               block_n, dot_fp32, cfg, warps, stages, write_logits, write_lse):
    """The full-width 8-bit kernel (K8V8 pages, no low section)."""
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


def paged_decode_attention_triton(q, pool, fmt: PageFormat, cache_dtype, page_table, lengths, slots, layer,
                                  scale, num_splits=None, max_len=None, block_n=None, out=None,
                                  fmt_low=None, len_low=None, logits_out=None, lse_out=None,
                                  num_warps=None, num_stages=None, kernel=None, config=None):
    """kernel: force one of KERNELS (tests, benchmarks; it must support the pages); None: decode_kernel's pick.
    config: a LaunchConfig in place of launch_config's (tests, benchmarks); block_n / num_warps / num_stages
    override either."""
    check_supported(fmt, cache_dtype, for_triton=True)
    has_low = _check_low(fmt, fmt_low, len_low, cache_dtype, True)
    B, Hq, D = q.shape
    Hkv, T = page_table.shape[2], fmt.tokens
    assert Hq % Hkv == 0 and D == fmt.head_dim and q.stride(2) == 1 and page_table.stride(3) == 1
    out = torch.empty_like(q) if out is None else out
    assert out.shape == q.shape and out.stride(2) == 1
    if logits_out is not None:
        assert logits_out.dtype == torch.float32 and logits_out.shape[:2] == (B, Hq) and logits_out.stride(2) == 1
    if lse_out is not None:
        assert lse_out.dtype == torch.float32 and lse_out.shape == (B, Hq)
    if B == 0:
        return out
    pc = pool.view(cache_dtype)
    picked = decode_kernel(fmt, fmt_low if has_low else None)
    kernel = kernel or picked
    if kernel not in (picked, "quartered"):
        low_note = " with a low section" if has_low else ""
        raise ValueError(f"kernel={kernel!r} cannot serve {fmt.name} pages{low_note}")
    if kernel == "quartered" and (fmt.float8 or (has_low and fmt_low.float8)):  # it unpacks integer codes only
        low_name = f" + {fmt_low.name}" if has_low else ""
        raise ValueError(f"the quartered decode kernel cannot serve e4m3 pages ({fmt.name}{low_name}); "
                         "K8V8 e4m3 pages without a low section go to the q8 kernel")
    cfg = config or launch_config(fmt, fmt_low if has_low else None, kernel)
    if max_len is None:  # capacity bound: needs no device sync
        max_len = page_table.shape[3] * max(T, fmt_low.tokens if has_low else 0)
    warps, stages = num_warps or cfg.num_warps, num_stages or cfg.num_stages
    if num_splits is None:
        num_splits = choose_num_splits(B, Hkv, max_len, q.device, block_n or cfg.block_n, warps, D)
    block_n = block_n or tile_tokens(cfg, max_len, num_splits)
    group = Hq // Hkv
    BLOCK_D = max(16, next_pow2(D))
    if num_splits > 1:
        mid_acc = torch.empty(B, Hq, num_splits, D, dtype=torch.float32, device=q.device)
        mid_ml = torch.empty(B, Hq, num_splits, 2, dtype=torch.float32, device=q.device)
    else:
        mid_acc = mid_ml = out  # unused
    low = fmt_low if has_low else fmt
    lenlo = len_low if has_low else lengths
    logits = logits_out if logits_out is not None else out  # unused when absent
    lse = lse_out if lse_out is not None else out
    dot_fp32 = dot_in_fp32(q, pool) or q.dtype == torch.float32 or cache_dtype == torch.float32
    if kernel == "q8":
        _launch_q8(q, pool, page_table, lengths, slots, out, mid_acc, mid_ml, logits, lse, layer, scale, num_splits,
                   fmt, block_n, dot_fp32, cfg, warps, stages, logits_out is not None, lse_out is not None)
    elif kernel == "f16":
        decode_f16_kernel[(B, Hkv, num_splits)](
            q, pc, page_table, lengths, slots, out, mid_acc, mid_ml, logits, lse,
            q.stride(0), q.stride(1), out.stride(0), out.stride(1),
            page_table.stride(0), page_table.stride(1), page_table.stride(2),
            lengths.stride(0), lengths.stride(1), lengths.stride(2), logits.stride(0), logits.stride(1),
            lse.stride(0), lse.stride(1),
            layer, scale * LOG2E, scale, Hq, D, num_splits, fmt.page_bytes // fmt.full_itemsize,
            seg_offsets(fmt, "k")[0], seg_offsets(fmt, "v")[0],
            GROUP=group, T=T, SPLIT=num_splits > 1, BLOCK_G=max(cfg.min_rows, next_pow2(group)), BLOCK_N=block_n,
            BLOCK_D=BLOCK_D, DOT_FP32=dot_fp32, WRITE_LOGITS=logits_out is not None, WRITE_LSE=lse_out is not None,
            num_warps=warps, num_stages=stages,
        )
    else:
        _launch_quartered(q, pc, pool, page_table, lengths, lenlo, slots, out, mid_acc, mid_ml, logits, lse, layer,
                          scale, num_splits, fmt, low, has_low, block_n, dot_fp32, cfg, warps, stages,
                          logits_out is not None, lse_out is not None)
    if num_splits > 1:
        _decode_reduce_kernel[(B, Hq)](
            mid_acc, mid_ml, out, out.stride(0), out.stride(1), Hq, D, num_splits,
            BLOCK_S=next_pow2(num_splits), BLOCK_D=BLOCK_D,
            lse_ptr=lse, stride_eb=lse.stride(0), stride_eh=lse.stride(1), WRITE_LSE=lse_out is not None,
            num_warps=4,
        )
    return out


def paged_decode_attention(q, pool, fmt: PageFormat, cache_dtype, page_table, lengths, slots, layer: int,
                           scale: float | None = None, num_splits: int | None = None, impl: str = "auto",
                           max_len: int | None = None, out: torch.Tensor | None = None,
                           fmt_low: PageFormat | None = None, len_low: torch.Tensor | None = None,
                           logits_out: torch.Tensor | None = None, lse_out: torch.Tensor | None = None):
    """Attention of one new token per sequence over its paged KV cache; returns [B, Hq, D] in q's dtype.

    q [B, Hq, D]; page_table int32 [S, L, Hkv, P + 1] (column P: trash, never read); slots int32 [B] picks rows
    of page_table/lengths. Per (slot, layer, KV head) the cache has
      - a HIGH section of lengths[s, l, h] tokens (int32 [S, L, Hkv], counting the new token) in format `fmt`:
        token j in page page_table[s, l, h, j // fmt.tokens], row j % fmt.tokens;
      - optionally a LOW section of len_low[s, l, h] tokens in format `fmt_low` (both must be given):
        token j in page page_table[s, l, h, P - 1 - j // fmt_low.tokens], row j % fmt_low.tokens.
    Any precision (16/8/4/2-bit keys and values) is dequantized on the fly. max_len: optional host-side upper
    bound on len_high + len_low of any head (sizes the splits without a device sync). Heads without tokens
    give zeros. out: optional preallocated [B, Hq, D] result.
    logits_out: optional f32 [B, Hq, NMAX] receiving each token's scaled logit q.k * scale at index j (high
    token j) or lengths + j (low token j); other entries untouched. lse_out: optional f32 [B, Hq] receiving
    the log-sum-exp of those logits (-inf for a head without tokens).
    """
    if scale is None:
        scale = 1.0 / math.sqrt(q.shape[-1])
    kw = dict(fmt_low=fmt_low, len_low=len_low, logits_out=logits_out, lse_out=lse_out)
    if use_triton(impl, q, pool, page_table, lengths, slots):
        return paged_decode_attention_triton(q, pool, fmt, cache_dtype, page_table, lengths, slots, layer,
                                             scale, num_splits=num_splits, max_len=max_len, out=out, **kw)
    res = paged_decode_attention_ref(q, pool, fmt, cache_dtype, page_table, lengths, slots, layer, scale,
                                     max_len=max_len, **kw)
    return res if out is None else out.copy_(res)
