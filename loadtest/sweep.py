"""Serving benchmark in the style of vLLM's: at each request rate, a fixed number of streaming chat requests
arrive as a Poisson process (or gamma, for bursty traffic), and the run reports throughput, goodput under a
TTFT/TPOT SLO, TTFT / TPOT / inter-token latency / end-to-end percentiles and the rejection (429) rate.

    python3 loadtest/sweep.py run --base-url http://127.0.0.1:8000 --rates 0.5,1,2,4 --num-requests 100 \
        --label diffkv --out results/diffkv.json            # + results/diffkv.png
    python3 loadtest/sweep.py plot results/fp16.json results/diffkv.json -o results/fp16-vs-diffkv.png

Arrival times are drawn up front (gaps ~ Gamma(shape=burstiness, scale=1/(rate*burstiness)); burstiness 1 is
Poisson) and every request is sent at its time whatever the responses do (open loop). `inf` sends all at once.
"""
from __future__ import annotations

import argparse
import asyncio
import json
import math
import sys
import time
from pathlib import Path
from typing import Optional

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
from prompts import load_prompts  # noqa: E402
from stream import StreamResult, chat_request  # noqa: E402

PERCENTILES = (50, 90, 99)
LATENCIES = ("ttft", "tpot", "itl", "e2el")  # the JSON's latency blocks, in milliseconds


def arrival_times(n: int, rate: float, burstiness: float, rng: np.random.Generator) -> np.ndarray:
    """Send times (s from the start) of n requests: cumulative gamma gaps, mean 1/rate."""
    if n <= 0:
        return np.zeros(0)
    if math.isinf(rate):
        return np.zeros(n)
    if rate <= 0 or burstiness <= 0:
        raise ValueError(f"rate and burstiness must be > 0 (got {rate}, {burstiness})")
    gaps = rng.gamma(shape=burstiness, scale=1.0 / (rate * burstiness), size=n)
    gaps[0] = 0.0  # the first request starts the clock
    return np.cumsum(gaps)


async def one_request(client, url: str, body: dict, timeout: float) -> StreamResult:
    import httpx

    res = StreamResult(t_start=time.monotonic())
    try:
        async with client.stream("POST", url, json=body, timeout=httpx.Timeout(timeout, connect=10)) as r:
            res.status = r.status_code
            if r.status_code == 200:
                async for line in r.aiter_lines():
                    res.feed(line, time.monotonic())
                if not res.done and res.error is None:
                    res.fail("the stream ended without [DONE]", time.monotonic())
            else:
                text = (await r.aread()).decode(errors="replace")
                res.fail(f"HTTP {r.status_code}: {text[:300]}", time.monotonic())
    except httpx.HTTPError as e:
        res.fail(f"{type(e).__name__}: {e}", time.monotonic())
    return res


async def run_rate(base_url: str, model: str, prompts: list, rate: float, n: int, burstiness: float, seed: int,
                   max_tokens: int, temperature: float, timeout: float, max_concurrency: Optional[int],
                   desc: str) -> tuple[list[StreamResult], float]:
    """n requests at `rate`; returns their results and the wall time from the first send to the last answer."""
    import httpx
    from tqdm.auto import tqdm

    url = base_url.rstrip("/") + "/v1/chat/completions"
    times = arrival_times(n, rate, burstiness, np.random.default_rng(seed))
    limit = asyncio.Semaphore(max_concurrency) if max_concurrency else None
    limits = httpx.Limits(max_connections=max_concurrency or n, max_keepalive_connections=max_concurrency or n)
    results: list[StreamResult] = []
    async with httpx.AsyncClient(limits=limits) as client:
        bar = tqdm(total=n, desc=desc, unit="req", leave=True)

        async def send(i: int) -> None:
            body = chat_request(model, prompts[i % len(prompts)], max_tokens, temperature)
            if limit is None:
                res = await one_request(client, url, body, timeout)
            else:
                async with limit:
                    res = await one_request(client, url, body, timeout)
            results.append(res)
            bar.update(1)
            bar.set_postfix(ok=sum(r.ok for r in results), rejected=sum(r.rejected for r in results), refresh=False)

        t0 = time.monotonic()
        tasks = []
        for i, t in enumerate(times):
            delay = t0 + float(t) - time.monotonic()
            if delay > 0:
                await asyncio.sleep(delay)
            tasks.append(asyncio.create_task(send(i)))
        await asyncio.gather(*tasks)
        bar.close()
    end = max((r.t_end for r in results if r.t_end is not None), default=time.monotonic())
    return results, end - t0


def _dist_ms(values: list[float]) -> dict:
    if not values:
        return {"mean": None, "std": None, **{f"p{p}": None for p in PERCENTILES}, "count": 0}
    a = np.asarray(values) * 1000.0
    return {"mean": float(a.mean()), "std": float(a.std()), **{f"p{p}": float(np.percentile(a, p))
                                                             for p in PERCENTILES}, "count": int(a.size)}


