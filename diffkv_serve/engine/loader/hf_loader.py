"""Load a Hugging Face model folder: config.json, *.safetensors (single or sharded), tokenizer.json.

Reads the files directly (no transformers import). Accepts both config styles: transformers 4
(`rope_theta` + `rope_scaling`) and transformers 5 (`rope_parameters`).
"""
from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Iterator, Mapping, Optional

import tokenizers
import torch
from safetensors import safe_open
from safetensors.torch import load_file

from diffkv_serve.engine.loader.weights import check_weights
from diffkv_serve.engine.model_config import ModelArch, RopeScaling
from diffkv_serve.engine.tokenizer import Tokenizer

_ARCHS = {
    "LlamaForCausalLM": "llama",
    "MistralForCausalLM": "mistral",
    "Qwen2ForCausalLM": "qwen2",
    "Qwen3ForCausalLM": "qwen3",
}


def _read_json(path: Path, required: bool = True) -> dict:
    if not path.is_file():
        if required:
            raise FileNotFoundError(f"{path.parent}: missing {path.name} (needed to load a Hugging Face model folder)")
        return {}
    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except json.JSONDecodeError as e:
        raise ValueError(f"{path}: invalid JSON ({e})") from e


def _as_list(v: Any) -> list[int]:
    if v is None:
        return []
    return [int(x) for x in v] if isinstance(v, (list, tuple)) else [int(v)]


def _token_text(v: Any) -> Optional[str]:
    """tokenizer_config stores special tokens as a string or as an AddedToken dict."""
    return v.get("content") if isinstance(v, dict) else v


def _rope(cfg: dict) -> tuple[float, Optional[RopeScaling]]:
    params = cfg.get("rope_parameters") or cfg.get("rope_scaling") or {}
    theta = float(cfg.get("rope_theta") or params.get("rope_theta") or 10000.0)
    kind = params.get("rope_type") or params.get("type") or "default"
    if kind == "default":
        return theta, None
    if kind not in ("llama3", "linear"):
        raise ValueError(f"unsupported rope scaling type {kind!r} (supported: default, linear, llama3)")
    return theta, RopeScaling.model_validate({**params, "rope_type": kind})


def arch_from_config(cfg: dict, folder: Path, extra_eos: list[int] = (), bos_fallback: Optional[int] = None) -> ModelArch:
    names = cfg.get("architectures") or []
    arch = next((_ARCHS[n] for n in names if n in _ARCHS), None)
    if arch is None:
        raise ValueError(f"{folder / 'config.json'}: unsupported architectures {names} (supported: {sorted(_ARCHS)})")
    hidden, heads = cfg["hidden_size"], cfg["num_attention_heads"]
    theta, scaling = _rope(cfg)
    return ModelArch(
        architecture=arch,
        vocab_size=cfg["vocab_size"],
        hidden_size=hidden,
        intermediate_size=cfg["intermediate_size"],
        num_layers=cfg["num_hidden_layers"],
        num_heads=heads,
        num_kv_heads=cfg.get("num_key_value_heads") or heads,
        head_dim=cfg.get("head_dim") or hidden // heads,
        rms_norm_eps=cfg.get("rms_norm_eps", 1e-6),
        rope_theta=theta,
        rope_scaling=scaling,
        max_position_embeddings=cfg.get("max_position_embeddings", 4096),
        tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
        # Qwen2 always has q/k/v bias (its config has no switch); Llama-style configs say attention_bias.
        attention_bias=arch == "qwen2" or bool(cfg.get("attention_bias", False)),
        qk_norm=arch == "qwen3",
        bos_token_id=cfg.get("bos_token_id") if cfg.get("bos_token_id") is not None else bos_fallback,
        eos_token_ids=list(dict.fromkeys(list(extra_eos) + _as_list(cfg.get("eos_token_id")))),
    )


class LazySafetensors(Mapping[str, torch.Tensor]):
    """HF-named tensors read from their safetensors files on access, one at a time: a tensor-parallel rank
    takes its shard of each and drops the rest, so it never holds the whole checkpoint in host memory."""

    def __init__(self, paths: list[Path]):
        self._where: dict[str, Path] = {}
        self._shapes: dict[str, tuple[int, ...]] = {}
        for p in paths:
            with safe_open(str(p), framework="pt") as f:
                for name in f.keys():
                    self._where[name] = p
                    self._shapes[name] = tuple(f.get_slice(name).get_shape())

    def __getitem__(self, name: str) -> torch.Tensor:
        with safe_open(str(self._where[name]), framework="pt") as f:
            return f.get_tensor(name)

    def __contains__(self, name: object) -> bool:
        return name in self._where

    def __iter__(self) -> Iterator[str]:
        return iter(self._where)

    def __len__(self) -> int:
        return len(self._where)

    def __delitem__(self, name: str) -> None:
        del self._where[name], self._shapes[name]

    def pop(self, name: str, default=None):
        if name not in self._where:
            return default
        del self[name]
        return default  # the tensor itself is never read

    @property
    def shapes(self) -> dict[str, tuple[int, ...]]:
        return dict(self._shapes)


