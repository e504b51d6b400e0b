"""The OpenAI API end to end over HTTP (loopback) on one Serve app with the embedded model (diffkv cache):
the official `openai` client, 16 concurrent streams, bad input, client disconnects, and fuzzing from the
app's own OpenAPI schema."""
import asyncio
import json
import math

import httpx
import openai
import pytest

from _cluster import served, wait_for

APP = "api"
PREFIX = "/api"
CONFIG = {
    "device": "cpu",
    "kv_mode": "diffkv",
    "max_model_len": 160,  # short context: bounds every generation the fuzzer can ask for
    "default_max_tokens": 8,
    "cache": {"num_pages": 4096},
    "admission": {"ttft_target_s": 60.0},  # nothing here is overload; test_service_overload covers 429s
    "limits": {"max_n": 4},  # the fuzzer's n: at most 4 sequences
}


@pytest.fixture(scope="module")
def service(cluster):
    with served(cluster, CONFIG, APP, PREFIX) as s:
        yield s


def client(service, cls=openai.OpenAI):
    return cls(base_url=service["base"] + "/v1", api_key="unused", max_retries=0, timeout=120)


def engine_idle(service) -> dict:
    """Wait until the engine has no request and every KV page is free; returns its stats."""
    def idle():
        st = service["engine"].stats.remote().result()
        return st if st["num_running"] == 0 and st["num_waiting"] == 0 and st["pages_used"] == 0 else None
    return wait_for(idle, 30, what="the engine to go idle with every page free")


def test_models_and_health(service):
    from diffkv_serve.engine.model_settings import load_model_settings

    c = client(service)
    assert [m.id for m in c.models.list().data] == [service["model"]]
    # the replica runs the model's calibrated thresholds (CONFIG leaves them unset), and the card says so
    kv = httpx.get(service["base"] + "/v1/models", timeout=30).json()["data"][0]["diffkv"]
    settings = load_model_settings(service["model"])
    assert (kv["kv_mode"], kv["alpha_high"], kv["alpha_low"]) == ("diffkv", settings["alpha_high"],
                                                                  settings["alpha_low"])
    assert kv["cache_dtype"] == "float32" and kv["high"] == "K8V4" and kv["prefix_caching"] is False
    r = httpx.get(service["base"] + "/health", timeout=30)
    assert r.status_code == 200 and r.json() == {"status": "ok", "model": service["model"]}


def test_openai_client_chat_and_completion(service):
    c = client(service)
    messages = [{"role": "user", "content": "Name three colors."}]
    full = c.chat.completions.create(model=service["model"], messages=messages, max_tokens=8, temperature=0)
    assert full.object == "chat.completion" and full.choices[0].message.role == "assistant"
    assert full.choices[0].finish_reason in ("stop", "length") and full.choices[0].message.content
    assert full.usage.completion_tokens <= 8 and full.usage.prompt_tokens > 0
    assert full.usage.total_tokens == full.usage.prompt_tokens + full.usage.completion_tokens

    chunks = list(c.chat.completions.create(model=service["model"], messages=messages, max_completion_tokens=8,
                                            temperature=0, stream=True, stream_options={"include_usage": True}))
    assert chunks[0].choices[0].delta.role == "assistant"
    text = "".join(ch.choices[0].delta.content or "" for ch in chunks if ch.choices)
    assert text == full.choices[0].message.content  # greedy: streamed == non-streamed
    finals = [ch.choices[0].finish_reason for ch in chunks if ch.choices and ch.choices[0].finish_reason]
    assert finals == [full.choices[0].finish_reason]
    assert chunks[-1].choices == [] and chunks[-1].usage == full.usage

    comp = c.completions.create(model=service["model"], prompt="The capital of France is", max_tokens=6,
                                temperature=0)
    assert comp.object == "text_completion" and comp.choices[0].text
    assert comp.usage.completion_tokens <= 6 and comp.choices[0].finish_reason in ("stop", "length")
    streamed = list(c.completions.create(model=service["model"], prompt="The capital of France is", max_tokens=6,
                                         temperature=0, stream=True))
    assert "".join(s.choices[0].text for s in streamed) == comp.choices[0].text

    # sampling settings and stop strings go through; a seed makes sampling reproducible
    kw = dict(model=service["model"], prompt="Once upon a time", max_tokens=8, temperature=0.9, top_p=0.9, seed=7)
    assert c.completions.create(**kw).choices[0].text == c.completions.create(**kw).choices[0].text
    first = comp.choices[0].text.split()[0]
    stopped = c.completions.create(model=service["model"], prompt="The capital of France is", max_tokens=6,
                                   temperature=0, stop=[first])
    assert stopped.choices[0].finish_reason == "stop" and first not in stopped.choices[0].text

    # per-request DiffKV thresholds (validated extra body field)
    kv = c.chat.completions.create(model=service["model"], messages=messages, max_tokens=4, temperature=0,
                                   extra_body={"kv_compression": {"alpha_high": 0.5, "alpha_low": 0.01}})
    assert kv.usage.completion_tokens <= 4
    kv = c.chat.completions.create(model=service["model"], messages=messages, max_tokens=4, temperature=0,
                                   extra_body={"kv_compression": {"prune_phase": "generation"}})
    assert kv.usage.completion_tokens <= 4
    engine_idle(service)


