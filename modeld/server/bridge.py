"""The one asyncio bridge between the listeners' event loops and the synchronous contract.

What: the gRPC servicer and every HTTP API run on an event loop; the engine's sessions are
synchronous and may block for minutes (a model load, a long prefill) or seconds (a decode
step, an observer waiting on a stalled worker). This module is the only place that crosses
between the two:

* :class:`Pools`: four thread pools, so what one kind of call does to its pool never starves
  the others. ``sessions``: a session's operations (prefills, the decode pump, close);
  ``calls``: opening sessions and counting tokens (may load a model: minutes, no timeout);
  ``probes``: describing a model file, with a timeout (a hung file system costs this pool, and
  its callers a clear ``model_load_failed``); ``observers``: status, sessions, explain-context
  and metrics, with a timeout (``busy``), so they answer while every session is busy.
* :class:`Bridge`: ``call`` (run on a pool, never holding the loop; what an abandoned call
  made is cleaned up), ``observe`` (the observers pool with its timeout) and ``session``.
* :class:`BridgedSession`: a hosted session as the contract's :class:`~modeld.contract.
  AsyncSession`. Progress callbacks run on the loop. A cancelled await interrupts the engine's
  work (a prefill stops within one batch); :meth:`BridgedSession.when_idle` says when the
  session has really stopped, so it is never used by two operations at once.
* :class:`BridgedStream`: a decode as an :class:`~modeld.contract.AsyncDecodeStream`. One
  pool thread alone iterates the engine's stream and posts chunks to the loop; ``cancel`` is
  immediate and safe from any thread; the pump reads the stream to its end.

What not: no protobuf, no HTTP, no engine import; error mapping stays with each transport.
Why: the servicer and the HTTP app used to wrap the contract two ways, and the HTTP app called
``status()`` and the metrics on its event loop (``blueprints/0007-wire.md``).
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import logging
import threading
from collections.abc import AsyncIterator, Awaitable, Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any, TypeVar

from modeld.contract import (
    ContextReport,
    DecodeConfig,
    DecodeStream,
    ModelInfo,
    PrefillProgress,
    PrefixInput,
    PrefixStatus,
    ProgressCallback,
    StreamChunk,
    SuffixInput,
    SuffixStatus,
)
from modeld.errors import BusyError, ModeldError
from modeld.manifest import ContextManifest
from modeld.server.gateway import TransportSession

__all__ = [
    "OBSERVER_TIMEOUT_SECONDS",
    "Bridge",
    "BridgedSession",
    "BridgedStream",
    "Pools",
    "post",
]

log = logging.getLogger("modeld.server")

OBSERVER_TIMEOUT_SECONDS = 5.0
"""How long status, sessions, explain-context and metrics wait for the engine before answering
``busy``."""
OBSERVER_THREADS = 4
PROBE_THREADS = 16
PUMP_WAIT_SECONDS = 30.0
"""How long closing a session waits for its decode pump to stop reading."""

_T = TypeVar("_T")
_A = TypeVar("_A")


@dataclass(frozen=True, slots=True)
class Pools:
    """The thread pools engine calls run on (see the module docstring)."""

    sessions: ThreadPoolExecutor
    calls: ThreadPoolExecutor
    probes: ThreadPoolExecutor
    observers: ThreadPoolExecutor

    @classmethod
    def for_sessions(cls, max_sessions: int) -> Pools:
        """Pools sized for ``max_sessions`` (threads start only when needed)."""
        return cls(
            sessions=ThreadPoolExecutor(max_workers=max_sessions + 8, thread_name_prefix="session-op"),
            calls=ThreadPoolExecutor(max_workers=max_sessions + 16, thread_name_prefix="engine-call"),
            probes=ThreadPoolExecutor(max_workers=PROBE_THREADS, thread_name_prefix="describe"),
            observers=ThreadPoolExecutor(max_workers=OBSERVER_THREADS, thread_name_prefix="observe"),
        )

    def shutdown(self) -> None:
        for pool in (self.sessions, self.calls, self.probes, self.observers):
            pool.shutdown(wait=False, cancel_futures=True)


def post(loop: asyncio.AbstractEventLoop, queue: asyncio.Queue[Any], item: object) -> None:
    """Put ``item`` in an asyncio queue from any thread (dropped once the loop is closed)."""
    with contextlib.suppress(RuntimeError):
        loop.call_soon_threadsafe(queue.put_nowait, item)


def _retrieve(future: asyncio.Future[Any]) -> None:
    """Mark a future's exception as seen (its caller may have gone away)."""
    if not future.cancelled():
        future.exception()


