"""The split merge of decode attention on its own (diffkv_serve/kernels/decode_attention/merge.py): CUDA-graph
microseconds per call at the engine's decode shapes, with the launch it picks (merge_launch: slices of head_dim)
beside whole rows a program (4 warps, 4,096 elements), and the error against its torch reference.

Usage (GPU):  python benchmarks/decode_merge.py [--shapes 128x12x4 32x12x16 ...]
Smoke (CPU):  python benchmarks/decode_merge.py --smoke
"""
from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

if "--smoke" in sys.argv:  # the Triton interpreter runs the kernel on the CPU; it must be chosen before the import
    os.environ.setdefault("TRITON_INTERPRET", "1")

import torch  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from _results import record_sweep  # noqa: E402
from attention import sweep_us  # noqa: E402

from diffkv_serve.kernels._common import next_pow2  # noqa: E402
from diffkv_serve.kernels.decode_attention.merge import (MAX_ROWS, MergeLaunch, merge_launch, merge_splits,  # noqa: E402
                                                          merge_splits_ref)

# batch x query heads x splits: Qwen2.5-1.5B's 12 heads at the split counts choose_num_splits gives its batches,
# and Llama-3-8B's 32
SHAPES = ["8x12x64", "32x12x16", "128x12x4", "256x12x2", "256x12x4", "32x32x4", "128x32x2"]


def parse_args(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--shapes", nargs="+", default=SHAPES, help="BATCHxHEADSxSPLITS")
    ap.add_argument("--head-dim", type=int, default=128)
    ap.add_argument("--rep", type=float, default=20, help="do_bench_cudagraph rep (ms)")
    ap.add_argument("--out", default=None)
    ap.add_argument("--smoke", action="store_true", help="CPU, tiny shapes, the Triton interpreter")
    return ap.parse_args(argv)


def main(argv=None) -> int:
    args = parse_args(argv)
    cuda = torch.cuda.is_available() and not args.smoke
    dev = torch.device("cuda" if cuda else "cpu")
    if args.smoke:
        args.shapes, args.head_dim = ["2x3x4", "1x2x64"], 32
    rows_out = []
    print(f"{'B':>4} {'Hq':>3} {'splits':>6} {'launch':>14} {'us':>8} {'us (whole rows)':>15} {'max err':>9}")
    for shape in args.shapes:
        B, Hq, S = (int(x) for x in shape.split("x"))
        D = args.head_dim
        g = torch.Generator(device=dev).manual_seed(0)
        acc = torch.randn(B, Hq, S, D, device=dev, generator=g)
        ml = torch.stack([torch.randn(B, Hq, S, device=dev, generator=g),
                          torch.rand(B, Hq, S, device=dev, generator=g) + 0.5], -1)
        out = torch.empty(B, Hq, D, device=dev, dtype=torch.float16)
        lse = torch.empty(B, Hq, device=dev)
        launch = merge_launch(S, D)
        whole = MergeLaunch(max(1, min(MAX_ROWS, 4096 // (next_pow2(S) * next_pow2(D)))), next_pow2(D), 4)
        merge_splits(acc, ml, out, lse, S, True)
        want, _ = merge_splits_ref(acc.cpu(), ml.cpu())
        err = float((out.float().cpu() - want).abs().max())
        times = {}
        for name, how in (("launch", launch), ("whole", whole)):
            def call(how=how):
                merge_splits(acc, ml, out, lse, S, True, launch=how)
            times[name] = sweep_us(call, cuda, args.rep)
        rows_out.append({"batch": B, "heads": Hq, "splits": S, "head_dim": D, "rows": launch.rows,
                         "chunk": launch.chunk, "warps": launch.warps, "us": times["launch"],
                         "us_whole_rows": times["whole"], "max_err": err, "acc_bytes": acc.numel() * 4})
        desc = f"{launch.rows}r/{launch.chunk}d/{launch.warps}w"
        print(f"{B:>4} {Hq:>3} {S:>6} {desc:>14} {times['launch']:8.2f} {times['whole']:15.2f} {err:9.1e}", flush=True)
    record_sweep("decode_merge", argv, args, rows_out, cuda)
    return 0


if __name__ == "__main__":
    sys.exit(main())
