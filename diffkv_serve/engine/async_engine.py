"""AsyncLLMEngine: one LLMEngine driven by a background thread, streamed to asyncio coroutines.

LLMEngine is not thread-safe, so every engine call (add_request, abort, step, stats) runs on the step
thread, or, while that thread is not running, inline on the caller's thread; either way under
`self._lock`. Coroutines hand work to the thread as commands (a FIFO, so an abort sent after an add is
always applied after it) and get results back through futures; step outputs travel to each request's
asyncio.Queue through `loop.call_soon_threadsafe`.

    aeng = AsyncLLMEngine(engine)
    await aeng.start()
    async for out in aeng.generate("req-1", "Hello", SamplingParams(max_tokens=16)):
        print(out.delta_text, end="")
    await aeng.shutdown()

A dead engine (a tensor-parallel worker lost: LLMEngine.step raised EngineDeadError) fails every request in
flight with EngineDeadError and every later generate() at once; the owner shuts it down and replaces it.
"""
from __future__ import annotations

import asyncio
import collections
import concurrent.futures
import logging
import threading
import time
from dataclasses import dataclass
from typing import Any, AsyncIterator, Callable, Optional, Union

from diffkv_serve.engine.errors import EngineDeadError
from diffkv_serve.engine.llm_engine import LLMEngine
from diffkv_serve.engine.sampling_params import SamplingParams
from diffkv_serve.engine.sequence import RequestOutput

log = logging.getLogger(__name__)


@dataclass(eq=False)
class _Stream:
    """Where one request's outputs go: a queue owned by the event loop that called generate()."""

    loop: asyncio.AbstractEventLoop
    queue: asyncio.Queue
    unfinished: int = 1  # sequences still to finish (SamplingParams.n); touched only on the step thread

    def put(self, item: Union[RequestOutput, BaseException, None]) -> None:
        """Thread-safe; an item is a RequestOutput, an exception (the step failed) or None (ended)."""
        try:
            self.loop.call_soon_threadsafe(self.queue.put_nowait, item)
        except RuntimeError:  # the consumer's loop is closed: nobody is listening any more
            pass


