"""The plain-torch reference of paged decode attention: gathers and dequantizes both sections of every
(sequence, KV head) and runs GQA attention in fp32. The CPU path runs it, and the tests compare the Triton kernels
against it."""
from __future__ import annotations

import torch
import triton

from diffkv_serve.kernels._common import check_supported
from diffkv_serve.kernels.page_layout import PageFormat
from diffkv_serve.kernels.quant import read_pages_ref
from diffkv_serve.kernels.sections import section_columns


def check_low_section(fmt: PageFormat, fmt_low: PageFormat | None, len_low, cache_dtype, for_triton: bool) -> bool:
    """Validates the optional low section (shared with dispatch.py); True when there is one."""
    if len_low is None:
        return False
    if fmt_low is None:
        raise ValueError("len_low needs fmt_low (the low section's page format)")
    check_supported(fmt_low, cache_dtype, for_triton)
    if (fmt_low.page_bytes, fmt_low.head_dim, fmt_low.full_itemsize) != (fmt.page_bytes, fmt.head_dim,
                                                                        fmt.full_itemsize):
        raise ValueError(f"formats {fmt.name} and {fmt_low.name} must share page_bytes, head_dim and itemsize")
    return True


def gather_section_ref(pool, fmt: PageFormat, cache_dtype, page_table, slots, layer, lens, n_tokens: int,
                       low: bool):
    """Keys, values float32 [B, Hkv, n, D] of section tokens 0..n-1 (dequantized) and their validity [B, Hkv, n]
    (j < lens). High token j: page_table[..., j // T]; low token j: page_table[..., P - 1 - j // T]."""
    T = fmt.tokens
    n_pages = triton.cdiv(n_tokens, T)
    cols = section_columns(torch.arange(n_pages, device=pool.device) * T, T, low, page_table.shape[3])
    # Entries past a head's length are garbage (-1, stale): clamp so the gather stays in bounds, mask later.
    pages = page_table[slots, layer][:, :, cols].long().clamp(0, pool.shape[0] - 1)  # [B, Hkv, n_pages]
    B, H = pages.shape[:2]
    D = fmt.head_dim
    keys = read_pages_ref(pool, fmt, cache_dtype, "k", pages).reshape(B, H, n_pages * T, D)
    vals = read_pages_ref(pool, fmt, cache_dtype, "v", pages).reshape(B, H, n_pages * T, D)
    j = torch.arange(n_pages * T, device=pool.device)
    valid = j < lens[..., None]
    return keys, vals, valid


def paged_decode_attention_ref(q, pool, fmt: PageFormat, cache_dtype, page_table, lengths, slots, layer,
                               scale, max_len=None, fmt_low=None, len_low=None, logits_out=None, lse_out=None,
                               q_low=None):
    """Vectorized torch: gather + dequantize both sections -> [B, Hkv, n, D], mask by length, GQA attention
    in fp32. q_low: the query the low section's keys meet (default q), for checking a kernel that rounds q per
    section (mma_cuda.round_query)."""
    check_supported(fmt, cache_dtype)
    has_low = check_low_section(fmt, fmt_low, len_low, cache_dtype, False)
    B, Hq, D = q.shape
    Hkv = page_table.shape[2]
    group = Hq // Hkv
    sl = slots.long()
    lens = lengths[sl, layer].long()  # [B, Hkv]
    lens_lo = len_low[sl, layer].long() if has_low else torch.zeros_like(lens)
    if max_len is None:
        max_len = int((lens + lens_lo).max()) if lens.numel() else 0
    # The reference gathers only as far as the longest section really reaches (one sync; CPU/tests only).
    n_hi = min(max_len, page_table.shape[3] * fmt.tokens, int(lens.max()) if lens.numel() else 0)
    parts = [gather_section_ref(pool, fmt, cache_dtype, page_table, sl, layer, lens, n_hi, False)]
    index = [torch.arange(parts[0][2].shape[-1], device=q.device).expand_as(parts[0][2])]
    if has_low:
        n_lo = min(max_len, (page_table.shape[3] - 1) * fmt_low.tokens, int(lens_lo.max()) if lens.numel() else 0)
        parts.append(gather_section_ref(pool, fmt_low, cache_dtype, page_table, sl, layer, lens_lo, n_lo, True))
        index.append(lens[..., None] + torch.arange(parts[1][2].shape[-1], device=q.device))
    keys = torch.cat([p[0] for p in parts], 2)
    vals = torch.cat([p[1] for p in parts], 2)
    valid = torch.cat([p[2] for p in parts], 2)  # [B, Hkv, n]
    index = torch.cat(index, 2)  # where each token's logit goes in logits_out
    vals = vals.masked_fill(~valid[..., None], 0.0)  # rows past the length may hold NaN garbage
    qg = q.float().view(B, Hkv, group, D)
    scores = qg @ keys.transpose(-1, -2)  # [B, Hkv, G, n]
    if has_low and q_low is not None:
        n_hi_cols = parts[0][0].shape[2]
        scores[..., n_hi_cols:] = q_low.float().view(B, Hkv, group, D) @ keys[:, :, n_hi_cols:].transpose(-1, -2)
    scores = scores * scale
    scores = scores.masked_fill(~valid[:, :, None, :], float("-inf"))
    if logits_out is not None:
        bi, hi, ji = valid.nonzero(as_tuple=True)
        logits_out.unflatten(1, (Hkv, group))[bi, hi, :, index[bi, hi, ji]] = scores[bi, hi, :, ji]
    if lse_out is not None:
        lse_out.copy_(torch.logsumexp(scores, -1).view(B, Hq))  # no token: -inf
    empty = (lens + lens_lo == 0)[:, :, None, None]
    probs = scores.softmax(-1).masked_fill(empty, 0.0)  # all -inf -> NaN -> 0
    return (probs @ vals).view(B, Hq, D).to(q.dtype)
