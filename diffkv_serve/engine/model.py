"""Llama-family decoder (Llama 2/3, Mistral, Qwen2/2.5, Qwen3) in plain PyTorch, tensor-parallel ready.

Each rank holds its share of the attention heads and MLP columns: q/k/v and gate/up are column-parallel
(fused per layer), o_proj and down_proj are row-parallel and followed by an all-reduce. The attention
itself is delegated to a backend object (engine.attention) that reads and writes the paged KV cache.
"""
from __future__ import annotations

from typing import Mapping, Optional, Protocol

import torch
from torch import nn

from diffkv_serve.engine.layers import RMSNorm, RotaryEmbedding, silu_and_mul
from diffkv_serve.engine.model_config import ModelArch
from diffkv_serve.engine.parallel import SINGLE, ParallelContext, check_tensor_parallel


class AttentionBackend(Protocol):
    def __call__(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        """q [N, Hq, D], k/v [N, Hkv, D] of this rank's heads -> [N, Hq, D]."""


class DecoderLayer(nn.Module):
    def __init__(self, arch: ModelArch, idx: int, pc: ParallelContext):
        super().__init__()
        self.idx = idx
        self.pc = pc
        D = arch.head_dim
        self.num_heads = pc.num_heads(arch)
        self.num_kv_heads = pc.num_kv_heads(arch)
        self.qkv_sizes = (self.num_heads * D, self.num_kv_heads * D, self.num_kv_heads * D)
        c0, c1 = pc.mlp_columns(arch)
        inter = c1 - c0
        self.input_layernorm = RMSNorm(arch.hidden_size, arch.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(arch.hidden_size, arch.rms_norm_eps)
        self.qkv_proj = nn.Linear(arch.hidden_size, sum(self.qkv_sizes), bias=arch.attention_bias)
        self.o_proj = nn.Linear(self.num_heads * D, arch.hidden_size, bias=False)
        self.q_norm = RMSNorm(D, arch.rms_norm_eps) if arch.qk_norm else None
        self.k_norm = RMSNorm(D, arch.rms_norm_eps) if arch.qk_norm else None
        self.gate_up_proj = nn.Linear(arch.hidden_size, 2 * inter, bias=False)
        self.down_proj = nn.Linear(inter, arch.hidden_size, bias=False)
        self.head_dim = D
        # Key centering (engine.key_centering): [Hq + Hk, D] subtracted after RoPE (zeros for queries), or None.
        self.register_buffer("qk_shift", None, persistent=False)
        self.key_observer = None  # calibration: called with (layer, keys) on eager forwards
        # KV rotation (engine.kv_rotation): [D, D] applied to queries and keys after RoPE, or None.
        self.register_buffer("kv_rotation", None, persistent=False)

    def forward(self, h: torch.Tensor, delta: Optional[torch.Tensor], rope: RotaryEmbedding,
                tables: tuple[torch.Tensor, torch.Tensor], attn: AttentionBackend
                ) -> tuple[torch.Tensor, torch.Tensor]:
        """(residual stream h, the previous layer's MLP output delta or None) -> (h, this layer's MLP output).
        The residual adds ride in the next norm's kernel (RMSNorm.add_and_norm); rope tables come per forward."""
        N, D = h.shape[0], self.head_dim
        h, x = self.input_layernorm.add_and_norm(h, delta)
        qkv = self.qkv_proj(x)
        Hq, Hk = self.num_heads, self.num_kv_heads
        qk = qkv[:, : (Hq + Hk) * D].view(N, Hq + Hk, D)
        v = qkv[:, (Hq + Hk) * D:].view(N, Hk, D)
        if self.q_norm is not None:
            qk = torch.cat([self.q_norm(qk[:, :Hq]), self.k_norm(qk[:, Hq:])], 1)
        qk = rope(qk, None, self.qk_shift, tables)  # q and k rotate together: one kernel
        q, k = qk[:, :Hq], qk[:, Hq:]
        if self.key_observer is not None:
            self.key_observer(self, k)
        if self.kv_rotation is not None:  # after centering: the centers are measured in the model's own basis
            qk = qk @ self.kv_rotation
            q, k = qk[:, :Hq], qk[:, Hq:]
        o = attn(self.idx, q, k, v).reshape(N, self.num_heads * D)
        h, x = self.post_attention_layernorm.add_and_norm(h, self.pc.all_reduce(self.o_proj(o)))
        return h, self.pc.all_reduce(self.down_proj(silu_and_mul(self.gate_up_proj(x))))


class CausalLM(nn.Module):
    def __init__(self, arch: ModelArch, max_len: int, pc: ParallelContext = SINGLE):
        super().__init__()
        check_tensor_parallel(arch, pc.world_size)
        self.arch, self.pc = arch, pc
        self.embed_tokens = nn.Embedding(arch.vocab_size, arch.hidden_size)
        self.layers = nn.ModuleList(DecoderLayer(arch, i, pc) for i in range(arch.num_layers))
        self.norm = RMSNorm(arch.hidden_size, arch.rms_norm_eps)
        self.lm_head = None if arch.tie_word_embeddings else nn.Linear(arch.hidden_size, arch.vocab_size, bias=False)
        self.rope = RotaryEmbedding(arch, max_len)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, attn: AttentionBackend) -> torch.Tensor:
        """Flat batch of tokens [N] -> final hidden states [N, hidden]."""
        h, delta = self.embed_tokens(input_ids), None
        tables = self.rope.tables(positions)
        for layer in self.layers:
            h, delta = layer(h, delta, self.rope, tables, attn)
        return self.norm.add_and_norm(h, delta)[1]

    def logits(self, hidden: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
        """fp32 logits [N, vocab]; into `out` (a static buffer, e.g. the CUDA graphs' shared one) when given, by
        the same one conversion kernel."""
        w = self.embed_tokens.weight if self.lm_head is None else self.lm_head.weight
        if out is None:
            return (hidden @ w.t()).float()
        return out.copy_(hidden @ w.t())

    @property
    def vocab_rows(self) -> int:
        """Width of the logits."""
        return (self.embed_tokens.weight if self.lm_head is None else self.lm_head.weight).shape[0]

    # ---- weights --------------------------------------------------------------------------------
    def shard(self, name: str, full: torch.Tensor) -> torch.Tensor:
        """This rank's part of parameter `name` given its full (single-rank) value: the one definition of
        the split. qkv_proj rows are [q | k | v] and gate_up_proj rows [gate | up], each cut per head or
        column range; o_proj and down_proj are cut along their input columns; the rest is replicated."""
        arch, pc = self.arch, self.pc
        if pc.world_size == 1:
            return full
        D = arch.head_dim
        q0, q1 = pc.q_heads(arch)
        k0, k1 = pc.kv_heads(arch)
        c0, c1 = pc.mlp_columns(arch)
        if name.endswith(("qkv_proj.weight", "qkv_proj.bias")):
            q, k, v = full.split([arch.num_heads * D, arch.num_kv_heads * D, arch.num_kv_heads * D])
            return torch.cat([q[q0 * D: q1 * D], k[k0 * D: k1 * D], v[k0 * D: k1 * D]])
        if name.endswith("o_proj.weight"):
            return full[:, q0 * D: q1 * D]
        if name.endswith("gate_up_proj.weight"):
            gate, up = full.chunk(2)
            return torch.cat([gate[c0:c1], up[c0:c1]])
        if name.endswith("down_proj.weight"):
            return full[:, c0:c1]
        return full

    @torch.no_grad()
    def load_weights(self, weights: Mapping[str, torch.Tensor]) -> None:
        """Copy a Hugging Face-named state dict into this rank's shards (fusing q/k/v and gate/up). Tensors
        are read one layer at a time, so a lazy mapping keeps only that much of the checkpoint in memory."""
        arch = self.arch

        def get(name: str) -> torch.Tensor:
            if name not in weights:
                raise ValueError(f"checkpoint has no tensor {name!r}")
            return weights[name]

        def put(param: torch.Tensor, name: str, full: torch.Tensor, source: str) -> None:
            value = self.shard(name, full)
            if param.shape != value.shape:
                raise ValueError(f"{source}: checkpoint shape {tuple(full.shape)} does not give model shape "
                                 f"{tuple(param.shape)} (rank {self.pc.rank} of {self.pc.world_size})")
            param.copy_(value)

        put(self.embed_tokens.weight, "embed_tokens.weight", get("model.embed_tokens.weight"),
            "model.embed_tokens.weight")
        put(self.norm.weight, "norm.weight", get("model.norm.weight"), "model.norm.weight")
        if self.lm_head is not None:
            put(self.lm_head.weight, "lm_head.weight", get("lm_head.weight"), "lm_head.weight")
        for i, layer in enumerate(self.layers):
            p = f"model.layers.{i}."
            n = f"layers.{i}."
            qkv = [get(p + f"self_attn.{x}_proj.weight") for x in "qkv"]
            put(layer.qkv_proj.weight, n + "qkv_proj.weight", torch.cat(qkv), p + "self_attn.q/k/v_proj.weight")
            if arch.attention_bias:
                bias = [get(p + f"self_attn.{x}_proj.bias") for x in "qkv"]
                put(layer.qkv_proj.bias, n + "qkv_proj.bias", torch.cat(bias), p + "self_attn.q/k/v_proj.bias")
            put(layer.o_proj.weight, n + "o_proj.weight", get(p + "self_attn.o_proj.weight"),
                p + "self_attn.o_proj.weight")
            if arch.qk_norm:
                put(layer.q_norm.weight, n + "q_norm.weight", get(p + "self_attn.q_norm.weight"),
                    p + "self_attn.q_norm.weight")
                put(layer.k_norm.weight, n + "k_norm.weight", get(p + "self_attn.k_norm.weight"),
                    p + "self_attn.k_norm.weight")
            gate_up = torch.cat([get(p + "mlp.gate_proj.weight"), get(p + "mlp.up_proj.weight")])
            put(layer.gate_up_proj.weight, n + "gate_up_proj.weight", gate_up, p + "mlp.gate/up_proj.weight")
            put(layer.down_proj.weight, n + "down_proj.weight", get(p + "mlp.down_proj.weight"),
                p + "mlp.down_proj.weight")
            put(layer.input_layernorm.weight, n + "input_layernorm.weight", get(p + "input_layernorm.weight"),
                p + "input_layernorm.weight")
            put(layer.post_attention_layernorm.weight, n + "post_attention_layernorm.weight",
                get(p + "post_attention_layernorm.weight"), p + "post_attention_layernorm.weight")

    @torch.no_grad()
    def init_random(self, seed: int = 0, std: float = 0.02) -> None:
        """Random weights in place on the model's device (GPU benchmarks of large shapes): norms at one,
        matrices and biases drawn from N(0, std). Every rank draws each parameter at its full single-rank
        shape from the same stream and keeps its shard, so TP=N builds the same model as TP=1."""
        g = torch.Generator(device=self.embed_tokens.weight.device).manual_seed(seed)
        full_shapes = self._full_shapes()
        for name, p in self.named_parameters():
            if "norm" in name:
                p.fill_(1.0)
            else:
                full = torch.randn(full_shapes[name], generator=g, device=p.device, dtype=torch.float32).mul_(std)
                p.copy_(self.shard(name, full))

    def _full_shapes(self) -> dict[str, torch.Size]:
        if self.pc.world_size == 1:
            return {name: p.shape for name, p in self.named_parameters()}
        with torch.device("meta"):
            whole = CausalLM(self.arch, 1, SINGLE)
        return {name: p.shape for name, p in whole.named_parameters()}
