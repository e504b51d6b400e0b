"""DiffKV Serve inference engine: paged KV cache, continuous batching, no Ray and no HTTP."""
from diffkv_serve.engine.config import CacheConfig, EngineConfig, SchedulerConfig
from diffkv_serve.engine.errors import InvalidRequestError
from diffkv_serve.engine.sampling_params import SamplingParams

__all__ = ["CacheConfig", "EngineConfig", "SchedulerConfig", "InvalidRequestError", "SamplingParams",
           "LLMEngine", "LLM"]


def __getattr__(name):  # keep `import engine` light: the model stack loads on first use
    if name == "LLMEngine":
        from diffkv_serve.engine.llm_engine import LLMEngine
        return LLMEngine
    if name == "LLM":
        from diffkv_serve.engine.llm import LLM
        return LLM
    raise AttributeError(name)
