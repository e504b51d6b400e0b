"""KV rotation (engine.kv_rotation): exact under attention on a 16-bit cache, and what keeps low-bit values
usable when one value channel is much larger than the rest (planted here in a tiny random model)."""
from __future__ import annotations

import pytest
import torch

from diffkv_serve.engine import EngineConfig
from diffkv_serve.engine import kv_rotation
from diffkv_serve.engine.config import CacheConfig
from diffkv_serve.engine.llm_engine import LLMEngine
from diffkv_serve.engine.loader import LoadedCheckpoint, random_weights
from diffkv_serve.engine.model import CausalLM
from diffkv_serve.engine.model_config import ModelArch
from diffkv_serve.engine.tokenizer import Tokenizer
from diffkv_serve.kernels.quant import dequantize_ref, quantize_ref
from test_key_centering import assert_same_logprobs, prompts_and_references, teacher_forced
from engine_helpers import TEST_DEVICE

# GQA 2, head_dim 32, a k_proj / v_proj bias (Qwen2-like).
ARCH = ModelArch(architecture="qwen2", vocab_size=256, hidden_size=128, intermediate_size=256, num_layers=2,
                 num_heads=4, num_kv_heads=2, head_dim=32, rope_theta=1e6, attention_bias=True,
                 max_position_embeddings=512, eos_token_ids=[0])
SHARPEN = 10.0  # final norm x10: next-token distributions peaked like a trained model's, not near uniform
V_OFFSET = 20.0  # one value channel per KV head: ~20x the others (the v_proj weights give values of ~0.5-1)


def planted_checkpoint() -> LoadedCheckpoint:
    """Random weights with sharp attention (q/k x4) and one large constant value channel per KV head."""
    w = random_weights(ARCH, seed=5)
    Hk, D = ARCH.num_kv_heads, ARCH.head_dim
    for i in range(ARCH.num_layers):
        p = f"model.layers.{i}.self_attn."
        w[p + "q_proj.weight"] *= 4
        w[p + "k_proj.weight"] *= 4
        w[p + "v_proj.bias"].view(Hk, D)[:, 3] = V_OFFSET
    w["model.norm.weight"] *= SHARPEN
    tok = Tokenizer.byte_level(ARCH.vocab_size, eos_token_ids=ARCH.eos_token_ids)
    return LoadedCheckpoint(ARCH, w, tok, "planted-values-tiny", None)


def engine(ckpt, cache: dict) -> LLMEngine:
    cfg = EngineConfig(device=TEST_DEVICE, max_model_len=256, enforce_eager=True,
                       scheduler={"max_num_seqs": 8, "max_num_batched_tokens": 2048},
                       cache={"num_pages": 512, **cache})
    return LLMEngine(cfg, checkpoint=ckpt)


@pytest.fixture(scope="module")
def planted():
    ckpt = planted_checkpoint()
    return (ckpt, *prompts_and_references(engine(ckpt, {"kv_mode": "fp16"}), seed=1))


@pytest.mark.parametrize("d", [32, 64, 128, 80, 96])
def test_rotation_is_orthogonal_and_fixed(d):
    r = kv_rotation.rotation(d)
    torch.testing.assert_close(r @ r.t(), torch.eye(d, dtype=torch.float64), atol=1e-12, rtol=0)
    assert torch.equal(r, kv_rotation.rotation(d))  # every engine of a model stores the same basis
    if d & (d - 1) == 0:  # Hadamard: every channel mixes into every other with the same weight
        assert torch.allclose(r.abs(), torch.full_like(r, d ** -0.5))


def test_hadamard_needs_a_power_of_two():
    with pytest.raises(ValueError, match="power of two"):
        kv_rotation.hadamard(96)


def test_auto_resolution_and_bad_values():
    assert kv_rotation.resolve_mode(CacheConfig(kv_mode="fp16")) == "off"
    for mode in ("int8", "int4", "fp8", "diffkv"):
        assert kv_rotation.resolve_mode(CacheConfig(kv_mode=mode)) == "hadamard"
    sixteen = {"kv_mode": "diffkv", "high": "K16V16", "low": "K16V16"}  # the equal-budget pruning baseline
    assert kv_rotation.resolve_mode(CacheConfig(**sixteen)) == "off"
    assert kv_rotation.resolve_mode(CacheConfig(**{**sixteen, "low": "K2V2"})) == "hadamard"  # KIVI-like
    assert kv_rotation.resolve_mode(CacheConfig(kv_mode="fp16", kv_rotation="hadamard")) == "hadamard"
    assert kv_rotation.resolve_mode(CacheConfig(kv_mode="int4", kv_rotation="off")) == "off"
    with pytest.raises(ValueError, match="kv_rotation"):
        CacheConfig(kv_rotation="random")


