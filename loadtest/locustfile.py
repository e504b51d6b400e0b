"""Locust load test of DiffKV Serve's OpenAI API: streaming chat requests arriving as a Poisson process.

    locust -f loadtest/locustfile.py --headless -H http://127.0.0.1:8000 -u 1 -r 1 -t 60s --stop-timeout 60 \
        --arrival-rate 2 --prompts gsm_symbolic --max-tokens 64 --csv results/locust

Open loop: each user draws exponential inter-arrival times (rate = --arrival-rate / users) and starts every
request in a greenlet of its own, so arrivals never wait for responses. --stop-timeout lets the requests that
arrived inside the run finish. Each request is reported as Locust request events:

    POST /v1/chat/completions   end-to-end latency (ms); response_length = output tokens. Failures: any
                                status but 200/429, an error event in the stream, a broken connection.
    TTFT chat                   time to first token (ms)
    TPOT chat                   time per output token after the first (ms)
    REJECTED 429                admission control's 429 + Retry-After: counted, never a failure
"""
from __future__ import annotations

import itertools
import random
import sys
import time
from pathlib import Path

import gevent
import requests
from gevent.pool import Group
from locust import User, events, task

sys.path.insert(0, str(Path(__file__).resolve().parent))
from prompts import load_prompts  # noqa: E402
from stream import StreamResult, chat_request  # noqa: E402

CHAT_PATH = "/v1/chat/completions"
_shared: dict = {}  # prompts, model: loaded once per Locust process


@events.init_command_line_parser.add_listener
def _options(parser):
    g = parser.add_argument_group("DiffKV Serve load test")
    g.add_argument("--arrival-rate", type=float, default=1.0, help="Poisson arrival rate, requests/s (all users)")
    g.add_argument("--prompts", default="gsm_symbolic", help="gsm_symbolic (reasoning-gym) or a JSONL file")
    g.add_argument("--num-prompts", type=int, default=256, help="prompts generated / cycled through")
    g.add_argument("--max-tokens", type=int, default=64, help="max_tokens of each request")
    g.add_argument("--temperature", type=float, default=0.0)
    g.add_argument("--model", default="", help="model name; default: the server's (GET /v1/models)")
    g.add_argument("--seed", type=int, default=0, help="seed of the arrival times and the prompt generator")
    g.add_argument("--max-in-flight", type=int, default=512,
                   help="client-side bound on open requests; an arrival over it is a failure (the client, not "
                        "the server, is saturated)")
    g.add_argument("--request-timeout", type=float, default=300.0, help="seconds without a byte before a "
                                                                         "request fails")


@events.init.add_listener
def _load_prompts(environment, **_):
    opts = environment.parsed_options
    if opts is not None:
        _shared["prompts"] = load_prompts(opts.prompts, opts.num_prompts, opts.seed)


def _model(host: str, opts) -> str:
    if opts.model:
        return opts.model
    if "model" not in _shared:
        r = requests.get(host.rstrip("/") + "/v1/models", timeout=30)
        r.raise_for_status()
        _shared["model"] = r.json()["data"][0]["id"]
    return _shared["model"]


def _ms(seconds) -> float:
    return 1000.0 * (seconds or 0.0)


class PoissonChatUser(User):
    """Arrivals at rate/users: the task only launches a request; wait_time is the exponential gap."""

    _ids = itertools.count()

    def __init__(self, environment):
        super().__init__(environment)
        opts = environment.parsed_options
        self.opts = opts
        users = max(1, getattr(opts, "num_users", None) or 1)
        self.rate = opts.arrival_rate / users
        if self.rate <= 0:
            raise ValueError(f"--arrival-rate must be > 0, got {opts.arrival_rate}")
        uid = next(self._ids)
        self.rng = random.Random(opts.seed * 1_000_003 + uid)
        self.prompt_order = itertools.cycle(range(uid, uid + len(_shared["prompts"])))
        self.session = requests.Session()
        adapter = requests.adapters.HTTPAdapter(pool_connections=1, pool_maxsize=opts.max_in_flight)
        self.session.mount("http://", adapter)
        self.session.mount("https://", adapter)
        self.requests = Group()

    def wait_time(self) -> float:
        return self.rng.expovariate(self.rate)

    def on_start(self):
        self.url = self.host.rstrip("/") + CHAT_PATH
        self.model = _model(self.host, self.opts)

    @task
    def arrive(self):
        if len(self.requests) >= self.opts.max_in_flight:
            self.environment.events.request.fire(
                request_type="POST", name=CHAT_PATH, response_time=0, response_length=0, context={},
                exception=RuntimeError(f"client saturated: {self.opts.max_in_flight} requests open"))
            return
        prompts = _shared["prompts"]
        self.requests.spawn(self._request, prompts[next(self.prompt_order) % len(prompts)])

    def on_stop(self):
        # Requests that arrived inside the run finish (bounded by --stop-timeout, which kills this greenlet).
        self.requests.join()

    # ---- one request -------------------------------------------------------------------------------------------
    def _request(self, messages):
        body = chat_request(self.model, messages, self.opts.max_tokens, self.opts.temperature)
        res = StreamResult(t_start=time.monotonic())
        try:
            with self.session.post(self.url, json=body, stream=True, timeout=(10, self.opts.request_timeout)) as r:
                res.status = r.status_code
                if r.status_code == 200:
                    for line in r.iter_lines(chunk_size=None, decode_unicode=True):
                        res.feed(line, time.monotonic())
                    if not res.done and res.error is None:
                        res.fail("the stream ended without [DONE]", time.monotonic())
                else:
                    res.fail(f"HTTP {r.status_code}: {r.text[:300]}", time.monotonic())
        except requests.RequestException as e:
            res.fail(f"{type(e).__name__}: {e}", time.monotonic())
        except gevent.GreenletExit:
            res.fail("cancelled when the run stopped (raise --stop-timeout)", time.monotonic())
            self._report(res)
            raise
        self._report(res)

    def _report(self, res: StreamResult) -> None:
        fire = self.environment.events.request.fire
        if res.rejected:
            fire(request_type="REJECTED", name="429", response_time=_ms(res.e2e), response_length=0,
                 exception=None, context={})
            return
        if not res.ok:
            fire(request_type="POST", name=CHAT_PATH, response_time=_ms(res.e2e), response_length=res.output_tokens,
                 exception=RuntimeError(res.error or f"HTTP {res.status}, finish_reason={res.finish_reason}"),
                 context={})
            return
        fire(request_type="POST", name=CHAT_PATH, response_time=_ms(res.e2e), response_length=res.output_tokens,
             exception=None, context={})
        if res.ttft is not None:
            fire(request_type="TTFT", name="chat", response_time=_ms(res.ttft), response_length=0, exception=None,
                 context={})
        if res.tpot is not None:
            fire(request_type="TPOT", name="chat", response_time=_ms(res.tpot), response_length=0, exception=None,
                 context={})


@events.quitting.add_listener
def _summary(environment, **_):
    stats = environment.stats
    done = stats.get(CHAT_PATH, "POST")
    rejected = stats.get("429", "REJECTED")
    ttft = stats.get("chat", "TTFT")
    arrivals = done.num_requests + rejected.num_requests
    if arrivals:
        print(f"[diffkv] arrivals {arrivals}: completed {done.num_requests - done.num_failures}, "
              f"rejected (429) {rejected.num_requests}, failed {done.num_failures}; TTFT p50 "
              f"{ttft.get_response_time_percentile(0.5):.0f} ms p99 {ttft.get_response_time_percentile(0.99):.0f} ms",
              file=sys.stderr)
