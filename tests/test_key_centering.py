"""Key centering (engine.key_centering): exact under softmax, and what makes 4-bit keys work on a model whose
keys carry a large constant channel (Qwen2's k_proj bias, planted here in a tiny random model)."""
from __future__ import annotations

import json

import pytest
import torch

from diffkv_serve.engine import EngineConfig, SamplingParams
from diffkv_serve.engine import key_centering
from diffkv_serve.engine.layers import RotaryEmbedding
from diffkv_serve.engine.llm_engine import LLMEngine
from diffkv_serve.engine.loader import LoadedCheckpoint, random_weights
from diffkv_serve.engine.model_config import ModelArch
from diffkv_serve.engine.tokenizer import Tokenizer
from engine_helpers import TEST_DEVICE

# A Qwen2-like tiny shape (k_proj bias, rope base 1e6): head_dim 32, 2 KV heads, GQA 2.
ARCH = ModelArch(architecture="qwen2", vocab_size=256, hidden_size=128, intermediate_size=256, num_layers=2,
                 num_heads=4, num_kv_heads=2, head_dim=32, rope_theta=1e6, attention_bias=True,
                 max_position_embeddings=512, eos_token_ids=[0])
OFFSET = 40.0  # the planted channel: ~100x the other key channels (Qwen2.5-1.5B layer 0: 89x the median)


def planted_checkpoint(offset: float = OFFSET) -> LoadedCheckpoint:
    """Random weights with attention sharp enough to matter (q/k projections x4) and, in every KV head, the
    lowest-frequency RoPE channel (the last of each half) carrying `offset` through the k_proj bias."""
    w = random_weights(ARCH, seed=3)
    H, Hk, D = ARCH.num_heads, ARCH.num_kv_heads, ARCH.head_dim
    for i in range(ARCH.num_layers):
        p = f"model.layers.{i}.self_attn."
        w[p + "q_proj.weight"] *= 4
        w[p + "k_proj.weight"] *= 4
        bias = w[p + "k_proj.bias"].view(Hk, D)
        bias[:, D // 2 - 1] = offset
        bias[:, D - 1] = -offset
    tok = Tokenizer.byte_level(ARCH.vocab_size, eos_token_ids=ARCH.eos_token_ids)
    return LoadedCheckpoint(ARCH, w, tok, "planted-qwen2-tiny", None)


def engine(ckpt, kv_mode: str, centering: str, rotation: str = "off") -> LLMEngine:
    """Centering alone unless `rotation` says otherwise (engine.kv_rotation also spreads a constant offset)."""
    cfg = EngineConfig(device=TEST_DEVICE, max_model_len=256, enforce_eager=True,
                       scheduler={"max_num_seqs": 8, "max_num_batched_tokens": 2048},
                       cache={"kv_mode": kv_mode, "num_pages": 512, "key_centering": centering,
                              "kv_rotation": rotation})
    return LLMEngine(cfg, checkpoint=ckpt)


def run(eng: LLMEngine, prompts, sps):
    for i, (p, sp) in enumerate(zip(prompts, sps)):
        eng.add_request(str(i), prompt_token_ids=p, sampling=sp)
    outs = {}
    while eng.has_unfinished_requests():
        for o in eng.step():
            if o.finished:
                outs[o.request_id] = o
    return [outs[str(i)] for i in range(len(prompts))]


def assert_same_logprobs(a: LLMEngine, b: LLMEngine, prompts, refs) -> None:
    """Teacher forced on `refs`, both engines give the same logprobs (float32: rounding only; bfloat16: its
    ~3 significant digits); on CPU their greedy runs also give the same tokens."""
    sps = [SamplingParams(temperature=0, max_tokens=len(r), ignore_eos=True, teacher_tokens=r, logprobs=True)
           for r in refs]
    lp_a = torch.tensor([o.logprobs for o in run(a, prompts, sps)])
    lp_b = torch.tensor([o.logprobs for o in run(b, prompts, sps)])
    torch.testing.assert_close(lp_b, lp_a, atol=2e-4 if TEST_DEVICE == "cpu" else 0.1, rtol=0)
    if TEST_DEVICE == "cpu":
        sp = SamplingParams(temperature=0, max_tokens=len(refs[0]), ignore_eos=True)
        assert [o.token_ids for o in run(b, prompts, [sp] * len(prompts))] == refs
        torch.testing.assert_close(b.prompt_logits(prompts[0] + refs[0]), a.prompt_logits(prompts[0] + refs[0]),
                                   atol=2e-4, rtol=0)


def teacher_forced(eng: LLMEngine, prompts, refs) -> tuple[float, float]:
    """(top-1 agreement with the fp16 cache's tokens `refs`, mean NLL of those tokens) under `eng`'s cache."""
    sps = [SamplingParams(temperature=0, max_tokens=len(r), ignore_eos=True, teacher_tokens=r, logprobs=True)
           for r in refs]
    outs = run(eng, prompts, sps)
    agree = [a for o in outs for a in o.teacher_agree]
    logprobs = [x for o in outs for x in o.logprobs]
    return sum(agree) / len(agree), -sum(logprobs) / len(logprobs)


def agreement(ckpt, kv_mode: str, centering: str, prompts, refs, rotation: str = "off") -> float:
    return teacher_forced(engine(ckpt, kv_mode, centering, rotation), prompts, refs)[0]


def prompts_and_references(fp16: LLMEngine, seed: int) -> tuple[list, list]:
    """Six random 24-token prompts and the greedy 40-token continuations `fp16` gives them."""
    g = torch.Generator().manual_seed(seed)
    prompts = [torch.randint(1, fp16.arch.vocab_size, (24,), generator=g).tolist() for _ in range(6)]
    sp = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)
    return prompts, [o.token_ids for o in run(fp16, prompts, [sp] * len(prompts))]


