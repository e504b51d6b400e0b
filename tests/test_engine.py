"""Continuous batching, preemption, sampling, stopping, streaming and bad input on the embedded model."""
import pytest
import torch

from diffkv_serve.engine import InvalidRequestError, SamplingParams

from engine_helpers import PROMPTS, run_all

GREEDY = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)


@pytest.mark.slow
def test_batch_equals_each_prompt_alone(make_engine):
    engine = make_engine()
    batched = [o.token_ids for o in run_all(engine, PROMPTS, GREEDY)]
    alone = [run_all(engine, [p], GREEDY)[0].token_ids for p in PROMPTS]
    assert batched == alone


def test_preemption_by_recompute_keeps_tokens(make_engine):
    roomy = make_engine()
    ref = [o.token_ids for o in run_all(roomy, PROMPTS, GREEDY)]
    # 30 layers x 3 KV heads = 90 pages per 16 tokens of one sequence: 900 pages hold ~160 tokens in all,
    # far less than six sequences need, so decoding must preempt and recompute.
    tight = make_engine(cache={"num_pages": 900, "block_size": 16})
    out = [o.token_ids for o in run_all(tight, PROMPTS, GREEDY)]
    assert tight.stats()["num_preemptions"] > 0
    assert out == ref


def test_step_limits_respected(make_engine):
    engine = make_engine(scheduler={"max_num_seqs": 2, "max_num_batched_tokens": 32})
    for i, p in enumerate(PROMPTS):
        engine.add_request(str(i), p, GREEDY)
    seen_running = 0
    while engine.has_unfinished_requests():
        engine.step()
        seen_running = max(seen_running, len(engine.scheduler.running))
    assert seen_running == 2


def test_seeded_sampling_is_reproducible_and_batch_independent(make_engine):
    engine = make_engine()
    sp = SamplingParams(temperature=0.9, top_p=0.9, top_k=50, seed=1234, max_tokens=20, ignore_eos=True)
    a = run_all(engine, [PROMPTS[0]], sp)[0].token_ids
    b = run_all(engine, [PROMPTS[0], PROMPTS[1], PROMPTS[2]], sp)[0].token_ids
    assert a == b
    other = SamplingParams(temperature=0.9, top_p=0.9, top_k=50, seed=99, max_tokens=20, ignore_eos=True)
    assert run_all(engine, [PROMPTS[0]], other)[0].token_ids != a


def test_top_k_one_is_greedy(make_engine):
    engine = make_engine()
    greedy = run_all(engine, [PROMPTS[1]], GREEDY)[0].token_ids
    topk = run_all(engine, [PROMPTS[1]], SamplingParams(temperature=1.5, top_k=1, max_tokens=24,
                                                         ignore_eos=True, seed=3))[0].token_ids
    assert greedy == topk


def test_logprobs_of_chosen_tokens(make_engine):
    engine = make_engine()
    out = run_all(engine, [PROMPTS[2]], SamplingParams(temperature=0, max_tokens=8, ignore_eos=True,
                                                        logprobs=True))[0]
    assert len(out.logprobs) == 8 and all(lp <= 0 for lp in out.logprobs)
    first = torch.log_softmax(engine.prompt_logits(out.prompt_token_ids), -1)[out.token_ids[0]]
    assert abs(first.item() - out.logprobs[0]) < 1e-4


def test_stop_string_and_stop_token(make_engine):
    engine = make_engine()
    full = run_all(engine, [PROMPTS[3]], GREEDY)[0]
    assert len(full.text) > 8
    stop = full.text[4:7]
    cut = run_all(engine, [PROMPTS[3]], SamplingParams(temperature=0, max_tokens=24, stop=[stop]))[0]
    assert cut.finish_reason == "stop" and cut.text == full.text[: full.text.index(stop)]
    tok = full.token_ids[5]
    cut2 = run_all(engine, [PROMPTS[3]], SamplingParams(temperature=0, max_tokens=24, stop_token_ids=[tok]))[0]
    assert cut2.finish_reason == "stop" and cut2.token_ids == full.token_ids[: full.token_ids.index(tok) + 1]


