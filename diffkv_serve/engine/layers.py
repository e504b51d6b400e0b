"""Building blocks of a Llama-family decoder in plain PyTorch."""
from __future__ import annotations

import math
from typing import Optional

import torch
import torch.nn.functional as F
from torch import nn

from diffkv_serve.engine.model_config import ModelArch
from diffkv_serve.kernels.rms_norm import rms_norm
from diffkv_serve.kernels.rope import apply_rope
from diffkv_serve.kernels.silu_mul import silu_mul


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.is_cuda:
            # One fused kernel (fp32 accumulation inside); the decode step is launch-bound at small batch.
            return F.rms_norm(x, (x.shape[-1],), self.weight, self.eps)
        # Reference order of operations (normalize in fp32, scale in the input dtype).
        xf = x.float()
        xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * xf.to(x.dtype)

    def add_and_norm(self, h: torch.Tensor, delta: Optional[torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
        """(h + delta, norm(h + delta)) for hidden states [N, H]: the residual add and the norm in one kernel on
        CUDA (diffkv_serve/kernels/rms_norm.py); delta None: (h, norm(h))."""
        return rms_norm(h, self.weight, self.eps, delta)


def rope_inv_freq(arch: ModelArch) -> torch.Tensor:
    """Rotary inverse frequencies, with Llama-3 / linear scaling when the config asks for it."""
    d = arch.head_dim
    inv = 1.0 / (arch.rope_theta ** (torch.arange(0, d, 2, dtype=torch.float64) / d))
    sc = arch.rope_scaling
    if sc is None or sc.rope_type == "default":
        return inv.float()
    if sc.rope_type == "linear":
        return (inv / sc.factor).float()
    # llama3: long wavelengths are slowed by `factor`, short ones kept, the band between interpolated.
    low_wl = sc.original_max_position_embeddings / sc.low_freq_factor
    high_wl = sc.original_max_position_embeddings / sc.high_freq_factor
    wl = 2 * math.pi / inv
    smooth = (sc.original_max_position_embeddings / wl - sc.low_freq_factor) / (sc.high_freq_factor - sc.low_freq_factor)
    scaled = torch.where(wl > low_wl, inv / sc.factor, inv)
    mid = (wl <= low_wl) & (wl >= high_wl)
    scaled = torch.where(mid, (1 - smooth) * inv / sc.factor + smooth * inv, scaled)
    return scaled.float()


class RotaryEmbedding(nn.Module):
    """HF "half split" rotary embedding with a cos/sin table for every position up to max_len."""

    def __init__(self, arch: ModelArch, max_len: int):
        super().__init__()
        t = torch.arange(max_len, dtype=torch.float32)
        freqs = torch.outer(t, rope_inv_freq(arch).to(t.device))  # rotary tables stay fp32
        self.register_buffer("cos", freqs.cos(), persistent=False)
        self.register_buffer("sin", freqs.sin(), persistent=False)

    def tables(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """cos, sin [N, D/2] (fp32) of these positions: gathered once per forward, shared by every layer."""
        return self.cos[positions], self.sin[positions]

    def forward(self, x: torch.Tensor, positions: torch.Tensor, shift: Optional[torch.Tensor] = None,
                tables: Optional[tuple[torch.Tensor, torch.Tensor]] = None) -> torch.Tensor:
        """x [N, heads, D], positions [N] -> rotated x, minus `shift` [heads, D] if given (key centering,
        engine.key_centering). On CPU the rotation runs in x's dtype like the Hugging Face reference, the shift
        riding on its multiply-adds; on CUDA one kernel rotates q and k (diffkv_serve/kernels/rope.py)."""
        cos, sin = tables if tables is not None else self.tables(positions)
        return apply_rope(x, cos, sin, shift)


def silu_and_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """silu(gate) * up of the fused [N, 2I] projection (one kernel on CUDA: diffkv_serve/kernels/silu_mul.py)."""
    return silu_mul(gate_up)
