"""On-device KV memory manager (docs/DESIGN.md "Memory manager", paper §5).

All state lives on the model's device:
  pool        uint8 [num_pages, page_bytes]   unified pages shared by every layer, head and precision
  free_list   int32 [num_pages + 1]           circular list of free page ids (+1 trash cell for masked writes)
  counters    int64 [2]                       (start, end): pages are taken at `start`, recycled at `end`;
                                              both only grow, so free = end - start and the index is mod N
  page_table  int32 [max_seqs + 1, L, H, P + 1]  bidirectional, per (sequence slot, layer, KV head): high-
                                              precision pages from the left (column c holds high tokens
                                              [c*T_hi, (c+1)*T_hi)), low-precision pages from the right
                                              (column P-1-c holds low tokens [c*T_lo, (c+1)*T_lo)); column P
                                              is a trash cell, row max_seqs a dummy slot (padded graph rows)
  held_high/held_low int32 [max_seqs + 1, L, H]  pages each side of each head holds
  len_high/len_low   int32 [max_seqs + 1, L, H]  tokens in each section
  low_armed          int32 [max_seqs + 1, L, H]  1 where the head's last decode plan let an empty low section open
                                              a page next step (compression_plan's lazy rule, new_low_armed)

Allocation and recycling for every (sequence, layer, head) of a step are one batched operation: each
head states its demand, an exclusive prefix sum gives each a disjoint range of the circular list, and
every head reads (or writes) its page ids in parallel. Masked-out lanes write to the trash cells, so
nothing needs a host round trip or a data-dependent shape. Host-side bookkeeping is O(requests).
Prefix-cache blocks are diffkv_serve/engine/kv/prefix_blocks.py's, the invariants tests check diffkv_serve/engine/kv/invariants.py's.
"""
from __future__ import annotations

from typing import Optional

import torch

from diffkv_serve.engine.host_copy import to_device
from diffkv_serve.engine.kv import invariants
from diffkv_serve.engine.kv.layout import CacheShape, cdiv
from diffkv_serve.engine.kv.prefix_blocks import PrefixBlocks
from diffkv_serve.engine.kv.reservation import worst_case_growth, worst_case_pages
from diffkv_serve.engine.kv.slots import SequenceSlots
from diffkv_serve.kernels.decode_pages import growth_bound
from diffkv_serve.kernels.page_alloc import grow_pages
from diffkv_serve.kernels.page_layout import PageFormat, PageState, page_bytes_for
from diffkv_serve.kernels.prompt_page_fit import fit_prompt_pages
from diffkv_serve.kernels.sections import section_targets


