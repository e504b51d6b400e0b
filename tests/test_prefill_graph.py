"""Prompt steps replayed from CUDA graphs (diffkv_serve/engine/prefill_graph.py) compute what eager prompt steps
compute: same first tokens, log-probabilities within bf16 rounding, same pages held. CUDA only (on CPU every
prompt step is eager; the kernel's graph layout and the graphs' budget are checked in
tests/kernels/test_prefill_attention.py and tests/test_graph_memory.py)."""
from __future__ import annotations

import pytest
import torch

from engine_helpers import TEST_DEVICE, assert_all_pages_free, run_all
from diffkv_serve.engine import EngineConfig, SamplingParams
from diffkv_serve.engine.llm_engine import LLMEngine
from diffkv_serve.engine.loader import load_checkpoint

pytestmark = pytest.mark.skipif(not TEST_DEVICE.startswith("cuda"), reason="CUDA graphs need a GPU")


def _engine(mode: str, graph_tokens: int) -> LLMEngine:
    cfg = EngineConfig(device=TEST_DEVICE, max_model_len=1024, max_prefill_graph_tokens=graph_tokens,
                       cache={"kv_mode": mode, "num_pages": 4096, "enable_prefix_caching": "off"},
                       scheduler={"max_num_seqs": 16, "max_num_batched_tokens": 1024})
    return LLMEngine(cfg, checkpoint=load_checkpoint("random:tiny-qwen2"))


@pytest.mark.parametrize("mode", ["fp16", "int4"])
def test_graphed_prompt_steps_equal_eager_ones(mode):
    g = torch.Generator().manual_seed(1)
    lens = [3, 17, 130, 700, 64, 1, 250, 900]  # buckets 128 .. 1024, several prompts per step
    prompts = [torch.randint(0, 500, (n,), generator=g).tolist() for n in lens]
    sp = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True, logprobs=0)
    outs = {}
    for tokens in (0, 1024):
        eng = _engine(mode, tokens)
        res = run_all(eng, prompts, sp)
        graphs = eng.runner.prefill_graphs
        assert (graphs is None) == (tokens == 0)
        if graphs is not None:
            assert graphs.graphs, "no prompt step was replayed from a graph"
        outs[tokens] = res
        assert_all_pages_free(eng)
        eng.shutdown()
    for eager, graphed in zip(outs[0], outs[1024]):
        assert graphed.token_ids[0] == eager.token_ids[0]
        a = torch.tensor([lp for lp in eager.logprobs[:1]])
        b = torch.tensor([lp for lp in graphed.logprobs[:1]])
        torch.testing.assert_close(b, a, atol=0.05, rtol=0.02)
