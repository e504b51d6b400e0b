"""Pieces of the load tests that need no server: arrival processes, SSE timing, prompts, summaries.
(The runs against the real service are in test_live_service.py.)"""
import asyncio
import json
import math
import random
import sys
import types

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


def _done(ttft, tpot, n=5):
    r = stream.StreamResult(t_start=0.0, status=200, t_first=ttft, done=True, finish_reason="length",
                            completion_tokens=n, prompt_tokens=10)
    r.t_end = ttft + tpot * (n - 1)
    r.chunk_times = [ttft + tpot * i for i in range(n)]
    return r


def test_per_token_latency_is_end_to_end_over_output_tokens():
    # e2e 0.1 + 0.02 * 4 = 0.18 s over 5 tokens = 36 ms; 0.5 + 0.1 * 9 = 1.4 s over 10 tokens = 140 ms
    results = [_done(0.1, 0.02, n=5), _done(0.5, 0.1, n=10), stream.StreamResult(t_start=0, status=429)]
    s = sweep.summarize(results, duration=5.0, rate=1.0, burstiness=1.0, slo_ttft_ms=1000, slo_tpot_ms=200)
    assert s["per_token_latency"]["count"] == 2  # the rejection has no latency
    assert s["per_token_latency"]["mean"] == pytest.approx((36 + 140) / 2)
    assert s["per_token_latency"]["p50"] == pytest.approx((36 + 140) / 2)


def _rate(rate, ttft_p90_ms, completed=10, n=10):
    return {"rate": rate, "num_requests": n, "completed": completed, "ttft": {"p90": ttft_p90_ms}}


def test_sustained_rate_is_the_highest_rate_below_which_every_rate_meets_the_slo():
    run = {"label": "x", "results": [_rate(4, 900), _rate(0.5, 100), _rate(1, 400), _rate(2, 2500), _rate("inf", 50)]}
    # sorted: 0.5 ok, 1 ok, 2 misses the 2 s target, 4 passes again (noise, not capacity); inf is no rate
    assert sweep.sustained_rate(run, ttft_ms=2000, percentile=90) == 1
    assert sweep.sustained_rate(run, ttft_ms=3000, percentile=90) == 4
    assert sweep.sustained_rate(run, ttft_ms=50, percentile=90) is None
    # a rate with a failed, cut-off or rejected request does not sustain, whatever its TTFT
    run["results"][2] = _rate(1, 400, completed=9)
    assert sweep.sustained_rate(run, ttft_ms=2000, percentile=90) == 0.5
    assert not sweep.meets_slo({"rate": 1, "num_requests": 3, "completed": 3, "ttft": {"p90": None}}, 2000)


def _run_json(path, label, ttfts_ms, per_token_ms):
    results = [{**_rate(r, t), "per_token_latency": {"mean": p}} for r, t, p in zip((0.5, 1, 2), ttfts_ms,
                                                                                       per_token_ms)]
    path.write_text(json.dumps({"label": label, "model": "m", "results": results}))
    return path


def test_slo_command_writes_the_combined_record_and_the_per_token_plot(tmp_path, capsys):
    a = _run_json(tmp_path / "fp16.json", "fp16", [300, 2500, 9000], [20, 60, 300])
    b = _run_json(tmp_path / "diffkv.json", "diffkv", [250, 800, 4000], [18, 25, 120])
    out = tmp_path / "serve_sweep.json"
    assert sweep.main(["slo", str(a), str(b), "--ttft-ms", "2000", "--percentile", "90", "--device", "GPU X",
                       "--out", str(out)]) == 0
    rec = json.loads(out.read_text())
    assert rec["sustained_rate"] == {"fp16": 0.5, "diffkv": 1}
    assert rec["slo"]["ttft_ms"] == 2000 and rec["slo"]["percentile"] == 90 and rec["device"] == "GPU X"
    assert [r["label"] for r in rec["runs"]] == ["fp16", "diffkv"]
    assert "fp16: highest sustained rate 0.5 req/s" in capsys.readouterr().out
    png = tmp_path / "fig16.png"
    assert sweep.main(["plot", "--kind", "per-token", "--ttft-ms", "2000", str(a), str(b), "-o", str(png)]) == 0
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and png.stat().st_size > 10_000
    assert sweep.main(["slo", str(tmp_path / "serve_sweep.json")]) == 2  # not a run JSON: a clear error


