"""Causal attention over packed variable-length sequences (prefill), with grouped-query heads.

Queries and keys may differ in length per sequence (cu_seqlens_k): a prefill whose prompt prefix came from
the prefix cache computes only its suffix queries, which attend over [cached prefix ; suffix] keys. Queries
are aligned to the end of their keys: query i of a sequence with q_len queries and k_len keys sits at
position k_len - q_len + i and sees keys 0..that position.
"""
from __future__ import annotations

import math

import torch
import triton
import triton.language as tl

from diffkv_serve.kernels._common import dot_in_fp32, next_pow2, use_triton

LOG2E = 1.4426950408889634


@triton.jit
def _attend_block(acc, m_i, l_i, q, k_ptr, v_ptr, k_start, k_len, n0, qpos, hk, stride_kn, stride_kh, stride_vn,
                  stride_vh, qk_scale, d, dmask,
                  MASKED: tl.constexpr, BLOCK_N: tl.constexpr, DOT_FP32: tl.constexpr):
    """One key block of the online softmax. MASKED: the block crosses the diagonal (or the keys' end)."""
    kn = n0 + tl.arange(0, BLOCK_N)
    rows = (k_start + kn)[:, None].to(tl.int64)
    if MASKED:
        kvmask = (kn[:, None] < k_len) & dmask
        k = tl.load(k_ptr + rows * stride_kn + hk * stride_kh + d[None, :], mask=kvmask, other=0.0)
        v = tl.load(v_ptr + rows * stride_vn + hk * stride_vh + d[None, :], mask=kvmask, other=0.0)
    else:
        k = tl.load(k_ptr + rows * stride_kn + hk * stride_kh + d[None, :], mask=dmask, other=0.0)
        v = tl.load(v_ptr + rows * stride_vn + hk * stride_vh + d[None, :], mask=dmask, other=0.0)
    if DOT_FP32:
        s = tl.dot(q, tl.trans(k.to(tl.float32)), input_precision="ieee")
    else:
        s = tl.dot(q, tl.trans(k))
    s = s * qk_scale  # scale * log2(e): the softmax then uses exp2
    if MASKED:
        s = tl.where((kn[None, :] <= qpos[:, None]) & (kn[None, :] < k_len), s, float("-inf"))
    m_new = tl.maximum(m_i, tl.max(s, 1))
    p = tl.exp2(s - m_new[:, None])
    alpha = tl.exp2(m_i - m_new)
    l_i = l_i * alpha + tl.sum(p, 1)
    if DOT_FP32:
        acc = acc * alpha[:, None] + tl.dot(p, v.to(tl.float32), input_precision="ieee")
    else:
        acc = tl.dot(p.to(v.dtype), v, acc * alpha[:, None])
    return acc, m_new, l_i


