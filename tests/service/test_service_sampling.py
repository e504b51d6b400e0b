"""Sampling parameters and log-probabilities over HTTP, on test_service_api's app (the embedded model, diffkv
cache) and an fp16 twin: the openai client for each parameter, streaming included, and logprobs against the
engine's teacher-forced ones."""
import httpx
import openai
import pytest
import torch

from diffkv_serve.engine import SamplingParams

from _cluster import served, wait_for
from engine_helpers import run_all
from test_service_api import CONFIG, client, engine_idle, service  # noqa: F401  (the module's app)

PROMPT = "The capital of France is Paris. The capital of Germany is"
# Generated tokens' logprobs were computed by decode steps reading the request's cache; the teacher-forced ones
# by a prefill over prompt + output (unquantized attention). fp16: rounding only; diffkv: the decode steps read
# the compressed cache, 0.07 nat apart measured.
TOLERANCE = {"fp16": 1e-3, "diffkv": 0.15}


def test_each_sampling_parameter_through_the_openai_client(service):
    c = client(service)
    extra = {"top_k": 5, "min_p": 0.05, "repetition_penalty": 1.2, "min_tokens": 2, "stop_token_ids": [0],
             "ignore_eos": True}
    out = c.completions.create(model=service["model"], prompt=PROMPT, max_tokens=4, temperature=0.7, seed=3,
                               presence_penalty=0.5, frequency_penalty=0.5, extra_body=extra)
    assert out.usage.completion_tokens == 4
    chat = c.chat.completions.create(model=service["model"], messages=[{"role": "user", "content": "hi"}],
                                     max_tokens=3, presence_penalty=-0.5, frequency_penalty=1.0, extra_body=extra)
    assert chat.usage.completion_tokens == 3
    # logit_bias decides: +100 on one token makes greedy decoding repeat it (penalties off)
    forced = c.completions.create(model=service["model"], prompt=PROMPT, max_tokens=3, temperature=0,
                                  logit_bias={"4": 100}, logprobs=0)
    assert forced.choices[0].logprobs.tokens == [forced.choices[0].logprobs.tokens[0]] * 3
    stream = c.completions.create(model=service["model"], prompt=PROMPT, max_tokens=3, temperature=0, stream=True,
                                  logit_bias={"4": 100}, extra_body={"repetition_penalty": 1.0, "min_tokens": 1})
    assert "".join(ch.choices[0].text for ch in stream if ch.choices) == forced.choices[0].text
    engine_idle(service)


@pytest.fixture(scope="module")
def fp16_service(cluster):
    """The same app with an fp16 cache (prefix caching on, its default for single precision)."""
    with served(cluster, {**CONFIG, "kv_mode": "fp16"}, "sampling-fp16", "/sampling-fp16") as s:
        yield s


def requests_done(service) -> None:
    """No request left and every page free but the prefix cache's."""
    def idle():
        st = service["engine"].stats.remote().result()
        return (st["num_running"] == 0 and st["num_waiting"] == 0
                and st["pages_used"] == st["prefix_cache_pages"])
    wait_for(idle, 30, what="the engine to finish every request and free its pages")


@pytest.fixture(scope="module")
def local_engines(smollm):
    """The replicas' engine configurations, in this process: the engine's own teacher-forced logprobs."""
    from diffkv_serve.engine.llm_engine import LLMEngine
    from diffkv_serve.service.config import ServiceConfig

    made = {}

    def get(mode: str):
        if mode not in made:
            cfg = ServiceConfig.model_validate({**CONFIG, "kv_mode": mode}).engine
            made[mode] = LLMEngine(cfg, checkpoint=smollm)
        return made[mode]

    return get


