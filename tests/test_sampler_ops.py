"""The sampler's batched logits adjustments and log-probabilities against plain per-row torch references, on
random logits (a mixed batch: each row its own parameters, some rows none)."""
import math

import pytest
import torch

from diffkv_serve.engine.errors import InvalidRequestError
from diffkv_serve.engine.logits_processors import TokenHistory, adjust_logits, apply_min_p
from diffkv_serve.engine.sampler import sample, with_logprobs
from diffkv_serve.engine.sampling_params import SamplingParams

V = 50
EOS = (2,)


def _logits(B: int, seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(B, V, generator=g) * 4  # both signs, so repetition's divide / multiply both show


def _history(B: int, seed: int = 1):
    g = torch.Generator().manual_seed(seed)
    prompts = [torch.randint(0, V, (int(torch.randint(1, 12, (1,), generator=g)),), generator=g).tolist()
               for _ in range(B)]
    outputs = [torch.randint(0, V, (int(torch.randint(0, 9, (1,), generator=g)),), generator=g).tolist()
               for _ in range(B)]
    return TokenHistory(prompts, outputs, [len(o) for o in outputs])


def _reference(logits: torch.Tensor, params, hist: TokenHistory) -> torch.Tensor:
    """One row at a time, one token at a time: bias, min_tokens mask, repetition, frequency / presence."""
    out = logits.clone()
    for i, p in enumerate(params):
        row = out[i]
        for tok, b in p.logit_bias.items():
            row[tok] += b
        if hist.num_generated[i] < p.min_tokens:
            for tok in list(p.stop_token_ids) + list(p.eos_token_ids):
                row[tok] = -math.inf
        if p.repetition_penalty != 1:
            for tok in set(hist.prompt[i]) | set(hist.output[i]):
                row[tok] = row[tok] / p.repetition_penalty if row[tok] > 0 else row[tok] * p.repetition_penalty
        for tok in set(hist.output[i]):
            row[tok] -= p.frequency_penalty * hist.output[i].count(tok) + p.presence_penalty
    return out


MIXED = [
    SamplingParams(),
    SamplingParams(presence_penalty=1.5),
    SamplingParams(frequency_penalty=-0.7),
    SamplingParams(presence_penalty=-2.0, frequency_penalty=2.0),
    SamplingParams(repetition_penalty=1.3),
    SamplingParams(repetition_penalty=0.6, frequency_penalty=0.5),
    SamplingParams(logit_bias={3: 5.0, 7: -100.0, "11": 2.5}),
    SamplingParams(min_tokens=20, max_tokens=30, stop_token_ids=[4, 9], eos_token_ids=EOS),
    SamplingParams(min_tokens=1, eos_token_ids=EOS),  # reached when the row has output already
    SamplingParams(repetition_penalty=2.0, presence_penalty=0.3, logit_bias={0: 1.0}, min_tokens=16,
                   eos_token_ids=EOS),
]


def test_adjustments_match_the_per_row_reference():
    B = len(MIXED)
    for seed in range(3):
        logits, hist = _logits(B, seed), _history(B, seed + 10)
        got = adjust_logits(logits, MIXED, hist)
        want = _reference(logits, MIXED, hist)
        assert torch.equal(torch.isinf(got), torch.isinf(want))
        torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-5)
        assert not torch.equal(got, logits)  # something changed, and the input is untouched
        assert torch.equal(logits, _logits(B, seed))


def test_a_batch_where_every_row_is_penalised():
    params = [p for p in MIXED if p.penalizes]  # no sub-batch: the penalties run on the whole batch
    B = len(params)
    logits, hist = _logits(B, 11), _history(B, 12)
    torch.testing.assert_close(adjust_logits(logits, params, hist), _reference(logits, params, hist))
    last = torch.tensor([o[-1] if o else 0 for o in hist.output])
    lagging = TokenHistory(hist.prompt, [o[:-1] for o in hist.output], hist.num_generated, last)
    torch.testing.assert_close(adjust_logits(logits, params, lagging), _reference(logits, params, hist))


