"""The timed loop the throughput benchmarks share: step an engine until its requests finish, counting tokens and
sampling its stats() every few steps."""
from __future__ import annotations

import statistics
import time
from typing import Callable, Optional


def step_until_done(engine, total_tokens: int, desc: str, quiet: bool, stats_every: int,
                    sample: Optional[Callable[[dict, int, float], list]] = None, deadline: Optional[float] = None,
                    drain: Optional[Callable[[], None]] = None, synchronize: Optional[Callable[[], None]] = None
                    ) -> dict:
    """Steps `engine` until it has no request left, or, past `deadline` (time.perf_counter()), calls `drain` to end
    the rest and flags the run as cut. `phases` splits the steps and their wall time into those that computed
    prompt tokens (prefills and recomputes) and the rest (decode). Every `stats_every` steps it records the
    running batch and compression ratio, and `sample(stats, step, seconds)` where given (a trace row); their time
    is `stats_seconds` (inside the wall time: engine.stats() reads the device, which also stalls the pipeline of
    asynchronous steps). stats_every 0 reads nothing between steps (engine speed alone, as another engine's
    generate() is timed): the mean batch is then the tokens of the steps that computed no prompt tokens over their
    count, and the compression ratio is unknown. `synchronize` runs before the clock stops (device work still
    queued belongs to the run)."""
    from tqdm import tqdm

    batches, ratios, trace, generated, steps, cut = [], [], [], 0, 0, False
    stats_seconds, decode_tokens = 0.0, 0
    # Steps that computed prompt tokens (prefills, recomputes after preemption) against the rest, by the
    # scheduler's counter: where the wall time goes besides decoding.
    scheduler = getattr(engine, "scheduler", None)
    computed = getattr(scheduler, "num_prefill_computed", None)
    phases = {"prefill": {"steps": 0, "seconds": 0.0, "tokens": 0}, "decode": {"steps": 0, "seconds": 0.0}}
    t0 = time.perf_counter()
    with tqdm(total=total_tokens, desc=desc, unit="tok", disable=quiet) as bar:
        while engine.has_unfinished_requests():
            if deadline is not None and time.perf_counter() > deadline:
                cut = True
                drain()
                break
            ts = time.perf_counter()
            n = sum(len(o.new_token_ids) for o in engine.step())
            dt = time.perf_counter() - ts
            now = getattr(scheduler, "num_prefill_computed", None)
            prefill = computed is not None and now != computed
            phase = phases["prefill" if prefill else "decode"]
            decode_tokens += 0 if prefill else n
            phase["steps"] += 1
            phase["seconds"] += dt
            if now is not None and computed is not None:
                phases["prefill"]["tokens"] += now - computed
            computed = now
            steps += 1
            generated += n
            bar.update(n)
            if stats_every > 0 and steps % stats_every == 0:
                ts = time.perf_counter()
                st = engine.stats()
                batches.append(st["num_running"])
                if st["compression_ratio"]:
                    ratios.append(st["compression_ratio"])
                if sample is not None:
                    trace.append(sample(st, steps, time.perf_counter() - t0))
                stats_seconds += time.perf_counter() - ts
    if synchronize is not None:
        synchronize()
    wall = time.perf_counter() - t0
    if batches:
        mean_batch = statistics.mean(batches)
    else:  # no stats read: tokens per decode step (one per running sequence)
        mean_batch = decode_tokens / phases["decode"]["steps"] if computed is not None and phases["decode"]["steps"] \
            else None
    return {"tokens": generated, "seconds": wall, "tokens_per_s": generated / wall if wall > 0 else 0.0,
            "steps": steps, "cut": cut, "mean_batch": mean_batch, "stats_seconds": stats_seconds,
            "max_batch": max(batches, default=None),
            "compression_ratio": statistics.mean(ratios) if ratios else None, "trace": trace,
            "phases": phases if computed is not None else None}
