"""diffkv_serve/kernels/decode_pages.py: the fused decode-step page work equals the torch reference on random states.

A state is a small memory manager whose heads hold random section lengths (some exactly at a page boundary, so
they need a page), pages filled with random tokens, a free list wrapped around its end, and padding rows on
the dummy slot; a plan is random per head over every Algorithm 1 outcome (nothing, victim demoted / pruned,
the window's token appended to low / replacing a low token / pruned), or the real compression_plan.
"""
import os
import random

import pytest
import torch

from diffkv_serve.engine.kv.layout import CacheShape
from diffkv_serve.engine.kv.pool import MemoryManager
from diffkv_serve.kernels.compression_plan import compression_plan
from diffkv_serve.kernels.decode_pages import decode_pages
from diffkv_serve.kernels.kv_write import write_kv

pytestmark = pytest.mark.filterwarnings("ignore:Conversion of an array with ndim:DeprecationWarning")
DEVICE = os.environ.get("DIFFKV_TEST_DEVICE", "cpu")
# Page ids, lengths and counters are integers; moves are byte copies or a deterministic requantization
# (enable_fp_fusion off): every implementation must give identical bytes.
TOL = 0
L, H, D, S = 2, 3, 16, 6


def _state(seed: int, high=(8, 4), low=(4, 2), batch=4, pad=2, layers=L, heads=H, low_tracked=True):
    rng = random.Random(seed)
    torch.manual_seed(seed)
    shape = CacheShape(num_layers=layers, num_kv_heads=heads, head_dim=D, max_seqs=S, max_model_len=64, block_size=4)
    mm = MemoryManager(shape, 35 * layers * heads, torch.float32, DEVICE, high=high, low=low, low_tracked=low_tracked)
    T_hi = mm.fmt_high.tokens
    T_lo = mm.fmt_low.tokens if low else 1
    # Move the free list's pointers near its end, so this step's pages wrap around.
    mm.counters[0] = 3 * mm.num_pages - 7
    mm.counters[1] = mm.counters[0] + mm.num_pages  # all free
    mm.free_list[:mm.num_pages] = torch.randperm(mm.num_pages, dtype=torch.int32)
    slots = [mm.alloc_slot() for _ in range(batch)]
    st = torch.tensor(slots, device=DEVICE)
    lh = torch.tensor([[[rng.choice([1, T_hi - 1, T_hi, T_hi + 1, 2 * T_hi, rng.randint(1, 3 * T_hi)])
                         for _ in range(heads)] for _ in range(layers)] for _ in slots], dtype=torch.int32)
    ll = torch.tensor([[[rng.choice([0, 1, T_lo, T_lo - 1, rng.randint(0, 2 * T_lo)]) if low else 0
                         for _ in range(heads)] for _ in range(layers)] for _ in slots], dtype=torch.int32)
    need_h = ((lh + T_hi - 1) // T_hi).to(DEVICE)
    need_l = ((ll + T_lo - 1) // T_lo).to(DEVICE)
    mm.grow(st, need_h, need_l, int((need_h + need_l).max()))
    mm.len_high[st], mm.len_low[st] = lh.to(DEVICE), ll.to(DEVICE)
    # Every row of every held page gets a random token (its own format), a position and a score.
    for fmt, held, from_right in ((mm.fmt_high, mm.held_high, False), (mm.fmt_low, mm.held_low, True)):
        if fmt is None:
            continue
        for s in slots:
            for layer in range(layers):
                for h in range(heads):
                    for c in range(int(held[s, layer, h])):
                        col = mm.max_pages - 1 - c if from_right else c
                        page = mm.page_table[s, layer, h, col]
                        n = fmt.tokens
                        k, v = torch.randn(n, 1, D, device=DEVICE) * 2, torch.randn(n, 1, D, device=DEVICE) + 0.5
                        pages = page.view(1, 1).expand(n, 1).contiguous()
                        rows = torch.arange(n, dtype=torch.int32, device=DEVICE).view(n, 1)
                        pos = torch.randint(0, 40, (n,), dtype=torch.int32, device=DEVICE)
                        write_kv(mm.pool, fmt, torch.float32, k, v, pages, rows, pos,  # scores only on tracked pages
                                 scores=torch.rand(n, 1, device=DEVICE) * 0.2 if fmt.tracked else None)
    slots_b = torch.tensor(slots + [mm.dummy_slot] * pad, dtype=torch.int32, device=DEVICE)
    seq_len = torch.tensor([int(lh[i].max()) + 5 for i in range(batch)] + [0] * pad, dtype=torch.int32,
                           device=DEVICE)
    return mm, slots_b, seq_len


def _random_plan(mm, slots, seq_len, seed):
    """A plan with every outcome of Algorithm 1 (random per head); padding rows do nothing."""
    rng = random.Random(seed)
    B, L, H = slots.numel(), mm.shape.num_layers, mm.shape.num_kv_heads
    f = {k: torch.full((B, L, H), -1, dtype=torch.int32) for k in ("high_hole", "to_low_src", "low_dst")}
    lh, ll = mm.len_high[slots.long()].cpu(), mm.len_low[slots.long()].cpu()
    new_h, new_l = lh.clone(), ll.clone()
    for b in range(B):
        for layer in range(L):
            for h in range(H):
                n_h, n_l = int(lh[b, layer, h]), int(ll[b, layer, h])
                if int(seq_len[b]) == 0 or n_h == 0:
                    continue
                j = rng.randrange(n_h)
                kind = rng.choice(["none", "demote", "prune", "append", "replace", "drop"])
                if kind == "replace" and n_l == 0:
                    kind = "append"
                if kind == "none":
                    continue
                f["high_hole"][b, layer, h] = j
                new_h[b, layer, h] = n_h - 1
                if kind in ("demote", "append"):
                    f["to_low_src"][b, layer, h], f["low_dst"][b, layer, h] = j, n_l
                    new_l[b, layer, h] = n_l + 1
                elif kind == "replace":
                    f["to_low_src"][b, layer, h], f["low_dst"][b, layer, h] = j, rng.randrange(n_l)
    armed = torch.tensor([[[rng.randint(0, 1) for _ in range(H)] for _ in range(L)] for _ in range(B)],
                         dtype=torch.int32)
    f.update(new_len_high=new_h, new_len_low=new_l, new_low_armed=armed)
    return {k: v.to(DEVICE) for k, v in f.items()}


def _snapshot(mm):
    return {name: getattr(mm, name).clone() for name in
            ("pool", "page_table", "held_high", "held_low", "len_high", "len_low", "free_list", "counters",
             "next_growth", "low_armed")}


def _run(mm, before, slots, seq_len, plan, impl):
    for name, t in before.items():
        getattr(mm, name).copy_(t)
    out = decode_pages(mm.page_state, mm.fmt_high, mm.fmt_low if plan is not None else None, mm.cache_dtype, slots,
                       seq_len, plan, impl=impl)
    return out, _snapshot(mm)


def _check_equal(mm, slots, seq_len, plan, grows=True):
    before = _snapshot(mm)
    (p_ref, r_ref), ref = _run(mm, before, slots, seq_len, plan, "ref")
    (p_tri, r_tri), tri = _run(mm, before, slots, seq_len, plan, "triton")
    assert torch.equal(p_tri, p_ref) and torch.equal(r_tri, r_ref), "write targets differ"
    for name in ref:
        if name == "free_list":  # the trash cell takes whatever masked lanes wrote
            assert torch.equal(tri[name][:-1], ref[name][:-1]), name
        elif name == "page_table":  # column P is the trash cell
            assert torch.equal(tri[name][..., :-1], ref[name][..., :-1]), name
        else:
            assert (tri[name].to(torch.int64) - ref[name].to(torch.int64)).abs().max() <= TOL, name
    # The step did something: pages handed out, tokens moved, the new tokens have targets.
    assert int(ref["counters"][0]) > int(before["counters"][0]) or not grows
    assert not torch.equal(ref["pool"], before["pool"]) or plan is None
    real = seq_len > 0
    assert (p_ref[:, real] >= 0).all() and (p_ref[:, ~real] == -1).all()
    return ref


@pytest.mark.parametrize("seed,layers,heads", [(0, L, H), (1, L, H), (2, L, H), (3, 3, 20)])
def test_random_plan_matches_reference(seed, layers, heads):
    """(3 layers x 20 heads: a layer's heads span two of the kernel's 16-head blocks.)"""
    mm, slots, seq_len = _state(seed, layers=layers, heads=heads)
    _check_equal(mm, slots, seq_len, _random_plan(mm, slots, seq_len, seed))


@pytest.mark.parametrize("seed", [4, 5])
def test_untracked_low_pages_match_reference(seed):
    """Low pages without score and position rows (CacheConfig.track_low): a token moved down writes only its K/V
    rows there, and nothing past them."""
    mm, slots, seq_len = _state(seed, low_tracked=False)
    assert not mm.fmt_low.tracked and mm.fmt_high.tracked
    _check_equal(mm, slots, seq_len, _random_plan(mm, slots, seq_len, seed))


@pytest.mark.parametrize("high,low", [((8, 4), (4, 2)), ((16, 16), (4, 2)), ((8, 8), (8, 4))])
def test_formats_and_real_plan(high, low):
    """Other section formats (the identity configuration's K16V16 high section among them), with the plan
    Algorithm 1 itself makes for these random scores."""
    mm, slots, seq_len = _state(7, high, low)
    B, window, T = slots.numel(), 2, mm.fmt_high.tokens
    # Each head holds the token leaving the window (position N - 1 - window) somewhere in its high section.
    rng = random.Random(7)
    pos = mm.pool.view(torch.int32)
    for b in range(B):
        s, c = int(slots[b]), int(seq_len[b]) - 1 - window
        for layer in range(L):
            for h in range(H):
                n = int(mm.len_high[s, layer, h])
                if c >= 0 and n:
                    j = rng.randrange(n)
                    pos[int(mm.page_table[s, layer, h, j // T]), mm.fmt_high.pos_off // 4 + j % T] = c
    plan = compression_plan(mm.pool, mm.fmt_high, mm.fmt_low, mm.page_table, mm.len_high, mm.len_low, slots,
                            torch.full((B,), 2, dtype=torch.int32, device=DEVICE), seq_len,
                            torch.full((B,), 1.0, device=DEVICE), torch.full((B,), 0.3, device=DEVICE), window,
                            impl="ref")
    actions = set(plan["action"].flatten().tolist())
    assert len(actions - {0, 1}) >= 2, f"the plan should move tokens: actions {actions}"
    _check_equal(mm, slots, seq_len, plan, grows=False)


@pytest.mark.parametrize("seed", range(2))
def test_single_precision_matches_reference(seed):
    mm, slots, seq_len = _state(seed, high=(4, 4), low=None)
    ref = _check_equal(mm, slots, seq_len, None)
    mm.check_invariants(live_slots=[int(s) for s in slots if int(s) != mm.dummy_slot])
    assert ref["len_high"][slots[0].long()].min() >= 2  # every head grew by the new token


def test_pages_stay_consistent():
    """After the step the memory manager's invariants hold: no page both free and held, none lost."""
    mm, slots, seq_len = _state(11)
    plan = _random_plan(mm, slots, seq_len, 11)
    decode_pages(mm.page_state, mm.fmt_high, mm.fmt_low, mm.cache_dtype, slots, seq_len, plan, impl="triton")
    mm.check_invariants(live_slots=[int(s) for s in slots if int(s) != mm.dummy_slot])
    real = slots[seq_len > 0].long()
    assert torch.equal(mm.next_growth[real], mm.decode_growth(real))  # what the scheduler reads next step


@pytest.mark.parametrize("impl", ["ref", "triton"])
def test_growth_bound_without_low_growth(impl):
    """A policy that never demotes (budget): the next growth counts only full high sides, so heads with an empty
    low section stop reserving a page each step; with low growth the empty ones the plan armed count too (the
    lazy low rule lets only those open a low page next step)."""
    counts = {}
    for low_grows in (True, False):
        mm, slots, seq_len = _state(5)
        mm.len_low.zero_()  # every low section empty (held pages stay: the invariants are not what is tested)
        plan = _random_plan(mm, slots, seq_len, 5)
        plan["to_low_src"].fill_(-1)
        plan["low_dst"].fill_(-1)
        plan["new_len_low"].zero_()
        n = plan["new_low_armed"].numel()  # every other head armed: both kinds among the empty low sections
        plan["new_low_armed"] = (torch.arange(n, device=DEVICE) % 2).to(torch.int32).view_as(plan["new_len_low"])
        decode_pages(mm.page_state, mm.fmt_high, mm.fmt_low, mm.cache_dtype, slots, seq_len, plan,
                     low_grows=low_grows, impl=impl)
        real = slots[seq_len > 0].long()
        hi_full = mm.len_high[real] >= mm.held_high[real] * mm.fmt_high.tokens
        armed = mm.low_armed[real] != 0
        assert torch.equal(armed, plan["new_low_armed"][seq_len > 0] != 0)  # stored for the next step's plan
        no_room = mm.held_low[real] == 0  # empty and no low page held (an empty held page has room)
        counts[low_grows] = mm.next_growth[real].cpu()
        want = (hi_full | (armed & no_room)) if low_grows else hi_full
        assert torch.equal(counts[low_grows], want.sum((1, 2)).cpu())
        if low_grows:  # the host's bound agrees (this pool was built for a policy that demotes)
            assert torch.equal(counts[low_grows], mm.decode_growth(real).cpu())
        assert bool((~hi_full & no_room & armed).any()) and bool((~hi_full & no_room & ~armed).any())
    assert (counts[False] < counts[True]).any()


def test_plan_needs_low_format():
    mm, slots, seq_len = _state(0)
    with pytest.raises(ValueError, match="plan and fmt_low"):
        decode_pages(mm.page_state, mm.fmt_high, None, mm.cache_dtype, slots, seq_len,
                     _random_plan(mm, slots, seq_len, 0))
