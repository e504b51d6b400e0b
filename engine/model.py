"""Llama-family decoder (Llama 2/3, Mistral, Qwen2/2.5, Qwen3) in plain PyTorch, tensor-parallel ready.

Each rank holds its share of the attention heads and MLP columns: q/k/v and gate/up are column-parallel
(fused per layer), o_proj and down_proj are row-parallel and followed by an all-reduce. The attention
itself is delegated to a backend object (engine.attention) that reads and writes the paged KV cache.
"""
from __future__ import annotations

from typing import Mapping, Protocol

import torch
from torch import nn

from engine.layers import RMSNorm, RotaryEmbedding, silu_and_mul
from engine.model_config import ModelArch
from engine.parallel import SINGLE, ParallelContext


class AttentionBackend(Protocol):
    def __call__(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        """q [N, Hq, D], k/v [N, Hkv, D] of this rank's heads -> [N, Hq, D]."""


class DecoderLayer(nn.Module):
    def __init__(self, arch: ModelArch, idx: int, pc: ParallelContext):
        super().__init__()
        self.idx = idx
        self.pc = pc
        D = arch.head_dim
        self.num_heads = arch.num_heads // pc.world_size
        self.num_kv_heads = arch.num_kv_heads // pc.world_size
        self.qkv_sizes = (self.num_heads * D, self.num_kv_heads * D, self.num_kv_heads * D)
        inter = arch.intermediate_size // pc.world_size
        self.input_layernorm = RMSNorm(arch.hidden_size, arch.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(arch.hidden_size, arch.rms_norm_eps)
        self.qkv_proj = nn.Linear(arch.hidden_size, sum(self.qkv_sizes), bias=arch.attention_bias)
        self.o_proj = nn.Linear(self.num_heads * D, arch.hidden_size, bias=False)
        self.q_norm = RMSNorm(D, arch.rms_norm_eps) if arch.qk_norm else None
        self.k_norm = RMSNorm(D, arch.rms_norm_eps) if arch.qk_norm else None
        self.gate_up_proj = nn.Linear(arch.hidden_size, 2 * inter, bias=False)
        self.down_proj = nn.Linear(inter, arch.hidden_size, bias=False)
        self.head_dim = D

    def forward(self, h: torch.Tensor, positions: torch.Tensor, rope: RotaryEmbedding,
                attn: AttentionBackend) -> torch.Tensor:
        N, D = h.shape[0], self.head_dim
        x = self.input_layernorm(h)
        qkv = self.qkv_proj(x)
        Hq, Hk = self.num_heads, self.num_kv_heads
        qk = qkv[:, : (Hq + Hk) * D].view(N, Hq + Hk, D)
        v = qkv[:, (Hq + Hk) * D:].view(N, Hk, D)
        if self.q_norm is not None:
            qk = torch.cat([self.q_norm(qk[:, :Hq]), self.k_norm(qk[:, Hq:])], 1)
        qk = rope(qk, positions)  # q and k rotate together: one set of kernels
        q, k = qk[:, :Hq], qk[:, Hq:]
        o = attn(self.idx, q, k, v).reshape(N, self.num_heads * D)
        h = h + self.pc.all_reduce(self.o_proj(o))
        x = self.post_attention_layernorm(h)
        return h + self.pc.all_reduce(self.down_proj(silu_and_mul(self.gate_up_proj(x))))


class CausalLM(nn.Module):
    def __init__(self, arch: ModelArch, max_len: int, pc: ParallelContext = SINGLE):
        super().__init__()
        pc.shard(arch.num_heads, "num_heads")
        pc.shard(arch.num_kv_heads, "num_kv_heads")
        pc.shard(arch.intermediate_size, "intermediate_size")
        self.arch, self.pc = arch, pc
        self.embed_tokens = nn.Embedding(arch.vocab_size, arch.hidden_size)
        self.layers = nn.ModuleList(DecoderLayer(arch, i, pc) for i in range(arch.num_layers))
        self.norm = RMSNorm(arch.hidden_size, arch.rms_norm_eps)
        self.lm_head = None if arch.tie_word_embeddings else nn.Linear(arch.hidden_size, arch.vocab_size, bias=False)
        self.rope = RotaryEmbedding(arch, max_len)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, attn: AttentionBackend) -> torch.Tensor:
        """Flat batch of tokens [N] -> final hidden states [N, hidden]."""
        h = self.embed_tokens(input_ids)
        for layer in self.layers:
            h = layer(h, positions, self.rope, attn)
        return self.norm(h)

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        w = self.embed_tokens.weight if self.lm_head is None else self.lm_head.weight
        return (hidden @ w.t()).float()

    # ---- weights --------------------------------------------------------------------------------
    @torch.no_grad()
    def load_weights(self, weights: Mapping[str, torch.Tensor]) -> None:
        """Copy a Hugging Face-named state dict into this rank's shards (fusing q/k/v and gate/up)."""
        arch, pc = self.arch, self.pc

        def get(name: str) -> torch.Tensor:
            if name not in weights:
                raise ValueError(f"checkpoint has no tensor {name!r}")
            return weights[name]

        def rows(t: torch.Tensor, n: int, what: str) -> torch.Tensor:
            a, b = pc.shard(n, what)
            per = t.shape[0] // n
            return t[a * per: b * per]

        def put(param: torch.Tensor, value: torch.Tensor, name: str) -> None:
            if param.shape != value.shape:
                raise ValueError(f"{name}: checkpoint shape {tuple(value.shape)} != model shape {tuple(param.shape)}")
            param.copy_(value)

        put(self.embed_tokens.weight, get("model.embed_tokens.weight"), "model.embed_tokens.weight")
        put(self.norm.weight, get("model.norm.weight"), "model.norm.weight")
        if self.lm_head is not None:
            put(self.lm_head.weight, get("lm_head.weight"), "lm_head.weight")
        for i, layer in enumerate(self.layers):
            p = f"model.layers.{i}."
            q = rows(get(p + "self_attn.q_proj.weight"), arch.num_heads, "num_heads")
            k = rows(get(p + "self_attn.k_proj.weight"), arch.num_kv_heads, "num_kv_heads")
            v = rows(get(p + "self_attn.v_proj.weight"), arch.num_kv_heads, "num_kv_heads")
            put(layer.qkv_proj.weight, torch.cat([q, k, v]), p + "qkv")
            if arch.attention_bias:
                bq = rows(get(p + "self_attn.q_proj.bias"), arch.num_heads, "num_heads")
                bk = rows(get(p + "self_attn.k_proj.bias"), arch.num_kv_heads, "num_kv_heads")
                bv = rows(get(p + "self_attn.v_proj.bias"), arch.num_kv_heads, "num_kv_heads")
                put(layer.qkv_proj.bias, torch.cat([bq, bk, bv]), p + "qkv bias")
            o = get(p + "self_attn.o_proj.weight")
            put(layer.o_proj.weight, rows(o.t(), arch.num_heads, "num_heads").t(), p + "self_attn.o_proj.weight")
            if arch.qk_norm:
                put(layer.q_norm.weight, get(p + "self_attn.q_norm.weight"), p + "self_attn.q_norm.weight")
                put(layer.k_norm.weight, get(p + "self_attn.k_norm.weight"), p + "self_attn.k_norm.weight")
            g = rows(get(p + "mlp.gate_proj.weight"), arch.intermediate_size, "intermediate_size")
            u = rows(get(p + "mlp.up_proj.weight"), arch.intermediate_size, "intermediate_size")
            put(layer.gate_up_proj.weight, torch.cat([g, u]), p + "gate_up")
            dn = get(p + "mlp.down_proj.weight")
            put(layer.down_proj.weight, rows(dn.t(), arch.intermediate_size, "intermediate_size").t(),
                p + "mlp.down_proj.weight")
            put(layer.input_layernorm.weight, get(p + "input_layernorm.weight"), p + "input_layernorm.weight")
            put(layer.post_attention_layernorm.weight, get(p + "post_attention_layernorm.weight"),
                p + "post_attention_layernorm.weight")

    @torch.no_grad()
    def init_random(self, seed: int = 0, std: float = 0.02) -> None:
        """Random weights in place on the model's device (GPU benchmarks of large shapes): norms at one,
        matrices and biases drawn from N(0, std)."""
        g = torch.Generator(device=self.embed_tokens.weight.device).manual_seed(seed)
        for name, p in self.named_parameters():
            if "norm" in name:
                p.fill_(1.0)
            else:
                p.copy_(torch.randn(p.shape, generator=g, device=p.device, dtype=torch.float32).mul_(std))
