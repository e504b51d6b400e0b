"""Sequence slots: the rows of the page and length tables that live sequences own.

A stack of free slots, last freed first reused. engine.kv.pool.MemoryManager (each rank) and
engine.kv.distributed.DistributedPages (the driver's view of all ranks) hand slots out in the same order,
so the driver's choice is every rank's."""
from __future__ import annotations


class SequenceSlots:
    def __init__(self, max_seqs: int):
        self._free = list(range(max_seqs - 1, -1, -1))  # pop from the end: slot 0 first
        self.max_seqs = max_seqs

    def alloc(self) -> int:
        if not self._free:
            raise RuntimeError("no free sequence slot: the scheduler admitted more than max_seqs")
        return self._free.pop()

    def release(self, slots: list[int]) -> None:
        self._free.extend(slots)

    def __len__(self) -> int:
        """Free slots."""
        return len(self._free)

    def in_use(self) -> set[int]:
        return set(range(self.max_seqs)) - set(self._free)
