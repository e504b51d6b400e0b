"""Runs the hand-written CUDA decode kernel (diffkv_serve/kernels/decode_attention/decode_mma.cu) on the CPU: g++ compiles it
with cuda_emu/warp_emu.h (one-warp blocks as 32 lanes on ucontext stacks, warp-collective operations done with the
PTX fragment layouts) and a C wrapper per variant; `compiled` stands in for mma_cuda._compiled and takes CPU
tensors. Builds are cached by the hash of their sources."""
from __future__ import annotations

import ctypes
import functools
import hashlib
import os
import re
import shutil
import subprocess
import tempfile
from pathlib import Path

import torch

from diffkv_serve.kernels.decode_attention import mma_cuda

HEADER = Path(__file__).with_name("cuda_emu") / "warp_emu.h"
CACHE = Path(os.environ.get("DIFFKV_EMU_CACHE", Path(tempfile.gettempdir()) / "diffkv_cuda_emu"))
KERNEL = "decode_mma"


def compiler() -> str | None:
    return shutil.which(os.environ.get("CXX", "g++"))


def signature(src: str, name: str = KERNEL) -> list[tuple[str, str]]:
    """(C type, name) of each parameter of the kernel `name`."""
    body = re.search(rf"{name}\((.*?)\)\s*\{{", src, re.S).group(1)
    params = []
    for p in body.split(","):
        p = " ".join(p.replace("__restrict__", "").split())
        ctype, pname = p.rsplit(" ", 1)
        if pname.startswith("*"):
            ctype, pname = ctype + "*", pname[1:]
        params.append((ctype.replace(" *", "*"), pname))
    return params


def _ctype(c: str):
    if c.endswith("*"):
        return ctypes.c_void_p
    return {"int": ctypes.c_int, "double": ctypes.c_double, "float": ctypes.c_float}[c]


@functools.cache
def _library(var: mma_cuda.Variant):
    src = mma_cuda.SOURCE.read_text()
    params = signature(src)
    wrapper = (var.defines() + f'#include "{mma_cuda.SOURCE}"\n'
               + f'extern "C" void emu_{KERNEL}(int gx, int gy, int gz, long smem, '
               + ", ".join(f"{t} {n}" for t, n in params) + ") {\n"
               + f"  emu_grid(gx, gy, gz, smem, [&] {{ {KERNEL}(" + ", ".join(n for _, n in params) + "); });\n}\n")
    key = hashlib.sha256((wrapper + src + HEADER.read_text()).encode()).hexdigest()[:16]
    so = CACHE / f"{KERNEL}_{key}.so"
    if not so.exists():
        CACHE.mkdir(parents=True, exist_ok=True)
        cpp = CACHE / f"{KERNEL}_{key}.cpp"
        cpp.write_text(wrapper)
        tmp = so.with_suffix(f".{os.getpid()}.tmp")
        r = subprocess.run([compiler(), "-O1", "-std=c++17", "-shared", "-fPIC", "-DDIFFKV_WARP_EMU", "-include",
                            str(HEADER), str(cpp), "-o", str(tmp)], capture_output=True, text=True)
        if r.returncode:
            raise RuntimeError(f"g++ could not build the emulated kernel ({cpp}):\n{r.stderr[-4000:]}")
        tmp.rename(so)  # atomic: parallel test workers never load a half-written library
    fn = getattr(ctypes.CDLL(str(so)), f"emu_{KERNEL}")
    fn.argtypes = [ctypes.c_int] * 3 + [ctypes.c_long] + [_ctype(t) for t, _ in params]
    fn.restype = None
    return fn, params


def compiled(device, var: mma_cuda.Variant):
    """A kernel callable like torch.cuda._compile_kernel's, over CPU tensors."""
    fn, params = _library(var)

    def launch(grid, block, shared_mem, args):
        assert tuple(block) == (32, 1, 1), block
        assert len(args) == len(params), (len(args), len(params))
        conv = []
        for a, (t, n) in zip(args, params):
            if t.endswith("*"):
                assert isinstance(a, torch.Tensor) and a.device.type == "cpu", n
                conv.append(a.data_ptr())
            else:
                conv.append(a)
        fn(*grid, shared_mem, *conv)

    return launch
