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


def section_targets(page_table: torch.Tensor, slots: torch.Tensor, idx: torch.Tensor, tokens: int,
                    layer: int | None = None, right=None) -> tuple[torch.Tensor, torch.Tensor]:
    """Torch: page (-1: none) and row (int32) of section indices idx (-1: none) of sequences in slots.

    idx [B, L, H] (layer None) or [B, H] (one layer); slots [B]. right None: the high section (column
    j // tokens); else the low section, whose pages end at column right - 1 (a number or per head like idx:
    the table's right end P, or a prompt's all-high reservation while it is planned)."""
    pt = page_table[slots.long()] if layer is None else page_table[slots.long(), layer]
    none = idx < 0
    col = idx.clamp_min(0).long() // tokens
    if right is not None:
        col = (right - 1 - col).clamp(0, page_table.shape[-1] - 1)
    page = pt.gather(-1, col.unsqueeze(-1)).squeeze(-1)
    page = torch.where(none, torch.full_like(page, -1), page)
    row = torch.where(none, torch.zeros_like(idx), idx % tokens).to(torch.int32)
    return page, row
