"""Prefix-cache blocks in one rank's pool (docs/DESIGN.md "Memory manager"): diffkv_serve/engine/kv/prefix_cache.py decides
which blocks exist, every rank applies the same block ids here."""
from __future__ import annotations

import torch


class PrefixBlocks:
    """MemoryManager's prefix-cache block pages (a mixin: it uses the pool's page table and free list)."""

    def _init_prefix_blocks(self) -> None:
        """A cached block is one high-precision page per (layer, head) that the page tables of its readers point
        at: columns [0, shared_cols[slot]) of a slot are such pages, read-only. In diffkv they are the first
        columns of the high section, holding tokens the policy pins high (docs/PREFIX_CACHING.md), so no
        demotion, pruning or compaction ever writes them."""
        L, H = self.shape.num_layers, self.shape.num_kv_heads
        self.prefix_block_tokens = self.fmt_high.tokens
        self.max_prefix_blocks = self.num_pages // self.heads_per_seq  # a block costs one page per head
        self.block_pages = torch.full((max(1, self.max_prefix_blocks), L, H), -1, dtype=torch.int32, device=self.device)
        self.cached_blocks: set[int] = set()
        self.shared_cols = [0] * (self.shape.max_seqs + 1)

    def attach_blocks(self, slot: int, block_ids: list[int]) -> None:
        """A new sequence reads these cached blocks as its first (high-section) page-table columns."""
        k = len(block_ids)
        if k == 0:
            return
        ids = torch.tensor(block_ids, dtype=torch.int64, device=self.device)
        self.page_table[slot, :, :, :k] = self.block_pages[ids].permute(1, 2, 0)
        self.held_high[slot] = k
        self.shared_cols[slot] = k

    def adopt_blocks(self, slot: int, first_col: int, block_ids: list[int]) -> None:
        """After its prefill, full high page columns [first_col, first_col + k) of a sequence become cached
        blocks (the cache owns the pages now; the sequence keeps reading them)."""
        k = len(block_ids)
        if k == 0:
            return
        if first_col != self.shared_cols[slot]:
            raise RuntimeError(f"slot {slot}: adopting columns from {first_col}, but {self.shared_cols[slot]} "
                               "are shared")
        ids = torch.tensor(block_ids, dtype=torch.int64, device=self.device)
        self.block_pages[ids] = self.page_table[slot, :, :, first_col:first_col + k].permute(2, 0, 1)
        self.shared_cols[slot] = first_col + k
        self._add_blocks(block_ids)

    def evict_blocks(self, block_ids: list[int]) -> None:
        """Recycle the pages of these cached blocks (no sequence reads them any more) in one batched recycle."""
        if not block_ids:
            return
        missing = set(block_ids) - self.cached_blocks
        if missing:
            raise RuntimeError(f"evicting prefix blocks {sorted(missing)} that are not cached")
        ids = torch.tensor(block_ids, dtype=torch.int64, device=self.device)
        pages = self.block_pages[ids].view(len(block_ids), -1)
        self._recycle(pages, torch.ones_like(pages, dtype=torch.bool))
        self.block_pages[ids] = -1
        self.cached_blocks -= set(block_ids)

    def _add_blocks(self, block_ids: list[int]) -> None:
        dup = self.cached_blocks & set(block_ids)
        if dup:
            raise RuntimeError(f"prefix blocks {sorted(dup)} are cached already")
        self.cached_blocks |= set(block_ids)

    def prefix_block_cost(self, num_blocks: int) -> int:
        """Pages num_blocks cached blocks take (one per layer and head)."""
        return num_blocks * self.heads_per_seq

    def prefix_block_yield(self, num_blocks: int) -> int:
        """Pages evicting num_blocks cached blocks frees (the same here; tensor-parallel views differ)."""
        return num_blocks * self.heads_per_seq
