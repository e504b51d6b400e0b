"""Per-request sampling settings, validated on construction (each error names its field).

The meanings follow vLLM's SamplingParams: penalties and logit_bias change the logits before greedy argmax
and before temperature; logprobs are those of the model's unmodified distribution."""
from __future__ import annotations

import math
from dataclasses import dataclass, field, replace
from typing import Optional

from diffkv_serve.engine.errors import InvalidRequestError
from diffkv_serve.engine.structured_outputs import StructuredOutputsParams

MAX_LOGPROBS = 20  # top alternatives per token (OpenAI's limit)
MAX_N = 128  # sequences per request (OpenAI's limit)
MAX_SEED = 2**64 - 1  # the largest seed a torch generator takes


def _is_int(v) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _is_number(v) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)


@dataclass
class SamplingParams:
    max_tokens: int = 16
    # Sequences sampled from one prompt (vLLM's n): they share the prompt's cached KV blocks where the cache
    # allows it; sequence i samples with seed + i when a seed is given.
    n: int = 1
    temperature: float = 1.0  # 0 = greedy
    top_p: float = 1.0
    top_k: int = 0  # 0 or -1: off
    min_p: float = 0.0  # drop tokens below min_p times the most likely token's probability; 0: off
    presence_penalty: float = 0.0  # subtracted once from each token already generated (OpenAI: -2..2)
    frequency_penalty: float = 0.0  # subtracted per occurrence among the generated tokens (OpenAI: -2..2)
    repetition_penalty: float = 1.0  # tokens of the prompt or output: logit / p if > 0, logit * p if < 0
    min_tokens: int = 0  # EOS and stop_token_ids are masked until this many tokens are generated
    logit_bias: dict[int, float] = field(default_factory=dict)  # token id -> added to its logit (-100..100)
    seed: Optional[int] = None
    stop: list[str] = field(default_factory=list)
    stop_token_ids: list[int] = field(default_factory=list)
    ignore_eos: bool = False
    # Log-probabilities under the unmodified distribution: None: none; 0: the chosen token's; k (<= 20): also
    # the k most likely tokens at each step. True / False are accepted for 0 / None.
    logprobs: Optional[int] = None
    prompt_logprobs: Optional[int] = None  # the same for every prompt token (the first has none)
    skip_special_tokens: bool = True
    # The tokenizer's EOS ids, filled in by the engine when the request is added (min_tokens masks them).
    eos_token_ids: tuple[int, ...] = field(default=(), repr=False)
    include_stop_str_in_output: bool = False
    # Evaluation: emit these tokens instead of sampling (teacher forcing); the output records whether the
    # model's own greedy choice agreed and, with logprobs, the log-probability of each forced token.
    teacher_tokens: Optional[list[int]] = None
    # What the output must match (a JSON schema, any JSON object, a regex, a choice, a Lark grammar): a
    # StructuredOutputsParams or a dict of its fields. The grammar masks the logits before everything else; EOS
    # is allowed only where the grammar accepts, and the request stops once the grammar is complete.
    structured_outputs: Optional[StructuredOutputsParams] = None

    def __post_init__(self) -> None:
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        self.stop = list(self.stop)
        self.stop_token_ids = list(self.stop_token_ids)
        if not _is_int(self.max_tokens) or self.max_tokens <= 0:
            raise InvalidRequestError(f"max_tokens must be a positive integer, got {self.max_tokens!r}", "max_tokens")
        if not _is_int(self.n) or not 1 <= self.n <= MAX_N:
            raise InvalidRequestError(f"n must be an integer in [1, {MAX_N}], got {self.n!r}", "n")
        if not self.temperature >= 0:  # also rejects NaN
            raise InvalidRequestError(f"temperature must be >= 0, got {self.temperature!r}", "temperature")
        if not 0 < self.top_p <= 1:
            raise InvalidRequestError(f"top_p must be in (0, 1], got {self.top_p!r}", "top_p")
        if not _is_int(self.top_k) or self.top_k < -1:
            raise InvalidRequestError(f"top_k must be -1, 0 (off) or a positive integer, got {self.top_k!r}", "top_k")
        if not (_is_number(self.min_p) and 0 <= self.min_p <= 1):
            raise InvalidRequestError(f"min_p must be in [0, 1], got {self.min_p!r}", "min_p")
        for name in ("presence_penalty", "frequency_penalty"):
            v = getattr(self, name)
            if not (_is_number(v) and -2 <= v <= 2):
                raise InvalidRequestError(f"{name} must be in [-2, 2], got {v!r}", name)
        if not (_is_number(self.repetition_penalty) and self.repetition_penalty > 0):
            raise InvalidRequestError(f"repetition_penalty must be > 0 (1: off), got {self.repetition_penalty!r}",
                                      "repetition_penalty")
        if not _is_int(self.min_tokens) or not 0 <= self.min_tokens <= self.max_tokens:
            raise InvalidRequestError(f"min_tokens must be an integer in [0, max_tokens={self.max_tokens}], got "
                                      f"{self.min_tokens!r}", "min_tokens")
        self.logit_bias = self._check_logit_bias(self.logit_bias)
        if any(not isinstance(s, str) or not s for s in self.stop):
            raise InvalidRequestError("stop must be non-empty strings", "stop")
        if any(not _is_int(t) or t < 0 for t in self.stop_token_ids):
            raise InvalidRequestError("stop_token_ids must be non-negative integers", "stop_token_ids")
        self.logprobs = self._check_logprobs("logprobs", self.logprobs)
        self.prompt_logprobs = self._check_logprobs("prompt_logprobs", self.prompt_logprobs)
        if self.teacher_tokens is not None:
            self.teacher_tokens = list(self.teacher_tokens)
            if any(not _is_int(t) or t < 0 for t in self.teacher_tokens):
                raise InvalidRequestError("teacher_tokens must be non-negative integers", "teacher_tokens")
        self.structured_outputs = StructuredOutputsParams.of(self.structured_outputs)
        # A torch generator takes seeds below 2^64; sequence i of an n-sequence request is seeded seed + i.
        if self.seed is not None and (not _is_int(self.seed) or not 0 <= self.seed <= MAX_SEED + 1 - self.n):
            raise InvalidRequestError(f"seed must be an integer in [0, {MAX_SEED + 1 - self.n}] (n={self.n}), got "
                                      f"{self.seed!r}", "seed")

    def for_sample(self, index: int) -> "SamplingParams":
        """The settings of sequence `index` of an n-sequence request: n=1, its own seed (seed + index), and
        the prompt's log-probabilities computed by sequence 0 only (they are the same for every sequence, and
        a prefill that computes them cannot read cached prefix blocks)."""
        return replace(self, n=1, seed=None if self.seed is None else self.seed + index,
                       prompt_logprobs=self.prompt_logprobs if index == 0 else None)

    @staticmethod
    def _check_logit_bias(bias) -> dict[int, float]:
        if bias is None:
            return {}
        if not isinstance(bias, dict):
            raise InvalidRequestError("logit_bias must map token ids to biases", "logit_bias")
        out = {}
        for k, v in bias.items():
            tok = int(k) if isinstance(k, str) and k.strip().isdigit() else k  # JSON keys are strings
            if not _is_int(tok) or tok < 0:
                raise InvalidRequestError(f"logit_bias keys must be token ids (non-negative integers), got {k!r}",
                                          "logit_bias")
            if not (_is_number(v) and -100 <= v <= 100):
                raise InvalidRequestError(f"logit_bias values must be in [-100, 100], got {v!r} for token {k}",
                                          "logit_bias")
            out[tok] = float(v)
        return out

    @staticmethod
    def _check_logprobs(name: str, v) -> Optional[int]:
        if v is None or v is False:
            return None
        if v is True:
            return 0
        if not _is_int(v) or not 0 <= v <= MAX_LOGPROBS:
            raise InvalidRequestError(f"{name} must be an integer in [0, {MAX_LOGPROBS}], got {v!r}", name)
        return v

    def check_vocab(self, vocab_size: int) -> None:
        """Token ids must exist in the model's vocabulary (checked when the request is added)."""
        for name, ids in (("logit_bias", self.logit_bias), ("stop_token_ids", self.stop_token_ids)):
            bad = [t for t in ids if t >= vocab_size]
            if bad:
                raise InvalidRequestError(f"{name} has token id {bad[0]} outside the vocabulary [0, {vocab_size})",
                                          name)

    @property
    def greedy(self) -> bool:
        return self.temperature == 0

    @property
    def penalizes(self) -> bool:
        """Needs the tokens generated so far (and, for repetition_penalty, the prompt's) on the device."""
        return self.presence_penalty != 0 or self.frequency_penalty != 0 or self.repetition_penalty != 1
