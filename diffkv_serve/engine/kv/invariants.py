"""The memory manager's invariants, checked by tests and benchmarks (docs/DESIGN.md "Memory manager"): every page
is free exactly once or owned exactly once, and every section fits in its pages. All reads copy to the host."""
from __future__ import annotations

from typing import Optional

import torch


def held_page_ids(mm) -> list[int]:
    """Pages the sequences own (not the prefix-cache pages their first columns may point at)."""
    P = mm.max_pages
    pt = mm.page_table.cpu()[..., :P]
    cols = torch.arange(P).view(1, 1, 1, -1)
    shared = torch.tensor(mm.shared_cols).view(-1, 1, 1, 1)
    mask = ((cols >= shared) & (cols < mm.held_high.cpu().unsqueeze(-1))) | (
        cols >= P - mm.held_low.cpu().unsqueeze(-1))
    return pt[mask].tolist()


def check_prefix_blocks(mm, refcounts: Optional[dict[int, int]]) -> list[int]:
    """Cached blocks' pages (returned); shared columns point at whole cached blocks; given the driver's
    refcounts, each block is read by exactly that many slots."""
    ids = sorted(mm.cached_blocks)
    bp = mm.block_pages.cpu()
    pages = bp[ids].flatten().tolist() if ids else []
    assert all(p >= 0 for p in pages), "a cached block lacks a page"
    page_to_block = {int(bp[b, 0, 0]): b for b in ids}
    readers = {b: 0 for b in ids}
    pt = mm.page_table.cpu()
    for slot, k in enumerate(mm.shared_cols):
        for col in range(k):
            b = page_to_block.get(int(pt[slot, 0, 0, col]))
            assert b is not None, f"slot {slot} column {col} is shared but points at no cached block"
            assert torch.equal(pt[slot, :, :, col], bp[b]), f"slot {slot} column {col}: not all of block {b}"
            readers[b] += 1
    if refcounts is not None:
        assert set(refcounts) == set(ids), f"driver caches blocks {sorted(refcounts)}, rank {ids}"
        assert readers == refcounts, f"slots reading each block {readers} != refcounts {refcounts}"
    return pages


def check_pool(mm, live_slots: Optional[list[int]] = None, refcounts: Optional[dict[int, int]] = None) -> None:
    """Every page is either free exactly once, owned by exactly one (slot, layer, head, column) or by
    exactly one cached prefix block (which slots may also read: as often as refcounts says), and every
    section fits in the pages its side holds."""
    start, end = mm.counters.tolist()
    n = mm.num_pages
    assert 0 <= end - start <= n, f"free count {end - start} outside [0, {n}]"
    # The free ids are the circular range [start, end) of the list: one roll, not a Python loop over pages
    # (millions at benchmark pool sizes).
    free_ids = mm.free_list[:n].cpu().roll(-(start % n))[: end - start].tolist()
    used_ids = held_page_ids(mm) + check_prefix_blocks(mm, refcounts)
    assert all(0 <= p < n for p in used_ids), "page table points outside the pool"
    seen = free_ids + used_ids
    assert len(seen) == n and len(set(seen)) == n, (
        f"pages lost or duplicated: {len(free_ids)} free + {len(used_ids)} held, "
        f"{len(set(seen))} distinct of {n}")
    assert not set(free_ids) & set(used_ids), "a page table points at a free page"
    assert bool((mm.held_high + mm.held_low <= mm.max_pages).all()), "page table sides overlap"
    assert bool((mm.len_high <= mm.held_high * mm.fmt_high.tokens).all()), "high section overflows"
    if mm.fmt_low is not None:
        assert bool((mm.len_low <= mm.held_low * mm.fmt_low.tokens).all()), "low section overflows"
    if live_slots is not None:
        busy = mm.slots_in_use()
        assert busy == set(live_slots), f"slots in use {sorted(busy)} != live sequences {sorted(live_slots)}"
