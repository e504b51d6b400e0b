"""SIGTERM on `diffkv serve` under streaming load drains: readiness and new requests get 503 at once,
requests in flight run to completion within --drain-timeout, what is still running then ends with an SSE
error event (streams) or a 503 (non-streaming), and the process exits cleanly (no traceback, no Serve
shutdown noise) within the drain timeout + 10 s. CPU, embedded model, loopback."""
import pytest
import json
import os
import signal
import subprocess
import sys
import threading
import time

import httpx

from _cluster import free_port, wait_for, wait_serve_healthy

DRAIN_TIMEOUT_S = 6.0
SHORT, LONG = 16, 400  # max_tokens: done within the drain / still generating at its timeout


def _stream(base, model, max_tokens, i, out, started):
    events = []
    try:
        with httpx.stream("POST", base + "/v1/chat/completions", timeout=120, json={
                "model": model, "stream": True, "max_tokens": max_tokens, "temperature": 0,
                "messages": [{"role": "user", "content": f"Write a very long story about dragon number {i}."}]}) as r:
            assert r.status_code == 200
            for line in r.iter_lines():
                if line.startswith("data: "):
                    events.append(line[len("data: "):])
                    started.set()
        out[i] = ("ended", events)
    except Exception as e:  # noqa: BLE001 - a cut connection is what the test looks for
        out[i] = ("broken", events, repr(e))


def _complete(base, model, out):
    r = httpx.post(base + "/v1/completions", timeout=120, json={
        "model": model, "prompt": "Once upon a time, in a land of dragons,", "max_tokens": LONG, "temperature": 0})
    out["full"] = r


@pytest.mark.slow
def test_sigterm_drains_streams_then_exits_cleanly(tmp_path):
    port = free_port()
    log_path = tmp_path / "serve.log"
    log = open(log_path, "w")
    proc = subprocess.Popen([sys.executable, "-m", "diffkv_serve.service.cli", "serve", "--device", "cpu", "--port", str(port),
                             "--num-cpus", "4", "--max-model-len", "512", "--no-admission",
                             "--drain-timeout", str(DRAIN_TIMEOUT_S)],
                            stdout=log, stderr=subprocess.STDOUT, env={**os.environ, "RAY_USAGE_STATS_ENABLED": "0"})
    base = f"http://127.0.0.1:{port}"
    try:
        model = wait_serve_healthy(proc, base, log_path, interval=0.5)

        out, threads, started = {}, [], []
        for i in range(8):  # 6 that finish within the drain, 2 that are cut at its timeout
            started.append(threading.Event())
            threads.append(threading.Thread(target=_stream, args=(base, model, SHORT if i < 6 else LONG, i, out,
                                                                  started[-1])))
        threads.append(threading.Thread(target=_complete, args=(base, model, out)))
        for t in threads:
            t.start()
        assert all(e.wait(60) for e in started), "every stream should be generating before the signal"

        t_signal = time.monotonic()
        proc.send_signal(signal.SIGTERM)
        wait_for(lambda: httpx.get(base + "/health", timeout=5).status_code == 503, 5, interval=0.1,
                 what="/health to turn 503 (not ready)")
        new = httpx.post(base + "/v1/completions", timeout=10, json={"model": model, "prompt": "Hi", "max_tokens": 2})
        assert new.status_code == 503 and new.headers["retry-after"] and new.json()["error"]["type"] == \
            "service_unavailable"

        for t in threads:
            t.join(60)
        rc = proc.wait(timeout=DRAIN_TIMEOUT_S + 30)
        exit_s = time.monotonic() - t_signal
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        log.close()
    text = log_path.read_text()

    broken = {i: o for i, o in out.items() if i != "full" and o[0] == "broken"}
    assert not broken, broken
    for i in range(8):
        last = out[i][1][-1]
        if i < 6:
            assert last == "[DONE]", (i, last)
        else:  # still generating at the timeout: ended by an error event, not cut
            err = json.loads(last)["error"]
            assert err["type"] == "service_unavailable" and "drain timeout" in err["message"], err
    full = out["full"]
    assert full.status_code == 503 and full.headers["retry-after"], full.text
    assert "drain timeout" in full.json()["error"]["message"]

    assert rc == 0 and exit_s < DRAIN_TIMEOUT_S + 10, (rc, exit_s)
    assert "Traceback" not in text and "graceful_shutdown failed" not in text, text[-4000:]
    assert "drained in" in text
    print(f"drain: 6/6 short streams [DONE], 2/2 long streams and 1 non-streaming request ended with 503 at the "
          f"timeout, 0 broken; exit {exit_s:.1f}s after SIGTERM (drain timeout {DRAIN_TIMEOUT_S:g}s)")


def test_diffkv_drain_reaches_every_ingress_replica_and_can_be_withdrawn(cluster):
    """`diffkv drain` (the KubeRay preStop hook) on an app with two ingress replicas: one announcement
    reaches both (a handle call would reach only one), a stream in flight finishes, a `--follow` (worker
    pod) hook waits for it, and `--cancel` puts both back to serving."""
    import ray

    from _cluster import served

    from diffkv_serve.service import drain

    app = "drain2"
    config = {"device": "cpu", "max_model_len": 256, "ingress_replicas": 2, "admission": {"ttft_target_s": 60.0}}
    cli = [sys.executable, "-m", "diffkv_serve.service.cli", "drain", "--address", ray.get_runtime_context().gcs_address,
           "--app", app]
    with served(cluster, config, app, "/" + app) as s:
        drain.clear(app)
        try:
            out, started = {}, threading.Event()
            stream = threading.Thread(target=_stream, args=(s["base"], s["model"], SHORT, 0, out, started))
            stream.start()
            assert started.wait(60)
            # a worker pod's hook: announces nothing, waits for the head's drain to finish
            follower = subprocess.Popen(cli + ["--follow", "--follow-s", "60"], stderr=subprocess.PIPE, text=True)
            r = subprocess.run(cli + ["--timeout", "30"], capture_output=True, text=True, timeout=90)
            assert r.returncode == 0 and "2 ingress replicas" in r.stderr and "drained in" in r.stderr, r.stderr
            _, err = follower.communicate(timeout=60)
            assert follower.returncode == 0 and "drained in" in err, err
            stream.join(30)
            assert out[0][0] == "ended" and out[0][1][-1] == "[DONE]", out
            reports = drain.reports(app)
            assert len(reports) == 2 and set(reports.values()) == {0}
            # Serve spreads these over both replicas: every one is refused
            codes = {httpx.get(s["base"] + "/health", timeout=10).status_code for _ in range(12)}
            codes |= {httpx.post(s["base"] + "/v1/completions", timeout=10,
                                 json={"model": s["model"], "prompt": "Hi"}).status_code for _ in range(12)}
            assert codes == {503}
            r = subprocess.run(cli + ["--cancel"], capture_output=True, text=True, timeout=90)
            assert r.returncode == 0, r.stderr
            wait_for(lambda: all(httpx.get(s["base"] + "/health", timeout=10).status_code == 200 for _ in range(8)),
                     10, interval=0.3, what="both replicas to serve again")
            wait_for(lambda: drain.reports(app) == {}, 5, interval=0.3, what="the reports to go")
        finally:
            drain.clear(app)
