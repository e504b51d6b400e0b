"""CUDA graphs for decode steps: the forward and logits of a padded batch are captured once per bucket
size and replayed, so a decode step costs one graph launch instead of one launch per operator (it is
launch-bound at small batch otherwise). Memory management runs before it, eagerly and batched.

Static buffers hold the step's inputs. Padding rows point at the memory manager's dummy slot (every
section empty) and at page -1 (the KV write skips them), so they read and write nothing. Capture runs
with every row padded, because the captured step is not idempotent (it adds attention to token scores);
the real inputs are copied in afterwards. The decode kernel is captured with max_len = max_model_len,
which fixes its split count for every length.
"""
from __future__ import annotations

import torch

from engine.attention import PagedAttention, StepMetadata
from engine.model import CausalLM


def graph_buckets(max_batch: int) -> list[int]:
    sizes = [b for b in (1, 2, 4, 8) if b < max_batch] + list(range(16, max_batch, 16))
    return sizes + [max_batch]


class DecodeGraphs:
    def __init__(self, model: CausalLM, attn: PagedAttention, max_batch: int, max_model_len: int):
        self.model, self.attn = model, attn
        mm = attn.kv.mm
        self.dummy = mm.dummy_slot
        self.max_batch, self.max_model_len = max_batch, max_model_len
        self.buckets = graph_buckets(max_batch)
        dev = mm.device
        L, H = mm.shape.num_layers, mm.shape.num_kv_heads
        self.ids = torch.zeros(max_batch, dtype=torch.int64, device=dev)
        self.positions = torch.zeros(max_batch, dtype=torch.int32, device=dev)
        self.slots = torch.full((max_batch,), self.dummy, dtype=torch.int32, device=dev)
        self.dst_page = torch.full((L, max_batch, H), -1, dtype=torch.int32, device=dev)
        self.dst_row = torch.zeros((L, max_batch, H), dtype=torch.int32, device=dev)
        self.graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self.logits: dict[int, torch.Tensor] = {}
        self.pool = None

    def bucket(self, n: int) -> int:
        return next(b for b in self.buckets if b >= n)

    def _pad(self, start: int, stop: int) -> None:
        self.ids[start:stop].zero_()
        self.positions[start:stop].zero_()
        self.slots[start:stop].fill_(self.dummy)
        self.dst_page[:, start:stop].fill_(-1)

    def _forward(self, b: int) -> torch.Tensor:
        self.attn.meta = StepMetadata(False, self.positions[:b], self.dst_page[:, :b], self.dst_row[:, :b],
                                      self.slots[:b], self.max_model_len)
        hidden = self.model(self.ids[:b], self.positions[:b].long(), self.attn)
        return self.model.logits(hidden)

    def _capture(self, b: int) -> None:
        self._pad(0, b)
        side = torch.cuda.Stream(self.ids.device)
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):  # warm up: Triton compiles, cuBLAS picks its kernels
            for _ in range(2):
                self._forward(b)
        torch.cuda.current_stream().wait_stream(side)
        g = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g, pool=self.pool):
            self.logits[b] = self._forward(b)
        self.pool = g.pool()
        self.graphs[b] = g

    def run(self, ids: torch.Tensor, positions: torch.Tensor, slots: torch.Tensor, dst_page: torch.Tensor,
            dst_row: torch.Tensor) -> torch.Tensor:
        """One decode step of n <= max_batch sequences (device tensors) -> logits [n, V]."""
        n = ids.shape[0]
        b = self.bucket(n)
        if b not in self.graphs:
            self._capture(b)
        self.ids[:n].copy_(ids)
        self.positions[:n].copy_(positions)
        self.slots[:n].copy_(slots)
        self.dst_page[:, :n].copy_(dst_page)
        self.dst_row[:, :n].copy_(dst_row)
        if b > n:
            self._pad(n, b)
        self.graphs[b].replay()
        return self.logits[b][:n]