class _FakeServer:
    """A loopback OpenAI-ish server: /v1/chat/completions streams `tokens` chunks, then [DONE] unless `hang`."""

    def __init__(self, hang: bool, tokens: int = 3):
        import threading

        self.hang, self.tokens, self.requests = hang, tokens, 0
        self.loop = asyncio.new_event_loop()
        ready = threading.Event()

        async def start():
            self.server = await asyncio.start_server(self.handle, "127.0.0.1", 0)
            self.port = self.server.sockets[0].getsockname()[1]
            ready.set()

        self.thread = threading.Thread(target=lambda: (self.loop.run_until_complete(start()), self.loop.run_forever()),
                                       daemon=True)
        self.thread.start()
        assert ready.wait(10)
        self.url = f"http://127.0.0.1:{self.port}"

    async def handle(self, reader, writer):
        length = 0
        while (line := await reader.readline()) not in (b"\r\n", b""):
            if line.lower().startswith(b"content-length:"):
                length = int(line.split(b":", 1)[1])
        # Read the body (ignored) before answering: closing with unread bytes resets the connection, which the
        # client can see as a failed request (a flaky count).
        await reader.readexactly(length)
        self.requests += 1
        writer.write(b"HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\nConnection: close\r\n\r\n")
        for line in _events(["tok"] * self.tokens, usage={"prompt_tokens": 4, "completion_tokens": self.tokens})[:-2]:
            writer.write((line + "\n").encode())
        await writer.drain()
        if self.hang:
            await asyncio.sleep(3600)
        writer.write(b"data: [DONE]\n\n")
        await writer.drain()
        writer.close()

    def close(self):
        async def shutdown():
            self.server.close()
            for task in asyncio.all_tasks():
                if task is not asyncio.current_task():
                    task.cancel()

        asyncio.run_coroutine_threadsafe(shutdown(), self.loop).result(5)
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(5)


def test_drain_timeout_cancels_requests_left_open_and_counts_them_failed():
    server = _FakeServer(hang=True)
    try:
        import time

        t0 = time.monotonic()
        results, _ = asyncio.run(sweep.run_rate(server.url, "m", [[{"role": "user", "content": "q"}]], float("inf"), 3,
                                                1.0, 0, 8, 0.0, 60.0, None, "test", drain_timeout=0.5))
        assert time.monotonic() - t0 < 10
        assert len(results) == 3 and not any(r.ok for r in results)
        assert all("cancelled" in r.error for r in results)
        s = sweep.summarize(results, 1.0, float("inf"), 1.0, 1000, 100)
        assert s["failed"] == 3 and s["completed"] == 0 and not sweep.meets_slo(s, 1000)
    finally:
        server.close()


def test_run_warms_up_writes_after_each_rate_and_skips_rates_past_the_budget(tmp_path):
    server = _FakeServer(hang=False, tokens=4)
    try:
        prompts_file = tmp_path / "p.jsonl"
        prompts_file.write_text('{"prompt": "q"}\n')
        args = sweep.build_parser().parse_args([
            "run", "--base-url", server.url, "--model", "m", "--prompts", str(prompts_file), "--rates", "1000,0.01",
            "--num-requests", "2", "--warmup", "1", "--time-budget-s", "30", "--label", "t"])
        seen = []
        report = sweep.run(args, on_rate=lambda rep: seen.append(len(rep["results"])))
        assert server.requests == 1 + 2  # the warm-up, then the first rate; 2 requests at 0.01/s need 200 s
        assert seen == [1] and report["skipped_rates"] == [0.01] and report["warmup_s"] > 0
        r = report["results"][0]
        assert r["completed"] == 2 and r["output_tokens"] == 8 and r["per_token_latency"]["count"] == 2
    finally:
        server.close()


# ---- the soak test's pieces ------------------------------------------------------------------------------------
soak_requests = load("loadtest/soak_requests.py", "soak_requests")
soak_report = load("loadtest/soak_report.py", "soak_report")
soak_cluster = load("loadtest/soak_cluster.py", "soak_cluster")
soak = load("loadtest/soak.py", "soak")

_ERR = {"error": {"message": "over capacity", "type": "rate_limit_error", "param": None, "code": "queue_delay"}}
_CHUNK = '{"id":"chatcmpl-1","choices":[{"index":0,"delta":{"content":"x"},"finish_reason":%s}]}'


