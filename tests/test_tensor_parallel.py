"""Tensor parallelism on CPU: Ray actor ranks joined by gloo give the tokens of one rank.

The embedded SmolLM2-135M has 9 query heads and 3 KV heads, so TP=2 splits it unevenly (rank 0: KV heads
0-1, rank 1: KV head 2). One Ray instance serves the whole module; every engine is shut down at the end.
"""
import asyncio
import os
import threading
import time

import pytest
import torch

from diffkv_serve.engine import EngineConfig, SamplingParams
from diffkv_serve.engine.errors import EngineDeadError
from diffkv_serve.engine.llm_engine import LLMEngine

from engine_helpers import PROMPTS, assert_all_pages_free, run_all

ray = pytest.importorskip("ray")

GREEDY = SamplingParams(temperature=0, max_tokens=10, ignore_eos=True)
# Longer than the DiffKV window (64), so prompt tokens are kept high, low or pruned per head.
LONG_PROMPT = ("The history of the printing press begins in the fifteenth century, when Johannes Gutenberg "
               "combined movable metal type, oil-based inks and a wooden press adapted from wine making. "
               "Within decades, printing shops spread across Europe, books became cheaper, literacy rose, "
               "and ideas travelled faster than ever before. Scholars argue that the press")


@pytest.fixture(scope="module", autouse=True)
def ray_cluster():
    os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
    started = not ray.is_initialized()
    if started:
        # Logical CPUs (bookkeeping, not cores): the module's cached engines hold 2.25 of them in placement
        # groups (two TP=2 pairs at 0.5, a Ray TP=1 at 0.25, two tiny TP=2 at 0.5), so 2 ran out when the
        # module ran on its own (the full suite reuses an earlier, larger cluster).
        ray.init(num_cpus=4, include_dashboard=False, log_to_driver=False)
    yield
    if started:  # a cluster someone else started stays up for them
        ray.shutdown()


@pytest.fixture(scope="module")
def engines(smollm):
    """Engines built on demand, once per module, shut down at its end."""
    built = {}

    def get(name, **kw):
        if name not in built:
            ckpt = None if str(kw.get("model", "")).startswith("random:") else smollm
            built[name] = LLMEngine(EngineConfig(device="cpu", **kw), checkpoint=ckpt)
        return built[name]

    yield get
    for eng in built.values():
        eng.shutdown()


# DiffKV thresholds pinned here, not taken from the model's calibration file (which may change): with them
# the long prompt keeps tokens high, low and pruned. TP=2 sums partial products in another order than
# TP=1 (fp32 differences ~1e-7), and quantizing the cache can turn that into a different code, so diffkv
# logits differ by up to ~1e-2; greedy tokens stay equal unless two candidates are that close. With the KV
# rotation (engine.kv_rotation) one of these prompts has such a near-tie (measured on CPU), so the token test runs
# unrotated; test_tp2_rotation_equals_tp1 checks the rotation's sharding on logits.
DIFFKV = {"kv_mode": "diffkv", "alpha_high": 1.0, "alpha_low": 0.02, "kv_rotation": "off"}
CACHES = {"fp16": {"kv_mode": "fp16"}, "diffkv": DIFFKV}
_REFS: dict = {}


def reference(engines, mode, prompts, sampling):
    """TP=1 in-process outputs, computed once per (mode, prompts)."""
    key = (mode, tuple(prompts), repr(sampling))
    if key not in _REFS:
        eng = engines(f"local-{mode}", cache={**CACHES[mode], "num_pages": 4000})
        _REFS[key] = run_all(eng, prompts, sampling)
        assert_all_pages_free(eng)
    return _REFS[key]


