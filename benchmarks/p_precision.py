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

import argparse
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from _results import write_result  # noqa: E402
from q_precision import KV_FORMATS, PROMPT, attend, capture, rel  # noqa: E402

from diffkv_serve.engine.flags import add_engine_flags  # noqa: E402
from diffkv_serve.engine.loader import load_checkpoint  # noqa: E402
from diffkv_serve.kernels.quant import dequantize_ref, quantize_ref  # noqa: E402

TILE = 64  # tokens a tile of the decode kernel
P_FORMATS = {"fp16": None, "u8/tile": 255, "u7/tile": 127}


def parse_args(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    add_engine_flags(ap, only=("model",))
    ap.add_argument("--tokens", type=int, default=1024, help="prompt tokens")
    ap.add_argument("--queries", type=int, default=32, help="last prompt positions that attend, per layer")
    ap.add_argument("--kv", nargs="+", default=["K4V4", "K4V2", "K8V4"], choices=list(KV_FORMATS))
    ap.add_argument("--rotation", nargs="+", default=["off", "hadamard"], choices=["off", "hadamard"])
    ap.add_argument("--key-centering", choices=["off", "served"], default="served",
                    help="served: the centers the engine installs for a quantized cache")
    ap.add_argument("--out", default=None)
    ap.add_argument("--smoke", action="store_true", help="the embedded model, 96 tokens, 8 queries")
    return ap.parse_args(argv)


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


def main(argv=None) -> int:
    args = parse_args(argv)
    if args.smoke:
        args.model, args.tokens, args.queries = None, 96, 8
    if not 1 <= args.queries <= args.tokens:
        raise ValueError(f"--queries {args.queries}: needs 1 <= queries <= --tokens ({args.tokens})")
    ckpt = load_checkpoint(args.model)
    ids = torch.tensor(ckpt.tokenizer.encode(PROMPT)[: args.tokens], dtype=torch.long)
    if ids.numel() < args.tokens:
        raise ValueError(f"--tokens {args.tokens}: the prompt has {ids.numel()} tokens with this tokenizer")
    pos = torch.arange(args.tokens - args.queries, args.tokens)
    rows = []
    print(f"{ckpt.name}, {args.tokens} prompt tokens, last {args.queries} attend, key centering {args.key_centering}; "
          "relative L2 of the attention output, mean over layers (max)")
    print(f"{'rotation':>9} {'kv':>5} {'p':>8} {'total':>17} {'p alone':>17} {'p alone / fp16 total':>21}")
    for rotation in args.rotation:
        cap = capture(ckpt, ids, rotation, args.queries, args.key_centering)
        for kv in args.kv:
            kb, vb = KV_FORMATS[kv]
            per_layer = {name: [] for name in P_FORMATS}
            for q, k, v in cap.layers:
                exact = attend(q, k, v, pos)
                pk, sk, zk = quantize_ref(k.float(), kb)
                pv, sv, zv = quantize_ref(v.float(), vb)
                kq = dequantize_ref(pk, sk, zk, kb, k.shape[-1]).double()
                vq = dequantize_ref(pv, sv, zv, vb, v.shape[-1]).double()
                base = attend_weights(q, kq, vq, sv.double(), pos, None)
                for name, levels in P_FORMATS.items():
                    got = attend_weights(q, kq, vq, sv.double(), pos, levels)
                    per_layer[name].append((rel(got, exact), rel(got, base), rel(base, exact)))
            for name, errs in per_layer.items():
                total, alone = [e[0] for e in errs], [e[1] for e in errs]
                share = [e[1] / max(e[2], 1e-30) for e in errs]
                row = {"rotation": rotation, "kv": kv, "p": name, "total_mean": sum(total) / len(total),
                       "total_max": max(total), "p_alone_mean": sum(alone) / len(alone), "p_alone_max": max(alone),
                       "share_mean": sum(share) / len(share), "share_max": max(share)}
                rows.append(row)
                print(f"{rotation:>9} {kv:>5} {name:>8} {row['total_mean']:8.2e} ({row['total_max']:7.1e}) "
                      f"{row['p_alone_mean']:8.2e} ({row['p_alone_max']:7.1e}) {row['share_mean']:10.3f} "
                      f"({row['share_max']:6.3f})", flush=True)
    cmd = "python benchmarks/p_precision.py " + " ".join(argv if argv is not None else sys.argv[1:])
    result = {"benchmark": "p_precision", "model": ckpt.name, "device": "cpu", "torch": torch.__version__,
              "command": cmd, "config": vars(args), "rows": rows}
    if args.out:
        write_result(result, "p_precision", "cpu", args.out, args.smoke)
    return 0


if __name__ == "__main__":
    sys.exit(main())
