"""One tensor-parallel rank: its model shard, its KV memory manager (for its KV heads) and its device.

The driver (engine.ray_executor) wraps `Worker` in a Ray actor; this module imports no Ray. Every step the
driver sends each rank the same small StepRequest, a delta against what the rank already knows:

  prefill  each sequence once, with its token ids, sampling settings and DiffKV thresholds (NewSequence)
  decode   per sequence only (slot, newest token, tokens cached): the rank keeps its own copy of each
           sequence (engine.sequence.Sequence without a detokenizer) and appends the token
  frees    slots to release first (finished, aborted, preempted), in the order the driver released them
  evict    prefix-cache blocks to drop next (engine.kv.prefix_cache: the driver decides every hit, insert and
           eviction by block id, so all ranks cache the same blocks, each in its own pages)

Slots are chosen by the driver; every rank's memory manager hands out slots in the same order (last
freed, first reused), so a rank takes the same slot and checks that it did. Rank 0 samples (all ranks
hold the same logits after the all-reduce); every rank reports its free pages and, per sequence of the
step, the pages it holds and its high / low token counts, which the driver's page view keeps.
"""
from __future__ import annotations

import logging
import os
import socket
from dataclasses import dataclass, field
from datetime import timedelta
from typing import Any, Optional

import torch

from diffkv_serve.engine.config import EngineConfig
from diffkv_serve.engine.kv.request_settings import KVRequestSettings
from diffkv_serve.engine.logprobs import StepLogprobs
from diffkv_serve.engine.sampling_params import SamplingParams
from diffkv_serve.engine.sequence import Sequence

log = logging.getLogger(__name__)

# Environment of every rank. The NVLS / multicast switches are required on our multi-GPU machines (NVLink
# SHARP and symmetric-memory multicast are unavailable there and would fail collective setup).
WORKER_ENV = {
    "NCCL_NVLS_ENABLE": "0",
    "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1",
    "NVSHMEM_DISABLE_NVLS": "1",
    "RAY_USAGE_STATS_ENABLED": "0",
}
COLLECTIVE_TIMEOUT = timedelta(minutes=10)  # a rank blocked this long in a collective gives up


@dataclass
class NewSequence:
    """A sequence a rank has not seen (admitted, or re-admitted after preemption: then with its outputs)."""

    request_id: str
    slot: int
    prompt_token_ids: list[int]
    output_token_ids: list[int]
    params: SamplingParams
    kv_settings: Optional[KVRequestSettings]  # resolved by the driver (None: the cache config's)
    prefix_hits: list[int] = field(default_factory=list)  # cached blocks its prefill reads
    prefix_inserts: list[int] = field(default_factory=list)  # blocks its prefill caches


@dataclass
class StepRequest:
    frees: list[int]  # slots to release before the step
    forget: list[str]  # finished requests: drop their sampling state (seeded generators)
    is_prefill: bool
    new: list[NewSequence] = field(default_factory=list)  # prefill: the batch, in order
    slots: list[int] = field(default_factory=list)  # decode: the batch, in order
    tokens: list[int] = field(default_factory=list)  # decode: each sequence's newest token (this step's input)
    num_cached: list[int] = field(default_factory=list)  # decode: its cached tokens before the step (checked)
    evict: list[int] = field(default_factory=list)  # prefix-cache blocks to evict after the frees
    token_masks: Optional[Any] = None  # engine.grammar.TokenMasks of the grammar rows, computed on the driver


@dataclass
class StepReport:
    rank: int
    free_pages: int
    held: list[int]  # per sequence of the step: pages held on this rank after it
    tokens_high: list[int]
    tokens_low: list[int]
    mm_seconds: float
    growth: list[int] = field(default_factory=list)  # per sequence: pages its next decode step may take here
    overflowed: list[int] = field(default_factory=list)  # learned-reservation prefill: indices that did not fit
    tokens: Optional[list[int]] = None  # rank 0 only
    logprobs: Optional[StepLogprobs] = None
    teacher_agree: Optional[list[Optional[bool]]] = None  # rank 0: per sequence, None if not teacher-forced


