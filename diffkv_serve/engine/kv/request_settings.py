"""One request's DiffKV compression settings (the `kv_compression` body field, LLMEngine.add_request), checked
and resolved against the engine's CacheConfig in this one place.

A request may override `alpha_high`, `alpha_low` (thresholds: a token is kept high if its significance is
>= alpha_high / position, low if >= alpha_low / position, else pruned) and `prune_phase` (which tokens may be
pruned: both, the prompt's or the generated ones). What it leaves out is the cache config's (the model's
calibrated thresholds where the config left them unset). The engine resolves a request once, when it is
added; the model runner writes the values into a per-slot device table at the sequence's prefill
(diffkv_serve/engine/kv/policy.py), which every decode step reads.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Mapping, Optional

from diffkv_serve.engine.config import PRUNE_PHASES, CacheConfig
from diffkv_serve.engine.errors import InvalidRequestError

FIELD = "kv_compression"  # the request field these settings come in (error messages and `param` name it)
ALPHA_FIELDS = ("alpha_high", "alpha_low")
FIELDS = (*ALPHA_FIELDS, "prune_phase")
ALPHA_MAX = 1e6  # largest threshold a request may set (beyond it nothing is ever kept at that level)


@dataclass(frozen=True)
class KVRequestSettings:
    alpha_high: float
    alpha_low: float
    prune_phase: str  # one of engine.config.PRUNE_PHASES

    @property
    def prefill_alpha_low(self) -> float:
        """alpha_low of the prompt's classification: 0 (nothing pruned) when only generated tokens may be."""
        return 0.0 if self.prune_phase == "generation" else self.alpha_low


def check_alpha(name: str, value: Any) -> float:
    """One threshold a request sets: a finite number in [0, ALPHA_MAX] (InvalidRequestError naming it)."""
    ok = isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)
    if not ok or not 0 <= value <= ALPHA_MAX:
        raise InvalidRequestError(f"{FIELD}.{name} must be a finite number >= 0 (at most {ALPHA_MAX:g}), "
                                  f"got {value!r}", f"{FIELD}.{name}")
    return float(value)


def check_prune_phase(value: Any) -> str:
    if not isinstance(value, str) or value not in PRUNE_PHASES:
        raise InvalidRequestError(f"{FIELD}.prune_phase must be one of {PRUNE_PHASES}, got {value!r}",
                                  f"{FIELD}.prune_phase")
    return value


def check_order(alpha_high: float, alpha_low: float) -> None:
    if alpha_low > alpha_high:
        raise InvalidRequestError(f"{FIELD}.alpha_low ({alpha_low}) must not exceed alpha_high ({alpha_high})",
                                  f"{FIELD}.alpha_low")


def check_overrides(overrides: Optional[Mapping[str, Any]]) -> dict[str, Any]:
    """The fields a request sets (None values dropped), each checked; no defaults needed (the ingress)."""
    if overrides is None:
        return {}
    if not isinstance(overrides, Mapping):
        raise InvalidRequestError(f"{FIELD} must be an object with {', '.join(FIELDS)}", FIELD)
    unknown = sorted(set(overrides) - set(FIELDS))
    if unknown:
        raise InvalidRequestError(f"{FIELD} accepts only {', '.join(FIELDS)}; got {', '.join(map(str, unknown))}",
                                  FIELD)
    out: dict[str, Any] = {}
    for name in ALPHA_FIELDS:
        if overrides.get(name) is not None:
            out[name] = check_alpha(name, overrides[name])
    if overrides.get("prune_phase") is not None:
        out["prune_phase"] = check_prune_phase(overrides["prune_phase"])
    if len(out.keys() & set(ALPHA_FIELDS)) == 2:
        check_order(out["alpha_high"], out["alpha_low"])
    return out


def resolve(overrides: Optional[Mapping[str, Any]], cache: CacheConfig) -> KVRequestSettings:
    """A request's settings: its checked overrides over the cache config's values."""
    given = check_overrides(overrides)
    settings = KVRequestSettings(given.get("alpha_high", cache.alpha_high), given.get("alpha_low", cache.alpha_low),
                                 given.get("prune_phase", cache.prune_phase))
    check_order(settings.alpha_high, settings.alpha_low)
    if settings.alpha_low > 0 and cache.kv_mode == "diffkv" and not cache.tracks_low_tokens():
        raise InvalidRequestError(f"{FIELD}.alpha_low must be 0 on this server: its diffkv cache keeps no scores for "
                                  "low tokens (track_low), so it cannot prune them", f"{FIELD}.alpha_low")
    if settings.prune_phase != "both" and cache.policy != "thresholds":
        raise InvalidRequestError(f"{FIELD}.prune_phase needs the engine's policy 'thresholds'",
                                  f"{FIELD}.prune_phase")
    return settings
