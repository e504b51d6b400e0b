"""Per-request logits adjustments, batched over a step: logit_bias, min_tokens (EOS and stop ids masked),
repetition / frequency / presence penalties, and min_p.

Each op runs once for the whole batch on per-row parameter tensors, and only when some row of the step uses
it: a batch where nobody asked pays nothing. Token histories arrive as flat (row, token id) pairs, turned
into per-row counts by one scatter-add. Semantics are vLLM's (and OpenAI's for the two additive penalties).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional, Sequence

import numpy as np
import torch

from diffkv_serve.engine.host_copy import to_device
from diffkv_serve.engine.sampling_params import SamplingParams


@dataclass
class TokenHistory:
    """What the rows of a step have seen. output[i]: tokens generated so far as the host knows them;
    num_generated[i]: how many there really are (async scheduling: the host may not have the newest yet, which
    is then last_token[i], this step's input, still on the device). prompt[i]: the prompt's ids."""

    prompt: Sequence[list[int]]
    output: Sequence[list[int]]
    num_generated: Sequence[int]
    last_token: Optional[torch.Tensor] = None  # [B] int64 on the device (decode steps), or None


def token_counts(rows: torch.Tensor, ids: torch.Tensor, batch: int, vocab: int) -> torch.Tensor:
    """[batch, vocab] float32: how often each row holds each token id (pairs rows[j], ids[j])."""
    counts = torch.zeros(batch * vocab, dtype=torch.float32, device=ids.device)
    counts.scatter_add_(0, rows * vocab + ids, torch.ones_like(ids, dtype=torch.float32))
    return counts.view(batch, vocab)


def apply_repetition_penalty(logits: torch.Tensor, seen: torch.Tensor, penalty: torch.Tensor) -> torch.Tensor:
    """Tokens seen (prompt or output) get positive logits divided by the row's penalty, negative ones multiplied."""
    p = penalty.unsqueeze(1)
    return torch.where(seen, torch.where(logits > 0, logits / p, logits * p), logits)


def apply_frequency_presence(logits: torch.Tensor, counts: torch.Tensor, frequency: torch.Tensor,
                             presence: torch.Tensor) -> torch.Tensor:
    """OpenAI's: logit - frequency * count - presence * (count > 0), counts over the generated tokens."""
    shift = torch.addcmul(presence.unsqueeze(1) * (counts > 0), counts, frequency.unsqueeze(1))
    return logits - shift


def apply_min_p(logits: torch.Tensor, min_p: torch.Tensor) -> torch.Tensor:
    """Drop tokens whose probability is below min_p times the row's most likely token's (min_p 0 keeps all)."""
    probs = logits.softmax(-1)
    drop = probs < min_p.unsqueeze(1) * probs.amax(-1, keepdim=True)
    return logits.masked_fill(drop, float("-inf"))


def _flat_pairs(lists: Sequence[Sequence[int]], rows: Sequence[int]) -> tuple[np.ndarray, np.ndarray]:
    """(row of each id, the ids) for lists[j] belonging to rows[j], as numpy arrays."""
    lens = np.fromiter((len(x) for x in lists), dtype=np.int64, count=len(lists))
    ids = np.fromiter((t for x in lists for t in x), dtype=np.int64, count=int(lens.sum()))
    return np.repeat(np.asarray(rows, dtype=np.int64), lens), ids


def _pairs_to_device(row_np: np.ndarray, id_np: np.ndarray, device: torch.device) -> tuple[torch.Tensor, ...]:
    both = to_device(np.concatenate([row_np, id_np]), torch.int64, device)
    return both[: len(row_np)], both[len(row_np):]


def adjust_logits(logits: torch.Tensor, params: Sequence[SamplingParams],
                  history: Optional[TokenHistory]) -> torch.Tensor:
    """The logits every row samples (or takes argmax) from: logit_bias, min_tokens masks, then the penalties.
    Returns `logits` itself when no row asks for any of them."""
    B, V = logits.shape
    dev = logits.device
    biased = [i for i, p in enumerate(params) if p.logit_bias]
    need_min = any(p.min_tokens > 0 for p in params)
    penal = [i for i, p in enumerate(params) if p.penalizes]
    if (penal or need_min) and history is None:
        raise ValueError("penalties and min_tokens need the rows' token history")
    if not biased and not need_min and not penal:
        return logits
    out = logits.clone()
    if biased:
        rows = np.repeat(np.asarray(biased, dtype=np.int64), [len(params[i].logit_bias) for i in biased])
        ids = np.fromiter((t for i in biased for t in params[i].logit_bias), dtype=np.int64, count=len(rows))
        vals = to_device([v for i in biased for v in params[i].logit_bias.values()], torch.float32, dev)
        r, t = _pairs_to_device(rows, ids, dev)
        out.index_put_((r, t), vals.to(out.dtype), accumulate=True)
    if need_min:
        # Rows still short of min_tokens may not end: their EOS and stop token ids go to -inf.
        short = [i for i, p in enumerate(params) if history.num_generated[i] < p.min_tokens]
        if short:
            stops = [tuple(params[i].stop_token_ids) + tuple(params[i].eos_token_ids) for i in short]
            rows, ids = _flat_pairs(stops, short)
            if len(ids):
                r, t = _pairs_to_device(rows, ids, dev)
                out.index_put_((r, t), torch.tensor(float("-inf"), dtype=out.dtype, device=dev))
    if penal:
        out = _penalize(out, params, history, penal)
    return out


def _penalize(logits: torch.Tensor, params: Sequence[SamplingParams], history: TokenHistory,
              penal: list[int]) -> torch.Tensor:
    """The penalties on the rows that use them only (gathered into a sub-batch when others do not), so their
    cost follows the rows asking, not the batch."""
    B, V = logits.shape
    dev = logits.device
    P = len(penal)
    local = list(range(P))  # row j of the sub-batch is batch row penal[j]
    sub_params = [params[i] for i in penal]
    idx = None if P == B else to_device(penal, torch.int64, dev)
    sub = logits if idx is None else logits[idx]
    # Generated tokens: what the host has, up to the last one when that is still only on the device.
    on_device = history.last_token is not None
    outs = [history.output[i][: max(0, history.num_generated[i] - on_device)] for i in penal]
    rows, ids = _flat_pairs(outs, local)
    r, t = _pairs_to_device(rows, ids, dev)
    if on_device:
        have = [j for j, i in enumerate(penal) if history.num_generated[i] > 0]
        last = history.last_token if idx is None else history.last_token[idx]
        sel = to_device(have, torch.int64, dev)
        r, t = torch.cat([r, sel]), torch.cat([t, last[sel]])
    counts = token_counts(r, t, P, V)
    rep = [j for j, p in enumerate(sub_params) if p.repetition_penalty != 1]
    if rep:  # first, as vLLM: it scales the logits the additive penalties then shift
        prow, pids = _flat_pairs([history.prompt[penal[j]] for j in rep], rep)
        pr_r, pr_t = _pairs_to_device(prow, pids, dev)
        seen = counts > 0
        seen.view(-1)[pr_r * V + pr_t] = True
        penalty = to_device([p.repetition_penalty for p in sub_params], torch.float32, dev)
        sub = apply_repetition_penalty(sub, seen, penalty)
    if any(p.frequency_penalty or p.presence_penalty for p in sub_params):
        f = to_device([p.frequency_penalty for p in sub_params], torch.float32, dev)
        pr = to_device([p.presence_penalty for p in sub_params], torch.float32, dev)
        sub = apply_frequency_presence(sub, counts, f, pr)
    if idx is None:
        return sub
    logits[idx] = sub
    return logits
