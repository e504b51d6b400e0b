"""Helpers shared by the engine tests (imported by name: `from engine_helpers import run_all`; a conftest cannot be
imported reliably once several test folders have one)."""
import os

TEST_DEVICE = os.environ.get("DIFFKV_TEST_DEVICE", "cpu")

# Short prompts of different lengths (one longer than a page) for batched engine tests.
PROMPTS = [
    "The quick brown fox",
    "In 1492, Columbus",
    "Water boils at",
    "A list of colors: red, green,",
    "import numpy as np\nx = np.",
    "Once upon a time in a land far, far away, there lived a king who had three daughters. The youngest",
]


def assert_all_pages_free(engine) -> None:
    """Invariant every test ends with: no slot is held, the prefix cache's blocks are consistent and nobody
    reads them; once it is cleared, each page is on the free list exactly once."""
    assert not engine.has_unfinished_requests(), "requests still queued or running"
    pc = engine.scheduler.prefix_cache
    engine.mm.check_invariants(live_slots=[], refcounts=pc.refcounts() if pc is not None else None)
    assert pc is None or not any(pc.refcounts().values()), "prefix blocks still referenced"
    engine.reset_prefix_cache()
    engine.mm.check_invariants(live_slots=[])
    assert engine.mm.free_pages() == engine.mm.num_pages


def run_all(engine, prompts, sampling, **kw):
    """Add every prompt (ids "0", "1", ...), step until all finish, return their final outputs in order."""
    for i, p in enumerate(prompts):
        engine.add_request(str(i), p, sampling, **kw)
    done = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                done[out.request_id] = out
    return [done[str(i)] for i in range(len(prompts))]


def apply_op(engine, ids: list, op: str, n: int, prompt=None, max_tokens: int = 1) -> None:
    """One operation of a random interleaving (property tests): "add" the prompt (greedy, max_tokens, EOS
    ignored; a prompt the engine refuses is skipped), "step" n times, "abort" the n-th request added (mod), or
    "preempt" the latest admitted sequence. ids collects the request ids added."""
    from diffkv_serve.engine import SamplingParams
    from diffkv_serve.engine.errors import InvalidRequestError

    if op == "add":
        rid = f"r{len(ids)}"
        try:
            engine.add_request(rid, prompt, SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True))
            ids.append(rid)
        except InvalidRequestError:
            pass
    elif op == "step":
        for _ in range(n):
            engine.step()
    elif op == "abort" and ids:
        engine.abort(ids[n % len(ids)])
    elif op == "preempt":
        engine.scheduler.preempt_last()
