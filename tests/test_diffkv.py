"""DiffKV mode end to end: the machinery as an identity, fidelity of the defaults on SmolLM2, stats, and
page accounting under random interleavings of add / step / abort / preempt."""
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from diffkv_serve.engine import EngineConfig, InvalidRequestError, SamplingParams
from diffkv_serve.engine.llm_engine import LLMEngine
from diffkv_serve.engine.loader import load_checkpoint

from engine_helpers import TEST_DEVICE, apply_op, assert_all_pages_free, run_all

PROMPTS = [
    "The history of the printing press begins",
    "Write a short story about a robot who learns to paint.",
    "Explain how photosynthesis works, step by step.",
]


@pytest.mark.slow
def test_identity_configuration_equals_fp16(make_engine):
    """high = K16V16 and both alphas 0 keep every token at full precision: exactly the fp16 engine."""
    sp = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)
    ref = [o.token_ids for o in run_all(make_engine(), PROMPTS, sp)]
    # Neither centered nor rotated ('auto' turns both on: the low section quantizes): they are exact only up to
    # rounding, which in bfloat16 (CUDA) flips near-tie tokens.
    ident = make_engine(cache={"kv_mode": "diffkv", "high": "K16V16", "low": "K4V2", "alpha_high": 0.0,
                               "alpha_low": 0.0, "window": 4, "kv_rotation": "off", "key_centering": "off"})
    assert [o.token_ids for o in run_all(ident, PROMPTS, sp)] == ref


@pytest.mark.slow
def test_defaults_keep_top1_agreement_on_long_generation(make_engine):
    """Teacher forcing along the fp16 engine's own greedy output of 512 tokens."""
    n = 512
    sp = SamplingParams(temperature=0, max_tokens=n, ignore_eos=True)
    tok = make_engine().tokenizer
    prompt = tok.encode(tok.apply_chat_template(
        [{"role": "user", "content": "Write a long, detailed essay about the history of mathematics."}]),
        add_special_tokens=False)
    ref = run_all(make_engine(), [prompt], sp)[0].token_ids
    engine = make_engine(cache={"kv_mode": "diffkv"})
    engine.add_request("tf", prompt, SamplingParams(temperature=0, max_tokens=n, ignore_eos=True,
                                                    teacher_tokens=ref))
    usage = None
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                agree = out.teacher_agree
                usage = out.kv_usage
    rate = sum(agree) / len(agree)
    # fp16-equivalent bytes over the bytes the compressed tokens really take (pages are per head).
    ratio = usage["bytes_fp16"] / usage["bytes_used"] if usage["bytes_used"] else float("inf")
    print(f"\ntop-1 agreement {rate:.3f} over {len(agree)} tokens; kept high {usage['tokens_high']}, "
          f"low {usage['tokens_low']}, pruned {usage['tokens_pruned']}; compression ratio {ratio:.2f}x")
    assert len(agree) == n and rate >= 0.90
    assert usage["tokens_low"] + usage["tokens_pruned"] > 0  # it really compressed


def test_stats_report_sections(make_engine):
    engine = make_engine(cache={"kv_mode": "diffkv", "window": 8})
    engine.add_request("a", PROMPTS[1] * 4, SamplingParams(temperature=0, max_tokens=30, ignore_eos=True))
    for _ in range(10):
        engine.step()
    st_ = engine.stats()
    L, H = engine.arch.num_layers, engine.arch.num_kv_heads
    assert st_["tokens_high"] + st_["tokens_low"] + st_["tokens_pruned"] == st_["cached_tokens"] * L * H
    assert st_["tokens_high"] > 0 and st_["pages_used"] > 0 and st_["bytes_used"] == st_["pages_used"] * st_["page_bytes"]
    assert st_["last_mm_seconds"] >= 0
    engine.abort("a")
    while engine.has_unfinished_requests():  # async scheduling (CUDA): the step in flight is read first
        engine.step()


@pytest.mark.parametrize("bad, param", [
    ({"alpha_high": -1}, "kv_compression.alpha_high"),
    ({"alpha_low": "x"}, "kv_compression.alpha_low"),
    ({"alpha_high": 0.1, "alpha_low": 0.5}, "kv_compression.alpha_low"),
    ({"beta": 1}, "kv_compression"),
])
def test_per_request_thresholds_are_validated(make_engine, bad, param):
    engine = make_engine(cache={"kv_mode": "diffkv"})
    with pytest.raises(InvalidRequestError) as e:
        engine.add_request("x", PROMPTS[0], SamplingParams(max_tokens=2), kv_compression=bad)
    assert e.value.param == param


