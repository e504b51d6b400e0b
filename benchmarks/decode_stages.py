"""The CUDA decode kernel with one tile in flight a program against two, at each split count, inside a CUDA graph.

decode_mma.cu keeps two cp.async tiles in flight a program, or one (mma_cuda.one_stage): one stage halves a
program's shared memory, so more programs reside a SM (K8V8 6 -> 12, K8V4 and DiffKV's two sections 8 -> 12), and
a grid of (sequence, KV head) pairs that overfills the two-stage residents may fit in one wave. This sweep times
both stage counts at every split count of --splits beside the automatic pick (mma_cuda.one_stage and
mma_cuda.num_splits), per precision and (batch, seq), at a model's heads (default Llama-3-8B's: 32 query / 8 KV
heads, head_dim 128: batch 128 is 1,024 pairs, over the 792 two-stage K8V8 programs of a 132-SM H100 / H200).
Times are do_bench_cudagraph medians; mix rows also write the per-token logits and the lse, as the engine does.

Usage (GPU):  python benchmarks/decode_stages.py --batches 128 160 192 --seqs 1024 4096 16384
Smoke (CPU):  python benchmarks/decode_stages.py --smoke   (the torch reference stands in for the kernel)
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from _results import record_sweep  # noqa: E402
from attention import agrees_with_first, decode_cases, rotating, sweep_us  # noqa: E402

from diffkv_serve.kernels.decode_attention import mma_cuda, paged_decode_attention  # noqa: E402
from diffkv_serve.kernels.decode_attention.merge import merge_splits  # noqa: E402
from diffkv_serve.kernels.decode_attention.tiles import LOG2E  # noqa: E402


def parse_args(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--precisions", nargs="+", default=["K8V8", "fp8", "K8V4", "mix"],
                    help="names (attention.py's PRECISIONS) or KxVy[+KxVy]")
    ap.add_argument("--hq", type=int, default=32)
    ap.add_argument("--hkv", type=int, default=8)
    ap.add_argument("--block-size", type=int, default=16, help="page_bytes = a fp16 page of this many tokens")
    ap.add_argument("--batches", type=int, nargs="+", default=[128, 160, 192])
    ap.add_argument("--seqs", type=int, nargs="+", default=[1024, 4096, 16384])
    ap.add_argument("--splits", type=int, nargs="+", default=[1, 2, 4])
    ap.add_argument("--rep", type=float, default=20, help="do_bench_cudagraph rep (ms)")
    ap.add_argument("--l2-bytes", type=float, default=50e6)
    ap.add_argument("--out", default=None)
    ap.add_argument("--smoke", action="store_true", help="CPU, tiny shape, torch reference timings")
    args = ap.parse_args(argv)
    if min(args.splits) < 1:
        ap.error("--splits: each count must be >= 1")
    return args


def main(argv=None) -> int:
    args = parse_args(argv)
    cuda = torch.cuda.is_available() and not args.smoke
    dev = torch.device("cuda" if cuda else "cpu")
    if args.smoke:
        args.batches, args.seqs, args.splits, args.hq, args.hkv = [2], [80], [1, 2], 4, 2
    D, dt = mma_cuda.HEAD_DIM, torch.float16
    configs = [(s, n) for s in (2, 1) for n in args.splits]
    rows = []
    print(f"{'prec':>6} {'B':>4} {'S':>6} {'auto':>6}  " + "  ".join(f"{f'{s}st/{n}':>8}" for s, n in configs)
          + "    best  auto/best")
    for prec, fmt_hi, fmt_lo, B, S, c in decode_cases(args.precisions, args.batches, args.seqs, args.hq, args.hkv, D,
                                                     args.block_size, dt, dev, args.l2_bytes if cuda else 0):
        diffkv = fmt_lo is not None
        pools, pt, lens, len_lo, q, slots = c.pools, c.page_table, c.lengths, c.len_low, c.q, c.slots
        out, logits, lse = c.out, c.logits, c.lse
        var = mma_cuda.variant(fmt_hi, fmt_lo, False, diffkv)
        auto = (mma_cuda.stages_for(var, B, args.hkv, dev), mma_cuda.num_splits(fmt_hi, fmt_lo, B, args.hkv, S, dev))
        times, ref = {}, None
        for stages, splits in sorted(set(configs) | {auto}):
            mid_acc = torch.empty(B, args.hq, splits, D, device=dev) if splits > 1 else out
            mid_ml = torch.empty(B, args.hq, splits, 2, device=dev) if splits > 1 else out

            def call(k, stages=stages, splits=splits, mid_acc=mid_acc, mid_ml=mid_ml):
                if not cuda:  # --smoke: the torch reference (stages and splits are launch details)
                    return paged_decode_attention(q, pools[k], fmt_hi, dt, pt, lens, slots, 0, max_len=S,
                                                  out=out, fmt_low=fmt_lo, len_low=len_lo, logits_out=logits,
                                                  lse_out=lse, impl="ref")
                mma_cuda.launch_mma(q, pools[k], fmt_hi, fmt_lo, pt, lens, len_lo if diffkv else lens, slots,
                                    out, mid_acc, mid_ml, logits, lse, 0, D ** -0.5 * LOG2E, splits,
                                    stages=stages)
                if splits > 1:
                    merge_splits(mid_acc, mid_ml, out, lse if lse is not None else out, splits,
                                 lse is not None)
                return out
            ref = agrees_with_first(ref, call(0), f"{prec} B{B} S{S}: {stages} stage(s), {splits} split(s)")
            times[(stages, splits)] = sweep_us(rotating(call, len(pools)), cuda, args.rep)
        best = min(times, key=times.get)
        rows.append({"precision": prec, "batch": B, "seq": S, "pairs": B * args.hkv,
                     "us": {f"{s}st/{n}": v for (s, n), v in times.items()},
                     "auto": f"{auto[0]}st/{auto[1]}", "auto_us": times[auto],
                     "best": f"{best[0]}st/{best[1]}", "best_us": times[best],
                     "kv_bytes": c.kv_bytes, "qo_bytes": c.qo_bytes})
        print(f"{prec:>6} {B:>4} {S:>6} {rows[-1]['auto']:>6}  "
              + "  ".join(f"{times[cfg]:8.1f}" for cfg in configs)
              + f"  {rows[-1]['best']:>6}  {times[auto] / times[best]:8.3f}", flush=True)
    record_sweep("decode_stages", argv, args, rows, cuda)
    return 0


if __name__ == "__main__":
    sys.exit(main())
