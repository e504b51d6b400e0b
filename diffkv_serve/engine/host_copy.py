"""Host values to the device without a stream sync.

torch.tensor(values, device="cuda") copies from pageable memory and waits for every kernel already queued on
the stream; with async scheduling that is the whole decode step in flight. Staging through pinned memory and
copying non-blocking leaves the queue alone (the caching host allocator keeps the staging block until the copy
has run)."""
from __future__ import annotations

import torch


def to_device(values, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    cuda = device.type == "cuda"
    return torch.tensor(values, dtype=dtype, pin_memory=cuda).to(device, non_blocking=cuda)
