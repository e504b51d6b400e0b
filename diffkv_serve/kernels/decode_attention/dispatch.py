"""The entry point of paged decode attention: paged_decode_attention picks the Triton kernels (CUDA tensors, or
impl="triton") or the torch reference (reference.py); paged_decode_attention_triton validates the call, picks the
kernel (launch.decode_kernel: f16.py, q8.py or quartered.py; mma_cuda.py's CUDA kernel where it can serve a call
of the quartered or q8 kernel), its launch parameters and split count (launch.py), launches it and merges the splits
(merge.py).

Kernel 1 runs one program per (batch entry, KV head, split): all query heads of the GQA group share each
key/value tile, so every page is read once. With one split it writes the output directly; otherwise it writes
partial (max, sum, acc) and the merge kernel combines the splits (flash-decoding).
"""
from __future__ import annotations

import math

import torch

from diffkv_serve.kernels._common import check_supported, dot_in_fp32, use_triton
from diffkv_serve.kernels.decode_attention import mma_cuda
from diffkv_serve.kernels.decode_attention.f16 import launch_f16
from diffkv_serve.kernels.decode_attention.launch import (choose_num_splits, decode_kernel, launch_config, q8_launch,
                                                          tile_tokens)
from diffkv_serve.kernels.decode_attention.merge import merge_splits
from diffkv_serve.kernels.decode_attention.q8 import launch_q8
from diffkv_serve.kernels.decode_attention.quartered import launch_quartered
from diffkv_serve.kernels.decode_attention.reference import check_low_section, paged_decode_attention_ref
from diffkv_serve.kernels.decode_attention.tiles import LOG2E
from diffkv_serve.kernels.page_layout import PageFormat


