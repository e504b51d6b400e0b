"""Measure the key centers (engine.key_centering) of a model: the mean post-RoPE key per (layer, KV head) over
calibration sequences (each prompt with its fp16 continuation, what generation attends to), read from eager
prefills of a 16-bit cache, so they are the model's own keys."""
from __future__ import annotations

import torch
from tqdm.auto import tqdm

from diffkv_serve.engine import key_centering


def measure_key_centers(model, sequences: list[list[int]]) -> torch.Tensor:
    """[layers, kv_heads, head_dim] float32 mean of the keys over every token of `sequences`."""
    if not sequences:
        raise ValueError("measure_key_centers: needs at least one calibration sequence")
    with model.engine({"kv_mode": "fp16", "key_centering": "off"}) as eng:
        with key_centering.observe(eng.runner.model) as means:
            for seq in tqdm(sequences, desc="key centers", leave=False):
                eng.prompt_logits(list(seq))
    return means.mean()


def center_summary(centers: torch.Tensor) -> dict:
    """What a settings file records beside the vectors: the largest |center| per layer (where outliers live)."""
    return {"sequences_mean_of": "post-RoPE keys", "max_abs_per_layer": [round(float(x), 2) for x in
                                                                        centers.abs().amax(dim=(1, 2))]}
