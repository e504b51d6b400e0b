"""One configuration end to end: an engine with its KV settings runs the fidelity replay and the task
problems; the result records the settings the engine really used (per-model defaults included)."""
from __future__ import annotations

import time
from typing import Optional

from evals.configs import KVConfig
from evals.fidelity import teacher_forced
from evals.runner import EvalModel
from evals.tasks import run_tasks

DEFAULT_MAX_TOKENS = {"gsm_symbolic": 384, "basic_arithmetic": 96, "chain_sum": 96}


def evaluate_config(model: EvalModel, kvc: KVConfig, problems=(), fidelity_prompts=(), refs=(),
                    max_tokens: Optional[dict] = None) -> dict:
    t0 = time.perf_counter()
    with model.engine(kvc.cache) as eng:
        cache = eng.config.cache  # after per-model settings were applied
        result = {"name": kvc.name, "label": kvc.label, "family": kvc.family,
                  "cache": cache.model_dump(exclude={"num_pages", "kv_cache_memory_gb", "gpu_memory_utilization"})}
        if refs:
            result["fidelity"] = teacher_forced(eng, cache, model.head_dim, list(fidelity_prompts), list(refs),
                                                f"{kvc.name} fidelity")
        if problems:
            result["tasks"] = run_tasks(eng, model, cache, list(problems), {**DEFAULT_MAX_TOKENS, **(max_tokens or {})},
                                        f"{kvc.name} tasks")
    result["seconds"] = time.perf_counter() - t0
    return result
