"""RMSNorm, optionally fused with the residual add before it: one kernel per norm in the decode step.

    h_out = h + delta          (rounded to h's dtype, as a separate add would store it)
    y     = weight * (h_out * rsqrt(mean(h_out^2) + eps))   normalized in fp32, cast, scaled in h's dtype

At decode batch sizes the step is launch-bound around the GEMMs: torch's rms_norm takes ~6 us for one 4096-wide
row on an H100 and the add another launch, so a layer's two norms and two adds are ~20 us of a ~230 us layer
(Llama-3-8B, batch 1). One program per row here, the add folded in.
"""
from __future__ import annotations

from typing import Optional

import torch
import triton
import triton.language as tl

from diffkv_serve.kernels._common import next_pow2, use_triton


def rms_norm_ref(h: torch.Tensor, weight: torch.Tensor, eps: float,
                 delta: Optional[torch.Tensor] = None) -> tuple[torch.Tensor, torch.Tensor]:
    """(h + delta, RMSNorm(h + delta)) in plain torch; delta None: (h, RMSNorm(h))."""
    if delta is not None:
        h = h + delta
    xf = h.float()
    xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    return h, weight * xf.to(h.dtype)


@triton.jit
def _rms_norm_kernel(h_ptr, d_ptr, w_ptr, h_out_ptr, y_ptr, stride_h, stride_d, stride_ho, stride_y, H, eps,
                     ADD: tl.constexpr, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    mask = cols < H
    h = tl.load(h_ptr + row * stride_h + cols, mask=mask, other=0.0)
    if ADD:
        d = tl.load(d_ptr + row * stride_d + cols, mask=mask, other=0.0)
        h = (h.to(tl.float32) + d.to(tl.float32)).to(h_ptr.dtype.element_ty)
        tl.store(h_out_ptr + row * stride_ho + cols, h, mask=mask)
    x = h.to(tl.float32)
    r = tl.rsqrt(tl.sum(x * x, 0) / H + eps)
    w = tl.load(w_ptr + cols, mask=mask, other=0.0).to(tl.float32)
    y = (x * r).to(h_ptr.dtype.element_ty).to(tl.float32) * w
    tl.store(y_ptr + row * stride_y + cols, y.to(y_ptr.dtype.element_ty), mask=mask)


def rms_norm(h: torch.Tensor, weight: torch.Tensor, eps: float, delta: Optional[torch.Tensor] = None,
             impl: str = "auto") -> tuple[torch.Tensor, torch.Tensor]:
    """(h + delta, RMSNorm(h + delta) * weight) for h [N, H] (delta None: (h, RMSNorm(h))). Triton on CUDA
    ("auto"), else the torch reference. The output dtype is h's, like the reference's (weight in h's dtype)."""
    if h.dim() != 2 or weight.shape != (h.shape[-1],):
        raise ValueError(f"rms_norm: h must be [N, H] and weight [H], got {tuple(h.shape)} and {tuple(weight.shape)}")
    if delta is not None and delta.shape != h.shape:
        raise ValueError(f"rms_norm: delta {tuple(delta.shape)} must match h {tuple(h.shape)}")
    tensors = (h, weight) if delta is None else (h, weight, delta)
    if not use_triton(impl, *tensors) or h.shape[0] == 0:
        return rms_norm_ref(h, weight, eps, delta)
    if h.stride(-1) != 1 or (delta is not None and delta.stride(-1) != 1):
        raise ValueError("rms_norm: rows must be contiguous")
    N, H = h.shape
    y = torch.empty_like(h)
    h_out = torch.empty_like(h) if delta is not None else h
    d = delta if delta is not None else h
    block = next_pow2(H)
    _rms_norm_kernel[(N,)](h, d, weight, h_out, y, h.stride(0), d.stride(0), h_out.stride(0), y.stride(0), H, eps,
                           ADD=delta is not None, BLOCK=block, num_warps=min(16, max(1, block // 512)))
    return h_out, y
