"""KV memory of a configuration as a fraction of an fp16 cache, metadata included.

Bytes per token of a precision are those of the engine's unified page at a 16-bit cache dtype (what the
GPU uses): quantized keys and values, their fp16 scale/zero and, on a diffkv cache's tracked pages, the f32
significance score and the int32 position, divided by the tokens a page holds (single-precision caches' pages
have no score or position rows). So the numbers do not depend on the machine (on CPU the engine keeps its 16-bit pages in
fp32). The fp16 reference is 2 bytes x (K + V) x head_dim per token and KV head, which the fp16 cache is.
"""
from __future__ import annotations

from diffkv_serve.engine.config import CacheConfig
from evals.configs import is_uniform_diffkv
from diffkv_serve.kernels.page_layout import PageFormat, page_bytes_for

HALF = 2  # bytes of a 16-bit element


def token_bytes(key_bits: int, value_bits: int, head_dim: int, block_size: int = 16, tracked: bool = True,
                rows_tracked: bool | None = None) -> float:
    """tracked: the pool's pages are sized for score and position rows (a diffkv cache's, CacheConfig.tracks_tokens);
    rows_tracked: these pages have them (default: tracked; a diffkv cache's low pages may not,
    CacheConfig.tracks_low_tokens)."""
    page = page_bytes_for(block_size, head_dim, HALF, tracked)
    rows = tracked if rows_tracked is None else rows_tracked
    return PageFormat.make(key_bits, value_bits, head_dim, page, HALF, tracked=rows).token_bytes()


def fp16_token_bytes(head_dim: int) -> int:
    return 2 * HALF * head_dim


def memory_fraction(cache: CacheConfig, head_dim: int, tokens_high: int, tokens_low: int, tokens_pruned: int) -> float:
    """Bytes of the kept tokens over what an fp16 cache would use for all of them (per KV head)."""
    total = tokens_high + tokens_low + tokens_pruned
    if total <= 0:
        raise ValueError("memory_fraction: no tokens")
    high, low = cache.precisions()
    # A uniform KxVy run as diffkv costs a single-precision cache's bytes: the alternative DiffKV is measured
    # against, not DiffKV's own.
    tracked = cache.tracks_tokens() and not is_uniform_diffkv(cache.model_dump())
    used = tokens_high * token_bytes(*high, head_dim, cache.block_size, tracked)
    if tokens_low:
        used += tokens_low * token_bytes(*low, head_dim, cache.block_size, tracked, cache.tracks_low_tokens())
    return used / (total * fp16_token_bytes(head_dim))
