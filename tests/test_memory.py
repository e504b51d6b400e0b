"""The memory manager never loses or double-frees a page, alone and under the engine's scheduling."""
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from diffkv_serve.engine.kv.layout import CacheShape
from diffkv_serve.engine.kv.pool import MemoryManager

SHAPE = CacheShape(num_layers=2, num_kv_heads=3, head_dim=16, max_seqs=4, max_model_len=64, block_size=4)


def test_prefix_sum_allocation_fills_each_head_in_order():
    mm = MemoryManager(SHAPE, 200, torch.float32, "cpu")
    a, b = mm.alloc_slot(), mm.alloc_slot()
    mm.reserve(torch.tensor([a, b]), torch.tensor([9, 4]), max_new_pages=3)
    T = mm.fmt.tokens
    assert mm.held[a].eq(-(-9 // T)).all() and mm.held[b].eq(1).all()
    # Heads take consecutive ranges of the free list, in (slot, layer, head) order.
    first = mm.page_table[a, 0, 0, :3].tolist()
    assert first == [0, 1, 2] and mm.page_table[a, 0, 1, 0].item() == 3
    assert mm.free_pages() == 200 - 6 * 3 - 6 * 1
    mm.check_invariants([a, b])
    mm.free([a, b])
    mm.check_invariants([])


ops = st.lists(st.tuples(st.sampled_from(["grow", "free"]), st.integers(0, 3), st.integers(1, 20)), max_size=40)


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(ops)
def test_random_grow_and_free_keep_every_page_exactly_once(seq_ops):
    mm = MemoryManager(SHAPE, 60, torch.float32, "cpu")
    T, per_seq = mm.fmt.tokens, SHAPE.num_layers * SHAPE.num_kv_heads
    live: dict[int, int] = {}  # slot -> tokens
    for op, which, n in seq_ops:
        if op == "grow":
            slot = list(live)[which % len(live)] if live and which % 2 else None
            if slot is None:
                if mm.num_free_slots == 0:
                    continue
                slot = mm.alloc_slot()
                live[slot] = 0
            new = min(live[slot] + n, SHAPE.max_model_len)
            need = mm.pages_to_grow(live[slot], new)
            if need > mm.free_pages():
                continue  # the scheduler never asks for more than is free
            mm.reserve(torch.tensor([slot]), torch.tensor([new]), max_new_pages=-(-n // T) + 1)
            live[slot] = new
            assert mm.held[slot].eq(-(-new // T)).all()
        elif live:
            slot = list(live)[which % len(live)]
            mm.free([slot])
            del live[slot]
        mm.check_invariants(list(live))
        assert mm.free_pages() == mm.num_pages - sum(per_seq * -(-t // T) for t in live.values())
    mm.free(list(live))
    mm.check_invariants([])
    assert mm.free_pages() == mm.num_pages


def test_paper_figure6_prompt_compaction():
    """8-token prompt, two heads, 2 tokens per high page, 4 per low page (DiffKV Figure 6)."""
    shape = CacheShape(num_layers=1, num_kv_heads=2, head_dim=16, max_seqs=2, max_model_len=8, block_size=2)
    mm = MemoryManager(shape, 16, torch.float16, "cpu", high=(16, 16), low=(4, 2))
    assert (mm.fmt_high.tokens, mm.fmt_low.tokens) == (2, 4)
    s = mm.alloc_slot()
    slots = torch.tensor([s])
    mm.reserve(slots, torch.tensor([8]), max_new_pages=4)  # all-high worst case: 4 pages per head
    reserved = mm.page_table[s, 0, :, :4].clone()
    assert reserved.tolist() == [[0, 1, 2, 3], [4, 5, 6, 7]] and mm.free_pages() == 8
    n_high = torch.tensor([[[2, 4]]], dtype=torch.int32)  # head A: 1 high page, head B: 2
    n_low = torch.tensor([[[3, 4]]], dtype=torch.int32)  # both: 1 low page
    mm.fit_prompt_plan(slots, 0, n_high[:, 0], n_low[:, 0])
    assert mm.free_pages() == 8  # no head needed an extra page
    mm.finish_prompt(slots, n_high, n_low)
    P = mm.max_pages
    pt = mm.page_table[s, 0]
    assert pt[0, 0].item() == 0 and pt[0, P - 1].item() == 3  # head A: high page 0, low page 3 at the right
    assert pt[1, :2].tolist() == [4, 5] and pt[1, P - 1].item() == 7  # head B: high 4, 5; low 7
    assert mm.held_high[s, 0].tolist() == [1, 2] and mm.held_low[s, 0].tolist() == [1, 1]
    assert mm.free_pages() == 8 + 3  # pages 1, 2 (head A) and 6 (head B) recycled
    start, end = mm.counters.tolist()
    assert [mm.free_list[i % 16].item() for i in range(end - 3, end)] == [1, 2, 6]
    mm.check_invariants([s])
    mm.free([s])
    mm.check_invariants([])
    assert mm.free_pages() == 16


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.lists(st.tuples(st.integers(1, 24), st.integers(0, 99), st.integers(0, 99), st.integers(0, 3)),
                min_size=1, max_size=12))
def test_random_prompt_plans_and_growth_keep_pages_exact(plans):
    """Prompts with random high/low splits per head, then decode-style growth on both sides, then frees."""
    shape = CacheShape(num_layers=2, num_kv_heads=2, head_dim=16, max_seqs=3, max_model_len=48, block_size=2)
    mm = MemoryManager(shape, 400, torch.float16, "cpu", high=(16, 16), low=(4, 2))
    g = torch.Generator().manual_seed(len(plans))
    live = []
    for n, fh, fl, grow_steps in plans:
        if mm.num_free_slots == 0 or mm.pages_for_tokens(n + grow_steps) > mm.free_pages():
            if live:
                mm.free([live.pop(0)])
                mm.check_invariants(live)
            continue
        s = mm.alloc_slot()
        live.append(s)
        slots = torch.tensor([s])
        mm.reserve(slots, torch.tensor([n]), max_new_pages=-(-n // mm.fmt_high.tokens))
        # Random per-head split of the n tokens into high / low / pruned.
        nh = torch.randint(0, n + 1, (1, 2, 2), generator=g, dtype=torch.int32)
        nl = (torch.rand(1, 2, 2, generator=g) * (n - nh + 1)).floor().to(torch.int32).clamp(max=n - nh)
        for layer in range(2):
            mm.fit_prompt_plan(slots, layer, nh[:, layer], nl[:, layer])
        mm.finish_prompt(slots, nh, nl)
        mm.check_invariants(live)
        for _ in range(grow_steps):  # at most one page a head per step, on either side
            side_low = torch.rand(1, 2, 2, generator=g) < 0.5
            lh, ll = mm.len_high[slots] + (~side_low), mm.len_low[slots] + side_low
            need_h = (lh > mm.held_high[slots] * mm.fmt_high.tokens).to(torch.int32)
            need_l = (ll > mm.held_low[slots] * mm.fmt_low.tokens).to(torch.int32)
            mm.grow(slots, need_h, need_l, 1)
            mm.len_high[slots], mm.len_low[slots] = lh.to(torch.int32), ll.to(torch.int32)
            mm.check_invariants(live)
    mm.free(live)
    mm.check_invariants([])
    assert mm.free_pages() == mm.num_pages
