"""Batched token sampling: grammar masks (engine.grammar), logits adjustments (engine.logits_processors), greedy,
temperature, min-p, top-k, top-p, per-request seeds, and the log-probabilities of the chosen and the most likely
tokens."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional, Sequence

import torch

from diffkv_serve.engine.grammar import TokenMasks, apply_token_masks
from diffkv_serve.engine.host_copy import to_device
from diffkv_serve.engine.logits_processors import TokenHistory, adjust_logits, apply_min_p
from diffkv_serve.engine.sampling_params import SamplingParams


@dataclass
class SamplerOutput:
    """On the logits' device. logprobs: each row's chosen token under the unmodified distribution, when some
    row asked; top_ids / top_logprobs [B, k]: the k most likely tokens, k the largest any row asked for."""

    tokens: torch.Tensor
    logprobs: Optional[torch.Tensor] = None
    top_ids: Optional[torch.Tensor] = None
    top_logprobs: Optional[torch.Tensor] = None


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
           generators: Sequence[Optional[torch.Generator]], history: Optional[TokenHistory] = None,
           masks: Optional[TokenMasks] = None) -> SamplerOutput:
    """logits [B, V] fp32 -> the tokens each row picks (greedy rows: argmax of the adjusted logits, as vLLM).
    masks: rows a grammar restricts (structured outputs): their other tokens are out before anything else."""
    B = logits.shape[0]
    dev = logits.device
    allowed = logits
    if masks is not None:
        rows = to_device(masks.rows, torch.int64, dev)
        allowed = apply_token_masks(logits, rows, masks.result().to(dev, non_blocking=True))
    adjusted = adjust_logits(allowed, params, history)
    tokens = adjusted.argmax(-1)
    if not all(p.greedy for p in params):  # decided on the host: no device sync
        greedy = to_device([p.greedy for p in params], torch.bool, dev)
        temp = to_device([p.temperature if p.temperature > 0 else 1.0 for p in params], torch.float32, dev)
        scaled = adjusted / temp.unsqueeze(1)
        if any(p.min_p > 0 and not p.greedy for p in params):
            scaled = apply_min_p(scaled, to_device([p.min_p for p in params], torch.float32, dev))
        if any((p.top_k > 0 or p.top_p < 1) and not p.greedy for p in params):
            # top_k at or above the vocabulary keeps every token (any size is valid, as in vLLM)
            top_k = to_device([min(p.top_k, logits.shape[-1]) for p in params], torch.int64, dev)
            top_p = to_device([p.top_p for p in params], torch.float32, dev)
            scaled = _mask_top_k_top_p(scaled, top_k, top_p)
        probs = scaled.softmax(-1)
        # Exponential race (argmax p / E, E ~ Exp(1)) samples from probs; each row draws its own noise so a
        # seeded request gets the same tokens whatever else is in the batch.
        noise = torch.empty_like(probs)
        for i in range(B):
            if not params[i].greedy:
                noise[i].exponential_(generator=generators[i])
        sampled = (probs / noise.clamp_min(1e-20)).argmax(-1)
        tokens = torch.where(greedy, tokens, sampled)
    return with_logprobs(logits, tokens, params)


def with_logprobs(logits: torch.Tensor, tokens: torch.Tensor, params: Sequence[SamplingParams]) -> SamplerOutput:
    """The chosen tokens' log-probabilities (and the top-k) under the raw logits, only if some row asked: a
    step where nobody did runs no log_softmax."""
    asked = [p.logprobs for p in params if p.logprobs is not None]
    if not asked:
        return SamplerOutput(tokens)
    lsm = logits.log_softmax(-1)
    out = SamplerOutput(tokens, lsm.gather(1, tokens.unsqueeze(1)).squeeze(1))
    k = max(asked)
    if k > 0:
        out.top_logprobs, out.top_ids = lsm.topk(k, dim=-1)
    return out
