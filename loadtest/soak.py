"""Soak test: Poisson load near capacity for a long while, mixed with client disconnects, aborts and bad
requests, one engine replica killed midway, and a check that nothing was lost.

    python3 loadtest/soak.py --duration 1200                 # starts its own Ray + Serve (2 replicas, CPU)
    python3 loadtest/soak.py --url http://127.0.0.1:8000 --metrics-url http://127.0.0.1:8080/metrics \
        --ray-address auto --duration 1200                   # a running service on this machine

Every request is tracked by its id to one outcome: completed, a clean error (429 / 503 / 400 with OpenAI's
error body, or a stream ending with an error event), disconnected by us, or lost (anything else: a hang, a
reset connection, a 500, a stream cut off without an error event). After the load drains, the KV page gauges
of the live replicas must all read 0 pages used. Replica processes' RSS is sampled throughout (psutil on the
actors' PIDs) and its slope after warm-up reported. Writes a JSON report and a PNG; exits 1 when an
invariant is broken.

The rate: --rate, or --load (0.9) x the capacity measured first (closed loop, --capacity-s seconds), scaled up
for the share of bad requests (the ingress refuses those without touching an engine).
"""
from __future__ import annotations

import argparse
import asyncio
import datetime
import json
import os
import platform
import random
import sys
import threading
import time
from pathlib import Path
from typing import Optional

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(1, str(REPO))  # this tree's `service` (the Ray workers get it through PYTHONPATH, main())

import soak_cluster as cluster  # noqa: E402
import soak_report  # noqa: E402
from soak_requests import (ABORT, BAD, COMPLETED, DISCONNECT, STREAM, Exchange, bad_bodies,  # noqa: E402
                           chat_body, has_content, judge, parse_mix)

ENGINE, INGRESS = "EngineReplica", "OpenAIIngress"  # service.app's deployment names
DEFAULT_MIX = "stream=0.55,plain=0.15,disconnect=0.1,abort=0.05,bad=0.15"
NO_BODY = ("", b"")


# ---- one request ---------------------------------------------------------------------------------------------
async def _send(client, url: str, raw: bytes, ex: Exchange, stream: bool, close_after: Optional[int],
                t0: float) -> None:
    import httpx

    try:
        async with client.stream("POST", url, content=raw, headers={"content-type": "application/json"}) as r:
            ex.status = r.status_code
            if r.status_code != 200 or not stream:
                ex.body = await r.aread()
                return
            async for line in r.aiter_lines():
                if not line.startswith("data:"):
                    continue
                data = line[5:].strip()
                ex.events.append(data)
                if ex.ttft is None and has_content(data):
                    ex.ttft = time.monotonic() - t0
                if close_after is not None and len(ex.events) >= close_after and data != "[DONE]":
                    ex.closed_by_client = True  # leaving the block closes the connection mid-stream
                    return
    except httpx.HTTPError as e:
        ex.transport_error = f"{type(e).__name__}: {e}"


