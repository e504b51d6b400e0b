"""The CUDA decode kernel (diffkv_serve/kernels/decode_attention/decode_mma.cu) against the Triton kernel the dispatcher would
pick without it (quartered; q8 for K8V8 pages, integer or e4m3) on the same calls, side by side in one run:
CUDA-graph time per call for each precision they both serve, at the Llama-3-8B (32 / 8 heads) and Qwen2.5-1.5B
(12 / 2) head layouts, head_dim 128, fp16 q, 16-token fp16 page size. DiffKV's K8V4 + K4V2 call (half the tokens
in each section) is timed without and with the per-token logits / lse outputs its significance update reads.
Both kernels' split counts are the dispatcher's, and their splits are merged by merge.py's kernel.
Pages hold random normal keys and values quantized as the engine writes them (attention.decode_inputs, the cache
benchmarks/decode_splits.py and decode_stages.py time too): a call's time depends on its codes and scales (the
softmax's running sum is rescaled in the tiles where a query's max grows; random bytes make NaN and infinite
scales, which skip that path). benchmarks/attention.py and the tests check values.

Usage: python benchmarks/decode_kernel_ab.py [--specs K8V4 K4V2 ...] [--shapes 8x4096 32x16384 ...] [--out PATH]
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from attention import decode_inputs, parse_spec  # noqa: E402
from benchmarks._results import write_result  # noqa: E402
from diffkv_serve.kernels.decode_attention import decode_kernel, paged_decode_attention_triton  # noqa: E402
from diffkv_serve.kernels.page_layout import page_bytes_for  # noqa: E402

HEADS = {"llama3-8b": (32, 8), "qwen2.5-1.5b": (12, 2)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--specs", nargs="+", default=["K8V4", "K4V2", "K4V4", "K8V8", "K8V8-e4m3", "K8V4+K4V2"])
    ap.add_argument("--shapes", nargs="+", default=["8x4096", "32x4096", "128x4096", "8x16384", "32x16384"],
                    help="BATCHxSEQ")
    ap.add_argument("--rep", type=float, default=20, help="do_bench_cudagraph rep (ms)")
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("decode_kernel_ab.py times CUDA kernels: it needs a CUDA GPU")
    from triton.testing import do_bench_cudagraph
    from tqdm import tqdm

    dev = torch.device("cuda")
    shapes = [tuple(map(int, s.split("x"))) for s in args.shapes]
    jobs = [(n, spec, B, S) for n in HEADS for spec in args.specs for B, S in shapes]
    rows = []
    for name, spec, B, S in tqdm(jobs, desc="calls"):
        hq, hkv = HEADS[name]
        hi, lo = parse_spec(spec, 128, page_bytes_for(16, 128, 2), 2)
        c = decode_inputs(hi, lo, B, hq, hkv, S, torch.float16, dev, 0)
        pool, pt, lh, ll, q, slots, out = c.pools[0], c.page_table, c.lengths, c.len_low, c.q, c.slots, c.out
        baseline = decode_kernel(hi, lo)  # the Triton kernel serving these pages
        row = dict(heads=name, spec=spec, B=B, S=S, baseline=baseline)
        timed = [("mma_cuda", False), (baseline, False)]  # (kernel, with the logits / lse outputs)
        if lo:  # DiffKV's call: also with the logits / lse outputs
            timed += [("mma_cuda", True), (baseline, True)]
        for k, with_logits in timed:
            logits, lse = (c.logits, c.lse) if with_logits else (None, None)

            def call():
                paged_decode_attention_triton(q, pool, hi, torch.float16, pt, lh, slots, 0, 0.088, max_len=S,
                                              out=out, fmt_low=lo, len_low=ll, logits_out=logits, lse_out=lse,
                                              kernel=k)

            call()
            torch.cuda.synchronize()
            row[k + ("+logits" if with_logits else "")] = round(do_bench_cudagraph(call, rep=args.rep) * 1e3, 2)
        rows.append(row)
        pool = c = None  # frees this cache before the next is built (`call` still names pool: no del)
    print(f"\n{'heads':<14}{'spec':<11}{'B':>5}{'S':>7}{'cuda us':>10}{'triton us':>11}{'(kernel)':>11}{'speedup':>9}"
          f"{'+logits':>10}{'+logits':>10}{'speedup':>9}")
    for r in rows:
        base = r["baseline"]
        line = (f"{r['heads']:<14}{r['spec']:<11}{r['B']:>5}{r['S']:>7}{r['mma_cuda']:>10.1f}{r[base]:>11.1f}"
                f"{base:>11}{r[base] / r['mma_cuda']:>8.2f}x")
        if "mma_cuda+logits" in r:
            line += (f"{r['mma_cuda+logits']:>10.1f}{r[base + '+logits']:>10.1f}"
                     f"{r[base + '+logits'] / r['mma_cuda+logits']:>8.2f}x")
        print(line)
    result = dict(benchmark="decode_kernel_ab", device=torch.cuda.get_device_name(), torch=torch.__version__,
                  command=" ".join(["python benchmarks/decode_kernel_ab.py"] + sys.argv[1:]),
                  timing="do_bench_cudagraph median (us) per call", rows=rows)
    write_result(result, "decode_mma_vs_triton", result["device"], args.out, False)


if __name__ == "__main__":
    main()
