"""A decode step's page work after Algorithm 1's plan, in two launches (paper §5.2 with the memory manager of §6.1).

For every (sequence, layer, KV head) of the batch:
  1. need     a new high page if the high section (after the plan, plus the new token) outgrows its pages, a new
              low page if the low section does (diffkv); totals per chunk of heads and per sequence, and the
              free list's start pointer moves past all of them (one atomic per sequence)
  2. apply    the pages, from the circular free list in (sequence, layer, head) order (exclusive prefix sum:
              the sequences before this one from step 1, the heads before this one within it), into the
              bidirectional page table; then the token that moves down is requantized into the low section
              and the hole it leaves in the high section is filled with the section's last token; the section
              lengths, each head's low_armed (the plan's new_low_armed), the new token's write target and the
              sequence's next worst-case growth (MemoryManager.note_growth) are stored.

Step 2 runs one program per (sequence, chunk of its heads, flattened over layers), so its page-table writes and
the moves that read them are ordered by a barrier, not by a launch. The reference is the same sequence of torch
operations the engine ran before (~40 launches per step: the decode step's memory management was launch-bound).

Padding rows of a CUDA-graph batch (seq_len 0, all pointing at the memory manager's dummy slot) need nothing,
move nothing and get write target page -1.
"""
from __future__ import annotations

from typing import Optional

import torch
import triton
import triton.language as tl

from diffkv_serve.kernels._common import next_pow2, pool_views, seg_offsets, use_triton
from diffkv_serve.kernels.kv_move import _check as _check_move, move_rows, move_tokens_ref
from diffkv_serve.kernels.page_alloc import grow_pages
from diffkv_serve.kernels.page_layout import PageFormat, PageState
from diffkv_serve.kernels.sections import section_page, section_targets


# ---- reference ------------------------------------------------------------------------------------------------
def decode_pages_ref(st: PageState, fmt_high: PageFormat, fmt_low: Optional[PageFormat], cache_dtype,
                     slots: torch.Tensor, seq_len: torch.Tensor, plan: Optional[dict],
                     low_grows: bool = True) -> tuple[torch.Tensor, ...]:
    num_pages = st.pool.shape[0]
    P = st.page_table.shape[-1] - 1
    active = (seq_len > 0).to(torch.int32).view(-1, 1, 1)
    T_hi = fmt_high.tokens
    grow = lambda nh, nl, m: grow_pages(st.page_table, st.held_high, st.held_low, st.free_list,  # noqa: E731
                                        st.counters, num_pages, slots, nh, nl, m)
    high = lambda idx: section_targets(st.page_table, slots, idx, T_hi)  # noqa: E731
    if plan is not None:
        new_high, new_low = plan["new_len_high"], plan["new_len_low"]
        need_low = (new_low > st.held_low[slots] * fmt_low.tokens).to(torch.int32)
        need_high = (new_high + active > st.held_high[slots] * T_hi).to(torch.int32)
        grow(need_high, need_low, 2)
        # Requantize the token that moves down (before its high row can be overwritten) ...
        sp, sr = high(plan["to_low_src"])
        dp, dr = section_targets(st.page_table, slots, plan["low_dst"], fmt_low.tokens, right=P)
        move_tokens_ref(st.pool, fmt_high, fmt_low, cache_dtype, sp.flatten(), sr.flatten(), dp.flatten(),
                        dr.flatten())
        # ... then close the hole in the high section with its last token.
        hole, last = plan["high_hole"], st.len_high[slots] - 1
        fill = (hole >= 0) & (hole != last)
        sp, sr = high(torch.where(fill, last, -1))
        dp, dr = high(torch.where(fill, hole, -1))
        move_tokens_ref(st.pool, fmt_high, fmt_high, cache_dtype, sp.flatten(), sr.flatten(), dp.flatten(),
                        dr.flatten())
        st.len_high[slots] = new_high + active
        st.len_low[slots] = new_low
        # Padding rows (the dummy slot, repeated) keep its state: several rows writing one cell would race.
        st.low_armed[slots] = torch.where(active > 0, plan["new_low_armed"], st.low_armed[slots])
        # What the scheduler reads next step; padding rows keep theirs.
        grown = growth_bound(st, slots, T_hi, fmt_low.tokens, low_grows)
        st.next_growth[slots] = torch.where(seq_len > 0, grown, st.next_growth[slots])
    else:
        new_high = st.len_high[slots] + active
        need_high = (new_high > st.held_high[slots] * T_hi).to(torch.int32)
        grow(need_high, torch.zeros_like(need_high), 1)
        st.len_high[slots] = new_high
    page, row = high(st.len_high[slots] - 1)
    return page.permute(1, 0, 2).contiguous(), row.permute(1, 0, 2).contiguous()


