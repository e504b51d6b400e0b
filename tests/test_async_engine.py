"""AsyncLLMEngine on the embedded model: concurrent streaming, early exit, bad input, shutdown, step errors.

Each test drives its own event loop with asyncio.run (no pytest-asyncio); `make_engine` checks afterwards
that every page is free again.
"""
import asyncio

import pytest

from diffkv_serve.engine import InvalidRequestError, SamplingParams
from diffkv_serve.engine.async_engine import AsyncLLMEngine

from engine_helpers import run_all

GREEDY = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
LONG = SamplingParams(temperature=0, max_tokens=64, ignore_eos=True)  # never meant to finish

PROMPTS = ["The quick brown fox", "In 1492, Columbus", "Water boils at", "A list of colors: red, green,"]


_REFERENCE: list = []


def reference(engine):
    """Final greedy outputs of PROMPTS via run_all (the sequential engine API), computed once per module:
    greedy output does not depend on the engine instance or the batch (test_engine checks the latter)."""
    if not _REFERENCE:
        _REFERENCE.extend(run_all(engine, PROMPTS, GREEDY))
    return _REFERENCE


async def collect(aeng, request_id, prompt, sampling=GREEDY):
    return [out async for out in aeng.generate(request_id, prompt, sampling)]


@pytest.mark.parametrize("async_steps", ["off", "on"])
def test_concurrent_generation_equals_run_all_and_deltas_concatenate(make_engine, async_steps):
    engine = make_engine(scheduler={"async_scheduling": async_steps})
    ref = reference(engine)

    async def main():
        async with AsyncLLMEngine(engine) as aeng:
            streams = await asyncio.gather(*(collect(aeng, f"r{i}", p) for i, p in enumerate(PROMPTS)))
            stats = await aeng.stats()
        return streams, stats

    streams, stats = asyncio.run(main())
    assert stats["num_running"] == 0 and stats["num_waiting"] == 0
    for outs, want in zip(streams, ref):
        final = outs[-1]
        assert final.finished and final.finish_reason == "length"
        assert all(not o.finished for o in outs[:-1])
        assert final.token_ids == want.token_ids and final.text == want.text
        assert "".join(o.delta_text for o in outs) == final.text
        assert [t for o in outs for t in o.new_token_ids] == final.token_ids
        assert len(outs) == GREEDY.max_tokens  # one output per step that produced a token


@pytest.mark.parametrize("async_steps", ["off", "on"])
def test_consumer_leaving_early_aborts_and_others_continue(make_engine, async_steps):
    engine = make_engine(scheduler={"async_scheduling": async_steps})
    ref = reference(engine)[1]

    async def main():
        async with AsyncLLMEngine(engine) as aeng:
            other = asyncio.create_task(collect(aeng, "other", PROMPTS[1]))
            # break + aclose(), as `async with aclosing(...)` or an HTTP handler's cleanup does
            agen = aeng.generate("leaver", PROMPTS[0], LONG)
            first = await agen.__anext__()
            assert not first.finished and "leaver" in engine.requests
            await agen.aclose()
            assert "leaver" not in engine.requests
            with pytest.raises(StopAsyncIteration):
                await agen.__anext__()
            # cancellation, as when the client disconnects mid-stream
            got_one = asyncio.Event()

            async def consume():
                async for _ in aeng.generate("cancelled", PROMPTS[2], LONG):
                    got_one.set()

            task = asyncio.create_task(consume())
            await got_one.wait()
            task.cancel()
            with pytest.raises(asyncio.CancelledError):
                await task
            assert "cancelled" not in engine.requests
            outs = await other
            assert await aeng.abort("leaver") is False
            return outs

    outs = asyncio.run(main())
    assert outs[-1].finished and outs[-1].token_ids == ref.token_ids
    assert engine.requests == {}
    assert engine.mm.free_pages() == engine.mm.num_pages


def test_invalid_request_raises_before_any_output_and_others_continue(make_engine):
    engine = make_engine()
    ref = reference(engine)[0]

    async def main():
        async with AsyncLLMEngine(engine) as aeng:
            good = asyncio.create_task(collect(aeng, "good", PROMPTS[0]))
            with pytest.raises(InvalidRequestError) as e:
                await aeng.generate("bad", "", GREEDY).__anext__()
            assert e.value.param == "prompt"
            with pytest.raises(InvalidRequestError) as e:
                await aeng.generate("x", PROMPTS[0], GREEDY, kv_compression={"bogus": 1}).__anext__()
            assert e.value.param == "kv_compression"
            # Commands reach the engine in order, so "good" is queued by now (and far from done): reusing its
            # id is refused and must leave "good" untouched.
            with pytest.raises(InvalidRequestError) as e:
                await aeng.generate("good", PROMPTS[1], GREEDY).__anext__()
            assert e.value.param == "request_id"
            return await good

    outs = asyncio.run(main())
    assert outs[-1].finished and outs[-1].token_ids == ref.token_ids


def test_shutdown_ends_in_flight_iterators_and_frees_pages(make_engine):
    engine = make_engine()

    async def main():
        aeng = AsyncLLMEngine(engine)
        await aeng.start()
        await aeng.start()  # idempotent
        started = [asyncio.Event(), asyncio.Event()]

        async def consume(i):
            outs = []
            async for out in aeng.generate(f"s{i}", PROMPTS[i], LONG):
                outs.append(out)
                started[i].set()
            return outs

        tasks = [asyncio.create_task(consume(i)) for i in range(2)]
        for ev in started:  # both are generating when shutdown comes
            await ev.wait()
        await aeng.shutdown()
        results = await asyncio.wait_for(asyncio.gather(*tasks), timeout=30)
        await aeng.shutdown()  # idempotent
        with pytest.raises(RuntimeError):
            await aeng.generate("late", PROMPTS[0], GREEDY).__anext__()
        return results

    for outs in asyncio.run(main()):
        assert outs[-1].finished and outs[-1].finish_reason == "abort"
        assert len(outs[-1].token_ids) < LONG.max_tokens
    assert engine.requests == {}
    assert not engine.has_unfinished_requests()
    assert engine.mm.free_pages() == engine.mm.num_pages


def test_failed_step_surfaces_to_in_flight_request_and_engine_keeps_serving(make_engine, monkeypatch):
    engine = make_engine()
    ref = reference(engine)[2]
    real_step = engine.step
    calls = {"n": 0}

    def flaky_step():
        calls["n"] += 1
        if calls["n"] == 2:  # after the prefill produced the first token
            raise ValueError("boom")
        return real_step()

    monkeypatch.setattr(engine, "step", flaky_step)

    async def main():
        async with AsyncLLMEngine(engine) as aeng:
            outs = []
            with pytest.raises(RuntimeError, match="boom") as e:
                async for out in aeng.generate("doomed", PROMPTS[0], LONG):
                    outs.append(out)
            assert isinstance(e.value.__cause__, ValueError)
            assert len(outs) == 1
            assert engine.requests == {}
            return await collect(aeng, "later", PROMPTS[2])

    outs = asyncio.run(main())
    assert outs[-1].finished and outs[-1].token_ids == ref.token_ids
