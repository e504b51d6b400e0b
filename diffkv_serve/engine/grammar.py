"""Structured outputs through llguidance: grammars compiled against the model's tokenizer, one matcher per
request, and each step's allowed-token bitmasks for the sampler.

llguidance was chosen by benchmarks/grammar_libraries.py (the embedded 49k vocabulary, CPU): no dependencies,
it reads our `tokenizers` JSON as it is, compiles a schema in under a millisecond, computes a mask in ~6-10 us
per token, says why a schema does not compile, and its Lark grammars embed JSON schemas (tool calls).

The host computes a step's masks on a worker thread (llguidance releases the GIL) while the model runs the
forward pass; the sampler waits for them only when it needs them (TokenMasks.result)."""
from __future__ import annotations

import json
import threading
import weakref
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Optional

import torch

from diffkv_serve.engine.errors import InvalidRequestError
from diffkv_serve.engine.structured_outputs import FIELD, StructuredOutputsParams

if TYPE_CHECKING:
    import llguidance

    from diffkv_serve.engine.sequence import Sequence
    from diffkv_serve.engine.tokenizer import Tokenizer


def lark_grammar(spec: StructuredOutputsParams) -> str:
    """The request's constraint as one llguidance grammar (JSON text of a grammar list, or Lark)."""
    import llguidance

    M = llguidance.LLMatcher
    try:
        if spec.json is not None or spec.json_object:
            schema = spec.json if spec.json is not None else {"type": "object"}
            return M.grammar_from_json_schema(schema, defaults={"whitespace_flexible": spec.whitespace_flexible})
        if spec.regex is not None:
            return M.grammar_from_regex(spec.regex)
        if spec.choice is not None:
            return "start: " + " | ".join(json.dumps(c) for c in spec.choice) + "\n"
        return M.grammar_from_lark(spec.grammar)
    except Exception as e:  # noqa: BLE001 - llguidance reports a bad grammar by any exception type
        raise InvalidRequestError(f"{FIELD}: the constraint does not compile: {e}", FIELD) from e


class GrammarCompiler:
    """One per tokenizer: llguidance's view of the vocabulary (built once, ~2 s for 49k tokens) and matchers."""

    def __init__(self, tokenizer: "Tokenizer", vocab_size: int):
        import llguidance

        self._ll = llguidance
        self.vocab_size = vocab_size  # the logits' width (may exceed the tokenizer's)
        self.tokenizer = llguidance.LLTokenizer(tokenizer.backend.to_str(), n_vocab=vocab_size,
                                                eos_token=list(tokenizer.eos_token_ids) or None)

    def matcher(self, spec: StructuredOutputsParams) -> "llguidance.LLMatcher":
        """A fresh matcher for one request; a grammar that does not compile raises InvalidRequestError."""
        grammar = lark_grammar(spec)
        M = self._ll.LLMatcher
        try:
            err = M.validate_grammar(grammar, self.tokenizer)
            m = None if err else M(self.tokenizer, grammar, log_level=0)
        except Exception as e:  # noqa: BLE001
            err = str(e)
        if err:
            raise InvalidRequestError(f"{FIELD}: the constraint does not compile: {err}", FIELD)
        if m.is_error():
            raise InvalidRequestError(f"{FIELD}: the constraint does not compile: {m.get_error()}", FIELD)
        return m


_COMPILERS: "weakref.WeakKeyDictionary[Tokenizer, dict[int, GrammarCompiler]]" = weakref.WeakKeyDictionary()
_COMPILERS_LOCK = threading.Lock()


def compiler_for(tokenizer: "Tokenizer", vocab_size: int) -> GrammarCompiler:
    """Shared by every engine on the same tokenizer (building it is the slow part)."""
    with _COMPILERS_LOCK:
        per = _COMPILERS.setdefault(tokenizer, {})
        if vocab_size not in per:
            per[vocab_size] = GrammarCompiler(tokenizer, vocab_size)
        return per[vocab_size]


def bitmask_words(vocab_size: int) -> int:
    return (vocab_size + 31) // 32


