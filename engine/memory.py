"""On-device KV memory manager (DESIGN.md "Memory manager").

All state lives on the model's device:
  pool        uint8 [num_pages, page_bytes]   unified pages shared by every layer, head and precision
  free_list   int32 [num_pages + 1]           circular list of free page ids (+1 trash cell for masked writes)
  counters    int64 [2]                       (start, end): pages are taken at `start`, recycled at `end`;
                                              both only grow, so free = end - start and the index is mod N
  page_table  int32 [max_seqs + 1, L, H, P + 1]  per (sequence slot, layer, KV head); column P is a trash
                                              cell, row max_seqs a dummy slot for padded CUDA-graph rows
  held        int32 [max_seqs + 1, L, H]      pages each head holds (left side)
  lengths     int32 [max_seqs + 1, L, H]      cached tokens per head

Allocation and recycling for every (sequence, layer, head) of a step are one batched operation: each
head states its demand, an exclusive prefix sum gives each a disjoint range of the circular list, and
every head reads (or writes) its page ids in parallel. Masked-out lanes write to the trash cells, so
nothing needs a host round trip or a data-dependent shape. Host-side bookkeeping is O(requests).
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from kernels.page_layout import PageFormat, page_bytes_for


@dataclass(frozen=True)
class CacheShape:
    num_layers: int
    num_kv_heads: int
    head_dim: int
    max_seqs: int
    max_model_len: int
    block_size: int  # tokens per full-precision page


class MemoryManager:
    def __init__(self, shape: CacheShape, num_pages: int, cache_dtype: torch.dtype, device: torch.device):
        if num_pages < 1:
            raise ValueError(f"num_pages={num_pages}: the page pool needs at least one page")
        self.shape = shape
        self.device = torch.device(device)
        self.cache_dtype = cache_dtype
        itemsize = torch.tensor([], dtype=cache_dtype).element_size()
        self.page_bytes = page_bytes_for(shape.block_size, shape.head_dim, itemsize)
        self.fmt = PageFormat.make(16, 16, shape.head_dim, self.page_bytes, itemsize)
        self.num_pages = num_pages
        self.max_pages = -(-shape.max_model_len // self.fmt.tokens)
        L, H, S, P = shape.num_layers, shape.num_kv_heads, shape.max_seqs, self.max_pages
        dev = self.device
        self.pool = torch.empty(num_pages, self.page_bytes, dtype=torch.uint8, device=dev)
        self.free_list = torch.empty(num_pages + 1, dtype=torch.int32, device=dev)
        self.free_list[:num_pages] = torch.arange(num_pages, dtype=torch.int32, device=dev)
        self.counters = torch.tensor([0, num_pages], dtype=torch.int64, device=dev)
        # Row S is a dummy slot that is never handed out: padding rows of a CUDA-graph batch point at it.
        self.dummy_slot = S
        self.page_table = torch.full((S + 1, L, H, P + 1), -1, dtype=torch.int32, device=dev)
        self.held = torch.zeros(S + 1, L, H, dtype=torch.int32, device=dev)
        self.lengths = torch.zeros(S + 1, L, H, dtype=torch.int32, device=dev)
        self._free_slots = list(range(S - 1, -1, -1))
        self._cols = torch.arange(P, device=dev, dtype=torch.int32)

    # ---- sizes -------------------------------------------------------------------------------------
    @staticmethod
    def pages_for_bytes(shape: CacheShape, cache_dtype: torch.dtype, nbytes: float) -> int:
        itemsize = torch.tensor([], dtype=cache_dtype).element_size()
        return max(1, int(nbytes // page_bytes_for(shape.block_size, shape.head_dim, itemsize)))

    @property
    def heads_per_seq(self) -> int:
        return self.shape.num_layers * self.shape.num_kv_heads

    def pages_for_tokens(self, num_tokens: int) -> int:
        """Pages one sequence of `num_tokens` tokens holds across all its (layer, head) pairs."""
        return self.heads_per_seq * -(-num_tokens // self.fmt.tokens)

    def pages_to_grow(self, old_len: int, new_len: int) -> int:
        """Worst-case new pages a sequence needs to grow from old_len to new_len cached tokens."""
        return self.pages_for_tokens(new_len) - self.pages_for_tokens(old_len)

    def free_pages(self) -> int:
        """Free pages on the device (one host sync; the scheduler calls it once per step)."""
        start, end = self.counters.tolist()
        return end - start

    # ---- slots (host side, O(requests)) --------------------------------------------------------------
    def alloc_slot(self) -> int:
        if not self._free_slots:
            raise RuntimeError("no free sequence slot: the scheduler admitted more than max_seqs")
        return self._free_slots.pop()

    @property
    def num_free_slots(self) -> int:
        return len(self._free_slots)

    # ---- batched allocation ------------------------------------------------------------------------
    def reserve(self, slots: torch.Tensor, new_lens: torch.Tensor, max_new_pages: int) -> None:
        """Grow every (slot, layer, head) so it can hold new_lens[b] tokens, in one batched operation.

        slots, new_lens: int32 [B] on the device. max_new_pages: host bound on any head's demand.
        """
        if max_new_pages <= 0:
            return
        T = self.fmt.tokens
        held = self.held[slots]  # [B, L, H]
        need = (-(-new_lens // T)).view(-1, 1, 1) - held
        need = need.clamp_min(0).to(torch.int32)
        flat = need.flatten()
        offsets = torch.cumsum(flat, 0) - flat  # exclusive prefix sum: each head's range in the list
        j = torch.arange(max_new_pages, device=self.device, dtype=torch.int64)
        valid = j < flat.unsqueeze(1)  # [BLH, m]
        idx = (self.counters[0] + offsets.unsqueeze(1) + j) % self.num_pages
        pages = self.free_list[idx]
        cols = held.flatten().unsqueeze(1).to(torch.int64) + j
        cols = torch.where(valid, cols, torch.full_like(cols, self.max_pages))  # invalid -> trash column
        L, H = self.shape.num_layers, self.shape.num_kv_heads
        rows = self.page_table[slots].view(-1, self.max_pages + 1)  # gathered copy
        rows.scatter_(1, cols, pages)
        self.page_table[slots] = rows.view(-1, L, H, self.max_pages + 1)
        self.held[slots] = held + need
        self.counters[0] += flat.sum()

    def set_lengths(self, slots: torch.Tensor, lens: torch.Tensor) -> None:
        self.lengths[slots] = lens.view(-1, 1, 1).to(torch.int32).expand(-1, *self.lengths.shape[1:])

    def write_targets(self, token_slots: torch.Tensor, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Page and row of each new token for every (layer, head): two int32 tensors [L, N, H]."""
        T = self.fmt.tokens
        cols = (positions // T).to(torch.int64)
        pages = self.page_table[token_slots, :, :, :].gather(
            3, cols.view(-1, 1, 1, 1).expand(-1, *self.page_table.shape[1:3], 1)).squeeze(3)  # [N, L, H]
        rows = (positions % T).to(torch.int32).view(-1, 1, 1).expand_as(pages)
        return pages.permute(1, 0, 2).contiguous(), rows.permute(1, 0, 2).contiguous()

    # ---- batched recycling -------------------------------------------------------------------------
    def free(self, slots: list[int]) -> None:
        """Return every page of these sequence slots to the free list and release the slots."""
        if not slots:
            return
        s = torch.tensor(slots, dtype=torch.int64, device=self.device)
        held = self.held[s].flatten()  # [BLH]
        offsets = torch.cumsum(held, 0) - held
        valid = self._cols.unsqueeze(0) < held.unsqueeze(1)  # [BLH, P]
        pages = self.page_table[s][..., : self.max_pages].reshape(-1, self.max_pages)
        idx = (self.counters[1] + offsets.unsqueeze(1) + self._cols) % self.num_pages
        idx = torch.where(valid, idx, torch.full_like(idx, self.num_pages))  # invalid -> trash cell
        self.free_list.scatter_(0, idx.flatten(), pages.flatten())
        self.counters[1] += held.sum()
        self.page_table[s] = -1
        self.held[s] = 0
        self.lengths[s] = 0
        self._free_slots.extend(slots)

    # ---- invariant (tests) ---------------------------------------------------------------------------
    def check_invariants(self, live_slots: list[int] | None = None) -> None:
        """Every page is either free exactly once or held by exactly one (slot, layer, head, column)."""
        start, end = self.counters.tolist()
        n = self.num_pages
        assert 0 <= end - start <= n, f"free count {end - start} outside [0, {n}]"
        fl = self.free_list[:n].cpu()
        free_ids = [int(fl[(start + i) % n]) for i in range(end - start)]
        held = self.held.cpu()
        pt = self.page_table.cpu()[..., : self.max_pages]
        mask = torch.arange(self.max_pages).view(1, 1, 1, -1) < held.unsqueeze(-1)
        used_ids = pt[mask].tolist()
        assert all(0 <= p < n for p in used_ids), "page table points outside the pool"
        seen = free_ids + used_ids
        assert len(seen) == n and len(set(seen)) == n, (
            f"pages lost or duplicated: {len(free_ids)} free + {len(used_ids)} held, "
            f"{len(set(seen))} distinct of {n}")
        assert not set(free_ids) & set(used_ids), "a page table points at a free page"
        if live_slots is not None:
            busy = set(range(self.shape.max_seqs)) - set(self._free_slots)
            assert busy == set(live_slots), f"slots in use {sorted(busy)} != live sequences {sorted(live_slots)}"
