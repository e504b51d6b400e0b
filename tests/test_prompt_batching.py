"""Prompt-step batching (SchedulerConfig.prefill_min_prompts / prefill_max_delay_steps) and the admission watermark
(prefill_watermark): the scheduler's rule on a page pool it can count exactly, then an engine run that generates
the same tokens with and without them and gives every page back."""
import pytest
from pydantic import ValidationError

from diffkv_serve.engine import EngineConfig, SamplingParams
from diffkv_serve.engine.config import SchedulerConfig
from diffkv_serve.engine.kv.layout import cdiv
from diffkv_serve.engine.llm_engine import LLMEngine
from diffkv_serve.engine.scheduler import Scheduler
from diffkv_serve.engine.sequence import Sequence, Status

from engine_helpers import TEST_DEVICE, assert_all_pages_free

TOKENS_PER_PAGE = 4


class CountingPool:
    """A single-precision page pool reduced to its counts: a sequence of n tokens holds ceil(n / 4) pages."""

    two_sided = False
    prefix_block_tokens = TOKENS_PER_PAGE

    def __init__(self, num_pages: int, slots: int = 32):
        self.num_pages = num_pages
        self.held: dict[int, int] = {}
        self.slots = list(range(slots))

    @property
    def num_free_slots(self) -> int:
        return len(self.slots)

    def free_pages(self) -> int:
        return self.num_pages - sum(self.held.values())

    planning_free_pages = free_pages

    def alloc_slot(self) -> int:
        slot = self.slots.pop(0)
        self.held[slot] = 0
        return slot

    def free(self, slots: list[int]) -> None:
        for s in slots:
            del self.held[s]
            self.slots.append(s)

    def pages_for_tokens(self, n: int) -> int:
        return cdiv(n, TOKENS_PER_PAGE)

    def pages_to_grow(self, old: int, new: int) -> int:
        return cdiv(new, TOKENS_PER_PAGE) - cdiv(old, TOKENS_PER_PAGE)

    def pages_held(self, slot: int) -> int:
        return self.held[slot]


def seq(i: int, n: int) -> Sequence:
    return Sequence(f"r{i}", list(range(1, n + 1)), SamplingParams(max_tokens=64), detokenizer=None)


def run_prefill(pool: CountingPool, batch) -> None:
    """What the model runner does to the pool for a prompt step: each prompt's pages are taken."""
    for s in batch.seqs:
        s.num_cached = s.num_tokens
        pool.held[s.slot] = pool.pages_for_tokens(s.num_tokens)


def finish(sch: Scheduler, s: Sequence) -> None:
    s.status = Status.FINISHED
    sch.remove(s)


def start(sch: Scheduler, pool: CountingPool, running: int, n: int = 7) -> list[Sequence]:
    """`running` sequences of n tokens admitted and prefilled (7 tokens: 2 pages, and no page to grow by one)."""
    for i in range(running):
        sch.add(seq(100 + i, n))
    batch, _ = sch.schedule()
    assert batch.is_prefill and len(batch.seqs) == running
    run_prefill(pool, batch)
    return batch.seqs


def test_defaults_batch_prompt_steps_and_keep_headroom():
    cfg = SchedulerConfig()
    assert (cfg.prefill_min_prompts, cfg.prefill_max_delay_steps, cfg.prefill_watermark) == (8, 16, 0.01)


def test_a_lone_prompt_that_fits_waits_for_company_then_runs_after_the_delay():
    pool = CountingPool(num_pages=22)
    sch = Scheduler(SchedulerConfig(max_num_seqs=32, prefill_min_prompts=3, prefill_max_delay_steps=2,
                                    prefill_watermark=0), pool)
    running = start(sch, pool, running=9)  # 2 pages each: 18 of 22 pages; 9 running: a step should take 3
    for i in range(5):
        sch.add(seq(i, 7))  # 2 pages each: two fit in the 4 free pages (less one decode step's growth: none)
    # Decode steps while only 2 of the 3 wanted fit: the delay runs out after 2 of them.
    for _ in range(2):
        batch, stuck = sch.schedule()
        assert not batch.is_prefill and len(batch.seqs) == 9 and not stuck
    batch, _ = sch.schedule()
    assert batch.is_prefill and [s.request_id for s in batch.seqs] == ["r0", "r1"]
    assert sch.num_deferred_steps == 2
    run_prefill(pool, batch)
    # Pages for three come back at once: no wait.
    for s in running[:3]:
        finish(sch, s)
    batch, _ = sch.schedule()
    assert batch.is_prefill and [s.request_id for s in batch.seqs] == ["r2", "r3", "r4"]
    assert sch.num_deferred_steps == 2


def test_no_wait_when_all_that_wait_fit_or_few_run_or_nothing_runs_or_nothing_fits():
    cfg = SchedulerConfig(max_num_seqs=32, prefill_min_prompts=4, prefill_max_delay_steps=100, prefill_watermark=0)
    # Nothing runs: whatever fits is admitted at once (an idle GPU waits for nobody).
    pool = CountingPool(num_pages=4)
    sch = Scheduler(cfg, pool)
    for i in range(5):
        sch.add(seq(i, 7))
    batch, _ = sch.schedule()
    assert batch.is_prefill and len(batch.seqs) == 2
    # Both that wait fit (fewer than 4 wait): admitted at once.
    pool = CountingPool(num_pages=50)
    sch = Scheduler(cfg, pool)
    start(sch, pool, running=16)  # 32 pages
    sch.add(seq(0, 7))
    sch.add(seq(1, 7))
    batch, _ = sch.schedule()
    assert batch.is_prefill and len(batch.seqs) == 2
    # Few run (7: a step should take 7 // 4 = 1 prompt): the one that fits is admitted at once.
    pool = CountingPool(num_pages=16)
    sch = Scheduler(cfg, pool)
    start(sch, pool, running=7)  # 14 pages
    for i in range(5):
        sch.add(seq(i, 7))
    batch, _ = sch.schedule()
    assert batch.is_prefill and len(batch.seqs) == 1 and sch.num_deferred_steps == 0
    # The head does not fit at all: a plain decode step, and the delay is not counting.
    pool = CountingPool(num_pages=34)
    sch = Scheduler(cfg, pool)
    start(sch, pool, running=16)
    sch.add(seq(0, 40))
    batch, _ = sch.schedule()
    assert not batch.is_prefill and sch.num_deferred_steps == 0 and sch._deferred == 0