def test_tp2_fp16_equals_tp1_through_preemption_with_uneven_heads(engines):
    ref = reference(engines, "fp16", PROMPTS, GREEDY)
    # Rank 0 holds 30 layers x 2 KV heads: 60 pages per 16 tokens of a sequence; 300 pages per rank cannot
    # hold six sequences, so decoding preempts (and recomputes) on the rank that fills first.
    eng = engines("tp2-fp16", tensor_parallel_size=2, cache={"num_pages": 300})
    for i, p in enumerate(PROMPTS):
        eng.add_request(str(i), p, GREEDY)
    eng.step()  # the first prefill
    ranks = eng.stats()["ranks"]
    assert [r["pages_total"] for r in ranks] == [300, 300]
    # Uneven split: rank 0 caches two KV heads per layer, rank 1 one, so it holds exactly twice the pages.
    assert ranks[0]["pages_used"] == 2 * ranks[1]["pages_used"] > 0
    done = {}
    while eng.has_unfinished_requests():
        for out in eng.step():
            if out.finished:
                done[out.request_id] = out
    assert eng.stats()["num_preemptions"] > 0
    assert [done[str(i)].token_ids for i in range(len(PROMPTS))] == [o.token_ids for o in ref]
    assert_all_pages_free(eng)  # every rank's pool, and the driver's view of it


def test_tp2_prompt_logits_and_seeded_sampling_equal_tp1(engines):
    local = engines("local-fp16", cache={**CACHES["fp16"], "num_pages": 4000})
    eng = engines("tp2-fp16", tensor_parallel_size=2, cache={"num_pages": 300})
    ids = local.tokenizer.encode(PROMPTS[1])
    torch.testing.assert_close(eng.prompt_logits(ids), local.prompt_logits(ids), atol=2e-4, rtol=0)
    sp = SamplingParams(temperature=0.8, top_p=0.9, seed=7, max_tokens=8, ignore_eos=True, logprobs=True)
    want = run_all(local, PROMPTS[:2], sp)
    got = run_all(eng, PROMPTS[:2], sp)
    assert [o.token_ids for o in got] == [o.token_ids for o in want]
    for g, w in zip(got, want):
        assert g.logprobs == pytest.approx(w.logprobs, abs=1e-3)
    # top-k and prompt logprobs: rank 0 computes them from the all-reduced hidden states
    sp = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True, logprobs=2, prompt_logprobs=1)
    g, w = run_all(eng, [PROMPTS[1]], sp)[0], run_all(local, [PROMPTS[1]], sp)[0]
    assert g.token_ids == w.token_ids and [[t for t, _ in x] for x in g.top_logprobs] == \
        [[t for t, _ in x] for x in w.top_logprobs]
    assert g.prompt_logprobs.logprobs[1:] == pytest.approx(w.prompt_logprobs.logprobs[1:], abs=1e-3)
    assert_all_pages_free(eng)


def test_tp2_rotation_equals_tp1(engines):
    """The KV rotation folded into each rank's v_proj rows and o_proj columns, and applied to its own heads'
    queries and keys, gives TP=1's logits (a 16-bit cache: nothing quantized, rounding only)."""
    rotated = {"kv_mode": "fp16", "kv_rotation": "hadamard"}
    local = engines("local-fp16-rotated", cache={**rotated, "num_pages": 4000})
    eng = engines("tp2-fp16-rotated", tensor_parallel_size=2, cache={**rotated, "num_pages": 300})
    assert eng.stats()["kv_rotation"] == "hadamard"
    ids = local.tokenizer.encode(PROMPTS[1])
    torch.testing.assert_close(eng.prompt_logits(ids), local.prompt_logits(ids), atol=2e-4, rtol=0)
    plain = engines("local-fp16", cache={**CACHES["fp16"], "num_pages": 4000})
    torch.testing.assert_close(local.prompt_logits(ids), plain.prompt_logits(ids), atol=2e-4, rtol=0)
    sp = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    assert [o.token_ids for o in run_all(eng, PROMPTS[:2], sp)] == [o.token_ids for o in run_all(local, PROMPTS[:2], sp)]
    assert_all_pages_free(eng)


