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
        """Run every prompt to completion; results come back in the prompts' order. A prompt whose
        SamplingParams has n > 1 gets sequence 0's output, with all n in `.outputs` (vLLM's shape)."""
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
        finished: dict[str, list[RequestOutput]] = {r: [] for r in ids}
        bar = tqdm(total=sum(sp.n for sp in sampling), desc="generate", disable=not use_tqdm)
        while self.engine.has_unfinished_requests():
            for out in self.engine.step():
                if out.finished:
                    finished[out.request_id].append(out)
                    bar.update(1)
        bar.close()
        results = []
        for r in ids:
            outs = sorted(finished[r], key=lambda o: o.index)
            if len(outs) > 1:
                outs[0].outputs = outs
            results.append(outs[0])
        return results

    def chat(self, messages: list[dict], sampling: Optional[SamplingParams] = None) -> RequestOutput:
        prompt = self.tokenizer.apply_chat_template(messages, add_generation_prompt=True)
        return self.generate(self.tokenizer.encode(prompt, add_special_tokens=False), sampling)[0]
