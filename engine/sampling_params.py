"""Per-request sampling settings, validated on construction (each error names its field)."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional

from engine.errors import InvalidRequestError


@dataclass
class SamplingParams:
    max_tokens: int = 16
    temperature: float = 1.0  # 0 = greedy
    top_p: float = 1.0
    top_k: int = 0  # 0 or -1: off
    seed: Optional[int] = None
    stop: list[str] = field(default_factory=list)
    stop_token_ids: list[int] = field(default_factory=list)
    ignore_eos: bool = False
    logprobs: bool = False  # log-probability of each chosen token (under the unmodified distribution)
    skip_special_tokens: bool = True
    include_stop_str_in_output: bool = False
    # Evaluation: emit these tokens instead of sampling (teacher forcing); the output records whether the
    # model's own greedy choice agreed and, with logprobs, the log-probability of each forced token.
    teacher_tokens: Optional[list[int]] = None

    def __post_init__(self) -> None:
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        self.stop = list(self.stop)
        self.stop_token_ids = list(self.stop_token_ids)
        if not isinstance(self.max_tokens, int) or isinstance(self.max_tokens, bool) or self.max_tokens <= 0:
            raise InvalidRequestError(f"max_tokens must be a positive integer, got {self.max_tokens!r}", "max_tokens")
        if not self.temperature >= 0:  # also rejects NaN
            raise InvalidRequestError(f"temperature must be >= 0, got {self.temperature!r}", "temperature")
        if not 0 < self.top_p <= 1:
            raise InvalidRequestError(f"top_p must be in (0, 1], got {self.top_p!r}", "top_p")
        if not isinstance(self.top_k, int) or self.top_k < -1:
            raise InvalidRequestError(f"top_k must be -1, 0 (off) or a positive integer, got {self.top_k!r}", "top_k")
        if any(not isinstance(s, str) or not s for s in self.stop):
            raise InvalidRequestError("stop must be non-empty strings", "stop")
        if any(not isinstance(t, int) or t < 0 for t in self.stop_token_ids):
            raise InvalidRequestError("stop_token_ids must be non-negative integers", "stop_token_ids")
        if self.teacher_tokens is not None:
            self.teacher_tokens = list(self.teacher_tokens)
            if any(not isinstance(t, int) or t < 0 for t in self.teacher_tokens):
                raise InvalidRequestError("teacher_tokens must be non-negative integers", "teacher_tokens")
        if self.seed is not None and (not isinstance(self.seed, int) or self.seed < 0):
            raise InvalidRequestError(f"seed must be a non-negative integer, got {self.seed!r}", "seed")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0
