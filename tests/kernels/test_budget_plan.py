"""Equal-budget pruning baseline (policy="budget"): the prompt keeps the window plus the most significant
tokens of each head, generation prunes the least significant old token once a head is over its budget, and
the Triton plan equals the torch reference on real engine states."""
import math
import os

import pytest
import torch

from diffkv_serve.engine import EngineConfig, SamplingParams
from diffkv_serve.engine.llm_engine import LLMEngine
from diffkv_serve.engine.loader import load_checkpoint
from diffkv_serve.kernels.compression_plan import FIELDS, compression_plan_ref, compression_plan_triton
from diffkv_serve.kernels.prompt_significance import budget_keep_mask

pytestmark = pytest.mark.filterwarnings("ignore:Conversion of an array with ndim:DeprecationWarning")
DEVICE = os.environ.get("DIFFKV_TEST_DEVICE", "cpu")
WINDOW = 4


def test_prompt_mask_keeps_window_then_top_scores_per_sequence():
    # Two packed sequences (5 and 7 tokens), 2 heads; budget 0.5 -> keep max(ceil(0.5 n), 2) tokens.
    mean = torch.tensor([[.9, .1], [.2, .8], [.5, .5], [.0, .0], [.0, .0],
                         [.3, .1], [.1, .3], [.7, .7], [.7, .2], [.0, .0], [.0, .0], [.0, .0]])
    lens = [5, 7]
    pos = torch.cat([torch.arange(n) for n in lens])
    seq = torch.cat([torch.full((n,), i) for i, n in enumerate(lens)])
    n = torch.tensor(lens)[seq]
    cu = torch.tensor([0, 5, 12], dtype=torch.int32)
    keep = budget_keep_mask(mean, pos, n, seq, cu, budget=0.5, window=2)
    # seq 0 keeps 3: window (3, 4) + best of 0..2; seq 1 keeps 4: window (5, 6) + best two of 0..4 (ties: earlier).
    expect = torch.zeros(12, 2, dtype=torch.bool)
    expect[[0, 3, 4], 0] = True
    expect[[1, 3, 4], 1] = True
    expect[[5 + 2, 5 + 3, 10, 11], 0] = True
    expect[[5 + 1, 5 + 2, 10, 11], 1] = True
    assert torch.equal(keep, expect)


def _engine(budget, high="K16V16"):
    cfg = EngineConfig(device=DEVICE, max_model_len=256, enforce_eager=True, scheduler={"max_num_seqs": 4},
                       cache={"kv_mode": "diffkv", "policy": "budget", "budget": budget, "high": high, "low": high,
                              "block_size": 4, "window": WINDOW, "significance_queries": 8})
    return LLMEngine(cfg, checkpoint=load_checkpoint("random:tiny"))


@pytest.mark.parametrize("budget,high", [(0.5, "K16V16"), (0.3, "K8V4")])
def test_every_head_holds_its_budget_and_triton_equals_reference(budget, high):
    eng = _engine(budget, high)
    mm = eng.mm
    for i, n in enumerate((3, 17, 40)):
        eng.add_request(str(i), list(range(3, 3 + n)), SamplingParams(temperature=0, max_tokens=12, ignore_eos=True))
    compared = steps = 0
    while eng.has_unfinished_requests():
        steps += 1
        running = [s for s in eng.scheduler.running if s.num_cached]
        if running and not eng.scheduler.waiting and steps % 3 == 0:  # the interpreter is slow: every 3rd step
            # The plan the next decode step will make, by both implementations on the live pages.
            i32 = dict(dtype=torch.int32, device=mm.device)
            args = (torch.tensor([s.slot for s in running], **i32),
                    torch.tensor([len(s.prompt_token_ids) for s in running], **i32),
                    torch.tensor([s.num_cached + 1 for s in running], **i32),
                    torch.zeros(len(running), device=mm.device), torch.zeros(len(running), device=mm.device))
            common = (mm.pool, mm.fmt_high, mm.fmt_low, mm.page_table, mm.len_high, mm.len_low, *args, WINDOW)
            ref = compression_plan_ref(*common, num_queries=8, budget=budget)
            tri = compression_plan_triton(*common, num_queries=8, budget=budget)
            for f in FIELDS:
                assert torch.equal(ref[f].cpu(), tri[f].cpu()), f
            assert set(ref["action"].unique().tolist()) <= {0, 1, 3}
            compared += 1
        eng.step()
        for s in eng.scheduler.running:
            # B(N) is computed in fp32 on both paths (0.3 * 50 rounds up to 15.0000009 -> 16).
            b_n = math.ceil(float(torch.tensor(budget, dtype=torch.float32) * float(s.num_cached)))
            keep = max(b_n, min(WINDOW, s.num_cached))
            lh = mm.len_high[s.slot]
            assert int(mm.len_low[s.slot].sum()) == 0
            assert int(lh.min()) == int(lh.max()) == keep, (s.num_cached, keep)
        mm.check_invariants([s.slot for s in eng.scheduler.running])
    assert compared >= 3
    mm.check_invariants(live_slots=[])
    assert mm.free_pages() == mm.num_pages
