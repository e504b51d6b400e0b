"""engine.devices resolves EngineConfig.device 'auto' once for the model runner, kv_mode 'auto' (model_settings,
kv_mode_support) and the CPU thread default; each sees the same answer with and without a visible GPU."""
import pytest
import torch

from diffkv_serve.engine import threads
from diffkv_serve.engine.devices import device_name, on_cpu
from diffkv_serve.engine.kv_mode_support import unsupported_reason
from diffkv_serve.engine.model_runner import resolve_device


@pytest.fixture
def no_gpu(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)


@pytest.fixture
def gpu(monkeypatch):
    """A visible GPU of compute capability 8.0 (below fp8's sm_89)."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device: (8, 0))


def test_auto_without_a_gpu_is_the_cpu_everywhere(no_gpu, monkeypatch):
    assert device_name("auto") == "cpu" and on_cpu("auto")
    assert resolve_device("auto") == torch.device("cpu")
    assert unsupported_reason("fp8", "auto") is None  # the CPU runs fp8 pages through the torch references
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    monkeypatch.setattr(torch, "set_num_threads", lambda n: None)  # keep this process's threads as they are
    assert threads.set_threads(None, "auto") == threads.default_threads()


def test_auto_with_a_gpu_is_cuda_everywhere(gpu, monkeypatch):
    assert device_name("auto") == "cuda" and not on_cpu("auto")
    assert resolve_device("auto") == torch.device("cuda")
    assert unsupported_reason("fp8", "auto") == "e4m3 pages need compute capability 8.9 or newer; cuda has 8.0"
    assert unsupported_reason("int4", "auto") is None
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    assert threads.set_threads(None, "auto") is None  # a GPU run keeps torch's own thread count


def test_named_devices_are_returned_as_given(no_gpu):
    for name in ("cpu", "cuda", "cuda:1"):
        assert device_name(name) == name
    assert on_cpu("cpu") and not on_cpu("cuda") and not on_cpu("cuda:1")
    # an unvalidated CLI value is not a CPU run; EngineConfig rejects it with its own message
    assert device_name("bogus") == "bogus" and not on_cpu("bogus")
    assert unsupported_reason("fp8", "cuda:1") is None  # a GPU this process cannot see: its rank checks it
    assert resolve_device("cpu") == torch.device("cpu")
    with pytest.raises(ValueError, match="device='cuda:1' but no CUDA device is available"):
        resolve_device("cuda:1")
