"""The same checkpoint as a Hugging Face transformers Llama model: the reference tests compare against and the
baseline benchmarks time (transformers is a dev/benchmark dependency, imported here only)."""
from __future__ import annotations

import torch


def hf_llama(ckpt, dtype: torch.dtype = torch.float32):
    """transformers LlamaForCausalLM (eval mode, `dtype`, on CPU) holding `ckpt`'s weights; a checkpoint tensor the
    model does not know, or a model weight the checkpoint lacks (other than a tied lm_head), is an error."""
    from transformers import LlamaConfig, LlamaForCausalLM

    a = ckpt.arch
    cfg = LlamaConfig(vocab_size=a.vocab_size, hidden_size=a.hidden_size, intermediate_size=a.intermediate_size,
                      num_hidden_layers=a.num_layers, num_attention_heads=a.num_heads,
                      num_key_value_heads=a.num_kv_heads, head_dim=a.head_dim, rms_norm_eps=a.rms_norm_eps,
                      rope_theta=a.rope_theta, max_position_embeddings=a.max_position_embeddings,
                      tie_word_embeddings=a.tie_word_embeddings)
    model = LlamaForCausalLM(cfg).float().eval()
    missing, unexpected = model.load_state_dict({k: v.float() for k, v in ckpt.weights.items()}, strict=False)
    if unexpected or not set(missing) <= {"lm_head.weight"}:
        raise ValueError(f"checkpoint does not match a Llama model: missing {missing}, unexpected {unexpected}")
    model.tie_weights()
    return model.to(dtype)
