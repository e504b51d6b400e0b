"""benchmarks/_step_loop.py: steps that computed prompt tokens are told from decode steps by the scheduler's
counter, and every step and token lands in one of the two."""
import sys
from pathlib import Path
from types import SimpleNamespace as NS

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))

from _step_loop import step_until_done  # noqa: E402


class FakeEngine:
    """Step 1 prefills 30 prompt tokens, steps 2-4 decode, step 5 recomputes 12 tokens, step 6 decodes."""

    def __init__(self):
        self.scheduler = NS(num_prefill_computed=0)
        self.plan = [30, 0, 0, 0, 12, 0]

    def has_unfinished_requests(self):
        return bool(self.plan)

    def step(self):
        tokens = self.plan.pop(0)
        if self.scheduler is not None:
            self.scheduler.num_prefill_computed += tokens
        return [NS(new_token_ids=[1, 2])]

    def stats(self):
        return {"num_running": 2, "compression_ratio": None}


def test_phases_split_prefill_and_decode_steps():
    run = step_until_done(FakeEngine(), 12, "t", quiet=True, stats_every=100)
    ph = run["phases"]
    assert ph["prefill"]["steps"] == 2 and ph["prefill"]["tokens"] == 42
    assert ph["decode"]["steps"] == 4 and run["steps"] == 6 and run["tokens"] == 12
    assert ph["prefill"]["seconds"] + ph["decode"]["seconds"] <= run["seconds"]


def test_no_phases_without_a_scheduler_counter():
    eng = FakeEngine()
    eng.scheduler = None
    assert step_until_done(eng, 12, "t", quiet=True, stats_every=100)["phases"] is None


def test_stats_every_zero_reads_nothing_and_counts_decode_tokens():
    eng = FakeEngine()
    eng.stats = None  # must not be called
    run = step_until_done(eng, 12, "t", quiet=True, stats_every=0)
    assert run["mean_batch"] == 2 and run["compression_ratio"] is None and run["stats_seconds"] == 0.0


def test_stats_are_sampled_and_timed():
    run = step_until_done(FakeEngine(), 12, "t", quiet=True, stats_every=2)
    assert run["mean_batch"] == 2 and run["max_batch"] == 2 and 0.0 <= run["stats_seconds"] <= run["seconds"]