def _ex(kind="stream", **kw):
    return soak_requests.Exchange(kind, **kw)


@pytest.mark.parametrize("ex,outcome", [
    (_ex(status=200, events=[_CHUNK % "null", _CHUNK % '"length"', "[DONE]"]), "completed"),
    (_ex("plain", status=200, body=json.dumps({"id": "c", "choices": [{"finish_reason": "stop"}],
                                               "usage": {}}).encode()), "completed"),
    (_ex(status=429, body=json.dumps(_ERR).encode()), "rejected"),
    (_ex(status=503, body=json.dumps(_ERR).encode()), "unavailable"),
    (_ex("bad", status=400, body=json.dumps(_ERR).encode()), "invalid"),
    (_ex(status=200, events=[_CHUNK % "null", json.dumps(_ERR)]), "stream_error"),
    (_ex("disconnect", status=200, events=[_CHUNK % "null"], closed_by_client=True), "disconnected"),
    (_ex("abort", closed_by_client=True), "disconnected"),
    # lost: each way a request can vanish without a clean answer
    (_ex(status=200, events=[_CHUNK % "null"]), "lost"),                               # cut off, no error event
    (_ex(status=200, events=[_CHUNK % "null"], transport_error="RemoteProtocolError: peer closed"), "lost"),
    (_ex(status=500, body=json.dumps(_ERR).encode()), "lost"),                         # a 500 is never clean
    (_ex(status=503, body=b"Service Unavailable"), "lost"),                            # no OpenAI error body
    (_ex(status=429, body=json.dumps({"error": {"message": "x"}}).encode()), "lost"),  # an incomplete one
    (_ex(timed_out=True, status=200, events=[_CHUNK % "null"]), "lost"),               # hung
    (_ex(transport_error="ConnectError: refused"), "lost"),                            # no response at all
    (_ex(status=200, events=["[DONE]"]), "lost"),                                      # [DONE] without a finish
    (_ex(status=200, events=[json.dumps({"error": {"message": "m"}})]), "lost"),      # error event not OpenAI's
    (_ex(status=200, events=[_CHUNK % '"stop"', "[DONE]", _CHUNK % "null"]), "lost"),  # events after [DONE]
    (_ex("plain", status=200, body=b'{"choices": []}'), "lost"),
])
def test_soak_judges_every_way_a_request_ends(ex, outcome):
    assert soak_requests.judge(ex).outcome == outcome


def test_soak_mix_parses_and_refuses_bad_input():
    mix = soak_requests.parse_mix("stream=2, bad=1, disconnect=1")
    assert mix == {"stream": 0.5, "plain": 0.0, "disconnect": 0.25, "abort": 0.0, "bad": 0.25}
    for bad, match in [("stream=1,nope=2", "nope"), ("stream", "KIND=WEIGHT"), ("stream=x", "not a number"),
                       ("stream=-1", ">= 0"), ("stream=0", "weight > 0"), ("bad=1", "only bad requests")]:
        with pytest.raises(ValueError, match=match):
            soak_requests.parse_mix(bad)


def test_soak_bad_bodies_are_each_refused_by_the_ingress_schema():
    from diffkv_serve.service.protocol import ChatCompletionRequest

    cases = soak_requests.bad_bodies("m", max_model_len=512)
    assert len({name for name, _ in cases}) == len(cases) >= 10
    for name, raw in cases:
        try:
            body = json.loads(raw)
        except json.JSONDecodeError:
            assert name == "malformed JSON"
            continue
        try:
            req = ChatCompletionRequest.model_validate(body)
        except Exception:
            continue  # the schema refuses it: FastAPI answers 400
        # the rest pass the schema and are refused by the ingress before admission (model, context)
        assert req.model != "m" or req.requested_max_tokens()[0] >= 512, name


def test_soak_poisson_times_have_the_rate():
    rng = random.Random(int(np.random.default_rng().integers(1 << 30)))
    t = soak.poisson_times(5.0, 4000.0, rng)
    assert all(0 < a < b < 4000 for a, b in zip(t, t[1:]))
    assert len(t) / 4000 == pytest.approx(5.0, rel=0.03)  # sd of the count: sqrt(20000) = 0.7%
    with pytest.raises(ValueError, match="rate"):
        soak.poisson_times(0.0, 10, rng)


