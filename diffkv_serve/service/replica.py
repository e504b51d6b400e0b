"""The engine deployment: one LLMEngine (and, with tensor parallelism, its worker actors) per Serve replica.

The ingress streams each request through `generate()`, which yields plain dicts:
    {"text": delta, "tokens": new token count, "finish_reason": None | "stop" | "length", "index": choice,
     "prompt_tokens": n, "completion_tokens": m (all choices), "done": all choices finished (on finishing
     items)[, "load": ReplicaLoad as dict on the last one]
     [, "logprobs": per new token {"token", "logprob", "top": [[token, logprob], ...]}]
     [, "prompt_text", "prompt_logprobs" (echo, each choice's first item: the prompt and its tokens' entries,
        the latter computed by choice 0 and sent with its item)]}
or one {"error": {"status", "message", "type", "param"}} (400 bad request, 503 engine dead). Cancelling the
stream (the client went away) cancels generate(), and AsyncLLMEngine aborts the request and frees its pages.

A dead engine (a worker actor lost) fails its in-flight requests with 503 and makes check_health() raise,
so Serve replaces the replica (a fresh engine, fresh workers, fresh placement group).
"""
from __future__ import annotations

import asyncio
import collections
import dataclasses
import json
import logging
import os
import signal
import time
from typing import Any, AsyncIterator, Optional

import ray
import torch

import diffkv_serve.engine.errors as engine_errors
from diffkv_serve.engine.async_engine import AsyncLLMEngine
from diffkv_serve.engine.errors import InvalidRequestError
from diffkv_serve.engine.sampling_params import SamplingParams
from diffkv_serve.service import replica_deaths, testing_hooks
from diffkv_serve.service.admission import ServiceMeter
from diffkv_serve.service.config import ServiceConfig, config_digest
from diffkv_serve.service.metrics import KV_MODE, REPLICA, Metrics

log = logging.getLogger("ray.serve")
MEMORY_SAMPLE_PERIOD_S = 2.0  # how stale the memory figures of a killed replica's death report may be


class _EngineDead(Exception):
    """Placeholder until engine.errors.EngineDeadError exists (then that class is used)."""


EngineDeadError = getattr(engine_errors, "EngineDeadError", _EngineDead)


def _error(status: int, message: str, type_: str, param: Optional[str] = None) -> dict:
    return {"error": {"status": status, "message": message, "type": type_, "param": param}}


def _dead_cause(e: BaseException) -> Optional[BaseException]:
    """The EngineDeadError behind an exception (AsyncLLMEngine wraps step failures in RuntimeError)."""
    while e is not None:
        if isinstance(e, EngineDeadError):
            return e
        e = e.__cause__
    return None


def _refused(e: InvalidRequestError, req: dict) -> dict:
    """The 400 for an engine refusal, naming the request's field: a constraint that does not compile came from
    response_format or tool_choice (the ingress says which)."""
    message, param = str(e), e.param
    if param == "structured_outputs" and req.get("structured_param"):
        param = req["structured_param"]
        message = message.replace("structured_outputs", param, 1)
    return _error(400, message, "invalid_request_error", param)


