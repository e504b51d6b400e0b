"""DiffKV generation-phase significance: add each cached token's attention probability to its score.

For every cached token of every (batch entry b, KV head h) the score segment (f32) of its page row gets
    max over the query heads g of h's GQA group of exp(logits[b, g, idx] - lse[b, g])
where idx = j for high token j and len_high + j for low token j, and logits / lse come from
paged_decode_attention(..., logits_out=, lse_out=) of the same step. With `alpha_low_by_slot` (the decode
alpha_low of every slot) a slot whose alpha_low is 0 keeps its low section's scores as they are: such a sequence
never prunes a low token (diffkv_serve/kernels/compression_plan.py compares a low victim against alpha_low / N = 0),
so nothing reads them, and most of a long sequence's tokens are low. A pinned prompt token's score is +inf
(diffkv_serve/kernels/prompt_classify.py pin_significance) and stays +inf, so the rows of a prefix-cache page
that several sequences read keep the same value whoever updates them.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from diffkv_serve.kernels._common import next_pow2, num_sms, use_triton
from diffkv_serve.kernels.kv_write import KVWrite, write_kv, write_kv_launch, write_token
from diffkv_serve.kernels.page_layout import PageFormat
from diffkv_serve.kernels.sections import section_columns, section_page, split_range

MAX_SPLITS = 64
# Programs per SM the split count aims for. A program's loop is a chain of dependent loads (page id, then the
# score row) with little work per tile, so it is latency-bound: one program per (sequence, KV head), as at
# batch x KV heads >= SMs before, left ~1.5 programs per SM and made this update 10-16 us per layer at
# SmolLM2's shape (benchmarks/decode_splits.py --score-splits sweeps it).
TARGET_PROGRAMS_PER_SM = 16
# Tokens per loop iteration. Each iteration waits on its page ids, then on its score words, so the tile is what
# keeps loads in flight: 512-token tiles made the update 2.3x faster than 64 at the 8B shape after a mix decode
# call (H100, CUDA-graph us, .carry/gpu/score_bench.py: B=64 S=4096 45.9 -> 20.1, 2.5 TB/s on the logits and
# score bytes; B=8 7.4 -> 4.2; B=128 80.5 -> 43.9); 256 gave 24.6 at B=64, 8 warps or one stage no better.
BLOCK_N = 512
# Where the caller expects short sections (high_only: its sequences decode at alpha_low 0, so only the high
# section, mostly the recent window, is scored), programs take one warp and 128-token tiles: a program is then one
# tile's chain of loads, and more of them wait at once. H100, Qwen2.5-1.5B (28 x 2 heads, K8V4 / K4V4, a_h 64,
# 1,024 tokens): 100 us a step at batch 256 instead of 127 (92 instead of 95 at batch 128).
SHORT_BLOCK_N = 128


def choose_score_splits(batch: int, kv_heads: int, max_len: int, device: torch.device, block_n: int) -> int:
    """Splits per (sequence, KV head): about TARGET_PROGRAMS_PER_SM programs per SM, at least one BLOCK_N tile
    of max_len tokens per split, at most MAX_SPLITS."""
    wanted = triton.cdiv(TARGET_PROGRAMS_PER_SM * num_sms(device), max(1, batch * kv_heads))
    return max(1, min(wanted, triton.cdiv(max(max_len, 1), block_n), MAX_SPLITS))


@triton.jit
def _score_section(
    pool_f32, pt_row, col0, lo, hi, logit_rows, logit_base, lse, gmask, page_words, score_off,
    T: tl.constexpr, LOW: tl.constexpr, BLOCK_N: tl.constexpr,
):
    for t0 in range(lo, hi, BLOCK_N):
        t = t0 + tl.arange(0, BLOCK_N)
        tmask = t < hi
        page = section_page(pt_row, col0, t, tmask, T, LOW)
        logit = tl.load(logit_rows[:, None] + (logit_base + t)[None, :], mask=gmask[:, None] & tmask[None, :],
                        other=float("-inf"))
        p = tl.max(tl.exp(logit - lse[:, None]), 0)  # [BLOCK_N]: max over the group's query heads
        ptr = pool_f32 + page * page_words + score_off + t % T
        tl.store(ptr, tl.load(ptr, mask=tmask, other=0.0) + p, mask=tmask)


@triton.jit(do_not_specialize=["num_splits", "n_write"])  # one variant whatever the split count and batch
def _score_kernel(
    pool_f32, pt_ptr, len_ptr, lenlo_ptr, slots_ptr, logits_ptr, lse_ptr, alow_ptr,
    stride_pts, stride_ptl, stride_pth, stride_ls, stride_ll, stride_lh, stride_lls, stride_lll, stride_llh,
    stride_gb, stride_gh, stride_eb, stride_eh,
    layer, low_col0, page_words, score_off, lscore_off, num_splits, Hkv,  # runtime: one variant for every length
    GROUP: tl.constexpr, T: tl.constexpr, T_LO: tl.constexpr, HAS_LOW: tl.constexpr, GATED: tl.constexpr,
    BLOCK_G: tl.constexpr, BLOCK_N: tl.constexpr,
    # WRITE: the first n_write programs write the next layer's new tokens (kv_write.write_token's arguments)
    w_k=None, w_v=None, w_page=None, w_slot=None, w_pos=None, w_score=None,
    w_pc=None, w_u8=None, w_h=None, w_i32=None, w_f32=None,
    w_skn=0, w_skh=0, w_svn=0, w_svh=0, w_spn=0, w_ssn=0, w_sscn=0, w_H=0, w_D=0,
    w_page_elems=0, w_page_bytes=0, w_k_off=0, w_k_meta=0, w_v_off=0, w_v_meta=0,
    w_page_words=0, w_score_off=0, w_pos_off=0, n_write=0,
    WRITE: tl.constexpr = False, KB: tl.constexpr = 16, VB: tl.constexpr = 16, HAS_SCORES: tl.constexpr = False,
    BLOCK_H: tl.constexpr = 1, BLOCK_D: tl.constexpr = 16, KF8: tl.constexpr = False, VF8: tl.constexpr = False,
    TRACKED: tl.constexpr = True,
):
    # One program per (batch entry, KV head, split), after the n_write token writers; each split takes its share
    # of both sections.
    pid = tl.program_id(0)
    if WRITE:
        if pid < n_write:
            write_token(pid, w_k, w_v, w_page, w_slot, w_pos, w_score, w_pc, w_u8, w_h, w_i32, w_f32,
                        w_skn, w_skh, w_svn, w_svh, w_spn, w_ssn, w_sscn, w_H, w_D,
                        w_page_elems, w_page_bytes, w_k_off, w_k_meta, w_v_off, w_v_meta,
                        w_page_words, w_score_off, w_pos_off, KB, VB, HAS_SCORES, BLOCK_H, BLOCK_D, KF8, VF8,
                        TRACKED)
            return
        pid -= n_write
    split = pid % num_splits
    b = pid // num_splits // Hkv
    h = pid // num_splits % Hkv
    slot = tl.load(slots_ptr + b).to(tl.int64)
    pt_row = pt_ptr + slot * stride_pts + layer * stride_ptl + h * stride_pth
    g = tl.arange(0, BLOCK_G)
    gmask = g < GROUP
    hq = h * GROUP + g
    lse = tl.load(lse_ptr + b * stride_eb + hq * stride_eh, mask=gmask, other=0.0)
    logit_rows = logits_ptr + b * stride_gb + hq * stride_gh

    length = tl.load(len_ptr + slot * stride_ls + layer * stride_ll + h * stride_lh)
    lo, hi = split_range(length, split, num_splits, BLOCK_N)
    _score_section(pool_f32, pt_row, 0, lo, hi, logit_rows, 0, lse, gmask,
                   page_words, score_off, T, False, BLOCK_N)
    if HAS_LOW:
        length_lo = tl.load(lenlo_ptr + slot * stride_lls + layer * stride_lll + h * stride_llh)
        if GATED:  # alpha_low 0: no low score is ever read
            length_lo = tl.where(tl.load(alow_ptr + slot) > 0, length_lo, 0)
        lo, hi = split_range(length_lo, split, num_splits, BLOCK_N)
        _score_section(pool_f32, pt_row, low_col0, lo, hi, logit_rows,
                       length, lse, gmask, page_words, lscore_off, T_LO, True, BLOCK_N)


def _sections(fmt, fmt_low, lengths, len_low):
    if len_low is not None and fmt_low is None:
        raise ValueError("len_low needs fmt_low (the low section's page format)")
    has_low = len_low is not None
    if has_low and fmt_low.page_bytes != fmt.page_bytes:
        raise ValueError("the high and low formats must share one page size")
    return has_low


def accumulate_scores_ref(pool, fmt: PageFormat, page_table, lengths, slots, layer, logits, lse,
                          fmt_low=None, len_low=None, alpha_low_by_slot=None):
    has_low = _sections(fmt, fmt_low, lengths, len_low)
    pf = pool.view(torch.float32)
    B, Hq, NMAX = logits.shape
    Hkv = page_table.shape[2]
    group = Hq // Hkv
    sl = slots.long()
    lens = lengths[sl, layer].long()  # [B, Hkv]
    lg = logits.float().unflatten(1, (Hkv, group))  # [B, Hkv, G, NMAX]
    ls = lse.float().view(B, Hkv, group, 1)
    sections = [(fmt, lens, torch.zeros_like(lens), False)]
    if has_low:
        n_low = len_low[sl, layer].long()
        if alpha_low_by_slot is not None:
            n_low = torch.where(alpha_low_by_slot[sl, None] > 0, n_low, 0)
        sections.append((fmt_low, n_low, lens, True))
    for f, n_tok, base, low in sections:
        T = f.tokens
        n = int(n_tok.max()) if n_tok.numel() else 0
        if n == 0:
            continue
        j = torch.arange(n, device=pool.device)
        cols = section_columns(j, T, low, page_table.shape[3])
        pages = page_table[sl, layer][:, :, cols].long()  # [B, Hkv, n]
        valid = j < n_tok[..., None]
        idx = (base[..., None] + j).clamp(max=NMAX - 1)
        x = lg.gather(3, idx[:, :, None, :].expand(B, Hkv, group, n))
        p = torch.exp(x - ls).amax(2)  # [B, Hkv, n]
        rows = (j % T).expand_as(pages)
        pf.index_put_((pages[valid], f.score_off // 4 + rows[valid]), p[valid], accumulate=True)


def accumulate_scores_triton(pool, fmt: PageFormat, page_table, lengths, slots, layer, logits, lse,
                             fmt_low=None, len_low=None, alpha_low_by_slot=None, num_splits=None, block_n=BLOCK_N,
                             num_warps=4, num_stages=None, write: KVWrite | None = None):
    has_low = _sections(fmt, fmt_low, lengths, len_low)
    B, Hq, NMAX = logits.shape
    Hkv = page_table.shape[2]
    launch = write_kv_launch(*write) if write is not None else None
    n_write = 0 if launch is None else write.k.shape[0]
    if B == 0 and n_write == 0:
        return
    assert logits.stride(2) == 1 and page_table.stride(3) == 1 and Hq % Hkv == 0
    low = fmt_low if has_low else fmt
    lenlo = len_low if has_low else lengths
    if num_splits is None:
        num_splits = choose_score_splits(B, Hkv, NMAX, logits.device, block_n)
    group = Hq // Hkv
    gated = has_low and alpha_low_by_slot is not None
    extra = {} if num_stages is None else dict(num_stages=num_stages)
    if launch is not None:  # the write's arguments by name (w_*), then its constexprs
        args, consts = launch
        assert len(args) == len(WRITE_ARGS)
        extra.update(zip(WRITE_ARGS, args), n_write=n_write, WRITE=True, enable_fp_fusion=False, **consts)
    _score_kernel[(n_write + B * Hkv * num_splits,)](
        pool.view(torch.float32), page_table, lengths, lenlo, slots, logits, lse,
        alpha_low_by_slot if gated else lse,
        page_table.stride(0), page_table.stride(1), page_table.stride(2),
        lengths.stride(0), lengths.stride(1), lengths.stride(2), lenlo.stride(0), lenlo.stride(1), lenlo.stride(2),
        logits.stride(0), logits.stride(1), lse.stride(0), lse.stride(1),
        layer, page_table.shape[3] - 2, fmt.page_bytes // 4, fmt.score_off // 4, low.score_off // 4,
        num_splits, Hkv, GROUP=group, T=fmt.tokens, T_LO=low.tokens, HAS_LOW=has_low, GATED=gated,
        BLOCK_G=next_pow2(group), BLOCK_N=block_n, num_warps=num_warps, **extra,
    )


# _score_kernel's names of kv_write.write_kv_launch's arguments, in their order.
WRITE_ARGS = ("w_k", "w_v", "w_page", "w_slot", "w_pos", "w_score", "w_pc", "w_u8", "w_h", "w_i32", "w_f32",
              "w_skn", "w_skh", "w_svn", "w_svh", "w_spn", "w_ssn", "w_sscn", "w_H", "w_D",
              "w_page_elems", "w_page_bytes", "w_k_off", "w_k_meta", "w_v_off", "w_v_meta",
              "w_page_words", "w_score_off", "w_pos_off")


def accumulate_scores(pool, fmt: PageFormat, page_table, lengths, slots, layer: int, logits, lse,
                      fmt_low: PageFormat | None = None, len_low: torch.Tensor | None = None,
                      alpha_low_by_slot: torch.Tensor | None = None, high_only: bool = False,
                      write: KVWrite | None = None, impl: str = "auto"):
    """In place: score[token] += max_g exp(logits[b, g, idx] - lse[b, g]) for every cached token of every
    (batch entry b, KV head h); g over h's query heads. Sections and idx as in paged_decode_attention
    (high token j: idx j, page_table[.., j // T]; low token j: idx lengths + j, page_table[.., P - 1 - j // T_lo]).

    logits f32 [B, Hq, NMAX] (NMAX >= len_high + len_low of every head), lse f32 [B, Hq]; the batch entries'
    slots must be distinct. alpha_low_by_slot: optional f32 [S], the decode alpha_low of every slot; a slot's
    low tokens are skipped where it is 0 (their scores are never read).
    high_only: a launch hint, not a rule: most slots are expected at alpha_low 0 (short sections; see SHORT_BLOCK_N).
    Any slot's sections are still updated in full.
    write: new tokens to write as write_kv(*write) would (another layer's: their pages are not this layer's), in
    the same launch on the GPU, so a decode layer's K/V write costs no launch of its own.
    """
    if use_triton(impl, pool, logits, page_table):
        # high_only: short tiles, but the split count of BLOCK_N-token tiles (a short section is one tile either way;
        # the H100 timing above is of this launch)
        short = dict(block_n=SHORT_BLOCK_N, num_warps=1, num_splits=choose_score_splits(
            logits.shape[0], page_table.shape[2], logits.shape[2], logits.device, BLOCK_N)) if high_only else {}
        accumulate_scores_triton(pool, fmt, page_table, lengths, slots, layer, logits, lse, fmt_low=fmt_low,
                                 len_low=len_low, alpha_low_by_slot=alpha_low_by_slot, write=write, **short)
    else:
        if write is not None:
            write_kv(*write, impl="ref")
        accumulate_scores_ref(pool, fmt, page_table, lengths, slots, layer, logits, lse, fmt_low=fmt_low,
                              len_low=len_low, alpha_low_by_slot=alpha_low_by_slot)