def test_per_request_thresholds_change_what_is_kept(make_engine):
    engine = make_engine(cache={"kv_mode": "diffkv", "window": 4})
    sp = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)
    keep_all = run_all(engine, [PROMPTS[2]], sp, kv_compression={"alpha_high": 0.0, "alpha_low": 0.0})[0]
    squeeze = run_all(engine, [PROMPTS[2]], sp, kv_compression={"alpha_high": 50.0, "alpha_low": 5.0})[0]
    assert keep_all.kv_usage["tokens_low"] + keep_all.kv_usage["tokens_pruned"] == 0
    assert squeeze.kv_usage["tokens_pruned"] > 0


def test_alpha_low_zero_skips_low_scores_and_changes_nothing(make_engine, monkeypatch):
    """At alpha_low 0 no low token is ever pruned, so the score update leaves low sections alone and the plan does
    not scan them: the same tokens and kept classes as an engine updating every low score. Requests at alpha_low
    0 and above share the batch (the skip is per slot: the low pages keep their score rows, track_low)."""
    import diffkv_serve.engine.kv.policy as policy

    cache = {"kv_mode": "diffkv", "high": "K8V4", "low": "K4V4", "alpha_high": 2.0, "alpha_low": 0.0, "window": 4,
             "track_low": True}
    sp = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    per_request = [None, {"alpha_high": 2.0, "alpha_low": 0.3}, None]

    def run(engine):
        for i, (p, kvc) in enumerate(zip(PROMPTS, per_request)):
            engine.add_request(str(i), p, sp, kv_compression=kvc)
        done = {}
        while engine.has_unfinished_requests():
            for o in engine.step():
                if o.finished:
                    done[o.request_id] = (o.token_ids, o.kv_usage)
        return [done[str(i)] for i in range(len(PROMPTS))]

    skipping = run(make_engine(cache=cache))
    real = policy.accumulate_scores
    monkeypatch.setattr(policy, "accumulate_scores", lambda *a, alpha_low_by_slot=None, **k: real(*a, **k))
    every = run(make_engine(cache=cache))
    assert skipping == every
    assert all(u["tokens_low"] > 0 for _, u in skipping)  # low sections existed (and went unscored at 0)
    assert skipping[1][1]["tokens_pruned"] > 0 and skipping[0][1]["tokens_pruned"] == 0


@pytest.mark.parametrize("low", ["K4V4", "K4V2"])
def test_untracked_low_pages_change_nothing_but_their_bytes(make_engine, low):
    """At alpha_low 0 no low token is ever pruned, so its score and position are never read: low pages without
    those rows (track_low 'auto') give the same tokens, logprobs and kept classes as low pages with them, in fewer
    bytes (a K4V4 low row costs what an int4 row does)."""
    sp = SamplingParams(temperature=0, max_tokens=48, ignore_eos=True, logprobs=1)
    cache = {"kv_mode": "diffkv", "high": "K8V4", "low": low, "alpha_high": 2.0, "alpha_low": 0.0, "window": 4,
             "record_pruning": True}
    runs, low_tokens = {}, {}
    for track in (True, "auto"):
        eng = make_engine(cache={**cache, "track_low": track})
        assert eng.mm.fmt_low.tracked is (track is True)
        low_tokens[track] = eng.mm.fmt_low.tokens
        runs[track] = run_all(eng, PROMPTS, sp)
    assert low_tokens["auto"] > low_tokens[True]  # more low tokens a page
    for a, b in zip(runs[True], runs["auto"]):
        assert a.token_ids == b.token_ids
        assert a.logprobs == b.logprobs
        assert torch.equal(a.kv_usage["token_classes"], b.kv_usage["token_classes"])
        for k in ("tokens_high", "tokens_low", "tokens_pruned"):
            assert a.kv_usage[k] == b.kv_usage[k]
        assert b.kv_usage["tokens_low"] > 0 and b.kv_usage["tokens_pruned"] == 0
        assert b.kv_usage["bytes_used"] <= a.kv_usage["bytes_used"]


