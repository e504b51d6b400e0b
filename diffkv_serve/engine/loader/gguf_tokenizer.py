"""Build a `Tokenizer` from GGUF `tokenizer.*` metadata.

Supported `tokenizer.ggml.model`: "gpt2" (byte-level BPE: tokens + merges) and "llama"
(SentencePiece-style BPE with byte fallback; merges derived from the token scores).
`tokenizer.ggml.pre` picks the pre-tokenizer split, following llama.cpp's table for that name.
"""
from __future__ import annotations

import warnings

import tokenizers
from tokenizers import AddedToken, Regex, decoders, models, normalizers, pre_tokenizers, processors

from diffkv_serve.engine.tokenizer import Tokenizer, bytes_to_unicode

# llama.cpp token types
NORMAL, UNKNOWN, CONTROL, USER_DEFINED, UNUSED, BYTE = 1, 2, 3, 4, 5, 6

# Control tokens that end a turn / the text: generation must stop on them even when the file's
# eos id names something else.
END_OF_GENERATION = {
    "<|im_end|>", "<|endoftext|>", "<|eot_id|>", "<|end_of_text|>", "<|eom_id|>", "<|end|>", "<end_of_turn>", "</s>",
}

_GPT2_SPLIT = r"'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+"
_LLAMA3_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_QWEN2_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
# pre name -> (split regex, digits one by one first?, NFC normalize?)  -- as in llama.cpp's llama-vocab.cpp
_PRE = {
    "default": (_GPT2_SPLIT, False, False),
    "gpt-2": (_GPT2_SPLIT, False, False),
    "gpt2": (_GPT2_SPLIT, False, False),
    "smollm": (_GPT2_SPLIT, True, False),
    "starcoder": (_GPT2_SPLIT, True, False),
    "refact": (_GPT2_SPLIT, True, False),
    "llama-bpe": (_LLAMA3_SPLIT, False, False),
    "llama3": (_LLAMA3_SPLIT, False, False),
    "llama-v3": (_LLAMA3_SPLIT, False, False),
    "smaug-bpe": (_LLAMA3_SPLIT, False, False),
    "dbrx": (_LLAMA3_SPLIT, False, False),
    "falcon3": (_LLAMA3_SPLIT, False, False),
    "qwen2": (_QWEN2_SPLIT, False, True),
    "deepseek-r1-qwen": (_QWEN2_SPLIT, False, True),
}
# llama.cpp matches whole words against the vocab before merging for Llama 3 ("ignore_merges" in HF).
_IGNORE_MERGES = {"llama-bpe", "llama3", "llama-v3", "smaug-bpe", "dbrx", "falcon3"}


def _byte_level_backend(md: dict, tokens: list[str], types: list[int]) -> tokenizers.Tokenizer:
    pre = md.get("tokenizer.ggml.pre", "default")
    if pre not in _PRE:
        warnings.warn(f"unknown GGUF pre-tokenizer {pre!r}; using GPT-2 splitting (tokenization may differ)")
    split, digits, nfc = _PRE.get(pre, _PRE["default"])
    alphabet = set(bytes_to_unicode().values())
    table = bytes_to_unicode()
    vocab: dict[str, int] = {}
    for i, (tok, typ) in enumerate(zip(tokens, types)):
        if typ == NORMAL and not set(tok) <= alphabet:  # mislabeled raw text: respell as bytes
            tok = "".join(table[b] for b in tok.encode("utf-8"))
        vocab.setdefault(tok, i)  # duplicates (padding fillers) keep their first id
    merges = [tuple(m.split(" ", 1)) for m in md.get("tokenizer.ggml.merges", [])]
    backend = tokenizers.Tokenizer(models.BPE(vocab=vocab, merges=merges, ignore_merges=pre in _IGNORE_MERGES))
    if nfc:
        backend.normalizer = normalizers.NFC()
    steps = [pre_tokenizers.Digits(individual_digits=True)] if digits else []
    if split == _GPT2_SPLIT:  # ByteLevel's built-in regex is exactly GPT-2's
        steps.append(pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True))
    else:
        steps += [pre_tokenizers.Split(Regex(split), behavior="isolated"), pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)]
    backend.pre_tokenizer = steps[0] if len(steps) == 1 else pre_tokenizers.Sequence(steps)
    backend.decoder = decoders.ByteLevel()
    return backend


