"""Cost-category ranges for step profiling (benchmarks/step_breakdown.py).

`with cost_range("memory"):` marks host code whose device work belongs to one category; under torch.profiler
it is a record_function range named "diffkv::memory", and the kernels launched inside it (CUDA-graph replays
included) are attributed to it. Without a profiler it is a null context: one flag check, because an idle
record_function still costs microseconds, which would add up over the layers of a decode step.
"""
from __future__ import annotations

import functools
from contextlib import nullcontext
from typing import Callable, ContextManager, TypeVar

import torch

PREFIX = "diffkv::"
# The engine's share of a step, by what its work is for (the benchmark's table maps kernel names onto the same).
CATEGORIES = ("model", "attention", "policy", "memory")
F = TypeVar("F", bound=Callable)


def cost_range(category: str) -> ContextManager:
    if category not in CATEGORIES:
        raise ValueError(f"unknown cost category {category!r}; expected one of {CATEGORIES}")
    if not torch.autograd._profiler_enabled():
        return nullcontext()
    return torch.profiler.record_function(PREFIX + category)


def costed(category: str) -> Callable[[F], F]:
    """A method whose whole call is one cost range (a range opened inside it still wins: innermost counts)."""
    def wrap(fn: F) -> F:
        @functools.wraps(fn)
        def ranged(*args, **kwargs):
            with cost_range(category):
                return fn(*args, **kwargs)
        return ranged  # type: ignore[return-value]
    return wrap
