"""One request's trip through an engine replica, as the ingress streams it: the replica call with its retries
while nothing reached the client, the first item that decides the status, server-sent events, per-token timing
for the metrics, and the end of a stream cut short (client gone, drain, replica lost)."""
import asyncio
import json
import logging
import time
from typing import TYPE_CHECKING, AsyncIterator, Optional, Union

from fastapi.responses import StreamingResponse

from diffkv_serve.service.admission import ReplicaLoad
from diffkv_serve.service.api_error import RETRY_AFTER_DEAD_S, APIError
from diffkv_serve.service.protocol import Usage

if TYPE_CHECKING:
    from diffkv_serve.service.api import OpenAIIngress

log = logging.getLogger("ray.serve")


_PATHS = {"chat": "/v1/chat/completions", "completions": "/v1/completions"}


def _sse(obj: Union[dict, str]) -> str:
    return f"data: {obj if isinstance(obj, str) else json.dumps(obj, separators=(',', ':'))}\n\n"


class _Stream:
    """One admitted request's call to an engine replica: first item, the rest, SSE, metrics, release."""

    def __init__(self, ingress: "OpenAIIngress", req: dict, endpoint: str, t0: float):
        self.ingress, self.req, self.endpoint, self.t0 = ingress, req, endpoint, t0
        self.rid = "chatcmpl-" + req["request_id"][4:] if endpoint == "chat" else "cmpl-" + req["request_id"][4:]
        self.attempts = 0  # re-sends to another replica after a failure before any output
        self.gen = self._call()
        self.t_first: Optional[float] = None
        self.t_last: Optional[float] = None  # when the latest tokens arrived
        self.finish_reason: Optional[str] = None
        self.completion_tokens = 0
        self.failed = False  # ended by an error (400 / 503 from the replica)
        self.error_event: Optional[APIError] = None  # the error a 200 stream ended with, as its last event
        self._closed = False
        self.abort_error: Optional[APIError] = None  # set when the server ends the request (drain timeout)
        self._aborted = asyncio.Event()
        ingress._streams.add(self)

    def abort(self, error: "APIError") -> None:
        """End the request with `error` (a stream gets it as its last SSE event), whatever the replica does."""
        if self.abort_error is None:
            self.abort_error = error
            self._aborted.set()

    async def _await_next(self) -> dict:
        """The replica's next item, unless abort() comes first."""
        if self.abort_error is not None:
            raise self.abort_error
        nxt = asyncio.ensure_future(self.gen.__anext__())
        stop = asyncio.ensure_future(self._aborted.wait())
        try:
            await asyncio.wait({nxt, stop}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            stop.cancel()
        if nxt.done():
            return nxt.result()
        nxt.cancel()
        # what the abandoned call ends with (Serve's RequestCancelledError) is expected: retrieve it, so that
        # asyncio does not log it as an exception nobody retrieved
        nxt.add_done_callback(lambda t: t.cancelled() or t.exception())
        raise self.abort_error

    def _call(self):
        """Send the request to an engine replica (the router picks it). A re-send gets its own engine id: the
        first replica may still hold the original (a dead engine keeps its requests until it is replaced)."""
        req = self.req
        if self.attempts:
            req = {**req, "request_id": f"{req['request_id']}-r{self.attempts}"}
        return self.ingress.engine.options(stream=True).generate.remote(req)

    async def _resend(self, cause: APIError) -> None:
        retry = self.ingress.cfg.retry
        self.attempts += 1
        self.failed = False
        log.warning("request %s: its engine replica failed before any output (%s); re-sending it (%d of %d)",
                    self.req["request_id"], cause.message, self.attempts, retry.max_retries)
        self.ingress.metrics.inc("diffkv_requests_retried_total", endpoint=self.endpoint)
        self.gen.cancel()  # no-op on a call that already failed; ends one a live replica still runs
        await asyncio.sleep(retry.backoff_s)  # lets the router drop the lost replica before it picks again
        self.gen = self._call()

    async def _next(self) -> Optional[dict]:
        try:
            return await self._next_item()
        except APIError:
            self.failed = True
            raise

    async def _next_item(self) -> Optional[dict]:
        try:
            item = await self._await_next()
        except StopAsyncIteration:
            return None
        except APIError:
            raise
        except Exception as e:  # the replica actor died or became unreachable
            if type(e).__name__ in ("RequestCancelledError",):
                raise
            raise APIError(503, f"the engine replica serving this request failed: {type(e).__name__}: {e}",
                           "service_unavailable", retry_after=RETRY_AFTER_DEAD_S) from e
        if "error" in item:
            err = item["error"]
            raise APIError(err["status"], err["message"], err["type"], err.get("param"),
                           retry_after=RETRY_AFTER_DEAD_S if err["status"] == 503 else None)
        if item.get("tokens"):
            self._token_times(item["tokens"])
        self.completion_tokens = item.get("completion_tokens", self.completion_tokens)
        if item.get("finish_reason"):
            self.finish_reason = item["finish_reason"]
            if item.get("load"):
                self.ingress.admission.report(ReplicaLoad(**item["load"]))
        return item

    def _token_times(self, n: int) -> None:
        """TTFT on the first tokens; after it, the gap since the previous tokens, split over the n tokens that
        arrived together (one inter-token latency observation per token, as vLLM records them)."""
        now, m = time.monotonic(), self.ingress.metrics
        if self.t_first is None:
            self.t_first = now
            m.observe("diffkv_time_to_first_token_seconds", now - self.t0, endpoint=self.endpoint)
        else:
            gap = (now - self.t_last) / n
            for _ in range(n):
                m.observe("diffkv_inter_token_latency_seconds", gap, endpoint=self.endpoint)
                m.observe("diffkv_time_per_output_token_seconds", gap, endpoint=self.endpoint)
        self.t_last = now

    async def first(self) -> dict:
        """The replica's first item. Until it arrives nothing has reached the client, so a replica that fails
        (503: actor or node lost, engine dead) is replaced by another one, up to retry.max_retries times."""
        while True:
            try:
                item = await self._next()
                if item is None:
                    self.failed = True
                    raise APIError(503, "the engine replica ended the request without output",
                                   "service_unavailable", retry_after=RETRY_AFTER_DEAD_S)
                return item
            except APIError as e:
                if e.status == 503 and self.abort_error is None and \
                        self.attempts < self.ingress.cfg.retry.max_retries:
                    await self._resend(e)
                    continue
                reason = {400: "invalid", 503: "engine_dead"}.get(e.status, "error")
                self.ingress.metrics.inc("diffkv_requests_rejected_total", endpoint=self.endpoint, reason=reason)
                raise

    async def rest(self) -> AsyncIterator[dict]:
        if self.finish_reason is not None:
            return
        while True:
            item = await self._next()
            if item is None:
                if self.finish_reason is None:
                    raise APIError(503, "the engine replica ended the request early", "service_unavailable",
                                   retry_after=RETRY_AFTER_DEAD_S)
                return
            yield item
            if self.finish_reason is not None:
                return

    async def sse(self, first: dict, render, include_usage: bool) -> AsyncIterator[str]:
        kw = {"rid": self.rid, "usage_field": include_usage}
        try:
            role = render("role", **kw)
            if role is not None:
                yield _sse(role)
            last = first
            yield _sse(render("delta", text=first["text"], finish_reason=first["finish_reason"], item=first, **kw))
            try:
                async for item in self.rest():
                    last = item
                    yield _sse(render("delta", text=item["text"], finish_reason=item["finish_reason"], item=item,
                                      **kw))
            except APIError as e:  # headers are sent: report the failure in the stream, as OpenAI does
                self.error_event = e
                yield _sse(e.body())
                return
            if include_usage:
                usage = Usage.of(last["prompt_tokens"], last["completion_tokens"])
                chunk = render("usage", usage=usage, **kw)
                chunk["choices"] = []
                yield _sse(chunk)
            yield _sse("[DONE]")
        finally:
            await self.close()

    async def close(self) -> None:
        """Idempotent: cancel the replica call if it is still running, record metrics, release admission."""
        if self._closed:
            return
        self._closed = True
        self.ingress._streams.discard(self)
        if self.finish_reason is None:
            self.gen.cancel()  # the engine replica aborts the request and frees its pages
        now = time.monotonic()
        m = self.ingress.metrics
        reason = self.finish_reason or ("error" if self.failed else "abort")
        m.inc("diffkv_requests_finished_total", endpoint=self.endpoint, reason=reason)
        if self.finish_reason is not None:
            m.observe("diffkv_e2e_request_latency_seconds", now - self.t0, endpoint=self.endpoint)
            if self.t_first is not None and self.completion_tokens > 1:
                m.observe("diffkv_request_time_per_output_token_seconds",
                          (now - self.t_first) / (self.completion_tokens - 1), endpoint=self.endpoint)
        self.ingress.admission.release()
        self.ingress._publish_admission_gauges()
        if self.error_event is not None:
            self._log_error_event()

    def _log_error_event(self) -> None:
        """Serve's access line for a stream says 200, the status its headers carried; this line, beside it,
        says what the client read last: an error event, not a finished answer."""
        e = self.error_event
        log.warning("POST %s %s: 200 streamed, then ended with an error event after %d tokens: %d %s: %s",
                    _PATHS[self.endpoint], self.rid, self.completion_tokens, e.status, e.type, e.message)


class _SSEResponse(StreamingResponse):
    """An SSE response that closes its request however the response ends, even if the client left before
    the body started (then the body's own `finally` never runs)."""

    def __init__(self, stream: _Stream, body: AsyncIterator[str]):
        super().__init__(body, media_type="text/event-stream", headers={"Cache-Control": "no-cache"})
        self._stream = stream

    async def __call__(self, scope, receive, send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            await self._stream.close()
