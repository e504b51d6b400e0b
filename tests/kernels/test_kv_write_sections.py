import os

import pytest
import torch

from diffkv_serve.kernels.kv_write_sections import write_sections
from diffkv_serve.kernels.sections import section_targets
from diffkv_serve.kernels.page_layout import PageFormat, page_bytes_for

DEVICE = os.environ.get("DIFFKV_TEST_DEVICE", "cpu")
# A write is a cast (or the same min-max quantization in both) + copy: identical bytes in every dtype.
DTYPES = [torch.float32] + ([torch.float16, torch.bfloat16] if DEVICE.startswith("cuda") else [])
S, L, P = 5, 3, 16  # sequence slots, layers, page-table columns (+ the trash column)


def _case(cache_dtype, high, low, H, D, seed, low_tracked=True):
    """Random prompt layer: 3 sequences of up to 12 tokens in random slots; each (token, head) high, low or
    pruned; section indices counted per (sequence, head), so destinations are distinct; distinct pages per
    page-table row, some columns unallocated (-1: the write is skipped)."""
    g = torch.Generator().manual_seed(seed)
    isz = torch.empty((), dtype=cache_dtype).element_size()
    pb = page_bytes_for(2, D, isz)
    fh, fl = PageFormat.make(*high, D, pb, isz), PageFormat.make(*low, D, pb, isz, tracked=low_tracked)
    num_pages = S * L * H * P
    table = torch.randperm(num_pages, generator=g).view(S, L, H, P).to(torch.int32)
    table[torch.rand(S, L, H, P, generator=g) < 0.1] = -1
    table = torch.cat([table, torch.full((S, L, H, 1), -1, dtype=torch.int32)], -1)  # column P: trash
    lens = torch.randint(1, 13, (3,), generator=g)
    slots = torch.randperm(S, generator=g)[:3]
    token_slots = slots.repeat_interleave(lens).to(torch.int32)
    seq_of_token = torch.arange(3).repeat_interleave(lens)
    N = int(lens.sum())
    cls = torch.randint(0, 3, (N, H), generator=g)  # 0 high, 1 low, 2 pruned
    idx = {}
    for c in (0, 1):
        hit = (cls == c).long()
        before = torch.zeros_like(hit)
        for s in range(3):  # index among the sequence's tokens of this class, per head
            m = seq_of_token == s
            before[m] = torch.cumsum(hit[m], 0) - hit[m]
        idx[c] = torch.where(cls == c, before, -1).to(torch.int32)
    right_of = torch.randint(8, P + 1, (S, L, H), generator=g, dtype=torch.int32)  # >= 8: sections never meet
    pool = torch.empty(num_pages, pb, dtype=torch.uint8)
    pool.view(torch.float32).fill_(float("nan"))
    k = (torch.randn(N, H, D, generator=g) * 2 + 0.5).to(cache_dtype)
    v = (torch.randn(N, H, D, generator=g) - 0.25).to(cache_dtype)
    pos = torch.randint(0, 10_000, (N,), generator=g, dtype=torch.int32)
    scores = torch.rand(N, H, generator=g) + 0.5
    drop = torch.tensor([False, True, False])
    to = lambda *ts: [t.to(DEVICE) for t in ts]  # noqa: E731
    return (fh, fl, *to(pool, k, v, pos, scores, table, token_slots, idx[0], idx[1], right_of, drop, seq_of_token))


def test_section_targets_match_a_loop():
    torch.manual_seed(0)
    H, T = 3, 4
    table = torch.randint(-1, 100, (S, L, H, P + 1), dtype=torch.int32)
    token_slots = torch.randint(0, S, (20,))
    idx = torch.randint(-1, 30, (20, H))
    right = torch.randint(1, P + 1, (20, H))
    for r in (None, right, P):
        page, row = section_targets(table, token_slots, idx, T, 1, r)
        for n in range(20):
            for h in range(H):
                j = int(idx[n, h])
                if j < 0:
                    assert page[n, h] == -1 and row[n, h] == 0
                    continue
                rr = None if r is None else (P if isinstance(r, int) else int(r[n, h]))
                col = j // T if rr is None else min(max(rr - 1 - j // T, 0), P)
                assert page[n, h] == table[token_slots[n], 1, h, col] and row[n, h] == j % T


@pytest.mark.parametrize("cache_dtype", DTYPES)
@pytest.mark.parametrize("high,low,low_tracked", [((8, 4), (4, 2), True), ((16, 16), (8, 8), True),
                                                  ((8, 8), (4, 4), True), ((4, 8), (2, 4), True),
                                                  ((8, 4), (4, 2), False), ((8, 4), (4, 4), False)])
@pytest.mark.parametrize("reserved,dropped", [(True, False), (False, True), (False, False)])
def test_write_sections_triton_equals_reference(cache_dtype, high, low, low_tracked, reserved, dropped):
    """low_tracked False: low pages without score and position rows (CacheConfig.track_low)."""
    H, D = 3, 32
    fh, fl, pool, k, v, pos, scores, table, tslots, ih, il, right_of, drop, seq = _case(
        cache_dtype, high, low, H, D, seed=high[0] * 7 + low[1] + reserved + 2 * dropped, low_tracked=low_tracked)
    if not low_tracked:  # the low rows' bytes stop where an untracked page's data ends
        assert not fl.tracked and fl.data_bytes <= fl.page_bytes
    kw = dict(right_of=right_of if reserved else None, drop=drop if dropped else None,
              seq_of_token=seq if dropped else None)
    pools = {impl: pool.clone() for impl in ("triton", "ref")}
    for impl, p in pools.items():
        write_sections(p, fh, fl, cache_dtype, k, v, pos, scores, table, 1, tslots, ih, il, impl=impl, **kw)
    assert torch.equal(pools["triton"], pools["ref"]), "triton differs from the reference"
    # The reference wrote every kept (token, head) with an allocated page, and nothing else.
    written = (pools["ref"] != pool).any(1)  # pages with a changed byte
    expect = set()
    P_ = table.shape[-1] - 1
    for n in range(k.shape[0]):
        if dropped and drop[seq[n]]:
            continue
        for h in range(H):
            for j, fmt, low_side in ((int(ih[n, h]), fh, False), (int(il[n, h]), fl, True)):
                if j < 0:
                    continue
                r = int(right_of[tslots[n], 1, h]) if reserved else P_
                col = (r - 1 - j // fmt.tokens) if low_side else j // fmt.tokens
                page = int(table[tslots[n], 1, h, col])
                if page >= 0:
                    expect.add(page)
    assert set(torch.nonzero(written).flatten().tolist()) == expect
    assert expect, "the case wrote nothing"


def test_write_sections_checks_arguments():
    fh, fl, pool, k, v, pos, scores, table, tslots, ih, il, right_of, drop, seq = _case(
        torch.float32, (8, 4), (4, 2), 2, 32, seed=1)
    with pytest.raises(ValueError, match="drop and seq_of_token"):
        write_sections(pool, fh, fl, torch.float32, k, v, pos, scores, table, 0, tslots, ih, il, drop=drop)
    other = PageFormat.make(4, 2, 32, fh.page_bytes * 2, 4)
    with pytest.raises(ValueError, match="share page_bytes"):
        write_sections(pool, fh, other, torch.float32, k, v, pos, scores, table, 0, tslots, ih, il, impl="triton")
