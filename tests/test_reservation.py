"""Learned (compression-aware) prompt page reservation: the footprint learner, the memory manager's overflow-safe prompt
allocation and exact decode bound, and an adversarial prompt mix end to end (estimate wrong on purpose)."""
import pytest
import torch
from pydantic import ValidationError

from diffkv_serve.engine import EngineConfig, SamplingParams
from diffkv_serve.engine.config import SchedulerConfig
from diffkv_serve.engine.kv.footprint import FootprintEstimator, length_bucket, quantile
from diffkv_serve.engine.kv.layout import CacheShape
from diffkv_serve.engine.kv.pool import MemoryManager
from diffkv_serve.engine.llm_engine import LLMEngine
from diffkv_serve.engine.prefill_graph import PrefillGraphs
from diffkv_serve.engine.loader import load_checkpoint

from engine_helpers import TEST_DEVICE, assert_all_pages_free


# ---- the learner ---------------------------------------------------------------------------------------
def test_quantile_is_nearest_rank():
    vals = [float(v) for v in range(1, 101)]  # 1..100
    assert quantile(vals, 0.95) == 95.0 and quantile(vals, 1.0) == 100.0 and quantile(vals, 0.001) == 1.0
    assert quantile([3.0, 1.0, 2.0], 0.5) == 2.0
    with pytest.raises(ValueError):
        quantile([], 0.5)


def test_learner_warms_up_on_the_worst_case_then_reserves_the_quantile_with_margin():
    est = FootprintEstimator(SchedulerConfig(footprint_quantile=0.9, footprint_margin=0.25, footprint_min_samples=10))
    assert length_bucket(100) == length_bucket(127) == 6 and length_bucket(128) == 7
    for i in range(9):
        est.observe_prompt(100, 20 + i, 100)
        assert est.prompt_pages(100, 100) == 100  # warming up: worst case
    est.observe_prompt(100, 29, 100)  # ratios 0.20 .. 0.29: the 0.9 quantile is 0.28
    assert est.ratio(120) == pytest.approx(0.28)
    assert est.prompt_pages(120, 200) == 70  # ceil(0.28 * 1.25 * 200)
    # A longer bucket with no samples borrows the shorter one's estimate; a shorter one never a longer's.
    assert est.prompt_pages(1000, 200) == 70
    assert est.prompt_pages(60, 200) == 200
    # Never above the worst case, whatever was observed.
    for _ in range(10):
        est.observe_prompt(40, 500, 100)
    assert est.prompt_pages(40, 30) == 30
    s = est.summary()
    assert s["prompt_samples"] == 20 and s["prompt_ratio"]["[64, 128)"]["samples"] == 10


def test_learner_keeps_only_recent_samples():
    est = FootprintEstimator(SchedulerConfig(footprint_min_samples=4, footprint_max_samples=4, footprint_margin=0))
    for _ in range(4):
        est.observe_prompt(50, 90, 100)
    assert est.ratio(50) == pytest.approx(0.9)
    for _ in range(4):  # the workload changed: the old samples age out
        est.observe_prompt(50, 10, 100)
    assert est.ratio(50) == pytest.approx(0.1)
    est.observe_growth(10, 5)
    assert est.summary()["growth_pages_per_token"] == pytest.approx(0.5)


@pytest.mark.parametrize("field, value", [("footprint_quantile", 0.0), ("footprint_quantile", 1.5),
                                          ("footprint_margin", -0.1), ("footprint_min_samples", 0),
                                          ("reservation", "optimistic")])
def test_bad_reservation_settings_name_the_field(field, value):
    with pytest.raises(ValidationError, match=field):
        SchedulerConfig(**{field: value})


# ---- the memory manager --------------------------------------------------------------------------------
def _mm(num_pages):
    shape = CacheShape(num_layers=2, num_kv_heads=2, head_dim=16, max_seqs=4, max_model_len=64, block_size=2)
    return MemoryManager(shape, num_pages, torch.float16, "cpu", high=(16, 16), low=(4, 2))  # 2 / 4 tokens a page


