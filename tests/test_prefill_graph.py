"""Prompt steps replayed from CUDA graphs (diffkv_serve/engine/prefill_graph.py) compute what eager prompt steps
compute: same first tokens, log-probabilities within bf16 rounding, every page freed (CUDA). On CPU the graphs'
staging runs eagerly (capture=False): padding to the bucket, the padding sequence, prompts whose cached prefix
blocks are computed again with their writes dropped (against an engine without the prefix cache), and diffkv
prompt steps (classification, page fitting and section writes equal to an eager step's). The
kernel's graph layout and the graphs' budget are checked in tests/kernels/test_prefill_attention.py and
tests/test_graph_memory.py."""
from __future__ import annotations

import pytest
import torch

from engine_helpers import TEST_DEVICE, assert_all_pages_free, run_all
from diffkv_serve.engine import EngineConfig, SamplingParams
from diffkv_serve.engine.llm_engine import LLMEngine
from diffkv_serve.engine.loader import load_checkpoint

from diffkv_serve.engine.prefill_graph import PrefillGraphs

cuda_only = pytest.mark.skipif(not TEST_DEVICE.startswith("cuda"), reason="CUDA graphs need a GPU")


def _engine(mode: str, graph_tokens: int, prefix_caching: bool = False,
            reservation: str = "worst_case") -> LLMEngine:
    cfg = EngineConfig(device=TEST_DEVICE, max_model_len=1024, max_prefill_graph_tokens=graph_tokens,
                       cache={"kv_mode": mode, "num_pages": 4096, "enable_prefix_caching": prefix_caching},
                       scheduler={"max_num_seqs": 16, "max_num_batched_tokens": 1024, "reservation": reservation})
    return LLMEngine(cfg, checkpoint=load_checkpoint("random:tiny-qwen2"))


@cuda_only
@pytest.mark.parametrize("mode,prefix_caching,reservation", [
    ("fp16", False, "worst_case"), ("int4", False, "worst_case"), ("int4", True, "worst_case"),
    ("diffkv", False, "worst_case"), ("diffkv", False, "learned")])
def test_graphed_prompt_steps_equal_eager_ones(mode, prefix_caching, reservation):
    """With the prefix cache, the graphed engine's later prompts hit the first one's blocks and compute them
    again; the eager engine runs without the cache."""
    g = torch.Generator().manual_seed(1)
    lens = [3, 17, 130, 700, 64, 1, 250, 900]  # buckets 128 .. 1024, several prompts per step
    head = torch.randint(0, 500, (260,), generator=g).tolist()
    prompts = [(head if prefix_caching and n > 260 else []) + torch.randint(0, 500, (n,), generator=g).tolist()
               for n in lens]
    prompts = [p[:1000] for p in prompts]
    sp = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True, logprobs=0)
    outs = {}
    for tokens in (0, 1024):
        eng = _engine(mode, tokens, prefix_caching and tokens > 0, reservation)
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


def _staged_engine(mode: str, prefix_caching: bool, staged: bool, max_model_len: int = 512,
                   scheduler: dict | None = None, **cache) -> LLMEngine:
    """An engine whose prompt steps (staged) go through the graphs' staging run eagerly (capture=False)."""
    cfg = EngineConfig(device=TEST_DEVICE, max_model_len=max_model_len,
                       cache={"kv_mode": mode, "num_pages": 4096, "enable_prefix_caching": prefix_caching, **cache},
                       scheduler={"max_num_seqs": 8, "max_num_batched_tokens": 1024, "async_scheduling": "off",
                                  **(scheduler or {})})
    eng = LLMEngine(cfg, checkpoint=load_checkpoint("random:tiny-qwen2"))
    if staged:
        r = eng.runner
        r.prefill_graphs = PrefillGraphs(r.model, r.attn, 1024, 8, capture=False, learned=r.learned)
    return eng


