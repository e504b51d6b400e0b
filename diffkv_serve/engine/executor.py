"""Where an LLMEngine's model runs: in this process (one rank) or on Ray actors (one per tensor-parallel rank).

The engine (scheduler, sequences, detokenizing, stop checks) talks to one executor through this interface:

    mm                     the page pool the scheduler plans against (free_pages, alloc_slot, free, ...):
                           the rank's MemoryManager locally, a driver-side view of every rank's for Ray
    execute(batch)         run one step on every rank -> sampled tokens (+ logprobs) of rank 0
    launch(batch), collect(handle)
                           async scheduling (when async_steps): enqueue a decode step, later read its tokens
    prompt_logits(ids)     next-token logits after a prompt, through the serving path
    slot_usage(slot, n)    pages, high and low tokens one sequence of n cached tokens holds now, summed over ranks
    token_counts(slots, n) tokens kept high / low / pruned over running sequences, summed over ranks
    rank_stats()           per rank: pages_total, pages_used, last_mm_seconds
    make_generator(seed)   the sampling generator of a seeded request (on the sampling rank's device)
    finish_request(id)     a request is gone for good (its per-request state on the ranks can go)
    check_health()         raise EngineDeadError if a rank is gone
    shutdown()             release the ranks (idempotent)
"""
from __future__ import annotations

from abc import ABC, abstractmethod
from typing import Any, Optional

import torch

from diffkv_serve.engine.config import EngineConfig
from diffkv_serve.engine.kv.layout import cdiv
from diffkv_serve.engine.loader import LoadedCheckpoint
from diffkv_serve.engine.model_runner import Batch, InFlight, ModelRunner
from diffkv_serve.engine.sequence import Sequence


class Executor(ABC):
    world_size: int = 1
    mm: Any  # engine.scheduler.PagePool
    async_steps: bool = False  # launch/collect available (the engine then runs decode steps one ahead)

    @abstractmethod
    def execute(self, batch: Batch) -> tuple[list[int], Optional[list[float]]]: ...

    @abstractmethod
    def prompt_logits(self, prompt_token_ids: list[int]) -> torch.Tensor: ...

    @abstractmethod
    def slot_usage(self, slot: int, num_cached: int) -> tuple[int, int, int]: ...

    @abstractmethod
    def token_counts(self, slots: list[int], cached: int) -> dict[str, int]: ...

    @abstractmethod
    def rank_stats(self) -> list[dict[str, Any]]: ...

    @abstractmethod
    def make_generator(self, seed: int) -> Optional[torch.Generator]: ...

    def token_classes(self, slot: int, num_tokens: int) -> torch.Tensor:
        """int8 [L, H, num_tokens]: each token position high / low / pruned per (layer, KV head) (KVCache)."""
        raise NotImplementedError(f"{type(self).__name__} cannot report token classes (local executor only)")

    def finish_request(self, request_id: str) -> None:
        """Nothing to forget by default."""

    def check_health(self) -> None:
        """A process-local executor is alive while its process is."""

    @abstractmethod
    def shutdown(self) -> None: ...


class LocalExecutor(Executor):
    """One rank in this process: the ModelRunner runs the driver's own Sequence objects."""

    def __init__(self, config: EngineConfig, ckpt: LoadedCheckpoint, max_model_len: int):
        if ckpt.weights is None and not ckpt.name.startswith("random:"):
            raise ValueError(f"checkpoint {ckpt.name!r} was loaded without weights (with_weights=False); "
                             "the local executor needs them")
        self.runner = ModelRunner(config, ckpt.arch, ckpt.weights, max_model_len, model_name=ckpt.name)
        self.mm = self.runner.mm
        self.async_steps = self.runner.async_steps

    @property
    def key_centering(self) -> dict:
        return self.runner.key_centering

    def execute(self, batch: Batch) -> tuple[list[int], Optional[list[float]]]:
        return self.runner.execute(batch)

    def launch(self, batch: Batch) -> InFlight:
        return self.runner.launch(batch)

    def collect(self, step: InFlight) -> tuple[list[int], Optional[list[float]]]:
        return self.runner.collect(step)

    def prompt_logits(self, prompt_token_ids: list[int]) -> torch.Tensor:
        from diffkv_serve.engine.sampling_params import SamplingParams

        seq = Sequence("__logits__", list(prompt_token_ids), SamplingParams(temperature=0, max_tokens=1),
                       detokenizer=None)
        seq.slot = self.mm.alloc_slot()
        try:
            self.runner.execute(Batch(True, [seq]), keep_logits=True)
            return self.runner.last_logits[0].cpu()
        finally:
            self.mm.free([seq.slot])

    def slot_usage(self, slot: int, num_cached: int) -> tuple[int, int, int]:
        mm = self.mm
        if not mm.two_sided and not mm.fmt_high.tracked:
            # A single-precision cache keeps every token, in order, in ceil(tokens / T) pages per (layer, KV
            # head): known on the host. A device read would wait for the step in flight (async scheduling
            # launched it already) at every finishing request.
            heads = mm.heads_per_seq
            return (cdiv(num_cached, mm.fmt_high.tokens) - mm.shared_cols[slot]) * heads, num_cached * heads, 0
        pages, hi, lo = torch.stack([(mm.held_high[slot] + mm.held_low[slot]).sum(),
                                     mm.len_high[slot].sum(), mm.len_low[slot].sum()]).tolist()
        return pages - mm.shared_cols[slot] * mm.heads_per_seq, hi, lo  # own pages: not cached blocks it reads

    def token_counts(self, slots: list[int], cached: int) -> dict[str, int]:
        return self.runner.kv.token_counts(slots, cached)

    def token_classes(self, slot: int, num_tokens: int) -> torch.Tensor:
        return self.runner.kv.token_classes(slot, num_tokens)

    def rank_stats(self) -> list[dict[str, Any]]:
        mm = self.mm
        return [{"rank": 0, "pages_total": mm.num_pages, "pages_used": mm.num_pages - mm.free_pages(),
                 "last_mm_seconds": self.runner.kv.mm_seconds()}]

    def make_generator(self, seed: int) -> Optional[torch.Generator]:
        return torch.Generator(device=self.runner.device).manual_seed(seed)

    def shutdown(self) -> None:
        """Nothing to release early: the model and pool go with this object (the pool stays readable)."""


def make_executor(config: EngineConfig, ckpt: LoadedCheckpoint, max_model_len: int) -> Executor:
    if config.executor_kind == "local":
        return LocalExecutor(config, ckpt, max_model_len)
    from diffkv_serve.engine.ray_executor import RayExecutor  # imports Ray only when asked for

    return RayExecutor(config, ckpt, max_model_len)
