"""Building blocks of a Llama-family decoder in plain PyTorch."""
from __future__ import annotations

import math
from typing import Optional

import torch
import torch.nn.functional as F
from torch import nn

from engine.model_config import ModelArch


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

    def forward(self, x: torch.Tensor, positions: torch.Tensor, shift: Optional[torch.Tensor] = None) -> torch.Tensor:
        """x [N, heads, D], positions [N] -> rotated x, minus `shift` [heads, D] if given (key centering,
        engine.key_centering). Like the reference, the rotation runs in x's dtype; the shift rides on the
        multiply-adds (addcmul), so it costs no extra kernel."""
        cos = self.cos[positions].unsqueeze(1).to(x.dtype)
        sin = self.sin[positions].unsqueeze(1).to(x.dtype)
        x1, x2 = x.chunk(2, dim=-1)
        cos2, sin2 = torch.cat((cos, cos), -1), torch.cat((sin, sin), -1)
        base = x * cos2 if shift is None else torch.addcmul(-shift, x, cos2)
        return torch.addcmul(base, torch.cat((-x2, x1), -1), sin2)


def silu_and_mul(gate_up: torch.Tensor) -> torch.Tensor:
    gate, up = gate_up.chunk(2, dim=-1)
    return F.silu(gate) * up
