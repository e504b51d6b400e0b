"""Serving benchmark in the style of vLLM's: at each request rate, a fixed number of streaming chat requests
arrive as a Poisson process (or gamma, for bursty traffic), and the run reports throughput, goodput under a
TTFT/TPOT SLO, TTFT / TPOT / inter-token latency / end-to-end percentiles, the per-token latency (end-to-end
latency / output tokens, queueing included: the DiffKV paper's Figure 16 metric, after vLLM) and the rejection
(429) rate.

    python3 loadtest/sweep.py run --base-url http://127.0.0.1:8000 --rates 0.5,1,2,4 --num-requests 100 \
        --label diffkv --out results/diffkv.json            # + results/diffkv.png
    python3 loadtest/sweep.py plot results/fp16.json results/diffkv.json -o results/fp16-vs-diffkv.png
    python3 loadtest/sweep.py plot --kind per-token results/fp16.json results/diffkv.json -o results/fig16.png
    python3 loadtest/sweep.py slo results/fp16.json results/diffkv.json --ttft-ms 2000 --percentile 90 \
        --out results/serve_sweep.json                      # the highest rate each run sustains under the SLO

Arrival times are drawn up front (gaps ~ Gamma(shape=burstiness, scale=1/(rate*burstiness)); burstiness 1 is
Poisson) and every request is sent at its time whatever the responses do (open loop). `inf` sends all at once.
"""
from __future__ import annotations

import argparse
import asyncio
import datetime
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
LATENCIES = ("ttft", "tpot", "itl", "e2el", "per_token_latency")  # the JSON's latency blocks, in milliseconds


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
                   desc: str, drain_timeout: Optional[float] = None) -> tuple[list[StreamResult], float]:
    """n requests at `rate`; returns their results and the wall time from the first send to the last answer.
    `drain_timeout`: seconds to wait after the last send; requests still open then are cancelled (the server
    aborts them) and count as failed, so an overloaded rate stays bounded in time."""
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
        _, pending = await asyncio.wait(tasks, timeout=drain_timeout)
        for task in pending:
            task.cancel()
        if pending:
            await asyncio.wait(pending)
            now = time.monotonic()
            for _ in pending:  # their send() never appended a result: record them as cut off
                res = StreamResult(t_start=now)
                res.fail(f"still open {drain_timeout:g} s after the last arrival (cancelled)", now)
                results.append(res)
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
        "per_token_latency": _dist_ms([r.e2e / r.output_tokens for r in ok if r.e2e is not None and r.output_tokens]),
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


def warm_up(args, model: str, prompts: list) -> float:
    """`args.warmup` requests one after another, not recorded: the server compiles its kernels and captures its
    graphs here rather than inside the first rate. Returns the seconds it took."""
    t0 = time.monotonic()
    for i in range(args.warmup):
        results, _ = asyncio.run(run_rate(args.base_url, model, prompts[i % len(prompts):], float("inf"), 1, 1.0, 0,
                                          args.max_tokens, args.temperature, args.timeout, None,
                                          desc=f"{args.label} warm-up {i + 1}/{args.warmup}"))
        if not results[0].ok:
            raise ValueError(f"warm-up request failed: {results[0].error}")
    return time.monotonic() - t0


def run(args, on_rate=None) -> dict:
    """Every rate in turn; `on_rate(report)` after each (the CLI writes the JSON then, so a run cut short keeps
    the rates it finished). With --time-budget-s, a rate whose arrivals alone (n / rate) would end past the
    budget is skipped, and so are the rates after it."""
    rates = parse_rates(args.rates)
    model = args.model or server_model(args.base_url)
    prompts = load_prompts(args.prompts, args.num_requests, args.seed)
    t_start = time.monotonic()
    report = {"label": args.label, "base_url": args.base_url, "model": model,
              "config": {"rates": [r if not math.isinf(r) else "inf" for r in rates],
                         "num_requests": args.num_requests, "burstiness": args.burstiness,
                         "max_tokens": args.max_tokens, "temperature": args.temperature, "prompts": args.prompts,
                         "seed": args.seed, "max_concurrency": args.max_concurrency, "warmup": args.warmup,
                         "drain_timeout_s": args.drain_timeout_s, "time_budget_s": args.time_budget_s},
              "results": [], "skipped_rates": []}
    report["warmup_s"] = warm_up(args, model, prompts)
    for i, rate in enumerate(rates):
        elapsed = time.monotonic() - t_start
        arrivals = 0.0 if math.isinf(rate) else args.num_requests / rate
        if args.time_budget_s is not None and elapsed + arrivals > args.time_budget_s:
            report["skipped_rates"] = [r if not math.isinf(r) else "inf" for r in rates[i:]]
            print(f"[{args.label}] {elapsed:.0f} s spent of the {args.time_budget_s:g} s budget: skipping rates "
                  f"{report['skipped_rates']}", file=sys.stderr)
            break
        results, duration = asyncio.run(run_rate(
            args.base_url, model, prompts, rate, args.num_requests, args.burstiness, args.seed + i, args.max_tokens,
            args.temperature, args.timeout, args.max_concurrency, desc=f"{args.label} @ {rate:g} req/s",
            drain_timeout=args.drain_timeout_s))
        report["results"].append(summarize(results, duration, rate, args.burstiness, args.slo_ttft_ms,
                                           args.slo_tpot_ms))
        if on_rate is not None:
            on_rate(report)
    return report