def _abandon(future: concurrent.futures.Future[_T], abandoned: Callable[[_T], None]) -> None:
    if future.cancelled() or future.exception() is not None:
        return
    try:
        abandoned(future.result())
    except Exception:
        log.exception("cleaning up after an abandoned call failed")


async def offload(
    pool: ThreadPoolExecutor,
    fn: Callable[..., _T],
    *args: Any,
    timeout: float | None = None,
    on_timeout: Callable[[], ModeldError] | None = None,
    abandoned: Callable[[_T], None] | None = None,
) -> _T:
    """Run ``fn(*args)`` on ``pool`` and wait for it without holding the event loop.

    ``timeout``: give up waiting (the thread finishes on its own) and raise ``on_timeout()``.
    ``abandoned``: called with the result if the caller stopped waiting (cancelled or timed
    out) and ``fn`` still succeeded, so what it made (an opened session) is not leaked."""
    inner = pool.submit(fn, *args)
    future = asyncio.wrap_future(inner)
    future.add_done_callback(_retrieve)
    try:
        if timeout is None:
            return await future
        return await asyncio.wait_for(asyncio.shield(future), timeout)
    except BaseException as exc:
        if not inner.done():
            inner.cancel()  # never started: it never will
            if abandoned is not None:
                inner.add_done_callback(lambda f: _abandon(f, abandoned))
        if isinstance(exc, TimeoutError) and on_timeout is not None:
            raise on_timeout() from None
        raise


class Bridge:
    """The listeners' way into the synchronous engine (see the module docstring)."""

    def __init__(self, pools: Pools, *, observer_timeout: float = OBSERVER_TIMEOUT_SECONDS) -> None:
        self.pools = pools
        self.observer_timeout = observer_timeout

    async def call(
        self,
        fn: Callable[..., _T],
        *args: Any,
        abandoned: Callable[[_T], None] | None = None,
    ) -> _T:
        """Run a call that may load a model (no timeout) on the ``calls`` pool."""
        return await offload(self.pools.calls, fn, *args, abandoned=abandoned)

    async def probe(
        self, fn: Callable[..., _T], *args: Any, timeout: float, late: Callable[[], ModeldError]
    ) -> _T:
        """Run a call that reads model files on the ``probes`` pool, giving up after ``timeout``."""
        return await offload(self.pools.probes, fn, *args, timeout=timeout, on_timeout=late)

    async def observe(self, fn: Callable[[], _T], what: str) -> _T:
        """Run an observer on its pool; ``busy`` if the engine does not answer in time."""

        def late() -> ModeldError:
            return BusyError(
                f"the engine did not answer {what} within {self.observer_timeout:g}s "
                "(an engine worker may be stalled; it is killed after the stall timeout)"
            )

        return await offload(self.pools.observers, fn, timeout=self.observer_timeout, on_timeout=late)

    def session(self, hosted: TransportSession) -> BridgedSession:
        return BridgedSession(hosted, self.pools.sessions)

    def shutdown(self) -> None:
        self.pools.shutdown()


