"""One-token-per-sequence attention over paged KV caches (decode), split along the sequence.

Kernel 1 runs one program per (batch entry, KV head, split): all query heads of the GQA group share each
key/value tile, so every page is read once. With one split it writes the output directly; otherwise it writes
partial (max, sum, acc) and kernel 2 merges the splits (flash-decoding).

Pages of any precision (DiffKV): 16-bit sides load the cache dtype; 8/4/2-bit sides load packed bytes and fp16
scale/zero and dequantize on the fly (planar layout, kernels/quant.py). A (sequence, head) may own a high
section (fmt, pages from the left of its page-table row) and a low section (fmt_low, pages from the right);
each program walks its share of high tokens, then of low tokens. Optional per-token logits and per-head lse
feed the generation-phase significance update (kernels/score_update.py). All of it hides behind constexpr
branches: a K16V16 call without a low section compiles to the same loop as before.
"""
from __future__ import annotations

import math

import torch
import triton
import triton.language as tl

from kernels._common import check_supported, dot_in_fp32, next_pow2, num_sms, seg_offsets, use_triton
from kernels.page_layout import PageFormat
from kernels.quant import codes_as_f16, load_codes, load_tile, read_pages_ref
from kernels.sections import section_columns, section_page

LOG2E = 1.4426950408889634
MIN_BLOCKS_PER_SPLIT = 4  # below this, the partial-result traffic outweighs the extra parallelism
MAX_SPLITS = 64


@triton.jit
def _dot(a, b, DOT_FP32: tl.constexpr):
    if DOT_FP32:
        return tl.dot(a.to(tl.float32), b.to(tl.float32), input_precision="ieee")
    else:
        return tl.dot(a, b)


@triton.jit
def _codes(c, DOT_FP32: tl.constexpr):
    """Codes as dot operands: fp16 on the GPU (exact), fp32 in the interpreter / on fp32 caches."""
    if DOT_FP32:
        return c.to(tl.float32)
    else:
        return codes_as_f16(c)


@triton.jit
def _attend_section(
    q, q16, qsum, m_i, l_i, acc, lo, hi, pt_row, col0,
    pool_c, pool_u8, pool_h, page_elems, page_bytes, k_off, k_meta, v_off, v_meta,
    qk_scale, sm_scale, D, d, dmask, gmask, logit_rows, logit_base,
    KB: tl.constexpr, VB: tl.constexpr, T: tl.constexpr, LOW: tl.constexpr, WRITE_LOGITS: tl.constexpr,
    BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr, DOT_FP32: tl.constexpr,
):
    """Online softmax over tokens [lo, hi) of one section (the high one, or the low one read from the right).

    Quantized sides never materialize dequantized tiles: with x = c * scale + zero per token,
        q . k_n      = scale_n * (q . c_n) + zero_n * sum(q)
        sum_n p_n v_n = sum_n (p_n scale_n) c_n + sum_n p_n zero_n
    so the dots run on the integer codes (exact in fp16; q16 is q in fp16 whatever the cache dtype) and
    scale/zero act on [G, N] only. The value weights p_n scale_n are divided by the tile's largest scale before
    the fp16 cast (no underflow)."""
    DT = q.dtype
    for t0 in range(lo, hi, BLOCK_N):
        t = t0 + tl.arange(0, BLOCK_N)
        tmask = t < hi
        page = section_page(pt_row, col0, t, tmask, T, LOW)
        row = t % T
        if KB == 16:
            k = load_tile(pool_c, pool_u8, pool_h, page, row, tmask, d, dmask, page_elems, page_bytes,
                          k_off, k_meta, D, KB, BLOCK_N, BLOCK_D)
            s = _dot(q, tl.trans(k.to(DT)), DOT_FP32)
        else:
            kc, ks, kz = load_codes(pool_u8, pool_h, page, row, tmask, page_bytes, k_off, k_meta,
                                    KB, BLOCK_N, BLOCK_D)
            s = _dot(q16, tl.trans(_codes(kc, DOT_FP32)), DOT_FP32) * ks[None, :] + qsum[:, None] * kz[None, :]
        if WRITE_LOGITS:
            tl.store(logit_rows[:, None] + (logit_base + t)[None, :], s * sm_scale,
                     mask=gmask[:, None] & tmask[None, :])
        s = tl.where(tmask[None, :], s * qk_scale, float("-inf"))  # log2 domain: exp2 below
        m_new = tl.maximum(m_i, tl.max(s, 1))
        p = tl.exp2(s - m_new[:, None])
        alpha = tl.exp2(m_i - m_new)
        l_i = l_i * alpha + tl.sum(p, 1)
        if VB == 16:
            v = load_tile(pool_c, pool_u8, pool_h, page, row, tmask, d, dmask, page_elems, page_bytes,
                          v_off, v_meta, D, VB, BLOCK_N, BLOCK_D)
            if DOT_FP32:
                acc = acc * alpha[:, None] + _dot(p, v, DOT_FP32)
            else:
                acc = tl.dot(p.to(DT), v.to(DT), acc * alpha[:, None])
        else:
            vc, vs, vz = load_codes(pool_u8, pool_h, page, row, tmask, page_bytes, v_off, v_meta,
                                    VB, BLOCK_N, BLOCK_D)
            top = tl.max(vs, 0)
            top = tl.where(top > 0, top, 1.0)
            pv = p * (vs / top)[None, :]
            zsum = tl.sum(p * vz[None, :], 1)
            pv = pv.to(q16.dtype)
            acc = acc * alpha[:, None] + _dot(pv, _codes(vc, DOT_FP32), DOT_FP32) * top + zsum[:, None]
        m_i = m_new
    return m_i, l_i, acc