def test_eos_stops_unless_ignored(make_engine):
    engine = make_engine()
    tok = engine.tokenizer
    chat = tok.encode(tok.apply_chat_template([{"role": "user", "content": "Say hi."}]), add_special_tokens=False)
    out = run_all(engine, [chat], SamplingParams(temperature=0, max_tokens=200))[0]
    assert out.finish_reason == "stop" and out.token_ids[-1] in tok.eos_token_ids
    out = run_all(engine, [chat], SamplingParams(temperature=0, max_tokens=len(out.token_ids) + 3,
                                                 ignore_eos=True))[0]
    assert out.finish_reason == "length"


def test_streamed_deltas_concatenate_to_text(make_engine):
    engine = make_engine()
    engine.add_request("s", "Write the word café and an emoji 🎉 three times:",
                       SamplingParams(temperature=0, max_tokens=40, ignore_eos=True))
    deltas, final = [], None
    while engine.has_unfinished_requests():
        for out in engine.step():
            deltas.append(out.delta_text)
            final = out
    assert "".join(deltas) == final.text
    assert "\ufffd" not in final.text
    # A generation cut at max_tokens may end inside a character: those bytes are held back, not sent as U+FFFD.
    assert final.text == engine.tokenizer.decode(final.token_ids).rstrip("\ufffd")


def test_abort_frees_pages_and_others_continue(make_engine):
    engine = make_engine()
    for i, p in enumerate(PROMPTS[:3]):
        engine.add_request(str(i), p, GREEDY)
    engine.step()
    engine.step()
    assert engine.abort("1") and not engine.abort("1") and not engine.abort("nope")
    done = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                done[out.request_id] = out
    assert set(done) == {"0", "2"}


@pytest.mark.parametrize("kwargs, param", [
    (dict(max_tokens=0), "max_tokens"),
    (dict(max_tokens=-3), "max_tokens"),
    (dict(temperature=-0.1), "temperature"),
    (dict(top_p=0.0), "top_p"),
    (dict(top_p=1.5), "top_p"),
    (dict(top_k=-2), "top_k"),
])
def test_bad_sampling_params_name_the_field(kwargs, param):
    with pytest.raises(InvalidRequestError) as e:
        SamplingParams(**kwargs)
    assert e.value.param == param and param in str(e.value)


def test_bad_prompts_are_rejected_and_engine_keeps_serving(make_engine):
    engine = make_engine(max_model_len=64)
    engine.add_request("good", PROMPTS[0], GREEDY)
    with pytest.raises(InvalidRequestError, match="empty"):
        engine.add_request("empty", "", GREEDY)
    with pytest.raises(InvalidRequestError, match="context"):
        engine.add_request("long", list(range(100, 170)), GREEDY)
    with pytest.raises(InvalidRequestError, match="token ids"):
        engine.add_request("vocab", [10**9], GREEDY)
    with pytest.raises(InvalidRequestError, match="already in use"):
        engine.add_request("good", PROMPTS[1], GREEDY)
    finished = []
    while engine.has_unfinished_requests():
        finished += [o.request_id for o in engine.step() if o.finished]
    assert finished == ["good"]


def test_generation_stops_at_context_end(make_engine):
    engine = make_engine(max_model_len=40)
    ids = engine.tokenizer.encode(PROMPTS[5])[:30]
    out = run_all(engine, [ids], SamplingParams(temperature=0, max_tokens=100, ignore_eos=True))[0]
    assert out.finish_reason == "length" and len(ids) + len(out.token_ids) == 40


def test_unknown_model_path_is_a_clear_error(tmp_path):
    from diffkv_serve.engine.loader import load_checkpoint

    with pytest.raises((FileNotFoundError, ValueError), match="no_such_model"):
        load_checkpoint(str(tmp_path / "no_such_model"))


def test_cuda_graph_decode_equals_eager(make_engine):
    from engine_helpers import TEST_DEVICE

    if not TEST_DEVICE.startswith("cuda"):
        pytest.skip("CUDA graphs exist on CUDA only")
    graphs = make_engine(dtype="float32")
    eager = make_engine(dtype="float32", enforce_eager=True)
    assert graphs.runner.graphs is not None and eager.runner.graphs is None
    # 5 prompts pad to the 8-wide graph: padding rows must not disturb the real ones.
    assert [o.token_ids for o in run_all(graphs, PROMPTS[:5], GREEDY)] == [o.token_ids for o in run_all(eager, PROMPTS[:5], GREEDY)]
