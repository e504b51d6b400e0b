"""Tokenizer used by the engine: a thin wrapper over a `tokenizers.Tokenizer` plus chat templating.

Every loader (HF folder, GGUF, random weights) produces one of these; it serializes to JSON so the
GGUF cache can store the converted tokenizer next to the weights.
"""
from __future__ import annotations

import json
import weakref
from datetime import datetime
from typing import Iterable, Optional, Sequence, Union

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

    @property
    def supports_tools(self) -> bool:
        """Does the chat template render a `tools` list (it reads a variable of that name)?"""
        if not self.chat_template:
            return False
        import jinja2.meta

        return "tools" in jinja2.meta.find_undeclared_variables(_jinja_env().parse(self.chat_template))

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


class _DecodeFacts:
    """What the catch-up of IncrementalDetokenizer may assume about one tokenizer's decode.

    `byte_level`: the backend's only decoder is ByteLevel, so (as `tokenizers` 0.23 decodes) model tokens'
    bytes are joined into runs and each run is decoded as lossy UTF-8; an added token that is not skipped
    ends the run and contributes its (non-empty) content; a skipped special token or an unknown id
    contributes nothing and does not end the run. Then, for any ids X, Y:
      (a) a token whose own decode is "" can be dropped without changing any decode;
      (b) decode(X + Y) == decode(X) + decode(Y) whenever decode(X) does not end in U+FFFD (X then ends on a
          complete character or an added token, where decoding starts afresh);
      (c) a window holding a token whose own decode is non-empty decodes to non-empty text.
    tests/test_lazy_text.py checks the catch-up built on them against token-by-token decoding on random ids.
    """

    def __init__(self, tokenizer: Tokenizer):
        self.tokenizer = tokenizer
        backend = getattr(tokenizer, "backend", None)
        self.byte_level = (
            isinstance(getattr(backend, "decoder", None), decoders.ByteLevel)
            and all(t.content for t in backend.get_added_tokens_decoder().values())
        )
        # skip_special_tokens -> {token id: does it alone decode to ""}, filled as ids come up
        self.empty_ids: dict[bool, dict[int, bool]] = {True: {}, False: {}}

    def empty(self, token_id: int, skip_special_tokens: bool) -> bool:
        """Does this token alone decode to ""? (cached: one decode per distinct id)"""
        known = self.empty_ids[skip_special_tokens]
        e = known.get(token_id)
        if e is None:
            e = known[token_id] = self.tokenizer.decode([token_id], skip_special_tokens=skip_special_tokens) == ""
        return e


_TOO_MANY = object()  # IncrementalDetokenizer._last_emit gave up

_FACTS: "weakref.WeakKeyDictionary[Tokenizer, _DecodeFacts]" = weakref.WeakKeyDictionary()


def _decode_facts(tokenizer: Tokenizer) -> _DecodeFacts:
    facts = _FACTS.get(tokenizer)
    if facts is None:
        facts = _FACTS[tokenizer] = _DecodeFacts(tokenizer)
    return facts


