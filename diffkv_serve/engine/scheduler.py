"""Continuous batching: FCFS scheduling of whole prompts, decode of everything running, and
preemption by recompute when the page pool runs out.

A step is either a prefill batch (newly scheduled prompts, prioritized like vLLM) or a decode batch
(one token for every running sequence). Page accounting asks the memory manager for the device's free
page count once per step and plans against each sequence's worst-case growth. With tensor parallelism
the page pool is a view of every rank's memory manager: free pages are the minimum over ranks, page
demands the largest rank's, and frees reach every rank (engine.kv.distributed).

Learned reservation (SchedulerConfig.reservation = "learned", engine.kv.footprint): a prompt reserves a
quantile of what prompts of its length kept so far, and decode steps are planned against each sequence's
exact bound (a head needs a page only on a side whose section is full), read with the free count (so are
diffkv's decode steps under either rule: a page per head and step would keep ~5% of the pool idle). A prefill
whose pages did not fit is detected on the device; its sequences go back to the head of the queue, the
first of them marked for the worst-case rule, so it is scheduled next, and fits.

Prefix caching (engine.kv.prefix_cache): scheduling looks each prompt up, counts only the uncached part's
pages (the cached blocks' pages are shared: a hit's first page-table columns point at them), and
reserves against free plus evictable pages: unreferenced cached blocks are evicted, least recently used
first, before anything is refused or preempted.
"""
from __future__ import annotations

import logging
import time
from collections import deque
from itertools import islice
from typing import Optional, Protocol

from diffkv_serve.engine.config import SchedulerConfig
from diffkv_serve.engine.kv.footprint import FootprintEstimator
from diffkv_serve.engine.model_runner import Batch
from diffkv_serve.engine.kv.prefix_cache import CachedBlock, PrefixCache
from diffkv_serve.engine.sequence import Sequence, Status

log = logging.getLogger(__name__)


class PagePool(Protocol):
    """What the scheduler needs of the KV memory (engine.kv.pool.MemoryManager or, over Ray ranks,
    engine.kv.distributed.DistributedPages)."""

    num_pages: int
    num_free_slots: int
    two_sided: bool  # diffkv sections: decode steps are planned with step_view's exact growth

    def free_pages(self) -> int: ...
    def planning_free_pages(self) -> int: ...  # the step's plan: may be a snapshot taken early in the last step
    def alloc_slot(self) -> int: ...
    def free(self, slots: list[int]) -> None: ...
    def pages_for_tokens(self, num_tokens: int) -> int: ...
    def pages_to_grow(self, old_len: int, new_len: int) -> int: ...
    def pages_held(self, slot: int) -> int: ...
    def step_view(self, slots: list[int]) -> tuple[int, list[int]]: ...
    # prefix cache: block geometry, what blocks cost (busiest rank) and free when evicted (at least, every rank)
    prefix_block_tokens: int
    def prefix_block_cost(self, num_blocks: int) -> int: ...
    def prefix_block_yield(self, num_blocks: int) -> int: ...
    def evict_blocks(self, block_ids: list[int]) -> None: ...


