"""Triton pieces the decode-attention kernels share (kernels/decode_attention*.py): a tile's scale/zero loads, its
row maxima with its top value scale, and the epilogue that writes a program's result (partial for a split, final
otherwise)."""
from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def load_scale_zero(pool_w, page, row, tmask, page_words, meta_w):
    """(scale, zero) float32 [N] of rows `row` of pages `page`: one 4-byte word per token (fp16 scale in the low
    half), which cp.async can copy (it moves 4 bytes or more). Masked rows give 0, 0."""
    w = tl.load(pool_w + page * page_words + meta_w + row, mask=tmask, other=0)
    scale = w.to(tl.int16).to(tl.float16, bitcast=True).to(tl.float32)
    zero = (w >> 16).to(tl.int16).to(tl.float16, bitcast=True).to(tl.float32)
    return scale, zero


@triton.jit
def max_and_top_scale(s, vs, g, TOP_ROW: tl.constexpr):
    """Row maxima of the logits s [G, N] and the tile's largest value scale (vs [N]; 1 if all are 0). With TOP_ROW a
    padding row of s (>= 0), that row is overwritten by vs, so one cross-warp reduction gives both (rows are not
    split across warps: reading its max back is local); else two. Returns (s, row maxima, top scale)."""
    if TOP_ROW >= 0:
        s = tl.where(g[:, None] == TOP_ROW, vs[None, :], s)
    tile_max = tl.max(s, 1)
    if TOP_ROW >= 0:
        top = tl.max(tl.where(g == TOP_ROW, tile_max, 0.0), 0)
    else:
        top = tl.max(vs, 0)
    return s, tile_max, tl.where(top > 0, top, 1.0)


@triton.jit
def store_result(acc, m_i, l_i, b, hq, gmask, omask, d, split, num_splits, Hq, o_ptr, stride_ob, stride_oh,
                 mid_acc, mid_ml, lse_ptr, stride_eb, stride_eh, D, SPLIT: tl.constexpr, WRITE_LSE: tl.constexpr):
    """A full-width program's result: with splits the partial (acc, max, sum) for the merge kernel, else the
    normalized output (zeros for an empty head) and, if asked, the natural-log lse (-inf without tokens)."""
    if SPLIT:
        idx = (b * Hq + hq) * num_splits + split  # mid_* are contiguous [B, Hq, num_splits, ...]
        tl.store(mid_acc + idx[:, None] * D + d[None, :], acc, mask=omask)
        tl.store(mid_ml + idx * 2, m_i, mask=gmask)
        tl.store(mid_ml + idx * 2 + 1, l_i, mask=gmask)
    else:
        out = acc / tl.where(l_i > 0, l_i, 1.0)[:, None]
        tl.store(o_ptr + b * stride_ob + hq[:, None] * stride_oh + d[None, :], out.to(o_ptr.dtype.element_ty),
                 mask=omask)
        if WRITE_LSE:
            lse = tl.where(l_i > 0, (m_i + tl.log2(tl.where(l_i > 0, l_i, 1.0))) * 0.6931471805599453,
                           float("-inf"))
            tl.store(lse_ptr + b * stride_eb + hq * stride_eh, lse, mask=gmask)