def test_tp2_diffkv_equals_tp1_and_abort_frees_every_rank(engines):
    prompts = PROMPTS[:2] + [LONG_PROMPT]
    ref = reference(engines, "diffkv", prompts, GREEDY)
    eng = engines("tp2-diffkv", tensor_parallel_size=2, cache={**DIFFKV, "num_pages": 3000})
    out = run_all(eng, prompts, GREEDY)
    assert [o.token_ids for o in out] == [o.token_ids for o in ref]
    long_usage = out[-1].kv_usage  # summed over ranks: the same per-head decisions as one rank
    assert long_usage["tokens_low"] + long_usage["tokens_pruned"] > 0
    assert long_usage == ref[-1].kv_usage
    assert_all_pages_free(eng)

    # Abort mid-decode on the driver: the frees reach both ranks with the next step.
    eng.add_request("keep", PROMPTS[0], GREEDY)
    eng.add_request("drop", LONG_PROMPT, SamplingParams(temperature=0, max_tokens=20, ignore_eos=True))
    for _ in range(3):
        eng.step()
    assert eng.stats()["pages_used"] > 0
    assert eng.abort("drop")
    eng.mm.check_invariants(live_slots=[eng.requests["keep"].slot])
    while eng.has_unfinished_requests():
        eng.step()
    assert_all_pages_free(eng)


def test_ray_executor_with_one_rank_equals_local_bit_for_bit(engines):
    """One rank on a Ray actor runs the same arithmetic as in-process: tokens and logprobs (top-k and the
    prompt's, which rank 0 reports to the driver) are identical, penalties included."""
    tiny = {"model": "random:tiny", "cache": {"num_pages": 500}}
    sp = SamplingParams(temperature=0, max_tokens=10, ignore_eos=True, logprobs=2, prompt_logprobs=1,
                        repetition_penalty=1.3, frequency_penalty=0.5, min_tokens=2)
    want = run_all(engines("tiny-local", **tiny), PROMPTS, sp)
    eng = engines("tiny-ray1", distributed_executor="ray", **tiny)
    got = run_all(eng, PROMPTS, sp)
    fields = lambda o: (o.token_ids, o.logprobs, o.top_logprobs, o.prompt_logprobs)  # noqa: E731
    assert [fields(o) for o in got] == [fields(o) for o in want]
    assert all(o.prompt_logprobs is not None and len(o.top_logprobs) == 10 for o in got)
    assert [r["rank"] for r in eng.stats()["ranks"]] == [0]
    assert_all_pages_free(eng)


def test_tp2_learned_reservation_redoes_an_overflowed_prompt_on_every_rank(engines):
    """Learned reservation learns on compressible prompts, then meets prompts that keep every token: a prefill
    that overflowed on any rank is redone on both (driver's flag union), with the tokens of worst-case
    reservation and every page back on every rank."""
    g = torch.Generator().manual_seed(1)
    prompts = [torch.randint(1, 500, (int(torch.randint(40, 64, (1,), generator=g)),), generator=g).tolist()
               for _ in range(6)]
    sp = SamplingParams(temperature=0, max_tokens=3, ignore_eos=True)
    outs = {}
    for reservation in ("worst_case", "learned"):
        # random:tiny, 2 layers x 1 KV head per rank; a 40-63 token prompt is 10 pages all-high on each rank.
        eng = engines(f"tiny-tp2-{reservation}", model="random:tiny", tensor_parallel_size=2, max_model_len=256,
                      scheduler={"max_num_seqs": 8, "reservation": reservation, "footprint_min_samples": 2},
                      cache={"kv_mode": "diffkv", "num_pages": 30, "block_size": 4, "window": 4,
                             "alpha_high": 2.0, "alpha_low": 0.5, "significance_queries": 8})
        squeeze = run_all(eng, prompts[:2], sp, kv_compression={"alpha_high": 50.0, "alpha_low": 20.0})
        keep = run_all(eng, prompts[2:], sp, kv_compression={"alpha_high": 0.0, "alpha_low": 0.0})
        outs[reservation] = [o.token_ids for o in squeeze + keep]
        assert_all_pages_free(eng)
        if reservation == "learned":
            assert eng.stats()["reservation"]["overflows"] > 0
    assert outs["learned"] == outs["worst_case"]


