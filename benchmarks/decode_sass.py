"""SASS instruction counts of the decode-attention kernels, compiled for an H100 (sm_90) on any machine.

Triton's wheel bundles ptxas and cuobjdump, so the kernels can be compiled for the GPU without one: this script
calls kernels/decode_attention/dispatch.py's launcher on small CPU tensors with Triton's launch intercepted, compiles
each kernel it would have launched the way Triton's runtime does (same argument specialization), and counts
the instructions of the kernel's main loop (its longest backward branch): per tile and per token
(x warps / tile), by opcode. Register moves (IMAD.MOV / MOV), tensor-core mmas (HMMA) and shared-memory loads
are what the ncu profiles of the decode kernels pointed at. Use it to compare kernel variants before spending
GPU time; times still need the GPU (benchmarks/attention.py).

    python benchmarks/decode_sass.py                         # 8B shape: every precision, default configs
    python benchmarks/decode_sass.py --precisions K4V2 --min-rows 16 8
"""
from __future__ import annotations

import argparse
import collections
import json
import os
import re
import subprocess
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
sys.path.insert(0, str(Path(__file__).resolve().parent))
os.environ["TRITON_INTERPRET"] = "0"  # compiled kernels, also where the test suite interprets them

import torch  # noqa: E402
import triton  # noqa: E402
from triton.backends.compiler import GPUTarget  # noqa: E402
from triton.compiler import ASTSource, compile as triton_compile, make_backend  # noqa: E402
from triton.runtime.jit import JITFunction, create_function_from_signature  # noqa: E402

import kernels.decode_attention as da  # noqa: E402
import kernels.decode_attention.dispatch as dispatch  # noqa: E402
from attention import PRECISIONS, build_paged, make_kv, parse_spec  # noqa: E402
from kernels.page_layout import page_bytes_for  # noqa: E402

TARGET = GPUTarget("cuda", 90, 32)
BIN = Path(triton.__file__).parent / "backends" / "nvidia" / "bin"
MOVES = ("IMAD.MOV.U32", "MOV")


def compile_launches(call) -> list:
    """Runs call() with every Triton launch replaced by a compile for TARGET; returns [(kernel name, compiled,
    the launch's keyword arguments: its constexprs)]."""
    backend = make_backend(TARGET)
    compiled = []

    def run(self, *args, grid, warmup, **kwargs):
        binder = create_function_from_signature(self.signature, self.params, backend)
        bound, spec, options = binder(*args, **kwargs)
        options, signature, constexprs, attrs = self._pack_args(backend, kwargs, bound, spec, options)
        compiled.append((self.fn.__name__, triton_compile(ASTSource(self, signature, constexprs, attrs),
                                                          target=TARGET, options=options.__dict__), kwargs))

    saved_run, saved_fp32 = JITFunction.run, dispatch.dot_in_fp32
    JITFunction.run, dispatch.dot_in_fp32 = run, lambda *t: False  # the GPU's fp16 dots, not the interpreter's fp32
    try:
        call()
    finally:
        JITFunction.run, dispatch.dot_in_fp32 = saved_run, saved_fp32
    return compiled


def sass_of(cubin: bytes) -> tuple[list[tuple[int, str]], int]:
    """(address, instruction) of a cubin's code and its registers per thread."""
    with tempfile.NamedTemporaryFile(suffix=".cubin", delete=False) as f:
        f.write(cubin)
    try:
        text = subprocess.run([str(BIN / "cuobjdump"), "-sass", f.name], capture_output=True, text=True,
                              check=True).stdout
        res = subprocess.run([str(BIN / "cuobjdump"), "--dump-resource-usage", f.name], capture_output=True,
                             text=True, check=True).stdout
    finally:
        os.unlink(f.name)
    ins = [(int(a, 16), t.strip()) for a, t in re.findall(r"/\*([0-9a-f]{4,})\*/\s+([^;]*);", text)]
    regs = re.search(r"\bREG:(\d+)", res)
    return ins, int(regs.group(1)) if regs else -1


def main_loop(ins: list[tuple[int, str]]) -> list[str]:
    """Instructions of the longest loop: from a backward branch's target to the branch."""
    best: list[str] = []
    for addr, txt in ins:
        m = re.search(r"\bBRA\b.*?0x([0-9a-f]+)", txt)
        if m and int(m.group(1), 16) < addr:
            body = [t for a, t in ins if int(m.group(1), 16) <= a <= addr]
            best = body if len(body) > len(best) else best
    return best