def summarize(results: list[StreamResult], duration: float, rate: float, burstiness: float,
              slo_ttft_ms: float, slo_tpot_ms: float) -> dict:
    ok = [r for r in results if r.ok]
    rejected = [r for r in results if r.rejected]
    failed = [r for r in results if not r.ok and not r.rejected]
    good = [r for r in ok if r.ttft is not None and r.ttft * 1000 <= slo_ttft_ms
            and (r.tpot is None or r.tpot * 1000 <= slo_tpot_ms)]
    out_tokens = sum(r.output_tokens for r in ok)
    in_tokens = sum(r.prompt_tokens or 0 for r in ok)
    duration = max(duration, 1e-9)
    return {
        "rate": rate if not math.isinf(rate) else "inf",
        "burstiness": burstiness,
        "num_requests": len(results),
        "completed": len(ok),
        "rejected": len(rejected),
        "failed": len(failed),
        "rejection_rate": len(rejected) / max(len(results), 1),
        "duration_s": duration,
        "request_throughput": len(ok) / duration,
        "output_throughput": out_tokens / duration,
        "total_token_throughput": (in_tokens + out_tokens) / duration,
        "goodput": len(good) / duration,
        "slo": {"ttft_ms": slo_ttft_ms, "tpot_ms": slo_tpot_ms},
        "prompt_tokens": in_tokens,
        "output_tokens": out_tokens,
        "ttft": _dist_ms([r.ttft for r in ok if r.ttft is not None]),
        "tpot": _dist_ms([r.tpot for r in ok if r.tpot is not None]),
        "itl": _dist_ms([x for r in ok for x in r.itls]),
        "e2el": _dist_ms([r.e2e for r in ok if r.e2e is not None]),
        "errors": sorted({r.error for r in failed if r.error})[:10],
    }


def server_model(base_url: str) -> str:
    import httpx

    url = base_url.rstrip("/") + "/v1/models"
    try:
        r = httpx.get(url, timeout=30)
        r.raise_for_status()
        return r.json()["data"][0]["id"]
    except (httpx.HTTPError, KeyError, IndexError, ValueError) as e:
        raise ValueError(f"cannot read the served model from {url}: {e!r} (is the server up? or pass --model)") \
            from None


def parse_rates(text: str) -> list[float]:
    rates = []
    for part in text.split(","):
        part = part.strip()
        if not part:
            continue
        r = float("inf") if part.lower() in ("inf", "infinity") else float(part)
        if not r > 0:
            raise ValueError(f"--rates: {part!r} is not a positive rate (requests/s) or 'inf'")
        rates.append(r)
    if not rates:
        raise ValueError("--rates: give at least one rate, e.g. 0.5,1,2")
    return rates


def run(args) -> dict:
    rates = parse_rates(args.rates)
    model = args.model or server_model(args.base_url)
    prompts = load_prompts(args.prompts, args.num_requests, args.seed)
    report = {"label": args.label, "base_url": args.base_url, "model": model,
              "config": {"rates": [r if not math.isinf(r) else "inf" for r in rates],
                         "num_requests": args.num_requests, "burstiness": args.burstiness,
                         "max_tokens": args.max_tokens, "temperature": args.temperature, "prompts": args.prompts,
                         "seed": args.seed, "max_concurrency": args.max_concurrency},
              "results": []}
    for i, rate in enumerate(rates):
        results, duration = asyncio.run(run_rate(
            args.base_url, model, prompts, rate, args.num_requests, args.burstiness, args.seed + i, args.max_tokens,
            args.temperature, args.timeout, args.max_concurrency, desc=f"{args.label} @ {rate:g} req/s"))
        report["results"].append(summarize(results, duration, rate, args.burstiness, args.slo_ttft_ms,
                                           args.slo_tpot_ms))
    return report


