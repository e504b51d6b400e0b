"""Builds paged KV caches of any precision (high section + optional low section) for the kernel tests."""
from __future__ import annotations

import torch

from diffkv_serve.kernels.kv_write import write_kv
from diffkv_serve.kernels.page_layout import PageFormat, page_bytes_for

LAYERS = 2
BLOCK = 16  # page size: a K16V16 page of BLOCK tokens


def formats(spec: str, D: int, isz: int) -> tuple[PageFormat, PageFormat | None]:
    """'K8V4' -> (K8V4, None); 'K8V4+K4V2' -> (K8V4 high, K4V2 low); 'K8V8-e4m3': e4m3 codes (kv_mode fp8);
    all of one page size: BLOCK 16-bit tokens' worth, or N's with an '@N' suffix ('K4V4@6': 21-token pages);
    a '/u' suffix: untracked pages, without score and position rows, as single-precision caches keep them."""
    spec, untracked, _ = spec.partition("/u")
    spec, _, block = spec.partition("@")
    tracked = not untracked
    pb = page_bytes_for(int(block) if block else BLOCK, D, isz, tracked)
    fmts = []
    for name in spec.split("+"):
        name, _, code = name.partition("-")
        kb, vb = name[1:].split("V")
        fmts.append(PageFormat.make(int(kb), int(vb), D, pb, isz, float8=code == "e4m3", tracked=tracked))
    return fmts[0], (fmts[1] if len(fmts) > 1 else None)


def build_cache(fmt_hi, fmt_lo, cache_dtype, Hkv, lens_hi, lens_lo, device, seed, extra_cols=2):
    """lens_hi/lens_lo: per slot a list of per-KV-head lengths (layer 1 uses them shifted down by one).

    Returns pool, page_table [S, L, Hkv, P + 1], len_hi, len_lo (None without fmt_lo), and the written tokens
    k, v {(s, l, h): [n, D] float32 high then low}. Rows never written stay NaN (a kernel must never read them);
    unused page-table entries are -1 or stale page ids.
    """
    g = torch.Generator().manual_seed(seed)
    D = fmt_hi.head_dim
    S = len(lens_hi)

    def per_layer(lens):
        out = torch.zeros(S, LAYERS, Hkv, dtype=torch.int32)
        for s, per_head in enumerate(lens):
            for layer in range(LAYERS):
                out[s, layer] = torch.tensor([max(0, n - layer) for n in per_head])
        return out

    len_hi = per_layer(lens_hi)
    len_lo = per_layer(lens_lo) if fmt_lo is not None else torch.zeros_like(len_hi)
    n_hi = (len_hi + fmt_hi.tokens - 1) // fmt_hi.tokens
    n_lo = (len_lo + fmt_lo.tokens - 1) // fmt_lo.tokens if fmt_lo is not None else torch.zeros_like(n_hi)
    P = int((n_hi + n_lo).max()) + extra_cols
    num_pages = int((n_hi + n_lo).sum()) + 5
    ids = torch.randperm(num_pages, generator=g)  # shuffled: pages of one head are scattered
    pool = torch.empty(num_pages, fmt_hi.page_bytes, dtype=torch.uint8)
    pool.view(torch.float32).fill_(float("nan"))  # as fp16 meta: scale 0, zero NaN
    page_table = torch.where(torch.rand(S, LAYERS, Hkv, P + 1, generator=g) < 0.5, -1,
                             torch.randint(0, num_pages, (S, LAYERS, Hkv, P + 1), generator=g)).to(torch.int32)
    tokens = {}
    nxt = 0
    for s in range(S):
        for layer in range(LAYERS):
            for h in range(Hkv):
                a, b = int(n_hi[s, layer, h]), int(n_lo[s, layer, h])
                page_table[s, layer, h, :a] = ids[nxt:nxt + a].to(torch.int32)
                if b:
                    page_table[s, layer, h, P - b:P] = ids[nxt + a:nxt + a + b].flip(0).to(torch.int32)
                nxt += a + b
    for fmt, lens, low in ((fmt_hi, len_hi, False), (fmt_lo, len_lo, True)):
        if fmt is None:
            continue
        T = fmt.tokens
        for s in range(S):
            for layer in range(LAYERS):
                n = int(lens[s, layer].max())
                if n == 0:
                    continue
                k = torch.randn(n, Hkv, D, generator=g) * 1.5 + torch.randn(Hkv, D, generator=g) * 0.5
                v = torch.randn(n, Hkv, D, generator=g) + 0.3
                j = torch.arange(n)[:, None].expand(n, Hkv)
                cols = (P - 1 - j // T) if low else j // T
                pages = page_table[s, layer][torch.arange(Hkv)[None, :].expand(n, Hkv), cols]
                pages = torch.where(j < lens[s, layer][None, :], pages, -1)
                rows = (j % T).to(torch.int32)
                pos = torch.randint(0, 100_000, (n,), generator=g, dtype=torch.int32)
                scores = torch.rand(n, Hkv, generator=g)
                write_kv(pool, fmt, cache_dtype, k.to(cache_dtype), v.to(cache_dtype), pages.contiguous(), rows,
                         pos, impl="ref", scores=scores)
                for h in range(Hkv):
                    m = int(lens[s, layer, h])
                    tokens.setdefault((s, layer, h), []).append((fmt, pages[:m, h], rows[:m, h]))
    return (pool.to(device), page_table.to(device), len_hi.to(device),
            len_lo.to(device) if fmt_lo is not None else None, tokens)
