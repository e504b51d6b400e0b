"""The state dict every loader must produce for a `ModelArch` (HF Llama naming), and a checker."""
from __future__ import annotations

import torch

from diffkv_serve.engine.model_config import ModelArch


def expected_shapes(arch: ModelArch) -> dict[str, tuple[int, ...]]:
    h, d = arch.hidden_size, arch.head_dim
    q, kv = arch.num_heads * d, arch.num_kv_heads * d
    shapes: dict[str, tuple[int, ...]] = {"model.embed_tokens.weight": (arch.vocab_size, h), "model.norm.weight": (h,)}
    if not arch.tie_word_embeddings:
        shapes["lm_head.weight"] = (arch.vocab_size, h)
    for i in range(arch.num_layers):
        p = f"model.layers.{i}."
        shapes[p + "input_layernorm.weight"] = (h,)
        shapes[p + "post_attention_layernorm.weight"] = (h,)
        shapes[p + "self_attn.q_proj.weight"] = (q, h)
        shapes[p + "self_attn.k_proj.weight"] = (kv, h)
        shapes[p + "self_attn.v_proj.weight"] = (kv, h)
        shapes[p + "self_attn.o_proj.weight"] = (h, q)
        if arch.attention_bias:
            shapes[p + "self_attn.q_proj.bias"] = (q,)
            shapes[p + "self_attn.k_proj.bias"] = (kv,)
            shapes[p + "self_attn.v_proj.bias"] = (kv,)
        if arch.qk_norm:
            shapes[p + "self_attn.q_norm.weight"] = (d,)
            shapes[p + "self_attn.k_norm.weight"] = (d,)
        shapes[p + "mlp.gate_proj.weight"] = (arch.intermediate_size, h)
        shapes[p + "mlp.up_proj.weight"] = (arch.intermediate_size, h)
        shapes[p + "mlp.down_proj.weight"] = (h, arch.intermediate_size)
    return shapes


def check_weights(arch: ModelArch, weights: dict[str, torch.Tensor], source: str) -> None:
    """Raise ValueError if names or shapes disagree with `arch` (catches bad configs early, with the
    file named, instead of a shape error deep inside the model)."""
    expected = expected_shapes(arch)
    # A lazy mapping (LazySafetensors) knows its shapes without reading any tensor.
    shapes = getattr(weights, "shapes", None) or {k: tuple(t.shape) for k, t in weights.items()}
    missing = sorted(set(expected) - set(shapes))
    extra = sorted(set(shapes) - set(expected))
    bad = [f"{k}: {shapes[k]} != {v}" for k, v in expected.items() if k in shapes and shapes[k] != v]
    problems = []
    if missing:
        problems.append(f"missing {len(missing)} tensors (e.g. {missing[:3]})")
    if extra:
        problems.append(f"unexpected {len(extra)} tensors (e.g. {extra[:3]})")
    if bad:
        problems.append(f"wrong shapes: {bad[:3]}")
    if problems:
        raise ValueError(f"{source}: weights do not match the architecture: " + "; ".join(problems))
