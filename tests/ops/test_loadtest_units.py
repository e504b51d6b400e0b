"""Pieces of the load tests that need no server: arrival processes, SSE timing, prompts, summaries.
(The runs against the real service are in test_live_service.py.)"""
import asyncio
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