# ---- plot -------------------------------------------------------------------------------------------------------
def plot(reports: list[dict], path: Path) -> None:
    """Latency and throughput vs offered rate, one line (color) per run: p50 solid, p99 dashed."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(2, 3, figsize=(15, 8.5))
    latency = [("ttft", "TTFT (ms)"), ("tpot", "TPOT (ms)"), ("e2el", "End-to-end latency (ms)")]
    for idx, rep in enumerate(reports):
        color = f"C{idx}"
        res = rep["results"]
        finite = [r for r in res if r["rate"] != "inf"]
        xs = [r["rate"] for r in finite]
        for ax, (key, title) in zip(axes[0], latency):
            for p, style in ((50, "-"), (99, "--")):
                ys = [r[key][f"p{p}"] for r in finite]
                ax.plot(xs, [np.nan if y is None else y for y in ys], style, marker="o", color=color,
                        label=f"{rep['label']} p{p}")
            ax.set_title(title)
        ax = axes[1][0]
        ax.plot(xs, [r["request_throughput"] for r in finite], "-", marker="o", color=color,
                label=f"{rep['label']} throughput")
        ax.plot(xs, [r["goodput"] for r in finite], "--", marker="s", color=color, label=f"{rep['label']} goodput")
        ax.set_title("Completed requests/s (goodput: within SLO)")
        axes[1][1].plot(xs, [r["output_throughput"] for r in finite], "-", marker="o", color=color,
                        label=rep["label"])
        axes[1][1].set_title("Output tokens/s")
        axes[1][2].plot(xs, [100 * r["rejection_rate"] for r in finite], "-", marker="o", color=color,
                        label=rep["label"])
        axes[1][2].set_title("Rejected (429), % of requests")
    for ax in axes.flat:
        ax.set_ylim(bottom=0)
        ax.set_xlabel("offered rate (requests/s)")
        ax.grid(alpha=0.3)
        if ax.lines:
            ax.legend(fontsize=8)
    models = sorted({rep.get("model", "?") for rep in reports})
    fig.suptitle(f"DiffKV Serve sweep: {', '.join(models)}")
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)


def _print_table(report: dict) -> None:
    head = f"{'rate':>6} {'done':>5} {'429':>4} {'fail':>4} {'req/s':>6} {'good/s':>6} {'tok/s':>7} " \
           f"{'TTFT p50/p99 ms':>17} {'TPOT p50/p99 ms':>17} {'ITL p99':>8} {'E2E p99':>8}"
    print(f"[{report['label']}] {report['model']}\n{head}")
    f = lambda d, k: "-" if d[k] is None else f"{d[k]:.0f}"  # noqa: E731
    for r in report["results"]:
        print(f"{r['rate']:>6} {r['completed']:>5} {r['rejected']:>4} {r['failed']:>4} "
              f"{r['request_throughput']:>6.2f} {r['goodput']:>6.2f} {r['output_throughput']:>7.1f} "
              f"{f(r['ttft'], 'p50') + '/' + f(r['ttft'], 'p99'):>17} "
              f"{f(r['tpot'], 'p50') + '/' + f(r['tpot'], 'p99'):>17} {f(r['itl'], 'p99'):>8} "
              f"{f(r['e2el'], 'p99'):>8}")


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="sweep.py", description=__doc__.split("\n\n")[0])
    sub = p.add_subparsers(dest="command", required=True)
    r = sub.add_parser("run", help="benchmark a server at a list of request rates")
    r.add_argument("--base-url", default="http://127.0.0.1:8000", help="the server (OpenAI API under /v1)")
    r.add_argument("--model", default="", help="default: the server's model (GET /v1/models)")
    r.add_argument("--rates", default="0.5,1,2", help="comma-separated requests/s; 'inf' sends all at once")
    r.add_argument("--num-requests", type=int, default=50, help="requests per rate")
    r.add_argument("--burstiness", type=float, default=1.0, help="gamma shape of the gaps; 1 = Poisson, <1 "
                                                                 "burstier")
    r.add_argument("--max-tokens", type=int, default=128)
    r.add_argument("--temperature", type=float, default=0.0)
    r.add_argument("--prompts", default="gsm_symbolic", help="gsm_symbolic (reasoning-gym) or a JSONL file")
    r.add_argument("--seed", type=int, default=0)
    r.add_argument("--slo-ttft-ms", type=float, default=2000.0, help="goodput: TTFT at most this")
    r.add_argument("--slo-tpot-ms", type=float, default=200.0, help="goodput: TPOT at most this")
    r.add_argument("--max-concurrency", type=int, default=None, help="client-side cap on open requests")
    r.add_argument("--timeout", type=float, default=600.0, help="seconds without a byte before a request fails")
    r.add_argument("--label", default="run", help="this run's name in the JSON and on the plot (fp16, diffkv)")
    r.add_argument("--out", type=Path, default=Path("sweep.json"), help="JSON path; the PNG goes beside it")
    r.add_argument("--compare", type=Path, nargs="*", default=[], help="earlier run JSONs to draw on the plot")
    pl = sub.add_parser("plot", help="draw one or more run JSONs together")
    pl.add_argument("inputs", type=Path, nargs="+")
    pl.add_argument("-o", "--out", type=Path, required=True, help="PNG path")
    return p


def main(argv: Optional[list[str]] = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        if args.command == "plot":
            plot([json.loads(p.read_text()) for p in args.inputs], args.out)
            print(f"wrote {args.out}")
            return 0
        if args.num_requests < 1:
            raise ValueError("--num-requests must be >= 1")
        report = run(args)
    except (ValueError, FileNotFoundError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(report, indent=2) + "\n")
    png = args.out.with_suffix(".png")
    plot([report] + [json.loads(p.read_text()) for p in args.compare], png)
    _print_table(report)
    print(f"wrote {args.out} and {png}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
