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
from dataclasses import dataclass

import torch
import triton
import triton.language as tl
from triton.language.extra.cuda import gdc_wait

from diffkv_serve.kernels._common import next_pow2
from diffkv_serve.kernels.decode_attention.tiles import natural_lse

# A merge program covers a few (sequence, query head) rows and one CHUNK-wide slice of head_dim; the grid's second
# axis covers the other slices. Whole rows a program (up to 16 of them, 4 warps) left a batch-8 call with 64 splits
# to 96 programs of 32 KB each, latency-bound. On an H200, whole decode calls of the CUDA kernel (14-60 us, 2-64
# splits, Qwen2.5-1.5B and Llama-3-8B heads) took 0.1-1.3 us less with slices of 32 (benchmarks/decode_merge.py
# times the merge alone). Up to 8 splits keep 4 warps a program; more run best at one warp (0.2-0.6 us less than
# two, 0.3-0.8 us less than four): the same elements a warp, in four times the programs.
CHUNK = 32
ELEMENTS_PER_WARP = 1024
MAX_ROWS = 16


@dataclass(frozen=True)
class MergeLaunch:
    rows: int  # (sequence, query head) rows a program combines: a power of two, 1..MAX_ROWS
    chunk: int  # head_dim elements a program covers
    warps: int


def merge_launch(num_splits: int, head_dim: int) -> MergeLaunch:
    """The merge's launch for a call's split count and head size."""
    chunk = min(CHUNK, max(16, next_pow2(head_dim)))
    warps = 4 if num_splits <= 8 else 1
    per_row = next_pow2(num_splits) * chunk
    return MergeLaunch(max(1, min(MAX_ROWS, ELEMENTS_PER_WARP * warps // per_row)), chunk, warps)


@triton.jit(do_not_specialize=["num_splits", "n_rows"])  # one variant whatever the split count and batch
def _decode_reduce_kernel(
    mid_acc, mid_ml, o_ptr, stride_ob, stride_oh, Hq, D, num_splits, n_rows,
    ROWS: tl.constexpr, BLOCK_S: tl.constexpr, BLOCK_D: tl.constexpr,
    lse_ptr=None, stride_eb=0, stride_eh=0, WRITE_LSE: tl.constexpr = False, PDL: tl.constexpr = False,
):
    if PDL:  # launched as a programmatic dependent: the attention kernel's partials are complete past this wait
        gdc_wait()
    row = tl.program_id(0) * ROWS + tl.arange(0, ROWS)  # row = b * Hq + hq
    s = tl.arange(0, BLOCK_S)
    d = tl.program_id(1) * BLOCK_D + tl.arange(0, BLOCK_D)
    rmask = row < n_rows
    dmask = d < D
    smask = rmask[:, None] & (s[None, :] < num_splits)
    idx = row[:, None] * num_splits + s[None, :]  # [ROWS, BLOCK_S]
    m = tl.load(mid_ml + idx * 2, mask=smask, other=-1.0e30)
    l = tl.load(mid_ml + idx * 2 + 1, mask=smask, other=0.0)
    m_max = tl.max(m, 1)
    w = tl.exp2(m - m_max[:, None])  # empty splits have l = 0 and acc = 0, so any weight is harmless
    total = tl.sum(w * l, 1)
    acc = tl.load(mid_acc + idx[:, :, None] * D + d[None, None, :], mask=smask[:, :, None] & dmask[None, None, :],
                  other=0.0)
    out = tl.sum(w[:, :, None] * acc, 1) / tl.where(total > 0, total, 1.0)[:, None]
    b, hq = row // Hq, row % Hq
    o = o_ptr + b[:, None] * stride_ob + hq[:, None] * stride_oh + d[None, :]
    tl.store(o, out.to(o_ptr.dtype.element_ty), mask=rmask[:, None] & dmask[None, :])
    if WRITE_LSE:
        if tl.program_id(1) == 0:  # every slice computes the same lse; the first one stores it
            tl.store(lse_ptr + b * stride_eb + hq * stride_eh, natural_lse(m_max, total), mask=rmask)


@functools.cache
def _pdl_capable(device: torch.device) -> bool:
    return device.type == "cuda" and not torch.version.hip and torch.cuda.get_device_capability(device) >= (9, 0)


def merge_splits(mid_acc, mid_ml, out, lse, num_splits: int, write_lse: bool, launch: MergeLaunch | None = None,
                 after_trigger: bool = False) -> None:
    """Merges mid_acc [B, Hq, num_splits, D] / mid_ml [B, Hq, num_splits, 2] into out [B, Hq, D] (and lse [B, Hq]
    with write_lse). launch: the program layout (default merge_launch's; benchmarks and tests pass others).
    after_trigger: the attention kernel before it triggers its dependents early (griddepcontrol.launch_dependents,
    as decode_mma.cu does), so on sm_90+ this launch is a programmatic dependent: its programs take the SMs the
    attention kernel's last programs free and wait for its results in gdc_wait, where a plain launch waits for the
    whole grid to end first. Measured on an H200 (CUDA graphs, 8-128 sequences x 1,024-4,096 tokens): 0.1-0.7 us
    off calls of 8-22 us; without the trigger it was 0.1-0.4 us slower, so the Triton kernels' merges stay plain."""
    B, Hq, D = out.shape
    launch = launch or merge_launch(num_splits, D)
    for name in ("rows", "chunk"):
        v = getattr(launch, name)
        if v < 1 or v & (v - 1):
            raise ValueError(f"merge_splits: launch.{name}={v} is not a power of two")
    pdl = after_trigger and _pdl_capable(out.device)
    _decode_reduce_kernel[(triton.cdiv(B * Hq, launch.rows), triton.cdiv(D, launch.chunk))](
        mid_acc, mid_ml, out, out.stride(0), out.stride(1), Hq, D, num_splits, B * Hq,
        ROWS=launch.rows, BLOCK_S=next_pow2(num_splits), BLOCK_D=launch.chunk,
        lse_ptr=lse, stride_eb=lse.stride(0), stride_eh=lse.stride(1), WRITE_LSE=write_lse, PDL=pdl,
        num_warps=launch.warps, launch_pdl=pdl,
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
