"""One configuration end to end: an engine with its KV settings runs the fidelity replay and the task
problems in one batch (fewer decode steps than one after the other); the result records the settings the
engine really used (per-model defaults included)."""
from __future__ import annotations

import time
from typing import Optional

from evals.configs import KVConfig
from evals.fidelity import score_fidelity, teacher_forced_requests
from evals.runner import EvalModel, run_requests
from evals.tasks import score_tasks, task_requests

DEFAULT_MAX_TOKENS = {"gsm_symbolic": 384, "basic_arithmetic": 32, "chain_sum": 32}


def run_config(model: EvalModel, eng, cache, name: str, problems=(), fidelity_prompts=(), refs=(),
               max_tokens: Optional[dict] = None, kv_compression: Optional[dict] = None) -> dict:
    """Fidelity and tasks of one configuration on a running engine (per-request thresholds optional)."""
    problems, refs = list(problems), list(refs)
    fid = teacher_forced_requests(list(fidelity_prompts), refs, kv_compression)
    tasks = task_requests(model, problems, {**DEFAULT_MAX_TOKENS, **(max_tokens or {})}, kv_compression)
    outs = run_requests(eng, fid + tasks, name)
    result = {}
    if refs:
        result["fidelity"] = score_fidelity(cache, model.head_dim, refs, outs[:len(fid)], name)
    if problems:
        result["tasks"] = score_tasks(cache, model.head_dim, problems, outs[len(fid):])
    return result


def evaluate_config(model: EvalModel, kvc: KVConfig, problems=(), fidelity_prompts=(), refs=(),
                    max_tokens: Optional[dict] = None) -> dict:
    t0 = time.perf_counter()
    with model.engine(kvc.cache) as eng:
        cache = eng.config.cache  # after per-model settings were applied
        result = {"name": kvc.name, "label": kvc.label, "family": kvc.family,
                  "cache": cache.model_dump(exclude={"num_pages", "kv_cache_memory_gb", "gpu_memory_utilization"})}
        result.update(run_config(model, eng, cache, kvc.name, problems, fidelity_prompts, refs, max_tokens))
    result["seconds"] = time.perf_counter() - t0
    return result
