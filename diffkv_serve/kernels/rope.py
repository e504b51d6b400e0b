"""Rotary embedding ("half split", as Hugging Face Llama/Qwen) of q and k in one kernel, with key centering's
shift folded into the same multiply-add.

    out[..., :D/2] = x1 * cos - x2 * sin - shift[:, :D/2]
    out[..., D/2:] = x2 * cos + x1 * sin - shift[:, D/2:]

cos / sin are gathered once per step ([N, D/2], fp32) and shared by every layer; the torch formulation costs
eight small kernels per layer (gathers, casts, cats, a negation, two multiply-adds), each ~1.5-6 us at decode
batch sizes on an H100.
"""
from __future__ import annotations

from typing import Optional

import torch
import triton
import triton.language as tl

from diffkv_serve.kernels._common import next_pow2, use_triton


def rope_ref(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
             shift: Optional[torch.Tensor] = None) -> torch.Tensor:
    """x [N, heads, D] rotated by cos/sin [N, D/2] (fp32 tables), minus shift [heads, D] if given; the rotation
    runs in x's dtype like the Hugging Face reference, the shift riding on the last multiply-adds."""
    c = cos.unsqueeze(1).to(x.dtype)
    s = sin.unsqueeze(1).to(x.dtype)
    x1, x2 = x.chunk(2, dim=-1)
    cos2, sin2 = torch.cat((c, c), -1), torch.cat((s, s), -1)
    base = x * cos2 if shift is None else torch.addcmul(-shift, x, cos2)
    return torch.addcmul(base, torch.cat((-x2, x1), -1), sin2)


@triton.jit
def _rope_kernel(x_ptr, cos_ptr, sin_ptr, shift_ptr, out_ptr, stride_xn, stride_xh, stride_on, stride_oh,
                 stride_c, H, HALF: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_D: tl.constexpr,
                 SHIFT: tl.constexpr):
    n = tl.program_id(0).to(tl.int64)
    h = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
    d = tl.arange(0, BLOCK_D)
    m = (h < H)[:, None] & (d < HALF)[None, :]
    c = tl.load(cos_ptr + n * stride_c + d, mask=d < HALF, other=0.0)[None, :]
    s = tl.load(sin_ptr + n * stride_c + d, mask=d < HALF, other=0.0)[None, :]
    row = x_ptr + n * stride_xn + h[:, None] * stride_xh + d[None, :]
    x1 = tl.load(row, mask=m, other=0.0).to(tl.float32)
    x2 = tl.load(row + HALF, mask=m, other=0.0).to(tl.float32)
    o1 = x1 * c - x2 * s
    o2 = x2 * c + x1 * s
    if SHIFT:
        sh = shift_ptr + h[:, None] * (2 * HALF) + d[None, :]
        o1 -= tl.load(sh, mask=m, other=0.0).to(tl.float32)
        o2 -= tl.load(sh + HALF, mask=m, other=0.0).to(tl.float32)
    orow = out_ptr + n * stride_on + h[:, None] * stride_oh + d[None, :]
    tl.store(orow, o1.to(out_ptr.dtype.element_ty), mask=m)
    tl.store(orow + HALF, o2.to(out_ptr.dtype.element_ty), mask=m)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, shift: Optional[torch.Tensor] = None,
               impl: str = "auto") -> torch.Tensor:
    """x [N, heads, D] (any strides with contiguous D) -> rotated copy [N, heads, D]. Triton on CUDA ("auto"):
    it rotates in fp32 and rounds once, so it is at least as exact as the reference (which rounds after each
    multiply)."""
    if x.dim() != 3 or x.shape[-1] % 2:
        raise ValueError(f"apply_rope: x must be [N, heads, D] with even D, got {tuple(x.shape)}")
    N, H, D = x.shape
    if cos.shape != (N, D // 2) or sin.shape != cos.shape:
        raise ValueError(f"apply_rope: cos/sin must be [{N}, {D // 2}], got {tuple(cos.shape)} / {tuple(sin.shape)}")
    if shift is not None and shift.shape != (H, D):
        raise ValueError(f"apply_rope: shift must be [{H}, {D}], got {tuple(shift.shape)}")
    if not use_triton(impl, x, cos, sin) or N == 0:
        return rope_ref(x, cos, sin, shift)
    if x.stride(-1) != 1 or not cos.is_contiguous() or not sin.is_contiguous():
        raise ValueError("apply_rope: x's head dim and the cos/sin tables must be contiguous")
    out = torch.empty((N, H, D), dtype=x.dtype, device=x.device)
    sh = shift.contiguous() if shift is not None else cos
    block_h = min(16, next_pow2(H))
    _rope_kernel[(N, triton.cdiv(H, block_h))](
        x, cos, sin, sh, out, x.stride(0), x.stride(1), out.stride(0), out.stride(1), cos.stride(0), H,
        HALF=D // 2, BLOCK_H=block_h, BLOCK_D=next_pow2(D // 2), SHIFT=shift is not None, num_warps=4)
    return out
