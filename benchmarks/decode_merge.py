"""The split merge of decode attention on its own (diffkv_serve/kernels/decode_attention/merge.py): CUDA-graph
microseconds per call at the engine's decode shapes, with the rows per program it picks (rows_per_program) beside
one (sequence, query head) row a program, and the error against its torch reference.

Usage (GPU):  python benchmarks/decode_merge.py [--shapes 128x12x4 32x12x16 ...]
Smoke (CPU):  python benchmarks/decode_merge.py --smoke
"""
from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path

if "--smoke" in sys.argv:  # the Triton interpreter runs the kernel on the CPU; it must be chosen before the import
    os.environ.setdefault("TRITON_INTERPRET", "1")

import torch  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from _results import record_sweep  # noqa: E402

from diffkv_serve.kernels.decode_attention.merge import merge_splits, merge_splits_ref, rows_per_program  # noqa: E402

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
    print(f"{'B':>4} {'Hq':>3} {'splits':>6} {'rows':>4} {'us':>8} {'us (1 row)':>10} {'max err':>9}")
    for shape in args.shapes:
        B, Hq, S = (int(x) for x in shape.split("x"))
        D = args.head_dim
        g = torch.Generator(device=dev).manual_seed(0)
        acc = torch.randn(B, Hq, S, D, device=dev, generator=g)
        ml = torch.stack([torch.randn(B, Hq, S, device=dev, generator=g),
                          torch.rand(B, Hq, S, device=dev, generator=g) + 0.5], -1)
        out = torch.empty(B, Hq, D, device=dev, dtype=torch.float16)
        lse = torch.empty(B, Hq, device=dev)
        rows = rows_per_program(S, D)
        merge_splits(acc, ml, out, lse, S, True)
        want, _ = merge_splits_ref(acc.cpu(), ml.cpu())
        err = float((out.float().cpu() - want).abs().max())
        times = {}
        for r in (rows, 1):
            def call(r=r):
                merge_splits(acc, ml, out, lse, S, True, rows=r)
            if cuda:
                import triton.testing
                times[r] = 1e3 * triton.testing.do_bench_cudagraph(call, rep=args.rep, return_mode="median")
            else:
                t0 = time.perf_counter()
                call()
                times[r] = 1e6 * (time.perf_counter() - t0)
        rows_out.append({"batch": B, "heads": Hq, "splits": S, "head_dim": D, "rows": rows, "us": times[rows],
                         "us_one_row": times[1], "max_err": err, "acc_bytes": acc.numel() * 4})
        print(f"{B:>4} {Hq:>3} {S:>6} {rows:>4} {times[rows]:8.2f} {times[1]:10.2f} {err:9.1e}", flush=True)
    record_sweep("decode_merge", argv, args, rows_out, cuda)
    return 0


if __name__ == "__main__":
    sys.exit(main())
