"""Lazy detokenization: catching up several tokens at once equals feeding them one by one, and the engine's
outputs read late (or never) equal what the eager engine reported at each step."""
from __future__ import annotations

import random
from typing import Optional

import pytest

from diffkv_serve.engine.loader import embedded_model_path
from diffkv_serve.engine.loader.gguf_loader import open_gguf, read_metadata
from diffkv_serve.engine.loader.gguf_tokenizer import tokenizer_from_gguf
from diffkv_serve.engine.tokenizer import IncrementalDetokenizer, Tokenizer


class ReferenceDetokenizer:
    """The eager rule as it was before lazy catch-up: two decodes per token."""

    def __init__(self, tokenizer: Tokenizer, skip_special_tokens: bool = True):
        self.tokenizer, self.skip = tokenizer, skip_special_tokens
        self.ids: list[int] = []
        self.prefix = self.read = 0
        self.text = ""

    def add(self, token_id: int) -> str:
        self.ids.append(token_id)
        dec = lambda ids: self.tokenizer.decode(ids, skip_special_tokens=self.skip)  # noqa: E731
        prefix_text, full_text = dec(self.ids[self.prefix:self.read]), dec(self.ids[self.prefix:])
        if len(full_text) > len(prefix_text) and not full_text.endswith("\ufffd"):
            new = full_text[len(prefix_text):]
            self.prefix, self.read = self.read, len(self.ids)
            self.text += new
            return new
        return ""


@pytest.fixture(scope="module")
def tok() -> Tokenizer:
    return tokenizer_from_gguf(read_metadata(open_gguf(embedded_model_path())), vocab_size=49152)


@pytest.fixture(scope="module")
def pools(tok) -> dict[str, list[int]]:
    """Token ids by kind: special, pieces of multi-byte characters (emoji, CJK, accents), complete non-ASCII
    tokens, and ordinary ones."""
    text = "🦙🚀👍🏽🇫🇷 日本語のテキストと中文文本 naïve café — “q” Привет ∑∫√ 𝔘𝔫𝔦"
    multi = sorted(set(tok.encode(text, add_special_tokens=False)))
    partial = [i for i in multi if "\ufffd" in tok.decode([i])]
    whole = [i for i in multi if i not in partial]
    return {"special": list(range(17)), "partial": partial, "whole": whole, "plain": list(range(17, 49152))}


def random_ids(rng: random.Random, pools: dict[str, list[int]], n: int) -> list[int]:
    kinds, weights = ["special", "partial", "whole", "plain"], [1, 6, 2, 3]
    return [rng.choice(pools[rng.choices(kinds, weights)[0]]) for _ in range(n)]


def state(d) -> tuple[int, int]:
    return (d._prefix, d._read) if isinstance(d, IncrementalDetokenizer) else (d.prefix, d.read)


@pytest.mark.parametrize("skip", [True, False])
@pytest.mark.parametrize("max_trials", [IncrementalDetokenizer.MAX_TRIALS, 1])
def test_catch_up_equals_one_by_one(tok, pools, skip, max_trials):
    """Random ids (mostly pieces of multi-byte characters), caught up in random chunks: after each chunk the
    text and the window offsets equal the reference fed one id at a time (max_trials=1 also exercises the
    fallback to stepping)."""
    assert pools["partial"] and pools["whole"]
    rng = random.Random(1234 + skip)
    held_back = 0
    for _ in range(60):
        ids = random_ids(rng, pools, rng.randint(1, 50))
        ref, lazy = ReferenceDetokenizer(tok, skip), IncrementalDetokenizer(tok, skip)
        lazy.MAX_TRIALS = max_trials
        i = 0
        while i < len(ids):
            j = min(len(ids), i + rng.choice([1, 1, 2, 3, 5, 8, 50]))
            want = "".join(ref.add(t) for t in ids[i:j])
            for t in ids[i:j]:
                lazy.push(t)
            got = lazy.catch_up()
            assert got == want and lazy.text == ref.text and state(lazy) == state(ref) and lazy.num_done == j
            i = j
        held_back += ref.read < len(ids)
    assert held_back > 5  # the ids did end inside characters often enough to test the hold-back


def test_catch_up_upto(tok, pools):
    """catch_up(upto) stops at that many tokens; later pushes and catch-ups carry on from there."""
    rng = random.Random(7)
    ids = random_ids(rng, pools, 40)
    ref, lazy = ReferenceDetokenizer(tok), IncrementalDetokenizer(tok)
    for t in ids:
        lazy.push(t)
    for upto in (3, 3, 10, 25, 40):
        while len(ref.ids) < upto:
            ref.add(ids[len(ref.ids)])
        lazy.catch_up(upto)
        assert "".join(lazy._text) == ref.text and state(lazy) == state(ref)


