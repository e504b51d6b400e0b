"""Tokenizer tests: GGUF tokenizer vs transformers' tokenizer from the same GGUF, chat template,
streaming detokenization."""
from __future__ import annotations

import pytest

from diffkv_serve.engine.loader import embedded_model_path
from diffkv_serve.engine.loader.gguf_loader import open_gguf, read_metadata
from diffkv_serve.engine.loader.gguf_tokenizer import tokenizer_from_gguf
from diffkv_serve.engine.tokenizer import IncrementalDetokenizer, Tokenizer

TEXTS = [
    "Hello world",
    "  leading and trailing spaces   ",
    "tabs\tand\nnewlines\n\n\nand \r\n crlf",
    "12345 and 3.14159 and 1,000,000",
    "naïve café déjà vu — “quotes”",
    "日本語のテキストと中文文本",
    "emoji 🦙🚀👍🏽 and flags 🇫🇷",
    "def f(x):\n    return x ** 2  # square\n",
    "if (a != b && c <= d) { return; }",
    "Don't you're we'll I'd THEY'RE",
    "<|im_start|>user\nhi<|im_end|>",
    "<|im_start|>system\nYou are nice.<|im_end|>\n<|im_start|>assistant\n",
    "text<|endoftext|>more text",
    "Привет, мир! Ελληνικά. عربي",
    "         ",
    "",
]


@pytest.fixture(scope="module")
def ours() -> Tokenizer:
    md = read_metadata(open_gguf(embedded_model_path()))
    return tokenizer_from_gguf(md, vocab_size=49152)


@pytest.fixture(scope="module")
def theirs():
    transformers = pytest.importorskip("transformers")
    path = embedded_model_path()
    return transformers.AutoTokenizer.from_pretrained(path.parent, gguf_file=path.name)


@pytest.mark.parametrize("text", TEXTS)
def test_encode_matches_transformers(ours, theirs, text):
    assert ours.encode(text) == theirs.encode(text)
    assert ours.encode(text, add_special_tokens=False) == theirs.encode(text, add_special_tokens=False)


@pytest.mark.parametrize("text", TEXTS)
def test_decode_round_trip(ours, theirs, text):
    ids = ours.encode(text)
    assert ours.decode(ids, skip_special_tokens=False) == text
    assert ours.decode(ids) == theirs.decode(ids, skip_special_tokens=True)


def test_special_tokens(ours):
    ids = ours.encode("<|im_start|>user\nhi<|im_end|>")
    assert ids[0] == ours.token_to_id("<|im_start|>") == 1 and ids[-1] == ours.token_to_id("<|im_end|>") == 2
    assert ours.decode(ids) == "user\nhi"  # control tokens are skipped
    # no BOS is prepended, like transformers for SmolLM2 (the GGUF says add_bos_token = false)
    assert ours.encode("hi") == ours.encode("hi", add_special_tokens=False)
    assert 2 in ours.eos_token_ids and 0 in ours.eos_token_ids  # <|im_end|>, <|endoftext|>
    assert ours.vocab_size == 49152


CONVERSATIONS = [
    [{"role": "user", "content": "What is 2+2?"}, {"role": "assistant", "content": "4."},
     {"role": "user", "content": "And 3+3?"}],
    [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi!"},
     {"role": "assistant", "content": "Hello 👋"}, {"role": "user", "content": "Bye"}],
]


@pytest.mark.parametrize("messages", CONVERSATIONS)
@pytest.mark.parametrize("gen", [True, False])
def test_chat_template_matches_transformers(ours, theirs, messages, gen):
    expected = theirs.apply_chat_template(messages, tokenize=False, add_generation_prompt=gen)
    got = ours.apply_chat_template(messages, add_generation_prompt=gen)
    assert got == expected
    assert ours.encode(got) == theirs.encode(expected)
    if gen:
        assert got.endswith("<|im_start|>assistant\n")


def test_json_round_trip(ours):
    again = Tokenizer.from_json(ours.to_json())
    for t in TEXTS:
        assert again.encode(t) == ours.encode(t)
    assert again.eos_token_ids == ours.eos_token_ids and again.bos_token_id == ours.bos_token_id
    assert again.chat_template == ours.chat_template


