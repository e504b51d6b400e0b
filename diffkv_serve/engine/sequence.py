"""One request's state inside the engine."""
from __future__ import annotations

import enum
import threading
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Callable, Optional

import torch

from diffkv_serve.engine.sampling_params import SamplingParams

if TYPE_CHECKING:
    from diffkv_serve.engine.kv.request_settings import KVRequestSettings


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
    output_top_logprobs: list = field(default_factory=list)  # per token: [(id, logprob)], logprobs > 0
    prompt_logprobs: Optional[object] = None  # engine.logprobs.PromptLogprobs, once its prefill computed it
    status: Status = Status.WAITING
    slot: Optional[int] = None
    num_cached: int = 0  # tokens whose K/V are in the cache
    finish_reason: Optional[str] = None
    # `text` (a property below) is detokenized on demand: `_text` holds the text of the detokenizer's first
    # num_done tokens; `_text_marks` maps token counts outputs asked for (text_between) to the text's length.
    _text: str = field(default="", repr=False)
    _text_marks: dict[int, int] = field(default_factory=dict, repr=False)
    _text_edited: bool = field(default=False, repr=False)  # a stop string cut `text`: no marks any more
    _text_lock: threading.Lock = field(default_factory=threading.Lock, repr=False, compare=False)
    emitted_chars: int = 0  # stop-string requests: how much of `text` was already streamed
    emitted_tokens: int = 0  # output tokens already reported
    emitted_text_tokens: int = 0  # detokenizer tokens already reported (other requests' text position)
    first_scheduled_time: Optional[float] = None  # its first prefill was scheduled (queue time ends)
    first_token_time: Optional[float] = None
    finish_time: Optional[float] = None
    num_preemptions: int = 0
    # Decode rows of this sequence launched and not yet read (async scheduling). A sequence preempted with a
    # row in flight waits for that token before its recompute is admitted, as it would with synchronous steps.
    rows_in_flight: int = 0
    kv_usage: Optional[dict] = None  # KV memory held at finish (engine.kv_usage)
    teacher_agree: list[bool] = field(default_factory=list)  # teacher forcing: greedy choice == forced token
    # Structured outputs: its llguidance matcher (engine.grammar), advanced with each token; driver only.
    grammar: Optional[Any] = field(default=None, repr=False)
    # Its DiffKV thresholds and prune phase, resolved when the request was added (None: the cache config's).
    kv_settings: Optional[KVRequestSettings] = None
    # Prefix cache (engine.kv.prefix_cache): block ids this prefill reads instead of computing, block ids it
    # writes (its next full prompt blocks), and the driver's blocks it holds references on.
    prefix_hits: list[int] = field(default_factory=list)
    prefix_inserts: list[int] = field(default_factory=list)
    prefix_refs: list = field(default_factory=list)  # engine.kv.prefix_cache.CachedBlock
    # Learned reservation (engine.kv.footprint): after its prompt overflowed the pool once, reserve it all-high.
    worst_case_reservation: bool = False
    prefill_pages: Optional[int] = None  # pages its last prefill kept, summed over ranks (growth stats)
    prefill_tokens: int = 0
    # A request of n > 1 sequences: its request id (outputs carry it; request_id is then this sequence's own)
    # and which of the n this is.
    group_id: Optional[str] = None
    index: int = 0

    @property
    def text(self) -> str:
        """Output text so far (stop string removed once matched), brought up to date when read."""
        with self._text_lock:
            d = self.detokenizer
            if d is not None and d.num_done < len(d.ids):
                self._text += d.catch_up()
            return self._text

    @text.setter
    def text(self, value: str) -> None:
        with self._text_lock:
            if self.detokenizer is not None:
                self.detokenizer.catch_up()  # pending tokens belong to the text being replaced
            self._text, self._text_marks, self._text_edited = value, {}, True

    def text_between(self, start: int, end: int) -> str:
        """The text the detokenizer's tokens start..end-1 added (0, n: the text after n tokens), the same
        whenever it is read. Only while no stop string cut the text (which only grows until then)."""
        with self._text_lock:
            assert not self._text_edited, "text_between after a stop string cut the text"
            marks = self._text_marks
            a = marks.get(start)
            if a is None:
                a = self._text_length_at(start)
            b = marks.get(end)
            if b is None:
                b = self._text_length_at(end)
            return self._text[a:b]

    MAX_TEXT_MARKS = 64  # streaming needs the last one; older ones only serve outputs read out of order

    def _text_length_at(self, n: int) -> int:
        d, marks = self.detokenizer, self._text_marks
        if n == 0:
            return 0
        if n >= d.num_done:
            self._text += d.catch_up(n)
            end = len(self._text)
        else:  # passed without a mark (outputs read out of order): detokenize the first n tokens again
            end = len(d.text_of_first(n))
        if len(marks) >= self.MAX_TEXT_MARKS:
            del marks[next(iter(marks))]  # the oldest
        marks[n] = end
        return end

    @property
    def all_token_ids(self) -> list[int]:
        return self.prompt_token_ids + self.output_token_ids

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_token_ids) + len(self.output_token_ids)

    @property
    def finished(self) -> bool:
        return self.status is Status.FINISHED


