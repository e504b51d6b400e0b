"""OpenAI API request and response bodies (the subset DiffKV Serve implements), as pydantic models.

Requests forbid unknown fields (OpenAI answers 400 "Unrecognized request argument") and check ranges, so
FastAPI's validation turns every bad body into a 400 with an OpenAI error body naming the field. Limits that
depend on the model (context length) are checked by the ingress and the engine replica.
"""
from __future__ import annotations

import json
import time
import uuid
from typing import Literal, Optional, Union

from pydantic import (BaseModel, ConfigDict, Field, StrictBool, StrictFloat, StrictInt, ValidationInfo,
                      field_validator, model_validator)

from diffkv_serve.engine.config import PrunePhase
from diffkv_serve.engine.kv.request_settings import ALPHA_MAX, check_alpha, check_order, check_prune_phase
from diffkv_serve.service.structured_outputs import ResponseFormat, Tool, ToolCall, ToolChoice, engine_constraint

MAX_STOP = 4  # OpenAI allows up to 4 stop sequences
MAX_LOGPROBS = 20  # top alternatives per token (vLLM's limit; the engine's SamplingParams checks the same)
MAX_N = 128  # choices per request (OpenAI's limit; the engine's SamplingParams checks the same)


class _Strict(BaseModel):
    # allow_inf_nan=False: Python's json accepts NaN / Infinity, which must fail as "a finite number", not
    # as a range error
    model_config = ConfigDict(extra="forbid", allow_inf_nan=False)


# ---- requests ---------------------------------------------------------------------------------------------
class KVCompression(_Strict):
    """Per-request DiffKV thresholds (diffkv mode): a token stays high precision if its significance is >=
    alpha_high / position, low precision if >= alpha_low / position, else it is pruned; prune_phase limits
    pruning to the prompt's or the generated tokens (engine CacheConfig.prune_phase). The checks are the
    engine's (diffkv_serve/engine/kv/request_settings.py), which also fills in the server's defaults."""

    alpha_high: Optional[StrictFloat] = Field(None, ge=0, le=ALPHA_MAX)
    alpha_low: Optional[StrictFloat] = Field(None, ge=0, le=ALPHA_MAX)
    prune_phase: Optional[PrunePhase] = Field(None, description="which tokens may be pruned: both | prompt | "
                                                                "generation (default: the server's)")

    @field_validator("alpha_high", "alpha_low", mode="before")
    @classmethod
    def _alpha(cls, v, info: ValidationInfo):
        # Before the type and range checks, so a bad value gets the engine's message.
        return v if v is None else check_alpha(info.field_name, v)

    @field_validator("prune_phase", mode="before")
    @classmethod
    def _prune_phase(cls, v):
        return v if v is None else check_prune_phase(v)

    @model_validator(mode="after")
    def _order(self) -> "KVCompression":
        if self.alpha_high is not None and self.alpha_low is not None:
            check_order(self.alpha_high, self.alpha_low)
        return self


class StreamOptions(_Strict):
    include_usage: StrictBool = False


class TextPart(_Strict):
    type: Literal["text"]
    text: str


class ChatMessage(_Strict):
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: Union[str, list[TextPart], None] = None
    name: Optional[str] = None
    tool_calls: Optional[list[ToolCall]] = Field(None, description="assistant: the calls it made")
    tool_call_id: Optional[str] = Field(None, description="tool: the call this message answers")

    def template_dict(self) -> dict:
        """The message as chat templates read it (HF's layout: a call's arguments as an object)."""
        out: dict = {"role": self.role, "content": self.text()}
        if self.name:
            out["name"] = self.name
        if self.tool_calls:
            out["tool_calls"] = [{"id": c.id, "type": c.type,
                                  "function": {"name": c.function.name, "arguments": _arguments(c.function.arguments)}}
                                 for c in self.tool_calls]
        if self.tool_call_id is not None:
            out["tool_call_id"] = self.tool_call_id
        return out

    def text(self) -> str:
        if self.content is None:
            return ""
        if isinstance(self.content, str):
            return self.content
        return "".join(p.text for p in self.content)


def _arguments(text: str):
    try:
        return json.loads(text)
    except ValueError:
        return text