def test_async_history_with_the_newest_token_on_the_device_is_the_same():
    """Async scheduling: the host lacks each row's newest token, which is this step's input id on the device."""
    B = len(MIXED)
    logits, hist = _logits(B, 5), _history(B, 6)
    want = adjust_logits(logits, MIXED, hist)
    last = torch.tensor([o[-1] if o else 0 for o in hist.output])
    lagging = TokenHistory(hist.prompt, [o[:-1] for o in hist.output], hist.num_generated, last)
    torch.testing.assert_close(adjust_logits(logits, MIXED, lagging), want)


def test_nothing_asked_costs_nothing():
    logits = _logits(4)
    params = [SamplingParams(temperature=0.7, top_k=-1), SamplingParams(temperature=0), SamplingParams(min_tokens=0),
              SamplingParams(repetition_penalty=1.0)]
    assert adjust_logits(logits, params, _history(4)) is logits  # no clone, no op
    out = sample(logits, params, [None] * 4, _history(4))
    assert out.logprobs is None and out.top_ids is None


def test_greedy_rows_take_the_argmax_of_the_adjusted_logits():
    B = len(MIXED)
    greedy = [SamplingParams(**{**p.__dict__, "temperature": 0.0}) for p in MIXED]
    logits, hist = _logits(B, 7), _history(B, 8)
    top = logits.argmax(-1).tolist()
    outs = [o + [t] * 3 for o, t in zip(hist.output, top)]  # each row repeated its favourite: penalties bite
    hist = TokenHistory(hist.prompt, outs, [len(o) for o in outs])
    tokens = sample(logits, greedy, [None] * B, hist).tokens
    assert tokens.tolist() == _reference(logits, greedy, hist).argmax(-1).tolist()
    assert tokens.tolist() != logits.argmax(-1).tolist()  # the adjustments did change some choice


def test_min_tokens_mask_holds_under_sampling():
    B = 64
    logits = torch.full((B, V), -5.0)
    logits[:, 2] = 10.0  # EOS overwhelmingly likely
    logits[:, 4] = 9.0  # and a stop token
    p = SamplingParams(temperature=1.0, min_tokens=3, stop_token_ids=[4], eos_token_ids=EOS)
    hist = TokenHistory([[1]] * B, [[5]] * B, [1] * B)
    gens = [torch.Generator().manual_seed(i) for i in range(B)]
    tokens = sample(logits + torch.randn(B, V) * 0.01, [p] * B, gens, hist).tokens
    assert not ({2, 4} & set(tokens.tolist()))
    done = TokenHistory([[1]] * B, [[5, 5, 5]] * B, [3] * B)
    assert set(sample(logits, [p] * B, gens, done).tokens.tolist()) <= {2, 4}


def test_min_p_mask_matches_the_per_row_reference():
    logits = _logits(5, 13)
    min_p = torch.tensor([0.0, 0.02, 0.1, 0.5, 1.0])
    got = apply_min_p(logits, min_p)
    for i in range(5):
        probs = logits[i].softmax(-1)
        want = logits[i].clone()
        for t in range(V):
            if probs[t] < min_p[i] * probs.max():
                want[t] = -math.inf
        assert torch.equal(got[i], want)


def test_min_p_keeps_exactly_the_tokens_above_the_threshold():
    B = 6
    logits = _logits(B, 3)
    params = [SamplingParams(temperature=0.8, min_p=m) for m in (0.0, 0.05, 0.1, 0.3, 0.9, 1.0)]
    for i, p in enumerate(params):
        probs = (logits[i] / 0.8).softmax(-1)
        allowed = set(torch.nonzero(probs >= p.min_p * probs.max()).flatten().tolist())
        drawn = set()
        for s in range(150):
            g = torch.Generator().manual_seed(s)
            drawn.add(sample(logits[i:i + 1], [p], [g]).tokens.item())
        assert drawn <= allowed
        if p.min_p >= 0.9:
            assert len(allowed) <= 2


