"""Move tokens between page rows, possibly changing their precision (DiffKV demotion, e.g. K8V4 -> K4V2).

Per side (keys, values): equal bits copy the row bytes (+ its fp16 scale/zero) exactly; different bits
dequantize the source row and re-quantize it in the destination precision (diffkv_serve/kernels/quant.py). Score and
position always move along unchanged. e4m3 sides (PageFormat.float8) are copied only, to e4m3 sides.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from diffkv_serve.kernels._common import check_supported, next_pow2, pool_views, seg_offsets, use_triton
from diffkv_serve.kernels.page_layout import PageFormat
from diffkv_serve.kernels.quant import load_tile, quantize_tile, read_rows_ref, write_rows_ref

BLOCK_M = 16


@triton.jit
def _move_side(pool_c, pool_u8, pool_h, sp, sr, dp, dr, ok, d, page_elems, page_bytes,
               s_off, s_meta, d_off, d_meta, D,
               SB: tl.constexpr, DB: tl.constexpr, ISZ: tl.constexpr,
               BLOCK_M: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_B: tl.constexpr):
    """One side (keys or values) of BLOCK_M rows: source bits SB -> destination bits DB.

    16-bit offsets are in cache-dtype elements; quantized ones in bytes (data) and fp16 units (meta).
    """
    if SB == DB:
        # Same precision: copy the row bytes exactly (and the 4-byte meta row).
        j = tl.arange(0, BLOCK_B)
        if SB == 16:
            nb = D * ISZ
            src = (sp * page_bytes + s_off * ISZ + sr * nb)[:, None] + j[None, :]
            dst = (dp * page_bytes + d_off * ISZ + dr * nb)[:, None] + j[None, :]
        else:
            nb = D * SB // 8
            src = (sp * page_bytes + s_off + sr * nb)[:, None] + j[None, :]
            dst = (dp * page_bytes + d_off + dr * nb)[:, None] + j[None, :]
        m2 = ok[:, None] & (j[None, :] < nb)
        tl.store(pool_u8 + dst, tl.load(pool_u8 + src, mask=m2), mask=m2)
        if SB != 16:
            for i in tl.static_range(2):
                meta = tl.load(pool_h + sp * (page_bytes // 2) + s_meta + sr * 2 + i, mask=ok)
                tl.store(pool_h + dp * (page_bytes // 2) + d_meta + dr * 2 + i, meta, mask=ok)
    else:
        # Different precision: dequantize [BLOCK_M, D] to float32, then store in the destination precision.
        m2 = ok[:, None] & (d[None, :] < D)
        x = load_tile(pool_c, pool_u8, pool_h, sp, sr, ok, d, d < D, page_elems, page_bytes, s_off, s_meta, D,
                      SB, BLOCK_M, BLOCK_D).to(tl.float32)
        if DB == 16:
            tl.store(pool_c + d_off + (dp * page_elems + dr * D)[:, None] + d[None, :],
                     x.to(pool_c.dtype.element_ty), mask=m2)
        else:
            packed, scale, zero = quantize_tile(x, DB, BLOCK_M, BLOCK_D)
            DRB: tl.constexpr = BLOCK_D * DB // 8
            jd = tl.arange(0, DRB)
            tl.store(pool_u8 + (dp * page_bytes + d_off + dr * DRB)[:, None] + jd[None, :], packed.to(tl.uint8),
                     mask=ok[:, None])
            meta = dp * (page_bytes // 2) + d_meta + dr * 2
            tl.store(pool_h + meta, scale, mask=ok)
            tl.store(pool_h + meta + 1, zero, mask=ok)


@triton.jit
def move_rows(pool_c, pool_u8, pool_h, pool_i32, sp, sr, dp, dr, ok, d, page_elems, page_bytes,
              sk_off, sk_meta, sv_off, sv_meta, dk_off, dk_meta, dv_off, dv_meta, s_score, s_pos, d_score, d_pos, D,
              SKB: tl.constexpr, SVB: tl.constexpr, DKB: tl.constexpr, DVB: tl.constexpr, ISZ: tl.constexpr,
              BLOCK_M: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_B: tl.constexpr, TRACKED: tl.constexpr = True):
    """Token rows (sp, sr) -> (dp, dr) where ok (BLOCK_M of them; pages int64): keys and values (re-quantized where
    the bits differ), then, where the destination is TRACKED, score and position (offsets in 4-byte words)."""
    _move_side(pool_c, pool_u8, pool_h, sp, sr, dp, dr, ok, d, page_elems, page_bytes,
               sk_off, sk_meta, dk_off, dk_meta, D, SKB, DKB, ISZ, BLOCK_M, BLOCK_D, BLOCK_B)
    _move_side(pool_c, pool_u8, pool_h, sp, sr, dp, dr, ok, d, page_elems, page_bytes,
               sv_off, sv_meta, dv_off, dv_meta, D, SVB, DVB, ISZ, BLOCK_M, BLOCK_D, BLOCK_B)
    if TRACKED:
        words = page_bytes // 4
        tl.store(pool_i32 + dp * words + d_score + dr, tl.load(pool_i32 + sp * words + s_score + sr, mask=ok),
                 mask=ok)
        tl.store(pool_i32 + dp * words + d_pos + dr, tl.load(pool_i32 + sp * words + s_pos + sr, mask=ok), mask=ok)


@triton.jit
def _move_kernel(
    pool_c, pool_u8, pool_h, pool_i32, src_page_ptr, src_row_ptr, dst_page_ptr, dst_row_ptr, M, D,
    page_elems, page_bytes,
    sk_off, sk_meta, sv_off, sv_meta, dk_off, dk_meta, dv_off, dv_meta,
    s_score, s_pos, d_score, d_pos,  # in 4-byte words
    SKB: tl.constexpr, SVB: tl.constexpr, DKB: tl.constexpr, DVB: tl.constexpr, ISZ: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_B: tl.constexpr, TRACKED: tl.constexpr,
):
    m = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    mmask = m < M
    sp = tl.load(src_page_ptr + m, mask=mmask, other=-1)
    dp = tl.load(dst_page_ptr + m, mask=mmask, other=-1)
    ok = (sp >= 0) & (dp >= 0)
    sp = tl.where(ok, sp, 0).to(tl.int64)
    dp = tl.where(ok, dp, 0).to(tl.int64)
    sr = tl.load(src_row_ptr + m, mask=ok, other=0)
    dr = tl.load(dst_row_ptr + m, mask=ok, other=0)
    move_rows(pool_c, pool_u8, pool_h, pool_i32, sp, sr, dp, dr, ok, tl.arange(0, BLOCK_D), page_elems, page_bytes,
              sk_off, sk_meta, sv_off, sv_meta, dk_off, dk_meta, dv_off, dv_meta, s_score, s_pos, d_score, d_pos, D,
              SKB, SVB, DKB, DVB, ISZ, BLOCK_M, BLOCK_D, BLOCK_B, TRACKED)


def _check(fmt_src: PageFormat, fmt_dst: PageFormat, cache_dtype, for_triton: bool) -> None:
    # Triton's re-quantization unpacks/packs by reshapes: only needed where a side changes precision.
    requant = fmt_src.key_bits != fmt_dst.key_bits or fmt_src.value_bits != fmt_dst.value_bits
    check_supported(fmt_src, cache_dtype, for_triton and requant)
    check_supported(fmt_dst, cache_dtype, for_triton and requant)
    if (fmt_src.page_bytes, fmt_src.head_dim) != (fmt_dst.page_bytes, fmt_dst.head_dim):
        raise ValueError(f"{fmt_src.name} and {fmt_dst.name} must share page_bytes and head_dim")
    if fmt_dst.tracked and not fmt_src.tracked:
        raise ValueError(f"{fmt_src.name} -> {fmt_dst.name}: untracked rows have no score or position to carry")
    for which, sb, db in (("k", fmt_src.key_bits, fmt_dst.key_bits), ("v", fmt_src.value_bits, fmt_dst.value_bits)):
        f8 = (fmt_src.side_float8(which), fmt_dst.side_float8(which))
        if any(f8) and (sb, f8[0]) != (db, f8[1]):  # equal bits alone would copy e4m3 bytes as integer codes
            raise ValueError(f"{fmt_src.name} -> {fmt_dst.name}: e4m3 rows move only to e4m3 rows (no re-quantization)")


def move_tokens_ref(pool, fmt_src: PageFormat, fmt_dst: PageFormat, cache_dtype, src_page, src_row, dst_page,
                    dst_row):
    _check(fmt_src, fmt_dst, cache_dtype, False)
    ok = (src_page >= 0) & (dst_page >= 0)
    sp, sr, dp, dr = (x[ok].long() for x in (src_page, src_row, dst_page, dst_row))
    if sp.numel() == 0:
        return
    D = fmt_src.head_dim
    for which, sb, db in (("k", fmt_src.key_bits, fmt_dst.key_bits), ("v", fmt_src.value_bits, fmt_dst.value_bits)):
        if sb == db:  # exact bytes: data row, then the 4-byte meta row
            s_off, d_off = (fmt_src.k_off, fmt_dst.k_off) if which == "k" else (fmt_src.v_off, fmt_dst.v_off)
            nb = D * fmt_src.full_itemsize if sb == 16 else D * sb // 8
            segs = [(s_off, d_off, nb)]
            if sb != 16:
                segs.append((fmt_src.k_meta_off, fmt_dst.k_meta_off, 4) if which == "k"
                            else (fmt_src.v_meta_off, fmt_dst.v_meta_off, 4))
            for so, do, w in segs:
                j = torch.arange(w, device=pool.device)
                pool[dp[:, None], (do + dr * w)[:, None] + j] = pool[sp[:, None], (so + sr * w)[:, None] + j]
        else:
            x = read_rows_ref(pool, fmt_src, cache_dtype, which, sp, sr)
            write_rows_ref(pool, fmt_dst, cache_dtype, which, dp, dr, x)
    if not fmt_dst.tracked:  # no score or position rows to write
        return
    pi = pool.view(torch.int32)
    for so, do in ((fmt_src.score_off, fmt_dst.score_off), (fmt_src.pos_off, fmt_dst.pos_off)):
        pi[dp, do // 4 + dr] = pi[sp, so // 4 + sr]


def move_tokens_triton(pool, fmt_src: PageFormat, fmt_dst: PageFormat, cache_dtype, src_page, src_row, dst_page,
                       dst_row):
    _check(fmt_src, fmt_dst, cache_dtype, True)
    M = src_page.numel()
    if M == 0:
        return
    assert all(x.is_contiguous() for x in (src_page, src_row, dst_page, dst_row))
    pc, pi, _ = pool_views(pool, cache_dtype)
    D, isz = fmt_src.head_dim, fmt_src.full_itemsize
    row_bytes = [D * isz if b == 16 else D * b // 8 for b in (fmt_src.key_bits, fmt_src.value_bits)]
    _move_kernel[(triton.cdiv(M, BLOCK_M),)](
        pc, pool, pool.view(torch.float16), pi, src_page, src_row, dst_page, dst_row, M, D,
        fmt_src.page_bytes // isz, fmt_src.page_bytes,
        *seg_offsets(fmt_src, "k"), *seg_offsets(fmt_src, "v"), *seg_offsets(fmt_dst, "k"),
        *seg_offsets(fmt_dst, "v"),
        *fmt_src.tracked_words(), *fmt_dst.tracked_words(), TRACKED=fmt_dst.tracked,
        SKB=fmt_src.key_bits, SVB=fmt_src.value_bits, DKB=fmt_dst.key_bits, DVB=fmt_dst.value_bits, ISZ=isz,
        BLOCK_M=BLOCK_M, BLOCK_D=next_pow2(D), BLOCK_B=next_pow2(max(row_bytes)),
        num_warps=4, enable_fp_fusion=False,  # dequantize as torch does (no FMA): bit-identical re-quantization
    )


def move_tokens(pool, fmt_src: PageFormat, fmt_dst: PageFormat, cache_dtype, src_page, src_row, dst_page,
                dst_row, impl: str = "auto"):
    """Copy token rows (K, V, their scale/zero, and where fmt_dst is tracked score and position) from
    (src_page[m], src_row[m]) in format fmt_src to (dst_page[m], dst_row[m]) in format fmt_dst; all int32 [M];
    rows with a negative page skipped.

    A side (keys or values) with equal bits in both formats is copied byte for byte (so fmt_src == fmt_dst is
    an exact copy); otherwise it is dequantized and re-quantized. No row may be both read and written.
    """
    fn = move_tokens_triton if use_triton(impl, pool, src_page, dst_page) else move_tokens_ref
    fn(pool, fmt_src, fmt_dst, cache_dtype, src_page, src_row, dst_page, dst_row)
