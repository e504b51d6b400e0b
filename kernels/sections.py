"""Where section token j lives in a bidirectional page table row (one definition for every kernel):
high token j is in column j // T, low token j in column P - 1 - j // T (low pages grow from the right;
column P of the table is a trash cell). Row within the page: j % T."""
from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def section_page(pt_row, col0, t, mask, T: tl.constexpr, LOW: tl.constexpr):
    """Page ids (int64) of section tokens t; pt_row points at the (slot, layer, head) row, col0 = P - 1."""
    if LOW:
        page = tl.load(pt_row + col0 - t // T, mask=mask, other=0)
    else:
        page = tl.load(pt_row + t // T, mask=mask, other=0)
    return page.to(tl.int64)


def section_columns(j: torch.Tensor, tokens: int, low: bool, table_width: int) -> torch.Tensor:
    """Page-table columns of section tokens j; table_width = page_table.shape[-1] = P + 1."""
    return (table_width - 2 - j // tokens) if low else j // tokens


@triton.jit
def split_range(length, split, num_splits, BLOCK_N: tl.constexpr):
    """Tokens [lo, hi) of a section that program `split` of `num_splits` covers, in whole BLOCK_N blocks."""
    per_split = tl.cdiv(tl.cdiv(length, BLOCK_N), num_splits) * BLOCK_N
    lo = split * per_split
    return lo, tl.minimum(length, lo + per_split)


def row_offsets(page_table: torch.Tensor, slots: torch.Tensor, layer: int | None = None) -> torch.Tensor:
    """int64 offsets into page_table.view(-1) of the rows of sequences in slots: [B, L, H] (layer None) or
    [B, H] (one layer). Indexing through them reads or writes only the cells a step needs; page_table[slots]
    would copy whole rows (B x L x H x (P + 1) cells, tens of MB per call at 8B shapes and large batches)."""
    assert page_table.is_contiguous()
    s0, s1, s2, _ = page_table.stride()
    dev = page_table.device
    heads = torch.arange(page_table.shape[2], device=dev, dtype=torch.int64) * s2
    if layer is None:
        layers = torch.arange(page_table.shape[1], device=dev, dtype=torch.int64) * s1
        return slots.long().view(-1, 1, 1) * s0 + layers.view(1, -1, 1) + heads
    return slots.long().view(-1, 1) * s0 + (layer * s1 + heads)


def section_targets(page_table: torch.Tensor, slots: torch.Tensor, idx: torch.Tensor, tokens: int,
                    layer: int | None = None, right=None) -> tuple[torch.Tensor, torch.Tensor]:
    """Torch: page (-1: none) and row (int32) of section indices idx (-1: none) of sequences in slots.

    idx [B, L, H] (layer None) or [B, H] (one layer); slots [B]. right None: the high section (column
    j // tokens); else the low section, whose pages end at column right - 1 (a number or per head like idx:
    the table's right end P, or a prompt's all-high reservation while it is planned)."""
    none = idx < 0
    col = idx.clamp_min(0).long() // tokens
    if right is not None:
        col = (right - 1 - col).clamp(0, page_table.shape[-1] - 1)
    page = page_table.view(-1)[row_offsets(page_table, slots, layer) + col]
    page = torch.where(none, torch.full_like(page, -1), page)
    row = torch.where(none, torch.zeros_like(idx), idx % tokens).to(torch.int32)
    return page, row
