"""Triton pieces the decode-attention kernels share (f16.py, q8.py, quartered.py): each program's prologue (its
batch entry, KV head, split and token range; its query group's rows), the PTX that turns packed codes into fp16
dot operands (planes_ptx, plane_codes, pair_planes), the row padding and even / odd splits of the key-pair dots,
a tile's scale/zero loads, its row maxima with its top value scale, and the epilogue that writes a program's
result (partial for a split, final otherwise)."""
from __future__ import annotations

import triton
import triton.language as tl

from diffkv_serve.kernels.sections import split_range

LOG2E = 1.4426950408889634  # the kernels' softmax runs in the log2 domain (exp2): logits are scaled by it


@triton.jit
def program_span(slots_ptr, len_ptr, pt_ptr, stride_pts, stride_ptl, stride_pth, stride_ls, stride_ll, stride_lh,
                 layer, num_splits, BLOCK_N: tl.constexpr):
    """What program (b, h, split) of the (batch entry, KV head, split) grid reads: returns b, h, split, the
    cache slot, the high section's length, the page-table row and the split's tokens [lo, hi) of that section,
    in whole BLOCK_N blocks. Lengths differ per (sequence, head); the split count is a runtime value, so one
    compiled variant serves every sequence length."""
    b, h, split = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    slot = tl.load(slots_ptr + b).to(tl.int64)
    length = tl.load(len_ptr + slot * stride_ls + layer * stride_ll + h * stride_lh)
    pt_row = pt_ptr + slot * stride_pts + layer * stride_ptl + h * stride_pth
    lo, hi = split_range(length, split, num_splits, BLOCK_N)
    return b, h, split, slot, length, pt_row, lo, hi


@triton.jit
def group_rows(h, GROUP: tl.constexpr, BLOCK_G: tl.constexpr):
    """The query-group tile of KV head h: row indices g [BLOCK_G], their query heads and which rows are real
    (BLOCK_G pads the group to the dot's minimum rows)."""
    g = tl.arange(0, BLOCK_G)
    return g, h * GROUP + g, g < GROUP


@triton.jit
def natural_lse(m, l):
    """The natural-log log-sum-exp of a softmax kept as log2-domain max m and sum l; -inf without tokens."""
    return tl.where(l > 0, (m + tl.log2(tl.where(l > 0, l, 1.0))) * 0.6931471805599453, float("-inf"))


def planes_ptx(bits: int, pairs: bool = False) -> str:
    """PTX for tl.inline_asm_elementwise: the 8 // bits planes of packed bytes in one go, plane p's codes c (bits
    p*bits..p*bits+bits-1 of each byte) as the fp16 numbers 1024 + c * 2^(p * bits). An 0x64 exponent byte above
    a byte XX makes the fp16 number 1024 + XX (0x64XX); a mask keeps the plane's bits: one or two instructions
    per two codes, against ~5 per code for shift / and / convert, which made quantized decode instruction-bound.
    The dots take these biased codes as they are; quartered._attend_section removes the 1024 and the 2^s
    with [G, N]-sized corrections (a dot's accumulator init and one multiply).

    pairs False (pack=4 on bytes): outputs $2p, $2p+1 hold plane p of bytes (0, 1) and (2, 3): two prmt put the
    bytes under 0x64, then one and per plane and output.
    pairs True (pack=2 on uint16 byte pairs, one register: bytes 0 and 2 are the low bytes): outputs $2p (low
    bytes: even dims) and $2p+1 (high bytes: odd dims) of plane p. Below 8 bits the low bytes need no move: one
    lop3 (x & mask) | 0x64006400 each (K4V2: 911 -> 887 SASS per one-warp tile, benchmarks/decode_sass.py); at
    8 bits a prmt (a lop3 needs its two constants in registers there, which cost as many moves). The high bytes
    take one prmt shared by the planes, then one and per plane. (ptxas already shares a prmt that separate asm
    blocks repeat on one register, so one block for all planes changes nothing else.)"""
    n = 8 // bits
    src = f"${2 * n}"
    lines = ["{", ".reg .b32 r_m, r_lo, r_hi, r_k, r_z;", "mov.b32 r_m, 0x64646464;"]
    if pairs:
        lines += ["mov.b32 r_z, 0x64006400;", f"prmt.b32 r_hi, {src}, r_m, 0x4341;"]
    else:
        lines += [f"prmt.b32 r_lo, {src}, r_m, 0x4140;", f"prmt.b32 r_hi, {src}, r_m, 0x4342;"]
    for p in range(n):
        bitsmask = ((1 << bits) - 1) << (p * bits)
        keep = 0xFF00 | bitsmask
        if pairs and bits == 8:
            lines.append(f"prmt.b32 ${2 * p}, {src}, r_m, 0x4240;")
        elif pairs:
            lines += [f"mov.b32 r_k, {bitsmask << 16 | bitsmask:#010x};", f"lop3.b32 ${2 * p}, {src}, r_k, r_z, 0xEA;"]
        else:
            lines.append(f"mov.b32 ${2 * p}, r_lo;" if keep == 0xFFFF else
                         f"mov.b32 r_k, {keep << 16 | keep:#010x};\nand.b32 ${2 * p}, r_lo, r_k;")
        lines.append(f"mov.b32 ${2 * p + 1}, r_hi;" if keep == 0xFFFF else
                     f"mov.b32 r_k, {keep << 16 | keep:#010x};\nand.b32 ${2 * p + 1}, r_hi, r_k;")
    return "\n".join(lines + ["}"])