def opcode(txt: str) -> str:
    return re.sub(r"^@!?U?P\w+\s+", "", txt).split()[0]


def analyze(prec: str, args, min_rows: int | None) -> dict:
    D, Hq, Hkv, S = args.head_dim, args.hq, args.hkv, args.seq
    K, V = make_kv(1, Hkv, S, D, torch.float16, "cpu", 0)
    fh, fl = parse_spec(PRECISIONS.get(prec, prec), D, page_bytes_for(16, D, 2), 2)
    pool, pt, lens, ll = build_paged(K, V, fh, fl, torch.float16, 0, impl="ref")
    q = torch.randn(args.batch, Hq, D, dtype=torch.float16)
    slots = torch.zeros(args.batch, dtype=torch.int32)  # every row reads the one cached sequence
    cfg = da.launch_config(fh, fl)
    if min_rows is not None:
        cfg = cfg._replace(min_rows=min_rows)
    compiled = compile_launches(lambda: da.paged_decode_attention_triton(
        q, pool, fh, torch.float16, pt, lens, slots, 0, D ** -0.5, max_len=args.max_len or S, fmt_low=fl,
        len_low=ll, config=cfg))
    name, ck, launch = compiled[0]  # the attention kernel (a split merge kernel may follow)
    block_n = launch["BLOCK_N"]  # the tiles the launcher picked (da.tile_tokens)
    ins, regs = sass_of(ck.asm["cubin"])
    loop = main_loop(ins)
    ops = collections.Counter(opcode(t) for t in loop)
    warps = ck.metadata.num_warps
    per_token = len(loop) * warps / block_n
    return dict(precision=prec, kernel=name, min_rows=cfg.min_rows, block_n=block_n, num_warps=warps,
                num_stages=cfg.num_stages, registers=regs, shared_bytes=ck.metadata.shared,
                sass_total=len(ins), loop=len(loop), loop_per_token=per_token, hmma=ops.get("HMMA.16816.F32", 0),
                moves=sum(ops.get(m, 0) for m in MOVES), opcodes=dict(ops.most_common()))


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--precisions", nargs="+", default=list(PRECISIONS), help=f"of {list(PRECISIONS)} or a spec")
    ap.add_argument("--hq", type=int, default=32)
    ap.add_argument("--hkv", type=int, default=8)
    ap.add_argument("--head-dim", type=int, default=128)
    ap.add_argument("--batch", type=int, default=128, help="sets the split count (choose_num_splits)")
    ap.add_argument("--seq", type=int, default=512, help="tokens of the small cache built to launch on")
    ap.add_argument("--max-len", type=int, default=4096, help="the length the split count is chosen for")
    ap.add_argument("--min-rows", type=int, nargs="+", default=[None], help="LaunchConfig.min_rows variants")
    ap.add_argument("--smoke", action="store_true", help="one small K4V2 kernel (CI)")
    ap.add_argument("--out", default=None, help="JSON with every row")
    args = ap.parse_args(argv)
    if args.smoke:
        args.precisions, args.hq, args.hkv, args.head_dim, args.seq, args.batch = ["K4V2"], 8, 2, 64, 64, 4
    rows = [analyze(p, args, r) for p in args.precisions for r in args.min_rows]
    print(f"sm_90 SASS, Hq {args.hq} Hkv {args.hkv} D {args.head_dim}, batch {args.batch}, max_len {args.max_len}")
    print(f"{'precision':>10} {'kernel':>22} {'rows':>4} {'regs':>4} {'smem':>6} {'loop':>5} {'/token':>6} "
          f"{'HMMA':>4} {'moves':>5}  top opcodes of the loop")
    for r in rows:
        top = ", ".join(f"{k} {v}" for k, v in list(r["opcodes"].items())[:6])
        print(f"{r['precision']:>10} {r['kernel']:>22} {r['min_rows']:>4} {r['registers']:>4} {r['shared_bytes']:>6} "
              f"{r['loop']:>5} {r['loop_per_token']:>6.1f} {r['hmma']:>4} {r['moves']:>5}  {top}")
    if args.out:
        command = " ".join(["python", "benchmarks/decode_sass.py", *(argv if argv is not None else sys.argv[1:])])
        Path(args.out).write_text(json.dumps(dict(command=command, target="sm_90", triton=triton.__version__,
                                                  rows=rows), indent=1))
        print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