# ---- SLO ----------------------------------------------------------------------------------------------------
def meets_slo(result: dict, ttft_ms: float, percentile: int = 90) -> bool:
    """One rate's result meets the TTFT SLO: every request completed (none rejected, failed or cut off) and the
    percentile of their TTFTs is within `ttft_ms`."""
    value = result["ttft"].get(f"p{percentile}")
    return (result["completed"] == result["num_requests"] and result["completed"] > 0 and value is not None
            and value <= ttft_ms)


def sustained_rate(report: dict, ttft_ms: float, percentile: int = 90) -> Optional[float]:
    """The highest measured finite rate R such that R and every lower measured rate meet the SLO (a rate that
    passes above one that failed is noise, not capacity); None when the lowest rate already fails."""
    best = None
    for r in sorted((r for r in report["results"] if r["rate"] != "inf"), key=lambda r: r["rate"]):
        if not meets_slo(r, ttft_ms, percentile):
            break
        best = r["rate"]
    return best


def slo_summary(reports: list[dict], ttft_ms: float, percentile: int = 90, device: Optional[str] = None,
                setup: Optional[dict] = None) -> dict:
    """One record of several runs (fp16, diffkv) and the rate each sustains under the TTFT SLO; `setup`: how the
    runs were taken (the command, the service's settings, timings), kept as given."""
    return {"benchmark": "serve_sweep", "device": device, "date": datetime.date.today().isoformat(),
            "models": sorted({r.get("model", "?") for r in reports}), "setup": setup or {},
            "slo": {"metric": "ttft", "percentile": percentile, "ttft_ms": ttft_ms,
                    "rule": "every request completed and the TTFT percentile within the target, at this rate and "
                            "every lower measured rate"},
            "sustained_rate": {r["label"]: sustained_rate(r, ttft_ms, percentile) for r in reports},
            "runs": reports}


def _print_slo(summary: dict) -> None:
    slo = summary["slo"]
    print(f"TTFT SLO: p{slo['percentile']} <= {slo['ttft_ms']:g} ms, every request completed")
    for run in summary["runs"]:
        cells = [f"{r['rate']}:{'ok' if meets_slo(r, slo['ttft_ms'], slo['percentile']) else 'MISS'}"
                 for r in run["results"]]
        best = summary["sustained_rate"][run["label"]]
        print(f"  {run['label']:>8}: highest sustained rate {'none' if best is None else f'{best:g} req/s'} "
              f"({' '.join(cells)})")


