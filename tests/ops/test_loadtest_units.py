"""Pieces of the load tests that need no server: arrival processes, SSE timing, prompts, summaries.
(The runs against the real service are in test_live_service.py.)"""
import json
import math

import numpy as np
import pytest

from _ops import load

prompts = load("loadtest/prompts.py", "prompts")
stream = load("loadtest/stream.py", "stream")
sweep = load("loadtest/sweep.py", "loadtest_sweep")


@pytest.mark.parametrize("burstiness,cv", [(1.0, 1.0), (0.25, 2.0), (4.0, 0.5)])
def test_arrivals_have_the_rate_and_the_burstiness(burstiness, cv):
    rate, n = 4.0, 20000
    t = sweep.arrival_times(n, rate, burstiness, np.random.default_rng(0))
    gaps = np.diff(t)
    assert t[0] == 0 and np.all(gaps >= 0)
    assert gaps.mean() == pytest.approx(1 / rate, rel=0.05)
    # Gamma(k): coefficient of variation 1/sqrt(k); k=1 (Poisson arrivals) has exponential gaps.
    assert gaps.std() / gaps.mean() == pytest.approx(cv, rel=0.08)
    if burstiness == 1.0:  # exponential: P(gap > mean) = 1/e; counts in 1-s windows have variance = mean
        assert (gaps > 1 / rate).mean() == pytest.approx(math.exp(-1), abs=0.02)
        counts = np.bincount(t.astype(int))[:-1]
        assert counts.var() / counts.mean() == pytest.approx(1.0, abs=0.15)
    assert np.all(sweep.arrival_times(5, float("inf"), 1.0, np.random.default_rng(0)) == 0)


def test_rates_parse_and_reject_bad_input():
    assert sweep.parse_rates("0.5, 2,inf") == [0.5, 2.0, float("inf")]
    for bad in ("", "0", "-1", "fast"):
        with pytest.raises(ValueError):
            sweep.parse_rates(bad)


def _events(chunks, usage=None, finish="length"):
    lines = ['data: {"choices":[{"index":0,"delta":{"role":"assistant","content":""},"finish_reason":null}]}', ""]
    for i, c in enumerate(chunks):
        fr = json.dumps(finish) if i == len(chunks) - 1 else "null"
        lines += [f'data: {{"choices":[{{"index":0,"delta":{{"content":{json.dumps(c)}}},"finish_reason":{fr}}}]}}',
                  ""]
    if usage:
        lines += ['data: ' + json.dumps({"choices": [], "usage": usage}), ""]
    return lines + ["data: [DONE]", ""]


def test_stream_timings_follow_the_vllm_definitions():
    r = stream.StreamResult(t_start=10.0, status=200)
    times = iter([10.1, 10.1, 10.5, 10.5, 10.7, 10.7, 11.0, 11.0, 11.1, 11.1, 11.2, 11.2])
    for line in _events(["Hello", " big", " world"], usage={"prompt_tokens": 7, "completion_tokens": 4,
                                                            "total_tokens": 11}):
        r.feed(line, next(times))
    assert r.ok and not r.rejected and r.text == "Hello big world" and r.finish_reason == "length"
    assert r.ttft == pytest.approx(0.5)  # the role chunk has no content: not the first token
    assert r.output_tokens == 4  # from usage, not the chunk count
    assert r.e2e == pytest.approx(1.2)
    assert r.tpot == pytest.approx((11.2 - 10.5) / 3)
    assert r.itls == pytest.approx([0.2, 0.3])


def test_stream_errors_and_rejections():
    r = stream.StreamResult(t_start=0.0, status=200)
    r.feed('data: {"choices":[{"index":0,"delta":{"content":"x"},"finish_reason":null}]}', 0.1)
    r.feed('data: {"error":{"message":"the engine replica serving this request failed","type":"x","code":503}}', 0.2)
    assert not r.ok and "engine replica" in r.error
    r = stream.StreamResult(t_start=0.0, status=200)
    r.feed('data: {"choices":[{"index":0,"delta":{"content":"x"},"finish_reason":null}]}', 0.1)
    assert not r.ok  # no [DONE]: cut off
    r = stream.StreamResult(t_start=0.0, status=429)
    assert r.rejected and not r.ok
    body = stream.chat_request("m", [{"role": "user", "content": "hi"}], 8, temperature=0)
    assert body["stream"] and body["stream_options"] == {"include_usage": True}
    assert isinstance(body["temperature"], float)  # the API's temperature is a strict float


def test_summary_counts_rejections_apart_and_goodput_uses_the_slo():
    def done(ttft, tpot, n=5):
        r = stream.StreamResult(t_start=0.0, status=200, t_first=ttft, done=True, finish_reason="length",
                                completion_tokens=n, prompt_tokens=10)
        r.t_end = ttft + tpot * (n - 1)
        r.chunk_times = [ttft + tpot * i for i in range(n)]
        return r
    results = [done(0.1, 0.01), done(0.2, 0.05), done(3.0, 0.01), stream.StreamResult(t_start=0, status=429),
               stream.StreamResult(t_start=0, status=500, error="HTTP 500")]
    s = sweep.summarize(results, duration=10.0, rate=1.0, burstiness=1.0, slo_ttft_ms=1000, slo_tpot_ms=20)
    assert (s["completed"], s["rejected"], s["failed"]) == (3, 1, 1)
    assert s["rejection_rate"] == pytest.approx(0.2)
    assert s["goodput"] == pytest.approx(0.1)  # only the first meets both TTFT <= 1 s and TPOT <= 20 ms
    assert s["request_throughput"] == pytest.approx(0.3)
    assert s["output_throughput"] == pytest.approx(1.5) and s["total_token_throughput"] == pytest.approx(4.5)
    assert s["ttft"]["p50"] == pytest.approx(200) and s["ttft"]["count"] == 3
    assert s["itl"]["count"] == 12 and s["errors"] == ["HTTP 500"]


def test_prompts_from_the_package_generator_and_from_jsonl(tmp_path):
    gen = prompts.load_prompts("gsm_symbolic", n=5, seed=3)
    assert len(gen) == 5 and all(m[0]["role"] == "user" and len(m[0]["content"]) > 40 for m in gen)
    assert gen == prompts.load_prompts("gsm_symbolic", n=5, seed=3)  # seeded: the same questions
    f = tmp_path / "p.jsonl"
    f.write_text('{"prompt": "a"}\n\n{"messages": [{"role": "user", "content": "b"}]}\n{"question": "c"}\n')
    assert [m[-1]["content"] for m in prompts.load_prompts(str(f), n=4)] == ["a", "b", "c", "a"]
    f.write_text('{"prompt": "a"}\n{"text": "b"}\n')
    with pytest.raises(ValueError, match=":2:"):
        prompts.load_prompts(str(f))
    with pytest.raises(ValueError, match="neither a generator"):
        prompts.load_prompts("no-such-source")
