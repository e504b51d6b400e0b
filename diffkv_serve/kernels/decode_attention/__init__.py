"""Paged decode attention (one new token per sequence over its paged KV cache, any precision, high + low
sections), split along the sequence and merged by log-sum-exp.

    dispatch.py   the entry points: paged_decode_attention (Triton or the reference) and
                  paged_decode_attention_triton (validation, kernel choice, launch, split merge)
    reference.py  the plain-torch reference
    launch.py     which kernel serves which pages, launch parameters, tile sizes, split counts
    f16.py        the full-width kernel for 16-bit pages
    q8.py         the full-width kernel for K8V8 pages (integer or e4m3 codes)
    quartered.py  the kernel for every other precision and for high + low sections
    mma_cuda.py   a hand-written CUDA kernel (decode_mma.cu) for 4/8-bit keys, 2/4-bit values, one or two
                  sections, on CUDA GPUs; picked over quartered.py wherever it can serve the call
    merge.py      the split merge kernel
    tiles.py      Triton helpers the kernels share
"""
from diffkv_serve.kernels.decode_attention import mma_cuda
from diffkv_serve.kernels.decode_attention.dispatch import paged_decode_attention, paged_decode_attention_triton
from diffkv_serve.kernels.decode_attention.launch import (KERNELS, MAX_SPLITS, TARGET_WARP_DIMS_PER_SM, WIDE_SPLIT_TOKENS,
                                             LaunchConfig, choose_num_splits, decode_kernel, launch_config,
                                             tile_tokens)
from diffkv_serve.kernels.decode_attention.reference import gather_section_ref, paged_decode_attention_ref

__all__ = [
    "mma_cuda", "KERNELS", "MAX_SPLITS", "TARGET_WARP_DIMS_PER_SM", "WIDE_SPLIT_TOKENS", "LaunchConfig", "choose_num_splits",
    "decode_kernel", "gather_section_ref", "launch_config", "paged_decode_attention", "paged_decode_attention_ref",
    "paged_decode_attention_triton", "tile_tokens",
]