# ---- plot -------------------------------------------------------------------------------------------------------
def plot_per_token(reports: list[dict], path: Path, ttft_ms: Optional[float] = None, percentile: int = 90) -> None:
    """The paper's Figure 16: mean per-token latency (end-to-end / output tokens, queueing included) vs the
    Poisson rate, one curve per run; beside it the TTFT percentile with the SLO line and each run's highest
    sustained rate marked."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (left, right) = plt.subplots(1, 2, figsize=(11, 4.2))
    for idx, rep in enumerate(reports):
        res = sorted((r for r in rep["results"] if r["rate"] != "inf"), key=lambda r: r["rate"])
        xs = [r["rate"] for r in res]
        per_token = [np.nan if r.get("per_token_latency", {}).get("mean") is None else r["per_token_latency"]["mean"]
                     / 1000 for r in res]
        ttft = [np.nan if r["ttft"].get(f"p{percentile}") is None else r["ttft"][f"p{percentile}"] / 1000 for r in res]
        left.plot(xs, per_token, marker="o", color=f"C{idx}", label=rep["label"])
        right.plot(xs, ttft, marker="o", color=f"C{idx}", label=rep["label"])
        best = sustained_rate(rep, ttft_ms, percentile) if ttft_ms is not None else None
        if best is not None:
            right.axvline(best, color=f"C{idx}", ls=":", lw=1, label=f"{rep['label']} sustains {best:g} req/s")
    left.set_title("Mean per-token latency (queueing included)")
    left.set_ylabel("seconds / output token")
    right.set_title(f"TTFT p{percentile}")
    right.set_ylabel("seconds")
    if ttft_ms is not None:
        right.axhline(ttft_ms / 1000, color="k", ls="--", lw=0.8, label=f"SLO {ttft_ms / 1000:g} s")
    for ax in (left, right):
        ax.set_xlabel("request rate (requests/s, Poisson)")
        ax.set_ylim(bottom=0)
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    models = sorted({rep.get("model", "?") for rep in reports})
    fig.suptitle(f"DiffKV Serve: {', '.join(models)}", fontsize=10)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)


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
           f"{'TTFT p50/p99 ms':>17} {'TPOT p50/p99 ms':>17} {'ITL p99':>8} {'E2E p99':>8} {'ms/token':>8}"
    print(f"[{report['label']}] {report['model']}\n{head}")
    f = lambda d, k: "-" if d[k] is None else f"{d[k]:.0f}"  # noqa: E731
    for r in report["results"]:
        print(f"{r['rate']:>6} {r['completed']:>5} {r['rejected']:>4} {r['failed']:>4} "
              f"{r['request_throughput']:>6.2f} {r['goodput']:>6.2f} {r['output_throughput']:>7.1f} "
              f"{f(r['ttft'], 'p50') + '/' + f(r['ttft'], 'p99'):>17} "
              f"{f(r['tpot'], 'p50') + '/' + f(r['tpot'], 'p99'):>17} {f(r['itl'], 'p99'):>8} "
              f"{f(r['e2el'], 'p99'):>8} {f(r.get('per_token_latency', {'mean': None}), 'mean'):>8}")


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
    r.add_argument("--warmup", type=int, default=0, help="requests sent one by one before the first rate, not "
                                                         "recorded (kernel compilation, graph capture)")
    r.add_argument("--drain-timeout-s", type=float, default=None, help="seconds to wait after a rate's last "
                   "arrival; requests still open then are cancelled and count as failed (default: wait)")
    r.add_argument("--time-budget-s", type=float, default=None, help="skip the remaining rates once a rate's "
                   "arrivals would end past this many seconds from the start")
    r.add_argument("--label", default="run", help="this run's name in the JSON and on the plot (fp16, diffkv)")
    r.add_argument("--out", type=Path, default=Path("sweep.json"), help="JSON path; the PNG goes beside it")
    r.add_argument("--compare", type=Path, nargs="*", default=[], help="earlier run JSONs to draw on the plot")
    pl = sub.add_parser("plot", help="draw one or more run JSONs together")
    pl.add_argument("inputs", type=Path, nargs="+")
    pl.add_argument("-o", "--out", type=Path, required=True, help="PNG path")
    pl.add_argument("--kind", choices=["grid", "per-token"], default="grid",
                    help="grid: every latency and throughput panel; per-token: per-token latency and TTFT vs rate")
    pl.add_argument("--ttft-ms", type=float, default=None, help="per-token: draw this TTFT SLO")
    pl.add_argument("--percentile", type=int, choices=PERCENTILES, default=90)
    s = sub.add_parser("slo", help="the highest rate each run sustains under a TTFT SLO (+ one combined JSON)")
    s.add_argument("inputs", type=Path, nargs="+")
    s.add_argument("--ttft-ms", type=float, default=2000.0, help="TTFT target (ms)")
    s.add_argument("--percentile", type=int, choices=PERCENTILES, default=90, help="TTFT percentile held to it")
    s.add_argument("--device", default=None, help="the machine, recorded in the combined JSON")
    s.add_argument("--setup", type=Path, default=None, help="JSON object of how the runs were taken, recorded")
    s.add_argument("--out", type=Path, default=None, help="combined JSON of every run and the sustained rates")
    return p


def _load_runs(paths: list[Path]) -> list[dict]:
    runs = [json.loads(p.read_text()) for p in paths]
    for p, run in zip(paths, runs):
        if not isinstance(run, dict) or "results" not in run or "label" not in run:
            raise ValueError(f"{p}: not a sweep run JSON (no 'label' / 'results')")
    return runs


def _plot_png(reports: list[dict], png: Path) -> bool:
    """The grid PNG, unless matplotlib is missing (GPU boxes without it: draw the JSON elsewhere)."""
    try:
        plot(reports, png)
    except ImportError as e:
        print(f"no plot ({e}); draw later with: sweep.py plot <json> -o <png>", file=sys.stderr)
        return False
    return True


def main(argv: Optional[list[str]] = None) -> int:
    args = build_parser().parse_args(argv)

    def write(report: dict) -> None:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(report, indent=2) + "\n")

    try:
        if args.command == "plot":
            runs = _load_runs(args.inputs)
            if args.kind == "per-token":
                plot_per_token(runs, args.out, args.ttft_ms, args.percentile)
            else:
                plot(runs, args.out)
            print(f"wrote {args.out}")
            return 0
        if args.command == "slo":
            setup = json.loads(args.setup.read_text()) if args.setup else None
            summary = slo_summary(_load_runs(args.inputs), args.ttft_ms, args.percentile, args.device, setup)
            _print_slo(summary)
            if args.out is not None:
                args.out.parent.mkdir(parents=True, exist_ok=True)
                args.out.write_text(json.dumps(summary, indent=2) + "\n")
                print(f"wrote {args.out}")
            return 0
        if args.num_requests < 1:
            raise ValueError("--num-requests must be >= 1")
        if args.warmup < 0:
            raise ValueError("--warmup must be >= 0")
        report = run(args, on_rate=write)
    except (ValueError, FileNotFoundError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    write(report)
    png = args.out.with_suffix(".png")
    drawn = _plot_png([report] + [json.loads(p.read_text()) for p in args.compare], png)
    _print_table(report)
    print(f"wrote {args.out}" + (f" and {png}" if drawn else ""))
    return 0


if __name__ == "__main__":
    sys.exit(main())
