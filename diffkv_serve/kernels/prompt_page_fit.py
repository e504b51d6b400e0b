"""One layer's prompt plan fitted into its all-high reservation (DiffKV §5.1 with the memory manager of §6.1).

A prompt of n tokens reserves ceil(n / T_high) pages per head; a head keeping n_high high and n_low low tokens
needs ceil(n_high / T_high) + ceil(n_low / T_low) pages, which rounding can make one more than reserved. Such a
head takes one page from the free list's start (circular), appended to the left side of its page-table row,
before its tokens are written. All heads of the layer at once: the pages go out in (sequence, head) order by
an exclusive prefix sum of who needs one. The reference does it with torch ops (~35 launches per layer of a
prompt step, which was launch-bound); the kernel is a single program (the layer's heads fit one block).
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from diffkv_serve.kernels._common import next_pow2, use_triton


@triton.jit
def _fit_kernel(pt_ptr, held_ptr, free_ptr, counters_ptr, slots_ptr, nh_ptr, nl_ptr,
                stride_pts, stride_ptl, stride_pth, stride_hs, stride_hl, stride_hh, stride_nb,
                layer, num_heads, total, num_pages,
                T_HI: tl.constexpr, T_LO: tl.constexpr, BLOCK: tl.constexpr):
    i = tl.arange(0, BLOCK)
    m = i < total
    b = i // num_heads
    h = i % num_heads
    slot = tl.load(slots_ptr + b, mask=m, other=0).to(tl.int64)
    nh = tl.load(nh_ptr + b * stride_nb + h, mask=m, other=0)
    nl = tl.load(nl_ptr + b * stride_nb + h, mask=m, other=0)
    held_at = held_ptr + slot * stride_hs + layer * stride_hl + h * stride_hh
    held = tl.load(held_at, mask=m, other=0)
    need = ((nh + T_HI - 1) // T_HI + (nl + T_LO - 1) // T_LO > held) & m
    need_i = need.to(tl.int64)
    start = tl.load(counters_ptr)
    at = (start + tl.cumsum(need_i, 0) - need_i) % num_pages  # exclusive prefix sum: each head's list cell
    page = tl.load(free_ptr + at, mask=need, other=-1)
    tl.store(pt_ptr + slot * stride_pts + layer * stride_ptl + h * stride_pth + held, page, mask=need)
    tl.store(held_at, held + 1, mask=need)
    tl.store(counters_ptr, start + tl.sum(need_i, 0))


def fit_prompt_pages_ref(page_table, held_high, free_list, counters, slots, layer: int, n_high, n_low,
                         tokens_high: int, tokens_low: int, num_pages: int) -> None:
    """Torch reference (in place on page_table, held_high, counters; nonzero syncs: CPU and tests)."""
    s = slots.long()
    held = held_high[s, layer]  # [B, H]
    need = -(-n_high // tokens_high) - (n_low // -tokens_low) > held
    flat = need.flatten().to(torch.int64)
    cells = (counters[0] + torch.cumsum(flat, 0) - flat) % num_pages
    b, h = need.nonzero(as_tuple=True)  # row-major: the order of the prefix sum
    page_table[s[b], layer, h, held[b, h].long()] = free_list[cells[need.flatten()]].to(page_table.dtype)
    held_high[s[b], layer, h] += 1
    counters[0] += flat.sum()


def fit_prompt_pages(page_table: torch.Tensor, held_high: torch.Tensor, free_list: torch.Tensor,
                     counters: torch.Tensor, slots: torch.Tensor, layer: int, n_high: torch.Tensor,
                     n_low: torch.Tensor, tokens_high: int, tokens_low: int, num_pages: int,
                     impl: str = "auto") -> None:
    """page_table int32 [S, L, H, P + 1] (column P: trash), held_high int32 [S, L, H], free_list int32
    [num_pages + 1], counters int64 [2] (start, end of the circular free list); slots int [B];
    n_high / n_low int [B, H]: this layer's planned section sizes. Updates the first three in place."""
    if use_triton(impl, page_table):
        B, H = n_high.shape
        if B * H == 0:
            return
        assert n_high.stride() == n_low.stride() and n_high.stride(1) == 1
        _fit_kernel[(1,)](
            page_table, held_high, free_list, counters, slots, n_high, n_low,
            page_table.stride(0), page_table.stride(1), page_table.stride(2),
            held_high.stride(0), held_high.stride(1), held_high.stride(2), n_high.stride(0),
            layer, H, B * H, num_pages, T_HI=tokens_high, T_LO=tokens_low, BLOCK=max(16, next_pow2(B * H)),
            num_warps=4)
        return
    fit_prompt_pages_ref(page_table, held_high, free_list, counters, slots, layer, n_high, n_low, tokens_high,
                         tokens_low, num_pages)