class IncrementalDetokenizer:
    """Streams text token by token without ever emitting half of a multi-byte character.

    Prefix/read-offset technique: decode a small window `ids[prefix:]` and compare with the decode of
    `ids[prefix:read]` (text already emitted). Decoding a window rather than single tokens keeps
    context-dependent decoders (SentencePiece's leading-space strip) correct; a trailing U+FFFD means the
    last token ended inside a UTF-8 sequence, so we wait for the next token.

    Lazy use: `push` only records a token; `catch_up` later emits exactly what `add` would have emitted for
    each pending token in turn, and leaves the same state. `add` is `push` + `catch_up`.
    """

    # Byte-level catch-up gives up (and steps token by token) after this many trial decodes.
    MAX_TRIALS = 8

    def __init__(self, tokenizer: Tokenizer, skip_special_tokens: bool = True):
        self.tokenizer = tokenizer
        self.skip_special_tokens = skip_special_tokens
        self.ids: list[int] = []
        self._prefix = 0  # start of the decode window
        self._read = 0  # tokens before this are already emitted
        self.num_done = 0  # tokens before this went through the emit rule (the rest are pending); read-only
        self._prefix_text: Optional[str] = None  # decode of ids[_prefix:_read], while still valid
        self._text: list[str] = []
        self._facts = _decode_facts(tokenizer)
        self._byte_level = self._facts.byte_level
        self._empty = self._facts.empty_ids[skip_special_tokens]

    def _decode(self, ids: Sequence[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=self.skip_special_tokens)

    def push(self, token_id: int) -> None:
        """Record a token; its text is worked out by the next catch_up."""
        self.ids.append(int(token_id))

    def add(self, token_id: int) -> str:
        self.push(token_id)
        return self.catch_up()

    def catch_up(self, upto: Optional[int] = None) -> str:
        """Run the pending tokens before `upto` (default: all) through the emit rule; returns the new text,
        the concatenation of what `add` returned for each of them one by one."""
        end = len(self.ids) if upto is None else upto
        if end <= self.num_done:
            return ""
        new = self._catch_up_byte_level(end) if self._byte_level else None
        if new is None:
            new = "".join([self._step(t) for t in range(self.num_done + 1, end + 1)])
        if new:
            self._text.append(new)
        return new

    def _step(self, t: int) -> str:
        """The emit rule for token t-1, ids[:t] known: the reference, one token at a time."""
        if self._prefix_text is None:
            self._prefix_text = self._decode(self.ids[self._prefix : self._read])
        prefix_text = self._prefix_text
        full_text = self._decode(self.ids[self._prefix : t])
        self.num_done = t
        if len(full_text) > len(prefix_text) and not full_text.endswith("\ufffd"):
            self._prefix, self._read, self._prefix_text = self._read, t, None
            return full_text[len(prefix_text) :]
        return ""

    def _catch_up_byte_level(self, end: int) -> Optional[str]:
        """The same as stepping tokens num_done+1..end, in a couple of decodes; None if it gave up (unchanged).

        With _DecodeFacts' (a)-(c), by induction over the steps: the rule emits after token t-1 iff that
        token's own decode is non-empty and decode(ids[read:t]) does not end in U+FFFD, `read` being the read
        offset when the catch-up starts; the pieces emitted up to the last such t join to
        decode(ids[read:t]); and the rule leaves read = the last such t, prefix = the one before it (or the
        old read). So: scan back from `end` for the last two emit points.
        """
        read = self._read
        last = self._last_emit(end, read)
        if last is _TOO_MANY:
            return None
        before = None
        if last is not None and last[0] - 1 > self.num_done:
            before = self._last_emit(last[0] - 1, read)
            if before is _TOO_MANY:
                return None
        self.num_done = end
        if last is None:
            return ""
        self._prefix = before[0] if before is not None else read
        self._read, self._prefix_text = last[0], None
        return last[1]

    def _last_emit(self, hi: int, read: int) -> Union[tuple[int, str], None, object]:
        """The last t in (num_done, hi] after which the rule emits, with decode(ids[read:t]); None if there is
        none; _TOO_MANY if finding out takes more than MAX_TRIALS decodes."""
        ids, empty, trials = self.ids, self._empty, 0
        for t in range(hi, self.num_done, -1):
            token_id = ids[t - 1]
            e = empty.get(token_id)
            if e is None:
                e = self._facts.empty(token_id, self.skip_special_tokens)
            if e:
                continue
            if trials == self.MAX_TRIALS:
                return _TOO_MANY
            trials += 1
            text = self.tokenizer.decode(ids[read:t], skip_special_tokens=self.skip_special_tokens)
            if not text.endswith("\ufffd"):
                return t, text
        return None

    def text_of_first(self, n: int) -> str:
        """The text the first n tokens emitted, worked out afresh (for a point catch_up already passed)."""
        again = IncrementalDetokenizer(self.tokenizer, self.skip_special_tokens)
        again.ids = self.ids[:n]
        return again.text

    def flush(self) -> str:
        """Emit whatever is still held back (e.g. a sequence that really ends in broken UTF-8)."""
        self.catch_up()
        prefix_text = self._decode(self.ids[self._prefix : self._read])
        full_text = self._decode(self.ids[self._prefix :])
        new = full_text[len(prefix_text) :] if full_text.startswith(prefix_text) else ""
        self._prefix = self._read = len(self.ids)
        self._prefix_text = None
        if new:
            self._text.append(new)
        return new

    @property
    def text(self) -> str:
        """Everything emitted so far, pending tokens included."""
        self.catch_up()
        return "".join(self._text)