def test_prompt_layer_allocation_never_hands_out_a_page_that_is_not_free():
    mm = _mm(12)
    a, b, c = mm.alloc_slot(), mm.alloc_slot(), mm.alloc_slot()
    slots = torch.tensor([a, b, c])
    overflow = torch.zeros(3, dtype=torch.bool)
    # Per head: 3 high tokens (2 pages) + 5 low (2 pages) = 4 pages; a sequence's layer: 8 pages.
    n_high = torch.full((3, 2), 3, dtype=torch.int32)
    n_low = torch.full((3, 2), 5, dtype=torch.int32)
    mm.alloc_prompt_layer(slots, 0, n_high, n_low, overflow, max_new_pages=4)
    assert overflow.tolist() == [False, True, True]  # batch order: the first fits, the others do not
    assert mm.free_pages() == 4 and mm.held_high[a, 0].tolist() == [2, 2] and mm.held_low[a, 0].tolist() == [2, 2]
    assert int(mm.held_high[b].sum() + mm.held_low[b].sum()) == 0
    # Layer 1 needs 8 more for `a`: it overflows too, taking nothing; the flagged ones stay flagged.
    mm.alloc_prompt_layer(slots, 1, n_high, n_low, overflow, max_new_pages=4)
    assert overflow.tolist() == [True, True, True] and mm.free_pages() == 4
    mm.set_prompt_lengths(slots, torch.stack([n_high, n_high], 1), torch.stack([n_low, n_low], 1), overflow)
    mm.check_invariants([a, b, c])
    mm.free([a, b, c])
    mm.check_invariants([])
    assert mm.free_pages() == 12


def test_prompt_layer_allocation_places_sections_where_the_targets_read_them():
    mm = _mm(64)
    s = mm.alloc_slot()
    slots = torch.tensor([s])
    overflow = torch.zeros(1, dtype=torch.bool)
    nh, nl = torch.tensor([[3, 0]], dtype=torch.int32), torch.tensor([[5, 1]], dtype=torch.int32)
    for layer in range(2):
        mm.alloc_prompt_layer(slots, layer, nh, nl, overflow, max_new_pages=4)
    mm.set_prompt_lengths(slots, torch.stack([nh, nh], 1), torch.stack([nl, nl], 1), overflow)
    assert not overflow.item() and mm.free_pages() == 64 - 2 * (2 + 2 + 0 + 1)
    P = mm.max_pages
    pt = mm.page_table[s, 0]
    assert (pt[0, :2] >= 0).all() and (pt[0, P - 2:P] >= 0).all() and pt[1, 0].item() == -1
    page, _ = mm.low_targets(slots, torch.tensor([[[4, 0]] * 2]))  # low token 4 sits on low page 1
    assert page[0, 0, 0].item() == pt[0, P - 2].item()
    mm.check_invariants([s])
    mm.free([s])


def test_decode_growth_counts_heads_with_a_full_section_or_an_armed_empty_low_one():
    mm = _mm(64)
    s = mm.alloc_slot()
    slots = torch.tensor([s])
    overflow = torch.zeros(1, dtype=torch.bool)
    # Layer 0: head 0 high full (2 of 2), head 1 neither full; layer 1: head 0 low full (4 of 4), head 1 none.
    plans = [(torch.tensor([[2, 1]]), torch.tensor([[1, 1]])), (torch.tensor([[1, 1]]), torch.tensor([[4, 0]]))]
    for layer, (nh, nl) in enumerate(plans):
        mm.alloc_prompt_layer(slots, layer, nh.int(), nl.int(), overflow, max_new_pages=4)
    mm.set_prompt_lengths(slots, torch.stack([p[0] for p in plans], 1).int(),
                          torch.stack([p[1] for p in plans], 1).int(), overflow)
    # Head (1, 1) holds no low page: its empty low section needs one only once a decode plan armed it (the lazy
    # low rule opens it no earlier than the step after); a freed slot starts unarmed.
    free, growth = mm.step_view([s])
    assert growth == [2] and free == mm.free_pages()
    mm.low_armed[s, 1, 1] = 1
    mm.note_growth(slots)
    assert mm.step_view([s])[1] == [3]
    mm.free([s])
    assert not bool(mm.low_armed[s].any())