class Scheduler:
    def __init__(self, config: SchedulerConfig, mm: PagePool, prefix_cache: Optional[PrefixCache] = None):
        self.config = config
        self.mm = mm
        self.prefix_cache = prefix_cache
        self.num_prefill_computed = 0  # prompt tokens scheduled prefills compute (cached blocks are read instead)
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []
        self.num_preemptions = 0
        self.num_overflows = 0  # learned reservation: prefills redone because their pages did not fit
        two_sided = bool(getattr(mm, "two_sided", False))
        # Learned reservation estimates what a DiffKV prompt keeps. A single-precision prompt keeps exactly its
        # worst case, so such a pool schedules as under worst case (learning there only changed its decode plan).
        self.footprint = FootprintEstimator(config) if config.reservation == "learned" and two_sided else None
        # Exact decode growth (step_view: a head needs a page only on a full side) for two-sided (diffkv) pools,
        # whose host worst case (a page per head and step) kept ~5% of the pool idle.
        self.exact_growth = two_sided
        self._growth_by_slot: Optional[dict[int, int]] = None  # exact: slot -> pages its next decode step may take
        self._deferred = 0  # decode steps a prompt that fit has waited for prefill_min_prompts (prompt batching)
        self.num_deferred_steps = 0

    def add(self, seq: Sequence) -> None:
        self.waiting.append(seq)

    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    def remove(self, seq: Sequence) -> None:
        """Drop a sequence (finished or aborted) and give its pages back."""
        if seq in self.running:
            self.running.remove(seq)
        elif seq in self.waiting:
            self.waiting.remove(seq)
        self._release(seq)

    def _release(self, seq: Sequence) -> None:
        if seq.slot is not None:
            self.mm.free([seq.slot])
            seq.slot = None
        seq.num_cached = 0
        self._drop_prefix_refs(seq)

    def _growth(self, seq: Sequence) -> int:
        """Pages one running sequence's next decode step may take."""
        if self._growth_by_slot is not None:
            return self._growth_by_slot[seq.slot]
        return self.mm.pages_to_grow(seq.num_cached, seq.num_cached + 1)

    def _decode_demand(self) -> int:
        return sum(map(self._growth, self.running))

    def schedule(self) -> tuple[Optional[Batch], list[Sequence]]:
        """The next batch (or None when idle), and sequences that must finish because they cannot grow."""
        if self.exact_growth:
            slots = [s.slot for s in self.running]
            free, growth = self.mm.step_view(slots)
            self._growth_by_slot = dict(zip(slots, growth))
        else:
            free = self.mm.planning_free_pages()
        demand = self._decode_demand()  # once per step: a per-sequence sum is the scheduler's main host cost
        prefill = [] if self._defer_prompts(free, demand) else self._schedule_prompts(free, demand)
        if prefill:
            return Batch(True, prefill), []
        if not self.running:
            if self.waiting and self._prompt_pages(self.waiting[0]) > self.mm.num_pages:
                return None, [self.waiting.popleft()]  # could never fit, even in an empty pool
            return None, []
        stuck: list[Sequence] = []
        while demand > free:
            if self.prefix_cache is not None and self.prefix_cache.num_evictable:
                free += self._evict(demand - free)
                continue
            if len(self.running) == 1:
                # Alone and still out of pages: the pool cannot hold this sequence any longer.
                stuck.append(self.running.pop())
                break
            demand -= self._growth(self.running[-1])
            free += self.preempt_last()
        return (Batch(False, list(self.running)) if self.running else None), stuck

    def preempt_last(self) -> int:
        """Preempt the latest admitted running sequence (recompute later); returns the pages it held."""
        if not self.running:
            return 0
        victim = self.running.pop()  # latest admitted goes first (FCFS keeps the oldest running)
        pages = self.mm.pages_held(victim.slot)
        self._release(victim)
        victim.status = Status.WAITING
        victim.num_preemptions += 1
        self.num_preemptions += 1
        self.waiting.appendleft(victim)
        log.debug("preempted %s (recompute)", victim.request_id)
        return pages

    def _headroom(self) -> int:
        """Pages prompts may not take while sequences run (prefill_watermark)."""
        return int(self.config.prefill_watermark * self.mm.num_pages) if self.running else 0

    def _defer_prompts(self, free: int, demand: int) -> bool:
        """Prompt batching (prefill_min_prompts): whether this step decodes although a waiting prompt fits,
        because fewer prompts fit than a prompt step should take and the first has not waited long enough.
        A step should take prefill_min_prompts prompts, or as many as wait, the free slots and the token budget
        allow, or one per prefill_min_prompts running sequences, whichever is fewest.
        Pages are counted without prefix hits (an over-estimate: a deferral, never a wrong admission)."""
        cfg = self.config
        if cfg.prefill_min_prompts <= 1 or not self.running or not self.waiting:
            self._deferred = 0
            return False
        # At most one prompt per prefill_min_prompts running sequences: a step that stops only a few (a pool of
        # a few sequences) costs little, and waiting would leave its pages idle for long.
        k = cfg.prefill_min_prompts
        want = min(k, max(1, len(self.running) // k), len(self.waiting), cfg.max_num_seqs - len(self.running),
                   self.mm.num_free_slots)
        room, budget, fit = free - demand - self._headroom(), cfg.max_num_batched_tokens, 0
        for seq in islice(self.waiting, want):  # not a copy of the queue: this runs every step
            if seq.rows_in_flight:
                break
            if fit and seq.num_tokens > budget:  # the token budget is full: this step is as large as it gets
                fit = want
                break
            need = self._prompt_pages(seq)
            if need > room:
                break
            room -= need
            budget -= seq.num_tokens
            fit += 1
        if fit == 0 or fit >= want or self._deferred >= cfg.prefill_max_delay_steps:
            self._deferred = 0
            return False
        self._deferred += 1
        self.num_deferred_steps += 1
        return True

    def _schedule_prompts(self, free: int, demand: int) -> list[Sequence]:
        """FCFS prompts that fit the token budget, the slots and the pages (worst case), in order.
        demand: pages the running sequences' next decode step may take."""
        cfg, mm = self.config, self.mm
        budget = cfg.max_num_batched_tokens
        # Keep one decode step's growth for everyone already running, so a new prompt cannot force preemption,
        # and the watermark's headroom.
        free -= demand + self._headroom()
        scheduled: list[Sequence] = []
        while self.waiting:
            seq = self.waiting[0]
            n = seq.num_tokens
            if len(self.running) + len(scheduled) >= cfg.max_num_seqs or mm.num_free_slots == 0:
                break
            if seq.rows_in_flight:  # preempted with its next token still on the way: schedule it once read
                break
            hits, new, reclaim = self._prefix_plan(seq)
            computed = n - len(hits) * (mm.prefix_block_tokens if hits else 0)
            # A prompt longer than the token budget still runs, alone.
            if computed > budget and scheduled:
                break
            need = self._prompt_pages(seq)
            if hits:
                need -= mm.prefix_block_cost(len(hits))  # its first columns are the cached blocks' pages
            if need > free + reclaim:
                break
            self.waiting.popleft()
            seq.slot = mm.alloc_slot()
            seq.status = Status.RUNNING
            if seq.first_scheduled_time is None:  # a preempted one's recompute is not queue time
                seq.first_scheduled_time = time.monotonic()
            scheduled.append(seq)
            if self.prefix_cache is not None:
                self._take_prefix(seq, hits, new)
            if need > free:  # unreferenced cached blocks make room (the hits are referenced now)
                free += self._evict(need - free)
            budget -= computed
            self.num_prefill_computed += computed
            free -= need
            if budget <= 0:
                break
        self.running.extend(scheduled)
        return scheduled

    def _prompt_pages(self, seq: Sequence) -> int:
        """Pages to reserve for a prompt: its all-high worst case, or the learned estimate plus one
        decode step's worst case."""
        n, mm = seq.num_tokens, self.mm
        worst = mm.pages_for_tokens(n + 1)
        if self.footprint is None or seq.worst_case_reservation:
            return worst
        return min(worst, self.footprint.prompt_pages(n, mm.pages_for_tokens(n)) + mm.pages_to_grow(n, n + 1))

    def settle_prefill(self, batch: Batch) -> set[int]:
        """After a prefill: learn what its prompts kept, and put the ones whose pages did not fit back at the
        head of the queue (their pages freed, in order); returns their indices in the batch."""
        lost = set(batch.overflowed)
        for i, seq in enumerate(batch.seqs):
            if i in lost or batch.pages_kept is None:
                continue
            seq.prefill_pages, seq.prefill_tokens = batch.pages_total[i], seq.num_tokens
            if self.footprint is not None:
                self.footprint.observe_prompt(seq.num_tokens, batch.pages_kept[i],
                                              self.mm.pages_for_tokens(seq.num_tokens))
        for i in sorted(lost, reverse=True):
            seq = batch.seqs[i]
            self.running.remove(seq)
            self._release(seq)
            seq.status = Status.WAITING
            self.waiting.appendleft(seq)
            self.num_overflows += 1
            log.debug("%s overflowed the page pool in its prefill (redone)", seq.request_id)
        if lost:
            # Only the first one surely took more than estimated (the others may have lost to its pages):
            # the worst case makes it fit next time, and it is first in line.
            batch.seqs[min(lost)].worst_case_reservation = True
        return lost

    def observe_finish(self, seq: Sequence, pages_now: int) -> None:
        """A sequence finishes holding pages_now pages (summed over ranks): learn its generation growth."""
        if self.footprint is not None and seq.prefill_pages is not None:
            self.footprint.observe_growth(seq.num_cached - seq.prefill_tokens, pages_now - seq.prefill_pages)

    # ---- prefix cache ---------------------------------------------------------------------------------
    def _prefix_plan(self, seq: Sequence) -> tuple[list[CachedBlock], list[tuple], int]:
        """Cached blocks a prompt can read, chain keys of the full blocks it may cache after them, and the
        pages evicting unreferenced blocks (other than its hits) would free."""
        pc = self.prefix_cache
        if pc is None:
            return [], [], 0
        toks = seq.all_token_ids
        n = len(toks)
        limit = n - 1  # the last token is computed: its logits are the first output
        if seq.params.prompt_logprobs is not None and not seq.output_token_ids:
            limit = 0  # its prefill must compute every prompt position's logits
        hits, candidates = pc.match(toks, limit)
        new = []
        for key in candidates:  # a contiguous run after the hits, up to the first block cached already
            if pc.contains(key[0]):
                break
            new.append(key)
        return hits, new, self.mm.prefix_block_yield(pc.evictable_excluding(hits))

    def _take_prefix(self, seq: Sequence, hits: list[CachedBlock], new: list[tuple]) -> None:
        """Reference the hits, insert the new blocks (as many as block ids allow); the ranks get both by id."""
        pc = self.prefix_cache
        pc.acquire(hits)
        inserted = []
        for key, toks, parent in new:
            blk = pc.insert(key, toks, parent)
            if blk is None:
                break
            inserted.append(blk)
        pc.record_query(seq.num_tokens, len(hits) * pc.block_tokens)
        seq.prefix_hits = [b.block_id for b in hits]
        seq.prefix_inserts = [b.block_id for b in inserted]
        seq.prefix_refs = hits + inserted

    def _evict(self, pages: int) -> int:
        """Evict least recently used unreferenced blocks until `pages` pages are free; returns pages freed."""
        ids = self.prefix_cache.evict(-(-pages // self.mm.prefix_block_yield(1)))
        self.mm.evict_blocks(ids)
        return self.mm.prefix_block_yield(len(ids))

    def after_prefill(self, batch: Batch) -> None:
        """A prefill ran: its new blocks become matchable. Call it before anything releases the batch's
        sequences (settle_prefill), or their new blocks would never be committed."""
        pc = self.prefix_cache
        if pc is None:
            return
        for seq in batch.seqs:
            pc.commit([b for b in seq.prefix_refs if not b.ready])

    def _drop_prefix_refs(self, seq: Sequence) -> None:
        if seq.prefix_refs:
            self.prefix_cache.release(seq.prefix_refs)
        seq.prefix_refs, seq.prefix_hits, seq.prefix_inserts = [], [], []

    def reset_prefix_cache(self) -> int:
        """Evict every unreferenced cached block; returns how many."""
        if self.prefix_cache is None:
            return 0
        ids = self.prefix_cache.clear()
        self.mm.evict_blocks(ids)
        return len(ids)