class AsyncLLMEngine:
    def __init__(self, engine: LLMEngine,
                 on_step: Optional[Callable[[list[RequestOutput], float], None]] = None):
        self.engine = engine
        # Called on the step thread after each successful step with (outputs, step seconds): the service's
        # per-step metrics (batch size, memory-management time). Its errors are logged, never raised.
        self.on_step = on_step
        self._lock = threading.Lock()  # held around every engine call
        self._cmd_lock = threading.Lock()  # guards _cmds and _accepting
        self._cmds: collections.deque[tuple[Callable[[], Any], concurrent.futures.Future]] = collections.deque()
        self._accepting = False  # the step thread takes commands
        self._stopping = False
        self._wake = threading.Event()
        self._thread: Optional[threading.Thread] = None
        self._streams: dict[str, _Stream] = {}  # in-flight requests; touched only under _lock

    # ---- lifecycle -----------------------------------------------------------------------------------
    @property
    def running(self) -> bool:
        return self._thread is not None and not self._stopping

    async def start(self) -> None:
        """Start the step thread (idempotent)."""
        if self._thread is not None:
            return
        self._stopping = False
        with self._cmd_lock:
            self._accepting = True
        self._thread = threading.Thread(target=self._run_loop, name="llm-engine-step", daemon=True)
        self._thread.start()

    async def shutdown(self) -> None:
        """Abort every request in flight (their iterators end), stop and join the step thread, then shut the
        engine down (its workers are released; idempotent)."""
        thread = self._thread
        if thread is not None:
            self._stopping = True
            self._wake.set()
            await asyncio.to_thread(thread.join)
            self._thread = None
        await asyncio.to_thread(self._shutdown_engine)

    def _shutdown_engine(self) -> None:
        with self._lock:
            self.engine.shutdown()

    def is_healthy(self) -> bool:
        return self.engine.is_healthy()

    async def check_health(self) -> None:
        """Raise EngineDeadError if the engine is dead or one of its workers is gone (runs between steps)."""
        if not self.engine.is_healthy():
            self.engine.check_health()  # raises with the reason
        await self._call(self.engine.check_health)

    async def __aenter__(self) -> "AsyncLLMEngine":
        await self.start()
        return self

    async def __aexit__(self, *exc) -> None:
        await self.shutdown()

    # ---- requests ------------------------------------------------------------------------------------
    async def generate(self, request_id: str, prompt: Union[str, list[int]],
                       sampling: Optional[SamplingParams] = None,
                       kv_compression: Optional[dict] = None) -> AsyncIterator[RequestOutput]:
        """Stream this request's outputs, ending after the finished one (with SamplingParams.n > 1: the outputs
        of its n sequences, interleaved, each with its `index`, ending once all n finished).

        The request is validated and queued when iteration starts: a bad request raises
        InvalidRequestError from the first `__anext__`, before any output. If the engine is dead, or dies
        while the request runs, the iterator raises EngineDeadError; if a step fails otherwise it raises
        RuntimeError (its __cause__ is the step's error). If the consumer stops early (break + aclose(),
        cancellation), the request is aborted and its pages are freed.
        """
        if not self.engine.is_healthy():
            self.engine.check_health()  # raises EngineDeadError with the reason, before anything is queued
        if not self.running:
            raise RuntimeError("AsyncLLMEngine is not running; call start() first")
        n = sampling.n if sampling is not None else 1
        stream = _Stream(asyncio.get_running_loop(), asyncio.Queue(), n)

        def add() -> None:
            if self._stopping:
                raise RuntimeError("AsyncLLMEngine is shutting down")
            self.engine.add_request(request_id, prompt, sampling, kv_compression=kv_compression)
            self._streams[request_id] = stream  # only once the engine accepted it

        done = False
        unfinished = n
        try:
            await self._call(add)
            while True:
                item = await stream.queue.get()
                if item is None:  # aborted without a final output
                    done = True
                    return
                if isinstance(item, EngineDeadError):
                    done = True
                    raise EngineDeadError(f"request {request_id!r} failed: {item}") from item
                if isinstance(item, BaseException):
                    done = True
                    raise RuntimeError(f"engine step failed for request {request_id!r}: {item!r}") from item
                if item.finished:
                    unfinished -= 1
                    done = unfinished == 0
                yield item
                if done:
                    return
        finally:
            if not done:
                # The consumer went away (or add() failed / never ran). Abort only if this stream is still
                # the request's stream: the id may belong to another request (duplicate id) or be finished.
                fut = self._submit(lambda: self._abort_locked(request_id, only=stream))
                try:
                    await asyncio.wrap_future(fut)
                except asyncio.CancelledError:
                    raise
                except Exception:  # pragma: no cover - abort itself failing must not mask the exit
                    log.exception("aborting request %s failed", request_id)

    async def abort(self, request_id: str) -> bool:
        """Abort a request; its iterator yields a final output with finish_reason 'abort' and ends.

        Returns False if the request is unknown or already finished."""
        return await self._call(lambda: self._abort_locked(request_id))

    async def stats(self) -> dict[str, Any]:
        return await self._call(self.engine.stats)

    # ---- commands ------------------------------------------------------------------------------------
    async def _call(self, fn: Callable[[], Any]) -> Any:
        return await asyncio.wrap_future(self._submit(fn))

    def _submit(self, fn: Callable[[], Any]) -> concurrent.futures.Future:
        """Queue fn for the step thread; when that thread is not taking commands, run it here."""
        fut: concurrent.futures.Future = concurrent.futures.Future()
        with self._cmd_lock:
            if self._accepting:
                self._cmds.append((fn, fut))
                self._wake.set()
                return fut
        self._execute(fn, fut)
        return fut

    def _execute(self, fn: Callable[[], Any], fut: concurrent.futures.Future) -> None:
        if not fut.set_running_or_notify_cancel():
            return
        try:
            with self._lock:
                result = fn()
        except BaseException as e:  # noqa: BLE001 - handed to the awaiting coroutine
            fut.set_exception(e)
        else:
            fut.set_result(result)

    def _drain(self) -> None:
        while True:
            with self._cmd_lock:
                if not self._cmds:
                    return
                fn, fut = self._cmds.popleft()
            self._execute(fn, fut)

    def _abort_locked(self, request_id: str, only: Optional[_Stream] = None) -> bool:
        """Under _lock. Abort in the engine and end the request's stream with a final 'abort' output."""
        stream = self._streams.get(request_id)
        if only is not None and stream is not only:
            return False
        self._streams.pop(request_id, None)
        seqs = self.engine.sequences(request_id)
        aborted = self.engine.abort(request_id)
        if stream is not None:
            finals: list[Optional[RequestOutput]] = []
            for seq in seqs:
                seq.finish_time = time.monotonic()
                try:
                    finals.append(self.engine.output(seq))  # finished, finish_reason "abort", rest of the text
                except Exception:  # pragma: no cover - the stream still has to end
                    log.exception("building the abort output of %s failed", seq.request_id)
            if len(finals) < stream.unfinished or None in finals:
                finals = [f for f in finals if f is not None] + [None]  # None ends the stream as it is
            for final in finals:
                stream.put(final)
        return aborted

    # ---- the step thread -----------------------------------------------------------------------------
    def _run_loop(self) -> None:
        try:
            while True:
                self._drain()
                if self._stopping:
                    break
                with self._lock:
                    busy = self.engine.has_unfinished_requests()
                    if busy:
                        self._step_locked()
                if not busy:
                    self._wake.wait()
                    self._wake.clear()  # commands queued before a set() are drained at the top
        finally:
            with self._cmd_lock:
                self._accepting = False  # from now on commands run inline on their callers' threads
            self._drain()
            with self._lock:
                for rid in list(self._streams) + list(self.engine.requests):
                    self._abort_locked(rid)

    def _step_locked(self) -> None:
        t0 = time.perf_counter()
        try:
            outputs = self.engine.step()
        except Exception as e:
            log.exception("engine step failed; failing %d in-flight request(s)", len(self.engine.requests))
            for rid in list(self.engine.requests):
                try:
                    self.engine.abort(rid)
                except Exception:  # pragma: no cover
                    log.exception("aborting %s after a failed step failed", rid)
            streams, self._streams = self._streams, {}
            for stream in streams.values():
                stream.put(e)
            return
        for out in outputs:
            stream = self._streams.get(out.request_id)
            if stream is None:
                continue
            if out.finished:
                stream.unfinished -= 1
                if stream.unfinished == 0:
                    del self._streams[out.request_id]
            stream.put(out)
        if self.on_step is not None:
            try:
                self.on_step(outputs, time.perf_counter() - t0)
            except Exception:  # pragma: no cover - observing a step must never break it
                log.exception("on_step callback failed")
