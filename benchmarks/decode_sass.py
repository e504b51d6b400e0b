"""SASS instruction counts of the decode-attention kernels, compiled for an H100 (sm_90) on any machine.

Triton's wheel bundles ptxas and cuobjdump, so the kernels can be compiled for the GPU without one: this script
calls diffkv_serve/kernels/decode_attention/dispatch.py's launcher on small CPU tensors with Triton's launch intercepted, compiles
each kernel it would have launched the way Triton's runtime does (same argument specialization), and counts
the instructions of the kernel's main loop (its longest backward branch): per tile and per token
(x warps / tile), by opcode, and the instructions laid out before that loop (a program's setup: what a short
split pays besides its tiles). Register moves (IMAD.MOV / MOV), tensor-core mmas (HMMA, and IMMA: the CUDA
kernel's integer q.k) and shared-memory loads
are what the ncu profiles of the decode kernels pointed at. Use it to compare kernel variants before spending
GPU time; times still need the GPU (benchmarks/attention.py).

    python benchmarks/decode_sass.py                         # 8B shape: every precision, default configs
    python benchmarks/decode_sass.py --precisions K4V2 --min-rows 16 8

With NVRTC at hand (the nvidia-cuda-nvrtc-cu12 wheel, or NVRTC_LIBRARY=/path/libnvrtc.so.12), the CUDA decode
kernel (diffkv_serve/kernels/decode_attention/decode_mma.cu) is compiled for sm_90 too and counted the same way, one row per
precision it serves (mix: DiffKV's call, with the logits; its main loop is the high section's, `loop_low` the
low section's).
"""
from __future__ import annotations

import argparse
import collections
import ctypes
import datetime
import glob
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

import diffkv_serve.kernels.decode_attention as da  # noqa: E402
import diffkv_serve.kernels.decode_attention.dispatch as dispatch  # noqa: E402
from diffkv_serve.kernels.decode_attention import mma_cuda  # noqa: E402
from attention import PRECISIONS, build_paged, make_kv, parse_spec  # noqa: E402
from diffkv_serve.kernels.page_layout import page_bytes_for  # noqa: E402

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


def loop_spans(ins: list[tuple[int, str]]) -> list[tuple[int, int]]:
    """Every loop's (first, last) address (a backward branch's target, the branch), longest first (a stable sort:
    among loops of one length, the first in the code comes first)."""
    out = []
    for addr, txt in ins:
        m = re.search(r"\bBRA\b.*?0x([0-9a-f]+)", txt)
        if m and int(m.group(1), 16) < addr:
            out.append((int(m.group(1), 16), addr))
    return sorted(out, key=lambda span: len([a for a, _ in ins if span[0] <= a <= span[1]]), reverse=True)


def loops(ins: list[tuple[int, str]]) -> list[list[str]]:
    """Every loop's instructions, longest first (loop_spans' order)."""
    return [[t for a, t in ins if lo <= a <= hi] for lo, hi in loop_spans(ins)]


def main_loop(ins: list[tuple[int, str]]) -> list[str]:
    """Instructions of the longest loop."""
    found = loops(ins)
    return found[0] if found else []


def before_main_loop(ins: list[tuple[int, str]]) -> int:
    """Instructions laid out before the main loop: a program's setup (query preparation, the first tiles' copies)."""
    spans = loop_spans(ins)
    return sum(1 for a, _ in ins if a < spans[0][0]) if spans else len(ins)


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
                sass_total=len(ins), before_loop=before_main_loop(ins), loop=len(loop), loop_per_token=per_token,
                hmma=ops.get("HMMA.16816.F32", 0), imma=_imma(ops),
                moves=sum(ops.get(m, 0) for m in MOVES), opcodes=dict(ops.most_common()))


def _imma(ops: collections.Counter) -> int:
    """Integer mmas of a loop (IMMA.16832.U8.S8 / .U8.U8: the CUDA kernel's q.k)."""
    return sum(v for k, v in ops.items() if k.startswith("IMMA"))


def nvrtc():
    """libnvrtc (NVRTC_LIBRARY, the nvidia-cuda-nvrtc wheel, or the system's), or None."""
    paths = [os.environ.get("NVRTC_LIBRARY", "")]
    for site in sys.path:
        paths += sorted(glob.glob(os.path.join(site, "nvidia", "cuda_nvrtc", "lib", "libnvrtc.so*")))
    paths += ["libnvrtc.so.12", "libnvrtc.so"]
    for p in paths:
        if p and "builtins" not in p:
            try:
                return ctypes.CDLL(p)
            except OSError:
                continue
    return None


