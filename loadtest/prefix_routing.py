"""Prefix-cache hit rate and time to first token behind the KV-headroom router and the prefix-aware router.

Starts a local Ray cluster (loopback), and for each kv_mode x router deploys `--replicas` engine replicas of
the embedded SmolLM2 with prefix caching on, then sends chat requests that open with one of
`--system-prompts` long system prompts followed by a distinct user turn, `--concurrency` at a time. Reports
per configuration the engine's prefix-cache hit rate (hit prompt tokens / looked-up prompt tokens, summed over
replicas), TTFT (streamed, client side) and how the requests spread over the replicas.

    python loadtest/prefix_routing.py                      # fp16 and diffkv, both routers, ~3 minutes on CPU
    python loadtest/prefix_routing.py --kv-modes fp16 --requests 16

Writes benchmarks/results/prefix_routing_cpu.json (or --out).
"""
from __future__ import annotations

import argparse
import asyncio
import datetime
import json
import os
import platform
import random
import statistics
import sys
import time
from pathlib import Path
from typing import Optional

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(Path(__file__).resolve().parent))
os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")

from stream import StreamResult, chat_request  # noqa: E402

WORDS = ("policy customer account invoice refund shipping warranty order support ticket escalate priority "
         "product return damaged replacement billing address payment card subscription renewal discount "
         "region language tone brief polite verify identity record note summary agent manager hours").split()


def system_prompts(n: int, chars: int, rng: random.Random) -> list[str]:
    """n distinct system prompts of about `chars` characters (numbered rules of random words)."""
    out = []
    for k in range(n):
        lines, size = [f"You are support assistant #{k} of a store. Follow these rules exactly."], 0
        while size < chars:
            line = f"Rule {len(lines)}: " + " ".join(rng.choice(WORDS) for _ in range(rng.randrange(8, 16))) + "."
            lines.append(line)
            size += len(line) + 1
        out.append("\n".join(lines))
    return out


def workload(n: int, prompts: list[str], rng: random.Random) -> list[list[dict]]:
    """n chats: a random system prompt, then a distinct user turn."""
    return [[{"role": "system", "content": rng.choice(prompts)},
             {"role": "user", "content": f"Ticket {i}: my {rng.choice(WORDS)} {rng.choice(WORDS)} is wrong. Help?"}]
            for i in range(n)]


async def _one(client, url: str, body: dict) -> StreamResult:
    res = StreamResult(t_start=time.monotonic())
    try:
        async with client.stream("POST", url, json=body) as r:
            res.status = r.status_code
            async for line in r.aiter_lines():
                res.feed(line, time.monotonic())
    except Exception as e:  # a broken connection counts as a failed request
        res.fail(f"{type(e).__name__}: {e}", time.monotonic())
    return res


async def send_all(base: str, model: str, chats: list, concurrency: int, max_tokens: int) -> list[StreamResult]:
    import httpx

    sem = asyncio.Semaphore(concurrency)
    async with httpx.AsyncClient(timeout=httpx.Timeout(300, connect=10)) as client:
        async def go(messages):
            async with sem:
                return await _one(client, base + "/v1/chat/completions", chat_request(model, messages, max_tokens))
        return await asyncio.gather(*(go(m) for m in chats))


def replica_stats(handle, replicas: int, timeout: float = 60) -> dict[str, dict]:
    """Each replica's engine stats (calls through the handle until every replica answered)."""
    seen: dict[str, dict] = {}
    deadline = time.monotonic() + timeout
    while len(seen) < replicas:
        if time.monotonic() > deadline:
            raise TimeoutError(f"only {len(seen)} of {replicas} replicas answered stats()")
        # several at once: Serve counts each sent call against its replica, so they spread over the replicas
        for st in [r.result() for r in [handle.stats.remote() for _ in range(4 * replicas)]]:
            seen[st["replica"]] = st
    return seen


def _pct(values: list[float], q: float) -> float:
    values = sorted(values)
    return values[min(len(values) - 1, int(round(q / 100 * (len(values) - 1))))]