_POOL: Optional[ThreadPoolExecutor] = None
_EXECUTOR = None  # llguidance.LLExecutor: its own threads fill the rows in parallel


def _pool() -> ThreadPoolExecutor:
    global _POOL, _EXECUTOR
    if _POOL is None:
        import llguidance

        _EXECUTOR = llguidance.LLExecutor(num_threads=2)
        _POOL = ThreadPoolExecutor(1, thread_name_prefix="grammar-mask")
    return _POOL


def _fill(matchers: list, vocab_size: int) -> torch.Tensor:
    mask = torch.zeros(len(matchers), bitmask_words(vocab_size), dtype=torch.int32)
    _EXECUTOR.unsafe_compute_mask_ptr([(m, i) for i, m in enumerate(matchers)], mask.data_ptr(),
                                      mask.shape[1] * 4, len(matchers))
    return mask


@dataclass
class TokenMasks:
    """The rows of one step that a grammar restricts, and their allowed tokens: bitmask [len(rows), words]
    int32 on the host, bit t % 32 of word t // 32 set when token t may come next. Built by start() on a
    worker thread; picklable once resolved (the tensor-parallel executor ships it to its ranks)."""

    rows: list[int]
    vocab_size: int
    bitmask: Optional[torch.Tensor] = None
    _future: Optional[Future] = field(default=None, repr=False, compare=False)

    @classmethod
    def start(cls, seqs: list["Sequence"], vocab_size: int) -> Optional["TokenMasks"]:
        """Begin computing the masks of the rows with a grammar (None when no row has one)."""
        rows = [i for i, s in enumerate(seqs) if s.grammar is not None]
        if not rows:
            return None
        matchers = [seqs[i].grammar for i in rows]
        out = cls(rows, vocab_size)
        out._future = _pool().submit(_fill, matchers, vocab_size)
        return out

    def result(self) -> torch.Tensor:
        if self.bitmask is None:
            self.bitmask, self._future = self._future.result(), None
        return self.bitmask

    def take(self, keep: list[int]) -> Optional["TokenMasks"]:
        """The masks of batch rows `keep`, renumbered as the rows of a batch of those only."""
        pos = {r: j for j, r in enumerate(self.rows)}
        sel = [(new, pos[old]) for new, old in enumerate(keep) if old in pos]
        if not sel:
            return None
        return TokenMasks([n for n, _ in sel], self.vocab_size, self.result()[[j for _, j in sel]])

    def __getstate__(self) -> dict:
        return {"rows": self.rows, "vocab_size": self.vocab_size, "bitmask": self.result(), "_future": None}


_BYTE_BIAS: dict[tuple, torch.Tensor] = {}


def _byte_bias(device: torch.device, dtype: torch.dtype) -> torch.Tensor:
    """[256, 8]: for each byte value, 0 where its bit i is set, -inf where not."""
    key = (device, dtype)
    if key not in _BYTE_BIAS:
        bits = (torch.arange(256).unsqueeze(1) >> torch.arange(8)) & 1
        _BYTE_BIAS[key] = torch.zeros(256, 8).masked_fill(bits == 0, float("-inf")).to(device, dtype)
    return _BYTE_BIAS[key]


def apply_token_masks(logits: torch.Tensor, rows: torch.Tensor, bitmask: torch.Tensor) -> torch.Tensor:
    """logits with the tokens each masked row may not take set to -inf, in one batched op on those rows only;
    bitmask [R, words] int32 on the logits' device. Each byte of the mask looks up its 8 additive biases (0 or
    -inf), two to three times faster on CPU than unpacking bits and masked_fill (byte order: little-endian)."""
    R, V = bitmask.shape[0], logits.shape[1]
    codes = bitmask.contiguous().view(torch.uint8).view(-1).to(torch.int32)
    bias = _byte_bias(logits.device, logits.dtype).index_select(0, codes).view(R, -1)[:, :V]
    if R == logits.shape[0]:  # every row masked (rows are then 0..B-1, in order)
        return logits + bias
    return logits.index_add(0, rows, bias)
