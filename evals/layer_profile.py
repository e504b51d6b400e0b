"""Prompt significance per (layer, KV head) of sample sequences, read from the engine's own prefill
(KVCache.significance_probe sees each layer's mean significance as the DiffKV classification does), so
the profile is the quantity the thresholds are compared with, from the same kernels.

Each sequence is prefilled alone (one request, one generated token); only tokens outside the recent
window count (the window is always kept high, outside any budget).
"""
from __future__ import annotations

from dataclasses import dataclass, field

import torch

from diffkv_serve.engine import SamplingParams


@dataclass
class SignificanceProfile:
    importance: list[torch.Tensor] = field(default_factory=list)  # per sample [L, H, T]: sums to 1 over T
    values: list[torch.Tensor] = field(default_factory=list)  # per sample [L, H, T]: mean * position (vs alpha)
    tokens: int = 0  # sample tokens outside the window


def _sample_profile(layers: dict, num_layers: int, window: int) -> tuple[torch.Tensor, torch.Tensor] | None:
    mean = torch.stack([layers[l][0] for l in range(num_layers)])  # [L, N, H]
    pos = layers[0][1]
    n = pos.numel()
    if not torch.equal(pos, torch.arange(n)):
        raise RuntimeError("significance profile: the prefill did not cover the whole sequence (prefix cache "
                           "hit or chunking); profiles need whole-sequence prefills")
    old = pos < n - window
    if not bool(old.any()):
        return None
    m = mean[:, old].transpose(1, 2).double()  # [L, H, T]
    x = m * (pos[old] + 1).double()
    return m / m.sum(-1, keepdim=True).clamp_min(1e-30), x


def profile_significance(model, sequences: list[list[int]], cache: dict | None = None) -> SignificanceProfile:
    """Profile of each sequence (token ids) through a DiffKV engine of `model` (evals.runner.EvalModel)."""
    prof = SignificanceProfile()
    with model.engine({"kv_mode": "diffkv", "layer_alpha_scale": None, **(cache or {})}) as eng:
        kv = eng.runner.kv if eng.runner is not None else None
        if kv is None:
            raise ValueError("significance profile: needs the in-process executor (tensor_parallel_size 1)")
        window = eng.config.cache.window
        captured: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}

        def probe(layer, mean, positions, info):
            if info.cu_seqlens.numel() != 2:
                raise RuntimeError("significance profile: one sequence per prefill expected")
            captured[layer] = (mean.float().cpu(), positions.long().cpu())

        kv.significance_probe = probe
        try:
            for i, ids in enumerate(sequences):
                captured.clear()
                eng.add_request(f"profile-{i}", list(ids), SamplingParams(temperature=0, max_tokens=1))
                while eng.has_unfinished_requests():
                    eng.step()
                got = _sample_profile(captured, eng.arch.num_layers, window)
                if got is not None:
                    prof.importance.append(got[0])
                    prof.values.append(got[1])
                    prof.tokens += got[0].shape[-1]
        finally:
            kv.significance_probe = None
    if not prof.importance:
        raise ValueError(f"significance profile: no sequence is longer than the {window}-token window")
    return prof