@pytest.fixture(scope="module")
def planted():
    ckpt = planted_checkpoint()
    return (ckpt, *prompts_and_references(engine(ckpt, "fp16", "off"), seed=0))


def test_k4_agreement_needs_centering(planted):
    """Uniform K4V4 on the planted model: without centering the offset takes the keys' 4-bit range and
    agreement with the fp16 cache collapses; centering on the rotated bias (no calibration) restores it."""
    ckpt, prompts, refs = planted
    off = agreement(ckpt, "int4", "off", prompts, refs)
    bias = agreement(ckpt, "int4", "bias", prompts, refs)
    print(f"K4V4 top-1 agreement: off {off:.3f}, bias {bias:.3f}")
    assert off <= 0.5 and bias >= 0.85, (off, bias)  # unplanted, this model's K4V4 agrees ~0.90


def test_rotation_does_not_replace_centering(planted):
    """The KV rotation spreads the planted constant over every channel, which helps, but the offset is still there
    in every token's range; centering removes it. The engine's default runs both."""
    ckpt, prompts, refs = planted
    rotated = agreement(ckpt, "int4", "off", prompts, refs, rotation="hadamard")
    both = agreement(ckpt, "int4", "bias", prompts, refs, rotation="hadamard")
    print(f"K4V4 top-1 agreement: rotated only {rotated:.3f}, centered and rotated {both:.3f}")
    assert both >= 0.85 and both > rotated + 0.1, (rotated, both)


def test_fp8_keys_gain_from_centering(planted):
    """e4m3's scale follows each key row's largest channel: the planted offset squeezes the other channels toward
    its subnormals, centering frees them (measured: 0.925 uncentered, 0.988 centered)."""
    ckpt, prompts, refs = planted
    off = agreement(ckpt, "fp8", "off", prompts, refs)
    bias = agreement(ckpt, "fp8", "bias", prompts, refs)
    assert bias >= 0.97 and bias > off


