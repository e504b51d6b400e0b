"""Async scheduling (SchedulerConfig.async_scheduling): decode step N+1 is launched before step N's tokens are
read. It must change nothing a client sees: the same tokens, texts, stop reasons and logprobs as synchronous
steps, with preemption, aborts in flight and every kind of stop, and no page lost (random interleavings with
async steps: tests/test_diffkv.py)."""
import pytest
import torch

from diffkv_serve.engine import EngineConfig, SamplingParams

from engine_helpers import PROMPTS, assert_all_pages_free, run_all


def _requests(engine, stop_token, penalties=False):
    """A mix of stops and sampling: greedy to max_tokens, a natural EOS, a stop string, a stop token, seeded
    sampling with logprobs, and with `penalties` a penalised request; (prompt, params) pairs."""
    tok = engine.tokenizer
    chat = tok.encode(tok.apply_chat_template([{"role": "user", "content": "Say hi."}]), add_special_tokens=False)
    reqs = [
        (PROMPTS[0], SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)),
        (chat, SamplingParams(temperature=0, max_tokens=40)),  # ends with EOS well before 40
        (PROMPTS[3], SamplingParams(temperature=0, max_tokens=16, stop=[" blue"])),
        (PROMPTS[4], SamplingParams(temperature=0, max_tokens=16, stop_token_ids=[stop_token])),
        (PROMPTS[2], SamplingParams(temperature=0.8, top_p=0.9, seed=7, max_tokens=14, ignore_eos=True,
                                    logprobs=True)),
        (PROMPTS[5], SamplingParams(temperature=0, max_tokens=7, ignore_eos=True)),
    ]
    if penalties:  # they read every generated token, the newest still on the device when a step is launched
        reqs.append((PROMPTS[1], SamplingParams(temperature=0, max_tokens=12, ignore_eos=True, repetition_penalty=1.3,
                                                frequency_penalty=0.8, presence_penalty=0.4, min_tokens=3,
                                                logit_bias={13: 2.0})))
    return reqs


def _run(engine, reqs):
    for i, (p, sp) in enumerate(reqs):
        engine.add_request(str(i), p, sp)
    done, pipelined = {}, 0
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                done[out.request_id] = out
        pipelined += engine._pending is not None
    outs = [done[str(i)] for i in range(len(reqs))]
    return [(o.token_ids, o.text, o.finish_reason, o.logprobs) for o in outs], pipelined


NEAR_TIE = 0.1  # nats between the two most likely tokens: a float-rounding flip, not a bug


def _same_or_near_tie(engine, reqs, got, want) -> list[int]:
    """Requests whose outputs differ must differ first at a greedy near-tie: `engine` (synchronous), given the
    prompt and the tokens both runs agree on, puts the two tokens within NEAR_TIE of each other at the top of its
    distribution. Nothing after that token is compared. Returns those requests."""
    excused = []
    for i, (g, w) in enumerate(zip(got, want)):
        if g[:3] == w[:3]:
            continue
        k = next((j for j, (a, b) in enumerate(zip(g[0], w[0])) if a != b), None)
        assert k is not None and reqs[i][1].temperature == 0, f"request {i}: {g[:3]} != {w[:3]}"
        prefix = list(reqs[i][0]) + list(w[0][:k])
        top = run_all(engine, [prefix], SamplingParams(temperature=0, max_tokens=1, logprobs=2))[0].top_logprobs[0]
        (id0, lp0), (id1, lp1) = top[:2]
        assert {id0, id1} == {g[0][k], w[0][k]} and lp0 - lp1 < NEAR_TIE, \
            f"request {i} differs at token {k} ({g[0][k]} against {w[0][k]}); there the top two are {top[:2]}"
        excused.append(i)
    return excused