class MemoryManager(PrefixBlocks):
    def __init__(self, shape: CacheShape, num_pages: int, cache_dtype: torch.dtype, device: torch.device,
                 high: tuple[int, int] = (16, 16), low: Optional[tuple[int, int]] = None, float8: bool = False,
                 low_grows: bool = True, low_tracked: bool = True):
        """float8: the high precision's 8-bit sides hold e4m3 codes (kv_mode fp8). low_grows: the policy can
        put tokens in the low section (False for the budget policy, which keeps every kept token high): when
        it cannot, prompts reserve no low page and decode steps count no low growth. Pages carry each token's
        score and position exactly when there is a low precision (CacheConfig.tracks_tokens: a diffkv cache); low
        pages carry them only where low_tracked (CacheConfig.tracks_low_tokens: something may prune a low token)."""
        if num_pages < 1:
            raise ValueError(f"num_pages={num_pages}: the page pool needs at least one page")
        self.shape = shape
        self.device = torch.device(device)
        self.cache_dtype = cache_dtype
        itemsize = torch.tensor([], dtype=cache_dtype).element_size()
        self.tracked = low is not None
        self.page_bytes = page_bytes_for(shape.block_size, shape.head_dim, itemsize, self.tracked)
        self.fmt_high = PageFormat.make(*high, shape.head_dim, self.page_bytes, itemsize, float8=float8,
                                        tracked=self.tracked)
        self.fmt_low = PageFormat.make(*low, shape.head_dim, self.page_bytes, itemsize,
                                       tracked=low_tracked) if low else None
        if self.fmt_low is not None and self.fmt_low.tokens < self.fmt_high.tokens:
            raise ValueError(f"low precision {self.fmt_low.name} must hold at least as many tokens per page as "
                             f"high precision {self.fmt_high.name}")
        self.num_pages = num_pages
        # A prompt reserves its all-high worst case; its low pages come out of that reservation, and rounding
        # both sections up to whole pages can need one page more (fit_prompt_plan): the reservation counts it.
        self.low_grows = self.fmt_low is not None and low_grows
        self.extra_prompt_pages = 1 if self.low_grows else 0
        self.max_pages = cdiv(shape.max_model_len, self.fmt_high.tokens) + self.extra_prompt_pages
        L, H, S, P = shape.num_layers, shape.num_kv_heads, shape.max_seqs, self.max_pages
        dev = self.device
        self.pool = torch.empty(num_pages, self.page_bytes, dtype=torch.uint8, device=dev)
        self.free_list = torch.empty(num_pages + 1, dtype=torch.int32, device=dev)
        self.free_list[:num_pages] = torch.arange(num_pages, dtype=torch.int32, device=dev)
        # The free list's (start, end) and, for two-sided pools, each slot's next decode growth (note_growth), side
        # by side: the scheduler reads both in one copy per step (step_view), with no launch of its own.
        self._step_state = torch.zeros(2 + S + 1, dtype=torch.int64, device=dev)
        self.counters = self._step_state[:2]
        self.counters[1] = num_pages
        self.next_growth = self._step_state[2:]  # [S + 1]: decode_growth as of the slot's last step
        # Async scheduling reads the step state as a decode step's memory work left it (snapshot_step_state), in
        # a copy that completes early in the step, instead of a read that waits for the whole step.
        cuda = dev.type == "cuda"
        self._view_host = torch.zeros(2 + S + 1, dtype=torch.int64, pin_memory=cuda)
        self._view_event = torch.cuda.Event() if cuda else None
        self._view_ready = False
        self.dummy_slot = S
        self.page_table = torch.full((S + 1, L, H, P + 1), -1, dtype=torch.int32, device=dev)
        zeros = lambda: torch.zeros(S + 1, L, H, dtype=torch.int32, device=dev)  # noqa: E731
        self.held_high, self.held_low, self.len_high, self.len_low = zeros(), zeros(), zeros(), zeros()
        self.low_armed = zeros()
        self._slots = SequenceSlots(S)
        self._cols = torch.arange(P, device=dev, dtype=torch.int32)
        self._init_prefix_blocks()

    @property
    def page_state(self) -> PageState:
        """The device tensors a decode step updates (diffkv_serve/kernels/decode_pages.py)."""
        return PageState(self.pool, self.page_table, self.held_high, self.held_low, self.len_high, self.len_low,
                         self.free_list, self.counters, self.next_growth, self.low_armed)

    # Single-precision names used by the fp16 path and the kernels' first arguments.
    @property
    def fmt(self) -> PageFormat:
        return self.fmt_high

    @property
    def lengths(self) -> torch.Tensor:
        return self.len_high

    @property
    def held(self) -> torch.Tensor:
        return self.held_high

    @property
    def heads_per_seq(self) -> int:
        return self.shape.num_layers * self.shape.num_kv_heads

    def pages_for_tokens(self, num_tokens: int) -> int:
        """Worst case (all high precision) pages of one sequence of num_tokens tokens, all heads."""
        return worst_case_pages(self.heads_per_seq, self.fmt_high.tokens, self.extra_prompt_pages, num_tokens)

    def pages_to_grow(self, old_len: int, new_len: int) -> int:
        """Worst-case new pages a sequence needs to grow from old_len to new_len cached tokens."""
        return worst_case_growth(self.heads_per_seq, self.fmt_high.tokens, self.extra_prompt_pages,
                                 self.fmt_low is not None, old_len, new_len)

    def free_pages(self) -> int:
        """Free pages on the device (one host sync)."""
        start, end = self.counters.tolist()
        return end - start

    def snapshot_step_state(self) -> None:
        """Copy the free list's counters and next_growth to the host without waiting (async scheduling: called
        between a decode step's memory work and its forward). The scheduler's next planning read uses it."""
        self._view_host.copy_(self._step_state, non_blocking=True)
        if self._view_event is not None:
            self._view_event.record()
        self._view_ready = True

    def _planning_state(self) -> list[int]:
        """The step state for the scheduler's plan: the pending snapshot if there is one (it waits only for the
        step's memory work; frees enqueued after it are missing, so free pages are under- never overstated),
        else a fresh read."""
        if not self._view_ready:
            return self._step_state.tolist()
        self._view_ready = False
        if self._view_event is not None:
            self._view_event.synchronize()
        return self._view_host.tolist()

    def planning_free_pages(self) -> int:
        """Free pages for the scheduler's once-per-step plan (see _planning_state)."""
        state = self._planning_state()
        return state[1] - state[0]

    def decode_growth(self, slots: torch.Tensor) -> torch.Tensor:
        """Most pages each sequence's next decode step can take (int64 [B], on the device): a head needs a
        page only on a side whose section is full, and at most one (the new token goes high; only a token
        leaving high can go low). An empty low section is full only where the head's last plan armed it: the
        lazy low rule (compression_plan) opens it no earlier than the step after the plan that armed it."""
        return growth_bound(self.page_state, slots, self.fmt_high.tokens,
                            self.fmt_low.tokens if self.fmt_low is not None else 0, self.low_grows)

    @property
    def two_sided(self) -> bool:
        """diffkv: heads grow high and low sections (a step's worst case, a page per head, is far from its
        exact need: the scheduler reads that with step_view)."""
        return self.fmt_low is not None

    def note_growth(self, slots: torch.Tensor) -> None:
        """Two-sided pools: record decode_growth of these slots after a prefill changed their sections, for
        step_view to read (a decode step records it in its own kernel: diffkv_serve/kernels/decode_pages.py)."""
        self.next_growth[slots] = self.decode_growth(slots)

    def step_view(self, slots: list[int]) -> tuple[int, list[int]]:
        """Free pages and decode_growth of these slots, in one host sync (the scheduler's per-step read)."""
        if self.two_sided:  # kept up to date by note_growth: one copy, no launch
            state = self._planning_state()
            return state[1] - state[0], [state[2 + s] for s in slots]
        self._view_ready = False
        s = to_device(slots, torch.int64, self.device)
        flat = torch.cat([self.decode_growth(s), self.counters[1:] - self.counters[:1]]).tolist()
        return flat[-1], flat[:-1]

    def pages_held(self, slot: int) -> int:
        """Pages one sequence holds on both sides of all its heads (one device read); prefix-cache pages it
        reads are the cache's, not its own."""
        return int((self.held_high[slot] + self.held_low[slot]).sum()) - self.shared_cols[slot] * self.heads_per_seq

    def page_rules(self) -> dict:
        """What the driver's tensor-parallel page view (engine.kv.distributed) needs of this rank's pool."""
        return {"num_pages": self.num_pages, "page_bytes": self.page_bytes, "heads_per_seq": self.heads_per_seq,
                "tokens_high": self.fmt_high.tokens, "extra_prompt_pages": self.extra_prompt_pages,
                "two_sided": self.two_sided, "max_seqs": self.shape.max_seqs,
                "prefix_block_tokens": self.prefix_block_tokens, "max_prefix_blocks": self.max_prefix_blocks}

    # ---- slots (host side, O(requests)) --------------------------------------------------------------
    def alloc_slot(self) -> int:
        return self._slots.alloc()

    @property
    def num_free_slots(self) -> int:
        return len(self._slots)

    def slots_in_use(self) -> set[int]:
        return self._slots.in_use()

    # ---- batched allocation ------------------------------------------------------------------------
    def grow(self, slots: torch.Tensor, need_high: torch.Tensor, need_low: torch.Tensor, max_new_pages: int,
             layer: Optional[int] = None) -> None:
        """Give every (slot, layer, head) need_high more pages on its left and need_low on its right.

        slots int [B]; need_* int [B, L, H] >= 0 ([B, H] for one `layer`); max_new_pages: host bound on
        need_high + need_low of any head.
        """
        at = slots if layer is None else (slots, layer)
        grow_pages(self.page_table, self.held_high, self.held_low, self.free_list, self.counters, self.num_pages,
                   at, need_high, need_low, max_new_pages)

    def reserve(self, slots: torch.Tensor, new_lens: torch.Tensor, max_new_pages: int) -> None:
        """Grow every head's high side to hold new_lens[b] tokens at high precision (the prompt's worst case)."""
        need_high = (cdiv(new_lens, self.fmt_high.tokens).view(-1, 1, 1) - self.held_high[slots]).clamp_min(0)
        need_high = need_high.to(torch.int32)
        self.grow(slots, need_high, torch.zeros_like(need_high), max_new_pages)

    def fit_prompt_plan(self, slots: torch.Tensor, layer: int, n_high: torch.Tensor, n_low: torch.Tensor) -> None:
        """n_high, n_low: [B, H] section sizes one layer's heads plan for their prompt. Rounding both sections of
        a head up to whole pages can need one page more than its all-high reservation; such heads get that page
        now (one launch on the GPU, diffkv_serve/kernels/prompt_page_fit.py), before their tokens are written."""
        fit_prompt_pages(self.page_table, self.held_high, self.free_list, self.counters, slots, layer,
                         n_high.contiguous(), n_low.contiguous(), self.fmt_high.tokens, self.fmt_low.tokens,
                         self.num_pages)

    def alloc_prompt_layer(self, slots: torch.Tensor, layer: int, n_high: torch.Tensor, n_low: torch.Tensor,
                           overflow: torch.Tensor, max_new_pages: int) -> None:
        """Learned reservation (no all-high reservation): grow each head of this layer to its plan, n_high
        tokens on the left and n_low on the right ([B, H]), in batch order while the free list lasts.

        A sequence whose pages do not fit (or that overflowed in an earlier layer) gets none and is flagged
        in overflow (bool [B], updated in place): the device never hands out a page that is not free, and
        the host learns of it after the forward, in the sync it makes anyway (no per-layer round trip).
        """
        at = (slots, layer)
        need_h = (cdiv(n_high, self.fmt_high.tokens) - self.held_high[at]).clamp_min(0)
        need_l = (cdiv(n_low, self.fmt_low.tokens) - self.held_low[at]).clamp_min(0)
        per_seq = (need_h + need_l).sum(1, dtype=torch.int64) * (~overflow)
        fits = ~overflow & (torch.cumsum(per_seq, 0) <= self.counters[1] - self.counters[0])
        overflow |= ~fits
        keep = fits.to(torch.int32).unsqueeze(1)
        self.grow(slots, (need_h * keep).to(torch.int32), (need_l * keep).to(torch.int32), max_new_pages, layer)

    def set_prompt_lengths(self, slots: torch.Tensor, n_high: torch.Tensor, n_low: torch.Tensor,
                           overflow: torch.Tensor) -> None:
        """After an alloc_prompt_layer prefill: section lengths of the sequences that fit (an overflowed
        one keeps length 0 until the scheduler frees it)."""
        ok = (~overflow).view(-1, 1, 1)
        self.len_high[slots] = torch.where(ok, n_high.to(torch.int32), self.len_high[slots])
        self.len_low[slots] = torch.where(ok, n_low.to(torch.int32), self.len_low[slots])
        self.note_growth(slots)

    def set_lengths(self, slots: torch.Tensor, lens: torch.Tensor) -> None:
        self.len_high[slots] = lens.view(-1, 1, 1).to(torch.int32).expand(-1, *self.len_high.shape[1:])

    # ---- where tokens live -------------------------------------------------------------------------
    def high_targets(self, slots: torch.Tensor, idx: torch.Tensor, layer: Optional[int] = None):
        """Page and row of high-section index idx (-1: none). slots [B]; idx [B, L, H] or [B, H] with layer."""
        return self._targets(slots, idx, layer, self.fmt_high.tokens, from_right=None)

    def low_targets(self, slots: torch.Tensor, idx: torch.Tensor, layer: Optional[int] = None,
                    right_of: Optional[torch.Tensor] = None):
        """Page and row of low-section index idx. During a prompt (before finish_prompt) the low pages are
        still inside the high reservation: pass right_of = held_high there (page c sits at column R-1-c)."""
        return self._targets(slots, idx, layer, self.fmt_low.tokens,
                             from_right=right_of if right_of is not None else self.max_pages)

    def _targets(self, slots, idx, layer, T, from_right):
        return section_targets(self.page_table, slots, idx, T, layer, from_right)

    def write_targets(self, token_slots: torch.Tensor, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Single-precision prefill: page and row of each new token for every (layer, head), [L, N, H]."""
        T = self.fmt_high.tokens
        cols = (positions // T).to(torch.int64)
        pages = self.page_table[token_slots, :, :, :].gather(
            3, cols.view(-1, 1, 1, 1).expand(-1, *self.page_table.shape[1:3], 1)).squeeze(3)  # [N, L, H]
        rows = (positions % T).to(torch.int32).view(-1, 1, 1).expand_as(pages)
        return pages.permute(1, 0, 2).contiguous(), rows.permute(1, 0, 2).contiguous()

    # ---- prompt planning: keep what each head needs, recycle the rest ---------------------------------
    def finish_prompt(self, slots: torch.Tensor, n_high: torch.Tensor, n_low: torch.Tensor) -> None:
        """After a prefill that reserved all-high pages: each head keeps ceil(n_high/T_hi) high pages from
        the left of its reservation and ceil(n_low/T_lo) low pages from its right end (moved to the right
        side of the page table); the pages between go back to the free list in one batched recycle."""
        P = self.max_pages
        R = self.held_high[slots].to(torch.int64)  # [B, L, H]
        h = cdiv(n_high.to(torch.int64), self.fmt_high.tokens)
        lo = cdiv(n_low.to(torch.int64), self.fmt_low.tokens) if self.fmt_low else torch.zeros_like(h)
        rows = self.page_table[slots][..., :P]  # [B, L, H, P] copy
        cols = self._cols.to(torch.int64)
        # Right side column j holds low page c = P-1-j, taken from reservation column R-1-c.
        c = P - 1 - cols
        src = (R.unsqueeze(-1) - 1 - c).clamp(0, P - 1)
        low_part = rows.gather(-1, src)
        keep_left = cols < h.unsqueeze(-1)
        keep_right = c < lo.unsqueeze(-1)
        new_rows = torch.where(keep_left, rows, torch.where(keep_right, low_part, torch.full_like(rows, -1)))
        # Recycle reservation columns [h, R - lo).
        drop = (cols >= h.unsqueeze(-1)) & (cols < (R - lo).unsqueeze(-1))
        self._recycle(rows.view(-1, P), drop.view(-1, P))
        full = self.page_table[slots]
        full[..., :P] = new_rows
        self.page_table[slots] = full
        self.held_high[slots] = h.to(torch.int32)
        self.held_low[slots] = lo.to(torch.int32)
        self.len_high[slots] = n_high.to(torch.int32)
        self.len_low[slots] = n_low.to(torch.int32)
        if self.two_sided:
            self.note_growth(slots)

    # ---- batched recycling -------------------------------------------------------------------------
    def _recycle(self, pages: torch.Tensor, mask: torch.Tensor) -> None:
        """Append pages[mask] ([rows, P]) to the free list: prefix sum over rows, in-row order by column."""
        count = mask.sum(1)
        offsets = torch.cumsum(count, 0) - count
        within = torch.cumsum(mask.to(torch.int64), 1) - 1
        idx = (self.counters[1] + offsets.unsqueeze(1) + within) % self.num_pages
        idx = torch.where(mask, idx, torch.full_like(idx, self.num_pages))  # masked -> trash cell
        self.free_list.scatter_(0, idx.flatten(), pages.flatten())
        self.counters[1] += count.sum()

    def free(self, slots: list[int]) -> None:
        """Return every page of these sequence slots to the free list and release the slots."""
        if not slots:
            return
        P = self.max_pages
        s = to_device(slots, torch.int64, self.device)
        hh = self.held_high[s].flatten().unsqueeze(1)
        hl = self.held_low[s].flatten().unsqueeze(1)
        # Columns [0, shared) point at prefix-cache pages: the cache recycles them when it evicts the block.
        shared = to_device([self.shared_cols[x] for x in slots], torch.int64, self.device)
        shared = shared.repeat_interleave(self.heads_per_seq).unsqueeze(1)
        cols = self._cols.unsqueeze(0)
        mask = ((cols >= shared) & (cols < hh)) | (cols >= P - hl)
        self._recycle(self.page_table[s][..., :P].reshape(-1, P), mask)
        for x in slots:
            self.shared_cols[x] = 0
        self.page_table[s] = -1
        for t in (self.held_high, self.held_low, self.len_high, self.len_low, self.low_armed):
            t[s] = 0
        self._slots.release(slots)

    def check_invariants(self, live_slots: Optional[list[int]] = None,
                         refcounts: Optional[dict[int, int]] = None) -> None:
        """Tests: diffkv_serve/engine/kv/invariants.py's check_pool (asserts)."""
        invariants.check_pool(self, live_slots, refcounts)