def growth_bound(st: PageState, slots: torch.Tensor, tokens_high: int, tokens_low: int, low_grows: bool
                 ) -> torch.Tensor:
    """Most pages each sequence's next decode step can take (int64 [B]), from its heads' sections as they stand: a
    head needs a page only on a side whose section is full, at most one per side. low_grows: the policy can send a
    token low (not the budget policy); an empty low section then counts only where the head's last plan armed it
    (compression_plan's lazy low rule opens it no earlier than the step after). _apply_kernel computes the same."""
    full = st.len_high[slots] >= st.held_high[slots] * tokens_high
    if low_grows:
        low = st.len_low[slots]
        full |= (low >= st.held_low[slots] * tokens_low) & ((low > 0) | (st.low_armed[slots] != 0))
    return full.sum((1, 2), dtype=torch.int64)


# ---- kernels --------------------------------------------------------------------------------------------------
@triton.jit
def _head_need(b, slot, h, m, active, lh_ptr, hh_ptr, hl_ptr, nlh_ptr, nll_ptr, LH,
               T_HI: tl.constexpr, T_LO: tl.constexpr, PLAN: tl.constexpr):
    """Pages heads h of sequence b need on their high and low side (0 or 1 each), and the pages they hold."""
    cell = slot * LH + h
    held_hi = tl.load(hh_ptr + cell, mask=m, other=0)
    if PLAN:
        new_hi = tl.load(nlh_ptr + b * LH + h, mask=m, other=0)
        new_lo = tl.load(nll_ptr + b * LH + h, mask=m, other=0)
        held_lo = tl.load(hl_ptr + cell, mask=m, other=0)
        need_lo = (new_lo > held_lo * T_LO).to(tl.int32)
    else:
        new_hi = tl.load(lh_ptr + cell, mask=m, other=0)
        held_lo = new_hi * 0
        need_lo = new_hi * 0
    need_hi = (new_hi + active > held_hi * T_HI).to(tl.int32)
    return tl.where(m, need_hi, 0), tl.where(m, need_lo, 0), held_hi, held_lo


@triton.jit
def _need_kernel(lh_ptr, hh_ptr, hl_ptr, nlh_ptr, nll_ptr, slots_ptr, seq_ptr, aux_ptr, counters_ptr, growth_ptr,
                 B, LH, NC, T_HI: tl.constexpr, T_LO: tl.constexpr, PLAN: tl.constexpr, BLOCK_C: tl.constexpr,
                 BLOCK_H: tl.constexpr):
    """Per sequence b: the pages each chunk of BLOCK_H of its heads (flattened over layers) needs,
    aux[b * NC + c], and all of them, aux[B * NC + b]."""
    b = tl.program_id(0)
    slot = tl.load(slots_ptr + b).to(tl.int64)
    active = (tl.load(seq_ptr + b) > 0).to(tl.int32)
    j = tl.arange(0, BLOCK_H)
    total = 0
    for c0 in range(0, NC, BLOCK_C):
        c = c0 + tl.arange(0, BLOCK_C)
        h = c[:, None] * BLOCK_H + j[None, :]
        nh, nl, _, _ = _head_need(b, slot, h, h < LH, active, lh_ptr, hh_ptr, hl_ptr, nlh_ptr, nll_ptr, LH,
                                        T_HI, T_LO, PLAN)
        per_chunk = tl.sum(nh + nl, 1)
        tl.store(aux_ptr + b * NC + c, per_chunk, mask=c < NC)
        total += tl.sum(per_chunk, 0)
    tl.store(aux_ptr + B * NC + b, total)
    tl.atomic_add(counters_ptr, total.to(tl.int64))  # the start pointer past every page of this step
    if PLAN:
        if active > 0:  # the apply kernel's chunks add their full sections to it
            tl.store(growth_ptr + slot, tl.zeros([], tl.int64))


