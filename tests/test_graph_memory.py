"""CUDA-graph memory on CPU: which batch sizes are captured, what they are budgeted, and the page pool sized
under gpu_memory_utilization with that budget taken off first (ModelRunner._num_pages with a fake device)."""
from __future__ import annotations

from types import SimpleNamespace

import pydantic
import pytest
import torch

from diffkv_serve.engine import EngineConfig
from diffkv_serve.engine.config import GRAPH_BATCH_CAP
from diffkv_serve.engine.graph_memory import (graph_batch_limit, graph_buckets, graph_memory_estimate,
                                              kv_pool_bytes, prefill_buckets, prefill_graph_bytes,
                                              step_activation_bytes)
from diffkv_serve.engine.kv.layout import CacheShape, pages_for_bytes
from diffkv_serve.engine.loader.presets import ARCH_PRESETS
from diffkv_serve.engine.model import CausalLM
from diffkv_serve.engine.model_runner import ModelRunner

GiB = 2**30
QWEN = ARCH_PRESETS["qwen2.5-1.5b"]


def test_capture_sizes_are_bounded_by_the_scheduler_and_the_cap():
    assert graph_batch_limit(256, 64) == 64  # never more rows than the scheduler runs at once
    assert graph_batch_limit(256, 1024) == 256
    assert graph_batch_limit(GRAPH_BATCH_CAP, 4096) == GRAPH_BATCH_CAP == 512
    with pytest.raises(ValueError, match="max_num_seqs"):
        graph_batch_limit(256, 0)
    assert graph_buckets(1) == [1] and graph_buckets(20) == [1, 2, 4, 8, 16, 20]
    b = graph_buckets(512)
    assert b == sorted(set(b)) and b[-1] == 512 and len(b) == 4 + 32
    with pytest.raises(ValueError, match="max_batch"):
        graph_buckets(0)


def test_config_refuses_captures_past_the_cap():
    with pytest.raises(pydantic.ValidationError, match="max_graph_batch_size"):
        EngineConfig(max_graph_batch_size=GRAPH_BATCH_CAP + 1)
    assert EngineConfig(max_graph_batch_size=GRAPH_BATCH_CAP).max_graph_batch_size == GRAPH_BATCH_CAP


def test_estimate_counts_one_shared_logits_buffer_not_one_per_bucket():
    est = graph_memory_estimate(QWEN, 512, 2)
    logits = 4 * 512 * QWEN.vocab_size
    assert logits < est < 1 * GiB
    assert est == logits + step_activation_bytes(QWEN, 512, 2) + 36 * 2 * 2**20
    # Each bucket keeping its own fp32 logits, as before, needed ~19 GiB for buckets up to 1,024 rows.
    per_bucket = sum(4 * b * QWEN.vocab_size for b in graph_buckets(1024))
    assert per_bucket > 18 * GiB > 20 * est
    assert graph_memory_estimate(QWEN, 64, 2) < graph_memory_estimate(QWEN, 128, 2) < est
    # a tensor-parallel rank's heads only: fewer attention partials
    assert graph_memory_estimate(QWEN, 512, 2, num_heads=6, num_kv_heads=1) < est


