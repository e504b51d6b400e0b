"""The memory manager never loses or double-frees a page, alone and under the engine's scheduling."""
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from engine.memory import CacheShape, MemoryManager

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