def test_centering_is_exact_under_softmax(planted):
    """A 16-bit cache quantizes nothing, so centering must change nothing but rounding: the same next-token
    logprobs after the prompt and after decode steps read the cache (teacher forced on the same tokens), and on
    CPU (float32) the same greedy tokens. bfloat16 on CUDA rounds differently with and without the shift, which
    flips the near-ties of a random model's greedy run, so there only the logprobs are compared."""
    ckpt, prompts, refs = planted
    eng = engine(ckpt, "fp16", "bias")
    assert eng.stats()["key_centering"]["mode"] == "bias"
    assert eng.stats()["key_centering"]["max_abs_center"] > 0.5 * OFFSET
    assert_same_logprobs(engine(ckpt, "fp16", "off"), eng, prompts, refs)

def test_auto_resolution():
    """'auto': off for the fp16 cache, the rotated bias for a quantized cache of a model with a k_proj bias,
    off for a model without one; explicit choices the model cannot honour are errors naming the field."""
    from diffkv_serve.engine.config import CacheConfig

    no_bias = ARCH.model_copy(update={"attention_bias": False})
    assert key_centering.resolve_mode(CacheConfig(kv_mode="fp16"), ARCH, None) == "off"
    assert key_centering.resolve_mode(CacheConfig(kv_mode="int4"), ARCH, None) == "bias"
    assert key_centering.resolve_mode(CacheConfig(kv_mode="diffkv"), no_bias, None) == "off"
    assert key_centering.resolve_mode(CacheConfig(kv_mode="int8"), no_bias, {"key_center": []}) == "calibrated"
    assert key_centering.resolve_mode(CacheConfig(kv_mode="fp8"), ARCH, None) == "bias"
    assert key_centering.resolve_mode(CacheConfig(kv_mode="fp8"), no_bias, {"key_center": []}) == "calibrated"
    with pytest.raises(ValueError, match="key_centering='calibrated'"):
        key_centering.resolve_mode(CacheConfig(kv_mode="int4", key_centering="calibrated"), ARCH, None)
    with pytest.raises(ValueError, match="key_centering='bias'"):
        key_centering.resolve_mode(CacheConfig(kv_mode="int4", key_centering="bias"), no_bias, None)
    with pytest.raises(ValueError, match="shape"):
        key_centering.check_centers([[0.0]], ARCH)


def test_measured_centers_from_settings(planted, monkeypatch):
    """Centers measured from the model's own keys (evals.key_center) find the planted offset, survive the
    settings file's JSON, and the engine runs them ('calibrated') with K4 agreement as good as the bias's."""
    from diffkv_serve.engine import model_runner
    from evals.key_center import measure_key_centers
    from evals.runner import EvalModel

    ckpt, prompts, refs = planted
    model = EvalModel(device=TEST_DEVICE, max_model_len=256, max_num_seqs=8, checkpoint=ckpt)
    centers = measure_key_centers(model, [p + r for p, r in zip(prompts, refs)])
    D = ARCH.head_dim
    assert centers.shape == (ARCH.num_layers, ARCH.num_kv_heads, D)
    # The lowest-frequency channels barely rotate over 64 positions: their mean is the planted bias.
    assert torch.allclose(centers[..., D // 2 - 1], torch.full_like(centers[..., 0], OFFSET), rtol=0.02)
    assert torch.allclose(centers[..., D - 1], torch.full_like(centers[..., 0], -OFFSET), rtol=0.02)
    settings = json.loads(json.dumps({key_centering.SETTINGS_KEY: key_centering.to_settings(centers)}))
    monkeypatch.setattr(model_runner, "load_model_settings", lambda name: settings)
    eng = engine(ckpt, "int4", "auto")
    assert eng.stats()["key_centering"]["mode"] == "calibrated"
    calibrated = agreement(ckpt, "int4", "calibrated", prompts, refs)
    bias = agreement(ckpt, "int4", "bias", prompts, refs)
    print(f"K4V4 top-1 agreement: calibrated {calibrated:.3f}, bias {bias:.3f}")
    assert calibrated >= bias - 0.05