@pytest.mark.parametrize("mode", ["diffkv", "fp16"])
@pytest.mark.slow
def test_completion_logprobs_and_echo_equal_the_engines_teacher_forced_ones(request, mode, local_engines):
    service = request.getfixturevalue("service" if mode == "diffkv" else "fp16_service")
    local_engine = local_engines(mode)
    c = client(service)
    ids = local_engine.tokenizer.encode(PROMPT)
    out = c.completions.create(model=service["model"], prompt=ids, max_tokens=5, temperature=0, logprobs=2)
    lp = out.choices[0].logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == len(lp.text_offset) == 5
    assert lp.text_offset[0] == 0 and "".join(lp.tokens) == out.choices[0].text
    assert all(max(t, key=t.get) == tok for t, tok in zip(lp.top_logprobs, lp.tokens))  # greedy: the top one
    gen = run_all(local_engine, [ids], SamplingParams(temperature=0, max_tokens=5, ignore_eos=True))[0].token_ids
    assert [local_engine.tokenizer.decode([t], skip_special_tokens=False) for t in gen] == lp.tokens
    forced = run_all(local_engine, [ids + gen], SamplingParams(temperature=0, max_tokens=1,
                                                               prompt_logprobs=1))[0].prompt_logprobs.logprobs
    diff = (torch.tensor(lp.token_logprobs) - torch.tensor(forced[len(ids):])).abs().max().item()
    assert diff < TOLERANCE[mode], diff
    # lm-eval's log-likelihood request: echo the prompt with its tokens' logprobs (the first has none)
    ll = c.completions.create(model=service["model"], prompt=ids + gen, max_tokens=1, temperature=0, logprobs=1,
                              echo=True)
    e = ll.choices[0].logprobs
    n = len(ids) + len(gen)
    assert len(e.tokens) == n + 1 and e.token_logprobs[0] is None and e.top_logprobs[0] is None
    assert ll.choices[0].text.startswith(local_engine.tokenizer.decode(ids + gen, skip_special_tokens=False))
    assert e.text_offset == [sum(len(t) for t in e.tokens[:i]) for i in range(n + 1)]
    torch.testing.assert_close(torch.tensor(e.token_logprobs[1:n]), torch.tensor(forced[1:]), atol=2e-3, rtol=0)
    if mode == "fp16":  # lm-eval's is_greedy: the greedy continuation is the top token at each of its positions
        cont = zip(e.token_logprobs[len(ids):n], e.top_logprobs[len(ids):n])
        assert all(lp == max(top.values()) for lp, top in cont)
    requests_done(service)


def test_chat_logprobs_and_streamed_chunks(service):
    c = client(service)
    kw = dict(model=service["model"], messages=[{"role": "user", "content": "Name a colour."}], max_tokens=4,
              temperature=0, logprobs=True, top_logprobs=3)
    full = c.chat.completions.create(**kw)
    content = full.choices[0].logprobs.content
    assert len(content) == full.usage.completion_tokens
    for e in content:
        assert len(e.top_logprobs) == 3 and e.top_logprobs[0].token == e.token and e.logprob <= 0
        assert bytes(e.bytes).decode("utf-8", "replace") == e.token
    chunks = [ch for ch in c.chat.completions.create(**kw, stream=True) if ch.choices]
    streamed = [e for ch in chunks if ch.choices[0].logprobs for e in ch.choices[0].logprobs.content]
    assert [(e.token, round(e.logprob, 4)) for e in streamed] == [(e.token, round(e.logprob, 4)) for e in content]
    plain = c.chat.completions.create(**{**kw, "logprobs": False, "top_logprobs": None})
    assert plain.choices[0].logprobs is None
    # completions stream: one logprobs object per chunk, offsets running on over the whole text
    body = {"model": service["model"], "prompt": PROMPT, "max_tokens": 4, "temperature": 0, "logprobs": 1,
            "echo": True, "stream": True}
    with httpx.stream("POST", service["base"] + "/v1/completions", json=body, timeout=60) as r:
        import json
        events = [json.loads(line[6:]) for line in r.iter_lines() if line.startswith("data: {")]
    objs = [ev["choices"][0]["logprobs"] for ev in events if ev["choices"]]
    offsets = [o for lp in objs for o in lp["text_offset"]]
    tokens = [t for lp in objs for t in lp["tokens"]]
    assert offsets == [sum(len(t) for t in tokens[:i]) for i in range(len(tokens))]
    assert "".join(ev["choices"][0]["text"] for ev in events if ev["choices"]).startswith(PROMPT)
    engine_idle(service)


