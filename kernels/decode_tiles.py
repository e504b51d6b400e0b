"""Triton pieces the decode-attention kernels share (kernels/decode_attention*.py): a tile's scale/zero loads, its
row maxima with its top value scale, and the epilogue that writes a program's result (partial for a split, final
otherwise)."""
from __future__ import annotations

import triton
import triton.language as tl


def unpack_ptx(bits: int, plane: int, pairs: bool = False) -> str:
    """PTX for tl.inline_asm_elementwise(pack=4): four packed bytes ($2) -> plane `plane` of each as the fp16
    number 1024 + c * 2^s (s = plane * bits, c the code), two per output register ($0, $1). prmt puts each byte
    under an 0x64 exponent byte (0x64XX is the fp16 number 1024 + XX) and a mask keeps the plane's bits: one or
    two instructions per two codes, against ~5 per code for shift / and / convert, which made quantized decode
    instruction-bound. The dots take these biased codes as they are; decode_attention._attend_section removes the 1024 and the
    2^s with [G, N]-sized corrections (a dot's accumulator init and one multiply).
    pairs: for pack=2 on uint16 elements (two bytes each) with two outputs: the low bytes' codes ($0) and the
    high bytes' ($1), i.e. bytes (0, 2) and (1, 3) of the register."""
    s = plane * bits
    keep = 0xFF00 | (((1 << bits) - 1) << s)
    lo, hi = ("0x4240", "0x4341") if pairs else ("0x4140", "0x4342")
    lines = ["{", ".reg .b32 r_m, r_k;", "mov.b32 r_m, 0x64646464;",
             f"prmt.b32 $0, $2, r_m, {lo};", f"prmt.b32 $1, $2, r_m, {hi};"]
    if keep != 0xFFFF:
        lines += [f"mov.b32 r_k, {keep << 16 | keep:#010x};", "and.b32 $0, $0, r_k;", "and.b32 $1, $1, r_k;"]
    return "\n".join(lines + ["}"])


_PAIRS_8_0 = tl.constexpr(unpack_ptx(8, 0, True))
_PAIRS_4_0, _PAIRS_4_1 = tl.constexpr(unpack_ptx(4, 0, True)), tl.constexpr(unpack_ptx(4, 1, True))
_PAIRS_2_0, _PAIRS_2_1 = tl.constexpr(unpack_ptx(2, 0, True)), tl.constexpr(unpack_ptx(2, 1, True))
_PAIRS_2_2, _PAIRS_2_3 = tl.constexpr(unpack_ptx(2, 2, True)), tl.constexpr(unpack_ptx(2, 3, True))


@triton.jit
def pair_codes(chunk, p: tl.constexpr, BITS: tl.constexpr, DOT_FP32: tl.constexpr):
    """Plane p of uint16 byte pairs [N, E] (bytes 2e, 2e + 1 of a row's chunk) as two dot operands [N, E]: the
    codes of the low bytes (even dims) and of the high bytes (odd dims), biased as decode_attention._operand's."""
    if DOT_FP32:
        x = chunk.to(tl.int32)
        m: tl.constexpr = ((1 << BITS) - 1) << (p * BITS)
        return (x & m).to(tl.float32), ((x >> 8) & m).to(tl.float32)
    else:
        if BITS == 8:
            asm: tl.constexpr = _PAIRS_8_0
        elif BITS == 4:
            asm: tl.constexpr = _PAIRS_4_0 if p == 0 else _PAIRS_4_1
        else:
            asm: tl.constexpr = _PAIRS_2_0 if p == 0 else (_PAIRS_2_1 if p == 1 else (_PAIRS_2_2 if p == 2 else
                                                                                       _PAIRS_2_3))
        return tl.inline_asm_elementwise(asm, "=r,=r,r", [chunk], dtype=(tl.float16, tl.float16), is_pure=True,
                                         pack=2)


@triton.jit
def pad_rows(x):
    """[R, C] -> [2R, C], the added rows zero. (Broadcast and where, not tl.join: a join halves the kWidth
    Triton picks for the dot operands, which brings back the register moves the padding is for.)"""
    R: tl.constexpr = x.shape[0]
    y = tl.reshape(tl.broadcast_to(x[None, :, :], (2, R, x.shape[1])), (2 * R, x.shape[1]))
    return tl.where((tl.arange(0, 2 * R) < R)[:, None], y, tl.zeros_like(y))


@triton.jit
def top_rows(y):
    """The first half of y's rows (inverse of pad_rows; in registers: the mma layout keeps rows r and r + 8
    in one thread)."""
    R: tl.constexpr = y.shape[0] // 2
    top, _ = tl.split(tl.permute(tl.reshape(y, (2, R, y.shape[1])), (1, 2, 0)))
    return top


@triton.jit
def even_odd(x):
    """[R, C] -> its even columns and its odd columns, [R, C / 2] each."""
    return tl.split(tl.reshape(x, (x.shape[0], x.shape[1] // 2, 2)))


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