def _spm_backend(md: dict, tokens: list[str], types: list[int]) -> tokenizers.Tokenizer:
    """SentencePiece BPE: a pair merges when the merged piece is in the vocab; higher score merges first."""
    scores = md.get("tokenizer.ggml.scores") or [0.0] * len(tokens)
    vocab: dict[str, int] = {}
    for i, tok in enumerate(tokens):
        vocab.setdefault(tok, i)
    ranked = []
    for tok, i in vocab.items():
        if types[i] != NORMAL or len(tok) < 2:
            continue
        for k in range(1, len(tok)):
            a, b = tok[:k], tok[k:]
            if a in vocab and b in vocab:
                ranked.append((-scores[i], vocab[a], vocab[b], a, b))
    merges = [(a, b) for *_, a, b in sorted(ranked)]
    unk_id = md.get("tokenizer.ggml.unknown_token_id", 0)
    backend = tokenizers.Tokenizer(
        models.BPE(vocab=vocab, merges=merges, unk_token=tokens[unk_id], fuse_unk=True, byte_fallback=True)
    )
    space_prefix = md.get("tokenizer.ggml.add_space_prefix", True)
    norm = [normalizers.Prepend("▁")] if space_prefix else []
    backend.normalizer = normalizers.Sequence(norm + [normalizers.Replace(" ", "▁")])
    dec = [decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse()]
    if space_prefix:
        dec.append(decoders.Strip(" ", 1, 0))
    backend.decoder = decoders.Sequence(dec)
    return backend


def tokenizer_from_gguf(md: dict, vocab_size: int) -> Tokenizer:
    """`md`: GGUF metadata as plain Python values. `vocab_size`: embedding rows (for a sanity check)."""
    kind = md.get("tokenizer.ggml.model")
    tokens: list[str] = md.get("tokenizer.ggml.tokens") or []
    if not tokens:
        raise ValueError("GGUF has no tokenizer.ggml.tokens; cannot build a tokenizer")
    types = list(md.get("tokenizer.ggml.token_type") or [NORMAL] * len(tokens))
    if kind == "gpt2":
        backend = _byte_level_backend(md, tokens, types)
        add_bos_default = False
    elif kind == "llama":
        backend = _spm_backend(md, tokens, types)
        add_bos_default = True  # SentencePiece Llama/Mistral files prepend <s>
    else:
        raise ValueError(f"unsupported GGUF tokenizer model {kind!r} (supported: 'gpt2', 'llama')")
    if len(tokens) > vocab_size:
        raise ValueError(f"GGUF tokenizer has {len(tokens)} tokens but the embedding only {vocab_size} rows")

    # Control tokens are special (matched whole in text, dropped by skip_special_tokens); user-defined
    # ones are matched whole too but kept in decoded text. Both already have ids in the model vocab.
    backend.add_special_tokens(
        [AddedToken(t, special=True, normalized=False) for t, ty in zip(tokens, types) if ty == CONTROL]
    )
    backend.add_tokens(
        [AddedToken(t, special=False, normalized=False) for t, ty in zip(tokens, types) if ty == USER_DEFINED]
    )

    bos_id = md.get("tokenizer.ggml.bos_token_id")
    # BOS rule: prepend BOS iff the file's tokenizer.ggml.add_bos_token says so (default: SentencePiece
    # yes, byte-level no), which is what llama.cpp does and what HF does for these models.
    if bos_id is not None and md.get("tokenizer.ggml.add_bos_token", add_bos_default):
        bos = tokens[bos_id]
        backend.post_processor = processors.TemplateProcessing(
            single=f"{bos} $A", pair=f"{bos} $A {bos} $B", special_tokens=[(bos, bos_id)]
        )

    eos_ids = [md[k] for k in ("tokenizer.ggml.eos_token_id", "tokenizer.ggml.eot_token_id", "tokenizer.ggml.eom_token_id") if k in md]
    eos_ids += [i for i, (t, ty) in enumerate(zip(tokens, types)) if ty == CONTROL and t in END_OF_GENERATION]
    return Tokenizer(
        backend, chat_template=md.get("tokenizer.chat_template"), bos_token_id=bos_id, eos_token_ids=eos_ids
    )
