"""Load a GGUF file: metadata -> ModelArch, tensors -> float32 with HF names, tokenizer from metadata.

Dequantizing costs seconds, so the converted checkpoint is cached as safetensors + JSON under
`cache_dir()/gguf/<stem>-<key>/`, keyed by the file's (path, size, mtime); later loads mmap it.
"""
from __future__ import annotations

import json
import re
import struct
from pathlib import Path
from typing import Optional

import gguf
import numpy as np
import torch
from safetensors.torch import load_file, save_file

from diffkv_serve.engine.loader.cache import atomic_write, atomic_write_text, cache_dir, file_identity, identity_key
from diffkv_serve.engine.loader.gguf_tokenizer import tokenizer_from_gguf
from diffkv_serve.engine.loader.weights import check_weights
from diffkv_serve.engine.model_config import ModelArch, RopeScaling
from diffkv_serve.engine.tokenizer import Tokenizer

CACHE_FORMAT = 1
# GGUF general.architecture -> ModelArch.architecture. llama.cpp permutes Q/K rows only for these:
_ARCHS = {"llama": "llama", "mistral": "mistral", "qwen2": "qwen2", "qwen3": "qwen3"}
_PERMUTED = {"llama", "mistral"}

_GLOBAL_NAMES = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}
_LAYER_NAMES = {
    "attn_norm.weight": "input_layernorm.weight",
    "ffn_norm.weight": "post_attention_layernorm.weight",
    "attn_q.weight": "self_attn.q_proj.weight",
    "attn_k.weight": "self_attn.k_proj.weight",
    "attn_v.weight": "self_attn.v_proj.weight",
    "attn_q.bias": "self_attn.q_proj.bias",
    "attn_k.bias": "self_attn.k_proj.bias",
    "attn_v.bias": "self_attn.v_proj.bias",
    "attn_output.weight": "self_attn.o_proj.weight",
    "attn_q_norm.weight": "self_attn.q_norm.weight",
    "attn_k_norm.weight": "self_attn.k_norm.weight",
    "ffn_gate.weight": "mlp.gate_proj.weight",
    "ffn_up.weight": "mlp.up_proj.weight",
    "ffn_down.weight": "mlp.down_proj.weight",
}
_BLOCK = re.compile(r"blk\.(\d+)\.(.+)")


def hf_name(gguf_name: str) -> str:
    if gguf_name in _GLOBAL_NAMES:
        return _GLOBAL_NAMES[gguf_name]
    m = _BLOCK.fullmatch(gguf_name)
    if m and m.group(2) in _LAYER_NAMES:
        return f"model.layers.{m.group(1)}.{_LAYER_NAMES[m.group(2)]}"
    raise ValueError(f"unsupported GGUF tensor {gguf_name!r}")


