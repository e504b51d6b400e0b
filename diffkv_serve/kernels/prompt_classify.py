"""Prompt classification of one layer (DiffKV paper §5.1): high / low / pruned per (token, KV head), and each kept
token's index within its section, in one launch.

Per prompt token i (1-based position) of a sequence of n tokens, with the attention it received summed over the
counted queries (diffkv_serve/kernels/prompt_significance.py) and divided by how many of them saw it (min(n - pos, Q), >= 1):
    high   if i is among the last `window` tokens, or mean >= alpha_high / i
    low    else if mean >= alpha_low / i
    pruned otherwise
alpha_high / alpha_low are per token (a request's thresholds), times an optional per-layer factor. Selected
tokens are numbered 0, 1, 2, ... per (sequence, head) in token order (where each goes in its section), and the
section sizes are returned. The reference does it with torch ops (about 45 launches per layer, which made
a diffkv prompt step launch-bound); the kernel runs one program per (sequence, KV head), scanning its tokens
in blocks with a carried count. Divisions are correctly rounded (div_rn), so both give identical classes.

Pinned tokens (CacheConfig.pin_prompt_blocks: a prompt's full prefix-cache blocks) carry significance +inf
(pin_significance, applied before classifying): every threshold keeps them high, they are the first tokens of
the high section in position order (whole pages, the ones a prefix cache shares), and the same +inf is their
stored score, so no later step treats them as anything else (diffkv_serve/kernels/compression_plan.py).
"""
from __future__ import annotations

from typing import Optional

import torch
import triton
import triton.language as tl

from diffkv_serve.kernels._common import next_pow2, use_triton


@triton.jit
def _classify_kernel(
    sig_ptr, pos_ptr, cu_ptr, ah_ptr, al_ptr, scale_ptr, idx_hi_ptr, idx_lo_ptr, n_hi_ptr, n_lo_ptr,
    stride_sn, stride_in, stride_nb, layer, window, num_queries,
    HAS_SCALE: tl.constexpr, BLOCK: tl.constexpr,
):
    b, h = tl.program_id(0), tl.program_id(1)
    start = tl.load(cu_ptr + b)
    end = tl.load(cu_ptr + b + 1)
    n = end - start
    mult = 1.0
    if HAS_SCALE:
        mult = tl.load(scale_ptr + layer)
    count_hi = 0
    count_lo = 0
    for t0 in range(start, end, BLOCK):
        t = t0 + tl.arange(0, BLOCK)
        m = t < end
        sig = tl.load(sig_ptr + t.to(tl.int64) * stride_sn + h, mask=m, other=0.0)
        pos = tl.load(pos_ptr + t, mask=m, other=0)
        seen = tl.maximum(tl.minimum(n - pos, num_queries), 1)
        mean = tl.math.div_rn(sig, seen.to(tl.float32))
        i1 = (pos + 1).to(tl.float32)
        ah = tl.load(ah_ptr + t, mask=m, other=0.0) * mult
        al = tl.load(al_ptr + t, mask=m, other=0.0) * mult
        hi = ((pos >= n - window) | (mean >= tl.math.div_rn(ah, i1))) & m
        lo = (~hi) & (mean >= tl.math.div_rn(al, i1)) & m
        hi_i = hi.to(tl.int32)
        lo_i = lo.to(tl.int32)
        rank_hi = count_hi + tl.cumsum(hi_i, 0) - 1
        rank_lo = count_lo + tl.cumsum(lo_i, 0) - 1
        out = t.to(tl.int64) * stride_in + h
        tl.store(idx_hi_ptr + out, tl.where(hi, rank_hi, -1), mask=m)
        tl.store(idx_lo_ptr + out, tl.where(lo, rank_lo, -1), mask=m)
        count_hi += tl.sum(hi_i, 0)
        count_lo += tl.sum(lo_i, 0)
    tl.store(n_hi_ptr + b * stride_nb + h, count_hi)
    tl.store(n_lo_ptr + b * stride_nb + h, count_lo)