@pytest.mark.parametrize("text", [
    "emoji 🦙🚀👍🏽 mixed with text",
    "日本語のテキストと中文文本",
    "🇫🇷🇯🇵 ünïcödé ∑∫√ 𝔘𝔫𝔦𝔠𝔬𝔡𝔢",
    "plain ascii only",
])
def test_incremental_detokenizer(ours, text):
    ids = ours.encode(text)
    detok = IncrementalDetokenizer(ours)
    pieces = [detok.add(i) for i in ids]
    assert "".join(pieces) == ours.decode(ids) == text == detok.text
    assert not any("\ufffd" in p for p in pieces)
    if len(text.encode()) > len(text):  # multi-byte text must actually have been held back somewhere
        assert any(p == "" for p in pieces)


def test_incremental_detokenizer_skips_special(ours):
    ids = ours.encode("<|im_start|>assistant\nSure 🦙!<|im_end|>")
    detok = IncrementalDetokenizer(ours)
    out = "".join(detok.add(i) for i in ids)
    assert out == detok.text == "assistant\nSure 🦙!"
    keep = IncrementalDetokenizer(ours, skip_special_tokens=False)
    assert "".join(keep.add(i) for i in ids) == "<|im_start|>assistant\nSure 🦙!<|im_end|>"


def test_incremental_detokenizer_broken_tail(ours):
    # The first byte token of a 4-byte emoji alone: nothing is emitted until flush.
    ids = ours.encode("ok 🦙")
    detok = IncrementalDetokenizer(ours)
    out = "".join(detok.add(i) for i in ids[:-1])
    assert "\ufffd" not in out and out.startswith("ok")
    detok.flush()
    assert detok.text.startswith("ok")


def test_byte_level_tokenizer():
    tok = Tokenizer.byte_level(1000, eos_token_ids=[999])
    text = "héllo 🦙 wörld"
    ids = tok.encode(text)
    assert ids == list(text.encode()) and tok.decode(ids) == text
    assert tok.vocab_size == 1000 and tok.eos_token_ids == [999]
    detok = IncrementalDetokenizer(tok)
    pieces = [detok.add(i) for i in ids]
    assert "".join(pieces) == text and "" in pieces and not any("\ufffd" in p for p in pieces)
    assert tok.decode([500]) == "<|extra_500|>"
    assert Tokenizer.from_json(tok.to_json()).encode(text) == ids


def test_chat_template_helpers():
    tok = Tokenizer.byte_level(300)
    tok.chat_template = (
        "{% for m in messages %}{% if m['role'] not in ['user', 'assistant'] %}"
        "{{ raise_exception('bad role') }}{% endif %}{{ m | tojson }}\n{% endfor %}"
    )
    assert tok.apply_chat_template([{"role": "user", "content": "<é>"}]) == '{"role": "user", "content": "<é>"}\n'
    with pytest.raises(Exception, match="bad role"):
        tok.apply_chat_template([{"role": "tool", "content": "x"}])


def test_sentencepiece_style_gguf_tokenizer():
    """tokenizer.ggml.model == "llama": BPE from scores, byte fallback, BOS by default, '▁' for spaces."""
    tokens = ["<unk>", "<s>", "</s>"] + [f"<0x{b:02X}>" for b in range(256)]
    pieces = ["▁", "h", "e", "l", "o", "w", "r", "d", "▁h", "ll", "▁he", "▁hell", "▁hello", "▁w", "or", "▁wor", "ld", "▁world"]
    tokens += pieces
    types = [2, 3, 3] + [6] * 256 + [1] * len(pieces)
    scores = [0.0] * 259 + [-float(i) for i in range(len(pieces))]
    md = {"tokenizer.ggml.model": "llama", "tokenizer.ggml.tokens": tokens, "tokenizer.ggml.token_type": types,
          "tokenizer.ggml.scores": scores, "tokenizer.ggml.bos_token_id": 1, "tokenizer.ggml.eos_token_id": 2,
          "tokenizer.ggml.unknown_token_id": 0}
    tok = tokenizer_from_gguf(md, vocab_size=len(tokens))
    ids = tok.encode("hello world")
    assert ids == [1, tokens.index("▁hello"), tokens.index("▁world")]
    assert tok.decode(ids) == "hello world"
    ids = tok.encode("hé")  # 'é' is not in the vocab: falls back to its UTF-8 bytes
    assert ids[-2:] == [3 + 0xC3, 3 + 0xA9] and tok.decode(ids) == "hé"
    assert tok.eos_token_ids == [2] and tok.bos_token_id == 1