@pytest.mark.parametrize("mode", ["fp16", "int4"])
def test_staged_prompt_steps_recompute_cached_blocks_as_without_the_cache(mode, monkeypatch):
    """A shared 150-token prefix: the first request caches its blocks, the next ones hit them. With the graphs'
    staging their prompt steps compute the cached tokens again and leave the cache's pages alone: every
    generated token and log-probability equals the engine without a prefix cache."""
    g = torch.Generator().manual_seed(5)
    shared = torch.randint(1, 500, (150,), generator=g).tolist()
    prompts = [shared + torch.randint(1, 500, (n,), generator=g).tolist() for n in (1, 30, 7, 61)] + [[4, 5, 6]]
    sp = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True, logprobs=0)
    outs = {}
    import diffkv_serve.engine.kv.policy as policy

    written = []  # rows the prompt steps store, per step: the cached ones must not be among them
    real_write = policy.write_kv

    def counting_write(pool, fmt, dtype, k, v, dst_page, *rest, **kw):
        # (a CUDA engine's own graphs capture prompt steps: nothing may sync then)
        capturing = torch.cuda.is_available() and torch.cuda.is_current_stream_capturing()
        if eng.runner.attn.meta.is_prefill and not capturing:
            written.append(int((dst_page >= 0).sum()))
        return real_write(pool, fmt, dtype, k, v, dst_page, *rest, **kw)

    monkeypatch.setattr(policy, "write_kv", counting_write)
    for name, caching, staged in (("plain", False, False), ("staged", True, True)):
        eng = _staged_engine(mode, caching, staged)
        first = run_all(eng, prompts[:1], sp)
        written.clear()
        rest = run_all(eng, prompts[1:], sp)
        outs[name] = first + rest
        if staged:  # the later prompts did read the first one's blocks, recomputed in the staged steps
            assert eng.stats()["prefix_cache_hits"] >= 3 * eng.mm.prefix_block_tokens  # one block or more each
            assert eng.runner.num_prefill_tokens == sum(len(p) for p in prompts)
            heads = eng.mm.shape.num_kv_heads  # per layer: every later prompt token but the cached ones
            hit = eng.stats()["prefix_cache_hits"]
            assert sum(written) == eng.mm.shape.num_layers * heads * (sum(map(len, prompts[1:])) - hit)
        assert_all_pages_free(eng)
        eng.shutdown()
    for a, b in zip(outs["plain"], outs["staged"]):
        assert b.token_ids == a.token_ids
        torch.testing.assert_close(torch.tensor(b.logprobs), torch.tensor(a.logprobs), atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("reservation", ["worst_case", "learned"])
def test_staged_diffkv_prompt_steps_equal_eager_ones(reservation):
    """DiffKV prompt steps through the graphs' staging (padding to the bucket, a padding sequence, empty ones)
    classify, fit and write exactly what an eager step does: the same section sizes and pages right after the
    step, the same tokens, log-probabilities and kept classes at the end, and the dummy slot (the decode graphs'
    padding rows) still holds nothing. The padding sequence (212 tokens) is longer than any sequence may be
    (64): its tokens' section indices lie past every page-table row."""
    g = torch.Generator().manual_seed(9)
    # 300 tokens -> bucket 512
    prompts = [torch.randint(1, 500, (n,), generator=g).tolist() for n in (3, 50, 54, 54, 54, 54, 31)]
    sp = SamplingParams(temperature=0, max_tokens=10, ignore_eos=True, logprobs=0)
    outs, after_prompt = {}, {}
    for staged in (False, True):
        eng = _staged_engine("diffkv", False, staged, max_model_len=64, scheduler={"reservation": reservation},
                             record_pruning=True, window=8)
        mm = eng.mm
        for i, p in enumerate(prompts):
            eng.add_request(str(i), p, sp)
        eng.step()  # the one prompt step
        slots = sorted(s.slot for s in eng.scheduler.running)
        assert len(slots) == len(prompts)
        after_prompt[staged] = ([t[slots].clone() for t in (mm.len_high, mm.len_low, mm.held_high, mm.held_low)],
                                mm.free_pages())
        assert int(mm.held_high[mm.dummy_slot].sum()) == int(mm.held_low[mm.dummy_slot].sum()) == 0
        if staged:  # the step went through the staging: its section sizes are in the static buffers
            assert int(eng.runner.prefill_graphs.n_sections.sum()) > 0
        done = {}
        while eng.has_unfinished_requests():
            for out in eng.step():
                if out.finished:
                    done[out.request_id] = out
        outs[staged] = [done[str(i)] for i in range(len(prompts))]
        assert_all_pages_free(eng)
        eng.shutdown()
    (plain_t, plain_free), (staged_t, staged_free) = after_prompt[False], after_prompt[True]
    assert staged_free == plain_free
    for a, b in zip(plain_t, staged_t):
        assert torch.equal(a, b)
    assert int(plain_t[1].sum()) > 0, "no token went low: the case does not exercise both sections"
    for a, b in zip(outs[False], outs[True]):
        assert b.token_ids == a.token_ids
        torch.testing.assert_close(torch.tensor(b.logprobs), torch.tensor(a.logprobs), atol=1e-4, rtol=1e-4)
        assert torch.equal(torch.as_tensor(b.kv_usage["token_classes"]), torch.as_tensor(a.kv_usage["token_classes"]))
        assert b.kv_usage["pages_used"] == a.kv_usage["pages_used"]
