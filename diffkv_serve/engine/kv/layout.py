"""The geometry of one rank's KV pool (docs/DESIGN.md "Page format"): the cache's shape and how many pages a
byte budget buys. The bytes inside a page are diffkv_serve/kernels/page_layout.py's (kernels read them too)."""
from __future__ import annotations

from dataclasses import dataclass

import torch

from diffkv_serve.kernels.page_layout import page_bytes_for


@dataclass(frozen=True)
class CacheShape:
    num_layers: int
    num_kv_heads: int
    head_dim: int
    max_seqs: int
    max_model_len: int
    block_size: int  # tokens per full-precision page



def cdiv(a, b):
    return -(-a // b)


def pages_for_bytes(shape: CacheShape, cache_dtype: torch.dtype, nbytes: float, tracked: bool = True) -> int:
    """Pages of nbytes bytes in total (at least one); tracked: pages with score and position rows."""
    itemsize = torch.tensor([], dtype=cache_dtype).element_size()
    return max(1, int(nbytes // page_bytes_for(shape.block_size, shape.head_dim, itemsize, tracked)))