@pytest.mark.slow  # long kernel / engine sweeps: CI's second stage
@pytest.mark.parametrize("mode, pages", [("fp16", 450), ("diffkv", None)])
def test_async_steps_give_the_same_outputs(make_engine, mode, pages):
    """pages=450 (fp16, 90 pages per 16 tokens of a sequence): less than the six sequences need at once, so
    decoding preempts and recomputes. diffkv's settings are pinned, not the model's calibrated ones, and its keys
    are not centered here. Async steps run other batch shapes than synchronous ones, and on some CPUs the float
    rounding of another shape flips a greedy near-tie of a diffkv request (the chat request's 13th token: two
    tokens 0.05 nats apart, on one CI machine and not on another; its thresholds can turn a last-bit difference
    into another precision class): so diffkv outputs must be equal, or one request may differ first where a
    synchronous engine's top two tokens lie within NEAR_TIE. Centering's own exactness is
    tests/test_key_centering.py.
    """
    pinned = ({"high": "K8V4", "low": "K4V2", "alpha_high": 1.0, "alpha_low": 0.02, "key_centering": "off"}
              if mode == "diffkv" else {})
    cache = {"kv_mode": mode, **pinned, **({"num_pages": pages} if pages else {})}
    # No admission headroom: the pool is sized so that decoding preempts, which the watermark would avoid.
    sched = {"prefill_watermark": 0.0}
    sync = make_engine(cache=cache, scheduler={"async_scheduling": "off", **sched})
    asyn = make_engine(cache=cache, scheduler={"async_scheduling": "on", **sched})
    assert asyn.executor.async_steps and not sync.executor.async_steps
    stop_token = run_all(sync, [PROMPTS[4]], SamplingParams(temperature=0, max_tokens=8))[0].token_ids[5]
    # diffkv: a seventh request changes the batch shapes enough to flip a near-tie of the chat request
    reqs = _requests(sync, stop_token, penalties=mode == "fp16")
    want, none = _run(sync, reqs)
    got, pipelined = _run(asyn, _requests(asyn, stop_token, penalties=mode == "fp16"))
    assert none == 0 and pipelined > 10  # steps really were launched ahead
    if mode == "fp16":
        assert [g[:3] for g in got] == [w[:3] for w in want]
    else:  # diffkv's thresholds can turn a last-bit difference into another class, and a near-tie into another token
        assert len(_same_or_near_tie(sync, reqs, got, want)) <= 1
    assert want[1][2] == "stop" and want[2][2] == "stop" and want[3][2] == "stop"  # the stops were exercised
    for g, w in zip(got, want):
        assert (g[3] is None) == (w[3] is None)
        if w[3] is not None and g[:3] == w[:3]:
            assert torch.allclose(torch.tensor(g[3]), torch.tensor(w[3]), atol=1e-4)
    if pages:
        assert sync.scheduler.num_preemptions > 0 and asyn.scheduler.num_preemptions > 0


def test_abort_while_a_step_is_in_flight(make_engine):
    engine = make_engine(scheduler={"async_scheduling": "on"})
    ref = make_engine(scheduler={"async_scheduling": "off"})
    greedy = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)
    want = [o.token_ids for o in run_all(ref, [PROMPTS[0], PROMPTS[2]], greedy)]
    for i, p in enumerate(PROMPTS[:3]):
        engine.add_request(str(i), p, greedy)
    for _ in range(4):
        engine.step()
    assert engine._pending is not None and any(s.request_id == "1" for s in engine._pending.batch.seqs)
    assert engine.abort("1")
    done = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            assert out.request_id != "1"  # the aborted row of the step in flight is dropped
            if out.finished:
                done[out.request_id] = out
    assert [done["0"].token_ids, done["2"].token_ids] == want


def test_preempt_while_a_step_is_in_flight(make_engine):
    """A sequence preempted while its decode row is in flight recomputes from its last read token: the stale
    row is dropped (it once finished the sequence as its re-prefill was being scheduled, with no slot)."""
    engine = make_engine(scheduler={"async_scheduling": "on"})
    ref = make_engine(scheduler={"async_scheduling": "off"})
    greedy = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
    want = [o.token_ids for o in run_all(ref, PROMPTS[:3], greedy)]
    for i, p in enumerate(PROMPTS[:3]):
        engine.add_request(str(i), p, greedy)
    for _ in range(3):
        engine.step()
    victim = engine.scheduler.running[-1]
    assert engine._pending is not None and victim in engine._pending.batch.seqs
    read = len(victim.output_token_ids)
    assert engine.scheduler.preempt_last() > 0
    done = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                done[out.request_id] = out
    assert victim.num_preemptions == 1 and read < 6
    assert [done[str(i)].token_ids for i in range(3)] == want
    assert_all_pages_free(engine)


def test_teacher_forced_rows_run_synchronously(make_engine):
    """Teacher tokens need the greedy choice on the host: such steps fall back to synchronous ones."""
    engine = make_engine(scheduler={"async_scheduling": "on"})
    ref = make_engine(scheduler={"async_scheduling": "off"})
    forced = [1, 2, 3, 4, 5, 6]
    sp = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True, teacher_tokens=forced)
    a, b = run_all(engine, [PROMPTS[1]], sp)[0], run_all(ref, [PROMPTS[1]], sp)[0]
    assert a.token_ids == b.token_ids == forced


def test_async_on_needs_the_local_executor():
    with pytest.raises(ValueError, match="async_scheduling"):
        EngineConfig(tensor_parallel_size=2, scheduler={"async_scheduling": "on"})


def test_planning_snapshot_is_consumed_once_and_never_overstates(make_engine):
    """The scheduler plans with the copy taken after the memory work of the step in flight; later frees are
    missing from it (free pages under-, never overstated); a second read without a new snapshot is fresh."""
    engine = make_engine(scheduler={"async_scheduling": "on"})
    mm = engine.mm
    for i, p in enumerate(PROMPTS[:2]):
        engine.add_request(str(i), p, SamplingParams(temperature=0, max_tokens=12, ignore_eos=True))
    engine.step()  # prefill
    engine.step()  # launches the first decode step: snapshot taken after its memory work
    assert mm._view_ready
    engine.abort("0")  # its pages go back after the snapshot
    planned = mm.planning_free_pages()
    assert not mm._view_ready and planned < mm.free_pages()
    assert mm.planning_free_pages() == mm.free_pages()  # no new snapshot: a fresh read
    while engine.has_unfinished_requests():
        engine.step()
