"""CUDA graphs for decode steps: page allocation, KV write targets, the forward and the logits of a
padded batch are captured once per bucket size and replayed, so a decode step costs one host-to-device
copy and one graph launch instead of one launch per operator (it is launch-bound at small batch).

Inputs live in one static int64 buffer [4, max_batch]: token ids, positions, sequence slots and new
lengths. Padding rows point at the memory manager's dummy slot with length 0: they allocate nothing,
their KV write targets are page -1 (skipped) and their attention reads no token. The decode kernel is
captured with max_len = max_model_len, which fixes its split count for every length.

Capturing is safe with live state because every captured memory operation is idempotent: `reserve`
allocates only the difference between a head's target length and what it holds, so the warm-up runs
and the replay together allocate exactly once.
"""
from __future__ import annotations

import torch

from engine.attention import PagedAttention, StepMetadata
from engine.memory import MemoryManager
from engine.model import CausalLM


def graph_buckets(max_batch: int) -> list[int]:
    sizes = [b for b in (1, 2, 4, 8) if b < max_batch] + list(range(16, max_batch, 16))
    return sizes + [max_batch]


class DecodeGraphs:
    def __init__(self, model: CausalLM, attn: PagedAttention, mm: MemoryManager, max_batch: int, max_model_len: int):
        self.model, self.attn, self.mm = model, attn, mm
        self.max_batch, self.max_model_len = max_batch, max_model_len
        self.buckets = graph_buckets(max_batch)
        self.inputs = torch.zeros(4, max_batch, dtype=torch.int64, device=mm.device)  # ids, pos, slot, new len
        self.graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self.logits: dict[int, torch.Tensor] = {}
        self.pool = None

    def bucket(self, n: int) -> int:
        return next(b for b in self.buckets if b >= n)

    def _step(self, b: int) -> torch.Tensor:
        mm = self.mm
        ids, pos, slots, lens = self.inputs[:, :b]
        pos32, slots32, lens32 = pos.int(), slots.int(), lens.int()
        mm.reserve(slots32, lens32, max_new_pages=1)  # a decode step adds one token: at most one page a head
        mm.set_lengths(slots32, lens32)
        dst_page, dst_row = mm.write_targets(slots, pos32)
        self.attn.meta = StepMetadata(False, pos32, dst_page, dst_row, slots32, self.max_model_len)
        return self.model.logits(self.model(ids, pos, self.attn))

    def _capture(self, b: int) -> None:
        side = torch.cuda.Stream(self.mm.device)
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):  # warm up: Triton compiles, cuBLAS picks its kernels
            for _ in range(2):
                self._step(b)
        torch.cuda.current_stream().wait_stream(side)
        g = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g, pool=self.pool):
            self.logits[b] = self._step(b)
        self.pool = g.pool()
        self.graphs[b] = g

    def run(self, ids: list[int], positions: list[int], slots: list[int], new_lens: list[int]) -> torch.Tensor:
        """One decode step for n <= max_batch sequences -> logits [n, V]."""
        n = len(ids)
        b = self.bucket(n)
        pad = b - n
        host = torch.tensor([ids + [0] * pad, positions + [0] * pad, slots + [self.mm.dummy_slot] * pad,
                             new_lens + [0] * pad], dtype=torch.int64).pin_memory()
        self.inputs[:, :b].copy_(host, non_blocking=True)
        if b not in self.graphs:
            self._capture(b)
        self.graphs[b].replay()
        return self.logits[b][:n]
