"""Architecture description shared by every loader (HF folder, GGUF, random weights) and the model code."""
from __future__ import annotations

from typing import Literal, Optional

from pydantic import BaseModel, ConfigDict, Field

Architecture = Literal["llama", "mistral", "qwen2", "qwen3"]


class RopeScaling(BaseModel):
    """Llama-3 style frequency scaling (rope_type "llama3"); "linear" divides positions by factor."""

    model_config = ConfigDict(extra="ignore")
    rope_type: Literal["llama3", "linear", "default"] = "default"
    factor: float = 1.0
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0
    original_max_position_embeddings: int = 8192


class ModelArch(BaseModel):
    """Shape and numerics of a Llama-family decoder. Weight names follow Hugging Face's convention."""

    model_config = ConfigDict(extra="forbid")
    architecture: Architecture = "llama"
    vocab_size: int = Field(gt=0)
    hidden_size: int = Field(gt=0)
    intermediate_size: int = Field(gt=0)
    num_layers: int = Field(gt=0)
    num_heads: int = Field(gt=0)
    num_kv_heads: int = Field(gt=0)
    head_dim: int = Field(gt=0)
    rms_norm_eps: float = 1e-5
    rope_theta: float = 10000.0
    rope_scaling: Optional[RopeScaling] = None
    max_position_embeddings: int = 4096
    tie_word_embeddings: bool = False
    attention_bias: bool = False  # Qwen2/2.5: bias on q, k, v projections
    qk_norm: bool = False  # Qwen3: RMSNorm over each head of q and k before RoPE
    bos_token_id: Optional[int] = None
    eos_token_ids: list[int] = Field(default_factory=list)

    @property
    def group_size(self) -> int:
        return self.num_heads // self.num_kv_heads
