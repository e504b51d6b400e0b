"""Hooks end-to-end tests use to drive a live engine replica into a state no request can reach (a replica
that grows past its memory limit). Off unless DIFFKV_TEST_HOOKS=1 is in the replica's environment, and
reachable only through a Serve DeploymentHandle (a Ray driver of the cluster), never over HTTP."""
from __future__ import annotations

import os

ENV = "DIFFKV_TEST_HOOKS"
MAX_HOLD_GIB = 4.0  # a test must not endanger the machine it runs on
_CHUNK = 64 * 2**20
_held: list[bytearray] = []


def enabled() -> bool:
    return os.environ.get(ENV) == "1"


def hold_memory(gib: float) -> int:
    """Allocate `gib` GiB in this process and keep it resident (every page written); returns the bytes now held."""
    if not enabled():
        raise RuntimeError(f"test hooks are off in this replica: set {ENV}=1 in its environment")
    if not 0 < gib <= MAX_HOLD_GIB:
        raise ValueError(f"gib: must be in (0, {MAX_HOLD_GIB}], got {gib}")
    left = int(gib * 2**30)
    while left > 0:
        chunk = bytearray(min(_CHUNK, left))
        chunk[::4096] = b"\x01" * len(range(0, len(chunk), 4096))  # touch each page: resident, not just mapped
        _held.append(chunk)
        left -= len(chunk)
    return sum(len(c) for c in _held)
