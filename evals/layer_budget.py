"""Per-layer budgets (XKV, "personalized" cache allocation across layers), as multipliers of DiffKV's alphas.

XKV keeps, in total, N tokens over all layers and maximizes the mean over layers of the importance each
layer retains, where a token's importance is its attention score divided by the sum over its layer. Its
greedy (Algorithm 1) takes the largest remaining normalized score N times, so it ends with the global
top-N of the normalized scores; allocate_top_n computes that directly. Here the unit is a (layer, KV head)
of one sample sequence: importance = mean significance / its sum over that head's tokens outside the recent
window (the window is always kept, outside any budget).

DiffKV does not keep a count per layer: it keeps a token high when its normalized significance
x = mean * position reaches alpha_high. So the allocation becomes a threshold per layer: the value on
that layer's x distribution (pooled over heads and samples) that keeps its allocated share, divided by
alpha_high. Where the global alpha already keeps the allocated share, the multiplier is exactly 1; N is
what the global alpha keeps on the same sample, so the per-layer thresholds cost the same memory there.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import torch

SCALE_MIN, SCALE_MAX = 1 / 64, 64.0  # a layer that gets (almost) nothing or everything: bounded thresholds


def allocate_top_n(importance: torch.Tensor, n: int) -> torch.Tensor:
    """How many of the global top-n entries of importance [L, M] lie in each layer (int64 [L]).

    Ties between layers go round-robin (by rank within the layer, then layer), so layers with equal
    importance get equal budgets, up to one entry when n does not divide evenly.
    """
    L, M = importance.shape
    if not 0 <= n <= L * M:
        raise ValueError(f"n={n}: the budget must be between 0 and the {L * M} entries")
    order = importance.argsort(dim=1, descending=True, stable=True)
    vals = importance.gather(1, order).flatten()
    rank = torch.arange(M).repeat(L)
    layer = torch.arange(L).repeat_interleave(M)
    # Lexicographic (-value, rank, layer): stable sorts from the last key to the first.
    idx = torch.arange(L * M)
    for key in (layer, rank, -vals):
        idx = idx[key[idx].argsort(stable=True)]
    return torch.bincount(layer[idx[:n]], minlength=L)


def _threshold(values: torch.Tensor, kept: int, alpha: float) -> float:
    """A threshold t keeping exactly `kept` of values (x >= t), the global alpha itself if it does."""
    v = values.sort(descending=True).values
    upper = float(v[kept - 1]) if kept > 0 else math.inf  # smallest kept value
    lower = float(v[kept]) if kept < v.numel() else 0.0  # largest dropped value
    if lower < alpha <= upper:
        return alpha
    if lower >= upper:  # a tie at the boundary: keep the tied values
        return upper
    if math.isinf(upper):
        return 2 * lower
    if lower <= 0:
        return upper / 2
    return math.sqrt(lower * upper)  # the middle of the gap on a log scale (x spans decades)


@dataclass
class LayerBudget:
    alpha: float  # the global alpha_high the multipliers scale
    total: list[int]  # entries (token, KV head) outside the window per layer, over the sample
    kept_global: list[int]  # entries the global alpha keeps high per layer
    kept: list[int]  # entries allocated per layer (global top-N of the normalized importance)
    scale: list[float]  # per-layer multipliers of alpha_high / alpha_low

    def summary(self) -> dict:
        return {"alpha_high": self.alpha, "entries": self.total, "kept_global_alpha": self.kept_global,
                "kept_allocated": self.kept, "kept_fraction_global_alpha": sum(self.kept_global) / max(sum(self.total), 1)}


def plan_layer_budgets(importance: list[torch.Tensor], values: list[torch.Tensor], alpha: float) -> LayerBudget:
    """Per-layer multipliers of alpha from per-sample profiles.

    importance[p], values[p]: [L, H, T_p] of sample p over its tokens outside the window: the normalized
    importance (sums to 1 over T_p per layer and head) and the normalized significance x that alpha is
    compared with. Each sample gets its own global top-N (N = what alpha keeps in it, XKV per task); the
    layers' allocations are summed over samples, then turned into thresholds on the pooled x.
    """
    if not alpha > 0:
        raise ValueError(f"alpha={alpha}: per-layer budgets scale a threshold > 0")
    if not importance or len(importance) != len(values):
        raise ValueError("plan_layer_budgets: needs one importance and one value profile per sample")
    L = importance[0].shape[0]
    kept = torch.zeros(L, dtype=torch.long)
    kept_global = torch.zeros(L, dtype=torch.long)
    for imp, x in zip(importance, values):
        if imp.shape != x.shape or imp.dim() != 3 or imp.shape[0] != L:
            raise ValueError(f"sample profiles must be [L={L}, H, T] and alike; got {tuple(imp.shape)}, {tuple(x.shape)}")
        g = (x >= alpha).flatten(1).sum(1)
        kept_global += g
        kept += allocate_top_n(imp.flatten(1), int(g.sum()))
    pooled = torch.cat([x.flatten(1) for x in values], dim=1)
    scale = [min(max(_threshold(pooled[l], int(kept[l]), alpha) / alpha, SCALE_MIN), SCALE_MAX) for l in range(L)]
    return LayerBudget(alpha, [pooled.shape[1]] * L, kept_global.tolist(), kept.tolist(), scale)
