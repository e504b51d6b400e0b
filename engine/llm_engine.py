"""LLMEngine: requests in, token-by-token outputs out (no Ray, no HTTP)."""
from __future__ import annotations

import logging
import time
from typing import Any, Optional, Union

import torch

from engine.config import EngineConfig
from engine.errors import InvalidRequestError
from engine.loader import LoadedCheckpoint, load_checkpoint
from engine.model_settings import apply_model_settings
from engine.model_runner import ModelRunner
from engine.sampling_params import SamplingParams
from engine.scheduler import Scheduler
from engine.sequence import RequestOutput, Sequence, Status
from engine.tokenizer import IncrementalDetokenizer

log = logging.getLogger(__name__)


class LLMEngine:
    def __init__(self, config: Optional[EngineConfig] = None, checkpoint: Optional[LoadedCheckpoint] = None,
                 **overrides: Any):
        if config is None:
            config = EngineConfig(**overrides)
        elif overrides:
            config = config.model_copy(update=overrides)
        self.config = config
        ckpt = checkpoint if checkpoint is not None else load_checkpoint(config.model)
        self.config = config = apply_model_settings(config, ckpt.name)  # calibrated alphas unless set
        self.arch = ckpt.arch
        self.tokenizer = ckpt.tokenizer
        self.model_name = ckpt.name
        self.max_model_len = min(config.max_model_len or ckpt.arch.max_position_embeddings,
                                 ckpt.arch.max_position_embeddings)
        random = ckpt.weights is None
        self.runner = ModelRunner(config, ckpt.arch, None if random else ckpt.weights, self.max_model_len)
        self.mm = self.runner.mm
        self.scheduler = Scheduler(config.scheduler, self.mm)
        self.requests: dict[str, Sequence] = {}
        self._last_step_time = 0.0
        self._num_generated = 0

    # ---- requests ------------------------------------------------------------------------------------
    def add_request(self, request_id: str, prompt: Union[str, list[int], None] = None,
                    sampling: Optional[SamplingParams] = None, prompt_token_ids: Optional[list[int]] = None,
                    arrival_time: Optional[float] = None, kv_compression: Optional[dict] = None) -> None:
        """Queue a request. Bad input raises InvalidRequestError (naming the field) and changes nothing."""
        sampling = sampling or SamplingParams()
        if request_id in self.requests:
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
        alphas = self._check_kv_compression(kv_compression)
        gen = None
        if sampling.seed is not None:
            gen = torch.Generator(device=self.runner.device).manual_seed(sampling.seed)
        seq = Sequence(request_id, ids, sampling,
                       IncrementalDetokenizer(self.tokenizer, skip_special_tokens=sampling.skip_special_tokens),
                       generator=gen, arrival_time=arrival_time or time.monotonic())
        seq.alpha_high, seq.alpha_low = alphas
        self.requests[request_id] = seq
        self.scheduler.add(seq)

    def _check_kv_compression(self, kv: Optional[dict]) -> tuple[Optional[float], Optional[float]]:
        """Per-request DiffKV thresholds {"alpha_high", "alpha_low"}; both optional, both >= 0."""
        if not kv:
            return None, None
        if not isinstance(kv, dict) or set(kv) - {"alpha_high", "alpha_low"}:
            raise InvalidRequestError("kv_compression accepts only 'alpha_high' and 'alpha_low'", "kv_compression")
        cc = self.config.cache
        vals = []
        for name in ("alpha_high", "alpha_low"):
            v = kv.get(name)
            if v is not None and (isinstance(v, bool) or not isinstance(v, (int, float)) or not v >= 0):
                raise InvalidRequestError(f"kv_compression.{name} must be a number >= 0, got {v!r}",
                                          f"kv_compression.{name}")
            vals.append(None if v is None else float(v))
        ah = vals[0] if vals[0] is not None else cc.alpha_high
        al = vals[1] if vals[1] is not None else cc.alpha_low
        if al > ah:
            raise InvalidRequestError(f"kv_compression.alpha_low ({al}) must not exceed alpha_high ({ah})",
                                      "kv_compression.alpha_low")
        return vals[0], vals[1]

    def abort(self, request_id: str) -> bool:
        """Stop a request and free its pages. Returns False if it is unknown or already finished."""
        seq = self.requests.pop(request_id, None)
        if seq is None:
            return False
        self.scheduler.remove(seq)
        seq.status, seq.finish_reason = Status.FINISHED, "abort"
        return True

    def has_unfinished_requests(self) -> bool:
        return self.scheduler.has_work()

    # ---- one step ------------------------------------------------------------------------------------
    def step(self) -> list[RequestOutput]:
        t0 = time.perf_counter()
        batch, stuck = self.scheduler.schedule()
        outputs: list[RequestOutput] = []
        for seq in stuck:
            log.warning("request %s exceeds the KV cache; finishing it with 'length'", seq.request_id)
            self._finish(seq, "length")
            outputs.append(self.output(seq))
        if batch is None:
            return outputs
        tokens, logprobs = self.runner.execute(batch)
        now = time.monotonic()
        for i, (seq, tok) in enumerate(zip(batch.seqs, tokens)):
            seq.output_token_ids.append(tok)
            if logprobs is not None and seq.params.logprobs:
                seq.output_logprobs.append(logprobs[i])
            if seq.first_token_time is None:
                seq.first_token_time = now
            self._num_generated += 1
            self._append_text(seq, tok)
            reason = self._stop_reason(seq, tok)
            if reason is not None:
                self._finish(seq, reason)
            outputs.append(self.output(seq))
        self._last_step_time = time.perf_counter() - t0
        return outputs

    def _append_text(self, seq: Sequence, tok: int) -> None:
        if seq.finish_reason is None:
            seq.text += seq.detokenizer.add(tok)

    def _stop_reason(self, seq: Sequence, tok: int) -> Optional[str]:
        p = seq.params
        if not p.ignore_eos and tok in self.tokenizer.eos_token_ids:
            return "stop"
        if tok in p.stop_token_ids:
            return "stop"
        if p.stop:
            # Only the tail can hold a new match: the new text plus the longest stop string.
            window = max(map(len, p.stop)) + 16
            start = max(0, len(seq.text) - window)
            hits = [(seq.text.find(s, start), s) for s in p.stop]
            hits = [(i, s) for i, s in hits if i >= 0]
            if hits:
                i, s = min(hits)
                seq.text = seq.text[: i + len(s)] if p.include_stop_str_in_output else seq.text[:i]
                return "stop"
        if len(seq.output_token_ids) >= p.max_tokens or seq.num_tokens >= self.max_model_len:
            return "length"
        return None

    def _finish(self, seq: Sequence, reason: str) -> None:
        if seq.slot is not None:
            seq.kv_usage = self.kv_usage(seq)
        seq.status, seq.finish_reason, seq.finish_time = Status.FINISHED, reason, time.monotonic()
        self.scheduler.remove(seq)
        self.requests.pop(seq.request_id, None)

    def output(self, seq: Sequence) -> RequestOutput:
        """What is new for this request since its last output (and everything so far)."""
        # While running, hold back a tail that could still become a stop string, so it is never streamed.
        hold = 0 if seq.finished or not seq.params.stop else max(map(len, seq.params.stop)) - 1
        visible = max(seq.emitted_chars, len(seq.text) - hold)
        delta = seq.text[seq.emitted_chars: visible]
        new_ids = seq.output_token_ids[seq.emitted_tokens:]
        seq.emitted_chars, seq.emitted_tokens = visible, len(seq.output_token_ids)
        return RequestOutput(seq.request_id, seq.prompt_token_ids, list(seq.output_token_ids), seq.text[:visible],
                             new_ids, delta, seq.finished, seq.finish_reason,
                             list(seq.output_logprobs) if seq.params.logprobs else None,
                             seq.arrival_time, seq.first_token_time, seq.finish_time, seq.kv_usage,
                             list(seq.teacher_agree) if seq.params.teacher_tokens is not None else None)

    def kv_usage(self, seq: Sequence) -> dict[str, int]:
        """KV memory one running sequence holds now (one device read)."""
        mm = self.mm
        pages, hi, lo = torch.stack([(mm.held_high[seq.slot] + mm.held_low[seq.slot]).sum(),
                                     mm.len_high[seq.slot].sum(), mm.len_low[seq.slot].sum()]).tolist()
        return {"pages_used": pages, "bytes_used": pages * mm.page_bytes,
                "bytes_fp16": seq.num_cached * self._fp16_token_bytes(), "tokens": seq.num_cached,
                "tokens_high": hi, "tokens_low": lo, "tokens_pruned": seq.num_cached * mm.heads_per_seq - hi - lo}

    def _fp16_token_bytes(self) -> int:
        """What one token costs in an fp16 cache across all layers and KV heads (K and V)."""
        return 2 * 2 * self.arch.head_dim * self.mm.heads_per_seq

    def prompt_logits(self, prompt_token_ids: list[int]) -> torch.Tensor:
        """Next-token logits [V] after a prompt, through the same cache and kernels as serving (tests, eval)."""
        from engine.model_runner import Batch

        seq = Sequence("__logits__", list(prompt_token_ids), SamplingParams(temperature=0, max_tokens=1),
                       detokenizer=None)
        seq.slot = self.mm.alloc_slot()
        try:
            self.runner.execute(Batch(True, [seq]), keep_logits=True)
            return self.runner.last_logits[0].cpu()
        finally:
            self.mm.free([seq.slot])

    # ---- stats -----------------------------------------------------------------------------------------
    def stats(self) -> dict[str, Any]:
        mm = self.mm
        free = mm.free_pages()
        used = mm.num_pages - free
        running = self.scheduler.running
        cached = sum(s.num_cached for s in running)
        bytes_fp16 = cached * self._fp16_token_bytes()
        return {
            "kv_mode": self.config.cache.kv_mode,
            "num_running": len(running),
            "num_waiting": len(self.scheduler.waiting),
            "num_preemptions": self.scheduler.num_preemptions,
            "num_generated_tokens": self._num_generated,
            "pages_total": mm.num_pages,
            "pages_used": used,
            "page_bytes": mm.page_bytes,
            "bytes_used": used * mm.page_bytes,
            "bytes_fp16": bytes_fp16,
            "compression_ratio": (bytes_fp16 / (used * mm.page_bytes)) if used else None,
            "cached_tokens": cached,
            **self.runner.kv.token_counts([s.slot for s in running if s.slot is not None], cached),
            "last_step_seconds": self._last_step_time,
            "last_mm_seconds": self.runner.kv.mm_seconds(),
        }