@triton.jit
def _decode_split_kernel(
    q_ptr, pool_c, pool_u8, pool_h, pt_ptr, len_ptr, lenlo_ptr, slots_ptr, o_ptr, mid_acc, mid_ml,
    logits_ptr, lse_ptr,
    stride_qb, stride_qh, stride_ob, stride_oh,
    stride_pts, stride_ptl, stride_pth, stride_ls, stride_ll, stride_lh,
    stride_lls, stride_lll, stride_llh, stride_gb, stride_gh, stride_eb, stride_eh,
    layer, qk_scale, sm_scale, Hq, D, low_col0,
    page_elems, page_bytes,
    k_off, k_meta, v_off, v_meta,  # high section format (16 bits: cache-dtype elements; else bytes / fp16)
    lk_off, lk_meta, lv_off, lv_meta,  # low section format
    GROUP: tl.constexpr, T: tl.constexpr, NUM_SPLITS: tl.constexpr,
    BLOCK_G: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr, DOT_FP32: tl.constexpr,
    KB: tl.constexpr = 16, VB: tl.constexpr = 16,
    HAS_LOW: tl.constexpr = False, KB_LO: tl.constexpr = 16, VB_LO: tl.constexpr = 16, T_LO: tl.constexpr = 1,
    WRITE_LOGITS: tl.constexpr = False, WRITE_LSE: tl.constexpr = False,
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
    q16 = q if DOT_FP32 else q.to(tl.float16)  # quantized sides dot fp16 codes (see _attend_section)
    qsum = tl.sum(q16.to(tl.float32), 1)  # folds key zero points into the dot
    logit_rows = logits_ptr + b * stride_gb + hq * stride_gh  # only used with WRITE_LOGITS

    m_i = tl.full([BLOCK_G], -1.0e30, tl.float32)  # finite, so empty splits merge without NaN
    l_i = tl.zeros([BLOCK_G], tl.float32)
    acc = tl.zeros([BLOCK_G, BLOCK_D], tl.float32)
    m_i, l_i, acc = _attend_section(
        q, q16, qsum, m_i, l_i, acc, lo, hi, pt_row, 0, pool_c, pool_u8, pool_h, page_elems, page_bytes,
        k_off, k_meta, v_off, v_meta, qk_scale, sm_scale, D, d, dmask, gmask, logit_rows, 0,
        KB, VB, T, False, WRITE_LOGITS, BLOCK_N, BLOCK_D, DOT_FP32)
    if HAS_LOW:
        # The low section (its own format, pages from the right end of the row), split the same way.
        length_lo = tl.load(lenlo_ptr + slot * stride_lls + layer * stride_lll + h * stride_llh)
        per_split_lo = tl.cdiv(tl.cdiv(length_lo, BLOCK_N), NUM_SPLITS) * BLOCK_N
        lo_lo = split * per_split_lo
        hi_lo = tl.minimum(length_lo, lo_lo + per_split_lo)
        m_i, l_i, acc = _attend_section(
            q, q16, qsum, m_i, l_i, acc, lo_lo, hi_lo, pt_row, low_col0, pool_c, pool_u8, pool_h, page_elems,
            page_bytes,
            lk_off, lk_meta, lv_off, lv_meta, qk_scale, sm_scale, D, d, dmask, gmask, logit_rows, length,
            KB_LO, VB_LO, T_LO, True, WRITE_LOGITS, BLOCK_N, BLOCK_D, DOT_FP32)

    if NUM_SPLITS == 1:
        out = acc / tl.where(l_i > 0, l_i, 1.0)[:, None]  # length 0 -> zeros
        tl.store(o_ptr + b * stride_ob + hq[:, None] * stride_oh + d[None, :],
                 out.to(o_ptr.dtype.element_ty), mask=gmask[:, None] & dmask[None, :])
        if WRITE_LSE:
            lse = tl.where(l_i > 0, (m_i + tl.log2(tl.where(l_i > 0, l_i, 1.0))) * 0.6931471805599453,
                           float("-inf"))  # natural-log lse; -inf without tokens
            tl.store(lse_ptr + b * stride_eb + hq * stride_eh, lse, mask=gmask)
    else:
        idx = (b * Hq + hq) * NUM_SPLITS + split  # mid_* are contiguous [B, Hq, NUM_SPLITS, ...]
        tl.store(mid_acc + idx[:, None] * D + d[None, :], acc, mask=gmask[:, None] & dmask[None, :])
        tl.store(mid_ml + idx * 2, m_i, mask=gmask)
        tl.store(mid_ml + idx * 2 + 1, l_i, mask=gmask)


@triton.jit
def _decode_reduce_kernel(
    mid_acc, mid_ml, o_ptr, stride_ob, stride_oh, Hq, D,
    NUM_SPLITS: tl.constexpr, BLOCK_S: tl.constexpr, BLOCK_D: tl.constexpr,
    lse_ptr=None, stride_eb=0, stride_eh=0, WRITE_LSE: tl.constexpr = False,
):
    b, hq = tl.program_id(0), tl.program_id(1)
    s = tl.arange(0, BLOCK_S)
    d = tl.arange(0, BLOCK_D)
    smask = s < NUM_SPLITS
    idx = (b * Hq + hq) * NUM_SPLITS + s
    m = tl.load(mid_ml + idx * 2, mask=smask, other=-1.0e30)
    l = tl.load(mid_ml + idx * 2 + 1, mask=smask, other=0.0)
    m_max = tl.max(m, 0)
    w = tl.exp2(m - m_max)  # empty splits have l = 0 and acc = 0, so any weight is harmless
    total = tl.sum(w * l, 0)
    acc = tl.load(mid_acc + idx[:, None] * D + d[None, :], mask=smask[:, None] & (d[None, :] < D), other=0.0)
    out = tl.sum(w[:, None] * acc, 0) / tl.where(total > 0, total, 1.0)
    tl.store(o_ptr + b * stride_ob + hq * stride_oh + d, out.to(o_ptr.dtype.element_ty), mask=d < D)
    if WRITE_LSE:
        lse = tl.where(total > 0, (m_max + tl.log2(tl.where(total > 0, total, 1.0))) * 0.6931471805599453,
                       float("-inf"))
        tl.store(lse_ptr + b * stride_eb + hq * stride_eh, lse)


def launch_config(fmt: PageFormat, fmt_low: PageFormat | None) -> tuple[int, int, int]:
    """(BLOCK_N, num_warps, num_stages) by precision, from the H200 sweep (benchmarks/tune_decode_attention.py,
    results/tune_decode_attention_H200.json): 128-token tiles and 4 warps win everywhere; one pipeline stage
    for a single quantized format (its unpacking already fills the registers), two otherwise."""
    quantized = any(b < 16 for f in (fmt, fmt_low) if f is not None for b in (f.key_bits, f.value_bits))
    return (128, 4, 1) if quantized and fmt_low is None else (128, 4, 2)


def choose_num_splits(batch: int, kv_heads: int, max_len: int, device: torch.device, block_n: int) -> int:
    """Enough splits for ~2 programs per SM when batch * kv_heads alone can't fill the GPU."""
    programs = batch * kv_heads
    sms = num_sms(device)
    if programs >= sms or max_len <= 0:
        return 1
    by_length = triton.cdiv(triton.cdiv(max_len, block_n), MIN_BLOCKS_PER_SPLIT)
    return max(1, min(triton.cdiv(2 * sms, programs), by_length, MAX_SPLITS))


def _check_low(fmt: PageFormat, fmt_low: PageFormat | None, len_low, cache_dtype, for_triton: bool) -> bool:
    """Validates the optional low section; True when there is one."""
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
                               scale, max_len=None, fmt_low=None, len_low=None, logits_out=None, lse_out=None):
    """Vectorized torch: gather + dequantize both sections -> [B, Hkv, n, D], mask by length, GQA attention
    in fp32."""
    check_supported(fmt, cache_dtype)
    has_low = _check_low(fmt, fmt_low, len_low, cache_dtype, False)
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
    scores = (qg @ keys.transpose(-1, -2)) * scale  # [B, Hkv, G, n]
    scores = scores.masked_fill(~valid[:, :, None, :], float("-inf"))
    if logits_out is not None:
        bi, hi, ji = valid.nonzero(as_tuple=True)
        logits_out.unflatten(1, (Hkv, group))[bi, hi, :, index[bi, hi, ji]] = scores[bi, hi, :, ji]
    if lse_out is not None:
        lse_out.copy_(torch.logsumexp(scores, -1).view(B, Hq))  # no token: -inf
    empty = (lens + lens_lo == 0)[:, :, None, None]
    probs = scores.softmax(-1).masked_fill(empty, 0.0)  # all -inf -> NaN -> 0
    return (probs @ vals).view(B, Hq, D).to(q.dtype)


