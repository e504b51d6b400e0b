import os

import pytest
import torch

from diffkv_serve.kernels.prompt_page_fit import fit_prompt_pages

pytestmark = pytest.mark.filterwarnings("ignore:Conversion of an array with ndim:DeprecationWarning")
DEVICE = os.environ.get("DIFFKV_TEST_DEVICE", "cpu")
S, L, H, P, NUM_PAGES, T_HI, T_LO = 6, 3, 4, 9, 50, 2, 4


def _state(seed):
    """A page table whose (slot, layer) rows hold `held` reserved pages, a scrambled circular free list whose
    start is near its end (so the handed-out cells wrap), and per-head plans of which some need an extra page."""
    g = torch.Generator().manual_seed(seed)
    n = torch.randint(1, 2 * (P - 2), (S,), generator=g)  # prompt tokens per slot
    held = (-(-n // T_HI)).view(S, 1, 1).expand(S, L, H).to(torch.int32).contiguous()
    pt = torch.full((S, L, H, P + 1), -1, dtype=torch.int32)
    pt[..., :P] = torch.randint(0, NUM_PAGES, (S, L, H, P), generator=g, dtype=torch.int32)
    free = torch.randperm(NUM_PAGES + 1, generator=g).to(torch.int32)
    counters = torch.tensor([NUM_PAGES - 3, 2 * NUM_PAGES - 3], dtype=torch.int64)
    slots = torch.tensor([4, 0, 2, 5])
    nn = n[slots].unsqueeze(1)
    n_high = (torch.rand(len(slots), H, generator=g) * (nn + 1)).floor().to(torch.int32)
    n_low = (torch.rand(len(slots), H, generator=g) * (nn - n_high + 1)).floor().to(torch.int32)
    # Half the heads keep almost everything, a few tokens low: rounding both sections up often needs a page more.
    few = torch.randint(1, 4, (len(slots), H), generator=g).clamp(max=nn)
    alt = torch.rand(len(slots), H, generator=g) < 0.5
    n_low = torch.where(alt, few, n_low).to(torch.int32)
    n_high = torch.where(alt, nn - few, n_high).to(torch.int32)
    return pt, held, free, counters, slots, n_high, n_low


def _naive(pt, held, free, counters, slots, layer, n_high, n_low):
    pt, held, counters = pt.clone(), held.clone(), counters.clone()
    for b, s in enumerate(slots.tolist()):
        for h in range(H):
            pages = -(-int(n_high[b, h]) // T_HI) - (int(n_low[b, h]) // -T_LO)
            if pages > held[s, layer, h]:
                pt[s, layer, h, held[s, layer, h]] = free[int(counters[0]) % NUM_PAGES]
                held[s, layer, h] += 1
                counters[0] += 1
    return pt, held, counters


@pytest.mark.parametrize("impl", ["ref", "triton"])
def test_fit_prompt_pages_hands_out_pages_in_head_order(impl):
    handed_out = 0
    for seed in range(6):
        pt, held, free, counters, slots, n_high, n_low = _state(seed)
        layer = seed % L
        want = _naive(pt, held, free, counters, slots, layer, n_high, n_low)
        handed_out += int(want[2][0] - counters[0])
        state = [x.to(DEVICE) for x in (pt, held, free, counters, slots, n_high, n_low)]
        fit_prompt_pages(*state[:5], layer, state[5], state[6], T_HI, T_LO, NUM_PAGES, impl=impl)
        for got, exp in zip((state[0], state[1], state[3]), want):
            assert torch.equal(got.cpu(), exp)
    assert handed_out > 6  # many heads took a page (the list wraps: start is 3 cells from its end)