# ---- end to end: a learned model of compressible prompts, then prompts that keep everything -----------
TINY = None


def _tiny():
    global TINY
    if TINY is None:
        TINY = load_checkpoint("random:tiny")
    return TINY


def _engine(reservation, num_pages, staged=False):
    """staged: prompt steps go through the prompt-step graphs' staging, run eagerly (prefill_graph.py)."""
    cfg = EngineConfig(device=TEST_DEVICE, max_model_len=256, enforce_eager=True,
                       scheduler={"max_num_seqs": 8, "max_num_batched_tokens": 512, "reservation": reservation,
                                  "footprint_min_samples": 2},
                       cache={"kv_mode": "diffkv", "num_pages": num_pages, "block_size": 4, "window": 4,
                              "alpha_high": 2.0, "alpha_low": 0.5, "significance_queries": 8})
    eng = LLMEngine(cfg, checkpoint=_tiny())
    if staged:
        r = eng.runner
        r.prefill_graphs = PrefillGraphs(r.model, r.attn, 512, 8, capture=False, learned=r.learned)
    return eng


def _check_decode_bound(engine):
    """Every decode step takes at most MemoryManager.decode_growth pages per sequence (checked inside it)."""
    kv, mm = engine.runner.kv, engine.runner.mm
    inner = kv.prepare_decode

    def checked(slots, *args, **kw):
        bound, before = mm.decode_growth(slots.long()), (mm.held_high[slots] + mm.held_low[slots]).sum((1, 2))
        out = inner(slots, *args, **kw)
        taken = (mm.held_high[slots] + mm.held_low[slots]).sum((1, 2)) - before
        assert bool((taken <= bound).all()), f"decode took {taken.tolist()} pages, bound {bound.tolist()}"
        return out

    kv.prepare_decode = checked


def _run(engine, requests):
    for rid, ids, sp, kv in requests:
        engine.add_request(rid, ids, sp, kv_compression=kv)
    done = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                done[out.request_id] = out.token_ids
        running = [s.slot for s in engine.scheduler.running]
        engine.mm.check_invariants(running)
        # step_view reads what note_growth recorded: it must be decode_growth as of now for every running slot
        assert engine.mm.step_view(running)[1] == engine.mm.decode_growth(torch.tensor(running, dtype=torch.long)).tolist()
    return done


@pytest.mark.parametrize("staged", [False, True])
def test_adversarial_prompt_mix_never_crashes_or_loses_a_request(staged):
    """staged: the same through the prompt-step graphs' staging (a padding sequence and empty ones, which take
    no page, beside the prompts that overflow)."""
    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(1, 500, (int(torch.randint(40, 64, (1,), generator=g)),), generator=g).tolist()
               for _ in range(10)]
    greedy = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
    seeded = SamplingParams(temperature=1.0, seed=3, max_tokens=6, ignore_eos=True)
    squeeze, keep_all = {"alpha_high": 50.0, "alpha_low": 20.0}, {"alpha_high": 0.0, "alpha_low": 0.0}
    learn = [(f"c{i}", prompts[i], greedy, squeeze) for i in range(4)]
    # Every token kept: the estimate learned on the prompts above is far too small for these.
    adversary = [(f"k{i}", prompts[i], seeded if i == 7 else greedy, keep_all) for i in range(4, 10)]
    outs, stats = {}, {}
    for reservation in ("worst_case", "learned"):
        eng = _engine(reservation, num_pages=60, staged=staged)  # a 40-63 token prompt: 20 pages all-high
        _check_decode_bound(eng)
        outs[reservation] = {**_run(eng, learn), **_run(eng, adversary)}
        stats[reservation] = eng.stats()
        assert_all_pages_free(eng)
    assert len(outs["learned"]) == 10 and outs["learned"] == outs["worst_case"]
    adm = stats["learned"]["reservation"]
    assert adm["overflows"] > 0 and adm["prompt_samples"] >= 10
    assert stats["worst_case"]["reservation"] == {"mode": "worst_case", "overflows": 0}


