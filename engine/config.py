"""Typed engine configuration: one place defines each name and its default."""
from __future__ import annotations

from typing import Literal, Optional

from pydantic import BaseModel, ConfigDict, Field, model_validator

KVMode = Literal["fp16"]  # later issues add int8 / int4 / diffkv through the same pages


class CacheConfig(BaseModel):
    model_config = ConfigDict(extra="forbid")
    kv_mode: KVMode = "fp16"
    block_size: int = Field(16, ge=1, description="tokens of a full-precision page; page bytes follow from it")
    num_pages: Optional[int] = Field(None, ge=1, description="fixed pool size; overrides kv_cache_memory_gb")
    kv_cache_memory_gb: Optional[float] = Field(
        None, gt=0, description="bytes for the page pool; default: 0.5 GiB on CPU, gpu_memory_utilization on CUDA")
    gpu_memory_utilization: float = Field(0.85, gt=0, le=1)


class SchedulerConfig(BaseModel):
    model_config = ConfigDict(extra="forbid")
    max_num_seqs: int = Field(64, ge=1)
    max_num_batched_tokens: int = Field(8192, ge=1)


class EngineConfig(BaseModel):
    model_config = ConfigDict(extra="forbid")
    model: Optional[str] = Field(None, description="HF folder, .gguf file, 'random:<preset>' or None (embedded)")
    device: str = Field("auto", description="'auto' (cuda if available), 'cpu', 'cuda', 'cuda:N'")
    dtype: Literal["auto", "float32", "float16", "bfloat16"] = "auto"
    max_model_len: Optional[int] = Field(None, ge=1, description="default: the model's context length")
    seed: int = 0
    enforce_eager: bool = Field(False, description="CUDA: run decode steps eagerly instead of replaying CUDA graphs")
    max_graph_batch_size: int = Field(256, ge=1, description="largest decode batch captured in a CUDA graph")
    cache: CacheConfig = Field(default_factory=CacheConfig)
    scheduler: SchedulerConfig = Field(default_factory=SchedulerConfig)

    @model_validator(mode="after")
    def _check_device(self) -> "EngineConfig":
        if not (self.device in ("auto", "cpu", "cuda") or self.device.startswith("cuda:")):
            raise ValueError(f"device={self.device!r}: use 'auto', 'cpu', 'cuda' or 'cuda:N'")
        return self