@triton.jit
def _apply_kernel(
    pool_c, pool_u8, pool_h, pool_i32, pt_ptr, lh_ptr, ll_ptr, hh_ptr, hl_ptr, armed_ptr, free_ptr, counters_ptr,
    growth_ptr, slots_ptr, seq_ptr, aux_ptr, hole_ptr, src_ptr, dst_ptr, nlh_ptr, nll_ptr, nla_ptr, page_out, row_out,
    B, LH, NC, H, P, num_pages, stride_pts, page_elems, page_bytes, D,
    hk_off, hk_meta, hv_off, hv_meta, lk_off, lk_meta, lv_off, lv_meta, hi_score, hi_pos, lo_score, lo_pos,
    T_HI: tl.constexpr, T_LO: tl.constexpr, PLAN: tl.constexpr, LOW_GROWS: tl.constexpr, LO_TRACKED: tl.constexpr,
    HKB: tl.constexpr, HVB: tl.constexpr, LKB: tl.constexpr, LVB: tl.constexpr, ISZ: tl.constexpr,
    BLOCK_H: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_B: tl.constexpr,
    BLOCK_NC: tl.constexpr,
):
    """One program per (sequence b, chunk c of BLOCK_H heads): their pages, moves, lengths, targets, growth."""
    b, c = tl.program_id(0), tl.program_id(1)
    slot = tl.load(slots_ptr + b).to(tl.int64)
    active = (tl.load(seq_ptr + b) > 0).to(tl.int32)
    # This chunk's first free-list cell: the start before the step (the need kernel already moved it past every
    # page of the step) plus the pages of the sequences before b and of b's chunks before this one.
    k = tl.arange(0, BLOCK_B)
    per_seq = tl.load(aux_ptr + B * NC + k, mask=k < B, other=0).to(tl.int64)
    before = tl.arange(0, BLOCK_NC)
    per_chunk = tl.load(aux_ptr + b * NC + before, mask=before < c, other=0).to(tl.int64)
    cell0 = (tl.load(counters_ptr) - tl.sum(per_seq, 0) + tl.sum(tl.where(k < b, per_seq, 0), 0)
             + tl.sum(per_chunk, 0))
    h = c * BLOCK_H + tl.arange(0, BLOCK_H)  # (layer, head) flattened
    m = h < LH
    row = pt_ptr + slot * stride_pts + h * (P + 1)  # the heads' page-table rows
    nh, nl, held_hi, held_lo = _head_need(b, slot, h, m, active, lh_ptr, hh_ptr, hl_ptr, nlh_ptr, nll_ptr,
                                                LH, T_HI, T_LO, PLAN)
    n = (nh + nl).to(tl.int64)
    at = cell0 + tl.cumsum(n, 0) - n  # exclusive prefix sum: high page first, then low
    first = tl.load(free_ptr + at % num_pages, mask=n > 0, other=-1)
    tl.store(row + held_hi, first, mask=nh > 0)
    tl.store(hh_ptr + slot * LH + h, held_hi + nh, mask=m)
    if PLAN:
        second = tl.load(free_ptr + (at + 1) % num_pages, mask=n > 1, other=-1)
        tl.store(row + (P - 1 - held_lo), tl.where(nh > 0, second, first), mask=nl > 0)
        tl.store(hl_ptr + slot * LH + h, held_lo + nl, mask=m)
    tl.debug_barrier()  # the moves and targets below read page-table cells other threads just wrote

    d = tl.arange(0, BLOCK_D)
    cell = slot * LH + h
    len_hi = tl.load(lh_ptr + cell, mask=m, other=0)
    if PLAN:
        # The token that moves down, requantized into its low row (before its high row is overwritten) ...
        src = tl.load(src_ptr + b * LH + h, mask=m, other=-1)
        dst = tl.load(dst_ptr + b * LH + h, mask=m, other=-1)
        ok = m & (src >= 0) & (dst >= 0)
        sp = section_page(row, P - 1, src, ok, T_HI, False)
        dp = section_page(row, P - 1, dst, ok, T_LO, True)
        ok = ok & (sp >= 0) & (dp >= 0)  # every access below is masked by ok: no clamping of rows
        sr = src % T_HI
        dr = dst % T_LO
        move_rows(pool_c, pool_u8, pool_h, pool_i32, sp, sr, dp, dr, ok, d, page_elems, page_bytes,
                  hk_off, hk_meta, hv_off, hv_meta, lk_off, lk_meta, lv_off, lv_meta, hi_score, hi_pos, lo_score,
                  lo_pos, D, HKB, HVB, LKB, LVB, ISZ, BLOCK_H, BLOCK_D, BLOCK_R, LO_TRACKED)
        tl.debug_barrier()  # ... then the hole it leaves is filled with the section's last token
        hole = tl.load(hole_ptr + b * LH + h, mask=m, other=-1)
        last = len_hi - 1
        fill = m & (hole >= 0) & (hole != last)
        sp = section_page(row, P - 1, last, fill, T_HI, False)
        dp = section_page(row, P - 1, hole, fill, T_HI, False)
        fill = fill & (sp >= 0) & (dp >= 0)
        sr = last % T_HI
        dr = hole % T_HI
        move_rows(pool_c, pool_u8, pool_h, pool_i32, sp, sr, dp, dr, fill, d, page_elems, page_bytes,
                  hk_off, hk_meta, hv_off, hv_meta, hk_off, hk_meta, hv_off, hv_meta, hi_score, hi_pos, hi_score,
                  hi_pos, D, HKB, HVB, HKB, HVB, ISZ, BLOCK_H, BLOCK_D, BLOCK_R)
        len_hi = tl.load(nlh_ptr + b * LH + h, mask=m, other=0) + active
        len_lo = tl.load(nll_ptr + b * LH + h, mask=m, other=0)
        tl.store(ll_ptr + cell, len_lo, mask=m)
        armed = tl.load(nla_ptr + b * LH + h, mask=m, other=0)
        tl.store(armed_ptr + cell, armed, mask=m & (active > 0))  # padding rows share the dummy slot's cell
        held_hi = tl.load(hh_ptr + cell, mask=m, other=0)
        held_lo = tl.load(hl_ptr + cell, mask=m, other=0)
        if LOW_GROWS:  # an empty low section opens a page next step only where this step's plan armed it
            full = (len_hi >= held_hi * T_HI) | ((len_lo >= held_lo * T_LO) & ((len_lo > 0) | (armed != 0)))
        else:  # a policy that never demotes (budget) never needs a low page
            full = len_hi >= held_hi * T_HI
        if active > 0:  # the sequence's next worst-case growth (its need kernel zeroed it)
            tl.atomic_add(growth_ptr + slot, tl.sum((full & m).to(tl.int64), 0))
    else:
        len_hi = len_hi + active
    tl.store(lh_ptr + cell, len_hi, mask=m)
    # The new token's write target: high index len_hi - 1 (page -1 for an empty head: padding rows).
    j = len_hi - 1
    has = m & (j >= 0)
    page = tl.load(row + j // T_HI, mask=has, other=-1)
    out = (h // H) * (B * H) + b * H + h % H  # [L, B, H]
    tl.store(page_out + out, page, mask=m)
    tl.store(row_out + out, tl.where(has, j % T_HI, 0), mask=m)


def decode_pages_triton(st: PageState, fmt_high: PageFormat, fmt_low: Optional[PageFormat], cache_dtype,
                        slots: torch.Tensor, seq_len: torch.Tensor, plan: Optional[dict], low_grows: bool = True,
                        block_h: int = 16, num_warps: int = 1) -> tuple[torch.Tensor, ...]:
    """block_h heads per program, num_warps: an H100 sweep at the Llama-3-8B shape (32 x 8 heads, K8V4 + K4V2,
    head_dim 128) timed the apply kernel at batch 64 / 256: 16 heads, 1 warp 57 / 230 us; 16, 2 76 / 297;
    8, 1 58 / 233; 32, 1 98 / 258; 32, 4 127 / 515; 64, 4 164 / 718 (the old torch sequence with two move
    kernels: 319 / 646 us). The moves are latency-bound scattered row accesses: many small programs win."""
    S, L, H, P1 = st.page_table.shape
    B, LH = slots.numel(), L * H
    for t in (st.page_table, st.held_high, st.held_low, st.len_high, st.len_low, st.low_armed):
        assert t.is_contiguous() and t.dtype == torch.int32
    dev = st.pool.device
    page_out = torch.empty(L, B, H, dtype=torch.int32, device=dev)
    row_out = torch.empty(L, B, H, dtype=torch.int32, device=dev)
    if B == 0:
        return page_out, row_out
    NC = triton.cdiv(LH, block_h)  # chunks of heads per sequence: one program each
    aux = torch.empty(B * NC + B, dtype=torch.int32, device=dev)  # pages per (sequence, chunk), per sequence
    has_plan = plan is not None
    fmt_low_ = fmt_low if has_plan else fmt_high
    if has_plan:
        _check_move(fmt_high, fmt_low, cache_dtype, True)
    fields = [plan[f].contiguous() for f in ("high_hole", "to_low_src", "low_dst", "new_len_high", "new_len_low",
                                             "new_low_armed")] if has_plan else [aux] * 6  # unused without a plan
    slots, seq_len = slots.contiguous(), seq_len.contiguous()
    _need_kernel[(B,)](st.len_high, st.held_high, st.held_low, fields[3], fields[4], slots, seq_len, aux,
                       st.counters, st.next_growth, B, LH, NC, T_HI=fmt_high.tokens, T_LO=fmt_low_.tokens,
                       PLAN=has_plan, BLOCK_C=max(1, min(next_pow2(NC), 4096 // block_h)), BLOCK_H=block_h,
                       num_warps=4)
    pc, pi, _ = pool_views(st.pool, cache_dtype)
    D, isz = fmt_high.head_dim, fmt_high.full_itemsize
    row_bytes = max(D * isz if bits == 16 else D * bits // 8 for bits in (fmt_high.key_bits, fmt_high.value_bits))
    _apply_kernel[(B, NC)](
        pc, st.pool, st.pool.view(torch.float16), pi, st.page_table, st.len_high, st.len_low, st.held_high,
        st.held_low, st.low_armed, st.free_list, st.counters, st.next_growth, slots, seq_len, aux, *fields,
        page_out, row_out,
        B, LH, NC, H, P1 - 1, st.pool.shape[0], st.page_table.stride(0), fmt_high.page_bytes // isz,
        fmt_high.page_bytes, D, *seg_offsets(fmt_high, "k"), *seg_offsets(fmt_high, "v"), *seg_offsets(fmt_low_, "k"),
        *seg_offsets(fmt_low_, "v"), *fmt_high.tracked_words(), *fmt_low_.tracked_words(),  # read with a plan only
        T_HI=fmt_high.tokens, T_LO=fmt_low_.tokens, PLAN=has_plan, LOW_GROWS=low_grows,
        LO_TRACKED=fmt_low_.tracked, HKB=fmt_high.key_bits, HVB=fmt_high.value_bits,
        LKB=fmt_low_.key_bits, LVB=fmt_low_.value_bits, ISZ=isz, BLOCK_H=block_h, BLOCK_D=next_pow2(D),
        BLOCK_R=next_pow2(row_bytes), BLOCK_B=next_pow2(B), BLOCK_NC=next_pow2(NC), num_warps=num_warps,
        enable_fp_fusion=False,  # requantize as torch does (no FMA): bit-identical to the reference's moves
    )
    return page_out, row_out


def decode_pages(st: PageState, fmt_high: PageFormat, fmt_low: Optional[PageFormat], cache_dtype,
                 slots: torch.Tensor, seq_len: torch.Tensor, plan: Optional[dict], low_grows: bool = True,
                 impl: str = "auto") -> tuple[torch.Tensor, torch.Tensor]:
    """Grow, move and target one decode step in place on `st` (see the module docstring).

    slots int32 [B]; seq_len int32 [B] (tokens after this step's token; 0 = a padding row); plan: the
    compression_plan of this step (diffkv, fmt_low given) or None (one precision); low_grows: whether the
    policy can send a token to the low section (not the budget policy), so whether a full low section (or an
    empty one the plan armed) counts in the next growth bound (growth_bound). Returns the new tokens' write
    targets (page, row), int32
    [L, B, H]. No host synchronization: a CUDA graph can capture it.
    """
    if (plan is None) != (fmt_low is None):
        raise ValueError("plan and fmt_low go together: a two-section (diffkv) cache needs its step's plan")
    fn = decode_pages_triton if use_triton(impl, st.pool, st.page_table, slots) else decode_pages_ref
    return fn(st, fmt_high, fmt_low, cache_dtype, slots, seq_len, plan, low_grows=low_grows)