async def exchange(client, base: str, kind: str, model: str, messages: list, max_tokens: int, timeout: float,
                   rng: random.Random, bad: tuple[str, bytes] = NO_BODY) -> Exchange:
    """Send one request of `kind` and return what came back. Disconnects close the stream after a few events;
    aborts close the request (streamed or not) after a random 0.05-2 s, wherever it is by then."""
    ex = Exchange(kind)
    stream = kind in (STREAM, DISCONNECT) or (kind == ABORT and rng.random() < 0.5)
    raw = bad[1] if kind == BAD else json.dumps(chat_body(model, messages, max_tokens, stream)).encode()
    close_after = 1 + rng.randint(1, max(1, max_tokens // 2)) if kind == DISCONNECT else None  # role event + k
    abort_after = rng.uniform(0.05, 2.0) if kind == ABORT else None
    url, t0 = base + "/v1/chat/completions", time.monotonic()
    try:
        async with asyncio.timeout(timeout):
            if abort_after is None:
                await _send(client, url, raw, ex, stream, close_after, t0)
            else:
                try:
                    async with asyncio.timeout(abort_after):
                        await _send(client, url, raw, ex, stream, None, t0)
                except TimeoutError:
                    ex.closed_by_client = True
    except TimeoutError:
        ex.timed_out = True
    return ex


def _client(limit: int):
    import httpx

    return httpx.AsyncClient(limits=httpx.Limits(max_connections=limit, max_keepalive_connections=64),
                             timeout=httpx.Timeout(None, connect=10))


# ---- capacity and load -----------------------------------------------------------------------------------------
async def measure_capacity(base: str, model: str, prompts: list, max_tokens: int, concurrency: int,
                           seconds: float, timeout: float) -> float:
    """Completed requests per second with `concurrency` streams kept open (closed loop)."""
    rng = random.Random(1)
    done = 0
    deadline = time.monotonic() + seconds

    async def worker(client, i: int) -> None:
        nonlocal done
        while time.monotonic() < deadline:
            ex = await exchange(client, base, STREAM, model, prompts[i % len(prompts)], max_tokens, timeout, rng)
            if judge(ex).outcome == COMPLETED:
                done += 1
            elif ex.status == 429:
                await asyncio.sleep(0.5)
            i += concurrency

    t0 = time.monotonic()
    async with _client(concurrency * 2) as client:
        await asyncio.gather(*(worker(client, i) for i in range(concurrency)))
    return done / (time.monotonic() - t0)


def poisson_times(rate: float, duration: float, rng: random.Random) -> list[float]:
    """Arrival times (s) of a Poisson process of `rate` over [0, duration)."""
    if not rate > 0:
        raise ValueError(f"rate must be > 0 requests/s, got {rate}")
    out, t = [], 0.0
    while True:
        t += rng.expovariate(rate)
        if t >= duration:
            return out
        out.append(t)


class Tracker:
    """Every request's record, by our own id, from its send to its outcome."""

    def __init__(self, t0: float):
        self.t0, self.records = t0, []

    def start(self, kind: str, case: Optional[str]) -> dict:
        rec = {"id": len(self.records), "kind": kind, "case": case, "t_send": time.monotonic() - self.t0,
               "outcome": None}
        self.records.append(rec)
        return rec

    def finish(self, rec: dict, ex: Exchange) -> None:
        v = judge(ex)
        rec.update(t_end=time.monotonic() - self.t0, status=ex.status, outcome=v.outcome, detail=v.detail,
                   response_id=v.response_id, ttft=ex.ttft)

    def open_count(self) -> int:
        return sum(r["outcome"] is None for r in self.records)


async def run_load(args, base: str, model: str, prompts: list, rate: float, mix: dict, tracker: Tracker) -> None:
    """Open loop: each request is sent at its Poisson time whatever the others do; returns when all answered
    (each is bounded by --request-timeout)."""
    rng = random.Random(args.seed)
    times = poisson_times(rate, args.duration, rng)
    kinds = rng.choices(list(mix), weights=list(mix.values()), k=len(times))
    bads = bad_bodies(model, args.context_limit)

    async def one(client, i: int, kind: str) -> None:
        bad = bads[i % len(bads)] if kind == BAD else NO_BODY
        rec = tracker.start(kind, bad[0] or None)
        ex = await exchange(client, base, kind, model, prompts[i % len(prompts)], args.max_tokens,
                            args.request_timeout, random.Random(args.seed * 1_000_003 + i), bad)
        tracker.finish(rec, ex)

    tasks = []
    async with _client(100_000) as client:
        for i, (t, kind) in enumerate(zip(times, kinds)):
            delay = tracker.t0 + t - time.monotonic()
            if delay > 0:
                await asyncio.sleep(delay)
            tasks.append(asyncio.create_task(one(client, i, kind)))
        await asyncio.gather(*tasks)


# ---- what runs beside the load: samples and the kill ----------------------------------------------------------
class Monitor(threading.Thread):
    """Every `period` seconds: each replica process's RSS and each live engine replica's KV pages (scraped);
    at `kill_at` seconds, kills the engine replica with the most pages in use, then watches for Serve's
    replacement (a new replica id, and the deployment back to `replicas` RUNNING)."""

    def __init__(self, target: cluster.Target, t0: float, period: float, kill_at: Optional[float], replicas: int):
        super().__init__(daemon=True)
        self.target, self.t0, self.period, self.kill_at, self.replicas = target, t0, period, kill_at, replicas
        self.rss: list[dict] = []
        self.pages: list[dict] = []
        self.in_flight: list[dict] = []
        self.kill: Optional[dict] = None
        self.errors: list[str] = []
        self.stop = threading.Event()

    def run(self) -> None:
        while not self.stop.is_set():
            try:
                self.sample()
            except Exception as e:  # a scrape or state call failing now and then must not end the samples
                self.errors.append(f"{time.monotonic() - self.t0:.0f}s: {type(e).__name__}: {e}")
            self.stop.wait(self.period)

    def engine_ids(self) -> Optional[set[str]]:
        if not self.target.ray_attached:
            return None
        return {r.replica_id for r in cluster.replicas(self.target.app) if r.deployment == ENGINE}

    def sample(self) -> None:
        t = time.monotonic() - self.t0
        live = None
        if self.target.ray_attached:
            procs = cluster.replicas(self.target.app)
            live = {r.replica_id for r in procs if r.deployment == ENGINE}
            for r in procs:
                rss = cluster.rss_bytes(r.pid)
                if rss is not None:
                    self.rss.append({"t": t, "deployment": r.deployment, "replica": r.replica_id, "pid": r.pid,
                                     "mb": rss / 2**20})
        if self.target.metrics_url:
            samples = cluster.scrape(self.target.metrics_url)
            for rid, p in cluster.pages_by_replica(samples).items():
                if live is None or rid in live:
                    self.pages.append({"t": t, "replica": rid, **p})
            flight = cluster.in_flight(samples)
            if flight is not None:
                self.in_flight.append({"t": t, "requests": flight})
        if self.kill_at is not None and self.kill is None and t >= self.kill_at and live:
            self.kill_one(t, live)
        elif self.kill is not None and self.kill.get("replaced_by") is None:
            self.check_replaced(t, live)

    def kill_one(self, t: float, live: set[str]) -> None:
        latest = {p["replica"]: p["used"] for p in self.pages if p["t"] >= t - 2 * self.period}
        victim = max((r for r in cluster.replicas(self.target.app) if r.deployment == ENGINE),
                     key=lambda r: (latest.get(r.replica_id, 0.0), r.replica_id))
        cluster.kill_replica(victim)
        self.kill = {"t": time.monotonic() - self.t0, "replica": victim.replica_id, "pid": victim.pid,
                     "pages_used_at_kill": latest.get(victim.replica_id), "replicas_before": sorted(live),
                     "replaced_by": None, "t_replaced": None, "time_to_replace_s": None}
        print(f"[soak] {self.kill['t']:.0f}s: killed engine replica {victim.replica_id} (pid {victim.pid}, "
              f"{latest.get(victim.replica_id, 0):.0f} pages in use)", file=sys.stderr, flush=True)

    def check_replaced(self, t: float, live: Optional[set[str]]) -> None:
        """Replaced: Serve counts the deployment whole again and the new replica's engine is up (its page pool
        is in the metrics, when there are metrics to read)."""
        new = sorted((live or set()) - set(self.kill["replicas_before"]))
        if self.target.metrics_url:
            up = {p["replica"] for p in self.pages if p["t"] >= t - 1e-6 and p["total"] > 0}
            new = [rid for rid in new if rid in up]
        if new and cluster.running_replicas(self.target.app, ENGINE) >= self.replicas:
            self.kill.update(replaced_by=new[0], t_replaced=t, time_to_replace_s=t - self.kill["t"])
            print(f"[soak] {t:.0f}s: Serve replaced it with {new[0]} after {t - self.kill['t']:.1f}s",
                  file=sys.stderr, flush=True)


def pages_at_end(target: cluster.Target, monitor: Monitor, timeout: float) -> Optional[dict]:
    """After the load: wait until every live engine replica's gauge reads 0 pages used (of > 0) and the ingress
    has nothing in flight; returns the last reading, `all_free` saying whether that happened in time."""
    if not target.metrics_url:
        return None
    last: dict = {}

    def free() -> bool:
        samples = cluster.scrape(target.metrics_url)
        pages = cluster.pages_by_replica(samples)
        live = monitor.engine_ids()
        if live is not None:
            pages = {rid: pages.get(rid, {"used": None, "total": 0.0}) for rid in live}
        flight = cluster.in_flight(samples)
        last.update(replicas=pages, in_flight=flight, retried=cluster.retried(samples),
                    t=time.monotonic() - monitor.t0)
        return bool(pages) and flight == 0 and all(p["total"] > 0 and p["used"] == 0 for p in pages.values())

    t0 = time.monotonic()
    ok = cluster.wait_until(free, timeout)
    return {**last, "all_free": bool(ok), "waited_s": time.monotonic() - t0}


# ---- the run ---------------------------------------------------------------------------------------------------
def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="soak.py", description=__doc__.split("\n\n")[0])
    p.add_argument("--duration", type=float, default=1200.0, help="seconds of load (default: 20 minutes)")
    p.add_argument("--rate", type=float, default=None, help="requests/s, bad ones included (default: measured)")
    p.add_argument("--load", type=float, default=0.9, help="without --rate: this fraction of measured capacity")
    p.add_argument("--capacity-s", type=float, default=30.0, help="seconds of the capacity measurement")
    p.add_argument("--mix", default=DEFAULT_MIX, help="request kinds and weights: stream, plain (not streamed), "
                                                       "disconnect (closed mid-stream), abort, bad (must be 400)")
    p.add_argument("--max-tokens", type=int, default=32)
    p.add_argument("--request-timeout", type=float, default=180.0, help="a request with no answer by then is lost")
    p.add_argument("--prompts", default="gsm_symbolic", help="gsm_symbolic or a JSONL file (loadtest/prompts.py)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--kill-at", type=float, default=0.4, help="kill an engine replica at this fraction of the "
                                                               "duration (needs Ray access)")
    p.add_argument("--no-kill", action="store_true", help="kill nothing")
    p.add_argument("--sample-period", type=float, default=5.0, help="seconds between RSS and page samples")
    p.add_argument("--rss-warmup-s", type=float, default=None, help="RSS trend ignores each process's first "
                   "seconds (default: a quarter of the duration, at most 300)")
    p.add_argument("--rss-flat-mb-per-min", type=float, default=2.0, help="an RSS slope above this is growth")
    p.add_argument("--rss-min-span-s", type=float, default=180.0, help="judge RSS only over this much time "
                                                                       "after warm-up")
    p.add_argument("--drain-timeout", type=float, default=90.0, help="seconds for pages to read free at the end")
    p.add_argument("--replace-timeout", type=float, default=180.0, help="seconds to wait for the replacement "
                                                                        "after the load, if not yet there")
    p.add_argument("--context-limit", type=int, default=10**7, help="a max_tokens beyond the served context "
                                                                    "(a bad request)")
    own = p.add_argument_group("the service it starts (without --url)")
    own.add_argument("--replicas", type=int, default=2)
    own.add_argument("--service-config", default=None, help="JSON object of ServiceConfig fields over the "
                                                            "defaults (soak_cluster.DEFAULT_SERVICE)")
    own.add_argument("--num-cpus", type=int, default=8, help="Ray's logical CPUs (replicas take fractions)")
    url = p.add_argument_group("a running service")
    url.add_argument("--url", default=None, help="its base URL (loopback); then nothing is started")
    url.add_argument("--metrics-url", default=None, help="Ray's Prometheus endpoint (pages at the end)")
    url.add_argument("--ray-address", default=None, help="attach to its Ray (kill, RSS): e.g. auto")
    url.add_argument("--app", default="diffkv", help="its Serve application name")
    p.add_argument("--out", type=Path, default=REPO / "benchmarks/results/soak_cpu.json")
    p.add_argument("--png", type=Path, default=REPO / "docs/soak_cpu.png")
    return p


def check_args(args) -> dict:
    """Every bad flag as a ValueError naming it; returns the request mix."""
    for name in ("duration", "capacity_s", "request_timeout", "sample_period", "drain_timeout", "replace_timeout"):
        if not getattr(args, name) > 0:
            raise ValueError(f"--{name.replace('_', '-')} must be > 0, got {getattr(args, name)}")
    if args.rate is not None and not args.rate > 0:
        raise ValueError(f"--rate must be > 0 requests/s, got {args.rate}")
    if not 0 < args.load <= 4:
        raise ValueError(f"--load must be in (0, 4], got {args.load}")
    if not 0 < args.kill_at < 1:
        raise ValueError(f"--kill-at must be a fraction of the duration in (0, 1), got {args.kill_at}")
    if args.max_tokens < 2:
        raise ValueError(f"--max-tokens must be >= 2 (a disconnect needs a stream to cut), got {args.max_tokens}")
    if args.replicas < 1:
        raise ValueError(f"--replicas must be >= 1, got {args.replicas}")
    if args.url is not None and not args.url.startswith(("http://127.0.0.1", "http://localhost", "http://[::1]")):
        raise ValueError(f"--url must be a loopback address (this test only loads this machine), got {args.url}")
    return parse_mix(args.mix)


def service_config(args) -> dict:
    cfg = {**cluster.DEFAULT_SERVICE, "num_replicas": args.replicas, "default_max_tokens": args.max_tokens}
    if args.service_config:
        try:
            extra = json.loads(args.service_config)
        except json.JSONDecodeError as e:
            raise ValueError(f"--service-config is not JSON: {e}") from None
        if not isinstance(extra, dict):
            raise ValueError("--service-config must be a JSON object of ServiceConfig fields")
        cfg.update(extra)
    from diffkv_serve.service.config import ServiceConfig

    ServiceConfig.model_validate(cfg)  # a bad field fails here, naming it
    return cfg


def server_model(base: str) -> str:
    import httpx

    try:
        return httpx.get(base + "/v1/models", timeout=60).json()["data"][0]["id"]
    except (httpx.HTTPError, KeyError, IndexError, ValueError) as e:
        raise ValueError(f"--url: cannot read the served model from {base}/v1/models: {e!r}") from None


def soak(args, mix: dict) -> dict:
    from prompts import load_prompts

    t_setup = time.monotonic()
    if args.url:
        if args.ray_address:
            cluster.attach(args.ray_address)
        target = cluster.Target(args.url.rstrip("/"), args.metrics_url, args.app, bool(args.ray_address))
        config = None
    else:
        config = service_config(args)
        target = cluster.start_local(config, num_cpus=args.num_cpus)
    model = server_model(target.base_url)
    prompts = load_prompts(args.prompts, 200, args.seed)
    n_replicas = args.replicas if not args.url else len(
        [r for r in cluster.replicas(args.app) if r.deployment == ENGINE]) if target.ray_attached else None
    setup_s = time.monotonic() - t_setup
    capacity = None
    if args.rate is None:
        concurrency = 4 * (n_replicas or 1)
        capacity = asyncio.run(measure_capacity(target.base_url, model, prompts, args.max_tokens, concurrency,
                                                args.capacity_s, args.request_timeout))
        if capacity <= 0:
            raise ValueError(f"no request completed in {args.capacity_s:g} s of capacity measurement; pass --rate")
        rate = args.load * capacity / max(1e-9, 1.0 - mix[BAD])
    else:
        rate = args.rate
    print(f"[soak] {model}: setup {setup_s:.0f}s, capacity {capacity if capacity is None else round(capacity, 2)} "
          f"req/s, offered {rate:.2f} req/s for {args.duration:g}s", file=sys.stderr, flush=True)

    t0 = time.monotonic()
    kill_at = None if (args.no_kill or not target.ray_attached) else args.kill_at * args.duration
    monitor = Monitor(target, t0, args.sample_period, kill_at, n_replicas or 1)
    monitor.start()
    tracker = Tracker(t0)
    asyncio.run(run_load(args, target.base_url, model, prompts, rate, mix, tracker))
    load_end = time.monotonic() - t0
    if monitor.kill is not None and monitor.kill["replaced_by"] is None:
        cluster.wait_until(lambda: monitor.kill["replaced_by"], args.replace_timeout)
    pages_end = pages_at_end(target, monitor, args.drain_timeout)
    monitor.sample()
    monitor.stop.set()
    monitor.join()

    warmup = args.rss_warmup_s if args.rss_warmup_s is not None else min(300.0, args.duration / 4)
    summary = soak_report.summarize(tracker.records, args.duration, rate)
    rss = soak_report.rss_summary(monitor.rss, warmup, args.rss_flat_mb_per_min, args.rss_min_span_s)
    report = {
        "benchmark": "soak", "date": datetime.date.today().isoformat(), "model": model,
        "device": f"cpu ({os.cpu_count()} cores, {platform.machine()})",
        "command": "python3 loadtest/soak.py " + " ".join(sys.argv[1:]),
        "config": {"duration_s": args.duration, "rate": rate, "capacity_req_per_s": capacity, "load": args.load,
                   "mix": mix, "max_tokens": args.max_tokens, "request_timeout_s": args.request_timeout,
                   "kill_at_s": kill_at, "sample_period_s": args.sample_period, "replicas": n_replicas,
                   "service": config, "url": args.url, "seed": args.seed},
        "setup_s": setup_s, "load_end_s": load_end,
        "invariants": soak_report.invariants(summary, monitor.kill if kill_at is not None else None, pages_end, rss),
        "summary": summary, "kill": monitor.kill, "pages_at_end": pages_end, "rss": rss,
        "monitor_errors": monitor.errors[:20],
        "timeline": {"pages": monitor.pages, "in_flight": monitor.in_flight, "rss": monitor.rss},
        "request_columns": list(soak_report.REQUEST_COLUMNS),
        "requests": soak_report.request_rows(tracker.records),
    }
    return report


def _print(report: dict) -> None:
    s, inv = report["summary"], report["invariants"]
    print(f"sent {s['sent']} at {s['offered_rate']:.2f} req/s over {s['duration_s']:g}s; status {s['status_counts']}")
    print(f"outcomes {s['outcomes']}")
    kill = report["kill"]
    if kill:
        took = kill["time_to_replace_s"]
        print(f"killed {kill['replica']} at {kill['t']:.0f}s; replaced by {kill['replaced_by']} after "
              f"{'-' if took is None else f'{took:.1f}'}s")
    end = report["pages_at_end"]
    if end:
        print(f"at the end: pages {end['replicas']}, in flight {end['in_flight']}, retried {end.get('retried')}")
    rss = report["rss"]
    print(f"RSS: max |slope| {rss['max_abs_slope_mb_per_min']} MB/min, max-min {rss['max_minus_min_mb']} MB "
          f"after {rss['warmup_s']:g}s warm-up")
    print("invariants: " + ", ".join(f"{k}={v}" for k, v in inv.items()))
    for lost in s["lost"][:10]:
        print(f"  lost #{lost['id']} ({lost['kind']}): {lost['detail']}")


def main(argv: Optional[list[str]] = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        mix = check_args(args)
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    os.environ["PYTHONPATH"] = os.pathsep.join([str(REPO)] + [p for p in [os.environ.get("PYTHONPATH")] if p])
    os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
    started = args.url is None
    try:
        report = soak(args, mix)
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    finally:
        if started:
            cluster.stop_local()
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(soak_report.to_json(report))
    args.png.parent.mkdir(parents=True, exist_ok=True)
    soak_report.plot(report, args.png)
    _print(report)
    print(f"wrote {args.out} and {args.png}")
    return 0 if report["invariants"]["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
