"""CUDA graphs for decode steps: the forward of a padded batch is captured once per bucket size and
replayed, so a step costs a few launches instead of one per operator (the decode step is launch-bound
at small batch otherwise).

Static buffers hold the step's inputs. Padding rows point at a reserved dummy sequence slot whose
heads have length 0 and at page -1 (the KV write skips them), so they read and write nothing. The
decode kernel is captured with max_len = max_model_len, which fixes its split count for any length.
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
        dev = mm.device
        L, H = mm.shape.num_layers, mm.shape.num_kv_heads
        self.ids = torch.zeros(max_batch, dtype=torch.int64, device=dev)
        self.positions = torch.zeros(max_batch, dtype=torch.int32, device=dev)
        self.slots = torch.full((max_batch,), mm.dummy_slot, dtype=torch.int32, device=dev)
        self.dst_page = torch.full((L, max_batch, H), -1, dtype=torch.int32, device=dev)
        self.dst_row = torch.zeros((L, max_batch, H), dtype=torch.int32, device=dev)
        self.graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self.logits: dict[int, torch.Tensor] = {}
        self.pool = None

    def bucket(self, n: int) -> int:
        return next(b for b in self.buckets if b >= n)

    def _meta(self, b: int) -> StepMetadata:
        return StepMetadata(False, self.positions[:b], self.dst_page[:, :b], self.dst_row[:, :b], self.slots[:b],
                            self.max_model_len)

    def _forward(self, b: int) -> torch.Tensor:
        self.attn.meta = self._meta(b)
        hidden = self.model(self.ids[:b], self.positions[:b].long(), self.attn)
        return self.model.logits(hidden)

    def _capture(self, b: int) -> None:
        side = torch.cuda.Stream(self.mm.device)
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
        """Inputs of n <= max_batch sequences (device tensors) -> logits [n, V]."""
        n = ids.shape[0]
        b = self.bucket(n)
        self.ids[:n].copy_(ids)
        self.positions[:n].copy_(positions)
        self.slots[:n].copy_(slots)
        self.dst_page[:, :n].copy_(dst_page)
        self.dst_row[:, :n].copy_(dst_row)
        if b > n:
            self.positions[n:b].zero_()
            self.slots[n:b].fill_(self.mm.dummy_slot)
            self.dst_page[:, n:b].fill_(-1)
        if b not in self.graphs:
            self._capture(b)
        self.graphs[b].replay()
        return self.logits[b][:n]
