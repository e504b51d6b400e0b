"""What the soak test sends and how it judges each answer: the request kinds of the mix, the bad bodies (each
refused by the ingress before admission, so under any load the answer is a 400), and the outcome of one
request from what the client saw.

Outcomes: `completed`; a clean error (`rejected` 429, `unavailable` 503, `invalid` 400 — each with an OpenAI
error body — or `stream_error`, a started stream that ends with an error event); `disconnected` (the client
closed it on purpose); and `lost`: anything else (a hang past the timeout, a reset connection, a 500, a stream
cut off without an error event, an error without OpenAI's body).
"""
from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Optional

# request kinds of the mix
STREAM = "stream"            # streamed chat, read to the end
PLAIN = "plain"              # non-streamed chat
DISCONNECT = "disconnect"    # streamed chat, closed by the client after a few chunks
ABORT = "abort"              # any chat request, closed by the client after a short random delay
BAD = "bad"                  # a body the ingress must refuse with 400
KINDS = (STREAM, PLAIN, DISCONNECT, ABORT, BAD)

# outcomes
COMPLETED, REJECTED, UNAVAILABLE, INVALID, STREAM_ERROR = "completed", "rejected", "unavailable", "invalid", \
    "stream_error"
DISCONNECTED, LOST = "disconnected", "lost"
CLEAN_ERRORS = (REJECTED, UNAVAILABLE, INVALID, STREAM_ERROR)
OUTCOMES = (COMPLETED, *CLEAN_ERRORS, DISCONNECTED, LOST)

_CLEAN_STATUS = {429: REJECTED, 503: UNAVAILABLE, 400: INVALID}


def parse_mix(text: str) -> dict[str, float]:
    """'stream=0.55,plain=0.15,disconnect=0.1,abort=0.05,bad=0.15' -> probabilities (normalized); kinds left
    out get 0."""
    mix = {k: 0.0 for k in KINDS}
    for part in text.split(","):
        part = part.strip()
        if not part:
            continue
        name, sep, value = part.partition("=")
        name = name.strip()
        if not sep or name not in mix:
            raise ValueError(f"--mix: {part!r} is not KIND=WEIGHT with KIND one of {', '.join(KINDS)}")
        try:
            w = float(value)
        except ValueError:
            raise ValueError(f"--mix: the weight of {name!r} is not a number: {value!r}") from None
        if not w >= 0:
            raise ValueError(f"--mix: the weight of {name!r} must be >= 0, got {w}")
        mix[name] = w
    total = sum(mix.values())
    if total <= 0:
        raise ValueError("--mix: give at least one kind a weight > 0")
    if mix[STREAM] + mix[PLAIN] + mix[DISCONNECT] + mix[ABORT] <= 0:
        raise ValueError("--mix: only bad requests would never load the engine; give a valid kind a weight")
    return {k: w / total for k, w in mix.items()}


def chat_body(model: str, messages: list[dict], max_tokens: int, stream: bool) -> dict:
    body = {"model": model, "messages": messages, "max_tokens": int(max_tokens), "temperature": 0.0,
            "stream": stream}
    if stream:
        body["stream_options"] = {"include_usage": True}
    return body


def bad_bodies(model: str, max_model_len: int) -> list[tuple[str, bytes]]:
    """(name, raw body) of requests the ingress refuses before admission control: the answer is a 400 whatever
    the load, and never reaches an engine replica."""
    ok = {"model": model, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4}
    cases = [
        ("malformed JSON", b'{"model": "' + model.encode() + b'", "messages": [{"role": "user", "content": "hi"'),
        ("not an object", b'["hello"]'),
        ("missing messages", {k: v for k, v in ok.items() if k != "messages"}),
        ("empty messages", {**ok, "messages": []}),
        ("unknown role", {**ok, "messages": [{"role": "wizard", "content": "hi"}]}),
        ("max_tokens wrong type", {**ok, "max_tokens": "ten"}),
        ("max_tokens zero", {**ok, "max_tokens": 0}),
        ("max_tokens beyond the context", {**ok, "max_tokens": max_model_len + 1}),
        ("temperature out of range", {**ok, "temperature": 7}),
        ("unknown field", {**ok, "frobnicate": True}),
        ("unknown model", {**ok, "model": model + "-nope"}),
        ("kv_compression low above high", {**ok, "kv_compression": {"alpha_high": 0.1, "alpha_low": 0.5}}),
    ]
    return [(name, b if isinstance(b, bytes) else json.dumps(b).encode()) for name, b in cases]


