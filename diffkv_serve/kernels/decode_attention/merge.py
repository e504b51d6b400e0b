"""The split merge of decode attention (flash-decoding's second kernel): with more than one split per (sequence,
KV head), every attention kernel writes partial (max, sum, acc) per split, and this kernel combines them by
log-sum-exp into the output (and the lse, when asked)."""
from __future__ import annotations

import triton
import triton.language as tl

from diffkv_serve.kernels._common import next_pow2
from diffkv_serve.kernels.decode_attention.tiles import natural_lse


@triton.jit(do_not_specialize=["num_splits"])  # one variant whatever the split count
def _decode_reduce_kernel(
    mid_acc, mid_ml, o_ptr, stride_ob, stride_oh, Hq, D, num_splits,
    BLOCK_S: tl.constexpr, BLOCK_D: tl.constexpr,
    lse_ptr=None, stride_eb=0, stride_eh=0, WRITE_LSE: tl.constexpr = False,
):
    b, hq = tl.program_id(0), tl.program_id(1)
    s = tl.arange(0, BLOCK_S)
    d = tl.arange(0, BLOCK_D)
    smask = s < num_splits
    idx = (b * Hq + hq) * num_splits + s
    m = tl.load(mid_ml + idx * 2, mask=smask, other=-1.0e30)
    l = tl.load(mid_ml + idx * 2 + 1, mask=smask, other=0.0)
    m_max = tl.max(m, 0)
    w = tl.exp2(m - m_max)  # empty splits have l = 0 and acc = 0, so any weight is harmless
    total = tl.sum(w * l, 0)
    acc = tl.load(mid_acc + idx[:, None] * D + d[None, :], mask=smask[:, None] & (d[None, :] < D), other=0.0)
    out = tl.sum(w[:, None] * acc, 0) / tl.where(total > 0, total, 1.0)
    tl.store(o_ptr + b * stride_ob + hq * stride_oh + d, out.to(o_ptr.dtype.element_ty), mask=d < D)
    if WRITE_LSE:
        tl.store(lse_ptr + b * stride_eb + hq * stride_eh, natural_lse(m_max, total))


def merge_splits(mid_acc, mid_ml, out, lse, num_splits: int, write_lse: bool) -> None:
    """Merges mid_acc [B, Hq, num_splits, D] / mid_ml [B, Hq, num_splits, 2] into out [B, Hq, D] (and lse [B, Hq]
    with write_lse)."""
    B, Hq, D = out.shape
    _decode_reduce_kernel[(B, Hq)](
        mid_acc, mid_ml, out, out.stride(0), out.stride(1), Hq, D, num_splits,
        BLOCK_S=next_pow2(num_splits), BLOCK_D=max(16, next_pow2(D)),
        lse_ptr=lse, stride_eb=lse.stride(0), stride_eh=lse.stride(1), WRITE_LSE=write_lse,
        num_warps=4,
    )
