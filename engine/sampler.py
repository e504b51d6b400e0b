"""Batched token sampling: greedy, temperature, top-k, top-p, per-request seeds, chosen-token logprobs."""
from __future__ import annotations

from typing import Optional, Sequence

import torch

from engine.host_copy import to_device
from engine.sampling_params import SamplingParams


def _mask_top_k_top_p(logits: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor) -> torch.Tensor:
    """Set logits outside each row's top-k / nucleus top-p to -inf (one sort for the whole batch)."""
    sorted_logits, order = logits.sort(dim=-1, descending=True)
    V = logits.shape[-1]
    ranks = torch.arange(V, device=logits.device).unsqueeze(0)
    k = torch.where(top_k > 0, top_k, torch.full_like(top_k, V)).unsqueeze(1)
    drop = ranks >= k
    probs = sorted_logits.masked_fill(drop, float("-inf")).softmax(-1)
    # Keep the smallest prefix whose mass reaches top_p (the token crossing the threshold stays).
    mass_before = probs.cumsum(-1) - probs
    drop |= mass_before >= top_p.unsqueeze(1)
    drop[:, 0] = False
    sorted_logits = sorted_logits.masked_fill(drop, float("-inf"))
    return torch.empty_like(logits).scatter_(1, order, sorted_logits)


def sample(logits: torch.Tensor, params: Sequence[SamplingParams],
           generators: Sequence[Optional[torch.Generator]]) -> tuple[torch.Tensor, Optional[torch.Tensor]]:
    """logits [B, V] fp32 -> (token ids [B] int64, logprobs [B] or None), both on logits.device."""
    B = logits.shape[0]
    dev = logits.device
    tokens = logits.argmax(-1)
    if not all(p.greedy for p in params):  # decided on the host: no device sync
        greedy = to_device([p.greedy for p in params], torch.bool, dev)
        temp = to_device([p.temperature if p.temperature > 0 else 1.0 for p in params], torch.float32, dev)
        top_k = to_device([p.top_k for p in params], torch.int64, dev)
        top_p = to_device([p.top_p for p in params], torch.float32, dev)
        scaled = _mask_top_k_top_p(logits / temp.unsqueeze(1), top_k, top_p)
        probs = scaled.softmax(-1)
        # Exponential race (argmax p / E, E ~ Exp(1)) samples from probs; each row draws its own noise so a
        # seeded request gets the same tokens whatever else is in the batch.
        noise = torch.empty_like(probs)
        for i in range(B):
            if not params[i].greedy:
                noise[i].exponential_(generator=generators[i])
        sampled = (probs / noise.clamp_min(1e-20)).argmax(-1)
        tokens = torch.where(greedy, tokens, sampled)
    logprobs = None
    if any(p.logprobs for p in params):
        logprobs = logits.log_softmax(-1).gather(1, tokens.unsqueeze(1)).squeeze(1)
    return tokens, logprobs