def paged_decode_attention_triton(q, pool, fmt: PageFormat, cache_dtype, page_table, lengths, slots, layer,
                                  scale, num_splits=None, max_len=None, block_n=None, out=None,
                                  fmt_low=None, len_low=None, logits_out=None, lse_out=None,
                                  num_warps=None, num_stages=None, kernel=None, config=None,
                                  alpha_low_by_slot=None):
    """kernel: force one of KERNELS (tests, benchmarks; it must support the pages); None: pick_kernel's choice
    ("quartered" or "q8" force the Triton kernel where the CUDA one would serve).
    config: a LaunchConfig in place of launch_config's (tests, benchmarks); block_n / num_warps / num_stages
    override either."""
    check_supported(fmt, cache_dtype, for_triton=True)
    has_low = check_low_section(fmt, fmt_low, len_low, cache_dtype, True)
    B, Hq, D = q.shape
    Hkv, T = page_table.shape[2], fmt.tokens
    _require(Hq % Hkv == 0, "q", f"{Hq} query heads are not a multiple of {Hkv} KV heads")
    _require(D == fmt.head_dim, "q", f"head_dim {D} differs from the pages' {fmt.head_dim}")
    _require(q.stride(2) == 1 and page_table.stride(3) == 1, "q/page_table", "the last dim must be contiguous")
    out = torch.empty_like(q) if out is None else out
    _require(out.shape == q.shape and out.stride(2) == 1, "out", f"shape {tuple(out.shape)} / strides differ from q's")
    if logits_out is not None:
        _require(logits_out.dtype == torch.float32 and logits_out.shape[:2] == (B, Hq)
                 and logits_out.stride(2) == 1, "logits_out", f"needs float32 [{B}, {Hq}, >=max_len], contiguous rows")
    if lse_out is not None:
        _require(lse_out.dtype == torch.float32 and lse_out.shape == (B, Hq), "lse_out",
                 f"needs float32 [{B}, {Hq}]")
    if B == 0:
        return out
    pc = pool.view(cache_dtype)
    picked = pick_kernel(fmt, fmt_low if has_low else None, q, Hq // Hkv)
    triton_pick = decode_kernel(fmt, fmt_low if has_low else None)  # may be forced where the CUDA kernel is picked
    kernel = kernel or picked
    forced_cuda = kernel == "mma_cuda" and picked != "mma_cuda"  # usable, already asked by pick_kernel otherwise
    why_not_cuda = mma_cuda.usable(fmt, fmt_low if has_low else None, q, Hq // Hkv) if forced_cuda else None
    if kernel not in (picked, triton_pick, "quartered") and not (forced_cuda and why_not_cuda is None):
        low_note = " with a low section" if has_low else ""
        cuda_note = f" (mma_cuda: {why_not_cuda})" if kernel == "mma_cuda" else ""
        raise ValueError(f"kernel={kernel!r} cannot serve {fmt.name} pages{low_note}{cuda_note}")
    if kernel == "quartered" and (fmt.float8 or (has_low and fmt_low.float8)):  # it unpacks integer codes only
        low_name = f" + {fmt_low.name}" if has_low else ""
        raise ValueError(f"the quartered decode kernel cannot serve e4m3 pages ({fmt.name}{low_name}); "
                         "K8V8 e4m3 pages without a low section go to the q8 kernel")
    if max_len is None:  # capacity bound: needs no device sync
        max_len = page_table.shape[3] * max(T, fmt_low.tokens if has_low else 0)
    if kernel == "mma_cuda":
        return _launch_mma(q, pool, fmt, fmt_low if has_low else None, page_table, lengths, len_low, slots, layer,
                           scale, num_splits, max_len, out, logits_out, lse_out, alpha_low_by_slot)
    cfg = config or launch_config(fmt, fmt_low if has_low else None, kernel)
    q8_splits = None
    if kernel == "q8" and config is None and not (block_n or num_warps or num_stages):
        cfg, q8_splits = q8_launch(B, Hkv, max_len, q.device, D)  # its launch depends on the grid's size
    warps, stages = num_warps or cfg.num_warps, num_stages or cfg.num_stages
    if num_splits is None:
        num_splits = q8_splits or choose_num_splits(B, Hkv, max_len, q.device, block_n or cfg.block_n, warps, D)
    block_n = block_n or tile_tokens(cfg, max_len, num_splits)
    mid_acc, mid_ml = _split_partials(out, num_splits)
    low = fmt_low if has_low else fmt
    lenlo = len_low if has_low else lengths
    logits = logits_out if logits_out is not None else out  # unused when absent
    lse = lse_out if lse_out is not None else out
    dot_fp32 = dot_in_fp32(q, pool) or q.dtype == torch.float32 or cache_dtype == torch.float32
    write_logits, write_lse = logits_out is not None, lse_out is not None
    if kernel == "q8":
        launch_q8(q, pool, page_table, lengths, slots, out, mid_acc, mid_ml, logits, lse, layer, scale, num_splits,
                  fmt, block_n, dot_fp32, cfg, warps, stages, write_logits, write_lse)
    elif kernel == "f16":
        launch_f16(q, pc, page_table, lengths, slots, out, mid_acc, mid_ml, logits, lse, layer, scale, num_splits,
                   fmt, block_n, dot_fp32, cfg, warps, stages, write_logits, write_lse)
    else:
        launch_quartered(q, pc, pool, page_table, lengths, lenlo, slots, out, mid_acc, mid_ml, logits, lse, layer,
                         scale, num_splits, fmt, low, has_low, block_n, dot_fp32, cfg, warps, stages, write_logits,
                         write_lse)
    if num_splits > 1:
        merge_splits(mid_acc, mid_ml, out, lse, num_splits, write_lse)
    return out


def _split_partials(out: torch.Tensor, num_splits: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Every split's partial (acc [B, Hq, num_splits, D], log2 max and sum [B, Hq, num_splits, 2]) for the merge;
    with one split the kernels write `out` directly and these are unused (out stands in)."""
    if num_splits == 1:
        return out, out
    B, Hq, D = out.shape
    return (torch.empty(B, Hq, num_splits, D, dtype=torch.float32, device=out.device),
            torch.empty(B, Hq, num_splits, 2, dtype=torch.float32, device=out.device))


def pick_kernel(fmt: PageFormat, fmt_low: PageFormat | None, q, group: int) -> str:
    """The kernel paged_decode_attention_triton launches for a call (one of KERNELS): decode_kernel's pick, or
    "mma_cuda" where that is "quartered" or "q8" and the CUDA kernel can serve the call (group: query heads per KV
    head)."""
    picked = decode_kernel(fmt, fmt_low)
    if picked in ("quartered", "q8") and mma_cuda.usable(fmt, fmt_low, q, group) is None:
        return "mma_cuda"
    return picked


def planned_splits(kernel: str, fmt: PageFormat, fmt_low: PageFormat | None, batch: int, kv_heads: int,
                   max_len: int, device: torch.device, head_dim: int) -> int:
    """The split count paged_decode_attention_triton gives `kernel` when the call names none (benchmarks)."""
    if kernel == "mma_cuda":
        return mma_cuda.num_splits(fmt, fmt_low, batch, kv_heads, max_len, device)
    if kernel == "q8":
        return q8_launch(batch, kv_heads, max_len, device, head_dim)[1]
    cfg = launch_config(fmt, fmt_low, kernel)
    return choose_num_splits(batch, kv_heads, max_len, device, cfg.block_n, cfg.num_warps, head_dim)


def _launch_mma(q, pool, fmt, fmt_low, page_table, lengths, len_low, slots, layer, scale, num_splits, max_len, out,
                logits_out, lse_out, alpha_low_by_slot=None):
    """The CUDA kernel's call, split as mma_cuda.num_splits says."""
    B = q.shape[0]
    if num_splits is None:
        num_splits = mma_cuda.num_splits(fmt, fmt_low, B, page_table.shape[2], max_len, q.device)
    mid_acc, mid_ml = _split_partials(out, num_splits)
    mma_cuda.launch_mma(q, pool, fmt, fmt_low, page_table, lengths, len_low, slots, out, mid_acc, mid_ml, logits_out,
                        lse_out, layer, scale * LOG2E, num_splits, alpha_low_by_slot=alpha_low_by_slot)
    if num_splits > 1:
        merge_splits(mid_acc, mid_ml, out, lse_out if lse_out is not None else out, num_splits, lse_out is not None,
                     after_trigger=True)
    return out


def paged_decode_attention(q, pool, fmt: PageFormat, cache_dtype, page_table, lengths, slots, layer: int,
                           scale: float | None = None, num_splits: int | None = None, impl: str = "auto",
                           max_len: int | None = None, out: torch.Tensor | None = None,
                           fmt_low: PageFormat | None = None, len_low: torch.Tensor | None = None,
                           logits_out: torch.Tensor | None = None, lse_out: torch.Tensor | None = None,
                           alpha_low_by_slot: torch.Tensor | None = None):
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
    the log-sum-exp of those logits (-inf for a head without tokens). alpha_low_by_slot: optional f32 [S], the
    decode alpha_low of every slot; where it is 0 the CUDA kernel leaves the slot's low-token logits unwritten
    (score_update never reads them; the other kernels write them anyway).
    """
    if scale is None:
        scale = 1.0 / math.sqrt(q.shape[-1])
    kw = dict(fmt_low=fmt_low, len_low=len_low, logits_out=logits_out, lse_out=lse_out)
    if use_triton(impl, q, pool, page_table, lengths, slots):
        return paged_decode_attention_triton(q, pool, fmt, cache_dtype, page_table, lengths, slots, layer,
                                             scale, num_splits=num_splits, max_len=max_len, out=out,
                                             alpha_low_by_slot=alpha_low_by_slot, **kw)
    res = paged_decode_attention_ref(q, pool, fmt, cache_dtype, page_table, lengths, slots, layer, scale,
                                     max_len=max_len, **kw)
    return res if out is None else out.copy_(res)


def _require(ok: bool, name: str, why: str) -> None:
    # A ValueError, not an assert: these checks guard a kernel launch and must survive python -O.
    if not ok:
        raise ValueError(f"paged_decode_attention_triton: {name}: {why}")