def test_lazy_low_sections_open_within_the_decode_bound():
    """Low sections that start empty open during decode (the lazy low rule, after the step that armed them) and
    every decode step stays within the bound that counts only the armed ones, far below one page per empty low
    section; the pages stay consistent each step and all come back."""
    eng = _engine("worst_case", num_pages=400)
    _check_decode_bound(eng)
    kv, mm = eng.runner.kv, eng.runner.mm
    inner, seen = kv.prepare_decode, {"opened": 0, "armed": 0, "bound": 0, "empty": 0}

    def watched(slots, *args, **kw):
        s = slots.long()
        empty = (mm.len_low[s] == 0) & (mm.held_low[s] == 0)
        seen["armed"] += int((empty & (mm.low_armed[s] != 0)).sum())
        seen["bound"] += int(mm.decode_growth(s).sum())
        seen["empty"] += int(empty.sum())
        out = inner(slots, *args, **kw)
        seen["opened"] += int((empty & (mm.len_low[s] > 0)).sum())
        return out

    kv.prepare_decode = watched
    g = torch.Generator().manual_seed(1)
    greedy = SamplingParams(temperature=0, max_tokens=96, ignore_eos=True)
    lazy = {"alpha_high": 2.0, "alpha_low": 1.0}  # about half pruned, few tokens low: low sections start empty
    requests = [(f"r{i}", torch.randint(1, 500, (24,), generator=g).tolist(), greedy, lazy) for i in range(4)]
    assert len(_run(eng, requests)) == 4
    assert seen["opened"] > 0 and seen["armed"] >= seen["opened"], seen
    assert seen["bound"] < seen["empty"], seen  # an unarmed empty low section reserves nothing
    assert_all_pages_free(eng)


@pytest.mark.parametrize("mode,num_pages", [("int4", 48), ("fp16", 160)])
@pytest.mark.parametrize("async_scheduling", ["off", "on"])
def test_learned_reservation_leaves_single_precision_scheduling_alone(mode, num_pages, async_scheduling):
    """A single-precision prompt keeps exactly its worst case, so learned reservation has nothing to learn there:
    the same steps, batches, preemptions and tokens as worst case on a pool that preempts."""
    g = torch.Generator().manual_seed(4)
    prompts = [torch.randint(1, 500, (int(torch.randint(20, 60, (1,), generator=g)),), generator=g).tolist()
               for _ in range(12)]
    sp = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    runs = {}
    for reservation in ("worst_case", "learned"):
        cfg = EngineConfig(device=TEST_DEVICE, max_model_len=256, enforce_eager=True,
                           scheduler={"max_num_seqs": 8, "max_num_batched_tokens": 256, "reservation": reservation,
                                      "footprint_min_samples": 2, "async_scheduling": async_scheduling},
                           cache={"kv_mode": mode, "num_pages": num_pages, "block_size": 4})
        eng = LLMEngine(cfg, checkpoint=_tiny())
        for i, p in enumerate(prompts):
            eng.add_request(str(i), p, sp)
        batches, done = [], {}
        while eng.has_unfinished_requests():
            outs = eng.step()
            batches.append(len(eng.scheduler.running))
            done.update({o.request_id: o.token_ids for o in outs if o.finished})
        runs[reservation] = (batches, eng.scheduler.num_preemptions, done)
        assert_all_pages_free(eng)
    assert runs["worst_case"][1] > 0  # the pool is small enough to preempt
    assert runs["learned"] == runs["worst_case"]