def openai_error(obj) -> Optional[dict]:
    """The `error` object when `obj` is OpenAI's error body ({"error": {"message": str, "type": str, "param",
    "code": str | None}}), else None."""
    if not isinstance(obj, dict) or not isinstance(obj.get("error"), dict):
        return None
    err = obj["error"]
    if set(err) != {"message", "type", "param", "code"}:
        return None
    if not (isinstance(err["message"], str) and err["message"] and isinstance(err["type"], str)):
        return None
    if err["code"] is not None and not isinstance(err["code"], str):
        return None
    return err


@dataclass
class Exchange:
    """What the client saw of one request."""

    kind: str
    status: int = 0                  # 0: no response head
    body: bytes = b""                # non-streamed responses and error responses
    events: list[str] = field(default_factory=list)  # SSE `data:` payloads, in order
    closed_by_client: bool = False   # we closed it on purpose (disconnect / abort)
    timed_out: bool = False          # no answer within the request timeout
    transport_error: Optional[str] = None  # connection reset, refused, protocol error
    ttft: Optional[float] = None     # seconds from sending to the first event carrying content (streams)


@dataclass
class Verdict:
    outcome: str
    detail: str = ""
    response_id: Optional[str] = None  # the server's id (chatcmpl-...), when one came back


def has_content(data: str) -> bool:
    """An SSE chunk carrying generated text."""
    obj = _json(data)
    if not isinstance(obj, dict):
        return False
    return any((c.get("delta") or {}).get("content") for c in obj.get("choices") or [] if isinstance(c, dict))


def _json(data: bytes | str):
    try:
        return json.loads(data)
    except (json.JSONDecodeError, UnicodeDecodeError):
        return None


def judge(ex: Exchange) -> Verdict:
    """The outcome of one exchange (module docstring)."""
    if ex.closed_by_client:
        return Verdict(DISCONNECTED, "closed by the client")
    if ex.timed_out:
        return Verdict(LOST, "no answer within the timeout (hung)")
    if ex.status == 0:
        return Verdict(LOST, f"no response: {ex.transport_error or 'unknown'}")
    if ex.status != 200:
        err = openai_error(_json(ex.body))
        if ex.status in _CLEAN_STATUS and err is not None and ex.transport_error is None:
            return Verdict(_CLEAN_STATUS[ex.status], f"{ex.status} {err['type']}: {err['message'][:120]}")
        return Verdict(LOST, f"HTTP {ex.status}: {ex.body[:200].decode(errors='replace')}"
                             + (f" ({ex.transport_error})" if ex.transport_error else ""))
    if not ex.events and ex.kind != PLAIN and not ex.body:
        return Verdict(LOST, f"200 with an empty body{': ' + ex.transport_error if ex.transport_error else ''}")
    if ex.events:
        return _judge_stream(ex)
    obj = _json(ex.body)
    if ex.transport_error is not None or not isinstance(obj, dict):
        return Verdict(LOST, f"200 with an unreadable body ({ex.transport_error or 'not JSON'})")
    choices = obj.get("choices") or []
    if choices and choices[0].get("finish_reason") in ("stop", "length") and "usage" in obj:
        return Verdict(COMPLETED, choices[0]["finish_reason"], obj.get("id"))
    return Verdict(LOST, f"200 without a finished choice: {ex.body[:200].decode(errors='replace')}")


def _judge_stream(ex: Exchange) -> Verdict:
    rid, finish = None, None
    for i, data in enumerate(ex.events):
        if data == "[DONE]":
            if i != len(ex.events) - 1:
                return Verdict(LOST, "events after [DONE]", rid)
            if finish is None:
                return Verdict(LOST, "[DONE] without a finish_reason", rid)
            return Verdict(COMPLETED, finish, rid)
        obj = _json(data)
        if not isinstance(obj, dict):
            return Verdict(LOST, f"unparsable event: {data[:120]}", rid)
        if "error" in obj:
            err = openai_error(obj)
            if err is None:
                return Verdict(LOST, f"error event without OpenAI's body: {data[:200]}", rid)
            if i != len(ex.events) - 1:
                return Verdict(LOST, "events after the error event", rid)
            return Verdict(STREAM_ERROR, f"{err['type']}: {err['message'][:120]}", rid)
        rid = rid or obj.get("id")
        for choice in obj.get("choices") or []:
            finish = choice.get("finish_reason") or finish
    why = ex.transport_error or "the stream ended"
    return Verdict(LOST, f"truncated stream without an error event ({why})", rid)
