"""How precise the softmax weights must be for p.v against low-bit values: each layer's decode attention on a
prompt's own queries, keys and values (K/V quantized as the cache stores them), with p' = p * value scale / the
largest value scale -- what the CUDA decode kernel hands its p.v mma -- in fp16 (the kernel's today) beside p' as
unsigned integers at one scale per 64-token tile and query head (the tile's largest p'), 8 or 7 bits: what an integer
p.v mma (u8 value codes by u8 p', one chain per 32 tokens instead of two fp16 ones) would compute.

Errors are relative L2 norms of the attention output against float64 with unquantized K/V ("total" for fp16 p'), and
of each integer p' against fp16 p' on the same quantized K/V ("p alone"), whose ratio to the total says how much the
weights' rounding adds to what the cache's quantization already costs. Queries, keys and values come from
benchmarks/q_precision.py's capture (rotation and key centering as the engine serves them).

Usage:  python benchmarks/p_precision.py [--model qwen2.5-coder-1.5b] [--tokens 1024]   (CPU is enough)
Smoke:  python benchmarks/p_precision.py --smoke
"""
from __future__ import annotations

import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from q_precision import attend, quantized, run, run_flags  # noqa: E402

TILE = 64  # tokens a tile of the decode kernel
P_FORMATS = {"fp16": None, "u8/tile": 255, "u7/tile": 127}


def parse_args(argv=None):
    return run_flags(__doc__, ["K4V4", "K4V2", "K8V4"], "served").parse_args(argv)


def round_weights(pw: torch.Tensor, levels: int | None) -> torch.Tensor:
    """p' [..., N] in [0, 1] as the p.v mma takes it: fp16 (levels None), else integers at one scale per TILE
    tokens (the tile's largest p' / levels)."""
    if levels is None:
        return pw.half().double()
    n = pw.shape[-1]
    t = torch.nn.functional.pad(pw, (0, (-n) % TILE)).unflatten(-1, (-1, TILE))
    s = t.amax(-1, keepdim=True) / levels
    t = torch.where(s > 0, torch.round(t / torch.where(s > 0, s, 1)) * s, t)
    return t.flatten(-2)[..., :n]


def attend_weights(q, k, v, vscale, pos, levels):
    """Causal GQA attention, float64, with p' = p * vscale / max vscale rounded by round_weights: q [P, Hq, D], k / v
    [N, Hkv, D] (dequantized), vscale [N, Hkv] the values' scales."""
    group = q.shape[1] // k.shape[1]
    kk, vv = k.repeat_interleave(group, 1), v.repeat_interleave(group, 1)
    vs = vscale.repeat_interleave(group, 1).T[:, None, :]  # [Hq, 1, N]
    logits = torch.einsum("phd,nhd->hpn", q, kk) * q.shape[-1] ** -0.5
    logits = logits.masked_fill(torch.arange(k.shape[0])[None, None, :] > pos[None, :, None], float("-inf"))
    p = torch.exp(logits - logits.amax(-1, keepdim=True))
    top = vs.amax(-1, keepdim=True)
    w = round_weights(p * vs / top, levels) * top / vs.clamp_min(1e-30)  # back to p's units
    return torch.einsum("hpn,nhd->phd", w / p.sum(-1, keepdim=True), vv)


def p_outputs(q, k, v, kb: int, vb: int, pos):
    """Exact attention, fp16 p' on the quantized cache (the baseline), and p' as each of P_FORMATS rounds it."""
    (kq, _, _), (vq, vscale, _) = quantized(k, kb), quantized(v, vb)
    got = {name: attend_weights(q, kq, vq, vscale, pos, levels) for name, levels in P_FORMATS.items()}
    return attend(q, k, v, pos), got["fp16"], got


def main(argv=None) -> int:
    return run(parse_args(argv), argv, "p_precision", "p", p_outputs)


if __name__ == "__main__":
    sys.exit(main())