def test_the_slots_and_the_token_budget_cap_the_batch_a_prompt_step_waits_for():
    # 16 running want 4 prompts a step; two free sequence slots make two prompts a full step.
    pool = CountingPool(num_pages=36)
    sch = Scheduler(SchedulerConfig(max_num_seqs=18, prefill_min_prompts=4, prefill_watermark=0), pool)
    start(sch, pool, running=16)  # 32 pages: 4 free, two 2-page prompts
    for i in range(5):
        sch.add(seq(i, 7))
    batch, _ = sch.schedule()
    assert batch.is_prefill and len(batch.seqs) == 2
    # A token budget of 20: two 8-token prompts take it (a third does not fit beside them).
    pool = CountingPool(num_pages=100)
    sch = Scheduler(SchedulerConfig(max_num_seqs=32, prefill_min_prompts=4, prefill_watermark=0), pool)
    start(sch, pool, running=16)
    sch.config = SchedulerConfig(max_num_seqs=32, max_num_batched_tokens=20, prefill_min_prompts=4,
                                 prefill_watermark=0)
    for i in range(5):
        sch.add(seq(i, 8))
    batch, _ = sch.schedule()
    assert batch.is_prefill and len(batch.seqs) == 2


def test_watermark_keeps_headroom_while_sequences_run_but_not_in_an_empty_pool():
    cfg = SchedulerConfig(max_num_seqs=16, prefill_min_prompts=1, prefill_watermark=0.25)  # 5 of 20 pages
    pool = CountingPool(num_pages=20)
    sch = Scheduler(cfg, pool)
    for i in range(10):
        sch.add(seq(i, 7))
    batch, _ = sch.schedule()  # empty pool: all 20 pages may go to prompts
    assert batch.is_prefill and len(batch.seqs) == 10
    pool = CountingPool(num_pages=20)
    sch = Scheduler(cfg, pool)
    start(sch, pool, running=2)  # 4 pages held, 16 free, 5 kept: 11 -> five 2-page prompts
    for i in range(8):
        sch.add(seq(i, 7))
    batch, _ = sch.schedule()
    assert batch.is_prefill and len(batch.seqs) == 5


@pytest.mark.parametrize("field, value", [("prefill_min_prompts", 0), ("prefill_max_delay_steps", -1),
                                          ("prefill_watermark", -0.1), ("prefill_watermark", 1.0)])
def test_bad_prompt_batching_settings_name_the_field(field, value):
    with pytest.raises(ValidationError, match=field):
        SchedulerConfig(**{field: value})


LENGTHS = [6 + 5 * (i % 5) for i in range(12)]


@pytest.mark.parametrize("mode, pool_gb", [("int4", 0.004), ("diffkv", 0.006)])
def test_engine_serves_every_request_to_its_length_with_prompt_batching_and_gives_every_page_back(mode, pool_gb):
    """A pool of about five sequences and twelve prompts of staggered lengths, so pages come back a sequence at a
    time: batching prompts and keeping headroom admit in fewer prompt steps, serve every request to its length and
    give every page back. Greedy tokens are not compared: a different decode batch moves the CPU GEMMs' rounding,
    which flips near-ties (max_num_seqs alone changes 1-2 of these 12 outputs, in int4 as in diffkv)."""
    def run(**sched):
        eng = LLMEngine(EngineConfig(device=TEST_DEVICE, cache={"kv_mode": mode, "kv_cache_memory_gb": pool_gb},
                                     scheduler={"max_num_seqs": 16, "max_num_batched_tokens": 512, **sched}))
        for i in range(12):
            eng.add_request(f"q{i}", [1 + (7 * i + j) % 300 for j in range(20 + 3 * i)],
                            SamplingParams(temperature=0, max_tokens=LENGTHS[i], ignore_eos=True))
        prompt_steps, out = 0, {}
        while eng.has_unfinished_requests():
            before = eng.scheduler.num_prefill_computed
            for o in eng.step():
                if o.finished:
                    assert o.request_id not in out
                    out[o.request_id] = len(o.outputs[0].token_ids)
            prompt_steps += eng.scheduler.num_prefill_computed != before
        assert_all_pages_free(eng)
        deferred = eng.scheduler.num_deferred_steps
        eng.shutdown()
        return out, prompt_steps, deferred

    plain, plain_steps, plain_deferred = run(prefill_min_prompts=1, prefill_watermark=0.0)
    batched, batched_steps, deferred = run(prefill_min_prompts=2, prefill_max_delay_steps=6, prefill_watermark=0.05)
    assert plain == batched == {f"q{i}": LENGTHS[i] for i in range(12)}
    assert plain_deferred == 0 and deferred > 0
    assert batched_steps < plain_steps
