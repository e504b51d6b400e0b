"""Prompt-phase token significance (DiffKV §4): attention each prompt token receives from the last queries.

For a sequence of length n only its last Q = min(num_queries, n) queries count. Token i's significance SUM
is, over those queries, the max over the query heads of its KV group of the causal softmax probability on i.
The engine divides by `significance_count` (how many of the counted queries saw the token) and keeps adding
the generation-phase attention to the same sums.

The Triton path never builds an n x n matrix: pass 1 gets each counted query row's log-sum-exp (Q x n work,
skipped when the caller passes `lse`), pass 2 runs one program per (key block, sequence, KV head) and loops
over the counted queries, so work per sequence is O(Q * n * group * D).

With a cached prompt prefix only the suffix's queries exist (cu_seqlens_q): queries are aligned to the end
of their sequence's keys, and the counted ones are the last Q that exist. A suffix shorter than Q loses only
the queries inside the cached prefix, which see no suffix token (causal): the suffix tokens' sums are the
same as with every query computed (the prefix's own sums are not: the engine pins those tokens anyway).
"""
from __future__ import annotations

import math

import torch
import triton
import triton.language as tl

from diffkv_serve.kernels._common import dot_in_fp32, next_pow2, use_triton

LOG2E = 1.4426950408889634


def significance_count(pos: torch.Tensor, prompt_len, num_seen, num_queries: int = 64) -> torch.Tensor:
    """How many counted queries saw the token at `pos` (elementwise, broadcasting).

    Prompt tokens got min(prompt_len - pos, Q) prompt queries plus one per generated query; generated
    tokens (pos >= prompt_len) were seen by every later query. num_seen = tokens whose queries were processed
    (num_seen == prompt_len right after prefill). Clamped to >= 1 so it is always a safe divisor.
    """
    in_prompt = torch.clamp(prompt_len - pos, max=num_queries) + (num_seen - prompt_len)
    return torch.where(pos < prompt_len, in_prompt, num_seen - pos).clamp_min(1)


def prompt_significance_count(cu_seqlens: torch.Tensor, num_queries: int = 64) -> torch.Tensor:
    """int32 [N]: min(n - i, Q) for token i of each packed sequence of length n."""
    cu = cu_seqlens.long()
    lens = cu[1:] - cu[:-1]
    seq = torch.repeat_interleave(torch.arange(lens.numel(), device=cu.device), lens)
    i = torch.arange(int(cu[-1]), device=cu.device) - cu[:-1][seq]
    n = lens[seq]
    return significance_count(i, n, n, num_queries).to(torch.int32)


