"""LLMEngine: requests in, token-by-token outputs out (no Ray, no HTTP)."""
from __future__ import annotations

import copy
import logging
import time
from typing import Any, Optional, Union

import torch

from diffkv_serve.engine import kv_rotation
from diffkv_serve.engine.config import EngineConfig
from diffkv_serve.engine.errors import EngineDeadError, InvalidRequestError
from diffkv_serve.engine.executor import Executor, make_executor
from diffkv_serve.engine.grammar import compiler_for
from diffkv_serve.engine.kv.prefix_cache import PrefixCache
from diffkv_serve.engine.kv.request_settings import resolve as resolve_kv_settings
from diffkv_serve.engine.logprobs import StepLogprobs
from diffkv_serve.engine.model_runner import Batch, InFlight
from diffkv_serve.engine.loader import LoadedCheckpoint, load_checkpoint
from diffkv_serve.engine.model_settings import apply_model_settings
from diffkv_serve.engine.parallel import check_tensor_parallel
from diffkv_serve.engine.sampling_params import SamplingParams
from diffkv_serve.engine.scheduler import Scheduler
from diffkv_serve.engine.sequence import RequestOutput, Sequence, Status
from diffkv_serve.engine.tokenizer import IncrementalDetokenizer

log = logging.getLogger(__name__)