def paged_decode_attention_triton(q, pool, fmt: PageFormat, cache_dtype, page_table, lengths, slots, layer,
                                  scale, num_splits=None, max_len=None, block_n=None, out=None,
                                  fmt_low=None, len_low=None, logits_out=None, lse_out=None,
                                  num_warps=None, num_stages=None):
    check_supported(fmt, cache_dtype, for_triton=True)
    has_low = _check_low(fmt, fmt_low, len_low, cache_dtype, True)
    B, Hq, D = q.shape
    Hkv, T = page_table.shape[2], fmt.tokens
    assert Hq % Hkv == 0 and D == fmt.head_dim and q.stride(2) == 1 and page_table.stride(3) == 1
    out = torch.empty_like(q) if out is None else out
    assert out.shape == q.shape and out.stride(2) == 1
    if logits_out is not None:
        assert logits_out.dtype == torch.float32 and logits_out.shape[:2] == (B, Hq) and logits_out.stride(2) == 1
    if lse_out is not None:
        assert lse_out.dtype == torch.float32 and lse_out.shape == (B, Hq)
    if B == 0:
        return out
    pc = pool.view(cache_dtype)
    tuned_n, tuned_warps, tuned_stages = launch_config(fmt, fmt_low if has_low else None)
    block_n = block_n or tuned_n
    if max_len is None:  # capacity bound: needs no device sync
        max_len = page_table.shape[3] * max(T, fmt_low.tokens if has_low else 0)
    if num_splits is None:
        num_splits = choose_num_splits(B, Hkv, max_len, q.device, block_n)
    group = Hq // Hkv
    BLOCK_D = max(16, next_pow2(D))
    if num_splits > 1:
        mid_acc = torch.empty(B, Hq, num_splits, D, dtype=torch.float32, device=q.device)
        mid_ml = torch.empty(B, Hq, num_splits, 2, dtype=torch.float32, device=q.device)
    else:
        mid_acc = mid_ml = out  # unused
    low = fmt_low if has_low else fmt
    lenlo = len_low if has_low else lengths
    logits = logits_out if logits_out is not None else out  # unused when absent
    lse = lse_out if lse_out is not None else out
    _decode_split_kernel[(B, Hkv, num_splits)](
        q, pc, pool, pool.view(torch.float16), page_table, lengths, lenlo, slots, out, mid_acc, mid_ml,
        logits, lse,
        q.stride(0), q.stride(1), out.stride(0), out.stride(1),
        page_table.stride(0), page_table.stride(1), page_table.stride(2),
        lengths.stride(0), lengths.stride(1), lengths.stride(2),
        lenlo.stride(0), lenlo.stride(1), lenlo.stride(2), logits.stride(0), logits.stride(1),
        lse.stride(0), lse.stride(1),
        layer, scale * LOG2E, scale, Hq, D, page_table.shape[3] - 2,
        fmt.page_bytes // fmt.full_itemsize, fmt.page_bytes,
        *seg_offsets(fmt, "k"), *seg_offsets(fmt, "v"), *seg_offsets(low, "k"), *seg_offsets(low, "v"),
        GROUP=group, T=T, NUM_SPLITS=num_splits,
        BLOCK_G=max(16, next_pow2(group)), BLOCK_N=block_n, BLOCK_D=BLOCK_D,
        DOT_FP32=dot_in_fp32(q, pool) or q.dtype == torch.float32 or cache_dtype == torch.float32,
        KB=fmt.key_bits, VB=fmt.value_bits,
        HAS_LOW=has_low, KB_LO=low.key_bits, VB_LO=low.value_bits, T_LO=low.tokens if has_low else 1,
        WRITE_LOGITS=logits_out is not None, WRITE_LSE=lse_out is not None,
        num_warps=num_warps or tuned_warps, num_stages=num_stages or tuned_stages,
    )
    if num_splits > 1:
        _decode_reduce_kernel[(B, Hq)](
            mid_acc, mid_ml, out, out.stride(0), out.stride(1), Hq, D,
            NUM_SPLITS=num_splits, BLOCK_S=next_pow2(num_splits), BLOCK_D=BLOCK_D,
            lse_ptr=lse, stride_eb=lse.stride(0), stride_eh=lse.stride(1), WRITE_LSE=lse_out is not None,
            num_warps=4,
        )
    return out


