"""Prefix cache index (driver side): which prompt blocks are cached, who reads them, what to evict.

A block is a run of `block_tokens` consecutive prompt tokens, named by a chain hash (the parent block's hash
and its own token ids), so a block matches only under the same whole prefix. Only full blocks are cached.
Each cached block has an id that every tensor-parallel rank uses for its own pages of that block (one page
per (layer, KV head), engine.kv.pool.MemoryManager.block_pages); ranks never decide anything themselves:
the driver's scheduler looks blocks up, counts references, picks evictions and sends them with the batch.

Reference counts: a sequence holds a reference on every block it reads or inserted until its end (its page
table points at the block's pages, in every mode). Blocks nobody references
stay cached, least recently used first in line for eviction. A block inserted by a prefill is not
matchable until that prefill ran (`commit`), so a batch never reads pages written in the same step.
"""
from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass
from typing import Optional


@dataclass(eq=False)
class CachedBlock:
    block_id: int
    key: int  # chain hash: hash((parent key, tokens))
    tokens: tuple[int, ...]  # kept to rule out hash collisions on a match
    parent: int
    refcount: int = 0
    ready: bool = False  # written by a prefill that has run


ROOT = 0  # parent key of a prompt's first block


def chain_keys(token_ids: list[int], block_tokens: int, num_blocks: int) -> list[tuple[int, tuple[int, ...], int]]:
    """(key, tokens, parent key) of the first num_blocks full blocks of token_ids."""
    out, parent = [], ROOT
    for b in range(num_blocks):
        toks = tuple(token_ids[b * block_tokens:(b + 1) * block_tokens])
        key = hash((parent, toks))
        out.append((key, toks, parent))
        parent = key
    return out


class PrefixCache:
    def __init__(self, block_tokens: int, max_blocks: int):
        if block_tokens < 1 or max_blocks < 0:
            raise ValueError(f"block_tokens={block_tokens} must be >= 1 and max_blocks={max_blocks} >= 0")
        self.block_tokens = block_tokens
        self.max_blocks = max_blocks
        self._by_key: dict[int, CachedBlock] = {}
        self._lru: OrderedDict[int, CachedBlock] = OrderedDict()  # refcount-0 ready blocks, oldest first
        self._free_ids = list(range(max_blocks - 1, -1, -1))
        self.queries = 0  # prompt tokens looked up (admitted sequences)
        self.hits = 0  # of those, tokens found cached

    # ---- lookup ------------------------------------------------------------------------------------
    def match(self, token_ids: list[int], max_tokens: int) -> tuple[list[CachedBlock], list[tuple]]:
        """The cached blocks that start token_ids (at most max_tokens tokens of them), and the chain keys of
        the full blocks after them up to the end of token_ids (candidates to insert). No side effects."""
        keys = chain_keys(token_ids, self.block_tokens, len(token_ids) // self.block_tokens)
        hits: list[CachedBlock] = []
        for key, toks, _ in keys[:max(0, max_tokens) // self.block_tokens]:
            blk = self._by_key.get(key)
            if blk is None or not blk.ready or blk.tokens != toks:
                break
            hits.append(blk)
        return hits, keys[len(hits):]

    def record_query(self, num_tokens: int, hit_tokens: int) -> None:
        self.queries += num_tokens
        self.hits += hit_tokens

    def contains(self, key: int) -> bool:
        return key in self._by_key

    # ---- references --------------------------------------------------------------------------------
    def acquire(self, blocks: list[CachedBlock]) -> None:
        for blk in blocks:
            if blk.refcount == 0:
                self._lru.pop(blk.block_id, None)
            blk.refcount += 1

    def release(self, blocks: list[CachedBlock]) -> None:
        """Drop one reference on each block; blocks nobody reads join the LRU tail. Later blocks of a prefix
        are released first, so they are evicted before the blocks they extend (a child is useless alone)."""
        for blk in reversed(blocks):
            if blk.refcount <= 0:
                raise RuntimeError(f"prefix block {blk.block_id} released more often than acquired")
            blk.refcount -= 1
            if blk.refcount == 0 and blk.ready:
                self._lru[blk.block_id] = blk

    # ---- insertion ---------------------------------------------------------------------------------
    def insert(self, key: int, tokens: tuple[int, ...], parent: int) -> Optional[CachedBlock]:
        """A new block (refcount 1: its writer), matchable after commit(); None if no block id is free."""
        if key in self._by_key:
            raise RuntimeError(f"prefix block key {key} is cached already")
        if not self._free_ids:
            return None
        blk = CachedBlock(self._free_ids.pop(), key, tokens, parent, refcount=1)
        self._by_key[key] = blk
        return blk

    def commit(self, blocks: list[CachedBlock]) -> None:
        """The prefill that wrote these blocks ran: later lookups may match them."""
        for blk in blocks:
            blk.ready = True
            if blk.refcount == 0:
                self._lru[blk.block_id] = blk

    # ---- eviction ----------------------------------------------------------------------------------
    @property
    def num_evictable(self) -> int:
        return len(self._lru)

    @property
    def num_cached(self) -> int:
        return len(self._by_key)

    def evictable_excluding(self, blocks: list[CachedBlock]) -> int:
        """Evictable blocks left once `blocks` are acquired."""
        return len(self._lru) - sum(1 for b in blocks if b.refcount == 0 and b.block_id in self._lru)

    def evict(self, num_blocks: int) -> list[int]:
        """Remove up to num_blocks least recently used unreferenced blocks; returns their ids."""
        ids = []
        while self._lru and len(ids) < num_blocks:
            bid, blk = self._lru.popitem(last=False)
            del self._by_key[blk.key]
            self._free_ids.append(bid)
            ids.append(bid)
        return ids

    def clear(self) -> list[int]:
        """Evict every unreferenced block (referenced ones stay: their readers still need them)."""
        return self.evict(len(self._lru))

    def refcounts(self) -> dict[int, int]:
        """block id -> references (tests compare it with what the sequences hold)."""
        return {b.block_id: b.refcount for b in self._by_key.values()}
