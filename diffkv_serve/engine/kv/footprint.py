"""What a DiffKV prompt really keeps, learned per engine (one model x cache config), for its page reservation.

Before its prefill a prompt's compressed size is unknown; the all-high worst case over-reserves it by the
compression ratio. After each prefill the engine reports the pages the prompt kept; this learner keeps the
fraction of the worst case they were (`ratio`), per prompt-length bucket (powers of two: short prompts are
mostly recent window and keep relatively more), as the most recent `footprint_max_samples` samples of each
bucket. A reservation asks for the `footprint_quantile` of a bucket's ratios times (1 + `footprint_margin`),
never more than the worst case. Warm-up: a bucket with fewer than `footprint_min_samples` samples borrows
the nearest shorter bucket that has enough (longer prompts compress at least as well, as a rule), else the
worst case. An estimate that turns out too small is not a correctness problem: the prefill detects it on
the device and the scheduler retries that prompt under the worst-case rule (engine.scheduler).

Generation growth (pages per generated token, measured from a sequence's prefill to its finish) is
learned the same way for the stats; the scheduler bounds decode growth exactly instead
(MemoryManager.decode_growth).
"""
from __future__ import annotations

import math
from collections import deque
from typing import Optional

from diffkv_serve.engine.config import SchedulerConfig


def length_bucket(num_tokens: int) -> int:
    """Bucket b holds prompts of [2**b, 2**(b+1)) tokens."""
    return max(0, int(num_tokens).bit_length() - 1)


def quantile(values: list[float], q: float) -> float:
    """Nearest-rank q-quantile (q in (0, 1]): the smallest value with at least q of the values at or below it."""
    if not values:
        raise ValueError("quantile of no values")
    s = sorted(values)
    return s[max(0, math.ceil(q * len(s)) - 1)]


class _Samples:
    """The most recent samples of one quantity, with its quantile cached until the next sample."""

    def __init__(self, max_samples: int):
        self.values: deque[float] = deque(maxlen=max_samples)
        self._q: Optional[float] = None

    def add(self, v: float) -> None:
        self.values.append(v)
        self._q = None

    def quantile(self, q: float) -> float:
        if self._q is None:
            self._q = quantile(list(self.values), q)
        return self._q


class FootprintEstimator:
    def __init__(self, config: SchedulerConfig):
        self.q = config.footprint_quantile
        self.margin = config.footprint_margin
        self.min_samples = config.footprint_min_samples
        self.max_samples = config.footprint_max_samples
        self.prompt: dict[int, _Samples] = {}
        self.growth = _Samples(config.footprint_max_samples)
        self.num_samples = 0

    # ---- learning --------------------------------------------------------------------------------------
    def observe_prompt(self, num_tokens: int, pages: int, worst_pages: int) -> None:
        """A prefill of num_tokens kept `pages` pages (on the busiest rank) of a worst case of worst_pages."""
        if num_tokens < 1 or worst_pages < 1:
            return
        b = length_bucket(num_tokens)
        self.prompt.setdefault(b, _Samples(self.max_samples)).add(min(1.0, pages / worst_pages))
        self.num_samples += 1

    def observe_growth(self, generated: int, pages: int) -> None:
        """A sequence grew by `pages` pages over `generated` decode steps since its prefill."""
        if generated > 0:
            self.growth.add(max(0, pages) / generated)

    # ---- estimates -------------------------------------------------------------------------------------
    def ratio(self, num_tokens: int) -> Optional[float]:
        """The fraction of the worst case a prompt of num_tokens is estimated to keep (None: still warming up)."""
        for b in range(length_bucket(num_tokens), -1, -1):
            s = self.prompt.get(b)
            if s is not None and len(s.values) >= self.min_samples:
                return s.quantile(self.q)
        return None

    def prompt_pages(self, num_tokens: int, worst_pages: int) -> int:
        """Pages to reserve for a prompt: the learned quantile with its margin, at most the worst case."""
        r = self.ratio(num_tokens)
        if r is None:
            return worst_pages
        return min(worst_pages, math.ceil(r * (1.0 + self.margin) * worst_pages))

    def summary(self) -> dict:
        """The current estimates, for stats(): per length bucket '[lo, hi)' its sample count and ratio."""
        buckets = {f"[{2**b}, {2**(b + 1)})": {"samples": len(s.values), "ratio": s.quantile(self.q)}
                   for b, s in sorted(self.prompt.items())}
        growth = self.growth.quantile(self.q) if self.growth.values else None
        return {"quantile": self.q, "margin": self.margin, "prompt_samples": self.num_samples,
                "prompt_ratio": buckets, "growth_pages_per_token": growth}
