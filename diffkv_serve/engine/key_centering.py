"""Key centering: a static vector per (layer, KV head) subtracted from every post-RoPE key before it reaches
attention or the cache, so low-bit keys quantize the information instead of a constant offset.

Why it is exact: a query's logits against the keys of one head all shift by the same q . mu, which softmax
cancels, so attention outputs, the split-K merge (by log-sum-exp) and the significance scores (softmax
probabilities) are unchanged; only the quantization error changes. Why it matters: some models (Qwen2 with its
k_proj bias) carry a few key channels hundreds of times larger than the rest, in the lowest RoPE frequencies,
where they barely rotate; a per-token min-max scale of 4 bits then wipes out every other channel.

Where the vector comes from (`CacheConfig.key_centering`):
- "calibrated": the mean post-RoPE key per (layer, KV head) that `python3 -m evals.cli calibrate` measured over
  calibration sequences, stored in the model's settings file under "key_center" ([layers][kv_heads][head_dim]);
- "bias": with no calibration, the k_proj bias rotated to every position of a span and averaged (no data
  needed; the outlier channels barely rotate, so this is close to the bias there and near zero elsewhere);
- "auto": calibrated if the settings file has it, else bias if the model has a k_proj bias, else off; a 16-bit
  cache (kv_mode fp16) quantizes nothing, so "auto" leaves it off.
The vector is applied inside the rotary embedding's last multiply-add (engine.layers.RotaryEmbedding), so it
costs no extra kernel.
"""
from __future__ import annotations

from contextlib import contextmanager
from typing import Iterator, Optional

import torch

from diffkv_serve.engine.config import CacheConfig
from diffkv_serve.engine.model_config import ModelArch

SETTINGS_KEY = "key_center"
BIAS_SPAN = 4096  # positions the rotated bias is averaged over: the lengths of typical requests


def resolve_mode(cache: CacheConfig, arch: ModelArch, settings: Optional[dict]) -> str:
    """The centering that runs: 'calibrated', 'bias' or 'off' ('auto' resolved; explicit choices checked)."""
    has_calibrated = bool(settings) and SETTINGS_KEY in settings
    mode = cache.key_centering
    if mode == "auto":
        if cache.resolved_mode == "fp16":
            return "off"
        return "calibrated" if has_calibrated else ("bias" if arch.attention_bias else "off")
    if mode == "calibrated" and not has_calibrated:
        raise ValueError("cache.key_centering='calibrated': the model's settings file has no key_center; run "
                         "`python3 -m evals.cli calibrate` or use 'bias' / 'auto'")
    if mode == "bias" and not arch.attention_bias:
        raise ValueError("cache.key_centering='bias': the model has no k_proj bias; use 'calibrated', 'auto' or 'off'")
    return mode


def check_centers(centers: object, arch: ModelArch) -> torch.Tensor:
    """A settings file's key_center as a float32 tensor [layers, kv_heads, head_dim]; ValueError if misshapen."""
    try:
        t = torch.tensor(centers, dtype=torch.float32)
    except (TypeError, ValueError) as e:
        raise ValueError(f"{SETTINGS_KEY} must be a nested list of numbers: {e}") from e
    want = (arch.num_layers, arch.num_kv_heads, arch.head_dim)
    if tuple(t.shape) != want or not torch.isfinite(t).all():
        raise ValueError(f"{SETTINGS_KEY} must be finite numbers of shape {list(want)} (layers, KV heads, "
                         f"head_dim), got {list(t.shape)}")
    return t


@torch.no_grad()
def bias_centers(model: torch.nn.Module, span: int = BIAS_SPAN) -> torch.Tensor:
    """Mean over positions [0, span) of RoPE(k_proj bias), per layer and this rank's KV heads: [L, Hk, D]."""
    span = min(span, model.rope.cos.shape[0])
    positions = torch.arange(span, device=model.rope.cos.device)
    out = []
    for layer in model.layers:
        Hq, Hk = layer.num_heads, layer.num_kv_heads
        D = layer.head_dim
        b = layer.qkv_proj.bias[Hq * D:(Hq + Hk) * D].float().view(1, Hk, D).expand(span, Hk, D)
        out.append(model.rope(b, positions).mean(0))
    return torch.stack(out)


def install(model: torch.nn.Module, centers: Optional[torch.Tensor]) -> None:
    """Give every layer its rotary shift ([Hq + Hk, D]: zeros for the query heads, the centers for the keys), or
    none. `centers` is [L, Hk, D] for this rank's KV heads."""
    for i, layer in enumerate(model.layers):
        shift = None
        if centers is not None:
            w = layer.qkv_proj.weight
            shift = torch.zeros(layer.num_heads + layer.num_kv_heads, layer.head_dim, dtype=w.dtype, device=w.device)
            shift[layer.num_heads:] = centers[i].to(w.device, w.dtype)
        layer.qk_shift = shift


def centers_for(mode: str, settings: Optional[dict], arch: ModelArch, model: torch.nn.Module,
                kv_heads: tuple[int, int]) -> Optional[torch.Tensor]:
    """The centers [L, k1 - k0, D] of a resolved mode (resolve_mode) for KV heads [k0, k1), or None ('off')."""
    if mode == "calibrated":
        return rank_centers(check_centers(settings[SETTINGS_KEY], arch), kv_heads)
    if mode == "bias":
        return bias_centers(model)
    return None


def rank_centers(full: torch.Tensor, kv_heads: tuple[int, int]) -> torch.Tensor:
    """This rank's slice [L, k1 - k0, D] of the full-model centers [L, Hk, D]."""
    k0, k1 = kv_heads
    return full[:, k0:k1]


class KeyMeans:
    """Running mean of the post-RoPE, uncentered keys per (layer, KV head) (see `observe`)."""

    def __init__(self, num_layers: int):
        self.sums: list[Optional[torch.Tensor]] = [None] * num_layers
        self.count = [0] * num_layers

    def add(self, layer: int, keys: torch.Tensor) -> None:
        s = keys.double().sum(0).cpu()
        self.sums[layer] = s if self.sums[layer] is None else self.sums[layer] + s
        self.count[layer] += keys.shape[0]

    def mean(self) -> torch.Tensor:
        """[L, Hk, D] float32; ValueError if some layer saw no key."""
        if any(c == 0 for c in self.count):
            raise ValueError("no keys observed for some layer: run at least one prefill inside observe()")
        return torch.stack([s / c for s, c in zip(self.sums, self.count)]).float()


@contextmanager
def observe(model: torch.nn.Module) -> Iterator[KeyMeans]:
    """Record the keys of every forward pass run inside the block (eager only; the CUDA-graph decode replays do
    not call Python), with any installed center added back, so the mean is that of the model's own keys."""
    means = KeyMeans(len(model.layers))

    def hook(layer, keys: torch.Tensor) -> None:
        if layer.qk_shift is not None:
            keys = keys + layer.qk_shift[layer.num_heads:]
        means.add(layer.idx, keys)

    for layer in model.layers:
        layer.key_observer = hook
    try:
        yield means
    finally:
        for layer in model.layers:
            layer.key_observer = None


def to_settings(centers: torch.Tensor, digits: int = 5) -> list:
    """[L, Hk, D] as the nested list a settings file stores (rounded: the file stays readable and small)."""
    return [[[round(float(x), digits) for x in head] for head in layer] for layer in centers.tolist()]


def describe(mode: str, centers: Optional[torch.Tensor]) -> dict:
    """What stats() reports: the mode that runs and the largest center magnitude it removes."""
    return {"mode": mode, "max_abs_center": None if centers is None else round(float(centers.abs().max()), 3)}

