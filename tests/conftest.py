import os

# Triton kernels run on CPU tensors through Triton's interpreter; it must be chosen before triton is imported.
if not os.environ.get("DIFFKV_TEST_DEVICE", "cpu").startswith("cuda"):
    os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest  # noqa: E402

TEST_DEVICE = os.environ.get("DIFFKV_TEST_DEVICE", "cpu")


@pytest.fixture(scope="session")
def smollm():
    """The embedded SmolLM2 checkpoint, loaded (and converted, once per cache dir) for the whole session."""
    from engine.loader import load_checkpoint

    return load_checkpoint(None)


def assert_all_pages_free(engine) -> None:
    """Invariant every test ends with: each page is on the free list exactly once and no slot is held."""
    assert not engine.has_unfinished_requests(), "requests still queued or running"
    engine.mm.check_invariants(live_slots=[])
    assert engine.mm.free_pages() == engine.mm.num_pages


@pytest.fixture
def make_engine(smollm):
    """Build engines on the embedded model; after the test, every one must have all its pages free."""
    from engine import EngineConfig
    from engine.llm_engine import LLMEngine

    engines = []

    def make(**kw):
        kw.setdefault("device", TEST_DEVICE)
        cfg = EngineConfig(**kw)
        eng = LLMEngine(cfg, checkpoint=smollm)
        engines.append(eng)
        return eng

    yield make
    for eng in engines:
        assert_all_pages_free(eng)


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
