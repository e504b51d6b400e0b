"""Small helpers shared by the kernel wrappers (dispatch, pool views, format checks)."""
from __future__ import annotations

import os

import torch

from diffkv_serve.kernels.page_layout import PageFormat

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


def check_supported(fmt: PageFormat, cache_dtype: torch.dtype, for_triton: bool = False) -> None:
    """Any precision of {16, 8, 4, 2} bits for keys and values; 16 bits = the cache dtype.

    Quantized sides need head_dim divisible by 8 // bits (planar packing); the Triton kernels also need a
    power-of-two head_dim >= 16 for them (a packed row unpacks by a reshape, without padding).
    """
    from diffkv_serve.kernels.quant import check_quant_dims

    itemsize = cache_dtype.itemsize
    if itemsize != fmt.full_itemsize:
        raise ValueError(f"cache dtype {cache_dtype} has {itemsize} bytes, format expects {fmt.full_itemsize}")
    D = fmt.head_dim
    for bits in (fmt.key_bits, fmt.value_bits):
        if bits == 16:
            continue
        check_quant_dims(bits, D)
        if for_triton and (D < 16 or D & (D - 1)):
            raise ValueError(f"{fmt.name}: the Triton kernels need a power-of-two head_dim >= 16, got {D}")


def seg_offsets(fmt: PageFormat, which: str) -> tuple[int, int]:
    """Kernel units of the keys ('k') or values ('v') segment: (offset in cache-dtype elements, 0) at 16 bits,
    else (offset in bytes, meta offset in fp16 units)."""
    bits = fmt.key_bits if which == "k" else fmt.value_bits
    off = fmt.k_off if which == "k" else fmt.v_off
    if bits == 16:
        return off // fmt.full_itemsize, 0
    return off, (fmt.k_meta_off if which == "k" else fmt.v_meta_off) // 2


def pool_views(pool: torch.Tensor, cache_dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Typed views of the same byte pool: (cache dtype, int32, float32), each [num_pages, page_bytes // size]."""
    if pool.dtype != torch.uint8 or pool.dim() != 2 or not pool.is_contiguous():
        raise ValueError("pool must be a contiguous uint8 tensor [num_pages, page_bytes]")
    return pool.view(cache_dtype), pool.view(torch.int32), pool.view(torch.float32)


def num_sms(device: torch.device) -> int:
    if device.type == "cuda":
        return torch.cuda.get_device_properties(device).multi_processor_count
    return 132  # H100 SXM: sizes the CPU interpreter's grids like the real target