_LAZY: Any = object()  # a RequestOutput field not cut from its sequence yet


class _Cut:
    """A RequestOutput field cut from the sequence's state on first read, then kept (settable like before)."""

    def __init__(self, cut: Callable[["RequestOutput"], Any]):
        self.cut = cut

    def __set_name__(self, owner: type, name: str) -> None:
        self.slot = "_" + name

    def __get__(self, out: Optional["RequestOutput"], owner: Optional[type] = None) -> Any:
        if out is None:
            return self
        value = getattr(out, self.slot)
        if value is _LAZY:
            value = self.cut(out)
            setattr(out, self.slot, value)
        return value

    def __set__(self, out: "RequestOutput", value: Any) -> None:
        setattr(out, self.slot, value)


class RequestOutput:
    """What a step reports for one request: the full output so far and the part new since last time.

    LLMEngine.output builds it with `snapshot`: the token lists and the text are only positions in the
    sequence's (growing) lists and text until a field is read, so a step pays nothing for fields nobody reads,
    and a field read later is still what that step reported.
    """

    __slots__ = ("request_id", "prompt_token_ids", "finished", "finish_reason", "arrival_time", "first_token_time",
                 "first_scheduled_time", "finish_time", "kv_usage", "_token_ids", "_text", "_new_token_ids", "_delta_text", "_logprobs",
                 "_teacher_agree", "_seq", "_n", "_n_before", "_n_logprobs", "_n_agree", "_text_src", "_t0", "_t1",
                 "_top_logprobs", "_n_top", "prompt_logprobs", "index", "_outputs")
    _FIELDS = ("request_id", "prompt_token_ids", "token_ids", "text", "new_token_ids", "delta_text", "finished",
               "finish_reason", "logprobs", "arrival_time", "first_token_time", "finish_time", "kv_usage",
               "teacher_agree", "first_scheduled_time", "top_logprobs",
               "prompt_logprobs", "index")  # __init__'s order: __reduce__ passes them positionally

    def __init__(self, request_id: str, prompt_token_ids: list[int], token_ids: list[int], text: str,
                 new_token_ids: list[int], delta_text: str, finished: bool, finish_reason: Optional[str],
                 logprobs: Optional[list[float]], arrival_time: float, first_token_time: Optional[float],
                 finish_time: Optional[float], kv_usage: Optional[dict] = None,
                 teacher_agree: Optional[list[bool]] = None, first_scheduled_time: Optional[float] = None,
                 top_logprobs: Optional[list] = None, prompt_logprobs: Optional[object] = None, index: int = 0):
        self.request_id, self.prompt_token_ids, self.finished = request_id, prompt_token_ids, finished
        self._token_ids, self._text, self._new_token_ids, self._delta_text = token_ids, text, new_token_ids, delta_text
        self.finish_reason, self._logprobs, self.arrival_time = finish_reason, logprobs, arrival_time
        self.first_token_time, self.finish_time, self.kv_usage = first_token_time, finish_time, kv_usage
        self._teacher_agree, self._seq = teacher_agree, None
        self.first_scheduled_time = first_scheduled_time
        # top_logprobs: per generated token its top-k [(id, logprob)] (logprobs > 0); prompt_logprobs: an
        # engine.logprobs.PromptLogprobs (prompt_logprobs set), from the prefill on
        self._top_logprobs, self.prompt_logprobs = top_logprobs, prompt_logprobs
        self.index, self._outputs = index, None  # index: which of the request's n sequences (SamplingParams.n)

    @classmethod
    def snapshot(cls, seq: Sequence, n_before: int, text_src: Optional[str], t0: int, t1: int) -> "RequestOutput":
        """The output of `seq` now: tokens n_before.. are new. Text: text_src[:t1] with delta text_src[t0:t1]
        when given (already cut), else the text after t1 detokenizer tokens with delta from t0 tokens on."""
        out = cls.__new__(cls)
        out.request_id, out.prompt_token_ids, out.finished = (seq.group_id or seq.request_id, seq.prompt_token_ids,
                                                              seq.finished)
        out.index, out._outputs = seq.index, None
        out.finish_reason, out.arrival_time = seq.finish_reason, seq.arrival_time
        out.first_scheduled_time = seq.first_scheduled_time
        out.first_token_time, out.finish_time, out.kv_usage, out._seq = (seq.first_token_time, seq.finish_time,
                                                                         seq.kv_usage, seq)
        out._token_ids = out._text = out._new_token_ids = out._delta_text = out._logprobs = out._teacher_agree = _LAZY
        out._n, out._n_before = len(seq.output_token_ids), n_before
        out._n_logprobs = len(seq.output_logprobs) if seq.params.logprobs is not None else -1
        out._n_top = len(seq.output_top_logprobs) if seq.params.logprobs else -1
        out._top_logprobs, out.prompt_logprobs = _LAZY, seq.prompt_logprobs
        out._n_agree = len(seq.teacher_agree) if seq.params.teacher_tokens is not None else -1
        out._text_src, out._t0, out._t1 = text_src, t0, t1
        return out

    def _cut_text(self) -> str:
        src = self._text_src
        return src[: self._t1] if src is not None else self._seq.text_between(0, self._t1)

    def _cut_delta(self) -> str:
        src = self._text_src
        return src[self._t0: self._t1] if src is not None else self._seq.text_between(self._t0, self._t1)

    token_ids = _Cut(lambda o: o._seq.output_token_ids[: o._n])
    text = _Cut(_cut_text)
    new_token_ids = _Cut(lambda o: o._seq.output_token_ids[o._n_before: o._n])
    delta_text = _Cut(_cut_delta)
    logprobs = _Cut(lambda o: o._seq.output_logprobs[: o._n_logprobs] if o._n_logprobs >= 0 else None)
    teacher_agree = _Cut(lambda o: o._seq.teacher_agree[: o._n_agree] if o._n_agree >= 0 else None)
    top_logprobs = _Cut(lambda o: o._seq.output_top_logprobs[: o._n_top] if o._n_top >= 0 else None)

    @property
    def outputs(self) -> list["RequestOutput"]:
        """vLLM's shape: the request's sequences, ordered by index (LLM.generate fills it for n > 1; otherwise
        the output itself). Each has the completion fields (index, text, token_ids, logprobs, finish_reason)."""
        return self._outputs if self._outputs is not None else [self]

    @outputs.setter
    def outputs(self, value: list["RequestOutput"]) -> None:
        self._outputs = value

    def _values(self) -> tuple:
        return tuple(getattr(self, f) for f in self._FIELDS)

    def __eq__(self, other: object) -> bool:
        return self._values() == other._values() if isinstance(other, RequestOutput) else NotImplemented

    __hash__ = None  # type: ignore[assignment]  # mutable, like the dataclass it replaces

    def __repr__(self) -> str:
        return "RequestOutput(" + ", ".join(f"{f}={v!r}" for f, v in zip(self._FIELDS, self._values())) + ")"

    def __reduce__(self):  # pickles the fields, cut, not the sequence
        return RequestOutput, self._values()
