"""The hand-written CUDA decode kernel for K4V2 pages (k4v2_mma.cu): when it serves a call (usable), how it is
compiled (NVRTC through torch.cuda._compile_kernel, once per device and q dtype) and launched (launch_k4v2).

It reads what the quartered Triton kernel reads and computes the same function (reference: reference.py), at
0.84-1.07 of the bandwidth floor where the Triton kernel reached 0.69-0.91 (benchmarks/attention.py, H100). It
serves the high section only, without the per-token logits / lse outputs: every other call stays with Triton.
"""
from __future__ import annotations

import functools
from pathlib import Path

import torch

from kernels.page_layout import PageFormat

SOURCE = Path(__file__).with_name("k4v2_mma.cu")
TILE = 64  # tokens per tile (k4v2_mma.cu); a tile spans at most two pages, so pages must hold TILE or more
MAX_GROUP = 8  # query heads per KV head: the mma's N
STAGES = 2  # cp.async tiles in flight; with MIN_PROGRAMS, fixes registers (167) and shared memory (13 KB)
MIN_PROGRAMS = 12  # one-warp programs per SM the register allocation must allow (__launch_bounds__)


def usable(fmt: PageFormat, has_low: bool, q: torch.Tensor, want_logits: bool, want_lse: bool) -> str | None:
    """None if the CUDA kernel can serve this call, else why not (tests and benchmarks print it)."""
    if not q.is_cuda or torch.version.hip:
        return "not a CUDA device"
    if torch.cuda.get_device_capability(q.device) < (8, 0):
        return "needs sm_80 or newer (cp.async, m16n8k16 mma, movmatrix)"
    if (fmt.key_bits, fmt.value_bits) != (4, 2) or fmt.float8:
        return f"{fmt.name} pages (serves K4V2 only)"
    if has_low:
        return "a low section"
    if want_logits or want_lse:
        return "per-token logits / lse outputs"
    if fmt.head_dim != 128:
        return f"head_dim {fmt.head_dim} (serves 128)"
    if fmt.tokens < TILE:
        return f"{fmt.tokens} tokens per page (needs {TILE} or more)"
    if q.dtype not in (torch.float16, torch.bfloat16):
        return f"q dtype {q.dtype}"
    return None


@functools.cache
def _compiled(device: torch.device, bf16: bool):
    with torch.cuda.device(device):
        # Settings as #defines: _compile_kernel's option list differs between torch versions.
        src = (f"#define STAGES {STAGES}\n#define MINB {MIN_PROGRAMS}\n#define Q_BF16 {int(bf16)}\n"
               + SOURCE.read_text())
        return torch.cuda._compile_kernel(src, "decode_k4v2")


def shared_bytes() -> int:
    return STAGES * TILE * (64 + 32 + 4 + 4)


def launch_k4v2(q, pool, fmt: PageFormat, page_table, lengths, slots, out, mid_acc, mid_ml, layer: int,
                qk_scale: float, num_splits: int) -> None:
    """One warp per (batch entry, KV head, split) over the high section; with num_splits > 1 it writes mid_acc
    [B, Hq, num_splits, D] / mid_ml [B, Hq, num_splits, 2] (log2-domain max, sum) for merge.merge_splits, else
    the normalized output into out."""
    B, Hq, _ = q.shape
    Hkv = page_table.shape[2]
    group = Hq // Hkv
    if group > MAX_GROUP:
        raise ValueError(f"launch_k4v2: {group} query heads per KV head (at most {MAX_GROUP})")
    kernel = _compiled(q.device, q.dtype == torch.bfloat16)
    kernel(grid=(B, Hkv, num_splits), block=(32, 1, 1), shared_mem=shared_bytes(), args=[
        q, pool, page_table, lengths, slots, out, mid_acc, mid_ml,
        q.stride(0), q.stride(1), out.stride(0), out.stride(1),
        page_table.stride(0), page_table.stride(1), page_table.stride(2),
        lengths.stride(0), lengths.stride(1), lengths.stride(2),
        layer, float(qk_scale), Hq, group, num_splits, fmt.tokens, fmt.page_bytes,
        fmt.k_off, fmt.k_meta_off, fmt.v_off, fmt.v_meta_off])
