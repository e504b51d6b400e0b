"""KV rotation: an orthogonal matrix R [D, D] per model that keys, queries and values are multiplied by before
they reach the cache, so a per-token low-bit scale is not set by one or two large channels.

Why it is exact: q R . k R = q . k (R R^T = I), so logits, softmax, significance scores and the split-K merge
are unchanged; values are stored as v R and the attention output o R is turned back by o_proj's weights, which
absorb R^T per head (W_o[:, head] <- W_o[:, head] R). Only the quantization error changes: a rotation spreads a
channel outlier over every channel (a Walsh-Hadamard matrix mixes all D channels with equal weight), so the
min-max range of a token shrinks towards that of a Gaussian and the 2- and 4-bit steps get finer.

Where it costs: values are rotated by folding R into v_proj's rows (weights and bias) once at load, so they cost
nothing at run time; keys and queries rotate after RoPE and key centering (RoPE sits between k_proj and the
cache, so R cannot be folded there): one [tokens, heads, D] x [D, D] matmul per layer.

R = H_D diag(s) / sqrt(D) with H_D the Sylvester Hadamard matrix and s seeded random signs (randomized
Hadamard, as in QuaRot); head_dim that is not a power of two gets a seeded random orthogonal matrix instead.
"""
from __future__ import annotations

from typing import Optional

import torch

from diffkv_serve.engine.config import CacheConfig

SEED = 0x5EED  # one fixed rotation per head_dim: every engine of a model stores keys in the same basis


def resolve_mode(cache: CacheConfig) -> str:
    """The rotation that runs: 'hadamard' or 'off' ('auto': on when some section quantizes, so off for fp16 and
    for a diffkv cache whose high and low sections are both K16V16)."""
    if cache.kv_rotation == "auto":
        quantized = any(p is not None and p != (16, 16) for p in cache.precisions())
        return "hadamard" if quantized else "off"
    return cache.kv_rotation


def hadamard(d: int) -> torch.Tensor:
    """The Sylvester Hadamard matrix of order d (a power of two), entries +-1, float64."""
    if d < 1 or d & (d - 1):
        raise ValueError(f"hadamard: order {d} is not a power of two")
    h = torch.ones(1, 1, dtype=torch.float64)
    while h.shape[0] < d:
        h = torch.cat([torch.cat([h, h], 1), torch.cat([h, -h], 1)])
    return h


def rotation(d: int, seed: int = SEED) -> torch.Tensor:
    """The orthogonal matrix [d, d] (float64) keys, queries and values are multiplied by (see the module doc)."""
    g = torch.Generator().manual_seed(seed)
    if d & (d - 1) == 0:
        signs = torch.randint(0, 2, (d,), generator=g, dtype=torch.float64).mul_(2).sub_(1)
        return hadamard(d) * signs / d ** 0.5  # columns scaled: H diag(s) / sqrt(d)
    q, r = torch.linalg.qr(torch.randn(d, d, generator=g, dtype=torch.float64))
    return q * torch.sign(torch.diagonal(r))  # Haar-distributed, deterministic given the seed


@torch.no_grad()
def install(model: torch.nn.Module, mode: str) -> Optional[torch.Tensor]:
    """Rotate `model` in place: fold R into v_proj and o_proj, give every layer R for its queries and keys.
    'off' leaves the model as it is. Returns R in the model's dtype, or None. Call once, before any request."""
    if mode == "off":
        return None
    if mode != "hadamard":
        raise ValueError(f"kv_rotation={mode!r}: expected 'hadamard' or 'off'")
    first = model.layers[0]
    D = first.head_dim
    r64 = rotation(D)
    w = first.qkv_proj.weight
    r = r64.to(w.device, w.dtype)
    for layer in model.layers:
        if getattr(layer, "kv_rotation", None) is not None:
            raise ValueError("kv_rotation: this model is already rotated")
        Hq, Hk = layer.num_heads, layer.num_kv_heads
        rd = r64.to(layer.qkv_proj.weight.device)
        # v = x W_v^T + b_v per head; v R = x (R^T W_v)^T + b_v R.
        v_rows = slice((Hq + Hk) * D, (Hq + 2 * Hk) * D)
        wv = layer.qkv_proj.weight[v_rows].double().view(Hk, D, -1)
        layer.qkv_proj.weight[v_rows] = torch.einsum("ij,hjc->hic", rd.t(), wv).reshape(Hk * D, -1).to(w.dtype)
        if layer.qkv_proj.bias is not None:
            bv = layer.qkv_proj.bias[v_rows].double().view(Hk, D)
            layer.qkv_proj.bias[v_rows] = (bv @ rd).reshape(-1).to(w.dtype)
        # o = (o R) R^T: o_proj's input columns of each query head absorb R^T.
        wo = layer.o_proj.weight.double().view(-1, Hq, D)
        layer.o_proj.weight.copy_((wo @ rd).reshape(layer.o_proj.weight.shape).to(w.dtype))
        layer.kv_rotation = r
    return r


def describe(mode: str) -> dict:
    """What stats() reports."""
    return {"mode": mode}
