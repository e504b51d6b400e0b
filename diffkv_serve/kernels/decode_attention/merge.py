"""The split merge of decode attention (flash-decoding's second kernel): with more than one split per (sequence,
KV head), every attention kernel writes partial (max, sum, acc) per split, and this kernel combines them by
log-sum-exp into the output (and the lse, when asked). merge_splits_ref is its torch reference.

The partials stay fp32 sums. Each split's normalized output in the output's dtype instead (half the bytes) was
measured on an H100 (benchmarks/attention.py, against the fp32 run of the lease before, SDPA rows within 1%): 3-5%
faster where a call has 2-4 splits (Llama-3-8B heads, 32 x 1024 tokens, int4: 20.9 against 22.0 us), 5-27% slower
at 8 or more (Qwen2.5-1.5B heads, 32 x 1024 tokens, int4: 13.3 against 10.5 us), the small calls that sit furthest
from the floor."""
from __future__ import annotations

import functools
import math

import torch
import triton
import triton.language as tl
from triton.language.extra.cuda import gdc_wait

from diffkv_serve.kernels._common import next_pow2
from diffkv_serve.kernels.decode_attention.tiles import natural_lse

# Elements of acc one program reduces (4 warps: 32 fp32 registers a thread). One (sequence, query head) row per
# program made 1,536 programs of 2 KB at batch 128, 12 query heads, 4 splits, and cost 5.7 us on an H100 for 3 MB,
# where 384 programs of 8 KB (batch 32, 16 splits) took 3.0 us: the block launches, not the bytes, set the time.
# So a program takes as many rows as fit this many elements, at most MAX_ROWS (benchmarks/decode_merge.py times both).
ELEMENTS_PER_PROGRAM = 4096
MAX_ROWS = 16


