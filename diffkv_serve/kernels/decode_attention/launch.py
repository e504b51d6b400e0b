"""Launch rules of the decode-attention kernels: which kernel serves a page format (decode_kernel), its measured
launch parameters (launch_config, LaunchConfig), the tokens per tile (tile_tokens) and how many ways each
(sequence, KV head) is split along the sequence (choose_num_splits)."""
from __future__ import annotations

from typing import NamedTuple

import torch
import triton

from diffkv_serve.kernels._common import num_sms
from diffkv_serve.kernels.page_layout import PageFormat

# Work in flight per SM that the split count aims for, in warps x (head_dim / 64): a decode program streams one
# (sequence, KV head) serially, so batch x KV heads alone leaves SMs idle or starved of loads. Measured
# (benchmarks/results/decode_splits_H200.json): at SmolLM2's 3 KV heads and head_dim 64, batch 16 ran 3x faster
# split 8 ways than 2 ways, batch 64 1.4x faster split 2 ways than unsplit. On an H100 at the 8B shape (8 KV
# heads, head_dim 128) batch >= 32 is fastest unsplit (2 splits: 9-30% slower) and batch 8 at 4 splits for every
# precision (256 programs on 132 SMs; K8V8 at 16384 tokens 105 us against 129 us at 3 splits, whose 192
# programs leave 72 SMs with one program). 16 = two 4-warp programs of head_dim 128 per SM. The quartered
# kernel's one-warp programs (launch_config) get four times the splits from the same target (batch 8: 16,
# batch 32: 4), which its own sweep confirmed.
TARGET_WARP_DIMS_PER_SM = 16
MAX_SPLITS = 64


class LaunchConfig(NamedTuple):
    block_n: int
    num_warps: int
    num_stages: int
    pure_k: bool = False  # unpacking may be scheduled freely (see tiles.plane_codes)
    pure_v: bool = False
    v_early: bool = False  # value loads issued before the key math
    red: int = 0  # how quartered._attend_section reduces a tile's rows (0: five reductions, 1: two; see there)
    maxnreg: int | None = None  # register cap per thread (ptxas), for more programs per SM
    min_rows: int = 8  # the query group's tile has max(min_rows, next_pow2(group)) rows (see launch_config)
    key_pairs: bool = False  # quartered kernel: quantized keys as uint16 byte pairs against a zero-padded q
    # (head_dim >= 128; see quartered._attend_section)
    wide_block_n: int | None = None  # tokens per tile where a split covers WIDE_SPLIT_TOKENS or more (tile_tokens)


# A split this long keeps a one-warp program in 64-token tiles through its pipeline (5 stages of copies in flight)
# with tiles to spare; a shorter one (batch 8 at 4096 tokens: 16 splits of 256) ran 7% slower in them.
WIDE_SPLIT_TOKENS = 1024


KERNELS = ("f16", "q8", "quartered", "mma_cuda")  # the last: mma_cuda.py, where it can serve the call


def decode_kernel(fmt: PageFormat, fmt_low: PageFormat | None) -> str:
    """Which kernel serves a call: "f16" (16-bit pages only), "q8" (K8V8 pages, integer or e4m3 codes, no low
    section; q8.py) or "quartered" (any integer precision, high + low sections)."""
    if fmt_low is None and fmt.key_bits == fmt.value_bits == 16:
        return "f16"
    if fmt_low is None and fmt.key_bits == fmt.value_bits == 8:
        return "q8"
    return "quartered"


# The q8 kernel's two launches. Measured on an H100 (benchmarks/results/tune_decode_attention_q8_H100.json: K8V8 pages,
# 32 / 8 and 12 / 2 heads, head_dim 128, batch 8-128 x 1k-16k tokens, every split count): narrow programs win where
# the wide launch would cut each sequence into splits shorter than WIDE_SPLIT_TOKENS (64 sequences x KV heads x 1024
# tokens: 14.7 against 16.2 us) and where the grid holds >= 4 wide programs per SM (1,024 of them x 1024 tokens:
# 106.2 against 113.2 us, fewer waves). Elsewhere the wide launch is as fast or faster (64 of them x 16384 tokens in
# 4 wide splits: 104.1 against 107.9 us in 8 narrow ones; one wide program each for 256 of them: 3-11% faster than
# any narrow launch).
Q8_NARROW = LaunchConfig(64, 2, 5)
Q8_WIDE = LaunchConfig(128, 4, 5)
Q8_WIDE_MAX_PROGRAMS_PER_SM = 4


def q8_launch(batch: int, kv_heads: int, max_len: int, device: torch.device, head_dim: int) -> tuple[LaunchConfig, int]:
    """(launch parameters, split count) of the q8 kernel for a call (see Q8_NARROW). Heads narrower than 128 keep
    the wide launch (the sweep was at head_dim 128). The narrow launch's split count is choose_num_splits' for its
    two warps, rounded down to a power of two (33 splits ran 4% slower than 32)."""
    wide_splits = choose_num_splits(batch, kv_heads, max_len, device, Q8_WIDE.block_n, Q8_WIDE.num_warps, head_dim)
    short_splits = wide_splits > 1 and max_len < WIDE_SPLIT_TOKENS * wide_splits
    crowded = wide_splits == 1 and batch * kv_heads >= Q8_WIDE_MAX_PROGRAMS_PER_SM * num_sms(device)
    if head_dim < 128 or not (short_splits or crowded):
        return Q8_WIDE, wide_splits
    splits = choose_num_splits(batch, kv_heads, max_len, device, Q8_NARROW.block_n, Q8_NARROW.num_warps, head_dim)
    return Q8_NARROW, 1 << (splits.bit_length() - 1)