@pytest.mark.parametrize("mode", ["int8", "int4", "fp8"])
def test_uniform_quantized_modes_generate(make_engine, mode):
    engine = make_engine(cache={"kv_mode": mode})
    # Long enough that rounding each head up to whole pages does not hide the saving.
    long_prompt = " ".join(PROMPTS) * 6
    out = run_all(engine, [long_prompt, PROMPTS[0]], SamplingParams(temperature=0, max_tokens=12, ignore_eos=True))
    assert all(len(o.token_ids) == 12 for o in out)
    assert out[0].kv_usage["bytes_used"] < out[0].kv_usage["bytes_fp16"] * (0.5 if mode == "int4" else 0.8)


# ---- property test on a tiny random model: nothing lost, nothing double-freed ---------------------------
TINY = None


def tiny_engine(num_pages, mode="diffkv", async_scheduling="off"):
    global TINY
    if TINY is None:
        TINY = load_checkpoint("random:tiny")
    cfg = EngineConfig(device=TEST_DEVICE, max_model_len=256, enforce_eager=True,
                       scheduler={"max_num_seqs": 4, "max_num_batched_tokens": 256,
                                  "async_scheduling": async_scheduling},
                       cache={"kv_mode": mode, "num_pages": num_pages, "block_size": 4, "window": 4,
                              "alpha_high": 2.0, "alpha_low": 0.5, "significance_queries": 8})
    return LLMEngine(cfg, checkpoint=TINY)


ops = st.lists(st.one_of(
    st.tuples(st.just("add"), st.integers(1, 40), st.integers(1, 30)),
    st.tuples(st.just("step"), st.integers(1, 4), st.just(0)),
    st.tuples(st.just("abort"), st.integers(0, 9), st.just(0)),
    st.tuples(st.just("preempt"), st.just(0), st.just(0)),
), max_size=25)


@settings(max_examples=30, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(ops, st.integers(120, 400), st.sampled_from(["diffkv", "fp16", "fp8"]), st.sampled_from(["off", "on"]))
def test_random_interleavings_never_lose_pages(op_list, num_pages, mode, async_scheduling):
    """async_scheduling "on": aborts and preemptions also hit sequences of the decode step in flight."""
    engine = tiny_engine(num_pages, mode, async_scheduling)
    g = torch.Generator().manual_seed(num_pages)
    ids = []
    for op, a, b in op_list:
        prompt = torch.randint(1, 500, (a,), generator=g).tolist() if op == "add" else None
        apply_op(engine, ids, op, a, prompt, b)
        live = [s.slot for s in engine.scheduler.running if s.slot is not None]
        engine.mm.check_invariants(live)
    while engine.has_unfinished_requests():
        engine.step()
    assert_all_pages_free(engine)


@pytest.mark.parametrize("mode", ["fp16", "diffkv"])
def test_cuda_graphs_equal_eager_and_keep_pages_exact(mode):
    """Graph replay (memory management + forward, padded batches) equals eager steps; padding rows on the
    dummy slot never take a page."""
    if not TEST_DEVICE.startswith("cuda"):
        pytest.skip("CUDA graphs exist on CUDA only")
    global TINY
    if TINY is None:
        TINY = load_checkpoint("random:tiny")
    outs = []
    for eager in (False, True):
        cfg = EngineConfig(device=TEST_DEVICE, max_model_len=256, enforce_eager=eager, dtype="float32",
                           scheduler={"max_num_seqs": 8}, cache={"kv_mode": mode, "block_size": 4, "window": 4,
                                                                 "alpha_high": 2.0, "alpha_low": 0.5,
                                                                 "num_pages": 20000})  # not the whole GPU
        eng = LLMEngine(cfg, checkpoint=TINY)
        prompts = [list(range(3, 3 + n)) for n in (5, 17, 40)]  # 3 rows pad to the 4-wide graph
        outs.append([o.token_ids for o in run_all(eng, prompts, SamplingParams(temperature=0, max_tokens=30,
                                                                                ignore_eos=True))])
        assert_all_pages_free(eng)
        assert int(eng.mm.held_high[eng.mm.dummy_slot].sum()) == 0
    assert outs[0] == outs[1]

