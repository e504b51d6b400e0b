"""Log-probabilities a step reports to the host: each row's chosen token and top-k alternatives, and the
prompt tokens' log-probabilities computed by a prefill (SamplingParams.logprobs / prompt_logprobs).

All are under the model's unmodified distribution (raw logits: no temperature, penalties or bias), computed
from the logits of the step that used the request's KV cache, whatever its compression."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable, Optional, Sequence

import torch

from diffkv_serve.engine.sampler import SamplerOutput
from diffkv_serve.engine.sampling_params import SamplingParams

TopLogprobs = list[tuple[int, float]]  # (token id, log-probability), most likely first
PROMPT_CHUNK = 256  # prompt positions per log_softmax: bounds the [positions, vocab] temporaries


@dataclass
class PromptLogprobs:
    """Per prompt token: its log-probability given the tokens before it (None for the first), and the top-k
    at that position (k = prompt_logprobs; None when 0)."""

    logprobs: list[Optional[float]]
    top: Optional[list[Optional[TopLogprobs]]] = None


@dataclass
class StepLogprobs:
    """A step's log-probabilities on the host, by row. chosen[i]: row i's token (0.0 where not asked; None when
    no row asked); top[i]: its top-k for k = that row's logprobs (None where not asked); prompt: rows whose
    prefill computed prompt log-probabilities."""

    chosen: Optional[list[float]] = None
    top: Optional[list[Optional[TopLogprobs]]] = None
    prompt: dict[int, PromptLogprobs] = field(default_factory=dict)

    def take(self, rows: Sequence[int], n: int) -> "StepLogprobs":
        """This step's rows j placed at rows[j] of a step of n rows (the others empty)."""
        where = {j: i for j, i in enumerate(rows)}
        chosen = top = None
        if self.chosen is not None:
            chosen = [0.0] * n
            for j, i in where.items():
                chosen[i] = self.chosen[j]
        if self.top is not None:
            top = [None] * n
            for j, i in where.items():
                top[i] = self.top[j]
        return StepLogprobs(chosen, top, {where[j]: p for j, p in self.prompt.items()})


def step_logprobs(out: SamplerOutput, params: Sequence[SamplingParams],
                  prompt: dict[int, PromptLogprobs]) -> Optional[StepLogprobs]:
    """The sampler's log-probabilities to the host (one copy per tensor), None when nothing was asked."""
    if out.logprobs is None and not prompt:
        return None
    res = StepLogprobs(prompt=prompt)
    if out.logprobs is not None:
        res.chosen = out.logprobs.tolist()
    if out.top_ids is not None:
        ids, lps = out.top_ids.tolist(), out.top_logprobs.tolist()
        res.top = [list(zip(ids[i][: p.logprobs], lps[i][: p.logprobs])) if p.logprobs else None
                   for i, p in enumerate(params)]
    return res


def prompt_logprobs(logits_of: Callable[[torch.Tensor], torch.Tensor], hidden: torch.Tensor,
                    targets: torch.Tensor, k: int) -> PromptLogprobs:
    """hidden [n, H]: the prompt's final hidden states at positions 0..n-1; targets [n - 1]: tokens 1..n-1.
    Position j's logits give token j + 1's log-probability."""
    lps, tops_ids, tops_lps = [], [], []
    for a in range(0, targets.shape[0], PROMPT_CHUNK):
        b = min(a + PROMPT_CHUNK, targets.shape[0])
        lsm = logits_of(hidden[a:b]).log_softmax(-1)
        lps.append(lsm.gather(1, targets[a:b].unsqueeze(1)).squeeze(1))
        if k > 0:
            v, i = lsm.topk(k, dim=-1)
            tops_lps.append(v)
            tops_ids.append(i)
    first: list[Optional[float]] = [None]
    out = PromptLogprobs(first + (torch.cat(lps).tolist() if lps else []))
    if k > 0:
        ids = torch.cat(tops_ids).tolist() if tops_ids else []
        vals = torch.cat(tops_lps).tolist() if tops_lps else []
        out.top = [None] + [list(zip(i, v)) for i, v in zip(ids, vals)]
    return out
