"""Batched page allocation from the circular free list (torch; docs/DESIGN.md "Memory manager", paper §6.1).

Every (sequence, layer, head) states how many pages it needs on its left (high) and right (low) side; an
exclusive prefix sum over the flattened heads gives each a disjoint range of the list after its start
pointer, and every head writes its page ids into its page-table row in parallel. Masked lanes write to the
row's trash column, so there is no data-dependent shape and no host round trip. The decode step does the same
in one kernel (diffkv_serve/kernels/decode_pages.py); prompts and the CPU path use this.
"""
from __future__ import annotations

import torch


def grow_pages(page_table: torch.Tensor, held_high: torch.Tensor, held_low: torch.Tensor, free_list: torch.Tensor,
               counters: torch.Tensor, num_pages: int, at, need_high: torch.Tensor, need_low: torch.Tensor,
               max_new_pages: int) -> None:
    """Give every head indexed by `at` (slots [B], or (slots, layer)) need_high more pages on its left and
    need_low on its right (int [B, L, H] or [B, H], >= 0). max_new_pages: host bound on need_high + need_low
    of any head. High pages come first in a head's range, then low ones."""
    if max_new_pages <= 0:
        return
    P = page_table.shape[-1] - 1  # last column: the trash cell
    hh, hl = held_high[at], held_low[at]
    need = (need_high + need_low).flatten()
    offsets = torch.cumsum(need, 0) - need  # exclusive prefix sum: each head's range in the list
    j = torch.arange(max_new_pages, device=page_table.device, dtype=torch.int64)
    valid = j < need.unsqueeze(1)  # [heads, m]
    pages = free_list[(counters[0] + offsets.unsqueeze(1) + j) % num_pages]
    nh = need_high.flatten().unsqueeze(1).to(torch.int64)
    left = hh.flatten().unsqueeze(1).to(torch.int64) + j
    right = P - 1 - hl.flatten().unsqueeze(1).to(torch.int64) - (j - nh)
    cols = torch.where(j < nh, left, right)
    cols = torch.where(valid, cols, torch.full_like(cols, P))  # invalid lanes -> trash column
    rows = page_table[at].view(-1, P + 1)
    rows.scatter_(1, cols, pages)
    page_table[at] = rows.view(*hh.shape, P + 1)
    held_high[at] = hh + need_high.to(torch.int32)
    held_low[at] = hl + need_low.to(torch.int32)
    counters[0] += need.sum()