def test_soak_rss_trend_recovers_a_slope_after_warm_up():
    rng = np.random.default_rng()
    slope = float(rng.uniform(-3, 3))  # MB per minute
    t = np.arange(0, 1200, 5.0)
    mb = 900 + slope * t / 60 + rng.normal(0, 0.5, t.size)
    mb[t < 120] -= 400 * np.exp(-t[t < 120] / 20)  # the model loading: excluded by the warm-up
    got = soak_report.rss_trend(list(zip(t.tolist(), mb.tolist())), warmup_s=120)
    # 216 points over 18 min with 0.5 MB noise: the fitted slope's sd is ~0.01 MB/min
    assert got["slope_mb_per_min"] == pytest.approx(slope, abs=0.1)
    assert got["warm_samples"] == int((t >= 120).sum())
    assert got["max_minus_min_mb"] == pytest.approx(float(np.ptp(mb[t >= 120])))
    assert soak_report.rss_trend([(0.0, 1.0), (1.0, 2.0)], warmup_s=0)["slope_mb_per_min"] is None


def test_soak_rss_is_flat_only_when_every_long_lived_engine_process_is():
    def samples(rid, dep, slope, start=0.0, end=900.0):
        return [{"t": t, "deployment": dep, "replica": rid, "pid": hash(rid) % 10000, "mb": 500 + slope * t / 60}
                for t in np.arange(start, end, 10.0).tolist()]
    flat = samples("a", "EngineReplica", 0.1) + samples("i", "OpenAIIngress", 30.0)  # the ingress is not judged
    assert soak_report.rss_summary(flat, 60, 2.0, 180)["flat"] is True
    growing = flat + samples("b", "EngineReplica", 5.0)
    s = soak_report.rss_summary(growing, 60, 2.0, 180)
    assert s["flat"] is False and s["max_abs_slope_mb_per_min"] == pytest.approx(5.0)
    short = samples("c", "EngineReplica", 50.0, start=700.0)  # too short after warm-up to judge
    assert soak_report.rss_summary(short, 60, 2.0, 180)["flat"] is None


def test_soak_summary_and_invariants():
    recs = [{"kind": "stream", "status": 200, "outcome": "completed", "detail": "", "t_send": 0.0, "t_end": 2.0,
             "ttft": 0.5},
            {"kind": "bad", "case": "unknown field", "status": 400, "outcome": "invalid", "detail": "", "t_send": 1.0,
             "t_end": 1.1},
            {"kind": "abort", "status": 0, "outcome": "disconnected", "detail": "", "t_send": 1.0, "t_end": 1.5},
            {"kind": "stream", "status": 503, "outcome": "unavailable", "detail": "", "t_send": 2.0, "t_end": 2.1}]
    s = soak_report.summarize(recs, 10.0, 0.4)
    assert s["status_counts"] == {"200": 1, "429": 0, "503": 1, "4xx": 1, "other_5xx": 0, "none": 1, "other": 0}
    assert s["clean_errors"] == 2 and s["outcomes"]["lost"] == 0
    kill = {"replaced_by": "new"}
    pages = {"all_free": True}
    inv = soak_report.invariants(s, kill, pages, {"flat": None})
    assert inv["ok"] and inv["replica_rss_flat"] is None
    assert not soak_report.invariants(s, {"replaced_by": None}, pages, {"flat": None})["ok"]
    assert not soak_report.invariants(s, kill, {"all_free": False}, {"flat": None})["ok"]
    lost = soak_report.summarize(recs + [{"kind": "plain", "status": 500, "outcome": "lost", "detail": "HTTP 500",
                                          "t_send": 3.0, "t_end": 3.2}], 10.0, 0.5)
    inv = soak_report.invariants(lost, kill, pages, {"flat": True})
    assert not inv["ok"] and not inv["nothing_lost"] and not inv["no_other_5xx"]
    assert lost["lost"][0]["detail"] == "HTTP 500"
    wrong = soak_report.summarize([dict(recs[1], status=429, outcome="rejected")], 10.0, 0.1)
    assert not soak_report.invariants(wrong, None, None, {"flat": None})["bad_requests_all_400"]


