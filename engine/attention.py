"""Attention over the paged KV cache for one engine step: writes the step's K/V into their pages, then
runs the prefill kernel (fresh prompts) or the paged decode kernel (one new token per sequence)."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch

from engine.memory import MemoryManager
from kernels.decode_attention import paged_decode_attention
from kernels.kv_write import write_kv
from kernels.prefill_attention import prefill_attention


@dataclass
class StepMetadata:
    is_prefill: bool
    positions: torch.Tensor  # int32 [N]
    dst_page: torch.Tensor  # int32 [L, N, H]
    dst_row: torch.Tensor  # int32 [L, N, H]
    slots: torch.Tensor  # int32 [B]
    max_len: int  # longest sequence in the step (host value: no device sync in the kernels)
    cu_seqlens: Optional[torch.Tensor] = None  # int32 [B + 1], prefill only


class PagedAttention:
    def __init__(self, mm: MemoryManager, scale: float):
        self.mm = mm
        self.scale = scale
        self.meta: Optional[StepMetadata] = None

    def __call__(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        m, mm = self.meta, self.mm
        write_kv(mm.pool, mm.fmt, mm.cache_dtype, k, v, m.dst_page[layer], m.dst_row[layer], m.positions)
        if m.is_prefill:
            # With recompute-preemption and no prefix sharing a prefill always starts from an empty cache,
            # so it attends over the fresh K/V alone.
            return prefill_attention(q, k, v, m.cu_seqlens, m.max_len, self.scale)
        return paged_decode_attention(q, mm.pool, mm.fmt, mm.cache_dtype, mm.page_table, mm.lengths,
                                      m.slots, layer, self.scale, max_len=m.max_len)
