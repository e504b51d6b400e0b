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


def entries_of(items: list[dict], echo: bool) -> tuple[list[dict], Optional[list[dict]]]:
    """(generated tokens' entries over all items, the prompt's when echoed with logprobs) or (.., None)."""
    gen = [e for it in items for e in it.get("logprobs") or []]
    prompt = items[0].get("prompt_logprobs") if echo and items else None
    return gen, prompt


def _with_calls(finish_reason: Optional[str], calls: bool) -> Optional[str]:
    return "tool_calls" if calls and finish_reason == "stop" else finish_reason


def chat_renderer(body: ChatCompletionRequest, created: int) -> Renderer:
    model = body.model
    tools = tools_active(body.tools, body.tool_choice)  # the reply is read for tool calls
    calls_stream = ToolCallStream()

    def logprobs(items: list[dict]) -> Optional[dict]:
        return chat_logprobs(entries_of(items, False)[0]) if body.logprobs else None

    def full_message(text: str, finish_reason: Optional[str]) -> tuple[dict, Optional[str]]:
        if not tools:
            return {"role": "assistant", "content": text}, finish_reason
        content, calls = parse_tool_calls(text)
        message = {"role": "assistant", "content": content}
        if calls:
            message["tool_calls"] = calls
        return message, _with_calls(finish_reason, bool(calls))

    def delta_of(text: str, finish_reason: Optional[str]) -> tuple[dict, Optional[str]]:
        if not tools:
            return ({"content": text} if text else {}), finish_reason
        content, calls = calls_stream.feed(text)
        if finish_reason is not None:
            content += calls_stream.finish()
        delta: dict = {"content": content} if content else {}
        if calls:
            delta["tool_calls"] = calls
        return delta, _with_calls(finish_reason, calls_stream.num_calls > 0)

    def render(kind: str, **kw) -> dict:
        if kind == "full":
            message, finish_reason = full_message(kw["text"], kw["finish_reason"])
            return {"id": kw["rid"], "object": "chat.completion", "created": created, "model": model,
                    "choices": [{"index": 0, "message": message,
                                 "logprobs": logprobs(kw["items"]), "finish_reason": finish_reason}],
                    "usage": kw["usage"].model_dump()}
        chunk = {"id": kw["rid"], "object": "chat.completion.chunk", "created": created, "model": model,
                 "choices": []}
        if kind == "role":
            chunk["choices"] = [{"index": 0, "delta": {"role": "assistant", "content": ""}, "logprobs": None,
                                 "finish_reason": None}]
        elif kind == "delta":
            delta, finish_reason = delta_of(kw["text"], kw["finish_reason"])
            chunk["choices"] = [{"index": 0, "delta": delta, "logprobs": logprobs([kw["item"]]),
                                 "finish_reason": finish_reason}]
        if kw.get("usage_field"):
            chunk["usage"] = kw["usage"].model_dump() if kw.get("usage") else None
        return chunk

    return render


def completion_renderer(body: CompletionRequest, created: int) -> Renderer:
    model = body.model
    offsets = CompletionLogprobs()  # text_offset runs on over the chunks of a stream

    def render(kind: str, **kw) -> Optional[dict]:
        if kind == "role":
            return None  # completions have no role chunk
        obj = {"id": kw["rid"], "object": "text_completion", "created": created, "model": model, "choices": []}
        if kind in ("full", "delta"):
            items = kw["items"] if kind == "full" else [kw["item"]]
            text = (items[0].get("prompt_text", "") if body.echo else "") + kw["text"]
            lp = None
            if body.logprobs is not None:
                gen, prompt = entries_of(items, body.echo)
                lp = offsets.render((prompt or []) + gen)
            obj["choices"] = [{"index": 0, "text": text, "logprobs": lp, "finish_reason": kw["finish_reason"]}]
        if kind == "full":
            obj["usage"] = kw["usage"].model_dump()
        elif kw.get("usage_field"):
            obj["usage"] = kw["usage"].model_dump() if kw.get("usage") else None
        return obj

    return render
