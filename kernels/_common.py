"""Small helpers shared by the kernel wrappers (dispatch, pool views, format checks)."""
from __future__ import annotations

import os

import torch

from kernels.page_layout import PageFormat

IMPLS = ("auto", "triton", "ref")


def interpreting() -> bool:
    """True when Triton runs through its CPU interpreter (set before triton is imported)."""
    return os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")


def use_triton(impl: str, *tensors: torch.Tensor) -> bool:
    """"auto" picks Triton for CUDA tensors and the torch reference otherwise."""
    if impl not in IMPLS:
        raise ValueError(f"impl={impl!r}: expected one of {IMPLS}")
    if impl == "auto":
        return all(t.is_cuda for t in tensors)
    return impl == "triton"


def dot_in_fp32(*tensors: torch.Tensor) -> bool:
    """tl.dot on bf16/fp16 is unreliable in the interpreter, so dots run on fp32 operands there."""
    return interpreting() or not all(t.is_cuda for t in tensors)


def next_pow2(n: int) -> int:
    return 1 << max(0, (int(n) - 1).bit_length())


def check_supported(fmt: PageFormat, cache_dtype: torch.dtype) -> None:
    """Only full-precision (16/16) pages exist so far; quantized pages come later."""
    if fmt.key_bits != 16 or fmt.value_bits != 16:
        raise NotImplementedError(f"page format {fmt.name}: only K16V16 pages are implemented")
    itemsize = cache_dtype.itemsize
    if itemsize != fmt.full_itemsize:
        raise ValueError(f"cache dtype {cache_dtype} has {itemsize} bytes, format expects {fmt.full_itemsize}")


def pool_views(pool: torch.Tensor, cache_dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Typed views of the same byte pool: (cache dtype, int32, float32), each [num_pages, page_bytes // size]."""
    if pool.dtype != torch.uint8 or pool.dim() != 2 or not pool.is_contiguous():
        raise ValueError("pool must be a contiguous uint8 tensor [num_pages, page_bytes]")
    return pool.view(cache_dtype), pool.view(torch.int32), pool.view(torch.float32)


def num_sms(device: torch.device) -> int:
    if device.type == "cuda":
        return torch.cuda.get_device_properties(device).multi_processor_count
    return 132  # H100 SXM: sizes the CPU interpreter's grids like the real target
