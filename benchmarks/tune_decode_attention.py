"""Sweep the decode-attention launch configuration (BLOCK_N, num_warps, num_stages) per page precision.

For each precision and shape it times `paged_decode_attention_triton` under every configuration (do_bench
median, L2 flushed, caches rotated like benchmarks/attention.py), checks every configuration's output against
the torch reference once, and prints the fastest configuration per precision (geomean time over the shapes).
The winners go into diffkv_serve/kernels/decode_attention/launch.py:launch_config by hand, with the JSON kept in results/.

Usage (GPU): python benchmarks/tune_decode_attention.py [--shapes 32x4096 8x16384 128x4096] [--out PATH]
Smoke (CPU): python benchmarks/tune_decode_attention.py --smoke   (interpreter, two configurations, tiny shape)
"""
from __future__ import annotations

import argparse
import itertools
import math
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from _results import write_result  # noqa: E402
from attention import PRECISIONS, build_paged, copies_for, make_kv, parse_spec, read_bytes, rotating  # noqa: E402

from diffkv_serve.kernels.decode_attention import launch_config, paged_decode_attention, paged_decode_attention_triton  # noqa: E402
from diffkv_serve.kernels.page_layout import page_bytes_for  # noqa: E402

TOL = 4e-3  # atol = rtol vs impl="ref" (fp16 dots on the same dequantized data)


def parse_args(argv):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--precisions", nargs="+", default=list(PRECISIONS))
    ap.add_argument("--shapes", nargs="+", default=None, help="BxS, default 32x4096 8x16384 128x4096")
    ap.add_argument("--block-n", type=int, nargs="+", default=[32, 64, 128])
    ap.add_argument("--warps", type=int, nargs="+", default=[4, 8])
    ap.add_argument("--stages", type=int, nargs="+", default=[1, 2])
    ap.add_argument("--rep", type=float, default=30, help="do_bench rep (ms)")
    ap.add_argument("--bandwidth", type=float, default=3.0e12)
    ap.add_argument("--out", default=None)
    ap.add_argument("--smoke", action="store_true")
    args = ap.parse_args(argv)
    if args.smoke:
        args.shapes = args.shapes or ["2x100"]
        args.block_n, args.warps, args.stages = [32], [4], [1, 2]
        args.precisions = ["fp16", "mix"]
    args.shapes = [tuple(map(int, s.split("x"))) for s in (args.shapes or ["32x4096", "8x16384", "128x4096"])]
    return args


def main(argv=None) -> int:
    args = parse_args(sys.argv[1:] if argv is None else argv)
    cuda = torch.cuda.is_available() and not args.smoke
    device = torch.device("cuda" if cuda else "cpu")
    Hq, Hkv, D, dt = 32, 8, 128, torch.float16
    page_bytes = page_bytes_for(16, D, 2)
    configs = list(itertools.product(args.block_n, args.warps, args.stages))
    gpu = torch.cuda.get_device_name() if cuda else "cpu"
    print(f"{gpu}: {len(configs)} configurations x {len(args.precisions)} precisions x {len(args.shapes)} shapes")
    rows = []
    for B, S in args.shapes:
        K, V = make_kv(B, Hkv, S, D, dt, device, seed=B + S)
        q = torch.randn(B, Hq, D, device=device, dtype=dt)
        slots = torch.arange(B, dtype=torch.int32, device=device)
        for prec in args.precisions:
            fmt_hi, fmt_lo = parse_spec(PRECISIONS.get(prec, prec), D, page_bytes, 2)
            pool, pt, lens, len_lo = build_paged(K, V, fmt_hi, fmt_lo, dt, 0, "auto")
            n = copies_for(pool.numel(), int(50e6) if cuda else 0)
            pools = [pool] + [pool.clone() for _ in range(n - 1)]
            kw = dict(max_len=S, fmt_low=fmt_lo, len_low=len_lo)
            ref = paged_decode_attention(q, pool, fmt_hi, dt, pt, lens, slots, 0, impl="ref", **kw).float()
            kv_bytes, qo = read_bytes(fmt_hi, fmt_lo, B, Hq, Hkv, S, 2)
            for bn, w, st in configs:
                def run(k, bn=bn, w=w, st=st):
                    return paged_decode_attention_triton(q, pools[k], fmt_hi, dt, pt, lens, slots, 0, D ** -0.5,
                                                         block_n=bn, num_warps=w, num_stages=st, **kw)
                got = run(0).float()
                err = float((got - ref).abs().max())
                if not torch.allclose(got, ref, atol=TOL, rtol=TOL):
                    print(f"MISMATCH {prec} B={B} S={S} block_n={bn} warps={w} stages={st}: max err {err:.3e}")
                    return 2
                if cuda:
                    import triton.testing
                    t = 1e3 * triton.testing.do_bench(rotating(run, n), rep=args.rep, return_mode="median")
                else:
                    t = float("nan")
                rows.append(dict(precision=prec, batch=B, seq=S, block_n=bn, num_warps=w, num_stages=st,
                                 time_us=t, frac_bw=(kv_bytes + qo) / (t * 1e-6) / args.bandwidth, max_err=err))
                print(f"  {prec:>5} B={B:<4} S={S:<6} n={bn:<4} w={w} s={st}: {t:8.1f} us "
                      f"{100 * rows[-1]['frac_bw']:5.1f}% BW  err {err:.1e}")
            del pools, pool
    best = {}
    for prec in args.precisions:
        def geo(cfg):
            ts = [r["time_us"] for r in rows if r["precision"] == prec and (r["block_n"], r["num_warps"],
                                                                           r["num_stages"]) == cfg]
            return math.exp(sum(math.log(t) for t in ts) / len(ts)) if cuda else 0.0
        cfg = min(configs, key=geo)
        fmt_hi, fmt_lo = parse_spec(PRECISIONS.get(prec, prec), D, page_bytes, 2)
        best[prec] = {"block_n": cfg[0], "num_warps": cfg[1], "num_stages": cfg[2], "geomean_us": geo(cfg),
                      "current": list(launch_config(fmt_hi, fmt_lo)[:3]),
                      "current_geomean_us": geo(tuple(launch_config(fmt_hi, fmt_lo)[:3]))
                      if tuple(launch_config(fmt_hi, fmt_lo)[:3]) in configs else None}
        print(f"best {prec:>5}: block_n={cfg[0]} warps={cfg[1]} stages={cfg[2]} ({geo(cfg):.1f} us geomean); "
              f"current {best[prec]['current']}")
    write_result({"benchmark": "tune_decode_attention", "device": gpu, "rows": rows, "best": best,
                  "command": "python benchmarks/tune_decode_attention.py " + " ".join(sys.argv[1:])},
                 "tune_decode_attention", gpu, args.out, args.smoke)
    return 0


if __name__ == "__main__":
    sys.exit(main())
