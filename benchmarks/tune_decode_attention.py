"""Sweep the decode-attention launch configuration (BLOCK_N, num_warps, num_stages, split count) per page precision.

For each head layout, precision and shape it times `paged_decode_attention_triton` under every configuration and
split count (0 = the dispatcher's count for that configuration), and the dispatcher's own launch (config "auto":
launch_config, or q8_launch for K8V8 pages); do_bench median with L2 flushed, or with --graph CUDA-graph replays
(do_bench_cudagraph, as benchmarks/attention.py times its graph column), caches rotated among copies. Every
configuration's output is checked against the torch reference once. It prints the fastest configuration per
precision (geomean over the shapes) and, per shape, the fastest launch beside the dispatcher's. The winners go into
diffkv_serve/kernels/decode_attention/launch.py by hand, with the JSON kept in results/.

Usage (GPU): python benchmarks/tune_decode_attention.py [--heads llama3-8b qwen2.5-1.5b] [--shapes 32x4096 ...]
                 [--splits 0 1 2 4 ...] [--graph] [--out PATH]
Smoke (CPU): TRITON_INTERPRET=1 python benchmarks/tune_decode_attention.py --smoke   (two configurations, tiny shape)
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
from attention import (HEADS, PRECISIONS, build_paged, copies_for, make_kv, parse_spec, read_bytes,  # noqa: E402
                       reference_for, rotating)

from diffkv_serve.kernels.decode_attention import (decode_kernel, launch_config, paged_decode_attention,  # noqa: E402
                                                   paged_decode_attention_triton)
from diffkv_serve.kernels.decode_attention.dispatch import pick_kernel  # noqa: E402
from diffkv_serve.kernels.page_layout import page_bytes_for  # noqa: E402

TOL = 4e-3  # atol = rtol vs impl="ref" (fp16 dots on the same dequantized data)


def parse_args(argv):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--precisions", nargs="+", default=list(PRECISIONS))
    ap.add_argument("--heads", nargs="+", default=["llama3-8b"], choices=list(HEADS))
    ap.add_argument("--splits", type=int, nargs="+", default=[0],
                    help="split counts to try per configuration (0: the dispatcher's count for it)")
    ap.add_argument("--graph", action="store_true", help="time CUDA-graph replays (do_bench_cudagraph)")
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
        args.block_n, args.warps, args.stages, args.splits = [32], [4], [1, 2], [0, 2]
        args.precisions = ["fp16", "mix"]
    args.shapes = [tuple(map(int, s.split("x"))) for s in (args.shapes or ["32x4096", "8x16384", "128x4096"])]
    return args


AUTO = ("auto",)  # the dispatcher's own launch, beside the swept configurations


def main(argv=None) -> int:
    args = parse_args(sys.argv[1:] if argv is None else argv)
    cuda = torch.cuda.is_available() and not args.smoke
    device = torch.device("cuda" if cuda else "cpu")
    D, dt = 128, torch.float16
    page_bytes = page_bytes_for(16, D, 2)
    configs = list(itertools.product(args.block_n, args.warps, args.stages))
    gpu = torch.cuda.get_device_name() if cuda else "cpu"
    print(f"{gpu}: {len(configs)} configurations x {len(args.splits)} split counts x {len(args.precisions)} "
          f"precisions x {len(args.shapes)} shapes x {len(args.heads)} head layouts")
    rows = []
    for heads, (B, S) in itertools.product(args.heads, args.shapes):
        Hq, Hkv, _ = HEADS[heads]
        K, V = make_kv(B, Hkv, S, D, dt, device, seed=B + S)
        q = torch.randn(B, Hq, D, device=device, dtype=dt)
        slots = torch.arange(B, dtype=torch.int32, device=device)
        for prec in args.precisions:
            fmt_hi, fmt_lo = parse_spec(PRECISIONS.get(prec, prec), D, page_bytes, 2)
            pool, pt, lens, len_lo = build_paged(K, V, fmt_hi, fmt_lo, dt, 0, "auto")
            n = copies_for(pool.numel(), int(50e6) if cuda else 0)
            pools = [pool] + [pool.clone() for _ in range(n - 1)]
            kw = dict(max_len=S, fmt_low=fmt_lo, len_low=len_lo)
            ref = paged_decode_attention(q, pool, fmt_hi, dt, pt, lens, slots, 0, impl="ref", **kw)
            auto_ref = reference_for(pick_kernel(fmt_hi, fmt_lo, q, Hq // Hkv), ref, q, pool, fmt_hi, dt, pt, lens,
                                     slots, **kw).float()  # what the dispatcher's pick is held to
            ref = ref.float()
            kv_bytes, qo = read_bytes(fmt_hi, fmt_lo, B, Hq, Hkv, S, 2)
            launches = [(AUTO, 0)] + [(c, sp) for c in configs for sp in args.splits
                                      if sp == 0 or sp <= -(-S // c[0])]  # a split holds at least one tile
            for cfg, sp in launches:
                # a swept configuration is the Triton kernel's: named, or the dispatcher would give the call to the
                # CUDA kernel where that serves it (and drop the configuration)
                over = {} if cfg == AUTO else dict(block_n=cfg[0], num_warps=cfg[1], num_stages=cfg[2],
                                                   kernel=decode_kernel(fmt_hi, fmt_lo))

                def run(k, over=over, sp=sp):
                    return paged_decode_attention_triton(q, pools[k], fmt_hi, dt, pt, lens, slots, 0, D ** -0.5,
                                                         num_splits=sp or None, **over, **kw)
                got = run(0).float()
                want = auto_ref if cfg == AUTO else ref
                err = float((got - want).abs().max())
                if not torch.allclose(got, want, atol=TOL, rtol=TOL):
                    print(f"MISMATCH {heads} {prec} B={B} S={S} config={cfg} splits={sp}: max err {err:.3e}")
                    return 2
                t = _time_us(rotating(run, n), args) if cuda else float("nan")
                rows.append(dict(heads=heads, precision=prec, batch=B, seq=S, config=list(cfg), splits=sp,
                                 time_us=round(t, 2), frac_bw=round((kv_bytes + qo) / (t * 1e-6) / args.bandwidth, 4),
                                 max_err=err))
            del pools, pool
    best = _best_per_precision(rows, args.precisions, configs, cuda, D, page_bytes)
    per_shape = _best_per_shape(rows)
    write_result({"benchmark": "tune_decode_attention", "device": gpu, "timing": "do_bench_cudagraph median" if
                  args.graph else "do_bench median (L2 flushed)", "rows": rows, "best": best, "per_shape": per_shape,
                  "command": "python benchmarks/tune_decode_attention.py " + " ".join(sys.argv[1:])},
                 "tune_decode_attention", gpu, args.out, args.smoke)
    return 0


def _time_us(call, args) -> float:
    import triton.testing
    if args.graph:
        return 1e3 * triton.testing.do_bench_cudagraph(call, rep=args.rep, return_mode="median")
    return 1e3 * triton.testing.do_bench(call, rep=args.rep, return_mode="median")


def _best_per_precision(rows, precisions, configs, cuda, D, page_bytes) -> dict:
    """The configuration with the lowest geomean time over every shape (at the dispatcher's split count)."""
    best = {}
    for prec in precisions:
        def geo(cfg):
            ts = [r["time_us"] for r in rows if r["precision"] == prec and tuple(r["config"]) == cfg
                  and r["splits"] == 0]
            return math.exp(sum(math.log(t) for t in ts) / len(ts)) if cuda and ts else 0.0
        cfg = min(configs, key=geo)
        fmt_hi, fmt_lo = parse_spec(PRECISIONS.get(prec, prec), D, page_bytes, 2)
        current = tuple(launch_config(fmt_hi, fmt_lo)[:3])
        best[prec] = {"block_n": cfg[0], "num_warps": cfg[1], "num_stages": cfg[2], "geomean_us": geo(cfg),
                      "current": list(current), "current_geomean_us": geo(current) if current in configs else None}
        print(f"best {prec:>5}: block_n={cfg[0]} warps={cfg[1]} stages={cfg[2]} ({geo(cfg):.1f} us geomean); "
              f"current {best[prec]['current']}")
    return best


def _best_per_shape(rows) -> list[dict]:
    """Per (heads, precision, batch, seq): the fastest launch against the dispatcher's ("auto")."""
    out = []
    keys = sorted({(r["heads"], r["precision"], r["batch"], r["seq"]) for r in rows})
    print(f"{'heads':<14}{'precision':<10}{'batch':>6}{'seq':>7}{'auto us':>9}{'best us':>9}  best launch")
    for k in keys:
        mine = [r for r in rows if (r["heads"], r["precision"], r["batch"], r["seq"]) == k]
        auto = next(r for r in mine if r["config"] == list(AUTO))
        top = min(mine, key=lambda r: r["time_us"])
        out.append(dict(zip(("heads", "precision", "batch", "seq"), k), auto_us=auto["time_us"],
                        best_us=top["time_us"], best_config=top["config"], best_splits=top["splits"]))
        print(f"{k[0]:<14}{k[1]:<10}{k[2]:>6}{k[3]:>7}{auto['time_us']:>9.1f}{top['time_us']:>9.1f}  "
              f"{top['config']} splits {top['splits'] or 'auto'}")
    return out


if __name__ == "__main__":
    sys.exit(main())
