"""One request's state inside the engine."""
from __future__ import annotations

import enum
import time
from dataclasses import dataclass, field
from typing import Optional

import torch

from engine.sampling_params import SamplingParams


class Status(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


@dataclass
class Sequence:
    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams
    detokenizer: object  # engine.tokenizer.IncrementalDetokenizer
    generator: Optional[torch.Generator] = None
    arrival_time: float = field(default_factory=time.monotonic)
    output_token_ids: list[int] = field(default_factory=list)
    output_logprobs: list[float] = field(default_factory=list)
    status: Status = Status.WAITING
    slot: Optional[int] = None
    num_cached: int = 0  # tokens whose K/V are in the cache
    finish_reason: Optional[str] = None
    text: str = ""  # output text so far (stop string removed once matched)
    emitted_chars: int = 0  # how much of `text` was already streamed
    emitted_tokens: int = 0
    first_token_time: Optional[float] = None
    finish_time: Optional[float] = None
    num_preemptions: int = 0
    kv_usage: Optional[dict] = None  # KV memory held at finish (engine.kv_usage)
    teacher_agree: list[bool] = field(default_factory=list)  # teacher forcing: greedy choice == forced token
    alpha_high: Optional[float] = None  # per-request DiffKV thresholds (None: the engine's)
    alpha_low: Optional[float] = None
    # Prefix cache (engine.prefix_cache): block ids this prefill reads instead of computing, block ids it
    # writes (its next full prompt blocks), and the driver's blocks it holds references on.
    prefix_hits: list[int] = field(default_factory=list)
    prefix_inserts: list[int] = field(default_factory=list)
    prefix_refs: list = field(default_factory=list)  # engine.prefix_cache.CachedBlock
    # Learned admission (engine.footprint): after its prompt overflowed the pool once, admit it all-high.
    worst_case_admission: bool = False
    prefill_pages: Optional[int] = None  # pages its last prefill kept, summed over ranks (growth stats)
    prefill_tokens: int = 0

    @property
    def all_token_ids(self) -> list[int]:
        return self.prompt_token_ids + self.output_token_ids

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_token_ids) + len(self.output_token_ids)

    @property
    def finished(self) -> bool:
        return self.status is Status.FINISHED


@dataclass
class RequestOutput:
    """What a step reports for one request: the full output so far and the part new since last time."""

    request_id: str
    prompt_token_ids: list[int]
    token_ids: list[int]
    text: str
    new_token_ids: list[int]
    delta_text: str
    finished: bool
    finish_reason: Optional[str]
    logprobs: Optional[list[float]]
    arrival_time: float
    first_token_time: Optional[float]
    finish_time: Optional[float]
    kv_usage: Optional[dict] = None
    teacher_agree: Optional[list[bool]] = None
