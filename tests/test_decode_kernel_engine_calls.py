"""The CUDA decode kernel (diffkv_serve/kernels/decode_attention/decode_mma.cu) on the calls an engine really makes: a random
model with the Qwen2.5-1.5B attention heads (12 query / 2 KV heads, head_dim 128) runs diffkv (its memory manager
keeps high and low sections, prunes and compacts) and int4 on the CPU, and every decode-attention call is also run
through the kernel's CPU emulation (tests/kernels/_cuda_emu.py) and compared with the reference the engine uses:
output, per-token logits and lse. The engine itself goes on with the reference's results."""
import dataclasses
import sys
from pathlib import Path

import pytest
import torch

import diffkv_serve.engine.kv.policy as policy
from diffkv_serve.engine import EngineConfig, SamplingParams
from diffkv_serve.engine.llm_engine import LLMEngine
from diffkv_serve.engine.loader import load_checkpoint
from engine_helpers import assert_all_pages_free, run_all
from diffkv_serve.kernels.decode_attention import mma_cuda
from diffkv_serve.kernels.decode_attention.tiles import LOG2E

sys.path.insert(0, str(Path(__file__).parent / "kernels"))
import _cuda_emu  # noqa: E402

QTOL = 4e-3  # tensor-core dots against the float32 reference on the same q (fp16, rounded as the kernel rounds it)
SPLITS = 3


def _merge(mid_acc, mid_ml):
    """The splits' (acc, log2 max, sum) by log-sum-exp, in torch (this test runs on CPU tensors whatever
    DIFFKV_TEST_DEVICE says, where the Triton merge kernel may not run): output, natural-log lse."""
    m, l = mid_ml[..., 0], mid_ml[..., 1]
    w = torch.exp2(m - m.amax(-1, keepdim=True))
    total = (w * l).sum(-1)
    out = (w[..., None] * mid_acc).sum(-2) / total.clamp_min(1e-30)[..., None]
    lse = torch.where(total > 0, (m.amax(-1) + torch.log2(total.clamp_min(1e-30))) * 0.6931471805599453,
                      float("-inf"))
    return out, lse


def _emulated(q, pool, fmt, page_table, lengths, slots, layer, scale, fmt_low, len_low, nmax):
    """The kernel's result for this call: output, logits [B, Hq, nmax] (NaN where not written), lse."""
    B, Hq, D = q.shape
    qh = q.half()
    out = torch.full_like(qh, float("nan"))  # unused with several splits
    logits = torch.full((B, Hq, nmax), float("nan"))
    lse = torch.full((B, Hq), float("nan"))
    mid_acc, mid_ml = torch.empty(B, Hq, SPLITS, D), torch.empty(B, Hq, SPLITS, 2)
    mma_cuda.launch_mma(qh, pool, fmt, fmt_low, page_table, lengths, len_low, slots, out, mid_acc, mid_ml, logits,
                        lse, layer, scale * LOG2E, SPLITS, compiled=_cuda_emu.compiled)
    out, lse = _merge(mid_acc, mid_ml)
    return out, logits, lse


@pytest.mark.skipif(_cuda_emu.compiler() is None, reason="the CPU emulation needs g++")
@pytest.mark.parametrize("mode", ["diffkv", "int4"])
def test_every_engine_decode_call_matches_the_reference(mode, monkeypatch):
    tiny = load_checkpoint("random:tiny")
    arch = tiny.arch.model_copy(update=dict(num_heads=12, num_kv_heads=2, head_dim=128))
    ckpt = dataclasses.replace(tiny, arch=arch, name="random:tiny-gqa6-d128")
    reference = policy.paged_decode_attention
    calls = []

    def checked(q, pool, fmt, cache_dtype, page_table, lengths, slots, layer, scale, max_len=None, fmt_low=None,
                len_low=None, logits_out=None, lse_out=None, **kw):
        res = reference(q, pool, fmt, cache_dtype, page_table, lengths, slots, layer, scale, max_len=max_len,
                        fmt_low=fmt_low, len_low=len_low, logits_out=logits_out, lse_out=lse_out, **kw)
        assert mma_cuda._format_reason(fmt, "high") is None
        nmax = max_len or int(page_table.shape[3] * fmt.tokens)
        B, Hq, _ = q.shape
        # the kernel's q (fp16, rounded per section where q.k runs on the integer mma): the reference on that q
        want_logits = torch.full((B, Hq, nmax), float("nan"))
        want_lse = torch.empty(B, Hq)
        want = mma_cuda.kernel_reference(q.half().float(), pool, fmt, cache_dtype, page_table, lengths, slots, layer,
                                         scale, max_len=max_len, fmt_low=fmt_low, len_low=len_low,
                                         logits_out=want_logits, lse_out=want_lse)
        out, logits, lse = _emulated(q, pool, fmt, page_table, lengths, slots, layer, scale, fmt_low, len_low, nmax)
        torch.testing.assert_close(out, want, atol=QTOL, rtol=QTOL)
        torch.testing.assert_close(lse, want_lse, atol=QTOL, rtol=QTOL)
        torch.testing.assert_close(logits, want_logits, atol=QTOL, rtol=QTOL, equal_nan=True)
        sl = slots.long()
        calls.append((int(len_low[sl, layer].sum()) if len_low is not None else 0, int(lengths[sl, layer].sum())))
        return res

    monkeypatch.setattr(policy, "paged_decode_attention", checked)
    cfg = EngineConfig(device="cpu", max_model_len=512, enforce_eager=True,
                       scheduler={"max_num_seqs": 4, "max_num_batched_tokens": 512},
                       cache={"kv_mode": mode, "window": 8, "alpha_high": 1.5, "alpha_low": 0.3,
                              "significance_queries": 8})
    engine = LLMEngine(cfg, checkpoint=ckpt)
    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(1, 500, (n,), generator=g).tolist() for n in (150, 37, 90)]
    out = run_all(engine, prompts, SamplingParams(temperature=0, max_tokens=24, ignore_eos=True))
    assert all(len(o.token_ids) == 24 for o in out)
    assert_all_pages_free(engine)
    assert len(calls) >= 23 * 2  # every decode step, both layers
    if mode == "diffkv":  # the calls covered both sections
        assert any(low > 0 for low, _ in calls) and all(high > 0 for _, high in calls)
