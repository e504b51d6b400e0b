"""The KV configurations compared, all through the same engine, pages and kernels (CacheConfig values).

  fp16                16-bit cache (reference)
  diffkv              K8V4 / K4V2 / pruned by the model's calibrated alpha_high, alpha_low
  k8v8, k4v4          uniform int8 / int4 (kv_mode int8 / int4)
  k4v4_norot, ...     the same without the KV rotation (engine.kv_rotation; on for every quantized cache)
  fp8                 e4m3 keys and values, a scale per token and KV head (kv_mode fp8: vLLM's fp8 cache)
  k8v4, k4v8,         uniform at one precision: diffkv with high = low = that precision and both alphas 0,
  k4v2, k2v4          so every token stays in the high section (the mirrors test "keys over values")
  kivi2               KIVI-like: the recent window at 16 bits, every older token at K2V2 (alpha_high out of
                      reach, alpha_low 0: nothing is high beyond the window, nothing is pruned)
  prune50, prune_eq   equal per-head budget pruning (H2O/SnapKV-style static sparsity) at 16 bits: each KV
                      head keeps 50% of its tokens, or the share that costs what DiffKV costs

Frontier points beyond these are named on the command line (parse_config): `uniform:K2V2` and
`diffkv:alpha_high=A,alpha_low=B[,high=K4V4][,low=K2V2]`.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Mapping

from diffkv_serve.engine.config import CacheConfig, parse_precision, parse_settings

UNREACHABLE = 1e9  # an alpha_high no significance reaches (KIVI-like: only the window stays high)


@dataclass(frozen=True)
class KVConfig:
    name: str
    label: str
    family: str  # fp16 | diffkv | uniform | mirror | kivi | prune
    cache: dict = field(default_factory=dict)

    def cache_config(self) -> CacheConfig:
        return CacheConfig(**self.cache)


def is_uniform_diffkv(cache: Mapping[str, Any]) -> bool:
    """A diffkv cache (its fields, or its describe()) with one precision and both alphas 0 under the threshold policy:
    how the evals run a uniform KxVy that has no kv_mode of its own (K8V4, K4V2, K2V2). Every token stays high, so
    it is that uniform cache, bytes included (no score or position rows: they never change what is stored)."""
    return (cache.get("kv_mode") == "diffkv" and cache.get("policy", "thresholds") == "thresholds"
            and parse_precision(cache["high"], "high") == parse_precision(cache["low"], "low")
            and cache.get("alpha_high") == 0 and cache.get("alpha_low") == 0)


def _uniform(name: str, precision: str, family: str = "uniform") -> KVConfig:
    return KVConfig(name, f"uniform {precision}", family,
                    {"kv_mode": "diffkv", "high": precision, "low": precision, "alpha_high": 0.0, "alpha_low": 0.0})


def diffkv_config(alpha_high: float | None, alpha_low: float | None, name: str = "diffkv",
                  low: str | None = None, high: str | None = None) -> KVConfig:
    """DiffKV K8V4/K4V2 (or the calibrated `high` / `low` precisions); None alphas leave the engine's per-model
    settings in charge."""
    cache = {"kv_mode": "diffkv"}
    if high is not None:
        cache["high"] = high
    if low is not None:
        cache["low"] = low
    if alpha_high is not None:
        cache["alpha_high"] = alpha_high
    if alpha_low is not None:
        cache["alpha_low"] = alpha_low
    label = "DiffKV" if alpha_high is None else f"DiffKV a_h={alpha_high:g} a_l={alpha_low:g}"
    if (high or low) and (high, low) != (CacheConfig().high, CacheConfig().low):
        label += f" {high or CacheConfig().high}/{low or CacheConfig().low}"
    return KVConfig(name, label, "diffkv", cache)


def prune_config(budget: float, name: str) -> KVConfig:
    if not 0 < budget <= 1:
        raise ValueError(f"prune budget {budget} must be in (0, 1]")
    return KVConfig(name, f"prune {100 * budget:.0f}% (equal budget)", "prune",
                    {"kv_mode": "diffkv", "policy": "budget", "budget": round(budget, 4), "high": "K16V16",
                     "low": "K16V16"})


def baseline_configs(attention_bias: bool = False) -> list[KVConfig]:
    """Every configuration that does not depend on DiffKV's calibrated thresholds or measured memory. Quantized
    ones center keys and rotate keys and values as the engine does by default (measured centers in a study);
    k4v4_raw turns both off, k4v4_norot / k4v2_norot the rotation alone, and, for a model with a k_proj bias,
    k4v4_bias centers on the rotated bias (no calibration)."""
    centering = [KVConfig("k4v4_raw", "uniform K4V4, keys neither centered nor rotated", "uniform",
                          {"kv_mode": "int4", "key_centering": "off", "kv_rotation": "off"})]
    rotation = [KVConfig("k4v4_norot", "uniform K4V4, not rotated", "uniform",
                         {"kv_mode": "int4", "kv_rotation": "off"}),
                KVConfig("k4v2_norot", "uniform K4V2, not rotated", "uniform",
                         {**_uniform("k4v2", "K4V2").cache, "kv_rotation": "off"})]
    if attention_bias:
        centering.append(KVConfig("k4v4_bias", "uniform K4V4, keys centered on the bias", "uniform",
                                  {"kv_mode": "int4", "key_centering": "bias"}))
    return [
        KVConfig("fp16", "fp16", "fp16", {"kv_mode": "fp16"}),
        KVConfig("k8v8", "uniform K8V8", "uniform", {"kv_mode": "int8"}),
        KVConfig("fp8", "fp8 e4m3", "uniform", {"kv_mode": "fp8"}),
        KVConfig("k4v4", "uniform K4V4", "uniform", {"kv_mode": "int4"}),
        *centering,
        *rotation,
        _uniform("k8v4", "K8V4"),
        _uniform("k4v8", "K4V8", "mirror"),
        _uniform("k4v2", "K4V2"),
        _uniform("k2v4", "K2V4", "mirror"),
        KVConfig("kivi2", "KIVI-like 2-bit + 16-bit window", "kivi",
                 {"kv_mode": "diffkv", "high": "K16V16", "low": "K2V2", "alpha_high": UNREACHABLE, "alpha_low": 0.0}),
        prune_config(0.5, "prune50"),
    ]


def precision(text: str) -> str:
    """'k8v4' -> 'K8V4' (parse_settings names this function in its error: '... is not a precision')."""
    parse_precision(text)
    return text.upper()


def parse_config(spec: str) -> KVConfig:
    """A configuration by name: a baseline (fp16, k8v8, k4v4, ...), `diffkv` (the model's calibrated settings),
    `uniform:KxVy` (every token at one precision) or `diffkv:alpha_high=A,alpha_low=B[,high=..][,low=..]`.
    ValueError naming what is wrong."""
    known = {c.name: c for c in baseline_configs(attention_bias=True)}
    if spec in known:
        return known[spec]
    if spec == "diffkv":
        return diffkv_config(None, None)
    head, _, rest = spec.partition(":")
    if head == "uniform" and rest:
        name = precision(rest)
        return KVConfig(spec, f"uniform {name}", "uniform", _uniform(spec, name).cache)
    if head != "diffkv" or not rest:
        raise ValueError(f"config {spec!r}: expected one of {sorted(known) + ['diffkv']}, uniform:KxVy or "
                         "diffkv:alpha_high=A,alpha_low=B[,high=KxVy][,low=KxVy]")
    _, kv = parse_settings(spec, {"alpha_high": float, "alpha_low": float, "high": precision, "low": precision},
                           "config")
    if not {"alpha_high", "alpha_low"} <= set(kv):
        raise ValueError(f"config {spec!r}: give both alpha_high and alpha_low")
    return diffkv_config(kv["alpha_high"], kv["alpha_low"], name=spec, high=kv.get("high"), low=kv.get("low"))