class _SamplingFields(_Strict):
    model: str = Field(min_length=1)
    temperature: Optional[StrictFloat] = Field(None, ge=0, le=2)
    top_p: Optional[StrictFloat] = Field(None, gt=0, le=1)
    seed: Optional[StrictInt] = Field(None, ge=0, le=2**63 - 1)
    stop: Union[str, list[str], None] = None
    stream: StrictBool = False
    stream_options: Optional[StreamOptions] = None
    n: StrictInt = Field(1, ge=1, le=MAX_N, description="completions sampled from the prompt (own seeds: seed + i)")
    user: Optional[str] = None
    presence_penalty: Optional[StrictFloat] = Field(None, ge=-2, le=2)
    frequency_penalty: Optional[StrictFloat] = Field(None, ge=-2, le=2)
    # vLLM's extra sampling parameters (its meanings: diffkv_serve/engine/sampling_params.py)
    top_k: Optional[StrictInt] = Field(None, ge=-1, description="-1 or 0: off")
    min_p: Optional[StrictFloat] = Field(None, ge=0, le=1)
    repetition_penalty: Optional[StrictFloat] = Field(None, gt=0, le=100, description="1: off")
    min_tokens: Optional[StrictInt] = Field(None, ge=0)
    stop_token_ids: Optional[list[StrictInt]] = Field(None, max_length=64)
    logit_bias: Optional[dict[str, StrictFloat]] = Field(None, description="token id -> bias in [-100, 100]")
    ignore_eos: StrictBool = False
    response_format: Optional[ResponseFormat] = Field(None, description="text, json_object or json_schema "
                                                                        "(enforced by a grammar)")
    kv_compression: Optional[KVCompression] = Field(
        None, description="DiffKV extension: per-request thresholds (a server whose cache is not diffkv with "
                          "thresholds answers 400)")

    @field_validator("stop")
    @classmethod
    def _check_stop(cls, v):
        if v is None:
            return v
        stops = [v] if isinstance(v, str) else v
        if len(stops) > MAX_STOP:
            raise ValueError(f"at most {MAX_STOP} stop sequences")
        if any(not s for s in stops):
            raise ValueError("stop sequences must be non-empty")
        return v

    @field_validator("stop_token_ids")
    @classmethod
    def _check_stop_token_ids(cls, v):
        if v is not None and any(t < 0 for t in v):
            raise ValueError("token ids must be non-negative")
        return v

    @field_validator("logit_bias")
    @classmethod
    def _check_logit_bias(cls, v):
        if v is None:
            return v
        if len(v) > 1024:
            raise ValueError("at most 1024 biased tokens")
        for k, b in v.items():
            if not k.isdigit() or not k.isascii():
                raise ValueError(f"keys must be token ids, got {k!r}")
            if not -100 <= b <= 100:
                raise ValueError(f"biases must be in [-100, 100], got {b} for token {k}")
        return v

    @model_validator(mode="after")
    def _check_stream_options(self):
        if self.stream_options is not None and not self.stream:
            raise ValueError("stream_options is only allowed when stream is true")
        return self

    def sampling_fields(self) -> dict:
        """The sampling settings the engine replica turns into SamplingParams (unset ones left out)."""
        fields = ("top_k", "min_p", "presence_penalty", "frequency_penalty", "repetition_penalty", "min_tokens",
                  "stop_token_ids")
        out = {f: getattr(self, f) for f in fields if getattr(self, f) is not None}
        if self.logit_bias:
            out["logit_bias"] = {int(k): b for k, b in self.logit_bias.items()}
        if self.ignore_eos:
            out["ignore_eos"] = True
        return out

    def constraint(self) -> tuple[Optional[dict], Optional[str]]:
        """engine.structured_outputs fields for response_format (chat: also tool_choice), and the field a
        compile error names; a contradiction raises service.structured_outputs.ConstraintError."""
        return engine_constraint(self.response_format)

    def stop_list(self) -> list[str]:
        return [] if self.stop is None else [self.stop] if isinstance(self.stop, str) else list(self.stop)

    def include_usage(self) -> bool:
        return bool(self.stream_options and self.stream_options.include_usage)


