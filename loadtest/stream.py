"""One streaming chat request's timings, from the server-sent events of /v1/chat/completions. Shared by the
Locust file (gevent + requests) and the sweep (asyncio + httpx): each feeds lines with their arrival time.

TTFT is the time from sending the request to the first chunk carrying content; inter-token latencies are the
gaps between content chunks; TPOT is (end - first token) / (output tokens - 1), the vLLM benchmark's
definitions. Output tokens come from the final usage chunk (stream_options.include_usage) when present.
"""
from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Optional


def chat_request(model: str, messages: list[dict], max_tokens: int, temperature: float = 0.0,
                 seed: Optional[int] = None) -> dict:
    body = {"model": model, "messages": messages, "max_tokens": int(max_tokens), "temperature": float(temperature),
            "stream": True, "stream_options": {"include_usage": True}}
    if seed is not None:
        body["seed"] = int(seed)
    return body


@dataclass
class StreamResult:
    t_start: float
    status: int = 0
    t_first: Optional[float] = None
    t_end: Optional[float] = None
    chunk_times: list[float] = field(default_factory=list)
    text: str = ""
    prompt_tokens: Optional[int] = None
    completion_tokens: Optional[int] = None
    finish_reason: Optional[str] = None
    error: Optional[str] = None  # an error event in the stream, a bad status body, or a broken connection
    done: bool = False  # saw "data: [DONE]"

    # ---- feeding -------------------------------------------------------------------------------------------
    def feed(self, line: str, t: float) -> None:
        """One line of the SSE body, received at time t."""
        if not line.startswith("data:"):
            return  # blank separators, comments, event names
        data = line[5:].strip()
        if data == "[DONE]":
            self.done = True
            self.t_end = t
            return
        try:
            obj = json.loads(data)
        except json.JSONDecodeError:
            self.error = f"unparsable event: {data[:200]}"
            return
        if "error" in obj:
            self.error = f"stream error: {obj['error'].get('message', obj['error'])}"
            self.t_end = t
            return
        for choice in obj.get("choices") or []:
            content = (choice.get("delta") or {}).get("content")
            if content:
                if self.t_first is None:
                    self.t_first = t
                self.chunk_times.append(t)
                self.text += content
            if choice.get("finish_reason"):
                self.finish_reason = choice["finish_reason"]
        if obj.get("usage"):
            self.prompt_tokens = obj["usage"].get("prompt_tokens")
            self.completion_tokens = obj["usage"].get("completion_tokens")

    def fail(self, message: str, t: float) -> None:
        self.error = message
        self.t_end = t

    # ---- outcome -------------------------------------------------------------------------------------------
    @property
    def rejected(self) -> bool:
        """Admission control said no (429): a rejection, not a failure."""
        return self.status == 429

    @property
    def ok(self) -> bool:
        return self.status == 200 and self.error is None and self.done and self.finish_reason is not None

    @property
    def output_tokens(self) -> int:
        return self.completion_tokens if self.completion_tokens is not None else len(self.chunk_times)

    @property
    def ttft(self) -> Optional[float]:
        return None if self.t_first is None else self.t_first - self.t_start

    @property
    def e2e(self) -> Optional[float]:
        return None if self.t_end is None else self.t_end - self.t_start

    @property
    def tpot(self) -> Optional[float]:
        if self.t_first is None or self.t_end is None or self.output_tokens < 2:
            return None
        return (self.t_end - self.t_first) / (self.output_tokens - 1)

    @property
    def itls(self) -> list[float]:
        return [b - a for a, b in zip(self.chunk_times, self.chunk_times[1:])]
