"""torch's CPU threads for a command-line run (`diffkv generate / chat / eval / calibrate --threads N`).

Default: the cores this process may use that other processes are not already keeping busy (the 1-minute load
average), between 1 and MAX_DEFAULT_THREADS. torch's threads meet at every op, so one thread waiting for a busy
core stalls them all. Measured on a 2-core box, `diffkv generate --max-tokens 64 --ignore-eos --threads N`
(SmolLM2-135M, the whole command, model load included; ranges over runs, other jobs on the box add noise):

    cores kept busy by other processes    1 thread       2 threads (torch's own default there)
    none                                  5.1 - 6.5 s    3.4 - 6.4 s
    one                                   5.7 - 6.2 s   12.8 - 13.6 s
    both                                  9.1 - 9.7 s   16.1 - 41.8 s

The cap is not measured (no larger box here): it keeps a big host from spreading a small model over dozens
of threads. Serve's engine replicas are Ray actors: Ray sets their OMP_NUM_THREADS to their CPUs (at least 1).
"""
from __future__ import annotations

import os
from typing import Optional

MAX_DEFAULT_THREADS = 4


def usable_cores() -> int:
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # not on Linux
        return os.cpu_count() or 1


def busy_cores() -> float:
    """Cores other processes keep busy: the 1-minute load average (0 where the platform has none)."""
    try:
        return os.getloadavg()[0]
    except (AttributeError, OSError):
        return 0.0


def default_threads(cores: Optional[int] = None, busy: Optional[float] = None) -> int:
    cores = usable_cores() if cores is None else cores
    busy = busy_cores() if busy is None else busy
    return max(1, min(MAX_DEFAULT_THREADS, cores - int(busy + 0.5)))


def set_threads(threads: Optional[int], device: str = "auto") -> Optional[int]:
    """Set torch's threads to `threads`, or, for a CPU run where neither it nor OMP_NUM_THREADS is given, to
    default_threads(). Returns the count set, or None when torch keeps its own."""
    import torch

    from diffkv_serve.engine.devices import on_cpu

    if threads is not None:
        if threads < 1:
            raise ValueError(f"--threads must be >= 1, got {threads}")
    elif os.environ.get("OMP_NUM_THREADS") or not on_cpu(device):
        return None
    else:
        threads = default_threads()
    torch.set_num_threads(threads)
    return threads