class ChatCompletionRequest(_SamplingFields):
    messages: list[ChatMessage] = Field(min_length=1)
    max_tokens: Optional[StrictInt] = Field(None, ge=1, description="deprecated alias of max_completion_tokens")
    max_completion_tokens: Optional[StrictInt] = Field(None, ge=1)
    logprobs: StrictBool = False
    top_logprobs: Optional[StrictInt] = Field(None, ge=0, le=MAX_LOGPROBS)
    tools: Optional[list[Tool]] = Field(None, min_length=1, max_length=128,
                                        description="for chat templates that render tools")
    tool_choice: Optional[ToolChoice] = Field(None, description="none | auto | required | a named function "
                                                                "(required and named are enforced by a grammar)")
    parallel_tool_calls: StrictBool = True

    @model_validator(mode="after")
    def _top_needs_logprobs(self):
        if self.top_logprobs and not self.logprobs:
            raise ValueError("top_logprobs needs logprobs: true")
        return self

    def constraint(self) -> tuple[Optional[dict], Optional[str]]:
        return engine_constraint(self.response_format, self.tools, self.tool_choice, self.parallel_tool_calls)

    def engine_logprobs(self) -> tuple[Optional[int], Optional[int]]:
        """(logprobs, prompt_logprobs) for the engine."""
        return (self.top_logprobs or 0 if self.logprobs else None), None

    def requested_max_tokens(self) -> tuple[Optional[int], str]:
        if self.max_completion_tokens is not None:
            return self.max_completion_tokens, "max_completion_tokens"
        return self.max_tokens, "max_tokens"


class CompletionRequest(_SamplingFields):
    prompt: Union[str, list[StrictInt], list[str], list[list[StrictInt]]]
    max_tokens: Optional[StrictInt] = Field(16, ge=1)
    echo: StrictBool = Field(False, description="the prompt before the completion (with logprobs: its tokens' too)")
    logprobs: Optional[StrictInt] = Field(None, ge=0, le=MAX_LOGPROBS, description="top alternatives per token")
    suffix: Optional[str] = Field(None, description="not supported")
    best_of: Optional[StrictInt] = Field(None, ge=1, description="only best_of = n is supported")

    @field_validator("prompt")
    @classmethod
    def _one_prompt(cls, v):
        if isinstance(v, list) and v and isinstance(v[0], (str, list)):
            if len(v) != 1:
                raise ValueError("one prompt per request is supported")
            v = v[0]
        if isinstance(v, list) and not v:
            raise ValueError("prompt is empty")
        if isinstance(v, list) and any(t < 0 for t in v):
            raise ValueError("prompt token ids must be non-negative")
        return v

    @field_validator("best_of")
    @classmethod
    def _best_of_is_n(cls, v, info: ValidationInfo):
        n = info.data.get("n", 1)
        if v is not None and v != n:
            raise ValueError(f"best_of={v} is not supported: only best_of equal to n ({n}) is")
        return v

    @field_validator("suffix")
    @classmethod
    def _no_suffix(cls, v):
        if v:
            raise ValueError("suffix is not supported")
        return v

    def engine_logprobs(self) -> tuple[Optional[int], Optional[int]]:
        """(logprobs, prompt_logprobs) for the engine: echo with logprobs reports the prompt's as well."""
        return self.logprobs, (self.logprobs if self.echo and self.logprobs is not None else None)

    def requested_max_tokens(self) -> tuple[Optional[int], str]:
        return self.max_tokens, "max_tokens"


class TokenizeRequest(_Strict):
    """vLLM's /tokenize: a text prompt, or chat messages through the model's chat template."""

    model: Optional[str] = Field(None, min_length=1, description="default: the served model")
    prompt: Optional[str] = None
    messages: Optional[list[ChatMessage]] = Field(None, min_length=1)
    add_special_tokens: Optional[StrictBool] = Field(None, description="default: true for a prompt, false for "
                                                                        "messages (the template adds them)")
    add_generation_prompt: StrictBool = True

    @model_validator(mode="after")
    def _one_input(self):
        if (self.prompt is None) == (self.messages is None):
            raise ValueError("give exactly one of prompt and messages")
        return self


class DetokenizeRequest(_Strict):
    model: Optional[str] = Field(None, min_length=1, description="default: the served model")
    tokens: list[StrictInt] = Field(max_length=1_000_000)

    @field_validator("tokens")
    @classmethod
    def _non_negative(cls, v):
        if any(t < 0 for t in v):
            raise ValueError("token ids must be non-negative")
        return v


# ---- responses ------------------------------------------------------------------------------------------------
def new_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex}"


def now_s() -> int:
    return int(time.time())


class Usage(BaseModel):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int

    @classmethod
    def of(cls, prompt: int, completion: int) -> "Usage":
        return cls(prompt_tokens=prompt, completion_tokens=completion, total_tokens=prompt + completion)


FinishReason = Optional[Literal["stop", "length", "tool_calls"]]