def unpermute_rows(w: torch.Tensor, n_heads: int) -> torch.Tensor:
    """Undo llama.cpp's Q/K permutation. Its converter stores each head's rotary pairs interleaved
    (rows j, j+d/2 -> 2j, 2j+1); HF's rotate_half wants them split into halves."""
    rows = w.shape[0]
    head_dim = rows // n_heads
    return w.reshape(n_heads, head_dim // 2, 2, *w.shape[1:]).transpose(1, 2).reshape(w.shape).contiguous()


# ---------------------------------------------------------------------------------------------
# Reading and validating the file
# ---------------------------------------------------------------------------------------------
_SCALAR = {0: "<B", 1: "<b", 2: "<H", 3: "<h", 4: "<I", 5: "<i", 6: "<f", 7: "<?", 10: "<Q", 11: "<q", 12: "<d"}


def _layout_problem(path: Path) -> str:
    """Walk the header ourselves to say *why* a file does not parse (gguf's errors are numpy noise)."""
    size = path.stat().st_size
    with open(path, "rb") as f:

        def read(n: int) -> bytes:
            if n > size:  # a length field larger than the whole file is garbage, not truncation
                raise ValueError(f"implausible length {n} at byte {f.tell()}")
            b = f.read(n)
            if len(b) < n:
                raise EOFError(f.tell())
            return b

        def unpack(fmt: str):
            return struct.unpack(fmt, read(struct.calcsize(fmt)))[0]

        def skip_value(vtype: int):
            if vtype == 8:
                f.seek(unpack("<Q"), 1)
            elif vtype == 9:
                etype, count = unpack("<I"), unpack("<Q")
                if etype in _SCALAR:
                    f.seek(struct.calcsize(_SCALAR[etype]) * count, 1)
                else:
                    for _ in range(count):
                        skip_value(etype)
            elif vtype in _SCALAR:
                read(struct.calcsize(_SCALAR[vtype]))
            else:
                raise ValueError(f"unknown metadata value type {vtype}")

        try:
            read(4)
            version = unpack("<I")
            if version not in (2, 3):
                return f"unsupported GGUF version {version}"
            n_tensors, n_kv = unpack("<Q"), unpack("<Q")
            alignment = 32
            for _ in range(n_kv):
                key = read(unpack("<Q")).decode("utf-8", "replace")
                vtype = unpack("<I")
                if key == "general.alignment" and vtype == 4:
                    alignment = unpack("<I")
                else:
                    skip_value(vtype)
                if f.tell() > size:
                    raise EOFError(f.tell())
            end = 0
            for _ in range(n_tensors):
                read(unpack("<Q"))  # tensor name: only its length matters here
                dims = [unpack("<Q") for _ in range(unpack("<I"))]
                qtype, offset = unpack("<I"), unpack("<Q")
                block, type_size = gguf.GGML_QUANT_SIZES[gguf.GGMLQuantizationType(qtype)]
                end = max(end, offset + int(np.prod(dims)) // block * type_size)
            data_start = -(-f.tell() // alignment) * alignment
        except EOFError as e:
            return f"file is {size} bytes and its header is cut off at byte {e.args[0]}: truncated?"
        except (ValueError, KeyError, UnicodeError, struct.error, OverflowError) as e:
            return f"corrupted header ({e})"
    if data_start + end > size:
        return f"file is {size} bytes but its tensor data needs {data_start + end}: truncated?"
    return "corrupted file"


def open_gguf(path: Path) -> gguf.GGUFReader:
    """GGUFReader with file-level checks turned into ValueErrors that name the file."""
    with open(path, "rb") as f:
        magic = f.read(4)
    if magic != b"GGUF":
        raise ValueError(f"{path}: not a GGUF file (bad magic {magic!r}, expected b'GGUF')")
    try:
        reader = gguf.GGUFReader(path)
    except Exception as e:  # numpy reshape/memmap errors on damaged files
        raise ValueError(f"{path}: {_layout_problem(path)} [{type(e).__name__}: {e}]") from e
    size = path.stat().st_size
    need = max((t.data_offset + t.n_bytes for t in reader.tensors), default=0)
    if need > size:
        raise ValueError(f"{path}: file is {size} bytes but its tensor data needs {need}: truncated?")
    return reader


def read_metadata(reader: gguf.GGUFReader) -> dict:
    return {k: f.contents() for k, f in reader.fields.items() if not k.startswith("GGUF.")}


# ---------------------------------------------------------------------------------------------
# Metadata -> ModelArch
# ---------------------------------------------------------------------------------------------
def _llama3_factors(s: RopeScaling, head_dim: int, theta: float) -> torch.Tensor:
    """Per-frequency divisors that llama.cpp stores as `rope_freqs.weight` for Llama-3.1 scaling."""
    inv_freq = 1.0 / theta ** (torch.arange(0, head_dim, 2, dtype=torch.float64) / head_dim)
    wavelen = 2 * torch.pi / inv_freq
    low_wl = s.original_max_position_embeddings / s.low_freq_factor
    high_wl = s.original_max_position_embeddings / s.high_freq_factor
    smooth = (s.original_max_position_embeddings / wavelen - s.low_freq_factor) / (s.high_freq_factor - s.low_freq_factor)
    mid = 1.0 / ((1 - smooth) / s.factor + smooth)
    return torch.where(wavelen < high_wl, torch.ones_like(wavelen), torch.where(wavelen > low_wl, torch.full_like(wavelen, s.factor), mid))


def _rope_scaling(md: dict, a: str, rope_freqs: Optional[torch.Tensor], head_dim: int, theta: float) -> Optional[RopeScaling]:
    kind = md.get(f"{a}.rope.scaling.type")
    if kind in (None, "none") and rope_freqs is None:
        return None
    if kind == "linear":
        return RopeScaling(rope_type="linear", factor=float(md[f"{a}.rope.scaling.factor"]))
    if kind not in (None, "none"):
        raise ValueError(f"unsupported GGUF rope scaling type {kind!r} (supported: linear, llama3 via rope_freqs)")
    # Llama 3.1+: only the factor table is stored. Accept it if it matches Llama-3's standard
    # parameters (low 1, high 4, original context 8192) with the largest factor.
    guess = RopeScaling(rope_type="llama3", factor=float(rope_freqs.max()), low_freq_factor=1.0, high_freq_factor=4.0,
                        original_max_position_embeddings=8192)
    if not torch.allclose(_llama3_factors(guess, head_dim, theta).float(), rope_freqs.float().flatten(), rtol=1e-3):
        raise ValueError("unsupported rope_freqs table in GGUF (not Llama-3 style scaling)")
    return guess


def arch_from_metadata(md: dict, tensors: dict[str, tuple[int, ...]], tokenizer: Tokenizer,
                       rope_freqs: Optional[torch.Tensor] = None) -> ModelArch:
    """`tensors`: GGUF tensor name -> torch-order shape."""
    a = md.get("general.architecture")
    if a not in _ARCHS:
        raise ValueError(f"unsupported GGUF architecture {a!r} (supported: {sorted(_ARCHS)})")

    def get(key: str, default=None):
        if f"{a}.{key}" in md:
            return md[f"{a}.{key}"]
        if default is None:
            raise ValueError(f"GGUF metadata lacks {a}.{key}")
        return default

    hidden, n_heads = int(get("embedding_length")), int(get("attention.head_count"))
    head_dim = int(get("attention.key_length", hidden // n_heads))
    theta = float(get("rope.freq_base", 10000.0))
    return ModelArch(
        architecture=_ARCHS[a],
        vocab_size=tensors["token_embd.weight"][0],
        hidden_size=hidden,
        intermediate_size=int(get("feed_forward_length")),
        num_layers=int(get("block_count")),
        num_heads=n_heads,
        num_kv_heads=int(get("attention.head_count_kv", n_heads)),
        head_dim=head_dim,
        rms_norm_eps=float(get("attention.layer_norm_rms_epsilon", 1e-5)),
        rope_theta=theta,
        rope_scaling=_rope_scaling(md, a, rope_freqs, head_dim, theta),
        max_position_embeddings=int(get("context_length", 4096)),
        tie_word_embeddings="output.weight" not in tensors,
        attention_bias="blk.0.attn_q.bias" in tensors,
        qk_norm="blk.0.attn_q_norm.weight" in tensors,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_ids=tokenizer.eos_token_ids,
    )


# ---------------------------------------------------------------------------------------------
# Conversion and cache
# ---------------------------------------------------------------------------------------------
def _dequantize(t) -> np.ndarray:
    try:
        arr = gguf.quants.dequantize(t.data, t.tensor_type)
    except NotImplementedError as e:
        raise ValueError(f"unsupported GGUF quantization {t.tensor_type.name} in tensor {t.name}") from e
    return np.asarray(arr, dtype=np.float32).reshape(tuple(int(d) for d in reversed(t.shape)))


def convert_gguf(path: Path) -> tuple[ModelArch, dict[str, torch.Tensor], Tokenizer]:
    reader = open_gguf(path)
    md = read_metadata(reader)
    shapes = {t.name: tuple(int(d) for d in reversed(t.shape)) for t in reader.tensors}
    if "token_embd.weight" not in shapes:
        raise ValueError(f"{path}: GGUF has no token_embd.weight")
    tokenizer = tokenizer_from_gguf(md, vocab_size=shapes["token_embd.weight"][0])
    by_name = {t.name: t for t in reader.tensors}
    rope_freqs = torch.from_numpy(_dequantize(by_name["rope_freqs.weight"])) if "rope_freqs.weight" in by_name else None
    try:
        arch = arch_from_metadata(md, shapes, tokenizer, rope_freqs)
    except ValueError as e:
        raise ValueError(f"{path}: {e}") from e

    weights: dict[str, torch.Tensor] = {}
    for t in reader.tensors:
        if t.name == "rope_freqs.weight":
            continue
        name = hf_name(t.name)
        w = torch.from_numpy(_dequantize(t).copy())  # copy: detach from the read-only memmap
        if arch.architecture in _PERMUTED and name.endswith(("q_proj.weight", "q_proj.bias")):
            w = unpermute_rows(w, arch.num_heads)
        elif arch.architecture in _PERMUTED and name.endswith(("k_proj.weight", "k_proj.bias")):
            w = unpermute_rows(w, arch.num_kv_heads)
        weights[name] = w
    check_weights(arch, weights, str(path))
    return arch, weights, tokenizer


def _cache_entry(path: Path) -> tuple[Path, dict]:
    identity = file_identity(path)
    return cache_dir() / "gguf" / f"{path.stem}-{identity_key(identity)}", identity


def load_gguf(path: str | Path, sha256: Optional[str] = None,
              with_weights: bool = True) -> tuple[ModelArch, Optional[dict[str, torch.Tensor]], Tokenizer]:
    """Load (from cache when possible) a GGUF checkpoint as float32 HF-named weights. with_weights=False
    returns weights=None and, when the conversion is cached, reads only its metadata."""
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"GGUF file not found: {path}")
    entry, identity = _cache_entry(path)
    meta_path, weights_path = entry / "meta.json", entry / "weights.safetensors"
    try:
        meta = json.loads(meta_path.read_text())
        if meta["format"] == CACHE_FORMAT and meta["source"]["size"] == identity["size"] and weights_path.is_file():
            weights = load_file(weights_path) if with_weights else None  # the converted float32 tensors
            return ModelArch.model_validate(meta["arch"]), weights, Tokenizer.from_json(meta["tokenizer"])
    except (OSError, ValueError, KeyError):
        pass  # no cache or a stale/damaged one: convert again

    arch, weights, tokenizer = convert_gguf(path)
    meta = {
        "format": CACHE_FORMAT,
        "source": {**identity, "sha256": sha256},
        "arch": arch.model_dump(mode="json"),
        "tokenizer": tokenizer.to_json(),
        "chat_template": tokenizer.chat_template,
    }
    try:
        # weights first, meta last: meta.json's presence means the entry is complete
        atomic_write(weights_path, lambda p: save_file(weights, str(p), metadata={"source": str(path)}))
        atomic_write_text(meta_path, json.dumps(meta))
    except OSError:
        pass  # read-only or full cache dir: still return the converted model
    return arch, weights if with_weights else None, tokenizer
