"""What the CUDA graphs (decode steps, short prompt steps) cost in device memory, counted against the KV pool's
budget before the pool is sized.

Graphs are captured after the pool exists (they replay the paged cache's memory management), so their memory is
reserved from an estimate, as vLLM reserves room for what it cannot profile before sizing its KV cache:

- a static fp32 logits buffer [max_batch, vocab] that every bucket's forward writes into (so no bucket keeps an
  output of its own alive in the graph pool);
- the graph pool: the buckets share one private pool and are captured largest first, so it holds about one
  largest-bucket step of activations (the bf16 logits, the MLP's and attention's intermediates, the attention's
  split-K partials), which smaller buckets reuse;
- a fixed amount per bucket (the graph objects, each bucket's plan and write targets).

DecodeGraphs measures the real cost as it captures (`memory_bytes`), to check the estimate against.
"""
from __future__ import annotations

from diffkv_serve.engine.config import GRAPH_BATCH_CAP
from diffkv_serve.engine.model_config import ModelArch

PER_BUCKET_BYTES = 2 * 2**20
ATTENTION_SPLITS = 16  # split-K partials per row and query head reserved for (the kernel picks fewer at large batch)


def graph_batch_limit(max_graph_batch_size: int, max_num_seqs: int) -> int:
    """Largest captured batch: never more rows than the scheduler runs at once, nor past GRAPH_BATCH_CAP."""
    for name, v in (("max_graph_batch_size", max_graph_batch_size), ("max_num_seqs", max_num_seqs)):
        if v < 1:
            raise ValueError(f"{name} must be at least 1, got {v}")
    return min(max_graph_batch_size, max_num_seqs, GRAPH_BATCH_CAP)


def graph_buckets(max_batch: int) -> list[int]:
    """Captured batch sizes: 1, 2, 4, 8, then every 16th up to max_batch (a step pads to the next one)."""
    if max_batch < 1:
        raise ValueError(f"max_batch must be at least 1, got {max_batch}")
    sizes = [b for b in (1, 2, 4, 8) if b < max_batch] + list(range(16, max_batch, 16))
    return sizes + [max_batch]


def _layer_row_bytes(arch: ModelArch, dtype_bytes: int, h: int, hk: int) -> int:
    """One token's intermediates in a layer (MLP, residual and norms, q/k/v and attention output)."""
    return dtype_bytes * (3 * arch.intermediate_size + 6 * arch.hidden_size + 2 * (h + 2 * hk) * arch.head_dim)


def step_activation_bytes(arch: ModelArch, rows: int, dtype_bytes: int, num_heads: int | None = None,
                          num_kv_heads: int | None = None) -> int:
    """Peak activations of one decode step of `rows` sequences (one layer's intermediates are live at a time)."""
    h = arch.num_heads if num_heads is None else num_heads
    hk = arch.num_kv_heads if num_kv_heads is None else num_kv_heads
    per_row = dtype_bytes * arch.vocab_size + _layer_row_bytes(arch, dtype_bytes, h, hk)
    per_row += 4 * h * ATTENTION_SPLITS * (arch.head_dim + 2)  # fp32 partial outputs, max and sum
    return rows * per_row


def graph_memory_estimate(arch: ModelArch, max_batch: int, dtype_bytes: int, num_heads: int | None = None,
                          num_kv_heads: int | None = None) -> int:
    """Bytes the decode graphs of batches up to `max_batch` take: logits buffer + pool + per-bucket fixed cost."""
    logits = 4 * max_batch * arch.vocab_size
    pool = step_activation_bytes(arch, max_batch, dtype_bytes, num_heads, num_kv_heads)
    return logits + pool + PER_BUCKET_BYTES * len(graph_buckets(max_batch))


def prefill_buckets(max_tokens: int) -> list[int]:
    """Token counts prompt-step graphs are captured for: 128, 256, 512, then steps of about 1.5x (768, 1024,
    1536, 2048, 3072, ...) below max_tokens, and max_tokens (a step pads to the next one)."""
    if max_tokens < 1:
        raise ValueError(f"max_tokens must be at least 1, got {max_tokens}")
    sizes, b = [128, 256, 512], 512
    while b < max_tokens:
        sizes += [b * 3 // 2, b * 2]
        b *= 2
    return [s for s in sizes if s < max_tokens] + [max_tokens]


def prefill_graph_bytes(arch: ModelArch, max_tokens: int, dtype_bytes: int, num_heads: int | None = None,
                        num_kv_heads: int | None = None) -> int:
    """Bytes the prompt-step graphs up to `max_tokens` tokens take: one largest forward's activations (the pool
    the buckets share), the static inputs (ids, positions and per-layer write targets) and the per-bucket cost."""
    if max_tokens <= 0:
        return 0
    h = arch.num_heads if num_heads is None else num_heads
    hk = arch.num_kv_heads if num_kv_heads is None else num_kv_heads
    per_token = _layer_row_bytes(arch, dtype_bytes, h, hk)
    per_token += 16 + 8 * arch.num_layers * hk  # ids, positions; page and row of every (layer, KV head)
    return max_tokens * per_token + PER_BUCKET_BYTES * len(prefill_buckets(max_tokens))


def kv_pool_bytes(free: int, total: int, utilization: float, activation_bytes: int, graph_bytes: int,
                  floor: int = 2**26) -> int:
    """The page pool under gpu_memory_utilization: what is free now (weights loaded), less the share of the
    device left unused, the prefill activations and the CUDA graphs' estimate; at least `floor`."""
    if not 0 < utilization <= 1:
        raise ValueError(f"gpu_memory_utilization must be in (0, 1], got {utilization}")
    return int(max(free - (1 - utilization) * total - activation_bytes - graph_bytes, floor))
