"""Small statistics for paired comparisons (no scipy on the GPU box)."""
from __future__ import annotations

import math
from statistics import NormalDist


def mean(xs: list[float]) -> float:
    return sum(xs) / len(xs) if xs else float("nan")


def paired_diff(a: list[float], b: list[float], confidence: float = 0.95) -> dict:
    """Mean of b - a over paired items with a normal-approximation confidence interval (n >= ~30)."""
    if len(a) != len(b):
        raise ValueError(f"paired_diff: {len(a)} vs {len(b)} items")
    n = len(a)
    if n == 0:
        raise ValueError("paired_diff: no items")
    d = [y - x for x, y in zip(a, b)]
    m = mean(d)
    sd = math.sqrt(sum((x - m) ** 2 for x in d) / (n - 1)) if n > 1 else 0.0
    half = NormalDist().inv_cdf(0.5 + confidence / 2) * sd / math.sqrt(n)
    return {"n": n, "mean": m, "ci_low": m - half, "ci_high": m + half, "confidence": confidence}
