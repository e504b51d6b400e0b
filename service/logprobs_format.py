"""OpenAI's log-probability layouts, built from the engine replica's per-token entries
({"token": text, "logprob": float or None, "top": [[text, logprob], ...] or None}, service/replica.py).

Completions: {"tokens", "token_logprobs", "top_logprobs": [{text: logprob}], "text_offset"}, where each
token's top_logprobs also holds the token itself (as vLLM's) and text_offset counts characters of the
returned text (the echoed prompt first). Chat: {"content": [{"token", "logprob", "bytes", "top_logprobs"}]}.
"""
from __future__ import annotations

from typing import Optional


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
