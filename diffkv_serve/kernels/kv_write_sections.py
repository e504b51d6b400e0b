"""A diffkv prompt layer's K/V writes in one launch: every token's head goes to its high-section row, its
low-section row, or nowhere (pruned), found from the section index and the page table inside the kernel.

It replaces, per layer of a prompt step, the page/row lookups of both sections (MemoryManager.high_targets /
low_targets: ~15 torch launches) and two write_kv launches: diffkv prompt steps were host-bound on launches
(step_breakdown: ~32 ms of host time in a 46 ms step at 8 x 1024 tokens on an H200).

Where a section index lives (diffkv_serve/kernels/sections.py): high index j in column j // T_hi of the head's page-table
row; low index j in column right - 1 - j // T_lo, right = the head's all-high reservation (held_high) while a
reserved prompt is planned, else P (the table's right end).
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from diffkv_serve.kernels._common import check_supported, next_pow2, pool_views, seg_offsets, use_triton
from diffkv_serve.kernels.kv_write import _store_token, write_kv_ref
from diffkv_serve.kernels.page_layout import PageFormat
from diffkv_serve.kernels.sections import section_targets


@triton.jit
def _section_rows(pt_row, idx, T: tl.constexpr, right, P, hmask, LOW: tl.constexpr):
    """(page int64, row, ok) of section indices idx [BLOCK_H] (-1: not in this section)."""
    ok = hmask & (idx >= 0)
    col = tl.where(ok, idx, 0) // T
    if LOW:
        col = tl.minimum(tl.maximum(right - 1 - col, 0), P)
    page = tl.load(pt_row + col, mask=ok, other=-1)
    ok = ok & (page >= 0)
    return tl.where(ok, page, 0).to(tl.int64), tl.where(ok, idx, 0) % T, ok


@triton.jit
def _write_sections_kernel(
    k_ptr, v_ptr, pos_ptr, score_ptr, ih_ptr, il_ptr, tslot_ptr, pt_ptr, right_ptr, drop_ptr, seq_ptr,
    pool_c, pool_u8, pool_h, pool_i32, pool_f32,
    stride_kn, stride_kh, stride_vn, stride_vh, stride_scn, stride_ihn, stride_iln,
    stride_pts, stride_ptl, stride_pth, stride_rs, stride_rl,
    layer, H, D, P,
    page_elems, page_bytes, page_words,
    hk_off, hk_meta, hv_off, hv_meta, h_score, h_pos,
    lk_off, lk_meta, lv_off, lv_meta, l_score, l_pos,
    T_HI: tl.constexpr, T_LO: tl.constexpr, HKB: tl.constexpr, HVB: tl.constexpr, LKB: tl.constexpr,
    LVB: tl.constexpr, RIGHT_OF: tl.constexpr, HAS_DROP: tl.constexpr, LO_TRACKED: tl.constexpr,
    BLOCK_H: tl.constexpr, BLOCK_D: tl.constexpr,
):
    # One program per token: its heads form one [BLOCK_H, BLOCK_D] tile; each head is stored by at most one of
    # the two formats (masks), so the tile is quantized for both and written once.
    n = tl.program_id(0)
    h = tl.arange(0, BLOCK_H)
    d = tl.arange(0, BLOCK_D)
    hmask = h < H
    if HAS_DROP:  # learned reservation: a sequence whose pages did not fit writes nothing
        hmask = hmask & (tl.load(drop_ptr + tl.load(seq_ptr + n)) == 0)
    slot = tl.load(tslot_ptr + n).to(tl.int64)
    pt_row = pt_ptr + slot * stride_pts + layer * stride_ptl + h * stride_pth
    if RIGHT_OF:
        right = tl.load(right_ptr + slot * stride_rs + layer * stride_rl + h, mask=hmask, other=0)
    else:
        right = tl.zeros([BLOCK_H], tl.int32) + P
    ih = tl.load(ih_ptr + n * stride_ihn + h, mask=hmask, other=-1)
    il = tl.load(il_ptr + n * stride_iln + h, mask=hmask, other=-1)
    hp, hr, hok = _section_rows(pt_row, ih, T_HI, right, P, hmask, False)
    lp, lr, lok = _section_rows(pt_row, il, T_LO, right, P, hmask, True)
    pos = tl.load(pos_ptr + n)
    score = tl.load(score_ptr + n * stride_scn + h, mask=hmask, other=0.0).to(tl.float32)

    _store_token(k_ptr, v_ptr, stride_kn, stride_kh, stride_vn, stride_vh, n, h, d, hp, hr, hok, pos, score,
                 pool_c, pool_u8, pool_h, pool_i32, pool_f32, page_elems, page_bytes, page_words,
                 hk_off, hk_meta, hv_off, hv_meta, h_score, h_pos, D, HKB, HVB, BLOCK_H, BLOCK_D)
    _store_token(k_ptr, v_ptr, stride_kn, stride_kh, stride_vn, stride_vh, n, h, d, lp, lr, lok, pos, score,
                 pool_c, pool_u8, pool_h, pool_i32, pool_f32, page_elems, page_bytes, page_words,
                 lk_off, lk_meta, lv_off, lv_meta, l_score, l_pos, D, LKB, LVB, BLOCK_H, BLOCK_D,
                 False, False, LO_TRACKED)  # no e4m3 sides (diffkv's formats are integer codes)


def write_sections_ref(pool, fmt_high: PageFormat, fmt_low: PageFormat, cache_dtype, k, v, positions, scores,
                       page_table, layer, token_slots, idx_high, idx_low, right_of=None, drop=None,
                       seq_of_token=None):
    if drop is not None:
        gone = drop[seq_of_token.long()].unsqueeze(1)
        idx_high, idx_low = idx_high.masked_fill(gone, -1), idx_low.masked_fill(gone, -1)
    P = page_table.shape[-1] - 1
    right = P if right_of is None else right_of[token_slots.long(), layer].long()
    for fmt, idx, r in ((fmt_high, idx_high, None), (fmt_low, idx_low, right)):
        page, row = section_targets(page_table, token_slots, idx, fmt.tokens, layer, r)
        write_kv_ref(pool, fmt, cache_dtype, k, v, page, row, positions, scores=scores)


def write_sections_triton(pool, fmt_high: PageFormat, fmt_low: PageFormat, cache_dtype, k, v, positions, scores,
                          page_table, layer, token_slots, idx_high, idx_low, right_of=None, drop=None,
                          seq_of_token=None):
    for fmt in (fmt_high, fmt_low):
        check_supported(fmt, cache_dtype, for_triton=True)
    if (fmt_high.page_bytes, fmt_high.head_dim) != (fmt_low.page_bytes, fmt_low.head_dim):
        raise ValueError(f"formats {fmt_high.name} and {fmt_low.name} must share page_bytes and head_dim")
    pc, pi, pf = pool_views(pool, cache_dtype)
    N, H, D = k.shape
    if N == 0:
        return
    assert D == fmt_high.head_dim and k.stride(2) == 1 and v.stride(2) == 1 and scores.stride(1) == 1
    assert idx_high.stride(1) == 1 and idx_low.stride(1) == 1 and page_table.stride(3) == 1
    isz = fmt_high.full_itemsize
    offs = []
    for fmt in (fmt_high, fmt_low):
        offs += [*seg_offsets(fmt, "k"), *seg_offsets(fmt, "v"), *fmt.tracked_words()]
    right = right_of if right_of is not None else page_table
    assert right_of is None or right_of.stride(2) == 1
    _write_sections_kernel[(N,)](
        k, v, positions, scores, idx_high, idx_low, token_slots, page_table, right,
        drop if drop is not None else token_slots, seq_of_token if seq_of_token is not None else token_slots,
        pc, pool, pool.view(torch.float16), pi, pf,
        k.stride(0), k.stride(1), v.stride(0), v.stride(1), scores.stride(0), idx_high.stride(0), idx_low.stride(0),
        page_table.stride(0), page_table.stride(1), page_table.stride(2), right.stride(0), right.stride(1),
        layer, H, D, page_table.shape[-1] - 1,
        fmt_high.page_bytes // isz, fmt_high.page_bytes, fmt_high.page_bytes // 4, *offs,
        T_HI=fmt_high.tokens, T_LO=fmt_low.tokens, HKB=fmt_high.key_bits, HVB=fmt_high.value_bits,
        LKB=fmt_low.key_bits, LVB=fmt_low.value_bits, RIGHT_OF=right_of is not None, HAS_DROP=drop is not None,
        LO_TRACKED=fmt_low.tracked,
        BLOCK_H=next_pow2(H), BLOCK_D=next_pow2(D), num_warps=4, enable_fp_fusion=False,
    )


def write_sections(pool, fmt_high: PageFormat, fmt_low: PageFormat, cache_dtype, k, v, positions, scores,
                   page_table, layer: int, token_slots, idx_high, idx_low, right_of=None, drop=None,
                   seq_of_token=None, impl: str = "auto"):
    """Write one layer's prompt tokens k, v [N, H, D] into their sections, in place.

    Head h of token n goes to high-section index idx_high[n, h] (fmt_high) or low-section index idx_low[n, h]
    (fmt_low) of sequence slot token_slots[n] (at most one of them >= 0; both -1: pruned), with its position
    and its score scores[n, h] (f32 [N, H]). page_table int32 [S, L, H, P + 1]. right_of: int32 [S, L, H] (the
    all-high reservation while a reserved prompt is planned: its low pages sit at its right end) or None (low
    pages from column P - 1). drop (bool [B]) with seq_of_token (int [N]): sequences whose tokens go nowhere.
    The same bytes as write_kv at the targets of MemoryManager.high_targets / low_targets.
    """
    if (drop is None) != (seq_of_token is None):
        raise ValueError("drop and seq_of_token go together")
    if fmt_high.float8 or fmt_low.float8:  # diffkv sections hold integer codes; e4m3 pages go through write_kv
        raise ValueError(f"write_sections: formats {fmt_high.name} and {fmt_low.name} must not be float8")
    fn = write_sections_triton if use_triton(impl, pool, k, v) else write_sections_ref
    fn(pool, fmt_high, fmt_low, cache_dtype, k, v, positions, scores, page_table, layer, token_slots, idx_high,
       idx_low, right_of=right_of, drop=drop, seq_of_token=seq_of_token)
