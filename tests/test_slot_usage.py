"""What a finishing request holds (LLMEngine.kv_usage): single-precision caches count it on the host, with no
device read that would wait for the step in flight; the count equals the memory manager's own, prefix-cache
pages it reads but does not own left out."""
from __future__ import annotations

import pytest
import torch

from engine_helpers import TEST_DEVICE, assert_all_pages_free
from diffkv_serve.engine import EngineConfig, SamplingParams
from diffkv_serve.engine.llm_engine import LLMEngine
from diffkv_serve.engine.loader import load_checkpoint


def _device_usage(mm, slot: int) -> tuple[int, int, int]:
    pages = int((mm.held_high[slot] + mm.held_low[slot]).sum()) - mm.shared_cols[slot] * mm.heads_per_seq
    return pages, int(mm.len_high[slot].sum()), int(mm.len_low[slot].sum())


@pytest.mark.parametrize("mode", ["fp16", "int4", "fp8"])
def test_host_usage_equals_the_pages_held(mode):
    cfg = EngineConfig(device=TEST_DEVICE, max_model_len=512,
                       cache={"kv_mode": mode, "num_pages": 2048, "enable_prefix_caching": True},
                       scheduler={"max_num_seqs": 8})
    eng = LLMEngine(cfg, checkpoint=load_checkpoint("random:tiny-qwen2"))
    g = torch.Generator().manual_seed(3)
    shared = torch.randint(1, 500, (150,), generator=g).tolist()  # full prefix blocks in every format
    prompts = [shared + torch.randint(1, 500, (n,), generator=g).tolist() for n in (1, 9, 23)] + [[5, 6, 7]]
    sp = SamplingParams(temperature=0, max_tokens=20, ignore_eos=True)
    eng.add_request("first", prompts[0], sp)
    eng.step()  # its prompt's blocks are cached before the others arrive
    for i, p in enumerate(prompts[1:]):
        eng.add_request(str(i), p, sp)
    seen, shared_seen = 0, False
    while eng.has_unfinished_requests():
        eng.step()
        for seq in eng.scheduler.running:
            if seq.slot is None:
                continue
            host = eng.executor.slot_usage(seq.slot, seq.num_cached)
            assert host == _device_usage(eng.mm, seq.slot), (mode, seq.request_id, seq.num_cached)
            seen += 1
            shared_seen |= eng.mm.shared_cols[seq.slot] > 0
    assert seen > 20 and shared_seen
    assert_all_pages_free(eng)