def rows_per_program(num_splits: int, head_dim: int) -> int:
    """(sequence, query head) rows one merge program combines: a power of two, 1..MAX_ROWS."""
    per_row = next_pow2(num_splits) * max(16, next_pow2(head_dim))
    return max(1, min(MAX_ROWS, ELEMENTS_PER_PROGRAM // per_row))


@triton.jit(do_not_specialize=["num_splits", "n_rows"])  # one variant whatever the split count and batch
def _decode_reduce_kernel(
    mid_acc, mid_ml, o_ptr, stride_ob, stride_oh, Hq, D, num_splits, n_rows,
    ROWS: tl.constexpr, BLOCK_S: tl.constexpr, BLOCK_D: tl.constexpr,
    lse_ptr=None, stride_eb=0, stride_eh=0, WRITE_LSE: tl.constexpr = False, PDL: tl.constexpr = False,
):
    if PDL:  # launched as a programmatic dependent: the attention kernel's partials are complete past this wait
        gdc_wait()
    if ROWS == 1:  # many splits: one row's [splits, D] tile (2D tiles ran 20% faster than [1, splits, D] here)
        _reduce_one_row(mid_acc, mid_ml, o_ptr, stride_ob, stride_oh, Hq, D, num_splits, BLOCK_S, BLOCK_D,
                        lse_ptr, stride_eb, stride_eh, WRITE_LSE)
        return
    row = tl.program_id(0) * ROWS + tl.arange(0, ROWS)  # row = b * Hq + hq
    s = tl.arange(0, BLOCK_S)
    d = tl.arange(0, BLOCK_D)
    rmask = row < n_rows
    smask = rmask[:, None] & (s[None, :] < num_splits)
    idx = row[:, None] * num_splits + s[None, :]  # [ROWS, BLOCK_S]
    m = tl.load(mid_ml + idx * 2, mask=smask, other=-1.0e30)
    l = tl.load(mid_ml + idx * 2 + 1, mask=smask, other=0.0)
    m_max = tl.max(m, 1)
    w = tl.exp2(m - m_max[:, None])  # empty splits have l = 0 and acc = 0, so any weight is harmless
    total = tl.sum(w * l, 1)
    dmask = d[None, None, :] < D
    acc = tl.load(mid_acc + idx[:, :, None] * D + d[None, None, :], mask=smask[:, :, None] & dmask, other=0.0)
    out = tl.sum(w[:, :, None] * acc, 1) / tl.where(total > 0, total, 1.0)[:, None]
    b, hq = row // Hq, row % Hq
    o = o_ptr + b[:, None] * stride_ob + hq[:, None] * stride_oh + d[None, :]
    tl.store(o, out.to(o_ptr.dtype.element_ty), mask=rmask[:, None] & (d[None, :] < D))
    if WRITE_LSE:
        tl.store(lse_ptr + b * stride_eb + hq * stride_eh, natural_lse(m_max, total), mask=rmask)


@triton.jit
def _reduce_one_row(mid_acc, mid_ml, o_ptr, stride_ob, stride_oh, Hq, D, num_splits,
                    BLOCK_S: tl.constexpr, BLOCK_D: tl.constexpr, lse_ptr, stride_eb, stride_eh,
                    WRITE_LSE: tl.constexpr):
    row = tl.program_id(0)
    s = tl.arange(0, BLOCK_S)
    d = tl.arange(0, BLOCK_D)
    smask = s < num_splits
    idx = row * num_splits + s
    m = tl.load(mid_ml + idx * 2, mask=smask, other=-1.0e30)
    l = tl.load(mid_ml + idx * 2 + 1, mask=smask, other=0.0)
    m_max = tl.max(m, 0)
    w = tl.exp2(m - m_max)
    total = tl.sum(w * l, 0)
    acc = tl.load(mid_acc + idx[:, None] * D + d[None, :], mask=smask[:, None] & (d[None, :] < D), other=0.0)
    out = tl.sum(w[:, None] * acc, 0) / tl.where(total > 0, total, 1.0)
    b, hq = row // Hq, row % Hq
    tl.store(o_ptr + b * stride_ob + hq * stride_oh + d, out.to(o_ptr.dtype.element_ty), mask=d < D)
    if WRITE_LSE:
        tl.store(lse_ptr + b * stride_eb + hq * stride_eh, natural_lse(m_max, total))


@functools.cache
def _pdl_capable(device: torch.device) -> bool:
    return device.type == "cuda" and not torch.version.hip and torch.cuda.get_device_capability(device) >= (9, 0)


def merge_splits(mid_acc, mid_ml, out, lse, num_splits: int, write_lse: bool, rows: int | None = None,
                 after_trigger: bool = False) -> None:
    """Merges mid_acc [B, Hq, num_splits, D] / mid_ml [B, Hq, num_splits, 2] into out [B, Hq, D] (and lse [B, Hq]
    with write_lse). rows: rows a program takes (a power of two; default rows_per_program's; benchmarks).
    after_trigger: the attention kernel before it triggers its dependents early (griddepcontrol.launch_dependents,
    as decode_mma.cu does), so on sm_90+ this launch is a programmatic dependent: its programs take the SMs the
    attention kernel's last programs free and wait for its results in gdc_wait, where a plain launch waits for the
    whole grid to end first. Measured on an H200 (CUDA graphs, 8-128 sequences x 1,024-4,096 tokens): 0.1-0.7 us
    off calls of 8-22 us; without the trigger it was 0.1-0.4 us slower, so the Triton kernels' merges stay plain."""
    B, Hq, D = out.shape
    rows = rows or rows_per_program(num_splits, D)
    if rows & (rows - 1):
        raise ValueError(f"merge_splits: rows={rows} is not a power of two")
    pdl = after_trigger and _pdl_capable(out.device)
    _decode_reduce_kernel[(triton.cdiv(B * Hq, rows),)](
        mid_acc, mid_ml, out, out.stride(0), out.stride(1), Hq, D, num_splits, B * Hq,
        ROWS=rows, BLOCK_S=next_pow2(num_splits), BLOCK_D=max(16, next_pow2(D)),
        lse_ptr=lse, stride_eb=lse.stride(0), stride_eh=lse.stride(1), WRITE_LSE=write_lse, PDL=pdl,
        num_warps=4, launch_pdl=pdl,
    )


def merge_splits_ref(mid_acc: torch.Tensor, mid_ml: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """merge_splits in torch: (out [B, Hq, D] fp32, natural-log lse [B, Hq], -inf where no split holds a token).
    mid_ml holds each split's log2-domain max and sum; a split without tokens has sum 0 and acc 0."""
    m, l = mid_ml[..., 0].double(), mid_ml[..., 1].double()
    m_max = m.amax(-1, keepdim=True)
    w = torch.exp2(m - m_max)
    total = (w * l).sum(-1)
    held = torch.where(total > 0, total, 1.0)  # rows without tokens divide by 1: their acc is 0
    out = (w[..., None] * mid_acc.double()).sum(-2) / held[..., None]
    lse = torch.where(total > 0, (m_max[..., 0] + torch.log2(held)) * math.log(2), float("-inf"))
    return out.float(), lse.float()
