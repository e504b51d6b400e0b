"""The scheduler's page pool when the KV cache lives on several ranks (engine.scheduler.PagePool).

Each rank's memory manager holds the pages of its own KV heads, and DiffKV sparsity differs per head, so
ranks fill up differently. The driver keeps, per rank, the free page count and what every slot holds, as
the ranks reported them after the last step, and plans conservatively:

  free_pages()        minimum over ranks
  pages_for_tokens()  the worst case of the rank with the most (layer, KV head) pairs
  pages_held(slot)    minimum over ranks (what preempting it frees on every rank, at least)
  step_view(slots)    the free pages above and, per slot, the largest rank's bound on its next decode step

Frees are booked here at once (the slot's pages go back to each rank's count) and reach the ranks with
the next step, before anything else happens there; so do prefix-cache evictions (a block is one page per
(layer, KV head) on every rank: it costs the most on the rank with the most heads, frees the least on the
rank with the fewest). Slot holdings count a slot's own pages, not the cached blocks it reads.
Slots are handed out here, last freed first reused, the same order every rank's MemoryManager follows.
"""
from __future__ import annotations

from typing import Any, Callable, Optional

from diffkv_serve.engine.kv.reservation import worst_case_growth, worst_case_pages
from diffkv_serve.engine.kv.slots import SequenceSlots


