"""Architecture presets for random-weight models (benchmarks and tests without downloads)."""
from __future__ import annotations

import torch

from diffkv_serve.engine.loader.weights import expected_shapes
from diffkv_serve.engine.model_config import ModelArch, RopeScaling

ARCH_PRESETS: dict[str, ModelArch] = {
    "llama3-8b": ModelArch(
        architecture="llama", vocab_size=128256, hidden_size=4096, intermediate_size=14336, num_layers=32,
        num_heads=32, num_kv_heads=8, head_dim=128, rms_norm_eps=1e-5, rope_theta=500000.0,
        rope_scaling=RopeScaling(rope_type="llama3", factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0,
                                 original_max_position_embeddings=8192),
        max_position_embeddings=8192, bos_token_id=128000, eos_token_ids=[128001, 128009],
    ),
    "qwen2.5-7b": ModelArch(
        architecture="qwen2", vocab_size=152064, hidden_size=3584, intermediate_size=18944, num_layers=28,
        num_heads=28, num_kv_heads=4, head_dim=128, rms_norm_eps=1e-6, rope_theta=1000000.0,
        max_position_embeddings=32768, attention_bias=True, eos_token_ids=[151645, 151643],
    ),
    # Qwen2.5-(Coder-)1.5B: GQA 6 (12 query heads over 2 KV heads), the accuracy study's model.
    "qwen2.5-1.5b": ModelArch(
        architecture="qwen2", vocab_size=151936, hidden_size=1536, intermediate_size=8960, num_layers=28,
        num_heads=12, num_kv_heads=2, head_dim=128, rms_norm_eps=1e-6, rope_theta=1000000.0,
        max_position_embeddings=32768, attention_bias=True, tie_word_embeddings=True,
        eos_token_ids=[151645, 151643],
    ),
    "smollm2-135m": ModelArch(
        architecture="llama", vocab_size=49152, hidden_size=576, intermediate_size=1536, num_layers=30,
        num_heads=9, num_kv_heads=3, head_dim=64, rms_norm_eps=1e-5, rope_theta=100000.0,
        max_position_embeddings=8192, tie_word_embeddings=True, bos_token_id=1, eos_token_ids=[2, 0],
    ),
    # A few-MB Llama-3-like shape for smoke runs of the benchmarks and fast engine tests.
    "tiny": ModelArch(
        architecture="llama", vocab_size=512, hidden_size=128, intermediate_size=256, num_layers=2,
        num_heads=4, num_kv_heads=2, head_dim=32, rms_norm_eps=1e-5, rope_theta=500000.0,
        rope_scaling=RopeScaling(rope_type="llama3", factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0,
                                 original_max_position_embeddings=256),
        max_position_embeddings=2048, eos_token_ids=[0],
    ),
    # The same size with Qwen2's attention biases (key centering's "bias" source) for smoke runs.
    "tiny-qwen2": ModelArch(
        architecture="qwen2", vocab_size=512, hidden_size=128, intermediate_size=256, num_layers=2,
        num_heads=4, num_kv_heads=2, head_dim=32, rms_norm_eps=1e-6, rope_theta=1000000.0,
        max_position_embeddings=2048, attention_bias=True, eos_token_ids=[0],
    ),
}


def random_weights(arch: ModelArch, seed: int = 0, dtype: torch.dtype = torch.float32,
                   device: str | torch.device = "cpu") -> dict[str, torch.Tensor]:
    """Full HF-named state dict: matrices ~ N(0, 0.02), norms = 1, biases small random (never zero, so
    bias handling is actually exercised). Generated on CPU with a fixed seed so any device gets the
    same numbers, then moved tensor by tensor to keep peak host memory low."""
    gen = torch.Generator().manual_seed(seed)
    out: dict[str, torch.Tensor] = {}
    for name, shape in expected_shapes(arch).items():
        if name.endswith("norm.weight"):
            t = torch.ones(shape)
        else:  # matrices and biases alike
            t = torch.randn(shape, generator=gen) * 0.02
        out[name] = t.to(device=device, dtype=dtype)
    return out