def test_n_choices_through_the_openai_client(fp16_service):
    """n=3: three choices, each its own index and seed (seed + i: the same text as a lone request with that
    seed); usage counts the prompt once and every choice's tokens; streamed choices arrive interleaved."""
    service = fp16_service
    c = client(service)
    kw = dict(model=service["model"], prompt=PROMPT, max_tokens=4, temperature=0.8, extra_body={"ignore_eos": True})
    three = c.completions.create(**kw, n=3, seed=21)
    assert [ch.index for ch in three.choices] == [0, 1, 2]
    alone = [c.completions.create(**kw, seed=21 + i) for i in range(3)]
    assert [ch.text for ch in three.choices] == [a.choices[0].text for a in alone]
    assert three.usage.prompt_tokens == alone[0].usage.prompt_tokens
    assert three.usage.completion_tokens == 12 and three.usage.total_tokens == three.usage.prompt_tokens + 12
    streamed: dict[int, str] = {}
    for ch in c.completions.create(**kw, n=3, seed=21, stream=True):
        for choice in ch.choices:
            streamed[choice.index] = streamed.get(choice.index, "") + choice.text
    assert streamed == {i: ch.text for i, ch in enumerate(three.choices)}
    # chat, streamed with usage: a role chunk and a finish reason per choice
    msgs = [{"role": "user", "content": "Name a colour."}]
    chunks = list(c.chat.completions.create(model=service["model"], messages=msgs, max_tokens=3, n=3, seed=2,
                                            stream=True, stream_options={"include_usage": True}))
    roles = [c.index for ch in chunks for c in ch.choices if c.delta.role]
    finishes = sorted(c.index for ch in chunks for c in ch.choices if c.finish_reason)
    assert roles == [0, 1, 2] and finishes == [0, 1, 2]
    full = c.chat.completions.create(model=service["model"], messages=msgs, max_tokens=3, n=3, seed=2)
    texts = {i: "".join(c.delta.content or "" for ch in chunks for c in ch.choices if c.index == i) for i in range(3)}
    assert texts == {ch.index: ch.message.content for ch in full.choices}
    assert chunks[-1].usage == full.usage and full.usage.completion_tokens <= 9
    # echo with logprobs: every choice starts with the prompt and its tokens' log-probabilities
    echo = c.completions.create(model=service["model"], prompt=PROMPT, max_tokens=2, n=2, seed=1, echo=True,
                                logprobs=0)
    a, b = (ch.logprobs for ch in echo.choices)
    p = len(a.tokens) - 2
    assert a.token_logprobs[:p] == b.token_logprobs[:p] and a.token_logprobs[0] is None and p > 1
    assert all(ch.text.startswith(PROMPT) for ch in echo.choices)
    requests_done(service)


def test_n_refusals_name_the_field(service):
    base = {"model": service["model"], "prompt": PROMPT, "max_tokens": 2}
    for body, param in (({"best_of": 3, "n": 2}, "best_of"), ({"n": 129}, "n"), ({"n": 0}, "n"),
                        ({"n": 5}, "n")):  # over CONFIG's limits.max_n
        r = httpx.post(service["base"] + "/v1/completions", json={**base, **body}, timeout=60)
        assert r.status_code == 400 and r.json()["error"]["param"] == param, r.text
    ok = httpx.post(service["base"] + "/v1/completions", json={**base, "best_of": 2, "n": 2, "seed": 3}, timeout=60)
    assert ok.status_code == 200 and [ch["index"] for ch in ok.json()["choices"]] == [0, 1]
    engine_idle(service)
