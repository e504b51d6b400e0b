"""Tensor-parallel context: which shard this process owns and how partial sums are combined.

With world_size 1 every collective is the identity, so the model code is the same on one device and
on N ranks (Megatron-style: heads and MLP columns are split, row-parallel outputs are all-reduced).
"""
from __future__ import annotations

from dataclasses import dataclass

import torch


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

    def shard(self, n: int, what: str) -> tuple[int, int]:
        """[start, end) of this rank's share of n units (heads, columns)."""
        if n % self.world_size:
            raise ValueError(f"{what}={n} is not divisible by tensor_parallel_size={self.world_size}")
        per = n // self.world_size
        return self.rank * per, (self.rank + 1) * per


SINGLE = ParallelContext()