@pytest.mark.parametrize("kv_mode", ["fp16", "diffkv"])
def test_tp2_prefix_caching_gives_the_same_tokens_and_ranks_cache_the_same_blocks(kv_mode):
    """Shared-prefix prompts in two waves (the second reads the first's blocks) on a pool small enough to
    evict: the driver's hits, inserts and evictions reach both ranks (checked against its refcounts), and
    the tokens equal those without caching (diffkv: under the same pinning rule)."""
    g = torch.Generator().manual_seed(2)
    prefix = torch.randint(1, 500, (50,), generator=g).tolist()  # 12 fp16 blocks of 4, 3 diffkv K8V4 blocks of 16
    prompts = [prefix + torch.randint(1, 500, (n,), generator=g).tolist() for n in (3, 9, 1, 14, 5)]
    sp = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
    cache = {"kv_mode": kv_mode, "num_pages": 80, "block_size": 4, "window": 4, "alpha_high": 2.0,
             "alpha_low": 0.5, "significance_queries": 4}
    outs = {}
    for caching in (False, True):
        # Shut down at once: the module's 2 Ray CPUs hold only so many engines' placement groups.
        pin = {"pin_prompt_blocks": True} if kv_mode == "diffkv" else {}
        eng = LLMEngine(EngineConfig(device="cpu", model="random:tiny", tensor_parallel_size=2, max_model_len=256,
                                     cache={**cache, **pin, "enable_prefix_caching": caching}))
        try:
            outs[caching] = [o.token_ids for o in run_all(eng, prompts[:1], sp) + run_all(eng, prompts[1:], sp)]
            st = eng.stats()
            assert (st["prefix_cache_hits"] >= 48) == caching  # a later prompt read the whole 48-token prefix
            pc = eng.scheduler.prefix_cache
            eng.mm.check_invariants(live_slots=[], refcounts=pc.refcounts() if caching else None)
            assert_all_pages_free(eng)
        finally:
            eng.shutdown()
    assert outs[True] == outs[False]


def test_tp2_hf_folder_with_biases_and_tied_embeddings_loaded_lazily(tmp_path):
    """Qwen2 shape (q/k/v biases, tied embeddings), 3 KV heads split 2 + 1; ranks read the folder lazily."""
    transformers = pytest.importorskip("transformers")
    from diffkv_serve.engine.loader import load_checkpoint
    from diffkv_serve.engine.loader.hf_loader import LazySafetensors
    from diffkv_serve.engine.tokenizer import Tokenizer

    cfg = transformers.Qwen2Config(vocab_size=300, hidden_size=96, intermediate_size=160, num_hidden_layers=2,
                                   num_attention_heads=6, num_key_value_heads=3, max_position_embeddings=512,
                                   tie_word_embeddings=True, eos_token_id=7)
    torch.manual_seed(0)
    model = transformers.Qwen2ForCausalLM(cfg).eval()
    with torch.no_grad():
        for n, p in model.named_parameters():
            if n.endswith(".bias"):
                p.normal_()  # HF starts biases at zero; a misplaced bias shard must show
    model.save_pretrained(tmp_path)
    Tokenizer.byte_level(256).backend.save(str(tmp_path / "tokenizer.json"))
    lazy = load_checkpoint(tmp_path, lazy=True)
    assert isinstance(lazy.weights, LazySafetensors) and "lm_head.weight" not in lazy.weights
    eager = load_checkpoint(tmp_path)
    assert set(lazy.weights) == set(eager.weights)
    assert all(torch.equal(lazy.weights[k], v) for k, v in eager.weights.items())

    prompts = [[5, 17, 42, 99, 3], [250, 1, 8], list(range(20, 60))]
    outs = {}
    for tp in (1, 2):
        eng = LLMEngine(EngineConfig(model=str(tmp_path), device="cpu", tensor_parallel_size=tp,
                                     cache={"num_pages": 200}))
        try:
            outs[tp] = [o.token_ids for o in run_all(eng, prompts, GREEDY)]
            assert_all_pages_free(eng)
        finally:
            eng.shutdown()
    assert outs[2] == outs[1]