class EngineReplica:
    """Serve deployment class (made a deployment by service.app with its resources and placement group)."""

    async def __init__(self, config: dict):
        from ray import serve

        self.cfg = ServiceConfig.model_validate(config)
        self.config_digest = config_digest(config)
        try:
            ctx = serve.get_replica_context()
            self.replica_id, self.app_name = ctx.replica_id.unique_id, ctx.app_name
            self.actor_id: Optional[str] = ray.get_runtime_context().get_actor_id()
        except Exception:  # outside Serve (unit tests construct it directly)
            self.replica_id, self.app_name, self.actor_id = "local", None, None
        self._memory_sampled = 0.0
        from diffkv_serve.engine.llm_engine import LLMEngine

        # Loading the model takes seconds: keep the replica's event loop free meanwhile.
        self.engine = await asyncio.to_thread(LLMEngine, self.cfg.engine)
        if self.cfg.chat_template is not None:  # this replica's own tokenizer object: nothing else sees it
            self.engine.tokenizer.chat_template = self.cfg.chat_template
        sched = self.engine.config.scheduler
        self.meter = ServiceMeter(self.cfg.admission.rate_window_s, sched.max_num_seqs)
        self.metrics = Metrics({REPLICA: self.replica_id, KV_MODE: self.engine.config.cache.resolved_mode})
        cache = self.engine.config.cache
        self.metrics.start_counters("engine", {"enable_prefix_caching": cache.prefix_caching()},
                                    rank=tuple(str(r) for r in range(self.cfg.engine.tensor_parallel_size)))
        self._batch_sizes: collections.deque[int] = collections.deque(maxlen=100_000)  # step thread -> poller
        self.aeng = AsyncLLMEngine(self.engine, on_step=self._on_step)
        await self.aeng.start()
        self.in_flight = 0
        self._dead: Optional[str] = None
        self._last_stats: dict[str, Any] = {}
        self._compression: dict[str, float] = {}  # last compression gauges measured with requests running
        self._prev_counters = {"num_preemptions": 0, "num_generated_tokens": 0, "prefix_cache_queries": 0,
                               "prefix_cache_hits": 0}
        await self._poll_once()  # pages_total for the meter before the first request
        self._poller = asyncio.get_running_loop().create_task(self._poll_stats())
        log.info("engine replica %s ready: %s, tp=%d, torch threads %d, KV cache %s", self.replica_id,
                 self.engine.model_name, self.cfg.engine.tensor_parallel_size, torch.get_num_threads(),
                 json.dumps(self.kv_cache_card()))

    # ---- requests ------------------------------------------------------------------------------------------
    def info(self) -> dict:
        """What the ingress needs to validate requests and answer /v1/models."""
        return {"model": self.cfg.served_model_name or self.engine.model_name, "max_model_len": self.engine.max_model_len,
                "kv_mode": self.engine.config.cache.resolved_mode,
                "max_num_seqs": self.engine.config.scheduler.max_num_seqs,
                "tensor_parallel_size": self.cfg.engine.tensor_parallel_size, "replica": self.replica_id,
                "kv_cache": self.kv_cache_card(), "config_digest": self.config_digest}

    def kv_cache_card(self) -> dict:
        """The cache as the engine resolved it (the model's settings file filled what the config left unset):
        /v1/models shows it as the model card's `diffkv` object (service.protocol.KVCacheCard)."""
        return {**self.engine.config.cache.describe(), "cache_dtype": self.engine.cache_dtype}

    def _prompt_ids(self, req: dict) -> list[int]:
        tok = self.engine.tokenizer
        if "messages" in req:
            if not getattr(tok, "chat_template", None):
                raise InvalidRequestError("this model has no chat template; use /v1/completions", "messages")
            extra = {}
            if req.get("tools"):
                if not tok.supports_tools:
                    raise InvalidRequestError(f"this model's chat template ({self.engine.model_name}) does not "
                                              "support tools", "tools")
                extra["tools"] = req["tools"]
            try:
                text = tok.apply_chat_template(req["messages"], add_generation_prompt=True, **extra)
            except Exception as e:  # the template rejects the conversation (e.g. roles out of order)
                raise InvalidRequestError(f"messages: the chat template refused them: {e}", "messages") from e
            return tok.encode(text, add_special_tokens=False)
        prompt = req["prompt"]
        ids = prompt if isinstance(prompt, list) else tok.encode(prompt)
        if not ids:
            raise InvalidRequestError("prompt is empty", "prompt")
        return ids

    def _sampling(self, req: dict, prompt_len: int) -> SamplingParams:
        ctx = self.engine.max_model_len
        prompt_param = "messages" if "messages" in req else "prompt"
        if prompt_len >= ctx:
            raise InvalidRequestError(
                f"This model's maximum context length is {ctx} tokens; the prompt has {prompt_len} tokens and "
                "leaves no room for a completion", prompt_param)
        room = ctx - prompt_len
        max_tokens, param = req.get("max_tokens"), req.get("max_tokens_param", "max_tokens")
        if max_tokens is None:
            max_tokens = min(self.cfg.default_max_tokens, room)
        elif max_tokens > room:
            raise InvalidRequestError(
                f"This model's maximum context length is {ctx} tokens. However, you requested "
                f"{prompt_len + max_tokens} tokens ({prompt_len} in the prompt, {max_tokens} for the completion). "
                f"Reduce the prompt or {param}.", param)
        temperature = req.get("temperature")
        top_p = req.get("top_p")
        return SamplingParams(max_tokens=max_tokens, n=req.get("n", 1),
                              temperature=1.0 if temperature is None else temperature,
                              top_p=1.0 if top_p is None else top_p, seed=req.get("seed"),
                              stop=req.get("stop") or [], logprobs=req.get("logprobs"),
                              prompt_logprobs=req.get("prompt_logprobs"),
                              structured_outputs=req.get("structured_outputs"), **(req.get("sampling") or {}))

    def _token_str(self, token_id: int) -> str:
        return self.engine.tokenizer.decode([token_id], skip_special_tokens=False)

    def _logprob_entries(self, ids: list[int], lps: list, tops: Optional[list]) -> list[dict]:
        """Per token: its text, log-probability (None: the prompt's first) and top alternatives."""
        s = self._token_str
        return [{"token": s(t), "logprob": lp,
                 "top": None if tops is None or tops[i] is None else [[s(a), b] for a, b in tops[i]]}
                for i, (t, lp) in enumerate(zip(ids, lps))]

    async def generate(self, req: dict) -> AsyncIterator[dict]:
        if self._dead is not None:
            yield _error(503, f"engine replica is restarting: {self._dead}", "service_unavailable")
            return
        t0 = time.monotonic()
        found_free_slot = self.in_flight < self.meter.snapshot(self.replica_id).servers
        self.in_flight += 1
        ttft = None
        departed = False  # counted in the meter (Little's law counts every departure, aborted ones too)
        try:
            try:
                ids = self._prompt_ids(req)
                params = self._sampling(req, len(ids))
            except InvalidRequestError as e:
                departed = True  # never entered the engine
                yield _refused(e, req)
                return
            # Per choice (params.n of them, interleaved): tokens already sent; finished ones and their pages.
            sent = [0] * params.n
            echo = [req.get("echo", False)] * params.n
            unfinished, pages = params.n, 0
            async for out in self.aeng.generate(req["request_id"], ids, params,
                                                kv_compression=req.get("kv_compression")):
                if ttft is None and out.token_ids:
                    ttft = time.monotonic() - t0
                    self._first_token_metrics(out)
                i, n = out.index, len(out.token_ids)
                new = n - sent[i]
                sent[i] = n
                item = {"text": out.delta_text, "tokens": new, "finish_reason": None, "index": i,
                        "prompt_tokens": len(out.prompt_token_ids), "completion_tokens": sum(sent)}
                if params.logprobs is not None:
                    item["logprobs"] = self._logprob_entries(out.token_ids[n - new:n], out.logprobs[n - new:n],
                                                             out.top_logprobs[n - new:n] if params.logprobs else None)
                if echo[i]:
                    echo[i] = False  # the prompt goes with the choice's first item
                    item["prompt_text"] = req["prompt"] if isinstance(req["prompt"], str) else \
                        self.engine.tokenizer.decode(ids, skip_special_tokens=False)
                    plp = out.prompt_logprobs  # choice 0's (the same for every choice)
                    if plp is not None:
                        item["prompt_logprobs"] = self._logprob_entries(ids, plp.logprobs, plp.top)
                if out.finished and out.finish_reason not in ("stop", "length"):
                    # aborted by the replica itself (shutting down): the client gets a clear error, not a
                    # truncated answer that looks complete
                    yield _error(503, f"the engine replica stopped this request ({out.finish_reason}); retry",
                                 "service_unavailable")
                    return
                if out.finished:
                    item["finish_reason"] = out.finish_reason
                    unfinished -= 1
                    pages += (out.kv_usage or {}).get("pages_used") or 0
                    item["done"] = unfinished == 0
                if item.get("done"):
                    self.meter.finished(pages or None, ttft, found_free_slot)
                    departed = True
                    item["load"] = dataclasses.asdict(self.meter.snapshot(self.replica_id))
                yield item
        except InvalidRequestError as e:
            departed = True  # refused by add_request: never entered the engine
            yield _refused(e, req)
        except asyncio.CancelledError:
            raise
        except Exception as e:
            dead = _dead_cause(e)
            if dead is None and not self.engine_healthy():
                dead = e
            if dead is not None:
                self._dead = self._dead or str(dead)
                log.error("engine replica %s: engine is dead (%s); failing the request with 503", self.replica_id,
                          dead)
                yield _error(503, f"the engine replica serving this request failed: {dead}", "service_unavailable")
            else:
                log.exception("request %s failed", req.get("request_id"))
                yield _error(500, f"engine error: {e}", "internal_error")
        finally:
            self.in_flight -= 1
            if not departed:
                self.meter.finished(None, None, False)

    def tokenize(self, req: dict) -> dict:
        """/tokenize: {"text" | "chat", add_special_tokens, add_generation_prompt} -> tokens, count, context."""
        tok = self.engine.tokenizer
        try:
            if "chat" in req:
                if not getattr(tok, "chat_template", None):
                    raise InvalidRequestError("this model has no chat template", "messages")
                try:
                    text = tok.apply_chat_template(req["chat"], add_generation_prompt=req["add_generation_prompt"])
                except Exception as e:
                    raise InvalidRequestError(f"messages: the chat template refused them: {e}", "messages") from e
                special = req["add_special_tokens"] is True
            else:
                text, special = req["text"], req["add_special_tokens"] is not False
            ids = tok.encode(text, add_special_tokens=special) if text else []
        except InvalidRequestError as e:
            return _error(400, str(e), "invalid_request_error", e.param)
        return {"tokens": ids, "count": len(ids), "max_model_len": self.engine.max_model_len}

    def tokenizer_info(self, req: dict) -> dict:
        """/tokenizer_info: the special tokens and chat template (vLLM's endpoint, which lm-eval's remote
        tokenizer needs). The tokenizer has no pad token: clients pad with EOS."""
        tok = self.engine.tokenizer
        return {"tokenizer_class": type(tok).__name__, "eos_token": tok.eos_token, "bos_token": tok.bos_token,
                "pad_token": None, "chat_template": tok.chat_template,
                "model_max_length": self.engine.max_model_len}

    def detokenize(self, req: dict) -> dict:
        """/detokenize: {"ids"} -> {"prompt"}, special tokens kept (as vLLM's)."""
        V = self.engine.arch.vocab_size
        bad = [t for t in req["ids"] if t >= V]
        if bad:
            return _error(400, f"token id {bad[0]} is outside the vocabulary [0, {V})", "invalid_request_error",
                          "tokens")
        return {"prompt": self.engine.tokenizer.decode(req["ids"], skip_special_tokens=False)}

    def _first_token_metrics(self, out) -> None:
        """Prefill done: its prompt tokens, and how long it waited in the engine's queue."""
        self.metrics.inc("diffkv_prompt_tokens_total", len(out.prompt_token_ids))
        scheduled = getattr(out, "first_scheduled_time", None)
        if scheduled is not None:
            self.metrics.observe("diffkv_request_queue_time_seconds", max(0.0, scheduled - out.arrival_time))

    # ---- health, routing stats, stats ---------------------------------------------------------------------
    def engine_healthy(self) -> bool:
        is_healthy = getattr(self.engine, "is_healthy", None)
        return is_healthy() if is_healthy is not None else True

    async def check_health(self) -> None:
        """Serve calls this every health_check_period_s; raising makes Serve replace the replica."""
        if self._dead is None and not self.engine_healthy():
            self._dead = "engine reported unhealthy"
        if self._dead is None and hasattr(self.aeng, "check_health"):
            try:
                await self.aeng.check_health()  # pings the worker actors (tensor-parallel engines)
            except Exception as e:
                self._dead = f"health check failed: {e!r}"
        if self._dead is not None:
            raise RuntimeError(f"engine replica {self.replica_id} is dead: {self._dead}")

    def record_routing_stats(self) -> dict:
        """Serve's router gets this every router.stats_period_s (service.router ranks replicas with it)."""
        st = self._last_stats
        load = self.meter.snapshot(self.replica_id)
        return {"pages_total": st.get("pages_total", 0), "pages_used": st.get("pages_used", 0),
                "num_running": st.get("num_running", 0), "num_waiting": st.get("num_waiting", 0),
                "max_num_seqs": self.engine.config.scheduler.max_num_seqs, "in_flight": self.in_flight,
                "pages_per_request": load.pages_per_request, "dead": self._dead is not None,
                # service.prefix_router follows prefixes only to replicas that cache them
                "prefix_caching": self.engine.config.cache.prefix_caching(),
                "pages_evictable": self._evictable_pages(),
                "kv_mode": self.engine.config.cache.resolved_mode}

    def _evictable_pages(self) -> int:
        """Pages of cached prefix blocks no request reads: free as soon as a prompt needs them."""
        pc = getattr(self.engine.scheduler, "prefix_cache", None)
        if pc is None:
            return 0
        return pc.num_evictable * self.engine.arch.num_layers * self.engine.arch.num_kv_heads

    async def stats(self) -> dict:
        """Engine stats plus this replica's measured load (tests and debugging)."""
        st = await self.aeng.stats()
        return {**st, "replica": self.replica_id, "in_flight": self.in_flight,
                "load": dataclasses.asdict(self.meter.snapshot(self.replica_id))}

    # ---- metrics ----------------------------------------------------------------------------------------------
    def _on_step(self, outputs: list, seconds: float) -> None:
        """Step thread, after each step: batch size, and the running count for Little's law."""
        if outputs:
            self._batch_sizes.append(len(outputs))
        finished = sum(1 for o in outputs if o.finished)
        sched = self.engine.scheduler
        self.meter.step(len(sched.running) + finished, len(sched.waiting), finished, seconds)

    async def _poll_stats(self) -> None:
        while True:
            await asyncio.sleep(self.cfg.stats_period_s)
            try:
                await self._sample_memory()
                await self._poll_once()
            except asyncio.CancelledError:
                raise
            except Exception as e:
                if _dead_cause(e) is not None or not self.engine_healthy():
                    self._dead = self._dead or f"stats failed: {e!r}"
                else:
                    log.exception("reading engine stats failed")

    async def _poll_once(self) -> None:
        st = await self.aeng.stats()
        m = self.metrics
        steps_ran = st["num_generated_tokens"] != self._prev_counters["num_generated_tokens"]
        self._last_stats = st
        self.meter.pages_total = st["pages_total"]
        if not st["num_running"]:
            self.meter.set_running(0)
        m.set("diffkv_num_requests_running", st["num_running"])
        m.set("diffkv_num_requests_waiting", st["num_waiting"])
        m.set("diffkv_kv_cache_usage_perc", st["pages_used"] / max(1, st["pages_total"]))
        ranks = st.get("ranks") or [{"rank": 0, "pages_total": st["pages_total"], "pages_used": st["pages_used"],
                                     "last_mm_seconds": st.get("last_mm_seconds", 0.0)}]
        for r in ranks:
            rank = str(r["rank"])
            m.set("diffkv_kv_pages_used", r["pages_used"], rank=rank)
            m.set("diffkv_kv_pages_total", r["pages_total"], rank=rank)
            m.set("diffkv_kv_page_occupancy", r["pages_used"] / max(1, r["pages_total"]), rank=rank)
            if steps_ran and r.get("last_mm_seconds"):
                m.observe("diffkv_mm_seconds", r["last_mm_seconds"], rank=rank)
        entries = st.get("tokens_high", 0) + st.get("tokens_low", 0) + st.get("tokens_pruned", 0)
        if entries > 0:  # while idle, the last measured values stay (re-set below: Ray drops unset gauges)
            self._compression = {"diffkv_kv_compression_ratio": st.get("compression_ratio") or 1.0,
                                 "diffkv_kv_tokens_high_fraction": st["tokens_high"] / entries,
                                 "diffkv_kv_tokens_low_fraction": st["tokens_low"] / entries,
                                 "diffkv_kv_tokens_pruned_fraction": st["tokens_pruned"] / entries}
        for name, value in self._compression.items():
            m.set(name, value)
        for key, name in (("num_preemptions", "diffkv_num_preemptions_total"),
                          ("num_generated_tokens", "diffkv_generation_tokens_total"),
                          ("prefix_cache_queries", "diffkv_prefix_cache_queries_total"),
                          ("prefix_cache_hits", "diffkv_prefix_cache_hits_total")):
            m.inc(name, st[key] - self._prev_counters[key])
            self._prev_counters[key] = st[key]
        while self._batch_sizes:
            m.observe("diffkv_batch_size", self._batch_sizes.popleft())
        rate = self.meter.snapshot(self.replica_id).service_rate
        m.set("diffkv_service_rate", rate or 0.0)

    async def _sample_memory(self) -> None:
        """For service.replica_deaths: if this process is killed without a word, how full its node was; and
        replica_memory_limit_gib: past it, the replica ends itself (its sample, recorded first, says why)."""
        now = time.monotonic()
        if self.actor_id is None or now - self._memory_sampled < MEMORY_SAMPLE_PERIOD_S:
            return
        self._memory_sampled = now
        limit_gib = self.cfg.replica_memory_limit_gib
        sample = replica_deaths.memory_sample(None if limit_gib is None else int(limit_gib * 2**30))
        try:
            await asyncio.to_thread(replica_deaths.record_memory, self.app_name, self.actor_id, sample)
        except Exception:  # noqa: BLE001 - the GCS briefly unreachable: the next sample comes soon
            log.debug("engine replica %s: memory sample not recorded", self.replica_id, exc_info=True)
        if replica_deaths.over_limit(sample):
            # SIGKILL as the OOM killer would, but at a limit of our choosing and with the cause on record;
            # a graceful stop would keep the memory while it drains
            log.error("engine replica %s: resident memory %.2f GiB is above replica_memory_limit_gib %.2f: "
                      "ending the replica", self.replica_id, sample["rss"] / 2**30, limit_gib)
            os.kill(os.getpid(), signal.SIGKILL)

    async def hold_memory_for_test(self, gib: float) -> int:
        """service.testing_hooks.hold_memory in this replica (only with DIFFKV_TEST_HOOKS=1)."""
        return await asyncio.to_thread(testing_hooks.hold_memory, gib)

    async def __del__(self) -> None:
        """Serve calls this on graceful shutdown: end the step thread, abort what is left, release workers."""
        if getattr(self, "actor_id", None) is not None:  # a stop, not a death (service.replica_deaths)
            try:
                dead = self._dead or (None if self.engine_healthy() else "the engine reports itself unhealthy")
                await asyncio.to_thread(replica_deaths.record_stop, self.app_name, self.actor_id, dead)
            except Exception:  # noqa: BLE001 - the GCS unreachable: the stop is then reported as a kill
                log.warning("engine replica %s: could not record its stop", self.replica_id, exc_info=True)
        poller = getattr(self, "_poller", None)
        if poller is not None:
            poller.cancel()
        aeng = getattr(self, "aeng", None)
        if aeng is not None:
            await aeng.shutdown()
        shutdown = getattr(getattr(self, "engine", None), "shutdown", None)
        if shutdown is not None:
            await asyncio.to_thread(shutdown)