def test_16_concurrent_streams_finish_with_correct_usage(service):
    prompts = [f"Write a short line about the number {i}." for i in range(16)]
    c = client(service)
    reference = {p: c.chat.completions.create(model=service["model"], messages=[{"role": "user", "content": p}],
                                              max_tokens=12, temperature=0) for p in prompts[:2]}

    async def one(ac, p):
        stream = await ac.chat.completions.create(model=service["model"], messages=[{"role": "user", "content": p}],
                                                  max_tokens=12, temperature=0, stream=True,
                                                  stream_options={"include_usage": True})
        text, usage, reasons = "", None, []
        async for ch in stream:
            if ch.choices:
                text += ch.choices[0].delta.content or ""
                if ch.choices[0].finish_reason:
                    reasons.append(ch.choices[0].finish_reason)
            if ch.usage is not None:
                usage = ch.usage
        return text, usage, reasons

    async def main():
        async with client(service, openai.AsyncOpenAI) as ac:
            return await asyncio.gather(*(one(ac, p) for p in prompts))

    results = asyncio.run(main())
    assert len(results) == 16
    for p, (text, usage, reasons) in zip(prompts, results):
        assert len(reasons) == 1 and usage is not None
        assert 1 <= usage.completion_tokens <= 12
        assert reasons[0] == "stop" or usage.completion_tokens == 12
        assert usage.total_tokens == usage.prompt_tokens + usage.completion_tokens
        assert text  # (batched float sums may flip a near-tie, so the text is not compared to a batch of one)
        if p in reference:
            assert usage.prompt_tokens == reference[p].usage.prompt_tokens
    engine_idle(service)