def segment_index(mask: torch.Tensor, cu_seqlens: torch.Tensor,
                  seq_of_token: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Index of each selected token within its sequence's section ([N, H] int32, -1 if not selected) and the
    section sizes per sequence ([B, H] int32): a prefix sum over the packed tokens, rebased at each sequence."""
    # One flat scan over the head-major [H, N] copy: a scan along dim 0 of [N, H] runs only H columns in
    # parallel (35 ms at N = 16k tokens on an H200). The scan runs on across heads, which the per-sequence
    # rebase below cancels (a sequence never spans two heads' rows).
    x = mask.t().contiguous().to(torch.int32)  # [H, N]
    incl = torch.cumsum(x.view(-1), 0, dtype=torch.int32).view_as(x).t()  # [N, H]
    excl = incl - x.t()
    # Empty sequences (a graphed step's unused ones, at the end) read row 0 or N - 1 and get size 0.
    empty = (cu_seqlens[1:] == cu_seqlens[:-1]).unsqueeze(1)
    starts = cu_seqlens[:-1].long().clamp(max=mask.shape[0] - 1)
    ends = (cu_seqlens[1:].long() - 1).clamp(min=0)
    base = excl[starts]  # [B, H]
    idx = excl - base[seq_of_token]
    sizes = (incl[ends] - base).masked_fill(empty, 0)
    return torch.where(mask, idx, torch.full_like(idx, -1)), sizes


def pin_significance(sig: torch.Tensor, pinned: torch.Tensor) -> torch.Tensor:
    """sig [N, H] with +inf on the pinned tokens (bool [N]): the classification keeps them high, and as their
    stored score it keeps every generation step from choosing them (inf never falls below a threshold, is never
    a least significant victim, and stays inf as attention is added to it)."""
    return sig.masked_fill(pinned.unsqueeze(1), float("inf"))


def prompt_mean_significance(sig: torch.Tensor, positions: torch.Tensor, seq_len_of_token: torch.Tensor,
                             num_queries: int) -> torch.Tensor:
    """Attention received per counted query that saw the token: sig [N, H] / min(n - pos, Q) (at least 1)."""
    n = seq_len_of_token.unsqueeze(1)
    pos = positions.long().unsqueeze(1)
    count = torch.clamp(n - pos, max=num_queries).clamp_min(1)
    return sig / count


def classify_prompt_ref(sig, positions, cu_seqlens, seq_of_token, seq_len_of_token, alpha_high, alpha_low,
                        window: int, num_queries: int, layer: int = 0, layer_scale: Optional[torch.Tensor] = None):
    """Torch reference: (idx_high, idx_low) int32 [N, H] (-1: not in that section), (n_high, n_low) int32 [B, H]."""
    mean = prompt_mean_significance(sig, positions, seq_len_of_token, num_queries)
    n = seq_len_of_token.unsqueeze(1)
    pos = positions.long().unsqueeze(1)
    i1 = (pos + 1).float()
    ah, al = alpha_high.unsqueeze(1), alpha_low.unsqueeze(1)
    if layer_scale is not None:
        ah, al = ah * layer_scale[layer], al * layer_scale[layer]
    is_high = (pos >= n - window) | (mean >= ah / i1)
    is_low = ~is_high & (mean >= al / i1)
    idx_high, n_high = segment_index(is_high, cu_seqlens, seq_of_token)
    idx_low, n_low = segment_index(is_low, cu_seqlens, seq_of_token)
    return idx_high, idx_low, n_high, n_low


def classify_prompt_triton(sig, positions, cu_seqlens, alpha_high, alpha_low, window: int, num_queries: int,
                           layer: int = 0, layer_scale: Optional[torch.Tensor] = None, max_seqlen: int = 1024):
    N, H = sig.shape
    B = cu_seqlens.numel() - 1
    assert sig.dtype == torch.float32 and sig.stride(1) == 1
    idx_high = torch.empty(N, H, dtype=torch.int32, device=sig.device)
    idx_low = torch.empty_like(idx_high)
    n_high = torch.empty(B, H, dtype=torch.int32, device=sig.device)
    n_low = torch.empty_like(n_high)
    if B == 0 or H == 0:
        return idx_high, idx_low, n_high, n_low
    block = min(1024, max(16, next_pow2(max_seqlen)))
    _classify_kernel[(B, H)](
        sig, positions, cu_seqlens, alpha_high, alpha_low, layer_scale if layer_scale is not None else sig,
        idx_high, idx_low, n_high, n_low, sig.stride(0), idx_high.stride(0), n_high.stride(0), layer, window,
        num_queries, HAS_SCALE=layer_scale is not None, BLOCK=block, num_warps=4)
    return idx_high, idx_low, n_high, n_low


def classify_prompt(sig: torch.Tensor, positions: torch.Tensor, cu_seqlens: torch.Tensor, seq_of_token: torch.Tensor,
                    seq_len_of_token: torch.Tensor, alpha_high: torch.Tensor, alpha_low: torch.Tensor, window: int,
                    num_queries: int, layer: int = 0, layer_scale: Optional[torch.Tensor] = None,
                    max_seqlen: int = 1024, impl: str = "auto"):
    """One layer's prompt classes and section indices.

    sig f32 [N, H]: attention each packed prompt token received (summed over the counted queries); positions
    int [N] (0-based, within its sequence); cu_seqlens int32 [B + 1]; seq_of_token int64 [N]; seq_len_of_token
    int [N]; alpha_high / alpha_low f32 [N] (the token's request's thresholds); layer_scale: optional f32 [L]
    multipliers of both thresholds (entry `layer` used); max_seqlen: host bound on a sequence's tokens (sizes
    the kernel's blocks). Returns idx_high, idx_low int32 [N, H] (-1: not in the section) and n_high, n_low
    int32 [B, H]."""
    if use_triton(impl, sig):
        return classify_prompt_triton(sig, positions.to(torch.int32), cu_seqlens.to(torch.int32),
                                      alpha_high.float(), alpha_low.float(), window, num_queries, layer,
                                      layer_scale, max_seqlen)
    return classify_prompt_ref(sig, positions, cu_seqlens, seq_of_token, seq_len_of_token, alpha_high, alpha_low,
                               window, num_queries, layer, layer_scale)
