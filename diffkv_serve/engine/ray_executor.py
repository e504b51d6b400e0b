"""RayExecutor: one Ray actor per tensor-parallel rank (engine.worker.Worker), in a placement group.

Placement: inside a placement group already (a Ray Serve replica deployed with placement_group_bundles:
bundle 0 is the replica's, bundles 1..N its ranks'), the ranks go into that group's bundles 1..N with the
resources those bundles name. Otherwise the executor reserves its own group, one bundle per rank
({"GPU": 1} on CUDA, a fraction of a CPU otherwise), packed on one host, and removes it at shutdown.

Each rank joins a torch.distributed group (NCCL on CUDA, gloo on CPU; rendezvous on a free TCP port of
rank 0's host, over loopback when all ranks share it) and loads its own shard of the checkpoint.

A step is one Ray call per rank, all in flight together. Results are awaited rank by rank as they finish,
so a rank that died or raised is seen at once even while the others stay blocked in a collective; then
every rank is killed (they cannot continue without it) and the step raises EngineDeadError.
"""
from __future__ import annotations

import logging
import os
import time
from typing import Any, Optional

import torch

from diffkv_serve.engine.config import EngineConfig
from diffkv_serve.engine.kv.distributed import DistributedPages
from diffkv_serve.engine.errors import EngineDeadError
from diffkv_serve.engine.executor import Executor
from diffkv_serve.engine.grammar import TokenMasks
from diffkv_serve.engine.loader import LoadedCheckpoint
from diffkv_serve.engine.model_config import ModelArch
from diffkv_serve.engine.model_runner import Batch
from diffkv_serve.engine.worker import WORKER_ENV, NewSequence, StepRequest, Worker

log = logging.getLogger(__name__)

CPU_PER_WORKER = 0.25  # a CPU rank's share of a core in its own placement group (TP=2 fits a 2-core box)
PLACEMENT_TIMEOUT_S = 120.0  # waiting longer for the group's resources means they will not come
HEALTH_TIMEOUT_S = 30.0
_PASS_ENV = ("DIFFKV_CACHE_DIR", "TRITON_INTERPRET", "TRITON_CACHE_DIR", "HF_HOME")  # the driver's, if set