DROP = object()  # remove this field from the otherwise valid body
BAD = [
    ("malformed JSON", "chat", b'{"model": "m", "messages": [', None),
    ("body not an object", "chat", [1, 2], None),
    ("missing messages", "chat", {"messages": DROP}, "messages"),
    ("empty messages", "chat", {"messages": []}, "messages"),
    ("unknown model", "chat", {"model": "gpt-17", "messages": [{"role": "user", "content": "hi"}]}, "model"),
    ("negative max_tokens", "chat", {"max_tokens": -5}, "max_tokens"),
    ("zero max_completion_tokens", "chat", {"max_completion_tokens": 0}, "max_completion_tokens"),
    ("absurd max_tokens", "chat", {"max_tokens": 10**12}, "max_tokens"),
    ("max_tokens over the context left", "completions", {"prompt": "word " * 100, "max_tokens": 100},
     "max_tokens"),
    ("temperature too high", "chat", {"temperature": 2.5}, "temperature"),
    ("temperature negative", "chat", {"temperature": -0.1}, "temperature"),
    ("top_p zero", "chat", {"top_p": 0}, "top_p"),
    ("prompt longer than the context", "chat",
     {"messages": [{"role": "user", "content": "tell me " * 400}]}, "messages"),
    ("completion prompt longer than the context", "completions", {"prompt": "tell me " * 400}, "prompt"),
    ("unknown role", "chat", {"messages": [{"role": "wizard", "content": "hi"}]}, "messages.0.role"),
    ("messages wrong type", "chat", {"messages": "hello"}, "messages"),
    ("max_tokens wrong type", "chat", {"max_tokens": "ten"}, "max_tokens"),
    ("temperature wrong type", "chat", {"temperature": "hot"}, "temperature"),
    ("stream wrong type", "chat", {"stream": "yes"}, "stream"),
    ("content wrong type", "chat", {"messages": [{"role": "user", "content": 42}]}, "messages.0.content"),
    ("n zero", "chat", {"n": 0}, "n"),
    ("unknown field", "chat", {"frobnicate": True}, "frobnicate"),
    ("too many stop strings", "chat", {"stop": ["a", "b", "c", "d", "e"]}, "stop"),
    ("stream_options without stream", "chat", {"stream_options": {"include_usage": True}}, None),
    ("kv_compression negative", "chat", {"kv_compression": {"alpha_high": -1}}, "kv_compression.alpha_high"),
    ("kv_compression NaN", "chat", {"kv_compression": {"alpha_high": math.nan}}, "kv_compression.alpha_high"),
    ("kv_compression unknown key", "chat", {"kv_compression": {"beta": 1}}, "kv_compression.beta"),
    ("kv_compression unknown prune phase", "chat", {"kv_compression": {"prune_phase": "decode"}},
     "kv_compression.prune_phase"),
    ("kv_compression low above high", "chat", {"kv_compression": {"alpha_high": 0.1, "alpha_low": 0.5}},
     "kv_compression"),
    ("empty token prompt", "completions", {"prompt": []}, "prompt"),
    ("token id outside the vocabulary", "completions", {"prompt": [1, 2, 10**9]}, "prompt"),
    ("two prompts", "completions", {"prompt": ["a", "b"]}, "prompt"),
    ("negative seed", "completions", {"seed": -1}, "seed"),
    ("n above limits.max_n", "completions", {"n": 5}, "n"),
    ("best_of other than n", "completions", {"best_of": 2}, "best_of"),
    ("response_format schema that does not compile", "chat",
     {"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "no-such-type"}}}},
     "response_format"),
    ("response_format schema that does not compile (completions)", "completions",
     {"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"$ref": "#/missing"}}}},
     "response_format"),
    ("tools empty", "chat", {"tools": []}, "tools"),
    ("tools with a template without them", "chat",
     {"tools": [{"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}]}, "tools"),
    ("tool_choice without tools", "chat", {"tool_choice": "auto"}, "tool_choice"),
    ("suffix unsupported", "completions", {"suffix": "x"}, "suffix"),
    ("presence_penalty out of range", "chat", {"presence_penalty": 2.5}, "presence_penalty"),
    ("repetition_penalty zero", "completions", {"repetition_penalty": 0.0}, "repetition_penalty"),
    ("min_p above one", "chat", {"min_p": 1.5}, "min_p"),
    ("top_k below -1", "chat", {"top_k": -2}, "top_k"),
    ("logit_bias key not a token id", "chat", {"logit_bias": {"abc": 1.0}}, "logit_bias"),
    ("logit_bias too large", "completions", {"logit_bias": {"5": 150.0}}, "logit_bias"),
    ("logit_bias outside the vocabulary", "completions", {"logit_bias": {"999999": 1.0}}, "logit_bias"),
    ("stop_token_ids outside the vocabulary", "chat", {"stop_token_ids": [10**7]}, "stop_token_ids"),
    ("min_tokens above max_tokens", "completions", {"min_tokens": 9}, "min_tokens"),
    ("completion logprobs above 20", "completions", {"logprobs": 21}, "logprobs"),
    ("top_logprobs without logprobs", "chat", {"top_logprobs": 2}, None),
    ("top_logprobs above 20", "chat", {"logprobs": True, "top_logprobs": 21}, "top_logprobs"),
]


@pytest.mark.parametrize("name,endpoint,body,param", BAD, ids=[b[0] for b in BAD])
def test_bad_input_is_a_400_with_an_openai_error_body(service, name, endpoint, body, param):
    url = service["base"] + ("/v1/chat/completions" if endpoint == "chat" else "/v1/completions")
    if isinstance(body, dict):
        base = ({"model": service["model"], "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4}
                if endpoint == "chat" else {"model": service["model"], "prompt": "hi", "max_tokens": 4})
        body = {**base, **body}
        body = {k: v for k, v in body.items() if v is not DROP}
    content = body if isinstance(body, bytes) else json.dumps(body).encode()
    r = httpx.post(url, content=content, headers={"content-type": "application/json"}, timeout=60)
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"} and err["message"]
    assert err["type"] == "invalid_request_error"
    assert err["code"] == ("model_not_found" if name == "unknown model" else None), err  # OpenAI: string or null
    if param is not None:
        assert err["param"] == param, err
    if name == "kv_compression NaN":
        assert "a finite number >= 0" in err["message"], err


def test_tokenize_and_detokenize(service):
    base, model = service["base"], service["model"]
    post = lambda path, body: httpx.post(base + path, json={"model": model, **body}, timeout=60)  # noqa: E731
    r = post("/tokenize", {"prompt": "The quick brown fox"})
    assert r.status_code == 200, r.text
    tok = r.json()
    assert tok["count"] == len(tok["tokens"]) > 0 and tok["max_model_len"] == CONFIG["max_model_len"]
    assert post("/detokenize", {"tokens": tok["tokens"]}).json() == {"prompt": "The quick brown fox"}
    # the ids a completion of the same prompt reports as its prompt tokens
    c = client(service).completions.create(model=model, prompt="The quick brown fox", max_tokens=1)
    assert c.usage.prompt_tokens == tok["count"]
    chat = post("/tokenize", {"messages": [{"role": "user", "content": "hi"}]}).json()
    out = client(service).chat.completions.create(model=model, messages=[{"role": "user", "content": "hi"}],
                                                  max_tokens=1)
    assert chat["count"] == out.usage.prompt_tokens
    assert "hi" in post("/detokenize", {"tokens": chat["tokens"]}).json()["prompt"]
    for path, body, param in (("/tokenize", {}, None), ("/tokenize", {"prompt": "a", "messages": [
            {"role": "user", "content": "b"}]}, None), ("/tokenize", {"prompt": "a", "model": "gpt-17"}, "model"),
            ("/detokenize", {"tokens": [10**9]}, "tokens"), ("/detokenize", {"tokens": [-1]}, "tokens"),
            ("/detokenize", {"tokens": "abc"}, "tokens"), ("/tokenize", {"prompt": "a", "frobnicate": 1}, "frobnicate")):
        r = post(path, body)
        assert r.status_code == 400, (path, body, r.text)
        err = r.json()["error"]
        assert err["type"] == "invalid_request_error" and (param is None or err["param"] == param), err


def test_service_keeps_serving_after_bad_input(service):
    c = client(service)
    with pytest.raises(openai.BadRequestError) as e:
        c.chat.completions.create(model=service["model"], messages=[{"role": "user", "content": "hi"}],
                                  temperature=9)
    assert e.value.body["param"] == "temperature"
    out = c.chat.completions.create(model=service["model"], messages=[{"role": "user", "content": "hi"}], max_tokens=3)
    assert out.usage.completion_tokens <= 3
    st = engine_idle(service)
    assert st["pages_used"] == 0


def test_client_disconnect_mid_stream_aborts_and_frees_pages(service):
    body = {"model": service["model"], "prompt": "Count slowly: one, two, three,", "max_tokens": 120,
            "temperature": 0, "stream": True}
    with httpx.Client(timeout=60) as h:
        with h.stream("POST", service["base"] + "/v1/completions", json=body) as r:
            assert r.status_code == 200
            lines = r.iter_lines()
            got = [next(lines) for _ in range(3)]
            assert all(g.startswith("data: ") or g == "" for g in got)
            st = service["engine"].stats.remote().result()
            assert st["num_running"] + st["num_waiting"] == 1 and st["pages_used"] > 0
        # leaving the block closed the connection mid-stream
    st = engine_idle(service)
    assert st["num_generated_tokens"] > 0


def test_fuzz_from_openapi_schema_no_5xx(service):
    import schemathesis
    from hypothesis import HealthCheck, given, settings

    schema = schemathesis.openapi.from_url(service["base"] + "/openapi.json")
    ops = [r.ok() for r in schema.get_all_operations()]
    assert {(o.method.upper(), o.path) for o in ops} >= {("POST", "/v1/chat/completions"),
                                                          ("POST", "/v1/completions"), ("GET", "/v1/models")}
    statuses: dict[int, int] = {}
    for op in ops:
        @settings(max_examples=20 if op.method.upper() == "POST" else 5, deadline=None, database=None,
                  suppress_health_check=list(HealthCheck))
        @given(case=op.as_strategy())
        def check(case):
            r = case.call(base_url=service["base"], timeout=120)
            statuses[r.status_code] = statuses.get(r.status_code, 0) + 1
            assert r.status_code < 500, (case.path, case.body, r.status_code, r.text[:500])
            if r.status_code >= 400:
                assert set(r.json()["error"]) == {"message", "type", "param", "code"}

        check()
    assert statuses.get(400, 0) > 0 and statuses.get(200, 0) > 0  # it reached both validation and generation
    engine_idle(service)
