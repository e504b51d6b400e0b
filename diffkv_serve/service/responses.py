"""The response bodies of /v1/chat/completions and /v1/completions (whole, and streamed chunk by chunk), with
OpenAI's log-probability layouts built from the engine replica's per-token entries
({"token": text, "logprob": float or None, "top": [[text, logprob], ...] or None}, diffkv_serve/service/replica.py).

Completions: {"tokens", "token_logprobs", "top_logprobs": [{text: logprob}], "text_offset"}, where each
token's top_logprobs also holds the token itself (as vLLM's) and text_offset counts characters of the
returned text (the echoed prompt first). Chat: {"content": [{"token", "logprob", "bytes", "top_logprobs"}]}.
Chat with tools (tool_choice not "none"): tool calls in the reply become `tool_calls` (service.tool_calls) and
finish_reason "tool_calls".
"""
from __future__ import annotations

from typing import Callable, Optional

from diffkv_serve.service.protocol import ChatCompletionRequest, CompletionRequest
from diffkv_serve.service.structured_outputs import tools_active
from diffkv_serve.service.tool_calls import ToolCallStream, parse_tool_calls

# render(kind, **kw): kind "full" (text, finish_reason, usage, rid, items: every replica item), "role" (the
# chat stream's first chunk), "delta" (text, finish_reason, item: one replica item) or "usage" (the last chunk)
Renderer = Callable[..., Optional[dict]]


class CompletionLogprobs:
    """Builds the completions object chunk by chunk, carrying text_offset across chunks of one response."""

    def __init__(self) -> None:
        self.offset = 0

    def render(self, entries: list[dict]) -> dict:
        out: dict = {"tokens": [], "token_logprobs": [], "top_logprobs": [], "text_offset": []}
        for e in entries:
            out["tokens"].append(e["token"])
            out["token_logprobs"].append(e["logprob"])
            out["text_offset"].append(self.offset)
            self.offset += len(e["token"])
            if e["logprob"] is None:  # the prompt's first token: nothing before it to predict it
                out["top_logprobs"].append(None)
            else:
                top = {t: lp for t, lp in (e["top"] or [])}
                top.setdefault(e["token"], e["logprob"])
                out["top_logprobs"].append(top)
        return out


def _chat_token(token: str, logprob: float) -> dict:
    return {"token": token, "logprob": logprob, "bytes": list(token.encode("utf-8"))}


def chat_logprobs(entries: list[dict]) -> dict:
    return {"content": [{**_chat_token(e["token"], e["logprob"]),
                         "top_logprobs": [_chat_token(t, lp) for t, lp in (e["top"] or [])]} for e in entries]}


def entries_of(items: list[dict]) -> list[dict]:
    """The generated tokens' entries over the items of one choice."""
    return [e for it in items for e in it.get("logprobs") or []]


def by_choice(items: list[dict]) -> list[tuple[int, list[dict]]]:
    """A whole response's replica items grouped by choice index (n > 1 interleaves them), in index order."""
    groups: dict[int, list[dict]] = {}
    for it in items:
        groups.setdefault(it.get("index", 0), []).append(it)
    return sorted(groups.items())


def _text(items: list[dict]) -> str:
    return "".join(it["text"] for it in items)


def _finish_reason(items: list[dict]) -> Optional[str]:
    return next((it["finish_reason"] for it in reversed(items) if it.get("finish_reason")), None)


def _with_calls(finish_reason: Optional[str], calls: bool) -> Optional[str]:
    return "tool_calls" if calls and finish_reason == "stop" else finish_reason