class BridgedSession:
    """A hosted session as the contract's ``AsyncSession`` (one operation at a time)."""

    def __init__(self, hosted: TransportSession, pool: ThreadPoolExecutor) -> None:
        self.hosted = hosted
        self._pool = pool
        self._lock = threading.Lock()
        self._running = 0  # operations (and decode pumps) not yet finished on their threads
        self._idle: list[Callable[[], None]] = []

    @property
    def session_id(self) -> str:
        return self.hosted.session_id

    @property
    def info(self) -> ModelInfo:
        return self.hosted.session.info

    @property
    def identity(self) -> ContextManifest:
        return self.hosted.session.identity

    # --- bookkeeping: when is the session really idle -------------------------------------

    def _begin(self) -> None:
        with self._lock:
            self._running += 1

    def _end(self) -> None:
        with self._lock:
            self._running -= 1
            callbacks = self._idle if self._running == 0 else []
            if callbacks:
                self._idle = []
        for callback in callbacks:
            try:
                callback()
            except Exception:
                log.exception("a session-idle callback failed")

    def when_idle(self, callback: Callable[[], None]) -> None:
        """Call ``callback`` (on any thread) once no operation of this session runs any more:
        at once if none does. A cancelled await leaves its operation running until the engine
        has stopped; this is when the session may be used, or closed, again."""
        with self._lock:
            if self._running:
                self._idle.append(callback)
                return
        callback()

    def interrupt(self) -> None:
        """Stop what the session runs (its client went away); quick, safe from any thread."""
        self.hosted.interrupt()

    async def _run(
        self, fn: Callable[..., _T], *args: Any, abandoned: Callable[[_T], None] | None = None
    ) -> _T:
        """Run ``fn(*args)`` on the sessions pool. A cancelled await interrupts the engine; the
        operation counts as running until its thread returns. ``abandoned``: called with the
        result when the await was cancelled but ``fn`` still succeeded (a decode stream
        nobody will read)."""
        call = _Call()

        def finished(f: concurrent.futures.Future[_T]) -> None:
            with call.lock:
                call.done = True
                give_up = call.abandoned
            try:
                if give_up and abandoned is not None:
                    _abandon(f, abandoned)
            finally:
                self._end()

        self._begin()
        try:
            inner = self._pool.submit(fn, *args)
        except BaseException:
            self._end()
            raise
        inner.add_done_callback(finished)
        future = asyncio.wrap_future(inner)
        future.add_done_callback(_retrieve)
        try:
            return await future
        except asyncio.CancelledError:
            if not inner.cancel():  # it runs (or ran): stop it; cancel() ends a queued one
                self.interrupt()
                with call.lock:
                    late = call.done
                    call.abandoned = True
                if late and abandoned is not None:
                    _abandon(inner, abandoned)
            raise

    # --- the contract ---------------------------------------------------------------------

    async def ensure_prefix(
        self, prefix: PrefixInput, progress: ProgressCallback | None = None
    ) -> PrefixStatus:
        return await self._run(self.hosted.session.ensure_prefix, prefix, _on_loop(progress))

    async def prefill_suffix(
        self, suffix: SuffixInput, progress: ProgressCallback | None = None
    ) -> SuffixStatus:
        return await self._run(self.hosted.session.prefill_suffix, suffix, _on_loop(progress))

    async def reporting(
        self, operation: Callable[[_A, ProgressCallback | None], Awaitable[_T]], argument: _A
    ) -> AsyncIterator[PrefillProgress | _T]:
        """Run ``ensure_prefix``/``prefill_suffix`` (bound methods of this object), yielding
        its progress reports as they come, then its result."""
        out: asyncio.Queue[PrefillProgress] = asyncio.Queue()
        task = asyncio.ensure_future(operation(argument, out.put_nowait))
        try:
            while not task.done():
                getter = asyncio.ensure_future(out.get())
                done, _ = await asyncio.wait({task, getter}, return_when=asyncio.FIRST_COMPLETED)
                if getter in done:
                    yield getter.result()
                else:
                    getter.cancel()
            while not out.empty():
                yield out.get_nowait()
            yield task.result()
        finally:
            if not task.done():
                task.cancel()

    async def decode(self, config: DecodeConfig) -> BridgedStream:
        stream = await self._run(self.hosted.session.decode, config, abandoned=self._close_stream)
        return BridgedStream(stream, self)

    def _close_stream(self, stream: DecodeStream) -> None:
        """A decode started after its caller went away: stop it and read it to its end."""
        self._begin()

        def close() -> None:
            try:
                stream.close()
            finally:
                self._end()

        threading.Thread(target=close, name="decode-close", daemon=True).start()

    async def explain_context(self) -> ContextReport:
        return await self._run(self.hosted.session.explain_context)

    async def close(self) -> None:
        await self._run(self.hosted.close)