class Worker:
    def __init__(self, config: EngineConfig, rank: int, world_size: int, device: str):
        self.config = config.model_copy(update={"device": device})
        self.rank, self.world_size = rank, world_size
        self.device = torch.device(device)
        if self.device.type == "cpu":
            # Ranks share the host's cores: one rank per core-share keeps them from oversubscribing it.
            torch.set_num_threads(max(1, (os.cpu_count() or 1) // world_size))
        self.runner = None
        self.seqs: dict[int, Sequence] = {}  # by slot
        self.generators: dict[str, torch.Generator] = {}  # seeded requests, kept across preemption

    # ---- setup -------------------------------------------------------------------------------------
    def node_ip(self) -> str:
        import ray

        return ray.util.get_node_ip_address()

    def free_port(self) -> int:
        """A free TCP port on this host for the process group's rendezvous (rank 0 listens on it)."""
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
            s.bind(("", 0))
            return s.getsockname()[1]

    def init(self, master_addr: str, master_port: int, max_model_len: int) -> dict[str, Any]:
        """Join the process group, load this rank's shard, build its KV cache; report what the driver plans with."""
        from diffkv_serve.engine.loader import load_checkpoint
        from diffkv_serve.engine.model_runner import ModelRunner
        from diffkv_serve.engine.parallel import ParallelContext

        if self.device.type == "cuda":
            torch.cuda.set_device(self.device)  # before NCCL binds its communicator to the current device
        if self.world_size > 1:
            import torch.distributed as dist

            backend = "nccl" if self.device.type == "cuda" else "gloo"
            kw = {"device_id": self.device} if backend == "nccl" else {}
            dist.init_process_group(backend, init_method=f"tcp://{master_addr}:{master_port}", rank=self.rank,
                                    world_size=self.world_size, timeout=COLLECTIVE_TIMEOUT, **kw)
        ckpt = load_checkpoint(self.config.model, lazy=True)  # HF folders: one tensor in host memory at a time
        pc = ParallelContext(self.rank, self.world_size)
        self.runner = ModelRunner(self.config, ckpt.arch, ckpt.weights, max_model_len, pc, model_name=ckpt.name)
        del ckpt
        if self.world_size > 1:  # every rank is ready; NCCL builds its communicator here, not in a graph capture
            pc.all_reduce(torch.zeros(1, device=self.device))
        mm = self.runner.mm
        return {"rank": self.rank, "arch": self.runner.arch.model_dump(mode="json"), **mm.page_rules(),
                "device": str(self.device), "dtype": str(self.runner.dtype),
                "key_centering": self.runner.key_centering,
                "gpu": torch.cuda.get_device_name(self.device) if self.device.type == "cuda" else "cpu"}

    # ---- per step ----------------------------------------------------------------------------------
    def step(self, req: StepRequest) -> StepReport:
        from diffkv_serve.engine.model_runner import Batch

        self._release(req.frees, req.forget, req.evict)
        if req.is_prefill:
            seqs = [self._adopt(n) for n in req.new]
        else:
            seqs = []
            for slot, tok, cached in zip(req.slots, req.tokens, req.num_cached):
                s = self.seqs[slot]
                if s.num_cached != cached:
                    raise RuntimeError(f"rank {self.rank}: slot {slot} ({s.request_id}) has {s.num_cached} cached "
                                       f"tokens, the driver says {cached}")
                s.output_token_ids.append(tok)
                seqs.append(s)
        sampler = self.rank == 0
        agree_before = [len(s.teacher_agree) for s in seqs]
        batch = Batch(req.is_prefill, seqs, token_masks=req.token_masks)
        tokens, logprobs = self.runner.execute(batch, sample_tokens=sampler)
        report = self._report([s.slot for s in seqs])
        report.overflowed = batch.overflowed
        if sampler:
            report.tokens, report.logprobs = tokens, logprobs
            report.teacher_agree = [s.teacher_agree[-1] if len(s.teacher_agree) > n else None
                                    for s, n in zip(seqs, agree_before)]
        return report

    def prompt_logits(self, frees: list[int], forget: list[str], slot: int,
                      prompt_token_ids: list[int], evict: Optional[list[int]] = None) -> Optional[torch.Tensor]:
        """Logits after a prompt through a temporary slot (freed again); rank 0 returns them."""
        from diffkv_serve.engine.model_runner import Batch

        self._release(frees, forget, evict)
        seq = self._adopt(NewSequence("__logits__", slot, list(prompt_token_ids), [],
                                      SamplingParams(temperature=0, max_tokens=1), None))
        try:
            self.runner.execute(Batch(True, [seq]), keep_logits=True, sample_tokens=False)
            return self.runner.last_logits[0].cpu() if self.rank == 0 else None
        finally:
            self._release([slot], [])

    def sync(self, frees: list[int], forget: list[str], evict: Optional[list[int]] = None) -> StepReport:
        """Apply pending frees (and prefix-cache evictions) outside a step and report the free pages."""
        self._release(frees, forget, evict)
        return self._report([])

    def check_invariants(self, live_slots: Optional[list[int]], refcounts: Optional[dict[int, int]] = None) -> int:
        """Every page free exactly once or held once (and, given live_slots, exactly those slots in use; given
        the driver's prefix-block refcounts, the same blocks cached and read as often); returns the free pages."""
        self.runner.mm.check_invariants(live_slots=live_slots, refcounts=refcounts)
        if live_slots is not None:
            assert sorted(self.seqs) == sorted(live_slots), f"rank {self.rank} tracks slots {sorted(self.seqs)}"
        return self.runner.mm.free_pages()

    def ping(self) -> int:
        return self.rank

    # ---- helpers ---------------------------------------------------------------------------------------
    def _adopt(self, n: NewSequence) -> Sequence:
        slot = self.runner.mm.alloc_slot()
        if slot != n.slot:
            raise RuntimeError(f"rank {self.rank}: slot order diverged from the driver's "
                               f"(took {slot}, driver chose {n.slot} for {n.request_id})")
        gen = None
        if n.params.seed is not None and self.rank == 0:
            gen = self.generators.get(n.request_id)
            if gen is None:
                gen = torch.Generator(device=self.runner.device).manual_seed(n.params.seed)
                self.generators[n.request_id] = gen
        seq = Sequence(n.request_id, list(n.prompt_token_ids), n.params, None, generator=gen)
        seq.output_token_ids = list(n.output_token_ids)
        seq.kv_settings = n.kv_settings
        seq.prefix_hits, seq.prefix_inserts = list(n.prefix_hits), list(n.prefix_inserts)
        seq.slot = slot
        self.seqs[slot] = seq
        return seq

    def _release(self, slots: list[int], forget: list[str], evict: Optional[list[int]] = None) -> None:
        if slots:
            self.runner.mm.free(slots)
            for slot in slots:
                self.seqs.pop(slot, None)
        if evict:
            self.runner.mm.evict_blocks(evict)
        for rid in forget:
            self.generators.pop(rid, None)

    def _report(self, slots: list[int]) -> StepReport:
        mm = self.runner.mm
        s = torch.tensor(slots, dtype=torch.int64, device=mm.device)
        held = (mm.held_high[s] + mm.held_low[s]).sum((1, 2), dtype=torch.int64)
        free = (mm.counters[1:] - mm.counters[:1]).to(torch.int64)  # same as mm.free_pages(), in the same read
        flat = torch.cat([held, mm.len_high[s].sum((1, 2), dtype=torch.int64),
                          mm.len_low[s].sum((1, 2), dtype=torch.int64), mm.decode_growth(s), free]).tolist()
        n = len(slots)  # one device read
        flat[:n] = [h - mm.shared_cols[x] * mm.heads_per_seq for h, x in zip(flat[:n], slots)]  # own pages only
        return StepReport(self.rank, flat[-1], flat[:n], flat[n:2 * n], flat[2 * n:3 * n], self.runner.kv.mm_seconds(),
                          growth=flat[3 * n:4 * n])