@triton.jit(do_not_specialize=["B"])
def _prefill_kernel(
    q_ptr, k_ptr, v_ptr, o_ptr, cu_ptr, cu_k_ptr,
    stride_qn, stride_qh, stride_kn, stride_kh, stride_vn, stride_vh, stride_on, stride_oh,
    qk_scale, D, B,
    GROUP: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr,
    BLOCK_B: tl.constexpr, DOT_FP32: tl.constexpr,
):
    # Program = (query block, query head); online softmax over key blocks up to the diagonal. The query blocks
    # of all sequences are numbered in order and taken from the end: the grid depends on the token and
    # sequence counts only (a CUDA graph replays it for any lengths), and each sequence's blocks with the
    # most keys start first, the short ones fill in the tail.
    pid, hq = tl.program_id(0), tl.program_id(1)
    i = tl.arange(0, BLOCK_B)
    lens = tl.load(cu_ptr + i + 1, mask=i < B, other=0) - tl.load(cu_ptr + i, mask=i < B, other=0)
    blocks = (lens + BLOCK_M - 1) // BLOCK_M
    ends = tl.cumsum(blocks, 0)  # query blocks of sequences 0..b
    j = tl.sum(blocks, 0) - 1 - pid
    b = tl.sum((ends <= j).to(tl.int32), 0)
    m0 = (j - tl.sum(tl.where(i == b, ends - blocks, 0), 0)) * BLOCK_M
    hk = hq // GROUP
    if j >= 0:
        start = tl.load(cu_ptr + b)
        seqlen = tl.load(cu_ptr + b + 1) - start
        k_start = tl.load(cu_k_ptr + b)
        k_len = tl.load(cu_k_ptr + b + 1) - k_start
        q_off = k_len - seqlen  # position of this sequence's first query (0 unless a cached prefix precedes it)
        offs_m = m0 + tl.arange(0, BLOCK_M)
        d = tl.arange(0, BLOCK_D)
        dmask = d[None, :] < D
        qmask = (offs_m[:, None] < seqlen) & dmask
        q = tl.load(q_ptr + (start + offs_m)[:, None].to(tl.int64) * stride_qn + hq * stride_qh + d[None, :],
                    mask=qmask, other=0.0)
        qpos = q_off + offs_m
        q = q.to(tl.float32) if DOT_FP32 else q.to(k_ptr.dtype.element_ty)

        m_i = tl.full([BLOCK_M], -1.0e30, tl.float32)  # finite: padded rows never produce NaN
        l_i = tl.zeros([BLOCK_M], tl.float32)
        acc = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)
        # Key blocks every query of the block sees whole need no mask (most of a long prompt's); the blocks
        # from the first query's position on cross the diagonal.
        full = ((q_off + m0 + 1) // BLOCK_N) * BLOCK_N
        hi = tl.minimum(k_len, q_off + m0 + BLOCK_M)
        for n0 in range(0, full, BLOCK_N):
            acc, m_i, l_i = _attend_block(acc, m_i, l_i, q, k_ptr, v_ptr, k_start, k_len, n0, qpos, hk,
                                          stride_kn, stride_kh, stride_vn, stride_vh, qk_scale, d, dmask,
                                          False, BLOCK_N, DOT_FP32)
        for n0 in range(full, hi, BLOCK_N):
            acc, m_i, l_i = _attend_block(acc, m_i, l_i, q, k_ptr, v_ptr, k_start, k_len, n0, qpos, hk,
                                          stride_kn, stride_kh, stride_vn, stride_vh, qk_scale, d, dmask,
                                          True, BLOCK_N, DOT_FP32)

        out = acc / tl.where(l_i > 0, l_i, 1.0)[:, None]
        tl.store(o_ptr + (start + offs_m)[:, None].to(tl.int64) * stride_on + hq * stride_oh + d[None, :],
                 out.to(o_ptr.dtype.element_ty), mask=qmask)


def prefill_attention_ref(q, k, v, cu_seqlens, scale, cu_seqlens_k=None):
    """Per-sequence fp32 attention with a causal mask (materializes Lq x Lk; for CPU and tests)."""
    N, Hq, D = q.shape
    group = Hq // k.shape[1]
    out = torch.empty_like(q)
    cu = cu_seqlens.tolist()
    cuk = cu if cu_seqlens_k is None else cu_seqlens_k.tolist()
    for s, e, ks_, ke in zip(cu[:-1], cu[1:], cuk[:-1], cuk[1:]):
        if e == s:
            continue
        qs = q[s:e].float().transpose(0, 1)  # [Hq, Lq, D]
        ks = k[ks_:ke].float().repeat_interleave(group, dim=1).transpose(0, 1)  # [Hq, Lk, D]
        vs = v[ks_:ke].float().repeat_interleave(group, dim=1).transpose(0, 1)
        scores = (qs @ ks.transpose(1, 2)) * scale
        Lq, Lk = e - s, ke - ks_
        causal = torch.ones(Lq, Lk, dtype=torch.bool, device=q.device).tril(Lk - Lq)  # queries end-aligned
        scores = scores.masked_fill(~causal, float("-inf"))
        out[s:e] = (scores.softmax(-1) @ vs).transpose(0, 1).to(q.dtype)
    return out


def prefill_attention_triton(q, k, v, cu_seqlens, scale, block_m=None, block_n=None, out=None,
                             cu_seqlens_k=None, num_warps=None, num_stages=None):
    N, Hq, D = q.shape
    Hkv = k.shape[1]
    assert Hq % Hkv == 0 and k.shape == v.shape and k.shape[2] == D
    assert q.stride(2) == 1 and k.stride(2) == 1 and v.stride(2) == 1
    out = torch.empty_like(q) if out is None else out
    assert out.shape == q.shape and out.stride(2) == 1
    B = cu_seqlens.numel() - 1
    if N == 0 or B == 0:
        return out
    BLOCK_D = max(16, next_pow2(D))
    # head_dim 128, bf16, H100: 64 x 64 tiles with 4 warps and 3 stages ran 1.6-2.3x faster than with 8 warps and
    # 2 stages (1 x 2,048 tokens: 128 -> 62 us; 32 x 512: 234 -> 126 us; 12 query heads, 2 KV heads) and as fast
    # as or faster than 128-row or 128-column tiles.
    block_m = block_m or (128 if BLOCK_D <= 64 else 64)
    block_n = block_n or 64
    # At most N // block_m full query blocks plus one partial block per sequence; the rest exit at once.
    grid = (triton.cdiv(N, block_m) + B, Hq)
    _prefill_kernel[grid](
        q, k, v, out, cu_seqlens, cu_seqlens if cu_seqlens_k is None else cu_seqlens_k,
        q.stride(0), q.stride(1), k.stride(0), k.stride(1), v.stride(0), v.stride(1),
        out.stride(0), out.stride(1),
        scale * LOG2E, D, B,
        GROUP=Hq // Hkv, BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_D=BLOCK_D, BLOCK_B=max(16, next_pow2(B)),
        DOT_FP32=dot_in_fp32(q) or q.dtype == torch.float32,
        num_warps=num_warps or 4, num_stages=num_stages or (3 if BLOCK_D >= 128 else 2),
    )
    return out


def prefill_attention(q, k, v, cu_seqlens, scale: float | None = None, impl: str = "auto",
                      out: torch.Tensor | None = None, cu_seqlens_k: torch.Tensor | None = None):
    """Causal attention within each packed sequence; q [N, Hq, D], k/v [Nk, Hkv, D] -> [N, Hq, D] (q's dtype).

    cu_seqlens int32 [B+1] delimits the sequences' queries; query head j reads KV head j // (Hq // Hkv).
    cu_seqlens_k: the keys' delimiters when they differ (a cached prefix precedes the queries; each
    sequence needs at least as many keys as queries); default: the same as the queries'.
    No host value but the shapes sizes the launch (a CUDA graph may replay it). out: optional preallocated result.
    """
    if scale is None:
        scale = 1.0 / math.sqrt(q.shape[-1])
    if use_triton(impl, q, k, v, cu_seqlens):
        return prefill_attention_triton(q, k, v, cu_seqlens, scale, out=out, cu_seqlens_k=cu_seqlens_k)
    res = prefill_attention_ref(q, k, v, cu_seqlens, scale, cu_seqlens_k=cu_seqlens_k)
    return res if out is None else out.copy_(res)