def launch_config(fmt: PageFormat, fmt_low: PageFormat | None, kernel: str | None = None) -> LaunchConfig:
    """Launch parameters of `kernel` (default: decode_kernel's pick), chosen by CUDA-graph timing on H100 / H200
    at the Llama-3-8B shape (32 query / 8 KV heads, head_dim 128) and SmolLM2's (9 / 3, head_dim 64).

    f16: 128-token tiles, 4 warps, 2 stages (99% of HBM bandwidth at B=128 S=4096; other stage counts and
    64-token tiles within 1%). q8: 64-token tiles, 2 warps, 5 stages (the fewest that double-buffer its cp.async
    tiles), at head_dim >= 128; the dispatcher picks it or Q8_WIDE by the grid's size (q8_launch). Quartered,
    head_dim >= 128: one warp per program over 32-token tiles (no cross-warp reductions, four times the splits for
    the same work target), freely scheduled unpacking, one tuple reduction of the row sums
    (red 1), key codes as uint16 pairs (key_pairs), 5 stages for keys of 4 bits or fewer and 3 for wider ones;
    64-token tiles where the high section is K4V2 / K2V2 and a split covers WIDE_SPLIT_TOKENS or more. Smaller
    heads: 2 warps, one stage, value loads first. GQA groups pad to 8 rows (16 for f16).

    Measured alternatives, each slower or no faster (benchmarks/results/decode_variants_H100.json,
    decode_kernel_variants_H200.json, tune_decode_attention_H200.json): 4 warps over 128-token tiles for the
    quartered kernel (1-20% slower); a full-width or transposed-dot path for quantized pages (0.6-0.86x the speed, more
    shared memory per program); value codes unpacked before the shared-memory transpose (5-24% slower); value
    codes as token pairs in the page (fewer instructions, three programs per SM instead of four); the split
    merge done by the last split to finish, or by programmatic dependent launch (within 2%, and slower for many
    splits); split counts that are not powers of two, or twice as many; register caps; 7 stages. Re-measured on an
    H100 at both the GQA 4 (Llama-3-8B) and GQA 6 (Qwen2.5-1.5B) heads for K8V4, K4V2 and mix: twice the splits
    (+1-29%), maxnreg 128 (+2-48%) or 96, value codes unpacked before the transpose (+1-33%) are all slower than
    these defaults, and the automatic split count is within 8% of the best of 1-64 splits at every shape
    (benchmarks/results/decode_splits_gqa6_H100.json). ncu on K4V2 (B32 S16384): registers (179) and shared memory
    (18.9 KB) each cap residency at 8 one-warp programs per SM and a scheduler issues every 1.7 cycles; raising
    residency with 3-4 stages and maxnreg 136-168 was 4-37% slower (spills, lost prefetch). Fewer
    instructions per tile stopped buying time once the loop is bound by fixed-latency dependency waits (ncu,
    K4V2 B=32 S=16384: 57% of issue slots busy)."""
    kernel = kernel or decode_kernel(fmt, fmt_low)
    if kernel == "f16":
        return LaunchConfig(128, 4, 2, min_rows=16)
    if kernel == "q8":
        return Q8_NARROW if fmt.head_dim >= 128 else Q8_WIDE
    if fmt.head_dim >= 128:
        narrow_keys = fmt.key_bits <= 4
        wide = 64 if narrow_keys and fmt.value_bits == 2 else None  # long splits of K4V2 / K2V2
        return LaunchConfig(32, 1, 5 if narrow_keys else 3, pure_k=True, pure_v=True, red=1, key_pairs=True,
                            wide_block_n=wide)
    return LaunchConfig(128, 2, 1, v_early=True)


def tile_tokens(cfg: LaunchConfig, max_len: int, num_splits: int) -> int:
    """Tokens per tile: cfg.wide_block_n where each split may cover WIDE_SPLIT_TOKENS or more (max_len is a bound
    on a head's tokens), else cfg.block_n."""
    if cfg.wide_block_n and max_len >= WIDE_SPLIT_TOKENS * num_splits:
        return cfg.wide_block_n
    return cfg.block_n


def choose_num_splits(batch: int, kv_heads: int, max_len: int, device: torch.device, block_n: int,
                      num_warps: int = 4, head_dim: int = 128) -> int:
    """Splits per (sequence, KV head) so that about TARGET_WARP_DIMS_PER_SM warps x head_dim / 64 run per SM;
    at least one BLOCK_N tile per split (of max_len tokens), at most MAX_SPLITS."""
    if max_len <= 0:
        return 1
    work = batch * kv_heads * num_warps * max(1, head_dim // 64)
    wanted = TARGET_WARP_DIMS_PER_SM * num_sms(device) // max(work, 1)
    return max(1, min(wanted, triton.cdiv(max_len, block_n), MAX_SPLITS))
