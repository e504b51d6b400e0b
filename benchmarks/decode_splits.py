"""Decode attention time vs split count (num_splits) at a model's head shape, inside a CUDA graph.

The split count decides how many programs stream one (sequence, KV head)'s tokens. The dispatcher picks it per
kernel from the batch, the KV heads and the SM count (dispatch.planned_splits); this sweep times every split count
of --splits beside that automatic choice, per precision and (batch, seq), so the rules can be checked at any head
shape: SmolLM2's (9 query / 3 KV heads, head_dim 64), where batch * KV heads alone leaves most SMs idle, or the
Llama-3-8B / Qwen2.5-1.5B heads the CUDA kernel serves (--hq 32 --hkv 8 --head-dim 128).
Times are do_bench_cudagraph medians (a graph of back-to-back calls rotating among cache copies, as in a
CUDA-graph decode step); diffkv rows also write per-token logits and the lse, as the engine's decode does,
and (--score-splits) time the score update that reads them (diffkv_serve/kernels/score_update.py) per split count.

Usage (GPU):  python benchmarks/decode_splits.py --hq 9 --hkv 3 --head-dim 64 --batches 16 64 --seqs 1024 4096
Smoke (CPU):  python benchmarks/decode_splits.py --smoke
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

from diffkv_serve.kernels.decode_attention import paged_decode_attention  # noqa: E402
from diffkv_serve.kernels.decode_attention.dispatch import pick_kernel, planned_splits  # noqa: E402
from diffkv_serve.kernels.score_update import BLOCK_N as SCORE_BLOCK_N  # noqa: E402
from diffkv_serve.kernels.score_update import accumulate_scores_ref, accumulate_scores_triton, choose_score_splits  # noqa: E402


def parse_args(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--precisions", nargs="+", default=["fp16", "K4V4", "mix"], help="names or KxVy[+KxVy]")
    ap.add_argument("--hq", type=int, default=9)
    ap.add_argument("--hkv", type=int, default=3)
    ap.add_argument("--head-dim", type=int, default=64)
    ap.add_argument("--block-size", type=int, default=16, help="page_bytes = a fp16 page of this many tokens")
    ap.add_argument("--batches", type=int, nargs="+", default=[16, 64])
    ap.add_argument("--seqs", type=int, nargs="+", default=[1024, 4096])
    ap.add_argument("--splits", type=int, nargs="+", default=[1, 2, 4, 8, 16, 32])
    ap.add_argument("--score-splits", type=int, nargs="*", default=[1, 2, 4, 8, 16],
                    help="diffkv rows: score-update split counts to time beside its automatic choice")
    ap.add_argument("--rep", type=float, default=20, help="do_bench_cudagraph rep (ms)")
    ap.add_argument("--bandwidth", type=float, default=3.0e12)
    ap.add_argument("--l2-bytes", type=float, default=50e6)
    ap.add_argument("--out", default=None)
    ap.add_argument("--smoke", action="store_true", help="CPU, tiny shape, torch reference timings")
    return ap.parse_args(argv)


def score_sweep(args, pools, fmt_hi, fmt_lo, pt, lens, len_lo, slots, logits, lse, B, S, dev, cuda) -> dict:
    """Score-update time per split count (diffkv_serve/kernels/score_update.py) on the logits the decode call just wrote."""
    block_n = SCORE_BLOCK_N
    auto = choose_score_splits(B, args.hkv, S, dev, block_n)
    times = {}
    for splits in sorted(set(args.score_splits) | {auto}):
        def call(k, splits=splits):
            if not cuda:  # --smoke: the torch reference (split counts are a kernel launch detail)
                return accumulate_scores_ref(pools[k], fmt_hi, pt, lens, slots, 0, logits, lse, fmt_low=fmt_lo,
                                             len_low=len_lo)
            accumulate_scores_triton(pools[k], fmt_hi, pt, lens, slots, 0, logits, lse, fmt_low=fmt_lo,
                                     len_low=len_lo, num_splits=splits, block_n=block_n)
        times[splits] = sweep_us(rotating(call, len(pools)), cuda, args.rep)
    best = min(times, key=times.get)
    print(f"{'score':>6} {B:>4} {S:>6} {auto:>5}  " + "  ".join(f"s={k}:{v:.1f}" for k, v in times.items())
          + f"   {best:>4}", flush=True)
    return {"auto_splits": auto, "us": {str(k): v for k, v in times.items()}, "best_splits": best,
            "auto_us": times[auto], "best_us": times[best]}


def main(argv=None) -> int:
    args = parse_args(argv)
    cuda = torch.cuda.is_available() and not args.smoke
    dev = torch.device("cuda" if cuda else "cpu")
    if args.smoke:
        args.batches, args.seqs, args.splits, args.hq, args.hkv, args.head_dim = [2], [40], [1, 2], 4, 2, 32
        args.score_splits = [1, 2]
    D, dt = args.head_dim, torch.float16
    rows = []
    print(f"{'prec':>6} {'B':>4} {'S':>6} {'auto':>5}  " + "  ".join(f"{'s=' + str(s):>8}" for s in args.splits)
          + "   best  GB/s(best)")
    for prec, fmt_hi, fmt_lo, B, S, c in decode_cases(args.precisions, args.batches, args.seqs, args.hq, args.hkv, D,
                                                     args.block_size, dt, dev, args.l2_bytes if cuda else 0):
        diffkv = fmt_lo is not None
        pools, pt, lens, len_lo, q, slots = c.pools, c.page_table, c.lengths, c.len_low, c.q, c.slots
        out, logits, lse, kv_bytes, qo, n = c.out, c.logits, c.lse, c.kv_bytes, c.qo_bytes, len(c.pools)
        kernel = pick_kernel(fmt_hi, fmt_lo, q, args.hq // args.hkv) if cuda else None
        auto = planned_splits(kernel, fmt_hi, fmt_lo, B, args.hkv, S, dev, D) if cuda else 1
        ref = None
        times = {}
        for splits in args.splits:
            def call(k, splits=splits):
                return paged_decode_attention(q, pools[k], fmt_hi, dt, pt, lens, slots, 0, num_splits=splits,
                                              max_len=S, out=out, fmt_low=fmt_lo, len_low=len_lo,
                                              logits_out=logits, lse_out=lse,
                                              impl="triton" if cuda else "ref")
            ref = agrees_with_first(ref, call(0), f"{prec} B{B} S{S}: num_splits={splits}")
            times[splits] = sweep_us(rotating(call, n), cuda, args.rep)
        best = min(times, key=times.get)
        gbs = (kv_bytes + qo) / (times[best] * 1e-6) / 1e9
        rows.append({"precision": prec, "kernel": kernel, "batch": B, "seq": S, "auto_splits": auto,
                     "us": {str(k): v for k, v in times.items()}, "best_splits": best,
                     "auto_us": times.get(auto), "best_us": times[best], "kv_bytes": kv_bytes,
                     "best_pct_bw": 100 * (kv_bytes + qo) / (times[best] * 1e-6) / args.bandwidth})
        print(f"{prec:>6} {B:>4} {S:>6} {auto:>5}  " + "  ".join(f"{times[s]:8.1f}" for s in args.splits)
              + f"   {best:>4}  {gbs:8.0f}", flush=True)
        if diffkv and args.score_splits:
            rows[-1]["score"] = score_sweep(args, pools, fmt_hi, fmt_lo, pt, lens, len_lo, slots, logits, lse,
                                            B, S, dev, cuda)
    record_sweep("decode_splits", argv, args, rows, cuda)
    return 0


if __name__ == "__main__":
    sys.exit(main())