def run_config(port: int, kv_mode: str, router: str, args, chats: list, warm: list) -> dict:
    from ray import serve

    from diffkv_serve.service.app import ENGINE_DEPLOYMENT, build_app

    cfg = {"device": "cpu", "num_replicas": args.replicas, "kv_mode": kv_mode, "replica_cpus": args.replica_cpus,
           "cache": {"enable_prefix_caching": True, **({"num_pages": args.num_pages} if args.num_pages else {})},
           "admission": {"enabled": False}, "router": {"policy": router, "stats_period_s": 0.5}}
    name = f"pr_{kv_mode}_{router}"
    serve.run(build_app(cfg), name=name, route_prefix="/" + name)
    base = f"http://127.0.0.1:{port}/{name}"
    try:
        import httpx

        model = httpx.get(base + "/v1/models", timeout=60).json()["data"][0]["id"]
        handle = serve.get_deployment_handle(ENGINE_DEPLOYMENT, app_name=name)
        # one-time costs (first forward passes) on every replica, with prompts the workload never uses
        asyncio.run(send_all(base, model, warm, args.replicas, 2))
        before = replica_stats(handle, args.replicas)
        t0 = time.monotonic()
        results = asyncio.run(send_all(base, model, chats, args.concurrency, args.max_tokens))
        wall = time.monotonic() - t0
        time.sleep(1.0)  # the last prefills' counters
        after = replica_stats(handle, args.replicas)
    finally:
        serve.delete(name)
    failed = [r.error for r in results if not r.ok]
    ttft = [r.ttft for r in results if r.ok and r.ttft is not None]
    delta = {rid: {k: after[rid][k] - before[rid][k] for k in ("prefix_cache_queries", "prefix_cache_hits",
                                                               "prefill_tokens_computed", "num_generated_tokens")}
             for rid in after}
    queries = sum(d["prefix_cache_queries"] for d in delta.values())
    hits = sum(d["prefix_cache_hits"] for d in delta.values())
    return {"kv_mode": kv_mode, "router": router, "requests": len(results), "failed": len(failed),
            "errors": failed[:3], "wall_s": round(wall, 2),
            "prefix_hit_rate": round(hits / max(1, queries), 4), "prompt_tokens": queries, "hit_tokens": hits,
            "prefill_tokens_computed": sum(d["prefill_tokens_computed"] for d in delta.values()),
            "ttft_ms": {"mean": round(1000 * statistics.fmean(ttft), 1), "p50": round(1000 * _pct(ttft, 50), 1),
                        "p90": round(1000 * _pct(ttft, 90), 1)} if ttft else None,
            "prompt_tokens_per_replica": sorted(d["prefix_cache_queries"] for d in delta.values())}


def print_table(rows: list[dict]) -> None:
    head = f"{'kv_mode':8} {'router':12} {'hit rate':>8} {'computed':>9} {'TTFT mean':>10} {'p50':>8} {'p90':>8} " \
           f"{'wall s':>7}  prompt tokens per replica"
    print(head)
    print("-" * len(head))
    for r in rows:
        t = r["ttft_ms"] or {"mean": float("nan"), "p50": float("nan"), "p90": float("nan")}
        print(f"{r['kv_mode']:8} {r['router']:12} {r['prefix_hit_rate']:8.1%} {r['prefill_tokens_computed']:9d} "
              f"{t['mean']:8.0f}ms {t['p50']:6.0f}ms {t['p90']:6.0f}ms {r['wall_s']:7.1f}  {r['prompt_tokens_per_replica']}")


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--kv-modes", default="fp16,diffkv", help="comma-separated kv modes")
    p.add_argument("--routers", default="kv_headroom,prefix", help="comma-separated router.policy values")
    p.add_argument("--replicas", type=int, default=2)
    p.add_argument("--replica-cpus", type=float, default=0.5)
    p.add_argument("--system-prompts", type=int, default=4)
    p.add_argument("--system-chars", type=int, default=1500, help="length of each system prompt (characters)")
    p.add_argument("--requests", type=int, default=32)
    p.add_argument("--concurrency", type=int, default=2)
    p.add_argument("--max-tokens", type=int, default=4)
    p.add_argument("--num-pages", type=int, default=None, help="KV pool per replica (pages); default: the engine's")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", default=str(ROOT / "benchmarks" / "results" / "prefix_routing_cpu.json"))
    return p


def main(argv: Optional[list[str]] = None) -> int:
    args = build_parser().parse_args(argv)
    for name in ("replicas", "system_prompts", "requests", "concurrency", "max_tokens"):
        if getattr(args, name) < 1:
            raise ValueError(f"--{name.replace('_', '-')} must be >= 1 (got {getattr(args, name)})")
    import ray
    from ray import serve

    sys.path.insert(0, str(ROOT / "tests" / "service"))
    from _cluster import free_port

    rng = random.Random(args.seed)
    prompts = system_prompts(args.system_prompts, args.system_chars, rng)
    chats = workload(args.requests, prompts, rng)
    warm = [[{"role": "user", "content": f"Warm-up {i}: say hello."}] for i in range(2 * args.replicas)]
    port = free_port()
    ray.init(address="local", num_cpus=8, include_dashboard=False, logging_level="warning")
    serve.start(http_options={"host": "127.0.0.1", "port": port})
    rows = []
    load_before = os.getloadavg()[0]  # the machine's load, since other jobs change TTFT on a shared box
    try:
        for kv_mode in args.kv_modes.split(","):
            for router in args.routers.split(","):
                rows.append(run_config(port, kv_mode, router, args, chats, warm))
                print_table(rows[-1:])
    finally:
        serve.shutdown()
        ray.shutdown()
    print()
    print_table(rows)
    result = {"what": "prefix-cache hit rate and TTFT: KV-headroom router vs prefix-aware router",
              "device": "cpu", "machine": f"{platform.processor() or platform.machine()}, {os.cpu_count()} cores",
              "date": datetime.date.today().isoformat(),
              "load_average_1m": [round(load_before, 2), round(os.getloadavg()[0], 2)], "model": "SmolLM2-135M-Instruct (embedded)",
              "command": "python loadtest/prefix_routing.py " + " ".join(argv if argv is not None else sys.argv[1:]),
              "settings": {k: v for k, v in vars(args).items() if k != "out"}, "runs": rows}
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(result, indent=2))
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