@triton.jit
def _lse_kernel(
    q_ptr, k_ptr, cu_ptr, cu_q_ptr, lse_ptr, stride_qn, stride_qh, stride_kn, stride_kh, stride_ln,
    qk_scale, D, num_queries,
    GROUP: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr,
    DOT_FP32: tl.constexpr,
):
    # Pass 1, program = (block of counted queries, sequence, query head): log2-domain row log-sum-exp.
    pid_m, b, hq = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    start = tl.load(cu_ptr + b)
    n = tl.load(cu_ptr + b + 1) - start
    q_start = tl.load(cu_q_ptr + b)
    n_q = tl.load(cu_q_ptr + b + 1) - q_start
    q_base = q_start - (n - n_q)  # packed row of position p: q_base + p
    first = n - tl.minimum(tl.minimum(n, num_queries), n_q)  # position of the first counted query
    m0 = first + pid_m * BLOCK_M
    if m0 < n:
        rows = m0 + tl.arange(0, BLOCK_M)
        d = tl.arange(0, BLOCK_D)
        dmask = d[None, :] < D
        rmask = rows < n
        q = tl.load(q_ptr + (q_base + rows)[:, None].to(tl.int64) * stride_qn + hq * stride_qh + d[None, :],
                    mask=rmask[:, None] & dmask, other=0.0)
        q = q.to(tl.float32) if DOT_FP32 else q.to(k_ptr.dtype.element_ty)
        m_i = tl.full([BLOCK_M], -1.0e30, tl.float32)
        l_i = tl.zeros([BLOCK_M], tl.float32)
        hi = tl.minimum(n, m0 + BLOCK_M)
        for k0 in range(0, hi, BLOCK_N):
            kn = k0 + tl.arange(0, BLOCK_N)
            k = tl.load(k_ptr + (start + kn)[:, None].to(tl.int64) * stride_kn + (hq // GROUP) * stride_kh
                        + d[None, :], mask=(kn[:, None] < n) & dmask, other=0.0)
            if DOT_FP32:
                s = tl.dot(q, tl.trans(k.to(tl.float32)), input_precision="ieee")
            else:
                s = tl.dot(q, tl.trans(k))
            s = tl.where((kn[None, :] <= rows[:, None]) & (kn[None, :] < n), s * qk_scale, float("-inf"))
            m_new = tl.maximum(m_i, tl.max(s, 1))
            l_i = l_i * tl.exp2(m_i - m_new) + tl.sum(tl.exp2(s - m_new[:, None]), 1)
            m_i = m_new
        tl.store(lse_ptr + (q_base + rows).to(tl.int64) * stride_ln + hq, m_i + tl.log2(l_i), mask=rmask)


@triton.jit
def _sig_kernel(
    q_ptr, k_ptr, cu_ptr, cu_q_ptr, lse_ptr, out_ptr,
    stride_qn, stride_qh, stride_kn, stride_kh, stride_ln, stride_on,
    qk_scale, lse_mult, D, num_queries,
    GROUP: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr,
    DOT_FP32: tl.constexpr,
):
    # Pass 2, program = (key block, sequence, KV head): the key tile is loaded once and reused by every
    # counted query of every head in the group; probabilities are recomputed from the row lse.
    pid_n, b, hk = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    start = tl.load(cu_ptr + b)
    n = tl.load(cu_ptr + b + 1) - start
    q_start = tl.load(cu_q_ptr + b)
    n_q = tl.load(cu_q_ptr + b + 1) - q_start
    q_base = q_start - (n - n_q)  # packed row of query position p: q_base + p
    n0 = pid_n * BLOCK_N
    if n0 < n:
        kn = n0 + tl.arange(0, BLOCK_N)
        d = tl.arange(0, BLOCK_D)
        dmask = d[None, :] < D
        kmask = kn < n
        k = tl.load(k_ptr + (start + kn)[:, None].to(tl.int64) * stride_kn + hk * stride_kh + d[None, :],
                    mask=kmask[:, None] & dmask, other=0.0)
        k = k.to(tl.float32) if DOT_FP32 else k
        acc = tl.zeros([BLOCK_N], tl.float32)
        # Queries before this key block see none of it (causal), so start at the later of the two.
        q_lo = tl.maximum(n - tl.minimum(tl.minimum(n, num_queries), n_q), n0)
        for m0 in range(q_lo, n, BLOCK_M):
            rows = m0 + tl.arange(0, BLOCK_M)
            rmask = rows < n
            qrow = (q_base + rows).to(tl.int64)
            seen = (kn[None, :] <= rows[:, None]) & kmask[None, :] & rmask[:, None]
            pmax = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
            for g in range(GROUP):
                hq = hk * GROUP + g
                q = tl.load(q_ptr + qrow[:, None] * stride_qn + hq * stride_qh + d[None, :],
                            mask=rmask[:, None] & dmask, other=0.0)
                if DOT_FP32:
                    s = tl.dot(q.to(tl.float32), tl.trans(k), input_precision="ieee")
                else:
                    s = tl.dot(q.to(k.dtype), tl.trans(k))
                lse = tl.load(lse_ptr + qrow * stride_ln + hq, mask=rmask, other=0.0) * lse_mult
                p = tl.exp2(s * qk_scale - lse[:, None])
                pmax = tl.maximum(pmax, tl.where(seen, p, 0.0))
            acc += tl.sum(pmax, 0)
        tl.store(out_ptr + (start + kn).to(tl.int64) * stride_on + hk, acc, mask=kmask)


def prompt_significance_ref(q, k, cu_seqlens, scale, num_queries=64, lse=None, cu_seqlens_q=None):
    """Per-sequence fp32 torch: materializes only the [Hq, Q, n] probabilities of the counted queries."""
    Hq = q.shape[1]
    Hkv = k.shape[1]
    group = Hq // Hkv
    out = torch.zeros(k.shape[0], Hkv, dtype=torch.float32, device=q.device)
    cu = cu_seqlens.tolist()
    cu_q = cu if cu_seqlens_q is None else cu_seqlens_q.tolist()
    for s, e, qs_, qe in zip(cu[:-1], cu[1:], cu_q[:-1], cu_q[1:]):
        n = e - s
        nq = min(num_queries, n, qe - qs_)  # the last Q queries that were computed
        if nq == 0:
            continue
        qs = q[qe - nq:qe].float().transpose(0, 1)  # [Hq, Q, D]
        ks = k[s:e].float().repeat_interleave(group, dim=1).transpose(0, 1)  # [Hq, n, D]
        logits = (qs @ ks.transpose(1, 2)) * scale
        qpos = torch.arange(n - nq, n, device=q.device)
        seen = torch.arange(n, device=q.device)[None, :] <= qpos[:, None]  # [Q, n]
        logits = logits.masked_fill(~seen, float("-inf"))
        if lse is None:
            probs = logits.softmax(-1)
        else:
            probs = torch.exp(logits - lse[qe - nq:qe].float().transpose(0, 1)[..., None])
        out[s:e] = probs.view(Hkv, group, nq, n).amax(1).sum(1).transpose(0, 1)
    return out


def prompt_significance_triton(q, k, cu_seqlens, scale, num_queries=64, lse=None, max_seqlen=None,
                               block_m=None, block_n=None, out=None, cu_seqlens_q=None):
    Nq, Hq, D = q.shape
    N, Hkv = k.shape[0], k.shape[1]
    cu_q = cu_seqlens if cu_seqlens_q is None else cu_seqlens_q
    assert Hq % Hkv == 0 and k.shape[2] == D and q.stride(2) == 1 and k.stride(2) == 1
    out = torch.empty(N, Hkv, dtype=torch.float32, device=q.device) if out is None else out
    assert out.shape == (N, Hkv) and out.dtype == torch.float32 and out.stride(1) == 1
    B = cu_seqlens.numel() - 1
    if N == 0 or B == 0:
        return out
    if max_seqlen is None:
        max_seqlen = int((cu_seqlens[1:] - cu_seqlens[:-1]).max())
    max_q = min(num_queries, max_seqlen)
    BLOCK_D = max(16, next_pow2(D))
    block_m = block_m or max(16, min(64, next_pow2(max_q)))  # Q=8 needs no 64-row tiles
    block_n = block_n or 64
    dot32 = dot_in_fp32(q, k) or q.dtype == torch.float32
    common = dict(BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_D=BLOCK_D, DOT_FP32=dot32, GROUP=Hq // Hkv)
    if lse is None:  # pass 1: log2-domain row lse of the counted queries (other rows stay unwritten)
        lse = torch.empty(Nq, Hq, dtype=torch.float32, device=q.device)
        _lse_kernel[(triton.cdiv(max_q, block_m), B, Hq)](
            q, k, cu_seqlens, cu_q, lse, q.stride(0), q.stride(1), k.stride(0), k.stride(1), lse.stride(0),
            scale * LOG2E, D, num_queries, **common, num_warps=4)
        lse_mult = 1.0
    else:  # caller's lse is natural-log (as attention kernels report it)
        assert lse.shape == (Nq, Hq) and lse.stride(1) == 1
        lse_mult = LOG2E
    _sig_kernel[(triton.cdiv(max_seqlen, block_n), B, Hkv)](
        q, k, cu_seqlens, cu_q, lse, out, q.stride(0), q.stride(1), k.stride(0), k.stride(1), lse.stride(0),
        out.stride(0), scale * LOG2E, lse_mult, D, num_queries, **common, num_warps=4)
    return out


def prompt_significance(q, k, cu_seqlens, scale: float | None = None, num_queries: int = 64, impl: str = "auto",
                        lse: torch.Tensor | None = None, max_seqlen: int | None = None,
                        out: torch.Tensor | None = None, cu_seqlens_q: torch.Tensor | None = None) -> torch.Tensor:
    """Significance SUMS f32 [N, Hkv] of packed causal sequences; divide by `prompt_significance_count`.

    q [N, Hq, D], k [N, Hkv, D]; cu_seqlens int32 [B+1]; query head j uses KV head j // (Hq // Hkv).
    lse: optional natural-log log-sum-exp [N, Hq] of the scaled causal logits (only the rows of each
    sequence's last num_queries queries are read); without it a first pass computes them.
    max_seqlen: optional host-side max sequence length (avoids a device sync).
    cu_seqlens_q: when q holds only each sequence's last queries (a cached prefix precedes them): their
    delimiters, q [Nq, Hq, D]; at least one per sequence (the counted ones: the last num_queries that exist).
    lse is then [Nq, Hq].
    """
    if scale is None:
        scale = 1.0 / math.sqrt(q.shape[-1])
    if use_triton(impl, q, k, cu_seqlens):
        return prompt_significance_triton(q, k, cu_seqlens, scale, num_queries, lse=lse, max_seqlen=max_seqlen,
                                          out=out, cu_seqlens_q=cu_seqlens_q)
    res = prompt_significance_ref(q, k, cu_seqlens, scale, num_queries, lse=lse, cu_seqlens_q=cu_seqlens_q)
    return res if out is None else out.copy_(res)


def budget_keep_mask(mean: torch.Tensor, positions: torch.Tensor, seq_len: torch.Tensor, seq_of_token: torch.Tensor,
                     cu_seqlens: torch.Tensor, budget: float, window: int) -> torch.Tensor:
    """Equal-budget pruning of a packed prompt (the H2O/SnapKV-style baseline): bool [N, H], True for the
    max(ceil(budget * n), window) tokens of each (sequence, KV head) that it keeps: the recent window first,
    then the highest mean significance (ties: the earlier token). No host synchronization.

    mean f32 [N, H]; positions, seq_len, seq_of_token int [N] (position in, length of and index of each
    token's sequence); cu_seqlens int32 [B + 1].
    """
    N, H = mean.shape
    pos, n = positions.long().view(-1, 1), seq_len.long().view(-1, 1)
    key = torch.where(pos >= n - window, torch.full_like(mean, float("inf")), mean)
    # Rank inside each sequence: sort by significance (descending), then stably by sequence.
    by_key = torch.argsort(key, dim=0, descending=True, stable=True)  # [N, H] token ids
    by_seq = torch.argsort(seq_of_token[by_key], dim=0, stable=True)
    order = by_key.gather(0, by_seq)
    start = cu_seqlens.long()[seq_of_token]  # [N]: first packed index of each token's sequence
    rank_sorted = torch.arange(N, device=mean.device).view(-1, 1) - start[order]
    rank = torch.empty_like(order).scatter_(0, order, rank_sorted)
    keep = torch.clamp_min(torch.ceil(torch.tensor(budget, dtype=torch.float32) * n.float()).long(), window)
    return rank < keep