class RayExecutor(Executor):
    def __init__(self, config: EngineConfig, ckpt: LoadedCheckpoint, max_model_len: int):
        import ray
        from ray.util.placement_group import get_current_placement_group
        from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

        os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
        if not ray.is_initialized():
            ray.init(include_dashboard=False)  # attaches to RAY_ADDRESS's cluster, else starts a local one
        self.world_size = n = config.tensor_parallel_size
        self.vocab_size = ckpt.arch.vocab_size
        self.workers: list = []
        self._own_pg = None
        self._closed = False
        self._seeded: set[str] = set()  # requests with a sampling generator on rank 0
        self._forget: list[str] = []
        try:
            current = get_current_placement_group()
            if current is not None:
                bundles, first, pg = self._bundles_of(current, n), 1, current
            else:
                bundles, first = [self._own_bundle(config, n)] * n, 0
                pg = self._reserve(bundles)
            use_gpu = self._use_gpu(config, bundles)
            device = "cuda:0" if use_gpu else "cpu"  # each rank sees only its own GPU (CUDA_VISIBLE_DEVICES)
            env = {**WORKER_ENV, **{k: os.environ[k] for k in _PASS_ENV if k in os.environ}}
            actor = ray.remote(Worker)
            for rank, bundle in enumerate(bundles):
                strategy = PlacementGroupSchedulingStrategy(placement_group=pg,
                                                            placement_group_bundle_index=first + rank)
                self.workers.append(actor.options(
                    num_cpus=bundle.get("CPU", 0), num_gpus=bundle.get("GPU", 0), max_restarts=0,
                    scheduling_strategy=strategy, runtime_env={"env_vars": env}).remote(config, rank, n, device))
            ips = self._gather([w.node_ip.remote() for w in self.workers], "starting")
            addr = "127.0.0.1" if len(set(ips)) == 1 else ips[0]
            port = self._gather([self.workers[0].free_port.remote()], "starting")[0]
            infos = self._gather([w.init.remote(addr, port, max_model_len) for w in self.workers],
                                 "loading its shard")
        except BaseException:
            self.shutdown()
            raise
        for info in infos:
            if ModelArch.model_validate(info["arch"]) != ckpt.arch:
                self.shutdown()
                raise ValueError(f"rank {info['rank']} loaded a different model than the driver's checkpoint "
                                 f"{ckpt.name!r}: pass the checkpoint's path as EngineConfig.model")
        self.devices = [info["gpu"] if info["gpu"] != "cpu" else info["device"] for info in infos]
        self.dtype = infos[0]["dtype"]
        self.key_centering = infos[0]["key_centering"]  # every rank resolves the same mode
        self.mm = DistributedPages(infos, self._check_ranks)
        self.learned = infos[0]["two_sided"] and config.scheduler.reservation == "learned"  # ModelRunner.learned
        log.info("%d tensor-parallel rank(s) on %s; pages per rank %s", n, self.devices, self.mm.pages_total)

    # ---- placement ---------------------------------------------------------------------------------
    @staticmethod
    def _bundles_of(pg, n: int) -> list[dict[str, float]]:
        specs = pg.bundle_specs
        if len(specs) < n + 1:
            raise ValueError(f"tensor_parallel_size={n}: this process runs in a placement group of {len(specs)} "
                             f"bundle(s); it needs {n + 1} (bundle 0 for the replica, 1..{n} for the ranks)")
        return [dict(specs[1 + r]) for r in range(n)]

    @staticmethod
    def _own_bundle(config: EngineConfig, n: int) -> dict[str, float]:
        import ray

        gpus = ray.cluster_resources().get("GPU", 0)
        if config.device == "cpu" or (config.device == "auto" and gpus < n):
            return {"CPU": CPU_PER_WORKER}
        if gpus < n:
            raise ValueError(f"tensor_parallel_size={n} needs {n} GPUs (one per rank); the Ray cluster has "
                             f"{gpus:g}")
        return {"GPU": 1}

    def _reserve(self, bundles: list[dict[str, float]]):
        import ray
        from ray.util.placement_group import placement_group

        # One host: the ranks rendezvous over its loopback and NCCL keeps to its NVLink.
        self._own_pg = pg = placement_group(bundles, strategy="STRICT_PACK")
        try:
            ray.get(pg.ready(), timeout=PLACEMENT_TIMEOUT_S)
        except ray.exceptions.GetTimeoutError:
            raise ValueError(f"tensor_parallel_size={len(bundles)}: could not reserve {bundles[0]} per rank on one "
                             f"host within {PLACEMENT_TIMEOUT_S:.0f}s (cluster: {ray.available_resources()})") from None
        return pg

    @staticmethod
    def _use_gpu(config: EngineConfig, bundles: list[dict[str, float]]) -> bool:
        has_gpu = all(b.get("GPU", 0) >= 1 for b in bundles)
        if config.device.startswith("cuda") and not has_gpu:
            raise ValueError(f"device={config.device!r} but the ranks' placement bundles {bundles} hold no GPU")
        return has_gpu and config.device != "cpu"

    # ---- calls to every rank -----------------------------------------------------------------------
    def _gather(self, refs: list, what: str, timeout: Optional[float] = None) -> list[Any]:
        """Results of one call per rank, taken as each rank finishes. The first rank to fail (or a timeout)
        kills every rank and raises EngineDeadError naming it, without waiting for ranks blocked on it."""
        import ray

        if self._closed:
            raise EngineDeadError("the tensor-parallel workers were released")
        rank_of = {ref: i for i, ref in enumerate(refs)}
        results: list[Any] = [None] * len(refs)
        pending = list(refs)
        deadline = None if timeout is None else time.monotonic() + timeout
        try:
            while pending:
                left = None if deadline is None else max(0.0, deadline - time.monotonic())
                ready, pending = ray.wait(pending, num_returns=1, timeout=left)
                if not ready:
                    late = sorted(rank_of[r] for r in pending)
                    raise EngineDeadError(f"tensor-parallel rank(s) {late} did not answer within {timeout:.0f}s "
                                          f"while {what}")
                results[rank_of[ready[0]]] = ray.get(ready[0])  # raises now if this rank died or raised
            return results
        except ray.exceptions.RayError as e:
            failed = next((rank_of[r] for r in refs if _failed(r)), None)
            kind = "died" if isinstance(e, ray.exceptions.RayActorError) else "failed"
            reason = (f"tensor-parallel rank {failed if failed is not None else '?'} of {self.world_size} {kind} "
                      f"while {what}: {_short(e)}")
            self.shutdown()
            raise EngineDeadError(reason) from e
        except EngineDeadError:
            self.shutdown()
            raise

    # ---- the executor interface -----------------------------------------------------------------------
    def execute(self, batch: Batch) -> tuple[list[int], Optional[list[float]]]:
        seqs = batch.seqs
        frees, forget = self.mm.take_pending(), self._take_forget()
        if batch.is_prefill:
            new = [NewSequence(s.request_id, s.slot, s.prompt_token_ids, list(s.output_token_ids), s.params,
                               s.kv_settings, s.prefix_hits, s.prefix_inserts)
                   for s in seqs]
            self._seeded.update(s.request_id for s in seqs if s.params.seed is not None)
            req = StepRequest(frees, forget, True, new=new)
        else:
            req = StepRequest(frees, forget, False, slots=[s.slot for s in seqs],
                              tokens=[s.output_token_ids[-1] if s.output_token_ids else s.prompt_token_ids[-1]
                                      for s in seqs],
                              num_cached=[s.num_cached for s in seqs])
        req.evict = self.mm.take_evictions()
        req.token_masks = TokenMasks.start(seqs, self.vocab_size)  # grammars live on the driver
        reports = self._gather([w.step.remote(req) for w in self.workers], "running a step")
        slots = [s.slot for s in seqs]
        for rep in reports:
            self.mm.update(rep.rank, slots, rep.free_pages, rep.held, rep.tokens_high, rep.tokens_low,
                           rep.mm_seconds, rep.growth)
        if batch.is_prefill and self.learned:
            # A prompt whose pages did not fit on any rank is redone on all (the scheduler frees its slot).
            # Rank 0 sampled it if it fit there: a seeded request's generator then drew once for nothing.
            batch.overflowed = sorted({i for rep in reports for i in rep.overflowed})
            batch.pages_kept = [max(per) for per in zip(*(rep.held for rep in reports))]
            batch.pages_total = [sum(per) for per in zip(*(rep.held for rep in reports))]
        lost = set(batch.overflowed)
        first = reports[0]
        for i, (seq, agree) in enumerate(zip(seqs, first.teacher_agree)):
            if agree is not None and i not in lost:
                seq.teacher_agree.append(agree)
        for i, s in enumerate(seqs):
            if i not in lost:
                s.num_cached = s.num_tokens if batch.is_prefill else s.num_cached + 1
        return first.tokens, first.logprobs

    def prompt_logits(self, prompt_token_ids: list[int]) -> torch.Tensor:
        slot = self.mm.alloc_slot()
        frees, forget = self.mm.take_pending(), self._take_forget()
        evict = self.mm.take_evictions()
        out = self._gather([w.prompt_logits.remote(frees, forget, slot, list(prompt_token_ids), evict)
                            for w in self.workers], "computing prompt logits")
        self.mm.release_unsent(slot)  # every rank freed it already
        return out[0]

    def slot_usage(self, slot: int, num_cached: int) -> tuple[int, int, int]:
        return self.mm.slot_usage(slot)  # the ranks' last reports, on the host

    def token_counts(self, slots: list[int], cached: int) -> dict[str, int]:
        return self.mm.token_counts(slots, cached)

    def rank_stats(self) -> list[dict[str, Any]]:
        return self.mm.rank_stats()

    def make_generator(self, seed: int) -> Optional[torch.Generator]:
        return None  # rank 0 seeds its own from SamplingParams.seed

    def finish_request(self, request_id: str) -> None:
        if request_id in self._seeded:
            self._seeded.discard(request_id)
            self._forget.append(request_id)

    def check_health(self) -> None:
        self._gather([w.ping.remote() for w in self.workers], "answering a health check", HEALTH_TIMEOUT_S)

    def shutdown(self) -> None:
        """Kill every rank and remove the placement group this executor made (idempotent)."""
        if self._closed:
            return
        self._closed = True
        import ray
        from ray.util.placement_group import remove_placement_group

        for w in self.workers:
            try:
                ray.kill(w, no_restart=True)
            except Exception:  # already gone
                pass
        self.workers = []
        if self._own_pg is not None:
            try:
                remove_placement_group(self._own_pg)
            except Exception:  # pragma: no cover - the cluster may be gone too
                log.exception("removing the placement group failed")
            self._own_pg = None

    # ---- helpers ---------------------------------------------------------------------------------------
    def _take_forget(self) -> list[str]:
        out, self._forget = self._forget, []
        return out

    def _check_ranks(self, live_slots: Optional[list[int]], refcounts: Optional[dict[int, int]] = None) -> list[int]:
        """Tests: pending frees (and evictions) reach the ranks, then each checks its memory manager; returns
        free pages."""
        frees, forget, evict = self.mm.take_pending(), self._take_forget(), self.mm.take_evictions()
        for rep in self._gather([w.sync.remote(frees, forget, evict) for w in self.workers], "applying frees"):
            self.mm.update(rep.rank, [], rep.free_pages, [], [], [])
        return self._gather([w.check_invariants.remote(live_slots, refcounts) for w in self.workers],
                            "checking invariants")


def _failed(ref) -> bool:
    import ray

    ready, _ = ray.wait([ref], timeout=0)
    if not ready:
        return False
    try:
        ray.get(ref)
    except ray.exceptions.RayError:
        return True
    return False


def _short(e: BaseException) -> str:
    """One line for a Ray error: the worker's own exception if it raised, else Ray's first line."""
    cause = getattr(e, "cause", None)
    if isinstance(cause, BaseException):
        e = cause
    text = str(e).strip().splitlines()
    return f"{type(e).__name__}: {text[0] if text else ''}"[:500]