class LLMEngine:
    def __init__(self, config: Optional[EngineConfig] = None, checkpoint: Optional[LoadedCheckpoint] = None,
                 **overrides: Any):
        if config is None:
            config = EngineConfig(**overrides)
        elif overrides:
            config = config.model_copy(update=overrides)
        self.config = config
        # Ray ranks load the weights themselves: the driver only needs the architecture and the tokenizer.
        local = config.executor_kind == "local"
        ckpt = checkpoint if checkpoint is not None else load_checkpoint(config.model, with_weights=local)
        check_tensor_parallel(ckpt.arch, config.tensor_parallel_size)
        self.config = config = apply_model_settings(config, ckpt.name)  # calibrated alphas unless set
        config.cache.check_num_layers(ckpt.arch.num_layers)
        self.arch = ckpt.arch
        self.tokenizer = ckpt.tokenizer
        self.model_name = ckpt.name
        self.max_model_len = min(config.max_model_len or ckpt.arch.max_position_embeddings,
                                 ckpt.arch.max_position_embeddings)
        self.executor: Executor = make_executor(config, ckpt, self.max_model_len)
        self.runner = getattr(self.executor, "runner", None)  # the in-process ModelRunner (local executor)
        self.mm = self.executor.mm
        prefix_cache = None
        if config.cache.prefix_caching():
            prefix_cache = PrefixCache(self.mm.prefix_block_tokens, self.mm.max_prefix_blocks)
        self.scheduler = Scheduler(config.scheduler, self.mm, prefix_cache)
        self.requests: dict[str, Sequence] = {}  # by sequence id (a request of n > 1 has n)
        self._groups: dict[str, list[Sequence]] = {}  # requests of n > 1 sequences: their sequences by index
        self._held: dict[str, list[Sequence]] = {}  # sequences waiting for sequence 0's prefill (prefix cache)
        self._last_step_time = 0.0
        self._pending: Optional[InFlight] = None  # async scheduling: the launched decode step not yet read
        self._num_generated = 0
        self._dead: Optional[str] = None  # why the engine cannot serve any more
        self._shut_down = False

    # ---- requests ------------------------------------------------------------------------------------
    def add_request(self, request_id: str, prompt: Union[str, list[int], None] = None,
                    sampling: Optional[SamplingParams] = None, prompt_token_ids: Optional[list[int]] = None,
                    arrival_time: Optional[float] = None, kv_compression: Optional[dict] = None) -> None:
        """Queue a request. Bad input raises InvalidRequestError (naming the field) and changes nothing;
        a dead or shut-down engine raises EngineDeadError."""
        self._check_alive()
        sampling = sampling or SamplingParams()
        if request_id in self.requests or request_id in self._groups:
            raise InvalidRequestError(f"request id {request_id!r} is already in use", "request_id")
        if prompt_token_ids is None:
            if isinstance(prompt, str):
                prompt_token_ids = self.tokenizer.encode(prompt) if prompt else []
            elif isinstance(prompt, list):
                prompt_token_ids = prompt
            else:
                raise InvalidRequestError("prompt must be a string or a list of token ids", "prompt")
        ids = list(prompt_token_ids)
        if not ids:
            raise InvalidRequestError("prompt is empty", "prompt")
        V = self.arch.vocab_size
        if any(not isinstance(t, int) or not 0 <= t < V for t in ids):
            raise InvalidRequestError(f"prompt token ids must be integers in [0, {V})", "prompt")
        if len(ids) >= self.max_model_len:
            raise InvalidRequestError(
                f"prompt has {len(ids)} tokens; this model's context is {self.max_model_len} tokens, "
                "which must also leave room for at least one generated token", "prompt")
        if self.mm.pages_for_tokens(len(ids) + 1) > self.mm.num_pages:
            raise InvalidRequestError(
                f"prompt of {len(ids)} tokens needs more KV pages than the whole cache holds "
                f"({self.mm.num_pages}); raise the KV cache size", "prompt")
        sampling.check_vocab(V)
        if sampling.min_tokens and not sampling.ignore_eos:
            sampling = copy.copy(sampling)  # the caller's object may serve other requests (other tokenizers)
            sampling.eos_token_ids = tuple(self.tokenizer.eos_token_ids)
        kv_settings = resolve_kv_settings(kv_compression, self.config.cache)
        # compiled once, here: a bad schema changes nothing; each of n sequences gets its own matcher
        grammar = None
        if sampling.structured_outputs is not None:
            grammar = compiler_for(self.tokenizer, self.arch.vocab_size).matcher(sampling.structured_outputs)
        arrival_time = arrival_time or time.monotonic()
        if sampling.n == 1:
            self.scheduler.add(self._new_sequence(request_id, ids, sampling, kv_settings, arrival_time,
                                                  grammar=grammar))
            return
        # n sequences: ids "<request_id>[i]", outputs under request_id with their index. With a prefix cache,
        # sequences 1.. wait until sequence 0's prefill ran: they then read its cached prompt blocks instead of
        # computing them.
        seqs = [self._new_sequence(f"{request_id}[{i}]", ids, sampling.for_sample(i), kv_settings, arrival_time,
                                   group=(request_id, i),
                                   grammar=None if grammar is None else grammar if i == 0 else grammar.deep_copy())
                for i in range(sampling.n)]
        self._groups[request_id] = seqs
        held = seqs[1:] if self.scheduler.prefix_cache is not None else []
        if held:
            self._held[request_id] = held
        for seq in seqs:
            if seq not in held:
                self.scheduler.add(seq)

    def _new_sequence(self, seq_id: str, ids: list[int], sampling: SamplingParams, kv_settings, arrival_time: float,
                      group: Optional[tuple[str, int]] = None, grammar=None) -> Sequence:
        gen = None
        if sampling.seed is not None:
            gen = self.executor.make_generator(sampling.seed)
        seq = Sequence(seq_id, ids, sampling,
                       IncrementalDetokenizer(self.tokenizer, skip_special_tokens=sampling.skip_special_tokens),
                       generator=gen, arrival_time=arrival_time)
        seq.kv_settings, seq.grammar = kv_settings, grammar
        if group is not None:
            seq.group_id, seq.index = group
        self.requests[seq_id] = seq
        return seq

    def _release_held(self, group_id: str) -> None:
        """Sequence 0 of an n-sequence request has run its prefill (or ended): queue its siblings."""
        for seq in self._held.pop(group_id, ()):
            if not seq.finished:
                self.scheduler.add(seq)

    def sequences(self, request_id: str) -> list[Sequence]:
        """The unfinished sequences of a request (n of them for SamplingParams.n = n, else one)."""
        if request_id in self._groups:
            return [s for s in self._groups[request_id] if not s.finished]
        seq = self.requests.get(request_id)
        return [seq] if seq is not None else []

    def abort(self, request_id: str) -> bool:
        """Stop a request (all its n sequences) or one sequence ("<request_id>[i]") and free its pages.
        Returns False if it is unknown or already finished."""
        seqs = self.sequences(request_id)
        for seq in seqs:
            self.requests.pop(seq.request_id, None)
            self.scheduler.remove(seq)
            self.executor.finish_request(seq.request_id)
            seq.status, seq.finish_reason = Status.FINISHED, "abort"
            self._forget_group(seq)
        return bool(seqs)

    def _forget_group(self, seq: Sequence) -> None:
        """A sequence ended: its held siblings may go, and a request whose n sequences all ended is dropped."""
        gid = seq.group_id
        if gid is None:
            return
        self._release_held(gid)
        if all(s.finished for s in self._groups.get(gid, ())):
            self._groups.pop(gid, None)

    def has_unfinished_requests(self) -> bool:
        """Requests waiting or running, or a launched step still to be read (async scheduling)."""
        return self.scheduler.has_work() or self._pending is not None

    # ---- one step ------------------------------------------------------------------------------------
    def step(self) -> list[RequestOutput]:
        """One scheduler step. A worker lost or failing raises EngineDeadError (the engine is then dead).

        Async scheduling (executor.async_steps): a decode step is launched before the previous one's tokens are
        read, so the returned outputs are the previous step's while the GPU already runs this one. Sequences
        that stop at step N (EOS, stop strings, max_tokens) were already scheduled into N + 1: that row is
        computed and dropped, and their pages go back after it (frees are stream-ordered). Prefills, stuck
        sequences and teacher-forced rows run synchronously, after the step in flight is read."""
        self._check_alive()
        t0 = time.perf_counter()
        batch, stuck = self.scheduler.schedule()
        pending, self._pending = self._pending, None
        # Teacher-forced rows, top-k logprobs (copied to the host after the step) and grammar rows (the next
        # mask needs this token) run synchronously.
        pipelined = (batch is not None and not batch.is_prefill and not stuck and self.executor.async_steps
                     and not any(s.params.teacher_tokens is not None or s.params.logprobs or s.grammar is not None
                                 for s in batch.seqs))
        outputs: list[RequestOutput] = []
        try:
            if pipelined:
                self._pending = self.executor.launch(batch)
                _count_rows(batch, +1)
            if pending is not None:
                try:
                    result = self.executor.collect(pending)
                finally:
                    _count_rows(pending.batch, -1)
                outputs += self._process(pending.batch, *result)
        except EngineDeadError as e:
            self._drop_pending()
            self._die(str(e))
            raise
        except BaseException:
            self._drop_pending()
            raise
        if not pipelined:
            outputs += self._step_sync(batch, stuck, after_collect=pending is not None)
        self._last_step_time = time.perf_counter() - t0
        return outputs

    def _drop_pending(self) -> None:
        if self._pending is not None:
            _count_rows(self._pending.batch, -1)
            self._pending = None

    def _step_sync(self, batch: Optional[Batch], stuck: list[Sequence], after_collect: bool) -> list[RequestOutput]:
        """Run a scheduled batch to its tokens. after_collect: the step in flight was read after this batch was
        scheduled, so sequences it finished leave the batch first."""
        outputs: list[RequestOutput] = []
        for seq in stuck:
            if seq.finished:  # stopped by the step just read
                continue
            log.warning("request %s exceeds the KV cache; finishing it with 'length'", seq.request_id)
            self._finish(seq, "length")
            outputs.append(self.output(seq))
        if batch is not None and after_collect and not batch.is_prefill:
            batch.seqs = [s for s in batch.seqs if not s.finished]
        if batch is None or not batch.seqs:
            return outputs
        try:
            tokens, logprobs = self.executor.execute(batch)
        except EngineDeadError as e:
            self._die(str(e))
            raise
        if batch.is_prefill:
            self.scheduler.after_prefill(batch)  # before settle_prefill may release a sequence
        redo = self.scheduler.settle_prefill(batch) if batch.is_prefill else set()
        return outputs + self._process(batch, tokens, logprobs, redo)

    def _process(self, batch: Batch, tokens: list[int], logprobs: Optional[StepLogprobs],
                 redo: frozenset[int] | set[int] = frozenset()) -> list[RequestOutput]:
        """Append each row's token, check stops, make outputs. Rows of finished sequences are skipped (async
        scheduling ran them one step past their stop, or they were aborted while the step was in flight)."""
        outputs: list[RequestOutput] = []
        now = time.monotonic()
        for i, (seq, tok) in enumerate(zip(batch.seqs, tokens)):
            if i in redo or seq.finished:  # redo: its prompt did not fit the pool: queued again, no token
                continue
            seq.output_token_ids.append(tok)
            if seq.group_id in self._held:
                self._release_held(seq.group_id)  # its prefill ran: the prompt's blocks are cached now
            if seq.grammar is not None and not seq.grammar.consume_token(tok):
                log.warning("request %s: token %d breaks its grammar (%s)", seq.request_id, tok,
                            seq.grammar.get_error())
            if logprobs is not None:
                self._record_logprobs(seq, logprobs, i)
            if seq.first_token_time is None:
                seq.first_token_time = now
            self._num_generated += 1
            self._append_text(seq, tok)
            reason = self._stop_reason(seq, tok)
            if reason is not None:
                self._finish(seq, reason)
            outputs.append(self.output(seq))
        return outputs

    @staticmethod
    def _record_logprobs(seq: Sequence, logprobs: StepLogprobs, row: int) -> None:
        k = seq.params.logprobs
        if k is not None and logprobs.chosen is not None:
            seq.output_logprobs.append(logprobs.chosen[row])
            if k > 0 and logprobs.top is not None:
                seq.output_top_logprobs.append(logprobs.top[row])
        if row in logprobs.prompt and seq.prompt_logprobs is None:
            seq.prompt_logprobs = logprobs.prompt[row]

    def _append_text(self, seq: Sequence, tok: int) -> None:
        # Only recorded: the text is worked out when read (stop strings below, or an output's text).
        if seq.finish_reason is None:
            seq.detokenizer.push(tok)

    def _stop_reason(self, seq: Sequence, tok: int) -> Optional[str]:
        p = seq.params
        if len(seq.output_token_ids) < p.min_tokens:  # no stop of any kind before min_tokens (vLLM's rule)
            return "length" if seq.num_tokens >= self.max_model_len else None
        if not p.ignore_eos and tok in self.tokenizer.eos_token_ids:
            return "stop"
        if tok in p.stop_token_ids:
            return "stop"
        if seq.grammar is not None and seq.grammar.is_stopped():  # complete: nothing may follow
            return "stop"
        if p.stop:
            # Only the tail can hold a new match: the new text plus the longest stop string.
            text = seq.text  # detokenized up to this token
            window = max(map(len, p.stop)) + 16
            start = max(0, len(text) - window)
            hits = [(text.find(s, start), s) for s in p.stop]
            hits = [(i, s) for i, s in hits if i >= 0]
            if hits:
                i, s = min(hits)
                seq.text = text[: i + len(s)] if p.include_stop_str_in_output else text[:i]
                return "stop"
        if len(seq.output_token_ids) >= p.max_tokens or seq.num_tokens >= self.max_model_len:
            return "length"
        return None

    def _finish(self, seq: Sequence, reason: str) -> None:
        if seq.slot is not None:
            seq.kv_usage = self.kv_usage(seq)
            if self.config.cache.record_pruning:
                seq.kv_usage["token_classes"] = self._token_classes(seq)
            self.scheduler.observe_finish(seq, seq.kv_usage["pages_used"])
        seq.status, seq.finish_reason, seq.finish_time = Status.FINISHED, reason, time.monotonic()
        self.scheduler.remove(seq)
        self.requests.pop(seq.request_id, None)
        self.executor.finish_request(seq.request_id)
        self._forget_group(seq)

    def output(self, seq: Sequence) -> RequestOutput:
        """What is new for this request since its last output (and everything so far). Token lists and text
        are cut from the sequence when the output's fields are first read."""
        n_before, seq.emitted_tokens = seq.emitted_tokens, len(seq.output_token_ids)
        if not seq.params.stop:
            start, seq.emitted_text_tokens = seq.emitted_text_tokens, len(seq.detokenizer.ids)
            return RequestOutput.snapshot(seq, n_before, None, start, seq.emitted_text_tokens)
        # Stop strings: the text is kept up to date (_stop_reason reads it every step), and while running a tail
        # that could still become a stop string is held back, so it is never streamed.
        text = seq.text
        hold = 0 if seq.finished else max(map(len, seq.params.stop)) - 1
        visible = max(seq.emitted_chars, len(text) - hold)
        start, seq.emitted_chars = seq.emitted_chars, visible
        return RequestOutput.snapshot(seq, n_before, text, start, visible)

    def kv_usage(self, seq: Sequence) -> dict[str, int]:
        """KV memory one running sequence holds now (one device read). pages_used / bytes_used: the pages it
        owns; pages_shared: prefix-cache pages it reads without owning them (not in pages_used). bytes_fp16:
        its tokens in a 16-bit cache; bytes_uncompressed: in an uncompressed cache of cache_dtype (what fp16
        mode really takes: twice bytes_fp16 on CPU, where the cache is float32)."""
        pages, hi, lo = self.executor.slot_usage(seq.slot, seq.num_cached)  # summed over ranks
        heads = self._heads_per_seq()
        shared = len(seq.prefix_refs) * heads  # a block: one page per head
        return {"pages_used": pages, "bytes_used": pages * self.mm.page_bytes, "pages_shared": shared,
                "bytes_fp16": seq.num_cached * self._fp16_token_bytes(),
                "bytes_uncompressed": seq.num_cached * self._fp16_token_bytes(self.cache_itemsize),
                "tokens": seq.num_cached, "tokens_high": hi, "tokens_low": lo,
                "tokens_pruned": seq.num_cached * heads - hi - lo}

    def token_classes(self, request_id: str) -> torch.Tensor:
        """Debug / evaluation: where each cached token position of a running request lives now, per (layer, KV
        head): int8 [L, H, tokens] on the CPU, engine.kv.policy.KEPT_HIGH / KEPT_LOW / PRUNED (one device read;
        local executor). With CacheConfig.record_pruning a finished request's kv_usage["token_classes"] holds
        the same at its finish."""
        seq = self.requests.get(request_id)
        if seq is None or seq.slot is None:
            raise KeyError(f"request {request_id!r} is not running")
        return self._token_classes(seq)

    def _token_classes(self, seq: Sequence) -> torch.Tensor:
        return self.executor.token_classes(seq.slot, seq.num_cached).cpu()

    @property
    def cache_dtype(self) -> str:
        """dtype of the cache's unquantized values (fp16 mode, 16-bit sections): the model's, float32 on CPU
        and bfloat16 on CUDA unless EngineConfig.dtype says otherwise."""
        runner = getattr(self.executor, "runner", None)
        dtype = runner.dtype if runner is not None else self.executor.dtype  # Ray ranks report theirs
        return str(dtype).removeprefix("torch.")

    @property
    def cache_itemsize(self) -> int:
        return getattr(torch, self.cache_dtype).itemsize

    def _heads_per_seq(self) -> int:
        """(layer, KV head) pairs of one sequence over all ranks."""
        return self.arch.num_layers * self.arch.num_kv_heads

    def _fp16_token_bytes(self, itemsize: int = 2) -> int:
        """What one token costs in an uncompressed cache across all layers and KV heads (K and V), 16-bit unless
        `itemsize` says otherwise."""
        return 2 * itemsize * self.arch.head_dim * self._heads_per_seq()

    def prompt_logits(self, prompt_token_ids: list[int]) -> torch.Tensor:
        """Next-token logits [V] after a prompt, through the same cache and kernels as serving (tests, eval)."""
        self._check_alive()
        try:
            return self.executor.prompt_logits(prompt_token_ids)
        except EngineDeadError as e:
            self._die(str(e))
            raise

    # ---- stats -----------------------------------------------------------------------------------------
    def stats(self) -> dict[str, Any]:
        """Totals over the tensor-parallel ranks (pages and tokens summed, memory-management time the
        slowest rank's) and each rank's own pages under "ranks"."""
        ranks = self.executor.rank_stats()
        page_bytes = self.mm.page_bytes
        used = sum(r["pages_used"] for r in ranks)
        running = self.scheduler.running
        cached = sum(s.num_cached for s in running)
        bytes_fp16 = cached * self._fp16_token_bytes()
        tokens = self.executor.token_counts([s.slot for s in running if s.slot is not None], cached)
        # What the running sequences hold: their own pages and the cached prefix blocks they read (one page per
        # layer and KV head each); cached blocks nobody reads are the prefix cache's, not the requests'.
        pc = self.scheduler.prefix_cache
        read_blocks = sum(1 for n in pc.refcounts().values() if n) if pc is not None else 0
        pages_running = tokens["pages_held"] + read_blocks * self._heads_per_seq()
        return {
            "kv_mode": self.config.cache.resolved_mode,
            "key_centering": self.executor.key_centering,
            "kv_rotation": kv_rotation.resolve_mode(self.config.cache),
            "cache_dtype": self.cache_dtype,
            "num_running": len(running),
            "num_waiting": len(self.scheduler.waiting),
            "num_preemptions": self.scheduler.num_preemptions,
            "reservation": self._reservation_stats(),
            "num_generated_tokens": self._num_generated,
            **self._prefix_cache_stats(),
            "pages_total": sum(r["pages_total"] for r in ranks),
            "pages_used": used,
            "page_bytes": page_bytes,
            "bytes_used": used * page_bytes,
            "bytes_fp16": bytes_fp16,
            "pages_running": pages_running,
            # fp16 bytes of the running sequences' tokens over the bytes of the pages they hold (partly filled
            # pages included; idle prefix-cache pages excluded)
            "compression_ratio": (bytes_fp16 / (pages_running * page_bytes)) if pages_running else None,
            "cached_tokens": cached,
            **tokens,
            "last_step_seconds": self._last_step_time,
            "last_mm_seconds": max(r["last_mm_seconds"] for r in ranks),
            "tensor_parallel_size": self.config.tensor_parallel_size,
            "ranks": ranks,
        }

    def _prefix_cache_stats(self) -> dict[str, Any]:
        """Prompt tokens looked up in / found in the prefix cache (admitted prompts), and what it holds."""
        pc = self.scheduler.prefix_cache
        blocks = pc.num_cached if pc is not None else 0
        return {"prefix_cache_enabled": pc is not None,
                "prefix_cache_queries": pc.queries if pc is not None else 0,
                "prefix_cache_hits": pc.hits if pc is not None else 0,
                "prefill_tokens_computed": self.scheduler.num_prefill_computed,
                "prefix_cache_blocks": blocks,
                "prefix_cache_pages": blocks * self._heads_per_seq()}  # one page per layer and KV head, all ranks

    def reset_prefix_cache(self) -> int:
        """Evict every cached prefix block no running request reads (their pages go back to the free list);
        returns how many blocks went."""
        return self.scheduler.reset_prefix_cache()

    def _reservation_stats(self) -> dict[str, Any]:
        """The prompt reservation rule, prefills redone because their pages did not fit, and the learned estimates."""
        sch = self.scheduler
        out = {"mode": self.config.scheduler.reservation, "overflows": sch.num_overflows}
        if sch.footprint is not None:
            out.update(sch.footprint.summary())
        return out

    # ---- health and lifecycle ----------------------------------------------------------------------------
    def is_healthy(self) -> bool:
        """False once a worker was lost or a step failed on one, and after shutdown()."""
        return self._dead is None

    def check_health(self) -> None:
        """Raise EngineDeadError if the engine is dead or a worker is gone (pings Ray workers)."""
        self._check_alive()
        try:
            self.executor.check_health()
        except EngineDeadError as e:
            self._die(str(e))
            raise

    def shutdown(self) -> None:
        """Abort every request (their pages go back) and release the workers (idempotent). The engine
        serves nothing afterwards."""
        if self._shut_down:
            return
        self._shut_down = True
        for rid in list(self.requests):
            self.abort(rid)
        self._drop_pending()  # async scheduling: every row of a step in flight belongs to an aborted request
        self.executor.shutdown()
        if self._dead is None:
            self._dead = "the engine was shut down"

    def close(self) -> None:
        """shutdown(), then let go of the executor (model, page pool, CUDA graphs), so their device memory is
        free once garbage is collected even while something still refers to this engine: a later engine in the
        same process sizes its pool under gpu_memory_utilization by what is free when it starts."""
        self.shutdown()
        self.executor = self.runner = self.mm = self.scheduler = None

    def _check_alive(self) -> None:
        if self._dead is not None:
            raise EngineDeadError(f"engine is not serving: {self._dead}")

    def _die(self, reason: str) -> None:
        """A rank is lost: nothing can run any more. Release the remaining workers at once (they may be
        blocked in a collective) so the owner can start a replacement; requests stay for the owner to fail."""
        if self._dead is None:
            self._dead = reason
            log.error("engine is dead: %s", reason)
        try:
            self.executor.shutdown()
        except Exception:  # pragma: no cover - releasing must not hide the original error
            log.exception("releasing the workers of a dead engine failed")


def _count_rows(batch: Batch, delta: int) -> None:
    """Rows in flight per sequence (Sequence.rows_in_flight): +1 when a decode step is launched, -1 once read."""
    for s in batch.seqs:
        s.rows_in_flight += delta
