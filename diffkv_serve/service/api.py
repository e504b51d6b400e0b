"""The OpenAI-compatible HTTP API: a FastAPI app served as the ingress deployment.

Per request: the guard (service.guard) refuses what needs no parsing to refuse (API key, draining, content
type, body size), then validate (pydantic models in service.protocol; every failure is a 400 OpenAI error body),
check the model and the token budget, ask admission control (429 + Retry-After when the predicted TTFT is
over target), then stream from an engine replica through Serve's handle (our KV-headroom router picks it).
The first item from the replica decides the status code (400 / 503 arrive before any token); a replica
that fails before that item is replaced by another (retry.max_retries re-sends: nothing reached the client
yet); later failures end an SSE stream with an error event, a non-streaming request with a 503. A client
that goes away cancels the replica call, which aborts the request in the engine and frees its pages. Every
admitted request ends in release(). The replica call and its stream live in diffkv_serve/service/streaming.py, the
error type in diffkv_serve/service/api_error.py.
(No `from __future__ import annotations`: Serve's class-based FastAPI views need the real annotations.)
"""
import asyncio
import logging
import time
from typing import Any, Optional, Union

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.openapi.utils import get_openapi
from fastapi.responses import JSONResponse
from ray import serve
from starlette.exceptions import HTTPException as StarletteHTTPException

from diffkv_serve.service import drain, replica_deaths
from diffkv_serve.service.admission import AdmissionController
from diffkv_serve.service.api_error import RETRY_AFTER_DEAD_S, APIError
from diffkv_serve.service.auth import APIKeys
from diffkv_serve.service.config import ServiceConfig, config_digest
from diffkv_serve.service.guard import DRAIN_RETRY_AFTER_S, GuardPolicy, RequestGuard
from diffkv_serve.service.metrics import Metrics
from diffkv_serve.service.protocol import (ChatCompletionRequest, CompletionRequest, DetokenizeRequest, DetokenizeResponse,
                              ErrorResponse, Health, ModelCard, ModelList, TokenizeRequest, TokenizeResponse, TokenizerInfo,
                              Usage, new_id, now_s)
from diffkv_serve.service.responses import chat_renderer, completion_renderer
from diffkv_serve.service.structured_outputs import ConstraintError
from diffkv_serve.service.streaming import _SSEResponse, _Stream

log = logging.getLogger("ray.serve")
# limits.max_prompt_chars' default per token of context: no tokenizer packs this many characters into
# every token of a real prompt, so a longer one cannot fit
PROMPT_CHARS_PER_TOKEN = 32

# The schema route is the ingress's own (it adds the served model's name), hence openapi_url=None here.
app = FastAPI(title="DiffKV Serve", version="0.1.0", openapi_url=None,
              description="OpenAI-compatible API over DiffKV-compressed paged-KV engine replicas")
# API keys, draining, content type and body size are checked before FastAPI reads the body (service.guard).
app.add_middleware(RequestGuard)

_ERRORS = {status: {"model": ErrorResponse} for status in (400, 401, 413, 429, 500, 503)}



def _endpoint(path: str) -> str:
    return "chat" if "chat" in path else "completions"


_TYPE_TAGS = {"str", "int", "float", "bool", "none", "dict", "list", "json-or-python", "is-instance"}


def _loc_param(loc: tuple) -> Optional[str]:
    """The field a validation error is about: 'messages.0.role'. Stops at a union member's tag ('str',
    'list[TextPart]', 'function-after[...]'), which names a type, not a field."""
    parts = []
    for p in loc:
        p = str(p)
        if p == "body" and not parts:
            continue
        if p in _TYPE_TAGS or "[" in p:
            break
        parts.append(p)
    return ".".join(parts) or None


@app.exception_handler(RequestValidationError)
async def _validation_error(request: Request, exc: RequestValidationError) -> JSONResponse:
    errs = exc.errors()
    first = errs[0] if errs else {}
    if first.get("type") == "json_invalid":
        message, param = f"invalid JSON body: {first.get('ctx', {}).get('error', 'malformed')}", None
    elif first.get("type") == "finite_number":  # NaN / Infinity: Python's json reads them, JSON has no such numbers
        param = _loc_param(tuple(first.get("loc", ())))
        message = f"{param or 'body'} must be a finite number, got {first.get('input')!r}"
    else:
        param = _loc_param(tuple(first.get("loc", ())))
        message = "; ".join(f"{_loc_param(tuple(e.get('loc', ()))) or 'body'}: {e.get('msg')}" for e in errs[:5])
    _count_rejection(request, "invalid")
    return APIError(400, message, "invalid_request_error", param).response()


