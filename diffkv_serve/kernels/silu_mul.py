"""SwiGLU's activation: silu(gate) * up from the fused gate_up projection [N, 2I], in one kernel (torch: a
silu and a multiply, plus the chunk's strided reads; two launches per layer at decode batch sizes)."""
from __future__ import annotations

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

from diffkv_serve.kernels._common import use_triton


def silu_mul_ref(gate_up: torch.Tensor) -> torch.Tensor:
    gate, up = gate_up.chunk(2, dim=-1)
    return F.silu(gate) * up


@triton.jit
def _silu_mul_kernel(x_ptr, out_ptr, stride_x, stride_o, I, BLOCK: tl.constexpr):
    n = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    m = cols < I
    g = tl.load(x_ptr + n * stride_x + cols, mask=m, other=0.0)
    u = tl.load(x_ptr + n * stride_x + I + cols, mask=m, other=0.0)
    # like torch: silu rounded to the input dtype, then the product in fp32, rounded once
    gf = g.to(tl.float32)
    s = (gf / (1.0 + tl.exp(-gf))).to(g.dtype)
    tl.store(out_ptr + n * stride_o + cols, (s.to(tl.float32) * u.to(tl.float32)).to(out_ptr.dtype.element_ty),
             mask=m)


def silu_mul(gate_up: torch.Tensor, impl: str = "auto") -> torch.Tensor:
    """gate_up [N, 2I] -> silu(gate) * up [N, I]. Triton on CUDA ("auto"), else the torch reference."""
    if gate_up.dim() != 2 or gate_up.shape[-1] % 2:
        raise ValueError(f"silu_mul: gate_up must be [N, 2I], got {tuple(gate_up.shape)}")
    if not use_triton(impl, gate_up) or gate_up.shape[0] == 0:
        return silu_mul_ref(gate_up)
    if gate_up.stride(-1) != 1:
        raise ValueError("silu_mul: rows must be contiguous")
    N, I2 = gate_up.shape
    I = I2 // 2
    out = torch.empty((N, I), dtype=gate_up.dtype, device=gate_up.device)
    block = 1024
    _silu_mul_kernel[(N, triton.cdiv(I, block))](gate_up, out, gate_up.stride(0), out.stride(0), I, BLOCK=block,
                                                 num_warps=4)
    return out
