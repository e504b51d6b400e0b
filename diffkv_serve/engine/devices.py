"""Where an EngineConfig.device runs the engine: the one place 'auto' is resolved, so the model runner, kv_mode
'auto' and the CPU thread default agree."""
from __future__ import annotations

import torch


def device_name(name: str) -> str:
    """`name` with 'auto' resolved: 'cuda' where this process sees a GPU, else 'cpu'. Any other name is returned
    as given, unchecked: a CLI flag reaches here before EngineConfig validates it, and Ray ranks on other nodes
    check their own GPUs (model_runner.resolve_device checks this process's)."""
    if name == "auto":
        return "cuda" if torch.cuda.is_available() else "cpu"
    return name


def on_cpu(name: str) -> bool:
    """Whether an EngineConfig.device runs the engine on the CPU ('cpu', or 'auto' without a visible GPU)."""
    return device_name(name) == "cpu"