@pytest.mark.parametrize("text", ["emoji 🦙🚀👍🏽 mixed with text", "日本語のテキストと中文文本",
                                  "<|im_start|>assistant\nSure 🦙!<|im_end|>"])
@pytest.mark.parametrize("skip", [True, False])
def test_catch_up_real_text(tok, text, skip):
    ids = tok.encode(text)
    ref, lazy = ReferenceDetokenizer(tok, skip), IncrementalDetokenizer(tok, skip)
    for t in ids:
        ref.add(t)
        lazy.push(t)
    assert lazy.text == ref.text == tok.decode(ids, skip_special_tokens=skip)


def test_general_decoder_steps_token_by_token(tok, pools):
    """A tokenizer whose decoder is not plain byte-level (SentencePiece-style Strip) takes the reference path."""
    from tokenizers import decoders

    backend = tokenizers_copy(tok)
    backend.decoder = decoders.Sequence([decoders.ByteLevel(), decoders.Strip(" ", 1, 0)])
    stripped = Tokenizer(backend, eos_token_ids=tok.eos_token_ids)
    rng = random.Random(3)
    for _ in range(10):
        ids = random_ids(rng, pools, 30)
        ref, lazy = ReferenceDetokenizer(stripped), IncrementalDetokenizer(stripped)
        assert not lazy._facts.byte_level
        for t in ids:
            ref.add(t)
            lazy.push(t)
        assert lazy.text == ref.text and state(lazy) == state(ref)


def tokenizers_copy(tok: Tokenizer):
    import tokenizers

    return tokenizers.Tokenizer.from_str(tok.backend.to_str())


# ---- the engine: lazy outputs against the eager text handling ---------------------------------------------------

class EagerText:
    """The engine's text handling before lazy detokenization (every token decoded in step(), every output
    copying the token list and slicing the text), kept on side state next to the engine's own: wrapped around
    an engine's _append_text / _stop_reason / output, it records (eager output, lazy output) for every output
    and checks both stop the same way."""

    def __init__(self, engine):
        self.engine, self.pairs, self.side = engine, [], {}
        lazy_append, lazy_stop, lazy_output = engine._append_text, engine._stop_reason, engine.output

        def append_text(seq, tok):
            self._append_text(seq, tok)
            lazy_append(seq, tok)

        def stop_reason(seq, tok):
            want = self._stop_reason(seq, tok)
            got = lazy_stop(seq, tok)
            assert got == want, (seq.request_id, got, want)
            return got

        def output(seq):
            eager = self._output(seq)
            lazy = lazy_output(seq)
            self.pairs.append((eager, lazy))
            return lazy

        engine._append_text, engine._stop_reason, engine.output = append_text, stop_reason, output

    def _state(self, seq) -> dict:
        st = self.side.get(seq.request_id)
        if st is None:
            st = self.side[seq.request_id] = {
                "detok": ReferenceDetokenizer(self.engine.tokenizer, seq.params.skip_special_tokens),
                "text": "", "chars": 0, "tokens": 0}
        return st

    def _append_text(self, seq, tok):
        st = self._state(seq)
        if seq.finish_reason is None:
            st["text"] += st["detok"].add(tok)

    def _stop_reason(self, seq, tok) -> Optional[str]:
        p, st = seq.params, self._state(seq)
        if not p.ignore_eos and tok in self.engine.tokenizer.eos_token_ids:
            return "stop"
        if tok in p.stop_token_ids:
            return "stop"
        if p.stop:
            window = max(map(len, p.stop)) + 16
            start = max(0, len(st["text"]) - window)
            hits = [(i, s) for i, s in ((st["text"].find(s, start), s) for s in p.stop) if i >= 0]
            if hits:
                i, s = min(hits)
                st["text"] = st["text"][: i + len(s)] if p.include_stop_str_in_output else st["text"][:i]
                return "stop"
        if len(seq.output_token_ids) >= p.max_tokens or seq.num_tokens >= self.engine.max_model_len:
            return "length"
        return None

    def _output(self, seq):
        from diffkv_serve.engine.sequence import RequestOutput

        st = self._state(seq)
        text = st["text"]
        hold = 0 if seq.finished or not seq.params.stop else max(map(len, seq.params.stop)) - 1
        visible = max(st["chars"], len(text) - hold)
        delta = text[st["chars"]: visible]
        new_ids = seq.output_token_ids[st["tokens"]:]
        st["chars"], st["tokens"] = visible, len(seq.output_token_ids)
        return RequestOutput(seq.request_id, seq.prompt_token_ids, list(seq.output_token_ids), text[:visible],
                             new_ids, delta, seq.finished, seq.finish_reason,
                             list(seq.output_logprobs) if seq.params.logprobs is not None else None,
                             seq.arrival_time, seq.first_token_time, seq.finish_time, seq.kv_usage,
                             list(seq.teacher_agree) if seq.params.teacher_tokens is not None else None,
                             seq.first_scheduled_time)


