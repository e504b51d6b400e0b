"""SamplingParams.n: one request, n sequences sampled from its prompt. They share the prompt's cached KV pages
in single-precision modes (prefix cache) and run as n independent sequences in diffkv; each samples with its
own seed."""
import pytest

from diffkv_serve.engine import SamplingParams
from diffkv_serve.engine.errors import InvalidRequestError
from diffkv_serve.engine.llm import LLM

from engine_helpers import run_all

PROMPT = "The history of the old city goes back many centuries, to a small market on the river. " * 2


def _run_peak(engine, request_id, ids, sampling):
    """Run one request to the end; (its finished outputs by index, the most pages its sequences held at once)."""
    engine.add_request(request_id, ids, sampling)
    outs, peak = {}, 0
    while engine.has_unfinished_requests():
        for o in engine.step():
            assert o.request_id == request_id
            if o.finished:
                outs[o.index] = o
        peak = max(peak, engine.stats()["pages_running"])
    return outs, peak


def test_n4_holds_less_than_four_times_one_requests_pages(make_engine):
    engine = make_engine(cache={"kv_mode": "fp16", "num_pages": 6000})  # prefix caching: on (single precision)
    ids = engine.tokenizer.encode(PROMPT)
    sp = SamplingParams(max_tokens=3, temperature=0.8, seed=11, ignore_eos=True)
    one, one_pages = _run_peak(engine, "one", ids, sp)
    engine.reset_prefix_cache()
    computed = engine.stats()["prefill_tokens_computed"]
    four, four_pages = _run_peak(engine, "four", ids, SamplingParams(**{**sp.__dict__, "n": 4}))
    assert sorted(four) == [0, 1, 2, 3] and all(len(o.token_ids) == 3 for o in four.values())
    # the prompt's full blocks are held once: each further sequence adds only its last partial block and its
    # own tokens' pages
    assert four_pages < 4 * one_pages, (four_pages, one_pages)
    block = engine.mm.prefix_block_tokens
    shared = len(ids) // block * block
    shared_pages = shared // block * engine.arch.num_layers * engine.arch.num_kv_heads
    assert four_pages == shared_pages + 4 * (one_pages - shared_pages), (four_pages, one_pages, shared_pages)
    # the prompt's prefill ran once; the other three computed only what follows the cached blocks
    assert engine.stats()["prefill_tokens_computed"] - computed == len(ids) + 3 * (len(ids) - shared)
    # sequence i sampled with seed + i: the same tokens as a lone request with that seed
    engine.reset_prefix_cache()
    alone = [run_all(engine, [ids], SamplingParams(**{**sp.__dict__, "seed": 11 + i}))[0] for i in range(4)]
    assert [four[i].token_ids for i in range(4)] == [a.token_ids for a in alone]
    assert four[0].token_ids == one[0].token_ids


def test_n_in_diffkv_runs_independent_sequences(make_engine):
    engine = make_engine(cache={"kv_mode": "diffkv", "num_pages": 4096})  # prefix caching: off (diffkv's default)
    ids = engine.tokenizer.encode(PROMPT)
    sp = SamplingParams(n=2, max_tokens=3, temperature=1.0, seed=5, ignore_eos=True, logprobs=0, prompt_logprobs=0)
    outs, _ = _run_peak(engine, "d", ids, sp)
    assert sorted(outs) == [0, 1]
    alone = [_run_peak(engine, f"a{i}", ids, sp.for_sample(i))[0][0] for i in range(2)]
    assert [outs[i].token_ids for i in range(2)] == [a.token_ids for a in alone]
    # batched with its sibling or alone: the same arithmetic up to the batch's rounding
    for i in range(2):
        assert max(abs(a - b) for a, b in zip(outs[i].logprobs, alone[i].logprobs)) < 0.1
    # the prompt's log-probabilities are the same for every sequence: sequence 0 computes them
    assert outs[0].prompt_logprobs is not None and outs[1].prompt_logprobs is None


def test_abort_ends_every_sequence_and_bad_n_is_refused(make_engine):
    engine = make_engine(cache={"kv_mode": "int8", "num_pages": 4096})
    ids = engine.tokenizer.encode(PROMPT)
    engine.add_request("x", ids, SamplingParams(n=3, max_tokens=50, ignore_eos=True))
    with pytest.raises(InvalidRequestError) as e:
        engine.add_request("x", ids, SamplingParams())
    assert e.value.param == "request_id"
    engine.step()  # sequence 0's prefill: the others are queued behind it
    assert engine.abort("x") and not engine.abort("x")
    assert not engine.has_unfinished_requests() and not engine.requests
    for bad in (0, 129, 2.0, True):
        with pytest.raises(InvalidRequestError) as e:
            SamplingParams(n=bad)
        assert e.value.param == "n"


def test_llm_generate_returns_vllms_outputs_shape(smollm):
    llm = LLM.__new__(LLM)  # the embedded checkpoint already loaded: skip LLM's own load
    from diffkv_serve.engine import EngineConfig
    from diffkv_serve.engine.llm_engine import LLMEngine

    llm.engine = LLMEngine(EngineConfig(device="cpu", cache={"kv_mode": "fp16", "num_pages": 2048}),
                           checkpoint=smollm)
    llm.tokenizer = llm.engine.tokenizer
    a, b = llm.generate(["Hello", "The sky is"], [SamplingParams(n=2, max_tokens=2, seed=1), SamplingParams()])
    assert [o.index for o in a.outputs] == [0, 1] and all(len(o.token_ids) == 2 for o in a.outputs)
    assert b.outputs == [b]


def test_async_engine_streams_all_n_and_a_consumer_leaving_aborts_them(make_engine):
    import asyncio

    from diffkv_serve.engine.async_engine import AsyncLLMEngine

    engine = make_engine(cache={"kv_mode": "int8", "num_pages": 4096})

    async def main():
        async with AsyncLLMEngine(engine) as aeng:
            finished = {}
            async for out in aeng.generate("g", PROMPT, SamplingParams(n=3, max_tokens=2, seed=1, ignore_eos=True)):
                assert out.request_id == "g" and out.index not in finished
                if out.finished:
                    finished[out.index] = len(out.token_ids)
            assert finished == {0: 2, 1: 2, 2: 2}  # the stream ended after the last of the three
            gen = aeng.generate("h", PROMPT, SamplingParams(n=3, max_tokens=100, ignore_eos=True))
            await gen.__anext__()
            await gen.aclose()  # the client went away: every sequence of the request is aborted
            assert not engine.requests and not engine.has_unfinished_requests()

    asyncio.run(main())