def paged_decode_attention(q, pool, fmt: PageFormat, cache_dtype, page_table, lengths, slots, layer: int,
                           scale: float | None = None, num_splits: int | None = None, impl: str = "auto",
                           max_len: int | None = None, out: torch.Tensor | None = None,
                           fmt_low: PageFormat | None = None, len_low: torch.Tensor | None = None,
                           logits_out: torch.Tensor | None = None, lse_out: torch.Tensor | None = None):
    """Attention of one new token per sequence over its paged KV cache; returns [B, Hq, D] in q's dtype.

    q [B, Hq, D]; page_table int32 [S, L, Hkv, P + 1] (column P: trash, never read); slots int32 [B] picks rows
    of page_table/lengths. Per (slot, layer, KV head) the cache has
      - a HIGH section of lengths[s, l, h] tokens (int32 [S, L, Hkv], counting the new token) in format `fmt`:
        token j in page page_table[s, l, h, j // fmt.tokens], row j % fmt.tokens;
      - optionally a LOW section of len_low[s, l, h] tokens in format `fmt_low` (both must be given):
        token j in page page_table[s, l, h, P - 1 - j // fmt_low.tokens], row j % fmt_low.tokens.
    Any precision (16/8/4/2-bit keys and values) is dequantized on the fly. max_len: optional host-side upper
    bound on len_high + len_low of any head (sizes the splits without a device sync). Heads without tokens
    give zeros. out: optional preallocated [B, Hq, D] result.
    logits_out: optional f32 [B, Hq, NMAX] receiving each token's scaled logit q.k * scale at index j (high
    token j) or lengths + j (low token j); other entries untouched. lse_out: optional f32 [B, Hq] receiving
    the log-sum-exp of those logits (-inf for a head without tokens).
    """
    if scale is None:
        scale = 1.0 / math.sqrt(q.shape[-1])
    kw = dict(fmt_low=fmt_low, len_low=len_low, logits_out=logits_out, lse_out=lse_out)
    if use_triton(impl, q, pool, page_table, lengths, slots):
        return paged_decode_attention_triton(q, pool, fmt, cache_dtype, page_table, lengths, slots, layer,
                                             scale, num_splits=num_splits, max_len=max_len, out=out, **kw)
    res = paged_decode_attention_ref(q, pool, fmt, cache_dtype, page_table, lengths, slots, layer, scale,
                                     max_len=max_len, **kw)
    return res if out is None else out.copy_(res)
