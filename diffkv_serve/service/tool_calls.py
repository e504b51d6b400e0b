"""The model's tool calls (Qwen / Hermes layout: `<tool_call>{"name": ..., "arguments": {...}}</tool_call>`)
read out of its reply as OpenAI `tool_calls`: whole replies, and streamed text where each call goes out as one
delta once its closing tag arrived. A block whose JSON is not a call stays in the text, as the model wrote it."""
from __future__ import annotations

import json
import re
import uuid
from typing import Optional

from diffkv_serve.service.structured_outputs import CALL_CLOSE, CALL_OPEN

_BLOCK = re.compile(re.escape(CALL_OPEN) + r"(.*?)" + re.escape(CALL_CLOSE), re.DOTALL)


def _call_of(body: str) -> Optional[dict]:
    """{"id", "type", "function": {"name", "arguments": JSON text}} from a block's JSON, or None."""
    try:
        obj = json.loads(body)
    except ValueError:
        return None
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str):
        return None
    args = obj.get("arguments", obj.get("parameters", {}))
    if isinstance(args, str):
        try:
            json.loads(args)
        except ValueError:
            return None
    else:
        args = json.dumps(args, ensure_ascii=False)
    return {"id": f"call_{uuid.uuid4().hex[:24]}", "type": "function",
            "function": {"name": obj["name"], "arguments": args}}


def parse_tool_calls(text: str) -> tuple[Optional[str], list[dict]]:
    """(the text outside the calls, stripped; None if empty, the calls)."""
    calls, kept, pos = [], [], 0
    for m in _BLOCK.finditer(text):
        call = _call_of(m.group(1))
        if call is None:
            continue
        kept.append(text[pos:m.start()])
        calls.append(call)
        pos = m.end()
    if not calls:
        return text, []
    kept.append(text[pos:])
    content = "".join(kept).strip()
    return content or None, calls


class ToolCallStream:
    """Streamed text in, (text to send on, calls completed) out: text that may be the start of a call is held
    back until it is known not to be one; a call goes out whole when its closing tag arrives."""

    def __init__(self) -> None:
        self.pending = ""
        self.in_call = False
        self.num_calls = 0

    def feed(self, text: str) -> tuple[str, list[dict]]:
        self.pending += text
        out, calls = [], []
        while True:
            if self.in_call:
                end = self.pending.find(CALL_CLOSE)
                if end < 0:
                    break
                block = self.pending[: end + len(CALL_CLOSE)]
                self.pending, self.in_call = self.pending[end + len(CALL_CLOSE):], False
                call = _call_of(block[len(CALL_OPEN): end])
                if call is None:
                    out.append(block)
                else:
                    calls.append({"index": self.num_calls, **call})
                    self.num_calls += 1
                continue
            start = self.pending.find(CALL_OPEN)
            if start >= 0:
                out.append(self.pending[:start])
                self.pending, self.in_call = self.pending[start:], True
                continue
            keep = _partial_open(self.pending)
            out.append(self.pending[: len(self.pending) - keep])
            self.pending = self.pending[len(self.pending) - keep:]
            break
        text_out = "".join(out)
        if self.num_calls and not text_out.strip():
            text_out = ""  # the newlines between calls are layout, not content
        return text_out, calls

    def finish(self) -> str:
        """What is still held back (an unfinished call or a partial tag) goes out as text."""
        rest, self.pending, self.in_call = self.pending, "", False
        return rest if not (self.num_calls and not rest.strip()) else ""


def _partial_open(text: str) -> int:
    """Length of the longest end of `text` that begins CALL_OPEN."""
    for n in range(min(len(text), len(CALL_OPEN) - 1), 0, -1):
        if CALL_OPEN.startswith(text[-n:]):
            return n
    return 0