@app.exception_handler(StarletteHTTPException)
async def _http_error(request: Request, exc: StarletteHTTPException) -> JSONResponse:
    type_ = "not_found_error" if exc.status_code == 404 else "invalid_request_error"
    return APIError(exc.status_code, str(exc.detail), type_).response()


@app.exception_handler(APIError)
async def _api_error(request: Request, exc: APIError) -> JSONResponse:
    return exc.response()


@app.exception_handler(Exception)
async def _internal_error(request: Request, exc: Exception) -> JSONResponse:  # pragma: no cover - a bug
    log.exception("unhandled error on %s", request.url.path)
    return APIError(500, f"internal error: {exc!r}", "internal_error").response()


def _replica_stopping(e: BaseException) -> bool:
    """A background poll failed because Serve is stopping this replica: its event loop's thread pool was shut
    down and takes no more work (nothing to report, and no traceback for the operator to read)."""
    return isinstance(e, RuntimeError) and "after shutdown" in str(e)


def _check_kv_compression(info: dict) -> None:
    """Per-request thresholds need a diffkv cache that classifies by thresholds; anywhere else they would be
    ignored, so the request is refused rather than served as if they applied."""
    cache = info.get("kv_cache") or {"kv_mode": info["kv_mode"]}
    if cache["kv_mode"] != "diffkv":
        raise APIError(400, f"kv_compression sets DiffKV thresholds, but this server's KV cache is kv_mode "
                            f"'{cache['kv_mode']}'; send it to a server started with kv_mode diffkv",
                       "invalid_request_error", "kv_compression")
    if cache.get("policy", "thresholds") != "thresholds":
        raise APIError(400, f"kv_compression sets DiffKV thresholds, but this server's diffkv cache keeps tokens "
                            f"by policy '{cache['policy']}', not by thresholds", "invalid_request_error",
                       "kv_compression")


def _count_rejection(request: Request, reason: str) -> None:
    # Serve ships the ingress class (and this app) to the replica by value, so module globals are not
    # shared with it: the ingress leaves itself on the app's state instead.
    ingress = getattr(request.app.state, "ingress", None)
    if ingress is not None:
        ingress.metrics.inc("diffkv_requests_rejected_total", endpoint=_endpoint(request.url.path), reason=reason)