def chat_renderer(body: ChatCompletionRequest, created: int) -> Renderer:
    model = body.model
    tools = tools_active(body.tools, body.tool_choice)  # the reply is read for tool calls
    calls_streams: dict[int, ToolCallStream] = {}  # one per choice: n > 1 interleaves their deltas

    def logprobs(items: list[dict]) -> Optional[dict]:
        return chat_logprobs(entries_of(items)) if body.logprobs else None

    def full_message(text: str, finish_reason: Optional[str]) -> tuple[dict, Optional[str]]:
        if not tools:
            return {"role": "assistant", "content": text}, finish_reason
        content, calls = parse_tool_calls(text)
        message = {"role": "assistant", "content": content}
        if calls:
            message["tool_calls"] = calls
        return message, _with_calls(finish_reason, bool(calls))

    def delta_of(text: str, finish_reason: Optional[str], index: int) -> tuple[dict, Optional[str]]:
        if not tools:
            return ({"content": text} if text else {}), finish_reason
        calls_stream = calls_streams.setdefault(index, ToolCallStream())
        content, calls = calls_stream.feed(text)
        if finish_reason is not None:
            content += calls_stream.finish()
        delta: dict = {"content": content} if content else {}
        if calls:
            delta["tool_calls"] = calls
        return delta, _with_calls(finish_reason, calls_stream.num_calls > 0)

    def render(kind: str, **kw) -> dict:
        if kind == "full":
            return {"id": kw["rid"], "object": "chat.completion", "created": created, "model": model,
                    "choices": [{"index": i, "message": message, "logprobs": logprobs(its), "finish_reason": fr}
                                for i, its in by_choice(kw["items"])
                                for message, fr in [full_message(_text(its), _finish_reason(its))]],
                    "usage": kw["usage"].model_dump()}
        chunk = {"id": kw["rid"], "object": "chat.completion.chunk", "created": created, "model": model,
                 "choices": []}
        if kind == "role":
            chunk["choices"] = [{"index": i, "delta": {"role": "assistant", "content": ""}, "logprobs": None,
                                 "finish_reason": None} for i in range(body.n)]
        elif kind == "delta":
            index = kw["item"].get("index", 0)
            delta, finish_reason = delta_of(kw["text"], kw["finish_reason"], index)
            chunk["choices"] = [{"index": index, "delta": delta, "logprobs": logprobs([kw["item"]]),
                                 "finish_reason": finish_reason}]
        if kw.get("usage_field"):
            chunk["usage"] = kw["usage"].model_dump() if kw.get("usage") else None
        return chunk

    return render


def completion_renderer(body: CompletionRequest, created: int) -> Renderer:
    model = body.model
    offsets: dict[int, CompletionLogprobs] = {}  # per choice: text_offset runs on over the chunks of a stream
    prompt_entries: list = []  # echo with logprobs: the prompt's entries, sent once (with choice 0's first item)

    def choice(index: int, items: list[dict]) -> dict:
        first = items[0]
        if "prompt_logprobs" in first:
            prompt_entries[:] = first["prompt_logprobs"]
        echoed = body.echo and "prompt_text" in first  # the choice's first item: its text starts with the prompt
        text = (first["prompt_text"] if echoed else "") + _text(items)
        lp = None
        if body.logprobs is not None:
            lp = offsets.setdefault(index, CompletionLogprobs()).render(
                (list(prompt_entries) if echoed else []) + entries_of(items))
        return {"index": index, "text": text, "logprobs": lp, "finish_reason": _finish_reason(items)}

    def render(kind: str, **kw) -> Optional[dict]:
        if kind == "role":
            return None  # completions have no role chunk
        obj = {"id": kw["rid"], "object": "text_completion", "created": created, "model": model, "choices": []}
        if kind == "full":
            groups = by_choice(kw["items"])
            for _, its in groups:  # choice 0's first item carries the prompt's entries for every choice
                if "prompt_logprobs" in its[0]:
                    prompt_entries[:] = its[0]["prompt_logprobs"]
            obj["choices"] = [choice(i, its) for i, its in groups]
        elif kind == "delta":
            obj["choices"] = [choice(kw["item"].get("index", 0), [kw["item"]])]
        if kind == "full":
            obj["usage"] = kw["usage"].model_dump()
        elif kw.get("usage_field"):
            obj["usage"] = kw["usage"].model_dump() if kw.get("usage") else None
        return obj

    return render
