"""Attention over the paged KV cache for one engine step: the layer's K/V go into their pages (quantized
and placed by the KV cache's policy), then the prefill kernel (fresh prompts) or the paged decode kernel
(one new token per sequence) computes the output."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch

from diffkv_serve.engine.kv.policy import CachedPrefix, KVCache, PrefillInfo
from diffkv_serve.engine.profiling import cost_range
from diffkv_serve.kernels.prefill_attention import prefill_attention


@dataclass
class StepMetadata:
    is_prefill: bool
    positions: torch.Tensor  # int32 [N]
    dst_page: torch.Tensor  # int32 [L, N, H]
    dst_row: torch.Tensor  # int32 [L, N, H]
    slots: torch.Tensor  # int32 [B]
    max_len: int  # longest sequence in the step (host value: no device sync in the kernels)
    cu_seqlens: Optional[torch.Tensor] = None  # int32 [B + 1], prefill only
    prefill: Optional[PrefillInfo] = None  # diffkv prefill only
    cached_prefix: Optional[CachedPrefix] = None  # prefill reading (or, diffkv, writing) prefix-cache blocks


class PagedAttention:
    def __init__(self, kv: KVCache, scale: float):
        self.kv = kv
        self.scale = scale
        self.meta: Optional[StepMetadata] = None

    def __call__(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        m = self.meta
        if m.is_prefill:
            k, v = self.kv.prefill_write(layer, q, k, v, m.positions, m.dst_page, m.dst_row, self.scale, m.prefill,
                                         m.max_len, m.cached_prefix)
            # A prefill attends over the fresh (unquantized) K/V of its computed tokens, after the cached
            # prefix blocks' K/V (read from their pages) when it has some.
            cu_k = None if m.cached_prefix is None else m.cached_prefix.cu_seqlens_k
            with cost_range("attention"):
                return prefill_attention(q, k, v, m.cu_seqlens, self.scale, cu_seqlens_k=cu_k)
        return self.kv.decode_attend(layer, q, k, v, m.positions, m.dst_page, m.dst_row, m.slots, self.scale,
                                     m.max_len)