def test_engine_inside_a_placement_group_puts_its_ranks_in_bundles_1_to_n(engines):
    """The Ray Serve pattern: a replica in bundle 0 of its placement group, its ranks in bundles 1..N."""
    from ray.util.placement_group import placement_group, remove_placement_group
    from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

    from diffkv_serve.engine.ray_executor import RayExecutor

    want = run_all(engines("tiny-local", model="random:tiny", cache={"num_pages": 500}), PROMPTS[:2], GREEDY)

    class Replica:  # defined here so Ray ships it by value
        def run(self, prompts, sampling):
            from ray.util.placement_group import get_current_placement_group

            eng = LLMEngine(EngineConfig(model="random:tiny", device="cpu", tensor_parallel_size=2,
                                         cache={"num_pages": 500}))
            try:
                for i, p in enumerate(prompts):
                    eng.add_request(str(i), p, sampling)
                done = {}
                while eng.has_unfinished_requests():
                    done.update({o.request_id: o.token_ids for o in eng.step() if o.finished})
                return (eng.executor._own_pg is None, get_current_placement_group().bundle_count,
                        [done[str(i)] for i in range(len(prompts))])
            finally:
                eng.shutdown()

    pg = placement_group([{"CPU": 0.1}, {"CPU": 0.2}, {"CPU": 0.2}], strategy="PACK")
    ray.get(pg.ready(), timeout=60)
    try:
        replica = ray.remote(Replica).options(num_cpus=0.1, scheduling_strategy=PlacementGroupSchedulingStrategy(
            pg, placement_group_bundle_index=0, placement_group_capture_child_tasks=True)).remote()
        used_callers_group, bundles, tokens = ray.get(replica.run.remote(PROMPTS[:2], GREEDY), timeout=300)
        ray.kill(replica)
    finally:
        remove_placement_group(pg)
    assert used_callers_group and bundles == 3
    assert tokens == [o.token_ids for o in want]

    class Group:  # too few bundles: the replica's plus one rank
        bundle_specs = [{"CPU": 1}, {"CPU": 1}]

    with pytest.raises(ValueError, match="tensor_parallel_size=2: .* placement group of 2 bundle"):
        RayExecutor._bundles_of(Group(), 2)


def test_killed_rank_mid_generation_raises_engine_dead_and_releases_the_rest():
    eng = LLMEngine(EngineConfig(model="random:tiny", device="cpu", tensor_parallel_size=2,
                                 cache={"num_pages": 500}))
    workers = list(eng.executor.workers)
    pg = eng.executor._own_pg
    long = SamplingParams(temperature=0, max_tokens=1500, ignore_eos=True)
    for i, p in enumerate(PROMPTS[:3]):
        eng.add_request(str(i), p, long)
    eng.step()
    killer = threading.Timer(0.3, ray.kill, [workers[1]])
    killer.start()
    t0 = time.monotonic()
    with pytest.raises(EngineDeadError, match="rank 1 of 2 died"):
        while time.monotonic() - t0 < 60:
            eng.step()
    killer.join()
    assert time.monotonic() - t0 < 30, "a dead rank must be noticed quickly"
    assert not eng.is_healthy()
    with pytest.raises(EngineDeadError):
        eng.add_request("late", PROMPTS[0], GREEDY)
    with pytest.raises(EngineDeadError):
        eng.step()
    with pytest.raises(ray.exceptions.RayActorError):  # rank 0, blocked in the all-reduce, was killed too
        ray.get(workers[0].ping.remote(), timeout=30)
    assert ray.util.placement_group_table(pg)["state"] == "REMOVED"
    eng.shutdown()
    eng.shutdown()  # idempotent


