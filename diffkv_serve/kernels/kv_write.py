"""Write new tokens' keys/values (plus position and a score) into their rows of KV pages, any precision.

16-bit sides store the cache dtype; 8/4/2-bit sides quantize on the fly (diffkv_serve/kernels/quant.py: per token and
head min-max, fp16 scale/zero in the meta segment, planar packing), e4m3 sides of a float8 format by their
absolute maximum (scale, zero point 0).
"""
from __future__ import annotations

from typing import NamedTuple

import torch
import triton
import triton.language as tl

from diffkv_serve.kernels._common import check_supported, next_pow2, pool_views, seg_offsets, use_triton
from diffkv_serve.kernels.page_layout import PageFormat
from diffkv_serve.kernels.quant import quantize_fp8_tile, quantize_tile, write_rows_ref


class KVWrite(NamedTuple):
    """write_kv's arguments (score_update.accumulate_scores(write=) runs it in its own launch)."""
    pool: torch.Tensor
    fmt: PageFormat
    cache_dtype: torch.dtype
    k: torch.Tensor
    v: torch.Tensor
    dst_page: torch.Tensor
    dst_slot: torch.Tensor
    positions: torch.Tensor


@triton.jit
def _store_side(x_ptr, stride_xn, stride_xh, n, h, d, page, slot, row_ok,
                pool_c, pool_u8, pool_h, page_elems, page_bytes, off, meta_off, D,
                BITS: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_D: tl.constexpr, F8: tl.constexpr = False):
    """Keys or values of token n, heads h [BLOCK_H] -> rows `slot` of pages `page` (int64); F8: e4m3 codes.

    16 bits: off is in cache-dtype elements. Quantized: off in bytes, meta_off in fp16 units.
    """
    m2 = row_ok[:, None] & (d[None, :] < D)
    x = tl.load(x_ptr + n * stride_xn + h[:, None] * stride_xh + d[None, :], mask=m2, other=0.0)
    if BITS == 16:
        row = (page * page_elems + slot * D)[:, None] + d[None, :]
        tl.store(pool_c + row + off, x.to(pool_c.dtype.element_ty), mask=m2)
    else:
        # BLOCK_D == D here (power of two): a masked-out row quantizes zeros and is not stored.
        if F8:
            packed, scale = quantize_fp8_tile(x.to(tl.float32), BLOCK_H)
            zero = tl.zeros([BLOCK_H], tl.float16)
        else:
            packed, scale, zero = quantize_tile(x.to(tl.float32), BITS, BLOCK_H, BLOCK_D)
        RB: tl.constexpr = BLOCK_D * BITS // 8
        j = tl.arange(0, RB)
        dst = (page * page_bytes + off + slot * RB)[:, None] + j[None, :]
        tl.store(pool_u8 + dst, packed.to(tl.uint8), mask=row_ok[:, None])
        meta = page * (page_bytes // 2) + meta_off + slot * 2
        tl.store(pool_h + meta, scale, mask=row_ok)
        tl.store(pool_h + meta + 1, zero, mask=row_ok)


@triton.jit
def _store_token(k_ptr, v_ptr, stride_kn, stride_kh, stride_vn, stride_vh, n, h, d, page, slot, row_ok, pos, score,
                 pool_c, pool_u8, pool_h, pool_i32, pool_f32, page_elems, page_bytes, page_words,
                 k_off, k_meta_off, v_off, v_meta_off, score_off, pos_off, D,
                 KB: tl.constexpr, VB: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_D: tl.constexpr,
                 KF8: tl.constexpr = False, VF8: tl.constexpr = False, TRACKED: tl.constexpr = True):
    """Token n's keys, values, position and scores [BLOCK_H] into rows `slot` of pages `page` (one format;
    KF8 / VF8: that side holds e4m3 codes; TRACKED: the pages have score and position rows)."""
    _store_side(k_ptr, stride_kn, stride_kh, n, h, d, page, slot, row_ok, pool_c, pool_u8, pool_h,
                page_elems, page_bytes, k_off, k_meta_off, D, KB, BLOCK_H, BLOCK_D, KF8)
    _store_side(v_ptr, stride_vn, stride_vh, n, h, d, page, slot, row_ok, pool_c, pool_u8, pool_h,
                page_elems, page_bytes, v_off, v_meta_off, D, VB, BLOCK_H, BLOCK_D, VF8)
    if TRACKED:
        word = page * page_words + slot
        tl.store(pool_i32 + word + pos_off, tl.zeros([BLOCK_H], tl.int32) + pos, mask=row_ok)
        tl.store(pool_f32 + word + score_off, score, mask=row_ok)


@triton.jit
def _write_kv_kernel(
    k_ptr, v_ptr, page_ptr, slot_ptr, pos_ptr, score_ptr,
    pool_c, pool_u8, pool_h, pool_i32, pool_f32,
    stride_kn, stride_kh, stride_vn, stride_vh, stride_pn, stride_sn, stride_scn,
    H, D,
    page_elems, page_bytes, k_off, k_meta_off, v_off, v_meta_off,
    page_words, score_off, pos_off,  # in 4-byte words
    KB: tl.constexpr, VB: tl.constexpr, HAS_SCORES: tl.constexpr,
    BLOCK_H: tl.constexpr, BLOCK_D: tl.constexpr, KF8: tl.constexpr, VF8: tl.constexpr, TRACKED: tl.constexpr,
):
    # One program per token: all its heads form one [BLOCK_H, BLOCK_D] tile (contiguous along D).
    write_token(tl.program_id(0), k_ptr, v_ptr, page_ptr, slot_ptr, pos_ptr, score_ptr,
                pool_c, pool_u8, pool_h, pool_i32, pool_f32,
                stride_kn, stride_kh, stride_vn, stride_vh, stride_pn, stride_sn, stride_scn, H, D,
                page_elems, page_bytes, k_off, k_meta_off, v_off, v_meta_off, page_words, score_off, pos_off,
                KB, VB, HAS_SCORES, BLOCK_H, BLOCK_D, KF8, VF8, TRACKED)


@triton.jit
def write_token(
    n, k_ptr, v_ptr, page_ptr, slot_ptr, pos_ptr, score_ptr,
    pool_c, pool_u8, pool_h, pool_i32, pool_f32,
    stride_kn, stride_kh, stride_vn, stride_vh, stride_pn, stride_sn, stride_scn,
    H, D,
    page_elems, page_bytes, k_off, k_meta_off, v_off, v_meta_off,
    page_words, score_off, pos_off,
    KB: tl.constexpr, VB: tl.constexpr, HAS_SCORES: tl.constexpr,
    BLOCK_H: tl.constexpr, BLOCK_D: tl.constexpr, KF8: tl.constexpr, VF8: tl.constexpr, TRACKED: tl.constexpr,
):
    """Token n's program of _write_kv_kernel (also run by score_update's kernel, which writes a decode layer's
    new tokens in the launch that updates the layer before's scores)."""
    h = tl.arange(0, BLOCK_H)
    d = tl.arange(0, BLOCK_D)
    hmask = h < H
    page = tl.load(page_ptr + n * stride_pn + h, mask=hmask, other=-1)
    slot = tl.load(slot_ptr + n * stride_sn + h, mask=hmask, other=0)
    row_ok = page >= 0  # negative page: skip this (token, head)
    page = tl.where(row_ok, page, 0).to(tl.int64)  # int64: the pool can exceed 2**31 elements

    if HAS_SCORES:
        score = tl.load(score_ptr + n * stride_scn + h, mask=row_ok, other=0.0).to(tl.float32)
    else:
        score = tl.zeros([BLOCK_H], tl.float32)
    _store_token(k_ptr, v_ptr, stride_kn, stride_kh, stride_vn, stride_vh, n, h, d, page, slot, row_ok,
                 tl.load(pos_ptr + n), score, pool_c, pool_u8, pool_h, pool_i32, pool_f32, page_elems, page_bytes,
                 page_words, k_off, k_meta_off, v_off, v_meta_off, score_off, pos_off, D, KB, VB, BLOCK_H, BLOCK_D,
                 KF8, VF8, TRACKED)


def write_kv_ref(pool, fmt: PageFormat, cache_dtype, k, v, dst_page, dst_slot, positions, scores=None):
    check_supported(fmt, cache_dtype)
    _, pi, pf = pool_views(pool, cache_dtype)
    N, H, D = k.shape
    ok = dst_page >= 0
    page = dst_page[ok].long()
    slot = dst_slot[ok].long()
    write_rows_ref(pool, fmt, cache_dtype, "k", page, slot, k[ok])
    write_rows_ref(pool, fmt, cache_dtype, "v", page, slot, v[ok])
    if not fmt.tracked:  # a single-precision cache's pages hold no position or score rows
        return
    pi[page, fmt.pos_off // 4 + slot] = positions[:, None].expand(N, H)[ok].to(torch.int32)
    pf[page, fmt.score_off // 4 + slot] = 0.0 if scores is None else scores[ok].float()


def write_kv_launch(pool, fmt: PageFormat, cache_dtype, k, v, dst_page, dst_slot, positions, scores=None):
    """(arguments, constexprs) of _write_kv_kernel for these tokens: one program per token (None: no token)."""
    check_supported(fmt, cache_dtype, for_triton=True)
    pc, pi, pf = pool_views(pool, cache_dtype)
    N, H, D = k.shape
    if N == 0:
        return None
    assert D == fmt.head_dim and k.stride(2) == 1 and v.stride(2) == 1
    assert dst_page.stride(1) == 1 and dst_slot.stride(1) == 1
    if scores is not None:
        assert scores.shape == (N, H) and scores.stride(1) == 1 and fmt.tracked
    isz = fmt.full_itemsize
    k_off, k_meta = seg_offsets(fmt, "k")
    v_off, v_meta = seg_offsets(fmt, "v")
    args = (k, v, dst_page, dst_slot, positions, pf if scores is None else scores,
            pc, pool, pool.view(torch.float16), pi, pf,
            k.stride(0), k.stride(1), v.stride(0), v.stride(1), dst_page.stride(0), dst_slot.stride(0),
            0 if scores is None else scores.stride(0),
            H, D, fmt.page_bytes // isz, fmt.page_bytes, k_off, k_meta, v_off, v_meta,
            fmt.page_bytes // 4, *fmt.tracked_words())
    consts = dict(KB=fmt.key_bits, VB=fmt.value_bits, HAS_SCORES=scores is not None, BLOCK_H=next_pow2(H),
                  BLOCK_D=next_pow2(D), KF8=fmt.key_float8, VF8=fmt.value_float8, TRACKED=fmt.tracked)
    return args, consts


def write_kv_triton(pool, fmt: PageFormat, cache_dtype, k, v, dst_page, dst_slot, positions, scores=None):
    launch = write_kv_launch(pool, fmt, cache_dtype, k, v, dst_page, dst_slot, positions, scores)
    if launch is None:
        return
    args, consts = launch
    _write_kv_kernel[(k.shape[0],)](*args, **consts, num_warps=4, enable_fp_fusion=False)


def write_kv(pool, fmt: PageFormat, cache_dtype, k, v, dst_page, dst_slot, positions, impl: str = "auto",
             scores: torch.Tensor | None = None):
    """k, v [N, H, D] -> row dst_slot[n, h] of page dst_page[n, h] (skipped where dst_page < 0); in place.

    Any page precision: 16-bit sides store the cache dtype, 8/4/2-bit sides are quantized (diffkv_serve/kernels/quant.py),
    as e4m3 codes where fmt.float8 says so.
    On tracked pages (fmt.tracked) also sets that row's position to positions[n] and its score to scores[n, h]
    (f32 [N, H]; default 0).
    """
    fn = write_kv_triton if use_triton(impl, pool, k, v) else write_kv_ref
    fn(pool, fmt, cache_dtype, k, v, dst_page, dst_slot, positions, scores=scores)
