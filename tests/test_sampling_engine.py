"""Sampling parameters and log-probabilities through the engine on the embedded model (few tokens each):
penalised greedy decoding against a reference built from the engine's own prompt logits, min_tokens, and
generated tokens' logprobs against the engine's teacher-forced prompt logprobs (fp16 and diffkv)."""
import pytest
import torch

from diffkv_serve.engine import SamplingParams

from engine_helpers import PROMPTS, run_all
from test_sampler_ops import _reference
from diffkv_serve.engine.logits_processors import TokenHistory

# Generated-token logprobs (decode steps, reading the request's cache) against a prefill of prompt + output
# (prompt_logprobs, attention over the same tokens unquantized). fp16: the same arithmetic up to rounding;
# diffkv: the decode steps read the compressed cache (0.07 nat measured on this prompt), the prefill does not.
TOLERANCE = {"fp16": 1e-4, "diffkv": 0.15}


def test_penalised_greedy_follows_the_reference_step_by_step(make_engine):
    engine = make_engine(cache={"kv_mode": "fp16"})
    prompt = engine.tokenizer.encode("one two one two one two one two one")
    plain = run_all(engine, [prompt], SamplingParams(temperature=0, max_tokens=5, ignore_eos=True))[0].token_ids
    sp = SamplingParams(temperature=0, max_tokens=5, ignore_eos=True, repetition_penalty=1.5, frequency_penalty=0.9,
                        presence_penalty=0.6, logit_bias={plain[1]: -4.0, 13: 1.5})
    got = run_all(engine, [prompt], sp)[0].token_ids
    assert got != plain
    for j in range(len(got)):
        logits = engine.prompt_logits(prompt + got[:j]).unsqueeze(0)
        want = _reference(logits, [sp], TokenHistory([prompt], [got[:j]], [j])).argmax(-1).item()
        assert got[j] == want, (j, got, want)


def test_min_tokens_defers_eos_and_stop_tokens(make_engine):
    engine = make_engine(cache={"kv_mode": "fp16"})
    tok = engine.tokenizer
    chat = tok.encode(tok.apply_chat_template([{"role": "user", "content": "Say hi."}]), add_special_tokens=False)
    free = run_all(engine, [chat], SamplingParams(temperature=0, max_tokens=40))[0]
    assert free.finish_reason == "stop" and free.token_ids[-1] in tok.eos_token_ids
    n = len(free.token_ids)
    held = run_all(engine, [chat], SamplingParams(temperature=0, max_tokens=n + 6, min_tokens=n + 2,
                                                  stop_token_ids=[free.token_ids[0]]))[0]
    assert len(held.token_ids) >= n + 2
    first = held.token_ids[: n + 1]
    assert not set(first) & (set(tok.eos_token_ids) | {free.token_ids[0]})


@pytest.mark.parametrize("mode", ["fp16", "diffkv"])
def test_logprobs_equal_the_engines_teacher_forced_ones(make_engine, mode):
    engine = make_engine(cache={"kv_mode": mode})
    prompt = engine.tokenizer.encode(PROMPTS[5])
    n = len(prompt)
    out = run_all(engine, [prompt], SamplingParams(temperature=0, max_tokens=6, ignore_eos=True, logprobs=3,
                                                   prompt_logprobs=2))[0]
    assert len(out.logprobs) == len(out.top_logprobs) == 6
    for tok, lp, top in zip(out.token_ids, out.logprobs, out.top_logprobs):
        assert len(top) == 3 and top[0][0] == tok and top[0][1] == pytest.approx(lp, abs=1e-6)  # greedy: top-1
        assert top[0][1] >= top[1][1] >= top[2][1]
    forced = run_all(engine, [prompt + out.token_ids], SamplingParams(temperature=0, max_tokens=1,
                                                                      prompt_logprobs=2))[0].prompt_logprobs
    assert len(forced.logprobs) == n + 6 and forced.logprobs[0] is None and forced.top[0] is None
    diff = (torch.tensor(out.logprobs) - torch.tensor(forced.logprobs[n:])).abs().max().item()
    assert diff < TOLERANCE[mode], diff
    # the first request's own prompt logprobs: the same prefill arithmetic as the teacher-forced one
    assert out.prompt_logprobs.logprobs[0] is None
    torch.testing.assert_close(torch.tensor(out.prompt_logprobs.logprobs[1:]), torch.tensor(forced.logprobs[1:n]),
                               atol=1e-5, rtol=0)
    assert [t[0] for t in out.prompt_logprobs.top[1]] == [t[0] for t in forced.top[1]]
    # and they are the log-softmax of the logits after each prefix
    ref = torch.log_softmax(engine.prompt_logits(prompt[:4]), -1)[prompt[4]].item()
    assert forced.logprobs[4] == pytest.approx(ref, abs=1e-4)


def test_prompt_logprobs_skip_the_prefix_cache(make_engine):
    engine = make_engine(cache={"kv_mode": "fp16", "enable_prefix_caching": True})
    prompt = engine.tokenizer.encode(PROMPTS[5] * 3)
    sp = SamplingParams(temperature=0, max_tokens=1, prompt_logprobs=0)
    a = run_all(engine, [prompt], sp)[0].prompt_logprobs
    hits = engine.stats()["prefix_cache_hits"]
    b = run_all(engine, [prompt], sp)[0].prompt_logprobs
    assert engine.stats()["prefix_cache_hits"] == hits  # computed again, every position
    run_all(engine, [prompt], SamplingParams(temperature=0, max_tokens=1))
    assert engine.stats()["prefix_cache_hits"] > hits  # while other requests still read the cache
    assert len(a.logprobs) == len(prompt) and a.top is None
    torch.testing.assert_close(torch.tensor(a.logprobs[1:]), torch.tensor(b.logprobs[1:]))