class DistributedPages:
    def __init__(self, infos: list[dict[str, Any]], check: Callable[..., list[int]]):
        """infos: what each rank's Worker.init returned; check(live_slots, refcounts): each rank's invariants
        -> free pages."""
        self.world_size = len(infos)
        first = infos[0]
        for key in ("page_bytes", "tokens_high", "extra_prompt_pages", "two_sided", "max_seqs"):
            if any(i[key] != first[key] for i in infos):
                raise RuntimeError(f"ranks disagree on {key}: {[i[key] for i in infos]}")
        self.page_bytes = first["page_bytes"]
        self._tokens_high = first["tokens_high"]
        self._extra = first["extra_prompt_pages"]
        self.two_sided = first["two_sided"]
        self._heads = max(i["heads_per_seq"] for i in infos)  # the rank a sequence costs most pages on
        self.heads_total = sum(i["heads_per_seq"] for i in infos)
        self.pages_total = [i["num_pages"] for i in infos]
        self.num_pages = min(self.pages_total)  # "could this ever fit" is asked of the smallest rank
        S = first["max_seqs"]
        self._free = list(self.pages_total)
        self._held = [[0] * S for _ in infos]
        self._high = [[0] * S for _ in infos]
        self._low = [[0] * S for _ in infos]
        self._growth = [[0] * S for _ in infos]  # MemoryManager.decode_growth per slot, as last reported
        self.mm_seconds = [0.0] * self.world_size
        self._slots = SequenceSlots(S)  # MemoryManager's order
        self._pending: list[int] = []
        self._rank_heads = [i["heads_per_seq"] for i in infos]
        self.prefix_block_tokens = first["prefix_block_tokens"]
        self.max_prefix_blocks = min(i["max_prefix_blocks"] for i in infos)
        self._evictions: list[int] = []
        self._check = check

    # ---- the scheduler's interface -----------------------------------------------------------------
    def free_pages(self) -> int:
        return min(self._free)

    def planning_free_pages(self) -> int:
        """Ray ranks step synchronously: the last step's read is current."""
        return self.free_pages()

    def pages_for_tokens(self, num_tokens: int) -> int:
        """MemoryManager.pages_for_tokens on the rank with the most heads."""
        return worst_case_pages(self._heads, self._tokens_high, self._extra, num_tokens)

    def pages_to_grow(self, old_len: int, new_len: int) -> int:
        """MemoryManager.pages_to_grow on the rank with the most heads."""
        return worst_case_growth(self._heads, self._tokens_high, self._extra, self.two_sided, old_len, new_len)

    def pages_held(self, slot: int) -> int:
        return min(h[slot] for h in self._held)

    def step_view(self, slots: list[int]) -> tuple[int, list[int]]:
        """MemoryManager.step_view from the ranks' last reports (no call to them)."""
        return self.free_pages(), [max(g[slot] for g in self._growth) for slot in slots]

    def prefix_block_cost(self, num_blocks: int) -> int:
        return num_blocks * self._heads

    def prefix_block_yield(self, num_blocks: int) -> int:
        return num_blocks * min(self._rank_heads)

    def evict_blocks(self, block_ids: list[int]) -> None:
        """Book the blocks' pages back on every rank now; the ranks recycle them with the next request."""
        for r, heads in enumerate(self._rank_heads):
            self._free[r] += len(block_ids) * heads
        self._evictions.extend(block_ids)

    def take_evictions(self) -> list[int]:
        out, self._evictions = self._evictions, []
        return out

    def alloc_slot(self) -> int:
        return self._slots.alloc()

    @property
    def num_free_slots(self) -> int:
        return len(self._slots)

    def free(self, slots: list[int]) -> None:
        for slot in slots:
            for r in range(self.world_size):
                self._free[r] += self._held[r][slot]
                self._held[r][slot] = self._high[r][slot] = self._low[r][slot] = 0
        self._pending.extend(slots)
        self._slots.release(slots)

    # ---- the executor's side ---------------------------------------------------------------------------
    def take_pending(self) -> list[int]:
        """Frees booked since the last call, in order (they go to every rank with the next request)."""
        out, self._pending = self._pending, []
        return out

    def release_unsent(self, slot: int) -> None:
        """A slot the ranks already freed themselves (a temporary one): only the driver's list takes it back."""
        self._slots.release([slot])

    def update(self, rank: int, slots: list[int], free_pages: int, held: list[int], high: list[int],
               low: list[int], mm_seconds: Optional[float] = None, growth: Optional[list[int]] = None) -> None:
        """A rank's report after it ran a request: its free pages and, per slot of the step, what it holds
        (and the bound on its next decode step)."""
        self._free[rank] = free_pages
        h, hi, lo = self._held[rank], self._high[rank], self._low[rank]
        for slot, a, b, c in zip(slots, held, high, low):
            h[slot], hi[slot], lo[slot] = a, b, c
        for slot, g in zip(slots, growth or ()):
            self._growth[rank][slot] = g
        if mm_seconds is not None:
            self.mm_seconds[rank] = mm_seconds

    def slot_usage(self, slot: int) -> tuple[int, int, int]:
        """Pages, high tokens and low tokens one slot holds, summed over ranks."""
        return (sum(h[slot] for h in self._held), sum(h[slot] for h in self._high),
                sum(h[slot] for h in self._low))

    def token_counts(self, slots: list[int], cached: int) -> dict[str, int]:
        hi = sum(self._high[r][s] for r in range(self.world_size) for s in slots)
        lo = sum(self._low[r][s] for r in range(self.world_size) for s in slots)
        held = sum(self._held[r][s] for r in range(self.world_size) for s in slots)
        return {"tokens_high": hi, "tokens_low": lo, "tokens_pruned": cached * self.heads_total - hi - lo,
                "pages_held": held}

    def rank_stats(self) -> list[dict[str, Any]]:
        return [{"rank": r, "pages_total": self.pages_total[r], "pages_used": self.pages_total[r] - self._free[r],
                 "last_mm_seconds": self.mm_seconds[r]} for r in range(self.world_size)]

    def check_invariants(self, live_slots: Optional[list[int]] = None,
                         refcounts: Optional[dict[int, int]] = None) -> None:
        """Tests: every rank's MemoryManager invariants hold (after the pending frees reach it; given the
        prefix cache's refcounts, every rank caches those blocks), and this view's free counts equal the
        ranks' own."""
        actual = self._check(live_slots, refcounts)
        assert actual == self._free, f"driver's free pages per rank {self._free} != ranks' {actual}"
        if live_slots is not None:
            busy = self._slots.in_use()
            assert busy == set(live_slots), f"driver's slots in use {sorted(busy)} != live {sorted(live_slots)}"