def _constraints(planes: int) -> str:
    return ",".join(["=r"] * (2 * planes) + ["r"])


_PLANES_8, _PLANES_4, _PLANES_2 = (tl.constexpr(planes_ptx(b)) for b in (8, 4, 2))
_PAIRS_8, _PAIRS_4, _PAIRS_2 = (tl.constexpr(planes_ptx(b, True)) for b in (8, 4, 2))
_OUT_8, _OUT_4, _OUT_2 = (tl.constexpr(_constraints(8 // b)) for b in (8, 4, 2))  # two output registers a plane


@triton.jit
def _masked_planes(x, BITS: tl.constexpr):
    """The fp32 (interpreter) form of planes_ptx: plane p of integer codes x as c * 2^(p * BITS), no bias."""
    if BITS == 8:
        return (x.to(tl.float32),)
    elif BITS == 4:
        return (x & 0x0F).to(tl.float32), (x & 0xF0).to(tl.float32)
    else:
        return ((x & 0x03).to(tl.float32), (x & 0x0C).to(tl.float32), (x & 0x30).to(tl.float32),
                (x & 0xC0).to(tl.float32))


@triton.jit
def _asm_planes(chunk, BITS: tl.constexpr, PAIRS: tl.constexpr, PURE: tl.constexpr):
    """planes_ptx(BITS, PAIRS) on the GPU: one fp16 tensor per output (two per plane with PAIRS, one without)."""
    N: tl.constexpr = (2 if PAIRS else 1) * (8 // BITS)
    if BITS == 8:
        asm: tl.constexpr = _PAIRS_8 if PAIRS else _PLANES_8
        out: tl.constexpr = _OUT_8
    elif BITS == 4:
        asm: tl.constexpr = _PAIRS_4 if PAIRS else _PLANES_4
        out: tl.constexpr = _OUT_4
    else:
        asm: tl.constexpr = _PAIRS_2 if PAIRS else _PLANES_2
        out: tl.constexpr = _OUT_2
    return tl.inline_asm_elementwise(asm, out, [chunk], dtype=(tl.float16,) * N, is_pure=PURE,
                                     pack=2 if PAIRS else 4)


@triton.jit
def plane_codes(chunk, BITS: tl.constexpr, DOT_FP32: tl.constexpr, PURE: tl.constexpr):
    """Every plane of packed bytes [N, C] (uint8) as a dot operand [N, C], biased as planes_ptx says (fp32 and
    unbiased with DOT_FP32): a tuple of 8 // BITS. PURE lets the compiler schedule the unpacking freely, also
    after the shared-memory transpose that feeds a value dot (which then reads single bytes); not pure keeps it
    before (ldmatrix.trans on fp16 pairs)."""
    if DOT_FP32:
        return _masked_planes(chunk.to(tl.int32), BITS)
    else:
        return _asm_planes(chunk, BITS, False, PURE)


@triton.jit
def pair_planes(chunk, BITS: tl.constexpr, DOT_FP32: tl.constexpr):
    """Every plane of uint16 byte pairs [N, E] (bytes 2e, 2e + 1 of a row's chunk) as two dot operands [N, E]:
    the codes of the low bytes (even dims) and of the high bytes (odd dims). A tuple (even 0, odd 0, even 1,
    odd 1, ...) of 2 * (8 // BITS), biased as planes_ptx says (fp32 and unbiased with DOT_FP32)."""
    if DOT_FP32:
        x = chunk.to(tl.int32)
        lo = _masked_planes(x & 0xFF, BITS)
        hi = _masked_planes(x >> 8, BITS)
        if BITS == 8:
            return lo[0], hi[0]
        elif BITS == 4:
            return lo[0], hi[0], lo[1], hi[1]
        else:
            return lo[0], hi[0], lo[1], hi[1], lo[2], hi[2], lo[3], hi[3]
    else:
        return _asm_planes(chunk, BITS, True, True)


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
            tl.store(lse_ptr + b * stride_eb + hq * stride_eh, natural_lse(m_i, l_i), mask=gmask)
