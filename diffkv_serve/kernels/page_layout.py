"""Byte layout of a unified KV page (docs/DESIGN.md "Memory manager").

A page belongs to one (sequence, layer, KV head) and one precision (key bits, value bits). It has six
segments, each 16-byte aligned:

    keys      [T, D] elements of the cache dtype (16-bit precision), packed ints (8/4/2-bit) or e4m3 codes
    values    [T, D] like keys
    key_meta  [T, 2] fp16 scale, zero point   (absent at 16 bits; the zero point is 0 for e4m3 codes)
    val_meta  [T, 2] fp16 scale, zero point   (absent at 16 bits)
    score     [T]    float32 token significance
    position  [T]    int32 token position in its sequence

Score and position exist only on tracked pages (a diffkv cache's high pages, whose policy ranks and moves tokens,
and its low pages where a low token may be pruned: CacheConfig.track_low). A
single-precision cache (fp16, int8, int4, fp8) keeps every token where it was written, in order, and never
reads either, so its pages leave both out: more tokens per byte (K4V4 60 instead of 57 tokens in the bytes of
a 16-token fp16 page, fp8 31 instead of 30).

Values follow the keys directly: at head_dim 128 a key row is a multiple of 32 bytes, so the value rows start on a
32-byte sector like the key rows, and a kernel's 128-byte copy of consecutive rows touches four sectors, not five.

"16 bits" means the unquantized cache dtype (fp16/bf16 on GPU, fp32 allowed on CPU), so its element
size is `full_itemsize`. Every page has the same byte size; tokens per page T follow from the precision.
A format with `float8` stores its 8-bit sides as fp8 e4m3 codes x / scale (diffkv_serve/kernels/quant.py) instead of
integers: the same bytes per token, so paging and page sizes do not depend on the code format.

PageState names the device tensors of a whole pool (pages, page table, section sizes, free list) as the
kernels that manage pages take them; the engine's memory manager (diffkv_serve/engine/kv/pool.py) owns them.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import NamedTuple

import torch

ALIGN = 16
SUPPORTED_BITS = (16, 8, 4, 2)


def _align(n: int) -> int:
    return (n + ALIGN - 1) // ALIGN * ALIGN


def _segment_bytes(tokens: int, head_dim: int, bits: int, full_itemsize: int) -> tuple[int, int]:
    """Bytes of the data segment and of its scale/zero segment for `tokens` tokens."""
    if bits == 16:
        return _align(tokens * head_dim * full_itemsize), 0
    return _align(tokens * head_dim * bits // 8), _align(tokens * 4)


def _page_bytes_needed(tokens: int, head_dim: int, key_bits: int, value_bits: int, full_itemsize: int,
                       tracked: bool = True) -> int:
    kd, km = _segment_bytes(tokens, head_dim, key_bits, full_itemsize)
    vd, vm = _segment_bytes(tokens, head_dim, value_bits, full_itemsize)
    return kd + km + vd + vm + (2 * _align(tokens * 4) if tracked else 0)


def page_bytes_for(block_size: int, head_dim: int, full_itemsize: int, tracked: bool = True) -> int:
    """Page size in bytes: what a full-precision (16/16) page of `block_size` tokens needs (with the score and
    position rows where the pages are tracked)."""
    return _page_bytes_needed(block_size, head_dim, 16, 16, full_itemsize, tracked)


@dataclass(frozen=True)
class PageFormat:
    """Where each segment of a page of one precision starts (byte offsets) and how many tokens it holds."""

    key_bits: int
    value_bits: int
    head_dim: int
    page_bytes: int
    full_itemsize: int
    tokens: int
    k_off: int
    k_meta_off: int
    v_off: int
    v_meta_off: int
    score_segment: int  # byte offsets of the score and position rows; -1 on untracked pages
    pos_segment: int
    float8: bool = False  # 8-bit sides hold e4m3 codes with a scale (zero point 0) instead of integers
    tracked: bool = True  # the page has score and position rows (a diffkv cache's)

    @staticmethod
    def make(key_bits: int, value_bits: int, head_dim: int, page_bytes: int, full_itemsize: int,
             float8: bool = False, tracked: bool = True) -> "PageFormat":
        for name, b in (("key_bits", key_bits), ("value_bits", value_bits)):
            if b not in SUPPORTED_BITS:
                raise ValueError(f"{name}={b}: a page precision uses bits from {SUPPORTED_BITS}")
        if float8 and 8 not in (key_bits, value_bits):
            raise ValueError(f"float8=True: K{key_bits}V{value_bits} has no 8-bit side to store as e4m3")
        if page_bytes % ALIGN:
            raise ValueError(f"page_bytes={page_bytes} must be a multiple of {ALIGN}")
        tokens = 0
        while _page_bytes_needed(tokens + 1, head_dim, key_bits, value_bits, full_itemsize, tracked) <= page_bytes:
            tokens += 1
        if tokens == 0:
            raise ValueError(f"page_bytes={page_bytes} holds no token of K{key_bits}V{value_bits}, head_dim {head_dim}")
        kd, km = _segment_bytes(tokens, head_dim, key_bits, full_itemsize)
        vd, vm = _segment_bytes(tokens, head_dim, value_bits, full_itemsize)
        k_off = 0
        v_off = k_off + kd
        k_meta_off = v_off + vd
        v_meta_off = k_meta_off + km
        score_off = v_meta_off + vm if tracked else -1
        pos_off = score_off + _align(tokens * 4) if tracked else -1
        return PageFormat(key_bits, value_bits, head_dim, page_bytes, full_itemsize, tokens,
                          k_off, k_meta_off, v_off, v_meta_off, score_off, pos_off, float8, tracked)

    def _tracked_segment(self, offset: int, what: str) -> int:
        if not self.tracked:
            raise ValueError(f"{self.name} pages of a single-precision cache hold no {what} rows (tracked=False)")
        return offset

    @property
    def score_off(self) -> int:
        """Byte offset of the float32 score row (tracked pages only)."""
        return self._tracked_segment(self.score_segment, "score")

    @property
    def pos_off(self) -> int:
        """Byte offset of the int32 position row (tracked pages only)."""
        return self._tracked_segment(self.pos_segment, "position")

    @property
    def data_bytes(self) -> int:
        """Bytes the key, value and scale/zero segments take from the page's start: where the score row starts on
        a tracked page; on an untracked one, the bytes past it are never written."""
        return self.v_meta_off + _segment_bytes(self.tokens, self.head_dim, self.value_bits, self.full_itemsize)[1]

    def tracked_words(self) -> tuple[int, int]:
        """(score, position) row offsets in 4-byte words for kernels that take them on every launch and read
        them only on tracked pages; (0, 0) on untracked ones."""
        return (self.score_off // 4, self.pos_off // 4) if self.tracked else (0, 0)

    @property
    def name(self) -> str:
        return f"K{self.key_bits}V{self.value_bits}" + ("-e4m3" if self.float8 else "")

    @property
    def key_float8(self) -> bool:
        """Keys are e4m3 codes."""
        return self.float8 and self.key_bits == 8

    @property
    def value_float8(self) -> bool:
        """Values are e4m3 codes."""
        return self.float8 and self.value_bits == 8

    def side_float8(self, which: str) -> bool:
        """Keys ('k') or values ('v') are e4m3 codes."""
        return self.key_float8 if which == "k" else self.value_float8

    def token_bytes(self) -> float:
        """Bytes per token on a full page of this precision (metadata included)."""
        return self.page_bytes / self.tokens


class PageState(NamedTuple):
    """A pool's device state, as the page-managing kernels (diffkv_serve/kernels/decode_pages.py) update it in place."""

    pool: torch.Tensor  # uint8 [num_pages, page_bytes]
    page_table: torch.Tensor  # int32 [S, L, H, P + 1]
    held_high: torch.Tensor  # int32 [S, L, H]
    held_low: torch.Tensor
    len_high: torch.Tensor
    len_low: torch.Tensor
    free_list: torch.Tensor  # int32 [num_pages + 1]
    counters: torch.Tensor  # int64 [2]: (start, end)
    next_growth: torch.Tensor  # int64 [S]
    low_armed: torch.Tensor  # int32 [S, L, H]: compression_plan's new_low_armed of each head's last step