@serve.deployment
@serve.ingress(app)
class OpenAIIngress:
    async def __init__(self, engine, config: dict):
        self.engine = engine  # DeploymentHandle of EngineReplica
        self.cfg = ServiceConfig.model_validate(config)
        self.config_digest = config_digest(config)
        scaling = self.cfg.autoscaling or {}
        self.admission = AdmissionController(
            self.cfg.admission, self.cfg.engine.scheduler.max_num_seqs, self.cfg.num_replicas,
            max_replicas=scaling.get("max_replicas") if scaling else self.cfg.num_replicas,
            share=1.0 / self.cfg.ingress_replicas)
        self.metrics = Metrics()
        self.metrics.start_counters("ingress")
        self._info: Optional[dict] = None
        self._schema: Optional[dict] = None
        app.state.ingress = self
        keys = APIKeys(self.cfg.all_api_keys())
        self.guard = GuardPolicy(keys, self.cfg.limits.max_body_bytes, on_reject=self._count_guard_rejection)
        app.state.guard = self.guard
        log.info("ingress: %s", f"API key required on every route but /health ({keys!r})" if keys.required
                 else "no API key required")
        self._streams: set[_Stream] = set()  # requests past admission, for the drain to end at its timeout
        # Ask the engine for the model's name and context now, without holding up the deployment.
        loop = asyncio.get_running_loop()
        self._info_task = loop.create_task(self._prefetch_info())
        self._gauges_task = loop.create_task(self._refresh_gauges())
        self._drain_task = loop.create_task(self._watch_for_drain())
        self._deaths_task = loop.create_task(self._watch_replica_deaths())

    async def _watch_replica_deaths(self) -> None:
        """diffkv_serve.service.replica_deaths: log and count every engine replica death of this app with its cause."""
        from diffkv_serve.service.app import ENGINE_DEPLOYMENT  # service.app imports this module

        watcher = replica_deaths.DeathWatcher(serve.get_replica_context().app_name, ENGINE_DEPLOYMENT)
        while True:
            await asyncio.sleep(replica_deaths.WATCH_PERIOD_S)
            try:
                deaths = await asyncio.to_thread(watcher.new_deaths)
            except Exception as e:  # noqa: BLE001 - the GCS briefly unreachable: look again
                if _replica_stopping(e):
                    return
                log.warning("reading engine replica deaths failed", exc_info=True)
                continue
            for d in deaths:
                log.error("engine replica %s (pid %d) died: %s: %s", d.replica, d.pid, d.cause, d.detail)
                self.metrics.inc("diffkv_replica_deaths_total", cause=d.cause)

    async def _watch_for_drain(self) -> None:
        """diffkv_serve.service.drain: once a drain is announced, refuse new requests, let those in flight run until the
        timeout, end the rest with a 503 / SSE error event, and report what is left; a withdrawn
        announcement (drain.clear) makes the replica serve again."""
        ctx = serve.get_replica_context()
        app_name, replica = ctx.app_name, ctx.replica_id.unique_id
        deadline: Optional[float] = None
        while True:
            await asyncio.sleep(drain.POLL_S)
            try:
                announcement = await asyncio.to_thread(drain.announced, app_name)
                if announcement is None:
                    if deadline is not None:
                        deadline, self.guard.draining = None, False
                        log.warning("ingress %s: drain withdrawn: serving again", replica)
                        await asyncio.to_thread(drain.forget_report, app_name, replica)
                    continue
                timeout_s = announcement.timeout_s
                if timeout_s is None:
                    timeout_s = self.cfg.drain_timeout_s
                if deadline is None:
                    deadline, self.guard.draining = time.monotonic() + timeout_s, True
                    log.warning("ingress %s: draining: new requests get 503; %d in flight get %.0fs to finish",
                                replica, self.admission.in_flight, timeout_s)
                running = [st for st in self._streams if st.abort_error is None]
                if time.monotonic() >= deadline and running:
                    log.warning("ingress %s: drain timeout: ending %d requests with 503", replica, len(running))
                    for stream in running:
                        stream.abort(APIError(503, f"the server shut down before the request finished (drain "
                                                   f"timeout {timeout_s:g}s); retry it", "service_unavailable",
                                              retry_after=DRAIN_RETRY_AFTER_S))
                await asyncio.to_thread(drain.report, app_name, replica, self.admission.in_flight)
            except Exception as e:  # noqa: BLE001 - the GCS briefly unreachable: try again at the next poll
                if _replica_stopping(e):
                    return
                log.warning("ingress %s: drain check failed", replica, exc_info=True)

    async def _refresh_gauges(self) -> None:
        """Re-set the admission gauges every second: the arrival-rate estimate decays between arrivals, and
        Ray stops exporting a gauge that is not set for a while."""
        while True:
            await asyncio.sleep(1.0)
            self._publish_admission_gauges()

    async def _prefetch_info(self) -> None:
        try:
            await self._model_info()
        except APIError:
            pass  # the first request asks again

    # ---- helpers ------------------------------------------------------------------------------------------
    def _count_guard_rejection(self, method: str, path: str, reason: str) -> None:
        if method == "POST" and path in ("/v1/chat/completions", "/v1/completions"):
            self.metrics.inc("diffkv_requests_rejected_total", endpoint=_endpoint(path), reason=reason)

    def _check_prompt_chars(self, body: Union[ChatCompletionRequest, CompletionRequest], info: dict) -> None:
        """Before the replica tokenizes: a prompt far longer than any context could hold is refused at once."""
        limit = self.cfg.limits.max_prompt_chars or PROMPT_CHARS_PER_TOKEN * info["max_model_len"]
        if isinstance(body, ChatCompletionRequest):
            param, chars = "messages", sum(len(m.text()) + len(m.name or "") for m in body.messages)
        elif isinstance(body.prompt, str):
            param, chars = "prompt", len(body.prompt)
        else:
            return  # token ids: the replica checks their count against the context
        if chars > limit:
            raise APIError(400, f"{param} has {chars} characters; this server accepts at most {limit} "
                                f"(limits.max_prompt_chars)", "invalid_request_error", param, "prompt_too_long")

    async def _model_info(self) -> dict:
        """The served model's name, context and cache, from an engine replica. Kept once a replica of this
        ingress's own deployment answered: during a rolling update a replica of the previous configuration
        may answer first (its description then serves this request only)."""
        if self._info is not None:
            return self._info
        try:
            info = await self.engine.info.remote()
        except Exception as e:
            raise APIError(503, f"no engine replica is available: {e!r}", "service_unavailable",
                           retry_after=RETRY_AFTER_DEAD_S) from e
        if info.get("config_digest") == self.config_digest:
            self._info = info
        elif self.cfg.served_model_name:  # this deployment's name for the model, whoever answered
            info = {**info, "model": self.cfg.served_model_name}
        return info

    def _publish_admission_gauges(self) -> None:
        m = self.metrics
        m.set("diffkv_arrival_rate", self.admission.arrival_rate())
        m.set("diffkv_requests_in_flight", self.admission.in_flight)
        if self.admission.last_prediction is not None:
            m.set("diffkv_admission_predicted_ttft_seconds", self.admission.last_prediction)

    async def _prepare(self, body: Union[ChatCompletionRequest, CompletionRequest], endpoint: str) -> dict:
        """Checks that need the model, then admission. Returns the replica request (the caller must release)."""
        info = await self._model_info()
        try:
            self._check_prompt_chars(body, info)
            if body.model != info["model"]:
                raise APIError(400, f"The model '{body.model}' does not exist; this server serves "
                                    f"'{info['model']}'", "invalid_request_error", "model", "model_not_found")
            if body.kv_compression is not None:
                _check_kv_compression(info)
            if body.n > self.cfg.limits.max_n:
                raise APIError(400, f"n={body.n} is over this server's limit of {self.cfg.limits.max_n} choices "
                                    f"(limits.max_n)", "invalid_request_error", "n")
            try:
                constraint, constraint_param = body.constraint()
            except ConstraintError as e:
                raise APIError(400, str(e), "invalid_request_error", e.param) from e
            max_tokens, param = body.requested_max_tokens()
            if max_tokens is not None and max_tokens >= info["max_model_len"]:
                raise APIError(400, f"{param}={max_tokens} does not fit this model's context of "
                                    f"{info['max_model_len']} tokens", "invalid_request_error", param)
        except APIError:
            self.metrics.inc("diffkv_requests_rejected_total", endpoint=endpoint, reason="invalid")
            raise
        if self.guard.draining:  # passed the guard just before the drain began
            self.metrics.inc("diffkv_requests_rejected_total", endpoint=endpoint, reason="draining")
            raise APIError(503, "the server is shutting down and takes no new requests", "service_unavailable",
                           retry_after=DRAIN_RETRY_AFTER_S)
        decision = self.admission.decide()
        self._publish_admission_gauges()
        if not decision.admit:
            self.metrics.inc("diffkv_requests_rejected_total", endpoint=endpoint, reason=decision.reason)
            raise APIError(429, f"The server is over capacity ({decision.detail}); retry after "
                                f"{decision.retry_after_s}s", "rate_limit_error", None, decision.reason,
                           retry_after=decision.retry_after_s)
        self.metrics.inc("diffkv_requests_admitted_total", endpoint=endpoint)
        req: dict[str, Any] = {
            "request_id": new_id("req"), "max_tokens": max_tokens, "max_tokens_param": param,
            "temperature": body.temperature, "top_p": body.top_p, "seed": body.seed, "stop": body.stop_list(),
            "kv_compression": body.kv_compression.model_dump(exclude_none=True) if body.kv_compression else None,
            "sampling": body.sampling_fields(), "n": body.n,
        }
        req["logprobs"], req["prompt_logprobs"] = body.engine_logprobs()
        if getattr(body, "echo", False):
            req["echo"] = True
        if constraint is not None:
            req["structured_outputs"], req["structured_param"] = constraint, constraint_param
        if isinstance(body, ChatCompletionRequest):
            req["messages"] = [m.template_dict() for m in body.messages]
            if body.tools:
                req["tools"] = [t.model_dump(exclude_none=True) for t in body.tools]
        else:
            req["prompt"] = body.prompt
        return req

    async def _run(self, body, endpoint: str, render) -> Any:
        """Shared by both endpoints. render(kind, ...) builds the endpoint's response objects."""
        t0 = time.monotonic()
        req = await self._prepare(body, endpoint)
        try:
            stream = _Stream(self, req, endpoint, t0)
        except BaseException:
            self.admission.release()
            raise
        try:
            first = await stream.first()
        except BaseException:
            await stream.close()
            raise
        if body.stream:
            return _SSEResponse(stream, stream.sse(first, render, body.include_usage()))
        try:
            text, last, items = first["text"], first, [first]
            async for item in stream.rest():
                text += item["text"]
                last = item
                items.append(item)
        finally:
            await stream.close()
        usage = Usage.of(last["prompt_tokens"], last["completion_tokens"])
        return JSONResponse(render("full", text=text, finish_reason=last["finish_reason"], usage=usage,
                                   rid=stream.rid, items=items))

    # ---- routes -----------------------------------------------------------------------------------------------
    @app.get("/openapi.json", include_in_schema=False)
    async def openapi(self, request: Request) -> JSONResponse:
        """FastAPI's schema with `model` limited to the served model (clients and fuzzers see the one value
        that is accepted)."""
        if self._schema is None:
            info = await self._model_info()
            schema = get_openapi(title=app.title, version=app.version, description=app.description,
                                 routes=request.app.routes)
            for name in ("ChatCompletionRequest", "CompletionRequest", "TokenizeRequest", "DetokenizeRequest"):
                schema["components"]["schemas"][name]["properties"]["model"]["enum"] = [info["model"]]
            self._schema = schema
        return JSONResponse(self._schema)

    @app.get("/health", response_model=Health, responses=_ERRORS)
    async def health(self) -> Health:
        if self.guard.draining:  # readiness: route no new work here
            raise APIError(503, "draining: the server is shutting down", "service_unavailable",
                           retry_after=DRAIN_RETRY_AFTER_S)
        info = await self._model_info()
        return Health(model=info["model"])

    @app.get("/v1/models", response_model=ModelList, responses=_ERRORS)
    async def models(self) -> ModelList:
        info = await self._model_info()
        return ModelList(data=[ModelCard(id=info["model"], created=now_s(), diffkv=info.get("kv_cache"))])

    async def _tokenizer_call(self, model: Optional[str], method: str, req: dict) -> dict:
        """/tokenize, /detokenize, /tokenizer_info: an engine replica holds the tokenizer. The request's keys are
        not the generate ones, so the prefix router neither matches nor remembers it. No model: the served one."""
        info = await self._model_info()
        if model is not None and model != info["model"]:
            raise APIError(400, f"The model '{model}' does not exist; this server serves '{info['model']}'",
                           "invalid_request_error", "model", "model_not_found")
        try:
            out = await getattr(self.engine, method).remote(req)
        except Exception as e:
            raise APIError(503, f"no engine replica answered: {e!r}", "service_unavailable",
                           retry_after=RETRY_AFTER_DEAD_S) from e
        if "error" in out:
            err = out["error"]
            raise APIError(err["status"], err["message"], err["type"], err.get("param"))
        return out

    @app.post("/tokenize", response_model=TokenizeResponse, responses=_ERRORS)
    async def tokenize(self, body: TokenizeRequest) -> TokenizeResponse:
        req = {"add_special_tokens": body.add_special_tokens, "add_generation_prompt": body.add_generation_prompt}
        if body.messages is not None:
            req["chat"] = [{"role": m.role, "content": m.text()} for m in body.messages]
        else:
            req["text"] = body.prompt
        return TokenizeResponse(**await self._tokenizer_call(body.model, "tokenize", req))

    @app.get("/tokenizer_info", response_model=TokenizerInfo, responses=_ERRORS)
    async def tokenizer_info(self) -> TokenizerInfo:
        return TokenizerInfo(**await self._tokenizer_call(None, "tokenizer_info", {}))

    @app.post("/detokenize", response_model=DetokenizeResponse, responses=_ERRORS)
    async def detokenize(self, body: DetokenizeRequest) -> DetokenizeResponse:
        return DetokenizeResponse(**await self._tokenizer_call(body.model, "detokenize", {"ids": body.tokens}))

    @app.post("/v1/chat/completions", responses=_ERRORS)
    async def chat_completions(self, body: ChatCompletionRequest):
        return await self._run(body, "chat", chat_renderer(body, now_s()))

    @app.post("/v1/completions", responses=_ERRORS)
    async def completions(self, body: CompletionRequest):
        return await self._run(body, "completions", completion_renderer(body, now_s()))
