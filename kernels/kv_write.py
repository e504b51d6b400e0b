"""Write new tokens' keys/values (plus position and a zero score) into their rows of KV pages."""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from kernels._common import check_supported, next_pow2, pool_views, use_triton
from kernels.page_layout import PageFormat


@triton.jit
def _write_kv_kernel(
    k_ptr, v_ptr, page_ptr, slot_ptr, pos_ptr,
    pool_c, pool_i32, pool_f32,
    stride_kn, stride_kh, stride_vn, stride_vh, stride_pn, stride_sn,
    H, D,
    page_elems, k_off, v_off,  # in cache-dtype elements
    page_words, score_off, pos_off,  # in 4-byte words
    BLOCK_H: tl.constexpr, BLOCK_D: tl.constexpr,
):
    # One program per token: all its heads form one [BLOCK_H, BLOCK_D] tile (contiguous along D).
    n = tl.program_id(0)
    h = tl.arange(0, BLOCK_H)
    d = tl.arange(0, BLOCK_D)
    hmask = h < H
    page = tl.load(page_ptr + n * stride_pn + h, mask=hmask, other=-1)
    slot = tl.load(slot_ptr + n * stride_sn + h, mask=hmask, other=0)
    row_ok = page >= 0  # negative page: skip this (token, head)
    page = tl.where(row_ok, page, 0).to(tl.int64)  # int64: the pool can exceed 2**31 elements
    m2 = row_ok[:, None] & (d[None, :] < D)

    k = tl.load(k_ptr + n * stride_kn + h[:, None] * stride_kh + d[None, :], mask=m2)
    v = tl.load(v_ptr + n * stride_vn + h[:, None] * stride_vh + d[None, :], mask=m2)
    # 16-bit pages only; quantized formats will quantize here and also write the meta segments.
    row = (page * page_elems + slot * D)[:, None] + d[None, :]
    tl.store(pool_c + row + k_off, k.to(pool_c.dtype.element_ty), mask=m2)
    tl.store(pool_c + row + v_off, v.to(pool_c.dtype.element_ty), mask=m2)

    pos = tl.load(pos_ptr + n)
    word = page * page_words + slot
    tl.store(pool_i32 + word + pos_off, tl.zeros([BLOCK_H], tl.int32) + pos, mask=row_ok)
    tl.store(pool_f32 + word + score_off, tl.zeros([BLOCK_H], tl.float32), mask=row_ok)


def write_kv_ref(pool, fmt: PageFormat, cache_dtype, k, v, dst_page, dst_slot, positions):
    check_supported(fmt, cache_dtype)
    pc, pi, pf = pool_views(pool, cache_dtype)
    N, H, D = k.shape
    ok = dst_page >= 0
    page = dst_page[ok].long()
    slot = dst_slot[ok].long()
    isz, d = fmt.full_itemsize, torch.arange(D, device=pool.device)
    cols = (slot * D)[:, None] + d[None, :]
    pc[page[:, None], fmt.k_off // isz + cols] = k[ok].to(cache_dtype)
    pc[page[:, None], fmt.v_off // isz + cols] = v[ok].to(cache_dtype)
    pi[page, fmt.pos_off // 4 + slot] = positions[:, None].expand(N, H)[ok].to(torch.int32)
    pf[page, fmt.score_off // 4 + slot] = 0.0


def write_kv_triton(pool, fmt: PageFormat, cache_dtype, k, v, dst_page, dst_slot, positions):
    check_supported(fmt, cache_dtype)
    pc, pi, pf = pool_views(pool, cache_dtype)
    N, H, D = k.shape
    if N == 0:
        return
    assert D == fmt.head_dim and k.stride(2) == 1 and v.stride(2) == 1
    assert dst_page.stride(1) == 1 and dst_slot.stride(1) == 1
    isz = fmt.full_itemsize
    _write_kv_kernel[(N,)](
        k, v, dst_page, dst_slot, positions, pc, pi, pf,
        k.stride(0), k.stride(1), v.stride(0), v.stride(1), dst_page.stride(0), dst_slot.stride(0),
        H, D, fmt.page_bytes // isz, fmt.k_off // isz, fmt.v_off // isz,
        fmt.page_bytes // 4, fmt.score_off // 4, fmt.pos_off // 4,
        BLOCK_H=next_pow2(H), BLOCK_D=next_pow2(D), num_warps=4,
    )


def write_kv(pool, fmt: PageFormat, cache_dtype, k, v, dst_page, dst_slot, positions, impl: str = "auto"):
    """k, v [N, H, D] -> row dst_slot[n, h] of page dst_page[n, h] (skipped where dst_page < 0); in place.

    Also sets that row's position to positions[n] and its score to 0.
    """
    fn = write_kv_triton if use_triton(impl, pool, k, v) else write_kv_ref
    fn(pool, fmt, cache_dtype, k, v, dst_page, dst_slot, positions)