def script_model(engine, scripts: dict[str, list[int]]) -> None:
    """Model stubbed out: request r's i-th generated token is scripts[r][i]."""
    import torch

    runner, V = engine.runner, engine.arch.vocab_size
    runner._prefill = runner._decode = lambda seqs: torch.zeros(len(seqs), V)

    def sample(batch, logits, sample_tokens):
        for s in batch.seqs:
            s.num_cached = s.num_tokens if batch.is_prefill else s.num_cached + 1
        return [scripts[s.request_id][len(s.output_token_ids)] for s in batch.seqs], None

    runner._sample = sample


def stop_string_in(tok: Tokenizer, ids: list[int], skip: bool, rng: random.Random) -> str:
    """A short piece of the decoded text (so the stop string does match), or one that never occurs."""
    text = tok.decode(ids, skip_special_tokens=skip)
    for _ in range(20):
        i = rng.randrange(len(text) // 3, max(len(text) // 3 + 1, len(text) - 3))
        piece = text[i: i + rng.randint(1, 3)]
        if piece and "\ufffd" not in piece:
            return piece
    return "never in the text"


def read_all(out) -> tuple:
    return (out.token_ids, out.text, out.new_token_ids, out.delta_text, out.logprobs, out.teacher_agree)


def run_scripted(make_engine, tok, pools, seed: int, read: str):
    """Twelve requests of random (mostly multi-byte) tokens, with and without stop strings and skipping special
    tokens, batched 4 at a time; `read`: every output read right after its step, only at the end (in random
    order), or some fields at once and the rest at the end."""
    from diffkv_serve.engine import SamplingParams

    rng = random.Random(seed)
    engine = make_engine(scheduler={"max_num_seqs": 4})
    eager = EagerText(engine)
    scripts = {}
    for i in range(12):
        rid = f"r{i}"
        ids = scripts[rid] = random_ids(rng, pools, rng.randint(1, 40))
        skip = i % 2 == 0
        stop = [stop_string_in(tok, ids, skip, rng)] if i % 3 else []
        if i % 4 == 1:
            stop.append(stop_string_in(tok, ids, skip, rng))
        sp = SamplingParams(temperature=0, max_tokens=len(ids), ignore_eos=i % 5 != 0, stop=stop,
                            include_stop_str_in_output=i % 7 == 3, skip_special_tokens=skip)
        engine.add_request(rid, [5, 6, 7, 8], sp)
    script_model(engine, scripts)
    late = []
    while engine.has_unfinished_requests():
        for out in engine.step():
            if read == "at_once":
                read_all(out)
            elif read == "mixed" and rng.random() < 0.5:
                rng.choice([lambda: out.delta_text, lambda: out.text, lambda: out.token_ids])()
            late.append(out)
    rng.shuffle(late)
    for out in late:
        read_all(out)
    return eager.pairs


@pytest.mark.parametrize("read", ["at_once", "late", "mixed"])
def test_engine_outputs_equal_eager(make_engine, tok, pools, read):
    pairs = run_scripted(make_engine, tok, pools, seed={"at_once": 1, "late": 2, "mixed": 3}[read], read=read)
    assert len(pairs) > 50
    stopped = 0
    for eager, lazy in pairs:
        assert lazy == eager, (eager, lazy)
        stopped += lazy.finish_reason == "stop"
    assert stopped >= 3  # stop strings and EOS did cut some requests
    # the deltas of each request join to its final text, which holds multi-byte characters
    finals = {lazy.request_id: lazy for _, lazy in pairs if lazy.finished}
    joined = {}
    for _, lazy in pairs:
        joined[lazy.request_id] = joined.get(lazy.request_id, "") + lazy.delta_text
    assert joined == {r: o.text for r, o in finals.items()}
    assert any(any(ord(c) > 0x2000 for c in o.text) for o in finals.values())


def test_outputs_of_a_real_run_equal_eager(make_engine):
    """The embedded model: unicode prompts, stop strings found in the text, both skip settings, and a tight KV
    cache so that requests are preempted and recomputed; outputs read after all steps ran."""
    from engine_helpers import PROMPTS

    from diffkv_serve.engine import SamplingParams

    prompts = ["Write the word café and an emoji 🎉 three times:", "日本語で自己紹介してください。"] + PROMPTS[2:]
    # stop strings the greedy continuations hold ("アネ" in the Japanese one, "Celsius", "Elara"), or at least "."
    stops = {1: ["アネ", "、", "。"], 2: ["Celsius", "."], 5: ["Elara", "."]}
    # 90 pages per 16 tokens of one sequence (see test_engine's preemption test): 600 pages hold ~106 tokens
    # in all, far less than six sequences need, so decoding must preempt
    engine = make_engine(cache={"num_pages": 600, "block_size": 16})
    eager = EagerText(engine)
    sps = [SamplingParams(temperature=0, max_tokens=20, ignore_eos=True, skip_special_tokens=i % 2 == 0,
                          stop=stops.get(i, []), logprobs=i == 3)
           for i in range(len(prompts))]
    for i, (p, sp) in enumerate(zip(prompts, sps)):
        engine.add_request(str(i), p, sp)
    outs = []
    while engine.has_unfinished_requests():
        outs += engine.step()
    assert engine.stats()["num_preemptions"] > 0
    assert sum(o.finish_reason == "stop" for o in outs) >= 2
    for eager_out, lazy in eager.pairs:
        assert lazy == eager_out
    assert any(any(ord(c) > 0x2000 for c in o.text) for o in outs)


def test_unread_text_costs_no_decode(make_engine, tok, pools, monkeypatch):
    """Outputs whose text nobody reads: step() never decodes; reading the final texts decodes a few windows per
    request, not every token (stop-string requests excepted: they decode every step, as before)."""
    from diffkv_serve.engine import SamplingParams

    engine = make_engine()
    rng = random.Random(5)
    scripts = {f"r{i}": random_ids(rng, pools, 60) for i in range(6)}
    for rid, ids in scripts.items():
        engine.add_request(rid, [5, 6, 7], SamplingParams(temperature=0, max_tokens=60, ignore_eos=True))
    script_model(engine, scripts)
    calls = []
    real = engine.tokenizer.decode
    monkeypatch.setattr(engine.tokenizer, "decode", lambda *a, **k: calls.append(1) or real(*a, **k))
    finals = []
    while engine.has_unfinished_requests():
        outs = engine.step()
        assert all(o.token_ids for o in outs)  # token lists are still readable at no decode cost
        finals += [o for o in outs if o.finished]
    assert not calls
    texts = [o.text for o in finals]
    assert len(calls) < 60 * len(finals) / 4
    for o, text in zip(finals, texts):
        ref = ReferenceDetokenizer(tok)
        for t in o.token_ids:
            ref.add(t)
        assert text == ref.text


def test_request_output_pickles_and_compares(make_engine, tok, pools):
    import pickle

    pairs = run_scripted(make_engine, tok, pools, seed=9, read="late")
    eager, lazy = pairs[-1]
    again = pickle.loads(pickle.dumps(lazy))
    assert again == lazy == eager and again._seq is None
    assert repr(lazy) == repr(eager)


def test_long_stream_read_backwards_then_from_another_thread(make_engine, tok, pools):
    """More outputs than the sequence keeps text marks for, read newest first (each older one re-detokenizes),
    then a second run read by another thread while steps go on: all equal the eager outputs."""
    import queue
    import threading

    from diffkv_serve.engine import SamplingParams

    rng = random.Random(11)
    for run in ("backwards", "threaded"):
        engine = make_engine()
        eager = EagerText(engine)
        scripts = {f"{run}{i}": random_ids(rng, pools, 150) for i in range(3)}
        for rid, ids in scripts.items():
            engine.add_request(rid, [5, 6], SamplingParams(temperature=0, max_tokens=len(ids), ignore_eos=True,
                                                          skip_special_tokens=rid.endswith("1")))
        script_model(engine, scripts)
        if run == "backwards":
            outs = []
            while engine.has_unfinished_requests():
                outs += engine.step()
            assert len(outs) == 450
            for out in reversed(outs):
                read_all(out)
        else:
            q: queue.Queue = queue.Queue()
            reader = threading.Thread(target=lambda: [read_all(o) for o in iter(q.get, None)])
            reader.start()
            while engine.has_unfinished_requests():
                for out in engine.step():
                    q.put(out)
            q.put(None)
            reader.join()
        for eager_out, lazy in eager.pairs:
            assert lazy == eager_out