class AssistantMessage(BaseModel):
    role: Literal["assistant"] = "assistant"
    content: str


class ChatChoice(BaseModel):
    index: int = 0
    message: AssistantMessage
    finish_reason: FinishReason
    logprobs: Optional[dict] = None


class ChatCompletion(BaseModel):
    id: str
    object: Literal["chat.completion"] = "chat.completion"
    created: int
    model: str
    choices: list[ChatChoice]
    usage: Usage


class Delta(BaseModel):
    role: Optional[Literal["assistant"]] = None
    content: Optional[str] = None


class ChatChunkChoice(BaseModel):
    index: int = 0
    delta: Delta
    finish_reason: FinishReason = None
    logprobs: Optional[dict] = None


class ChatCompletionChunk(BaseModel):
    id: str
    object: Literal["chat.completion.chunk"] = "chat.completion.chunk"
    created: int
    model: str
    choices: list[ChatChunkChoice]
    usage: Optional[Usage] = None


class CompletionChoice(BaseModel):
    index: int = 0
    text: str
    finish_reason: FinishReason
    logprobs: Optional[dict] = None


class Completion(BaseModel):
    """Both the whole response and each streamed chunk (OpenAI uses the same object for both)."""

    id: str
    object: Literal["text_completion"] = "text_completion"
    created: int
    model: str
    choices: list[CompletionChoice]
    usage: Optional[Usage] = None


class KVCacheCard(BaseModel):
    """The KV cache the served model runs with, as its engine resolved it (the model's calibrated thresholds
    and precisions from its settings file where the server's configuration left them unset)."""

    kv_mode: str
    cache_dtype: str = Field(description="dtype of unquantized cache values (float32 on CPU, bfloat16 on CUDA)")
    high: str = Field(description="precision of (significant) tokens, K<bits>V<bits> (-e4m3: fp8 codes)")
    low: Optional[str] = Field(None, description="diffkv: precision of moderately significant tokens")
    prefix_caching: bool
    policy: Optional[str] = Field(None, description="diffkv: thresholds | budget")
    window: Optional[int] = Field(None, description="diffkv: most recent tokens always kept high")
    alpha_high: Optional[float] = Field(None, description="diffkv thresholds: kept high if significance >= "
                                                          "alpha_high / position")
    alpha_low: Optional[float] = Field(None, description="diffkv thresholds: kept low if significance >= "
                                                         "alpha_low / position")
    layer_alpha_scale: Optional[list[float]] = Field(None, description="diffkv thresholds: per-layer multipliers")
    prune_phase: Optional[PrunePhase] = Field(None, description="diffkv thresholds: which tokens may be pruned "
                                                                "(both | prompt | generation)")
    budget: Optional[float] = Field(None, description="diffkv budget: fraction of tokens each KV head keeps")
    pin_prompt_blocks: Optional[bool] = Field(None, description="diffkv: each prompt's full prefix-cache blocks "
                                                                "are kept high, never demoted or pruned")


class ModelCard(BaseModel):
    id: str
    object: Literal["model"] = "model"
    created: int
    owned_by: str = "diffkv-serve"
    diffkv: Optional[KVCacheCard] = Field(None, description="DiffKV extension: the KV cache this model runs with")


class ModelList(BaseModel):
    object: Literal["list"] = "list"
    data: list[ModelCard]


class TokenizeResponse(BaseModel):
    tokens: list[int]
    count: int
    max_model_len: int


class DetokenizeResponse(BaseModel):
    prompt: str


class TokenizerInfo(BaseModel):
    """vLLM's /tokenizer_info: what a client needs to tokenize like the server (lm-evaluation-harness's
    remote tokenizer reads it, then calls /tokenize and /detokenize)."""

    tokenizer_class: str
    eos_token: Optional[str]
    bos_token: Optional[str]
    pad_token: Optional[str]
    chat_template: Optional[str]
    model_max_length: int


class ErrorDetail(BaseModel):
    """OpenAI's error object: `code` is a string (e.g. "model_not_found") or null, never the HTTP status."""

    message: str
    type: str
    param: Optional[str] = None
    code: Optional[str] = None


class ErrorResponse(BaseModel):
    error: ErrorDetail


class Health(BaseModel):
    status: Literal["ok"] = "ok"
    model: str


def error_body(message: str, type_: str, param: Optional[str] = None, code: Optional[str] = None) -> dict:
    return ErrorResponse(error=ErrorDetail(message=message, type=type_, param=param, code=code)).model_dump()