def test_soak_reads_the_page_gauges_per_replica():
    text = ('ray_diffkv_kv_pages_used{replica="a",rank="0",SessionName="s"} 3.0\n'
            'ray_diffkv_kv_pages_used{replica="a",rank="1",SessionName="s"} 2.0\n'
            'ray_diffkv_kv_pages_total{replica="a",rank="0"} 100.0\n'
            'ray_diffkv_kv_pages_total{replica="a",rank="1"} 100.0\n'
            'ray_diffkv_kv_pages_used{replica="b",rank="0"} 0.0\n'
            'ray_diffkv_kv_pages_total{replica="b",rank="0"} 50.0\n'
            '# HELP ray_diffkv_requests_in_flight x\nray_diffkv_requests_in_flight{Component="x"} 4.0\n'
            'ray_diffkv_requests_retried_total{endpoint="chat"} 2.0\n'
            'ray_diffkv_requests_retried_total{endpoint="completions"} 1.0\n')
    samples = soak_cluster.parse_metrics(text)
    assert soak_cluster.pages_by_replica(samples) == {"a": {"used": 5.0, "total": 200.0},
                                                      "b": {"used": 0.0, "total": 50.0}}
    assert soak_cluster.in_flight(samples) == 4.0
    assert soak_cluster.in_flight(samples[:2]) is None
    assert soak_cluster.retried(samples) == 3.0 and soak_cluster.retried(samples[:2]) is None


def test_a_local_ray_node_that_fails_to_start_is_started_again_on_a_new_port(monkeypatch, capsys):
    """A metrics port found free can be taken before Ray's agent binds it, and the node then times out at startup:
    init_local_ray shuts the attempt down and starts again on a newly picked port; past the last attempt it raises."""
    ports, shutdowns, failures = [], [], {"left": 1}

    def init(**kw):
        assert kw["address"] == "local" and kw["num_cpus"] == 2
        ports.append(kw["_metrics_export_port"])
        if failures["left"]:
            failures["left"] -= 1
            raise Exception("The current node timed out during startup.")

    monkeypatch.setitem(sys.modules, "ray", types.SimpleNamespace(init=init, shutdown=lambda: shutdowns.append(1)))
    assert soak_cluster.init_local_ray(2) == ports[-1]
    assert len(ports) == 2 and len(shutdowns) == 1
    assert "attempt 2 of 3" in capsys.readouterr().out

    ports.clear(), shutdowns.clear()
    failures["left"] = 5
    with pytest.raises(Exception, match="timed out during startup"):
        soak_cluster.init_local_ray(2)
    assert len(ports) == len(shutdowns) == soak_cluster.START_ATTEMPTS
    with pytest.raises(ValueError, match="attempts=0"):
        soak_cluster.on_a_free_port(lambda port: port, attempts=0)


def test_soak_report_json_round_trips_with_one_line_per_request(tmp_path):
    rng = np.random.default_rng()
    recs = [{"id": i, "kind": "stream", "case": None, "t_send": float(rng.uniform(0, 100)), "t_end": 101.0,
             "status": 200, "outcome": "completed", "ttft": float(rng.uniform(0, 1))} for i in range(30)]
    report = {"request_columns": list(soak_report.REQUEST_COLUMNS), "requests": soak_report.request_rows(recs)}
    text = soak_report.to_json(report)
    back = soak_report.requests_of(json.loads(text))
    assert [r["id"] for r in back] == list(range(30))
    rows = [line for line in text.splitlines() if line.strip().startswith("[") and line.rstrip(",").endswith("]")]
    assert len(rows) == 30
    assert all(abs(b["t_send"] - r["t_send"]) <= 5e-4 for b, r in zip(back, recs))


@pytest.mark.parametrize("flags,field", [(["--duration", "0"], "--duration"), (["--rate", "-1"], "--rate"),
                                         (["--kill-at", "1.5"], "--kill-at"), (["--max-tokens", "1"], "--max-tokens"),
                                         (["--url", "http://example.com"], "--url"), (["--mix", "x=1"], "--mix"),
                                         (["--load", "0"], "--load"), (["--replicas", "0"], "--replicas")])
def test_soak_flags_are_checked_naming_the_flag(flags, field):
    args = soak.build_parser().parse_args(flags)
    with pytest.raises(ValueError, match=field):
        soak.check_args(args)
    args = soak.build_parser().parse_args(["--service-config", '{"kv_mode": "nope"}'])
    with pytest.raises(ValueError, match="kv_mode"):
        soak.service_config(args)