def _safetensors_paths(folder: Path) -> list[Path]:
    index = folder / "model.safetensors.index.json"
    if index.is_file():
        files = sorted(set(_read_json(index)["weight_map"].values()))
        missing = [f for f in files if not (folder / f).is_file()]
        if missing:
            raise FileNotFoundError(f"{folder}: shards listed in {index.name} are missing: {missing}")
        paths = [folder / f for f in files]
    else:
        paths = sorted(folder.glob("*.safetensors"))
        if not paths:
            raise FileNotFoundError(
                f"{folder}: no *.safetensors weights found (pytorch_model.bin is not supported; re-save with safetensors)"
            )
    return paths


def load_hf_weights(folder: Path, lazy: bool = False) -> dict[str, torch.Tensor] | LazySafetensors:
    paths = _safetensors_paths(folder)
    if lazy:
        return LazySafetensors(paths)
    weights: dict[str, torch.Tensor] = {}
    for p in paths:
        weights.update(load_file(p))
    return weights


def load_hf_tokenizer(folder: Path, eos_ids: list[int], bos_id: Optional[int]) -> tuple[Tokenizer, list[int], Optional[int]]:
    """Returns the tokenizer plus the final eos ids / bos id (tokenizer_config may add to them)."""
    tok_file = folder / "tokenizer.json"
    if not tok_file.is_file():
        raise FileNotFoundError(f"{folder}: missing tokenizer.json (only fast-tokenizer folders are supported)")
    backend = tokenizers.Tokenizer.from_file(str(tok_file))
    tcfg = _read_json(folder / "tokenizer_config.json", required=False)

    template = tcfg.get("chat_template")
    if isinstance(template, list):  # named templates: [{"name": "default", "template": ...}, ...]
        template = next((t["template"] for t in template if t.get("name") == "default"), None)
    jinja_file = folder / "chat_template.jinja"
    if template is None and jinja_file.is_file():
        template = jinja_file.read_text(encoding="utf-8")

    eos_text = _token_text(tcfg.get("eos_token"))
    eos_tok = backend.token_to_id(eos_text) if eos_text else None
    eos_ids = list(dict.fromkeys(eos_ids + ([eos_tok] if eos_tok is not None else [])))
    if bos_id is None and _token_text(tcfg.get("bos_token")):
        bos_id = backend.token_to_id(_token_text(tcfg["bos_token"]))
    # BOS: tokenizer.json's post-processor already encodes the model's rule (e.g. Llama 3 prepends
    # <|begin_of_text|>, Qwen adds nothing), exactly what transformers uses.
    return Tokenizer(backend, chat_template=template, bos_token_id=bos_id, eos_token_ids=eos_ids), eos_ids, bos_id


def load_hf(folder: str | Path, with_weights: bool = True,
            lazy: bool = False) -> tuple[ModelArch, Optional[Mapping[str, torch.Tensor]], Tokenizer]:
    """with_weights=False reads config and tokenizer only (weights=None); lazy=True returns a
    LazySafetensors mapping (tensors read on access) instead of loading every tensor now."""
    folder = Path(folder)
    cfg = _read_json(folder / "config.json")
    gen = _read_json(folder / "generation_config.json", required=False)
    arch = arch_from_config(cfg, folder, extra_eos=_as_list(gen.get("eos_token_id")), bos_fallback=gen.get("bos_token_id"))
    tokenizer, eos_ids, bos_id = load_hf_tokenizer(folder, arch.eos_token_ids, arch.bos_token_id)
    arch = arch.model_copy(update={"eos_token_ids": eos_ids, "bos_token_id": bos_id})
    if not with_weights:
        return arch, None, tokenizer

    weights = load_hf_weights(folder, lazy=lazy)
    for k in [k for k in weights if k.endswith("rotary_emb.inv_freq")]:
        del weights[k]  # old checkpoints saved this recomputable buffer
    if arch.tie_word_embeddings:
        weights.pop("lm_head.weight", None)  # tied: the engine reuses embed_tokens
    check_weights(arch, weights, str(folder))
    return arch, weights, tokenizer