def test_async_streams_get_engine_dead_when_a_worker_is_killed():
    from diffkv_serve.engine.async_engine import AsyncLLMEngine

    eng = LLMEngine(EngineConfig(model="random:tiny", device="cpu", distributed_executor="ray",
                                 cache={"num_pages": 500}))
    pg = eng.executor._own_pg
    long = SamplingParams(temperature=0, max_tokens=1500, ignore_eos=True)

    async def consume(aeng, rid, prompt, started):
        n = 0
        async for _ in aeng.generate(rid, prompt, long):
            n += 1
            started.set()
        return n

    async def main():
        aeng = AsyncLLMEngine(eng)
        await aeng.start()
        await aeng.check_health()
        started = [asyncio.Event(), asyncio.Event()]
        tasks = [asyncio.create_task(consume(aeng, f"s{i}", PROMPTS[i], started[i])) for i in range(2)]
        for ev in started:
            await ev.wait()
        ray.kill(eng.executor.workers[0])
        results = await asyncio.wait_for(asyncio.gather(*tasks, return_exceptions=True), timeout=60)
        assert all(isinstance(r, EngineDeadError) for r in results), results
        with pytest.raises(EngineDeadError):  # fails fast, before anything is queued
            await asyncio.wait_for(aeng.generate("late", PROMPTS[0], GREEDY).__anext__(), timeout=10)
        with pytest.raises(EngineDeadError):
            await aeng.check_health()
        assert not aeng.is_healthy()
        await asyncio.wait_for(aeng.shutdown(), timeout=60)

    asyncio.run(main())
    assert eng.requests == {} and not eng.has_unfinished_requests()
    assert ray.util.placement_group_table(pg)["state"] == "REMOVED"


def test_bad_tensor_parallel_sizes_name_the_field(smollm):
    with pytest.raises(ValueError, match="tensor_parallel_size=4 exceeds the model's 3 KV heads"):
        LLMEngine(EngineConfig(device="cpu", tensor_parallel_size=4), checkpoint=smollm)
    with pytest.raises(ValueError, match="tensor_parallel_size=3 exceeds the model's 2 KV heads"):
        LLMEngine(EngineConfig(model="random:tiny", device="cpu", tensor_parallel_size=3))
    with pytest.raises(ValueError, match="tensor_parallel_size=2 needs distributed_executor"):
        EngineConfig(tensor_parallel_size=2, distributed_executor="local")
    with pytest.raises(ValueError, match="tensor_parallel_size"):
        EngineConfig(tensor_parallel_size=0)


@pytest.mark.parametrize("kv_mode", ["fp16", "diffkv"])
def test_driver_page_rules_match_the_memory_manager(kv_mode):
    """DistributedPages restates MemoryManager's worst-case page rules for the rank with the most heads."""
    from diffkv_serve.engine.config import CacheConfig
    from diffkv_serve.engine.kv.distributed import DistributedPages
    from diffkv_serve.engine.kv.layout import CacheShape
    from diffkv_serve.engine.kv.pool import MemoryManager

    high, low = CacheConfig(kv_mode=kv_mode).precisions()
    mm = MemoryManager(CacheShape(4, 2, 32, 8, 256, 16), 64, torch.float32, "cpu", high=high, low=low)
    info = mm.page_rules()
    smaller = {**info, "heads_per_seq": mm.heads_per_seq // 2}
    view = DistributedPages([info, smaller], check=lambda live: [])
    for n in range(1, 120, 7):
        assert view.pages_for_tokens(n) == mm.pages_for_tokens(n)
        assert view.pages_to_grow(n, n + 1) == mm.pages_to_grow(n, n + 1)
    assert [view.alloc_slot() for _ in range(3)] == [mm.alloc_slot() for _ in range(3)]


def test_benchmark_smoke_checks_tokens_and_times_decode(tmp_path):
    """benchmarks/tensor_parallel.py --smoke (random:tiny, TP 1 and 2 on CPU), run in this module's Ray."""
    import importlib.util
    from pathlib import Path

    path = Path(__file__).resolve().parents[1] / "benchmarks" / "tensor_parallel.py"
    spec = importlib.util.spec_from_file_location("bench_tensor_parallel", path)
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    out = tmp_path / "tp.json"
    assert bench.main(["--smoke", "--out", str(out)]) == 0
    import json

    result = json.loads(out.read_text())
    assert [c["tokens_equal"] for c in result["checks"]] == [True, True]
    assert result["checks"][1]["prompt_logits_max_abs_diff"] < 1e-4
    assert [(r["tp"], r["batch"]) for r in result["rows"]] == [(1, 1), (1, 3), (2, 1), (2, 3)]
    assert all(r["decode_tok_s"] > 0 for r in result["rows"])
    assert result["rows"][2]["pages_per_rank"] == [result["rows"][2]["pages_per_rank"][0]] * 2
