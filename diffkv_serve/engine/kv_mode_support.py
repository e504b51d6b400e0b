"""Whether a KV cache mode runs on a device: what kv_mode 'auto' checks before it takes a model's measured mode."""
from __future__ import annotations

from typing import Optional

import torch

from diffkv_serve.engine.devices import device_name

E4M3_CAPABILITY = (8, 9)  # cvt between e4m3 and fp16 (the decode kernels' fp8 pages) needs sm_89 or newer


def unsupported_reason(kv_mode: str, device: str) -> Optional[str]:
    """Why `kv_mode` cannot run on `device` (an EngineConfig.device), or None. A CUDA device this process cannot
    see (Ray ranks on other nodes) is not checked here: the ranks check their own GPUs."""
    if kv_mode != "fp8":
        return None
    name = device_name(device)
    if not name.startswith("cuda") or not torch.cuda.is_available():
        return None
    capability = torch.cuda.get_device_capability(torch.device(name))
    if capability < E4M3_CAPABILITY:
        return (f"e4m3 pages need compute capability {E4M3_CAPABILITY[0]}.{E4M3_CAPABILITY[1]} or newer; "
                f"{name} has {capability[0]}.{capability[1]}")
    return None