def nvrtc_version(lib) -> str | None:
    if lib is None:
        return None
    major, minor = ctypes.c_int(), ctypes.c_int()
    lib.nvrtcVersion(ctypes.byref(major), ctypes.byref(minor))
    return f"{major.value}.{minor.value}"


def cuda_cubin(lib, source: str) -> bytes:
    """decode_mma.cu (with a variant's #defines) compiled by NVRTC into an sm_90 cubin."""
    prog = ctypes.c_void_p()
    if lib.nvrtcCreateProgram(ctypes.byref(prog), source.encode(), b"decode_mma.cu", 0, None, None):
        raise RuntimeError("nvrtcCreateProgram failed")
    opts = [b"-arch=sm_90", b"-std=c++17"]
    rc = lib.nvrtcCompileProgram(prog, len(opts), (ctypes.c_char_p * len(opts))(*opts))
    size = ctypes.c_size_t()
    if rc:
        lib.nvrtcGetProgramLogSize(prog, ctypes.byref(size))
        log = ctypes.create_string_buffer(size.value)
        lib.nvrtcGetProgramLog(prog, log)
        raise RuntimeError(f"NVRTC could not compile decode_mma.cu:\n{log.value.decode()}")
    lib.nvrtcGetCUBINSize(prog, ctypes.byref(size))
    cubin = ctypes.create_string_buffer(size.value)
    lib.nvrtcGetCUBIN(prog, cubin)
    lib.nvrtcDestroyProgram(ctypes.byref(prog))
    return cubin.raw


def analyze_cuda(lib, prec: str, args) -> dict:
    """The CUDA kernel's variant for this precision (mix: with logits, as DiffKV calls it)."""
    fh, fl = parse_spec(PRECISIONS.get(prec, prec), args.head_dim, page_bytes_for(16, args.head_dim, 2), 2)
    var = mma_cuda.variant(fh, fl, False, fl is not None)
    ins, regs = sass_of(cuda_cubin(lib, var.defines() + mma_cuda.SOURCE.read_text()))
    found = loops(ins)
    main, low = found[0], (found[1] if fl is not None and len(found) > 1 else [])
    ops = collections.Counter(opcode(t) for t in main)
    return dict(precision=prec, kernel="decode_mma", min_rows=None, block_n=mma_cuda.TILE, num_warps=1,
                num_stages=mma_cuda.STAGES, registers=regs, shared_bytes=var.shared_bytes, sass_total=len(ins),
                before_loop=before_main_loop(ins),
                loop=len(main), loop_per_token=len(main) / mma_cuda.TILE, loop_low=len(low) or None,
                hmma=ops.get("HMMA.16816.F32", 0), imma=_imma(ops), moves=sum(ops.get(m, 0) for m in MOVES),
                opcodes=dict(ops.most_common()))


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
    lib = nvrtc() if args.head_dim == mma_cuda.HEAD_DIM else None
    if lib is None:
        print("CUDA kernel: no NVRTC here (or head_dim != 128): its rows are left out")
    else:
        for p in args.precisions:
            fh, fl = parse_spec(PRECISIONS.get(p, p), args.head_dim, page_bytes_for(16, args.head_dim, 2), 2)
            reasons = [mma_cuda._format_reason(f, w) for f, w in ((fh, "high"), (fl, "low")) if f is not None]
            if not any(reasons):  # the CUDA kernel serves these pages
                rows.append(analyze_cuda(lib, p, args))
    print(f"sm_90 SASS, Hq {args.hq} Hkv {args.hkv} D {args.head_dim}, batch {args.batch}, max_len {args.max_len}")
    print(f"{'precision':>10} {'kernel':>22} {'rows':>4} {'regs':>4} {'smem':>6} {'setup':>5} {'loop':>5} {'/token':>6} "
          f"{'HMMA':>4} {'IMMA':>4} {'moves':>5}  top opcodes of the loop")
    for r in rows:
        top = ", ".join(f"{k} {v}" for k, v in list(r["opcodes"].items())[:6])
        print(f"{r['precision']:>10} {r['kernel']:>22} {str(r['min_rows'] or '-'):>4} {r['registers']:>4} "
              f"{r['shared_bytes']:>6} {r['before_loop']:>5} "
              f"{r['loop']:>5} {r['loop_per_token']:>6.1f} {r['hmma']:>4} {r['imma']:>4} {r['moves']:>5}  {top}")
    if args.out:
        command = " ".join(["python", "benchmarks/decode_sass.py", *(argv if argv is not None else sys.argv[1:])])
        Path(args.out).write_text(json.dumps(dict(command=command, target="sm_90", triton=triton.__version__,
                                                  nvrtc=nvrtc_version(lib), rows=rows,
                                                  date=datetime.date.today().isoformat()), indent=1))
        print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
