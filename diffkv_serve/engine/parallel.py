"""Tensor-parallel context: which shard this process owns and how partial sums are combined.

With world_size 1 every collective is the identity, so the model code is the same on one device and
on N ranks (Megatron-style: heads and MLP columns are split, row-parallel outputs are all-reduced).

Heads are split by whole KV groups (a KV head and the query heads that read it), as evenly as possible:
SmolLM2-135M (9 query heads, 3 KV heads) on 2 ranks gives rank 0 KV heads 0-1 (query heads 0-5) and
rank 1 KV head 2 (query heads 6-8). MLP columns are split as evenly as possible too.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from diffkv_serve.engine.model_config import ModelArch


def even_split(n: int, parts: int, index: int) -> tuple[int, int]:
    """[start, end) of part `index` when n units go to `parts` parts; the first n % parts get one more."""
    base, extra = divmod(n, parts)
    start = index * base + min(index, extra)
    return start, start + base + (index < extra)


def check_tensor_parallel(arch: ModelArch, tensor_parallel_size: int) -> None:
    """Refuse splits that leave a rank without a whole KV group (or without MLP columns)."""
    tp = tensor_parallel_size
    if tp < 1:
        raise ValueError(f"tensor_parallel_size={tp} must be at least 1")
    if arch.num_heads % arch.num_kv_heads:
        raise ValueError(f"num_heads={arch.num_heads} is not a multiple of num_kv_heads={arch.num_kv_heads}")
    if tp > arch.num_kv_heads:
        raise ValueError(
            f"tensor_parallel_size={tp} exceeds the model's {arch.num_kv_heads} KV heads: every rank needs at "
            f"least one whole KV group; use tensor_parallel_size <= {arch.num_kv_heads}")
    if tp > arch.intermediate_size:
        raise ValueError(f"tensor_parallel_size={tp} exceeds the model's intermediate_size={arch.intermediate_size}")


@dataclass(frozen=True)
class ParallelContext:
    rank: int = 0
    world_size: int = 1

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        if self.world_size == 1:
            return x
        import torch.distributed as dist

        dist.all_reduce(x)
        return x

    # ---- this rank's share -------------------------------------------------------------------------
    def kv_heads(self, arch: ModelArch) -> tuple[int, int]:
        """[start, end) of this rank's KV heads (whole KV groups)."""
        return even_split(arch.num_kv_heads, self.world_size, self.rank)

    def q_heads(self, arch: ModelArch) -> tuple[int, int]:
        """[start, end) of this rank's query heads: the ones reading its KV heads."""
        a, b = self.kv_heads(arch)
        return a * arch.group_size, b * arch.group_size

    def mlp_columns(self, arch: ModelArch) -> tuple[int, int]:
        return even_split(arch.intermediate_size, self.world_size, self.rank)

    def num_kv_heads(self, arch: ModelArch) -> int:
        a, b = self.kv_heads(arch)
        return b - a

    def num_heads(self, arch: ModelArch) -> int:
        a, b = self.q_heads(arch)
        return b - a


SINGLE = ParallelContext()
