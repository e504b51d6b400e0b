"""Decode attention over 16-bit pages only (kv_mode fp16, or a diffkv cache whose sections are all 16-bit):
the full head dimension in one tile per token block, so the tensor cores read keys and values straight from
shared memory (cp.async pipelining, ldmatrix), which is what reaches the HBM roofline on an H200.

dispatch.py sends 16-bit-only calls here because the quartered kernel's tiles (needed to unpack quantized rows
without a reshape) cost ~10-40% on 16-bit pages (benchmarks/results/decode_kernel_variants_H200.json). Same grid
and partial-result layout as the other kernels; merge.py combines the splits.
"""
from __future__ import annotations

import triton
import triton.language as tl

from diffkv_serve.kernels._common import next_pow2, seg_offsets
from diffkv_serve.kernels.decode_attention.tiles import LOG2E, group_rows, program_span, store_result
from diffkv_serve.kernels.sections import section_page


@triton.jit(do_not_specialize=["num_splits"])  # one variant whatever the split count
def decode_f16_kernel(
    q_ptr, pool_c, pt_ptr, len_ptr, slots_ptr, o_ptr, mid_acc, mid_ml, logits_ptr, lse_ptr,
    stride_qb, stride_qh, stride_ob, stride_oh, stride_pts, stride_ptl, stride_pth, stride_ls, stride_ll, stride_lh,
    stride_gb, stride_gh, stride_eb, stride_eh,
    layer, qk_scale, sm_scale, Hq, D, num_splits, page_elems, k_off, v_off,
    GROUP: tl.constexpr, T: tl.constexpr, SPLIT: tl.constexpr, BLOCK_G: tl.constexpr, BLOCK_N: tl.constexpr,
    BLOCK_D: tl.constexpr, DOT_FP32: tl.constexpr, WRITE_LOGITS: tl.constexpr, WRITE_LSE: tl.constexpr,
):
    b, h, split, slot, length, pt_row, lo, hi = program_span(
        slots_ptr, len_ptr, pt_ptr, stride_pts, stride_ptl, stride_pth, stride_ls, stride_ll, stride_lh, layer,
        num_splits, BLOCK_N)
    _, hq, gmask = group_rows(h, GROUP, BLOCK_G)
    d = tl.arange(0, BLOCK_D)
    dmask = d < D
    DT = pool_c.dtype.element_ty
    q = tl.load(q_ptr + b * stride_qb + hq[:, None] * stride_qh + d[None, :], mask=gmask[:, None] & dmask[None, :],
                other=0.0)
    q = q.to(tl.float32) if DOT_FP32 else q.to(DT)
    logit_rows = logits_ptr + b * stride_gb + hq * stride_gh
    m_i = tl.full([BLOCK_G], -1.0e30, tl.float32)  # finite, so empty splits merge without NaN
    l_i = tl.zeros([BLOCK_G], tl.float32)
    acc = tl.zeros([BLOCK_G, BLOCK_D], tl.float32)
    for t0 in range(lo, hi, BLOCK_N):
        t = t0 + tl.arange(0, BLOCK_N)
        tmask = t < hi
        page = section_page(pt_row, 0, t, tmask, T, False)
        rows = (page * page_elems + (t % T) * D)[:, None] + d[None, :]
        kv_mask = tmask[:, None] & dmask[None, :]
        k = tl.load(pool_c + k_off + rows, mask=kv_mask, other=0.0)
        if DOT_FP32:
            s = tl.dot(q, tl.trans(k.to(tl.float32)), input_precision="ieee")
        else:
            s = tl.dot(q, tl.trans(k))
        if WRITE_LOGITS:
            tl.store(logit_rows[:, None] + t[None, :], s * sm_scale, mask=gmask[:, None] & tmask[None, :])
        s = tl.where(tmask[None, :], s * qk_scale, float("-inf"))  # log2 domain: exp2 below
        m_new = tl.maximum(m_i, tl.max(s, 1))
        p = tl.exp2(s - m_new[:, None])
        alpha = tl.exp2(m_i - m_new)
        l_i = l_i * alpha + tl.sum(p, 1)
        v = tl.load(pool_c + v_off + rows, mask=kv_mask, other=0.0)
        if DOT_FP32:
            acc = acc * alpha[:, None] + tl.dot(p, v.to(tl.float32), input_precision="ieee")
        else:
            acc = tl.dot(p.to(DT), v, acc * alpha[:, None])
        m_i = m_new

    store_result(acc, m_i, l_i, b, hq, gmask, gmask[:, None] & dmask[None, :], d, split, num_splits, Hq, o_ptr,
                 stride_ob, stride_oh, mid_acc, mid_ml, lse_ptr, stride_eb, stride_eh, D, SPLIT, WRITE_LSE)


def launch_f16(q, pc, page_table, lengths, slots, out, mid_acc, mid_ml, logits, lse, layer, scale, num_splits, fmt,
               block_n, dot_fp32, cfg, warps, stages, write_logits, write_lse):
    """Launches decode_f16_kernel on the (batch, KV head, split) grid; pc is the pool viewed as the cache dtype."""
    (B, Hq, D), Hkv = q.shape, page_table.shape[2]
    group = Hq // Hkv
    decode_f16_kernel[(B, Hkv, num_splits)](
        q, pc, page_table, lengths, slots, out, mid_acc, mid_ml, logits, lse,
        q.stride(0), q.stride(1), out.stride(0), out.stride(1),
        page_table.stride(0), page_table.stride(1), page_table.stride(2),
        lengths.stride(0), lengths.stride(1), lengths.stride(2), logits.stride(0), logits.stride(1),
        lse.stride(0), lse.stride(1),
        layer, scale * LOG2E, scale, Hq, D, num_splits, fmt.page_bytes // fmt.full_itemsize,
        seg_offsets(fmt, "k")[0], seg_offsets(fmt, "v")[0],
        GROUP=group, T=fmt.tokens, SPLIT=num_splits > 1, BLOCK_G=max(cfg.min_rows, next_pow2(group)),
        BLOCK_N=block_n, BLOCK_D=max(16, next_pow2(D)), DOT_FP32=dot_fp32, WRITE_LOGITS=write_logits,
        WRITE_LSE=write_lse, num_warps=warps, num_stages=stages,
    )