def test_top_k_minus_one_and_zero_are_off():
    logits = _logits(2, 4)
    g = lambda: [torch.Generator().manual_seed(1), torch.Generator().manual_seed(1)]  # noqa: E731
    a = sample(logits, [SamplingParams(top_k=-1)] * 2, g()).tokens
    b = sample(logits, [SamplingParams(top_k=0)] * 2, g()).tokens
    assert torch.equal(a, b)
    # any larger top_k keeps the whole vocabulary, even past what an int64 holds (an HTTP request may ask it)
    for k in (logits.shape[-1], 2**62, 2**70):
        assert torch.equal(sample(logits, [SamplingParams(top_k=k, top_p=0.9)] * 2, g()).tokens,
                           sample(logits, [SamplingParams(top_p=0.9)] * 2, g()).tokens)


def test_logprobs_chosen_and_top_k_of_the_raw_distribution():
    B = 4
    logits = _logits(B, 9)
    params = [SamplingParams(logprobs=3, presence_penalty=2.0), SamplingParams(), SamplingParams(logprobs=0),
              SamplingParams(logprobs=True)]
    hist = TokenHistory([[1]] * B, [[0, 1, 2]] * B, [3] * B)
    out = sample(logits, params, [None] * B, hist)
    ref = torch.log_softmax(logits, -1)  # raw logits: penalties change the choice, not the reported logprobs
    for i in range(B):
        assert out.logprobs[i].item() == pytest.approx(ref[i, out.tokens[i]].item(), abs=1e-6)
    vals, ids = ref[0].topk(3)
    assert out.top_ids[0].tolist() == ids.tolist()
    torch.testing.assert_close(out.top_logprobs[0], vals)
    assert with_logprobs(logits, out.tokens, [SamplingParams()] * B).logprobs is None


@pytest.mark.parametrize("kw,field", [
    ({"min_p": 1.5}, "min_p"), ({"min_p": math.nan}, "min_p"),
    ({"presence_penalty": 2.5}, "presence_penalty"), ({"frequency_penalty": -3}, "frequency_penalty"),
    ({"repetition_penalty": 0}, "repetition_penalty"), ({"repetition_penalty": math.inf}, "repetition_penalty"),
    ({"min_tokens": -1}, "min_tokens"), ({"min_tokens": 20, "max_tokens": 10}, "min_tokens"),
    ({"logit_bias": {5: 101}}, "logit_bias"), ({"logit_bias": {-1: 1}}, "logit_bias"),
    ({"logit_bias": {"x": 1}}, "logit_bias"), ({"logit_bias": [1]}, "logit_bias"),
    ({"stop_token_ids": [-2]}, "stop_token_ids"), ({"top_k": -2}, "top_k"), ({"top_k": 1.5}, "top_k"),
    ({"logprobs": 21}, "logprobs"), ({"logprobs": -1}, "logprobs"), ({"prompt_logprobs": 50}, "prompt_logprobs"),
    ({"seed": -1}, "seed"), ({"seed": 2**64}, "seed"), ({"seed": 2**64 - 2, "n": 3}, "seed"),
])
def test_bad_values_name_their_field(kw, field):
    with pytest.raises(InvalidRequestError) as e:
        SamplingParams(**kw)
    assert e.value.param == field and isinstance(e.value, ValueError)


def test_token_ids_outside_the_vocabulary_name_their_field():
    for kw, field in (({"logit_bias": {V: 1.0}}, "logit_bias"), ({"stop_token_ids": [V + 3]}, "stop_token_ids")):
        with pytest.raises(InvalidRequestError) as e:
            SamplingParams(**kw).check_vocab(V)
        assert e.value.param == field
