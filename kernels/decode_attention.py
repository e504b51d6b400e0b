"""One-token-per-sequence attention over paged KV caches (decode), split along the sequence.

Kernel 1 runs one program per (batch entry, KV head, split): all query heads of the GQA group share each
key/value tile, so every page is read once. With one split it writes the output directly; otherwise it writes
partial (max, sum, acc) and kernel 2 merges the splits (flash-decoding).
"""
from __future__ import annotations

import math

import torch
import triton
import triton.language as tl

from kernels._common import check_supported, dot_in_fp32, next_pow2, num_sms, pool_views, use_triton
from kernels.page_layout import PageFormat

LOG2E = 1.4426950408889634
MIN_BLOCKS_PER_SPLIT = 4  # below this, the partial-result traffic outweighs the extra parallelism
MAX_SPLITS = 64


@triton.jit
def _decode_split_kernel(
    q_ptr, pool_c, pt_ptr, len_ptr, slots_ptr, o_ptr, mid_acc, mid_ml,
    stride_qb, stride_qh, stride_ob, stride_oh,
    stride_pts, stride_ptl, stride_pth, stride_ls, stride_ll, stride_lh,
    layer, qk_scale, Hq, D,
    page_elems, k_off, v_off,  # in cache-dtype elements
    GROUP: tl.constexpr, T: tl.constexpr, NUM_SPLITS: tl.constexpr,
    BLOCK_G: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr, DOT_FP32: tl.constexpr,
):
    b, h, split = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    slot = tl.load(slots_ptr + b).to(tl.int64)
    length = tl.load(len_ptr + slot * stride_ls + layer * stride_ll + h * stride_lh)
    pt_row = pt_ptr + slot * stride_pts + layer * stride_ptl + h * stride_pth
    # This split's token range, in whole BLOCK_N blocks; lengths differ per (sequence, head).
    per_split = tl.cdiv(tl.cdiv(length, BLOCK_N), NUM_SPLITS) * BLOCK_N
    lo = split * per_split
    hi = tl.minimum(length, lo + per_split)

    g = tl.arange(0, BLOCK_G)
    d = tl.arange(0, BLOCK_D)
    hq = h * GROUP + g
    gmask = g < GROUP
    dmask = d < D
    q = tl.load(q_ptr + b * stride_qb + hq[:, None] * stride_qh + d[None, :],
                mask=gmask[:, None] & dmask[None, :], other=0.0)
    q = q.to(tl.float32) if DOT_FP32 else q.to(pool_c.dtype.element_ty)

    m_i = tl.full([BLOCK_G], -1.0e30, tl.float32)  # finite, so empty splits merge without NaN
    l_i = tl.zeros([BLOCK_G], tl.float32)
    acc = tl.zeros([BLOCK_G, BLOCK_D], tl.float32)
    for t0 in range(lo, hi, BLOCK_N):
        t = t0 + tl.arange(0, BLOCK_N)
        tmask = t < hi
        # Token t sits in page page_table[t // T], row t % T; rows of one page are contiguous.
        page = tl.load(pt_row + t // T, mask=tmask, other=0).to(tl.int64)
        row = page * page_elems + (t % T) * D
        m2 = tmask[:, None] & dmask[None, :]
        # 16-bit pages only; quantized formats will load packed ints + meta and dequantize here.
        k = tl.load(pool_c + k_off + row[:, None] + d[None, :], mask=m2, other=0.0)
        v = tl.load(pool_c + v_off + row[:, None] + d[None, :], mask=m2, other=0.0)
        if DOT_FP32:
            s = tl.dot(q, tl.trans(k.to(tl.float32)), input_precision="ieee")
        else:
            s = tl.dot(q, tl.trans(k))
        s = tl.where(tmask[None, :], s * qk_scale, float("-inf"))  # log2 domain: exp2 below
        m_new = tl.maximum(m_i, tl.max(s, 1))
        p = tl.exp2(s - m_new[:, None])
        alpha = tl.exp2(m_i - m_new)
        l_i = l_i * alpha + tl.sum(p, 1)
        if DOT_FP32:
            acc = acc * alpha[:, None] + tl.dot(p, v.to(tl.float32), input_precision="ieee")
        else:
            acc = tl.dot(p.to(v.dtype), v, acc * alpha[:, None])
        m_i = m_new

    if NUM_SPLITS == 1:
        out = acc / tl.where(l_i > 0, l_i, 1.0)[:, None]  # length 0 -> zeros
        tl.store(o_ptr + b * stride_ob + hq[:, None] * stride_oh + d[None, :],
                 out.to(o_ptr.dtype.element_ty), mask=gmask[:, None] & dmask[None, :])
    else:
        idx = (b * Hq + hq) * NUM_SPLITS + split  # mid_* are contiguous [B, Hq, NUM_SPLITS, ...]
        tl.store(mid_acc + idx[:, None] * D + d[None, :], acc, mask=gmask[:, None] & dmask[None, :])
        tl.store(mid_ml + idx * 2, m_i, mask=gmask)
        tl.store(mid_ml + idx * 2 + 1, l_i, mask=gmask)


@triton.jit
def _decode_reduce_kernel(
    mid_acc, mid_ml, o_ptr, stride_ob, stride_oh, Hq, D,
    NUM_SPLITS: tl.constexpr, BLOCK_S: tl.constexpr, BLOCK_D: tl.constexpr,
):
    b, hq = tl.program_id(0), tl.program_id(1)
    s = tl.arange(0, BLOCK_S)
    d = tl.arange(0, BLOCK_D)
    smask = s < NUM_SPLITS
    idx = (b * Hq + hq) * NUM_SPLITS + s
    m = tl.load(mid_ml + idx * 2, mask=smask, other=-1.0e30)
    l = tl.load(mid_ml + idx * 2 + 1, mask=smask, other=0.0)
    w = tl.exp2(m - tl.max(m, 0))  # empty splits have l = 0 and acc = 0, so any weight is harmless
    total = tl.sum(w * l, 0)
    acc = tl.load(mid_acc + idx[:, None] * D + d[None, :], mask=smask[:, None] & (d[None, :] < D), other=0.0)
    out = tl.sum(w[:, None] * acc, 0) / tl.where(total > 0, total, 1.0)
    tl.store(o_ptr + b * stride_ob + hq * stride_oh + d, out.to(o_ptr.dtype.element_ty), mask=d < D)


def choose_num_splits(batch: int, kv_heads: int, max_len: int, device: torch.device, block_n: int) -> int:
    """Enough splits for ~2 programs per SM when batch * kv_heads alone can't fill the GPU."""
    programs = batch * kv_heads
    sms = num_sms(device)
    if programs >= sms or max_len <= 0:
        return 1
    by_length = triton.cdiv(triton.cdiv(max_len, block_n), MIN_BLOCKS_PER_SPLIT)
    return max(1, min(triton.cdiv(2 * sms, programs), by_length, MAX_SPLITS))


def paged_decode_attention_ref(q, pool, fmt: PageFormat, cache_dtype, page_table, lengths, slots, layer,
                               scale, max_len=None):
    """Vectorized torch: gather pages -> [B, Hkv, P*T, D], mask by length, GQA attention in fp32."""
    check_supported(fmt, cache_dtype)
    B, Hq, D = q.shape
    Hkv, T = page_table.shape[2], fmt.tokens
    group = Hq // Hkv
    pc = pool_views(pool, cache_dtype)[0]
    sl = slots.long()
    lens = lengths[sl, layer].long()  # [B, Hkv]
    if max_len is None:
        max_len = int(lens.max()) if lens.numel() else 0
    n_pages = min(triton.cdiv(max_len, T), page_table.shape[3])
    if n_pages == 0:
        return torch.zeros_like(q)
    # Entries past a head's length are garbage (-1, stale): clamp so the gather stays in bounds, mask later.
    pt = page_table[sl, layer, :, :n_pages].long().clamp(0, pool.shape[0] - 1)
    isz = fmt.full_itemsize
    k_pages = pc[:, fmt.k_off // isz: fmt.k_off // isz + T * D].view(-1, T, D)
    v_pages = pc[:, fmt.v_off // isz: fmt.v_off // isz + T * D].view(-1, T, D)
    keys = k_pages[pt].view(B, Hkv, n_pages * T, D).float()
    vals = v_pages[pt].view(B, Hkv, n_pages * T, D).float()
    valid = torch.arange(n_pages * T, device=q.device) < lens[..., None]  # [B, Hkv, P*T]
    vals = vals.masked_fill(~valid[..., None], 0.0)  # rows past the length may hold NaN garbage
    qg = q.float().view(B, Hkv, group, D)
    scores = (qg @ keys.transpose(-1, -2)) * scale  # [B, Hkv, G, P*T]
    scores = scores.masked_fill(~valid[:, :, None, :], float("-inf"))
    probs = scores.softmax(-1).masked_fill((lens == 0)[:, :, None, None], 0.0)  # all -inf -> NaN -> 0
    return (probs @ vals).view(B, Hq, D).to(q.dtype)


def paged_decode_attention_triton(q, pool, fmt: PageFormat, cache_dtype, page_table, lengths, slots, layer,
                                  scale, num_splits=None, max_len=None, block_n=None, out=None):
    check_supported(fmt, cache_dtype)
    B, Hq, D = q.shape
    Hkv, T = page_table.shape[2], fmt.tokens
    assert Hq % Hkv == 0 and D == fmt.head_dim and q.stride(2) == 1 and page_table.stride(3) == 1
    out = torch.empty_like(q) if out is None else out
    assert out.shape == q.shape and out.stride(2) == 1
    if B == 0:
        return out
    pc = pool_views(pool, cache_dtype)[0]
    block_n = block_n or 128  # H100: 128 tokens per iteration measured a bit faster than 64 or 32
    if max_len is None:
        max_len = page_table.shape[3] * T  # capacity bound: needs no device sync
    if num_splits is None:
        num_splits = choose_num_splits(B, Hkv, max_len, q.device, block_n)
    group = Hq // Hkv
    BLOCK_D = max(16, next_pow2(D))
    if num_splits > 1:
        mid_acc = torch.empty(B, Hq, num_splits, D, dtype=torch.float32, device=q.device)
        mid_ml = torch.empty(B, Hq, num_splits, 2, dtype=torch.float32, device=q.device)
    else:
        mid_acc = mid_ml = out  # unused
    isz = fmt.full_itemsize
    _decode_split_kernel[(B, Hkv, num_splits)](
        q, pc, page_table, lengths, slots, out, mid_acc, mid_ml,
        q.stride(0), q.stride(1), out.stride(0), out.stride(1),
        page_table.stride(0), page_table.stride(1), page_table.stride(2),
        lengths.stride(0), lengths.stride(1), lengths.stride(2),
        layer, scale * LOG2E, Hq, D, fmt.page_bytes // isz, fmt.k_off // isz, fmt.v_off // isz,
        GROUP=group, T=T, NUM_SPLITS=num_splits,
        BLOCK_G=max(16, next_pow2(group)), BLOCK_N=block_n, BLOCK_D=BLOCK_D,
        DOT_FP32=dot_in_fp32(q, pool) or q.dtype == torch.float32 or cache_dtype == torch.float32,
        num_warps=4, num_stages=2,
    )
    if num_splits > 1:
        _decode_reduce_kernel[(B, Hq)](
            mid_acc, mid_ml, out, out.stride(0), out.stride(1), Hq, D,
            NUM_SPLITS=num_splits, BLOCK_S=next_pow2(num_splits), BLOCK_D=BLOCK_D, num_warps=4,
        )
    return out


def paged_decode_attention(q, pool, fmt: PageFormat, cache_dtype, page_table, lengths, slots, layer: int,
                           scale: float | None = None, num_splits: int | None = None, impl: str = "auto",
                           max_len: int | None = None, out: torch.Tensor | None = None):
    """Attention of one new token per sequence over its paged KV cache; returns [B, Hq, D] in q's dtype.

    q [B, Hq, D]; page_table int32 [S, L, Hkv, P]; lengths int32 [S, L, Hkv] (already counting the new
    token); slots int32 [B] picks rows of page_table/lengths. max_len: optional host-side upper bound on
    lengths[slots, layer] (sizes the splits without a device sync). Heads of length 0 give zeros.
    out: optional preallocated [B, Hq, D] result.
    """
    if scale is None:
        scale = 1.0 / math.sqrt(q.shape[-1])
    if use_triton(impl, q, pool, page_table, lengths, slots):
        return paged_decode_attention_triton(q, pool, fmt, cache_dtype, page_table, lengths, slots, layer,
                                             scale, num_splits=num_splits, max_len=max_len, out=out)
    res = paged_decode_attention_ref(q, pool, fmt, cache_dtype, page_table, lengths, slots, layer, scale,
                                     max_len=max_len)
    return res if out is None else out.copy_(res)
