"""Offline batch generation: `LLM(model).generate(prompts, sampling)`."""
from __future__ import annotations

from typing import Any, Optional, Sequence, Union

from tqdm.auto import tqdm

from diffkv_serve.engine.config import EngineConfig
from diffkv_serve.engine.llm_engine import LLMEngine
from diffkv_serve.engine.sampling_params import SamplingParams
from diffkv_serve.engine.sequence import RequestOutput

Prompt = Union[str, list[int]]


class LLM:
    def __init__(self, model: Optional[str] = None, config: Optional[EngineConfig] = None, **overrides: Any):
        if config is None:
            config = EngineConfig(model=model, **overrides)
        self.engine = LLMEngine(config)
        self.tokenizer = self.engine.tokenizer

    def generate(self, prompts: Union[Prompt, Sequence[Prompt]],
                 sampling: Union[SamplingParams, Sequence[SamplingParams], None] = None,
                 use_tqdm: bool = False) -> list[RequestOutput]:
        """Run every prompt to completion; results come back in the prompts' order."""
        if isinstance(prompts, str) or (isinstance(prompts, list) and prompts and isinstance(prompts[0], int)):
            prompts = [prompts]
        prompts = list(prompts)
        if sampling is None or isinstance(sampling, SamplingParams):
            sampling = [sampling or SamplingParams()] * len(prompts)
        if len(sampling) != len(prompts):
            raise ValueError(f"sampling: got {len(sampling)} SamplingParams for {len(prompts)} prompts")
        ids = [f"offline-{id(self)}-{i}" for i in range(len(prompts))]
        for rid, prompt, sp in zip(ids, prompts, sampling):
            self.engine.add_request(rid, prompt, sp)
        results: dict[str, RequestOutput] = {}
        bar = tqdm(total=len(prompts), desc="generate", disable=not use_tqdm)
        while self.engine.has_unfinished_requests():
            for out in self.engine.step():
                if out.finished:
                    results[out.request_id] = out
                    bar.update(1)
        bar.close()
        return [results[r] for r in ids]

    def chat(self, messages: list[dict], sampling: Optional[SamplingParams] = None) -> RequestOutput:
        prompt = self.tokenizer.apply_chat_template(messages, add_generation_prompt=True)
        return self.generate(self.tokenizer.encode(prompt, add_special_tokens=False), sampling)[0]
