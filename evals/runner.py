"""One model, many KV configurations: engines share the loaded checkpoint and are built one at a time
(each takes its KV pool from the device), run batches of requests to completion with a progress bar."""
from __future__ import annotations

import gc
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Iterator, Optional

import torch
from tqdm.auto import tqdm

from diffkv_serve.engine import EngineConfig, SamplingParams
from diffkv_serve.engine.config import GRAPH_BATCH_CAP
from diffkv_serve.engine.loader import LoadedCheckpoint, load_checkpoint
from diffkv_serve.engine.sequence import RequestOutput


@dataclass
class Request:
    prompt_ids: list[int]
    sampling: SamplingParams
    kv_compression: Optional[dict] = None


class EvalModel:
    def __init__(self, model: Optional[str] = None, device: str = "auto", max_model_len: int = 2048,
                 max_num_seqs: int = 64, kv_cache_memory_gb: Optional[float] = None, seed: int = 0,
                 checkpoint: Optional[LoadedCheckpoint] = None):
        self.ckpt = checkpoint if checkpoint is not None else load_checkpoint(model)
        self.name = self.ckpt.name
        self.tokenizer = self.ckpt.tokenizer
        self.head_dim = self.ckpt.arch.head_dim
        self.device, self.max_model_len, self.seed = device, max_model_len, seed
        self.max_num_seqs, self.kv_cache_memory_gb = max_num_seqs, kv_cache_memory_gb
        # Measured key centers (evals.key_center) that engines of quantized modes use instead of the settings
        # file's, unless a configuration names its own key_centering: calibration sweeps with them.
        self.key_center: Optional[torch.Tensor] = None

    def chat_ids(self, text: str) -> list[int]:
        tok = self.tokenizer
        if not getattr(tok, "chat_template", None):
            return tok.encode(text)
        return tok.encode(tok.apply_chat_template([{"role": "user", "content": text}], add_generation_prompt=True),
                          add_special_tokens=False)

    @contextmanager
    def engine(self, cache: dict) -> Iterator["object"]:
        from diffkv_serve.engine.llm_engine import LLMEngine

        cache = dict(cache)
        if self.kv_cache_memory_gb is not None:
            cache.setdefault("kv_cache_memory_gb", self.kv_cache_memory_gb)
        cfg = EngineConfig(model=None, device=self.device, max_model_len=self.max_model_len, seed=self.seed,
                           max_graph_batch_size=min(self.max_num_seqs, GRAPH_BATCH_CAP), cache=cache,
                           scheduler={"max_num_seqs": self.max_num_seqs, "max_num_batched_tokens": 16384})
        eng = LLMEngine(cfg, checkpoint=self.ckpt)
        if (self.key_center is not None and cache.get("key_centering", "auto") in ("auto", "calibrated")
                and cache.get("kv_mode", "fp16") != "fp16"):
            eng.runner.use_key_centers(self.key_center)
        try:
            yield eng
        finally:
            # The caller's `as eng` name outlives the block: closing frees the pool for the next engine anyway.
            eng.close()
            del eng
            gc.collect()
            if torch.cuda.is_available():
                torch.cuda.empty_cache()


def run_requests(engine, requests: list[Request], desc: str) -> list[RequestOutput]:
    """Add every request, step until all finish; outputs in request order. The bar counts tokens."""
    ids = [f"{desc}-{i}" for i in range(len(requests))]
    budget = dict(zip(ids, (r.sampling.max_tokens for r in requests)))
    for rid, r in zip(ids, requests):
        engine.add_request(rid, r.prompt_ids, r.sampling, kv_compression=r.kv_compression)
    done: dict[str, RequestOutput] = {}
    bar = tqdm(total=sum(r.sampling.max_tokens for r in requests), desc=desc, unit="tok", leave=False)
    try:
        while engine.has_unfinished_requests():
            for out in engine.step():
                bar.update(len(out.new_token_ids))
                if out.finished:
                    done[out.request_id] = out
                    bar.update(budget[out.request_id] - len(out.token_ids))  # stopped early: the rest is done
    finally:
        bar.close()
        for rid in ids:  # an exception mid-run must not leave requests holding pages
            if rid not in done:
                engine.abort(rid)
    return [done[r] for r in ids]
