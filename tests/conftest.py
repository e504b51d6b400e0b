import os

# Triton kernels run on CPU tensors through Triton's interpreter; it must be chosen before triton is imported.
if not os.environ.get("DIFFKV_TEST_DEVICE", "cpu").startswith("cuda"):
    os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest  # noqa: E402

from engine_helpers import TEST_DEVICE, assert_all_pages_free  # noqa: E402


@pytest.fixture(scope="session")
def smollm():
    """The embedded SmolLM2 checkpoint, loaded (and converted, once per cache dir) for the whole session."""
    from diffkv_serve.engine.loader import load_checkpoint

    return load_checkpoint(None)


@pytest.fixture
def make_engine(smollm):
    """Build engines on the embedded model; after the test, every one must have all its pages free."""
    from diffkv_serve.engine import EngineConfig
    from diffkv_serve.engine.llm_engine import LLMEngine

    engines = []

    def make(**kw):
        kw.setdefault("device", TEST_DEVICE)
        if isinstance(kw.get("cache", {}), dict):  # these tests expect the uncompressed cache unless they say
            kw["cache"] = {"kv_mode": "fp16", **kw.get("cache", {})}  # otherwise ('auto' runs the measured mode)
        cfg = EngineConfig(**kw)
        eng = LLMEngine(cfg, checkpoint=smollm)
        engines.append(eng)
        return eng

    yield make
    for eng in engines:
        assert_all_pages_free(eng)


@pytest.fixture(autouse=True)
def _restore_torch_threads():
    """Commands run in-process (evals.cli eval, diffkv generate) set torch's thread count for the machine's load; a test
    that follows must not inherit it (float sums differ with the thread count, and bit-for-bit checks compare
    against Ray workers that set their own)."""
    import torch

    before = torch.get_num_threads()
    yield
    torch.set_num_threads(before)


# The fast subset (`pytest -m "not slow"`, about 5 minutes on 2 cores) leaves out what needs a Ray cluster or a
# server process, and these files, each of which runs minutes of real engines or processes:
SLOW_FILES = {
    "multinode/test_service_multinode.py",  # a multi-node Ray cluster of its own
    "ops/test_live_service.py",  # a live service scraped by Prometheus
    "ops/test_soak.py",  # a bounded soak run
    "test_engine_vs_hf.py",  # the engine against transformers, token for token
    "test_tensor_parallel.py",  # Ray worker actors per rank
}


def pytest_collection_modifyitems(config, items):
    root = config.rootpath / "tests"
    for item in items:
        rel = item.path.relative_to(root).as_posix() if item.path.is_relative_to(root) else ""
        if rel in SLOW_FILES or "cluster" in getattr(item, "fixturenames", ()):
            item.add_marker(pytest.mark.slow)