def test_pool_bytes_arithmetic():
    assert kv_pool_bytes(70 * GiB, 80 * GiB, 0.9, 1 * GiB, GiB // 2) == int((70 - 8 - 1 - 0.5) * GiB)
    assert kv_pool_bytes(5 * GiB, 80 * GiB, 0.9, 1 * GiB, 0) == 2**26  # the floor
    with pytest.raises(ValueError, match="gpu_memory_utilization"):
        kv_pool_bytes(1, 1, 0.0, 0, 0)


def _fake_runner(monkeypatch, enforce_eager: bool, **cfg):
    free, total = 60 * GiB, 80 * GiB
    calls = _fake_runner.calls = []

    def mem_get_info(device=None):
        calls.append("mem_get_info")
        return free, total

    monkeypatch.setattr(torch.cuda, "mem_get_info", mem_get_info)
    monkeypatch.setattr(torch.cuda, "empty_cache", lambda: calls.append("empty_cache"))
    cfg["cache"] = {"kv_mode": "fp16", **cfg.get("cache", {})}  # as the engine resolves 'auto' for a GPU model
    config = EngineConfig(enforce_eager=enforce_eager, **cfg)
    runner = SimpleNamespace(config=config, device=torch.device("cuda"), arch=QWEN, dtype=torch.bfloat16)
    runner._graph_batch = lambda: ModelRunner._graph_batch(runner)
    runner._prefill_graph_tokens = lambda: ModelRunner._prefill_graph_tokens(runner)
    shape = CacheShape(QWEN.num_layers, QWEN.num_kv_heads, QWEN.head_dim, config.scheduler.max_num_seqs, 4096, 16)
    _fake_runner.last = runner
    return ModelRunner._num_pages(runner, shape), shape, free, total, config


def test_pool_is_sized_after_the_graphs_budget(monkeypatch):
    sched = {"max_num_seqs": 512, "max_num_batched_tokens": 8192}
    eager, shape, free, total, config = _fake_runner(monkeypatch, True, scheduler=sched)
    graphs, *_ = _fake_runner(monkeypatch, False, scheduler=sched, max_graph_batch_size=512)
    act = 64 * 8192 * QWEN.hidden_size
    # cached blocks no tensor holds (an engine freed before this one) count as free: released before measuring
    assert _fake_runner.calls == ["empty_cache", "mem_get_info"]
    assert eager == pages_for_bytes(shape, torch.bfloat16, free - 0.15 * total - act, config.cache.tracks_tokens())
    est = graph_memory_estimate(QWEN, 512, 2)
    prompt_graphs = prefill_graph_bytes(QWEN, 4096, 2)  # max_prefill_graph_tokens: short prompt steps
    assert graphs == pages_for_bytes(shape, torch.bfloat16, free - 0.15 * total - act - est - prompt_graphs,
                                    config.cache.tracks_tokens())
    assert _fake_runner.last.graph_budget == est  # what DecodeGraphs checks its measured memory against
    assert eager > graphs
    # an explicit pool (the benchmarks' --kv-memory-gb, vLLM's kv_cache_memory_bytes) is taken as given
    fixed, *_ = _fake_runner(monkeypatch, False, scheduler=sched, cache={"kv_cache_memory_gb": 0.98})
    assert fixed == pages_for_bytes(shape, torch.bfloat16, 0.98 * GiB, tracked=False)  # fp16: untracked pages
    assert fixed > pages_for_bytes(shape, torch.bfloat16, 0.98 * GiB, tracked=True)
    # fewer scheduled sequences: fewer captured rows, a smaller reservation
    small, *_ = _fake_runner(monkeypatch, False, scheduler={"max_num_seqs": 32, "max_num_batched_tokens": 8192})
    assert graphs < small < eager


def test_prompt_step_graphs_sizes_and_budget(monkeypatch):
    assert prefill_buckets(4096) == [128, 256, 512, 768, 1024, 1536, 2048, 3072, 4096]
    assert prefill_buckets(100) == [100] and prefill_buckets(3000)[-2:] == [2048, 3000]
    with pytest.raises(ValueError, match="max_tokens"):
        prefill_buckets(0)
    assert prefill_graph_bytes(QWEN, 0, 2) == 0
    one = prefill_graph_bytes(QWEN, 4096, 2)
    assert 200 * 2**20 < one < 500 * 2**20  # about one 4,096-token forward's activations
    assert prefill_graph_bytes(QWEN, 2048, 2) < one
    sched = {"max_num_seqs": 256, "max_num_batched_tokens": 8192}
    with_graphs, shape, free, total, config = _fake_runner(monkeypatch, False, scheduler=sched)
    runner = _fake_runner.last
    assert ModelRunner._prefill_graph_tokens(runner) == 4096
    # diffkv prompt steps replay graphs too (either reservation), unless prompt blocks are pinned (prefix
    # caching) or the budget policy ranks tokens
    for cache, sched_extra, want in (({}, {}, 4096), ({}, {"reservation": "learned"}, 4096),
                                     ({"enable_prefix_caching": True}, {}, 0), ({"policy": "budget"}, {}, 0)):
        _fake_runner(monkeypatch, False, scheduler={**sched, **sched_extra}, cache={"kv_mode": "diffkv", **cache})
        assert ModelRunner._prefill_graph_tokens(_fake_runner.last) == want, (cache, sched_extra)
    # never past the scheduler's prompt-step size; 0 turns them off
    small, *_ = _fake_runner(monkeypatch, False, scheduler={**sched, "max_num_batched_tokens": 1024})
    assert ModelRunner._prefill_graph_tokens(_fake_runner.last) == 1024
    off, *_ = _fake_runner(monkeypatch, False, scheduler=sched, max_prefill_graph_tokens=0)
    assert ModelRunner._prefill_graph_tokens(_fake_runner.last) == 0
    act = 64 * 8192 * QWEN.hidden_size
    assert off == pages_for_bytes(shape, torch.bfloat16, free - 0.15 * total - act - graph_memory_estimate(
        QWEN, 256, 2), tracked=False) > with_graphs
    eager, *_ = _fake_runner(monkeypatch, True, scheduler=sched)
    assert ModelRunner._prefill_graph_tokens(_fake_runner.last) == 0
    with pytest.raises(pydantic.ValidationError, match="max_prefill_graph_tokens"):
        EngineConfig(max_prefill_graph_tokens=-1)


def test_logits_into_a_static_buffer_equal_the_allocating_path():
    arch = ARCH_PRESETS["tiny"]
    torch.manual_seed(0)
    model = CausalLM(arch, 64)
    model.init_random(0)
    hidden = torch.randn(5, arch.hidden_size)
    buf = torch.full((8, model.vocab_rows), float("nan"))
    out = model.logits(hidden, out=buf[:5])
    assert model.vocab_rows == arch.vocab_size and out.data_ptr() == buf.data_ptr()
    assert torch.equal(buf[:5], model.logits(hidden)) and torch.isnan(buf[5:]).all()