def test_install_folds_values_once():
    """v_proj's rows and bias and o_proj's columns change, q/k/MLP weights do not; a second install is refused."""
    torch.manual_seed(0)
    model = CausalLM(ARCH, 64)
    model.init_random(seed=2)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    r = kv_rotation.install(model, "hadamard")
    D, Hq, Hk = ARCH.head_dim, ARCH.num_heads, ARCH.num_kv_heads
    r64 = kv_rotation.rotation(D).float()
    for i, layer in enumerate(model.layers):
        w0 = before[f"layers.{i}.qkv_proj.weight"]
        v0 = w0[(Hq + Hk) * D:].view(Hk, D, -1)
        torch.testing.assert_close(layer.qkv_proj.weight[:(Hq + Hk) * D], w0[:(Hq + Hk) * D], atol=0, rtol=0)
        torch.testing.assert_close(layer.qkv_proj.weight[(Hq + Hk) * D:].view(Hk, D, -1),
                                   torch.einsum("ji,hjc->hic", r64, v0), atol=1e-6, rtol=1e-5)
        wo0 = before[f"layers.{i}.o_proj.weight"].view(-1, Hq, D)
        torch.testing.assert_close(layer.o_proj.weight.view(-1, Hq, D), wo0 @ r64, atol=1e-6, rtol=1e-5)
        assert layer.kv_rotation is r
    with pytest.raises(ValueError, match="already rotated"):
        kv_rotation.install(model, "hadamard")
    with pytest.raises(ValueError, match="kv_rotation"):
        kv_rotation.install(CausalLM(ARCH, 64), "givens")


def test_rotation_is_exact_on_a_16_bit_cache(planted):
    """A 16-bit cache quantizes nothing, so rotating must change nothing but rounding (the folded v_proj / o_proj
    weights and the rotated queries and keys): the same logprobs teacher forced on the same tokens, and on CPU
    the same greedy tokens and prompt logits (tests/test_key_centering.assert_same_logprobs)."""
    ckpt, prompts, refs = planted
    eng = engine(ckpt, {"kv_mode": "fp16", "kv_rotation": "hadamard"})
    assert eng.stats()["kv_rotation"] == "hadamard"
    assert_same_logprobs(engine(ckpt, {"kv_mode": "fp16"}), eng, prompts, refs)

def attention_error(rotate: bool, key_bits: int, value_bits: int, outliers: bool, seed: int = 0) -> float:
    """Relative error of one head's attention output when keys and values are quantized per token (the cache's
    min-max codes, kernels.quant), optionally in the rotated basis: q R . (K R)^T, then (P V R) R^T."""
    g = torch.Generator().manual_seed(seed)
    T, D = 512, 128
    q, k, v = (torch.randn(n, D, generator=g) for n in (4, T, T))
    if outliers:  # a few channels ~20x the rest, varying per token (so no constant centering removes them)
        k[:, 5] += 20 * (1 + 0.2 * torch.randn(T, generator=g))
        v[:, 3] += 20 * (1 + 0.2 * torch.randn(T, generator=g))
        v[:, 70] -= 12 * (1 + 0.2 * torch.randn(T, generator=g))
    r = kv_rotation.rotation(D).float() if rotate else torch.eye(D)

    def roundtrip(x: torch.Tensor, bits: int) -> torch.Tensor:
        return dequantize_ref(*quantize_ref(x, bits), bits, D)

    exact = torch.softmax(q @ k.t() / D ** 0.5, -1) @ v
    p = torch.softmax((q @ r) @ roundtrip(k @ r, key_bits).t() / D ** 0.5, -1)
    out = p @ roundtrip(v @ r, value_bits) @ r.t()
    return float((out - exact).norm() / exact.norm())


@pytest.mark.parametrize("key_bits,value_bits", [(4, 4), (4, 2), (8, 2)])
def test_rotation_shrinks_the_quantization_error_of_outlier_channels(key_bits, value_bits):
    """The mechanism, on fresh random inputs with planted outlier channels: the rotated cache's attention output
    is much closer to the exact one. Without outliers (Gaussian channels) the rotation changes little."""
    plain = attention_error(False, key_bits, value_bits, outliers=True)
    rotated = attention_error(True, key_bits, value_bits, outliers=True)
    assert rotated < 0.5 * plain, (plain, rotated)
    plain0 = attention_error(False, key_bits, value_bits, outliers=False)
    rotated0 = attention_error(True, key_bits, value_bits, outliers=False)
    assert rotated0 < 1.25 * plain0, (plain0, rotated0)


def test_low_bit_values_gain_from_rotation(planted):
    """End to end through the engine's pages and kernels: with one large value channel, each token's low-bit
    value scale is set by it; rotated, the fp16 cache's tokens (teacher forced) are predicted better. Keys at 8
    bits, so only the values differ."""
    ckpt, prompts, refs = planted
    for precision in ("K8V4", "K8V2"):
        cache = {"kv_mode": "diffkv", "high": precision, "low": precision, "alpha_high": 0.0, "alpha_low": 0.0}
        off_top1, off_nll = teacher_forced(engine(ckpt, {**cache, "kv_rotation": "off"}), prompts, refs)
        on_top1, on_nll = teacher_forced(engine(ckpt, {**cache, "kv_rotation": "hadamard"}), prompts, refs)
        print(f"{precision} top-1 / NLL: not rotated {off_top1:.3f} / {off_nll:.3f}, "
              f"rotated {on_top1:.3f} / {on_nll:.3f}")
        assert on_top1 > off_top1 and on_nll < off_nll