def _on_loop(progress: ProgressCallback | None) -> ProgressCallback | None:
    """``progress`` called on the running loop, whatever thread reports."""
    if progress is None:
        return None
    loop = asyncio.get_running_loop()

    def report(step: PrefillProgress) -> None:
        with contextlib.suppress(RuntimeError):  # the loop is closed: nobody listens
            loop.call_soon_threadsafe(progress, step)

    return report


_EOF = object()


class _Call:
    """One operation's hand-over between its thread and a cancelled await."""

    __slots__ = ("abandoned", "done", "lock")

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.done = False
        self.abandoned = False


@dataclass(frozen=True, slots=True)
class _Failed:
    error: BaseException


class BridgedStream:
    """A decode as an ``AsyncDecodeStream``: one pool thread pumps the engine's stream.

    Iterate it to get the chunks; :meth:`cancel` (or :meth:`cancel_now` from any thread) stops
    the engine within one step and the stream ends with its final ``canceled`` chunk. A stream
    left unread is cancelled when the caller stops iterating (:meth:`aclose`)."""

    def __init__(self, stream: DecodeStream, owner: BridgedSession) -> None:
        self._stream = stream
        self._owner = owner
        self._queue: asyncio.Queue[object] = asyncio.Queue()
        self._started = False
        self._finished = False

    def _start(self) -> None:
        self._started = True
        loop = asyncio.get_running_loop()
        queue = self._queue
        stream = self._stream
        owner = self._owner

        def pump() -> None:
            try:
                for chunk in stream:
                    post(loop, queue, chunk)
                post(loop, queue, _EOF)
            except BaseException as exc:
                post(loop, queue, _Failed(exc))
            finally:
                owner._end()

        owner._begin()
        try:
            owner._pool.submit(pump)
        except BaseException:
            owner._end()
            raise

    def __aiter__(self) -> AsyncIterator[StreamChunk]:
        return self

    async def __anext__(self) -> StreamChunk:
        if self._finished:
            raise StopAsyncIteration
        if not self._started:
            self._start()
        try:
            item = await self._queue.get()
        except asyncio.CancelledError:
            self.cancel_now()
            raise
        if item is _EOF:
            self._finished = True
            raise StopAsyncIteration
        if isinstance(item, _Failed):
            self._finished = True
            raise item.error
        assert isinstance(item, StreamChunk)
        return item

    def cancel_now(self) -> None:
        """Stop the engine's decode within one step (non-blocking, any thread)."""
        self._stream.cancel()

    async def cancel(self) -> None:
        self.cancel_now()

    async def aclose(self) -> None:
        """Stop reading: a decode still running is cancelled; its pump reads it to its end (or
        a stream never iterated is closed on a pool thread)."""
        if self._finished:
            return
        self._finished = True
        self.cancel_now()
        if not self._started:
            stream = self._stream
            owner = self._owner
            owner._begin()

            def close() -> None:
                try:
                    stream.close()
                finally:
                    owner._end()

            try:
                owner._pool.submit(close)
            except BaseException:
                owner._end()
                threading.Thread(target=stream.close, name="decode-close", daemon=True).start()
