"""Tokenizer used by the engine: a thin wrapper over a `tokenizers.Tokenizer` plus chat templating.

Every loader (HF folder, GGUF, random weights) produces one of these; it serializes to JSON so the
GGUF cache can store the converted tokenizer next to the weights.
"""
from __future__ import annotations

import json
from datetime import datetime
from typing import Iterable, Optional, Sequence

import jinja2
import jinja2.ext
import jinja2.sandbox
import tokenizers
from tokenizers import decoders, models, pre_tokenizers


def bytes_to_unicode() -> dict[int, str]:
    """GPT-2's reversible byte -> printable character table used by byte-level BPE vocabularies."""
    printable = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + list(range(ord("®"), ord("ÿ") + 1))
    table, extra = {}, 0
    for b in range(256):
        if b in printable:
            table[b] = chr(b)
        else:  # control/space bytes are moved past 255 so every token is visible text
            table[b] = chr(256 + extra)
            extra += 1
    return table


def _raise_exception(message: str):
    raise jinja2.exceptions.TemplateError(message)


def _tojson(value, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
    # Like HF: no HTML escaping (jinja's built-in tojson escapes '<', '>' and '&').
    return json.dumps(value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


def _strftime_now(fmt: str) -> str:
    return datetime.now().strftime(fmt)


_JINJA_ENV: Optional[jinja2.sandbox.ImmutableSandboxedEnvironment] = None


def _jinja_env() -> jinja2.sandbox.ImmutableSandboxedEnvironment:
    global _JINJA_ENV
    if _JINJA_ENV is None:
        # Same options as HF transformers so templates render byte-identically.
        env = jinja2.sandbox.ImmutableSandboxedEnvironment(
            trim_blocks=True, lstrip_blocks=True, extensions=[jinja2.ext.loopcontrols]
        )
        env.filters["tojson"] = _tojson
        env.globals["raise_exception"] = _raise_exception
        env.globals["strftime_now"] = _strftime_now
        _JINJA_ENV = env
    return _JINJA_ENV


class Tokenizer:
    """Text <-> token ids, chat templating and the model's stop tokens.

    BOS: whatever the backend's post-processor does when `add_special_tokens=True`. Loaders bake their
    BOS rule into the post-processor (HF folders: tokenizer.json as shipped; GGUF: add BOS only when
    `tokenizer.ggml.add_bos_token` says so), which matches transformers for the same model.
    """

    def __init__(
        self,
        backend: tokenizers.Tokenizer,
        *,
        chat_template: Optional[str] = None,
        bos_token_id: Optional[int] = None,
        eos_token_ids: Iterable[int] = (),
    ):
        self.backend = backend
        self.chat_template = chat_template
        self.bos_token_id = bos_token_id
        self.eos_token_ids: list[int] = list(dict.fromkeys(int(i) for i in eos_token_ids))

    # ---- basic properties -------------------------------------------------------------------
    @property
    def vocab_size(self) -> int:
        return self.backend.get_vocab_size(with_added_tokens=True)

    @property
    def bos_token(self) -> Optional[str]:
        return None if self.bos_token_id is None else self.backend.id_to_token(self.bos_token_id)

    @property
    def eos_token_id(self) -> Optional[int]:
        return self.eos_token_ids[0] if self.eos_token_ids else None

    @property
    def eos_token(self) -> Optional[str]:
        return None if self.eos_token_id is None else self.backend.id_to_token(self.eos_token_id)

    def token_to_id(self, token: str) -> Optional[int]:
        return self.backend.token_to_id(token)

    # ---- encode / decode --------------------------------------------------------------------
    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return self.backend.encode(text, add_special_tokens=add_special_tokens).ids

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        return self.backend.decode(list(ids), skip_special_tokens=skip_special_tokens)

    def apply_chat_template(self, messages: list[dict], add_generation_prompt: bool = True, **kwargs) -> str:
        if not self.chat_template:
            raise ValueError("this tokenizer has no chat template; encode the prompt text directly")
        template = _jinja_env().from_string(self.chat_template)
        return template.render(
            messages=messages,
            add_generation_prompt=add_generation_prompt,
            bos_token=self.bos_token or "",
            eos_token=self.eos_token or "",
            **kwargs,
        )

    # ---- serialization (for the loader cache) -----------------------------------------------
    def to_json(self) -> str:
        return json.dumps(
            {
                "backend": self.backend.to_str(),
                "chat_template": self.chat_template,
                "bos_token_id": self.bos_token_id,
                "eos_token_ids": self.eos_token_ids,
            }
        )

    @classmethod
    def from_json(cls, text: str) -> "Tokenizer":
        d = json.loads(text)
        return cls(
            tokenizers.Tokenizer.from_str(d["backend"]),
            chat_template=d.get("chat_template"),
            bos_token_id=d.get("bos_token_id"),
            eos_token_ids=d.get("eos_token_ids") or (),
        )

    @classmethod
    def byte_level(cls, vocab_size: int = 256, eos_token_ids: Iterable[int] = ()) -> "Tokenizer":
        """A trivial tokenizer for random-weight models: one token per UTF-8 byte (ids 0-255), and
        ids 256..vocab_size-1 as placeholder tokens `<|extra_N|>` so any sampled id decodes."""
        table = bytes_to_unicode()
        vocab = {table[b]: b for b in range(min(256, vocab_size))}
        for i in range(len(vocab), vocab_size):
            vocab[f"<|extra_{i}|>"] = i
        backend = tokenizers.Tokenizer(models.BPE(vocab=vocab, merges=[]))
        backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
        backend.decoder = decoders.ByteLevel()
        return cls(backend, eos_token_ids=eos_token_ids)


class IncrementalDetokenizer:
    """Streams text token by token without ever emitting half of a multi-byte character.

    Prefix/read-offset technique: decode a small window `ids[prefix:]` and compare with the decode of
    `ids[prefix:read]` (text already emitted). Decoding a window rather than single tokens keeps
    context-dependent decoders (SentencePiece's leading-space strip) correct; a trailing U+FFFD means the
    last token ended inside a UTF-8 sequence, so we wait for the next token.
    """

    def __init__(self, tokenizer: Tokenizer, skip_special_tokens: bool = True):
        self.tokenizer = tokenizer
        self.skip_special_tokens = skip_special_tokens
        self.ids: list[int] = []
        self._prefix = 0  # start of the decode window
        self._read = 0  # tokens before this are already emitted
        self._text: list[str] = []

    def _decode(self, ids: Sequence[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=self.skip_special_tokens)

    def add(self, token_id: int) -> str:
        self.ids.append(int(token_id))
        prefix_text = self._decode(self.ids[self._prefix : self._read])
        full_text = self._decode(self.ids[self._prefix :])
        if len(full_text) > len(prefix_text) and not full_text.endswith("\ufffd"):
            new = full_text[len(prefix_text) :]
            self._prefix, self._read = self._read, len(self.ids)
            self._text.append(new)
            return new
        return ""

    def flush(self) -> str:
        """Emit whatever is still held back (e.g. a sequence that really ends in broken UTF-8)."""
        prefix_text = self._decode(self.ids[self._prefix : self._read])
        full_text = self._decode(self.ids[self._prefix :])
        new = full_text[len(prefix_text) :] if full_text.startswith(prefix_text) else ""
        self._prefix = self._read = len(self.ids)
        if new:
            self._text.append(new)
        return new

    @property
    def text(self) -> str:
        return "".join(self._text)
