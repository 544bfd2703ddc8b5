"""The daemon side of the protocol: requests in flight, typed calls, and the in-process host.

A :class:`Host` is one loaded runtime seen from the daemon. Callers use its typed methods from
any thread: the engine ``tokenize`` and ``start_generate``; the warm-state cache the KV
operations of its own protocol (``modeld/cache/runtime.py``'s ``KVRuntime``: ``copy``, ``drop``,
``sync``, ``snapshot``, ``save``, ``restore``, with typed results). Each is one protocol request with its
own operation id, so several sessions can have requests in flight at once and the engine side
interleaves them (``modeld/workers/scheduler.py``). A job can be cancelled by message
(:meth:`Call.cancel`).

Two hosts implement the transport: :class:`InlineHost` runs the scheduler on a thread of this
process (the memory backend in tests and for ``--isolation inline``), and
``modeld/workers/proxy.py``'s ``WorkerHost`` runs it in a supervised child process. When a
host dies every call in flight fails at once with the host's ``death`` error, and the host is
never used again (a new one replaces it: nuke and repave, never replay).
"""

from __future__ import annotations

import contextlib
import itertools
import queue
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from typing import TYPE_CHECKING, TypeVar

from modeld.backends.base import Layout, ModelRuntime, SyncStep, Vocab
from modeld.cache.runtime import KVRuntime, Restored, Saved, SyncEnd
from modeld.cache.snapfile import SnapshotFile
from modeld.contract import DecodeConfig
from modeld.errors import EngineError, ModeldError, error_from_reason
from modeld.workers.protocol import (
    REFUSED,
    Cancel,
    Close,
    Copy,
    Drop,
    Failed,
    Finished,
    Generate,
    Grant,
    Load,
    Loaded,
    Message,
    Progress,
    Restore,
    Result,
    Room,
    Save,
    Share,
    Snapshot,
    Sync,
    Tokenize,
    Tokens,
)
from modeld.workers.scheduler import Scheduler

__all__ = ["Call", "Host", "InlineHost", "SyncCall"]

_M = TypeVar("_M", bound=Message)
_FINAL = (Result, Finished, Failed, Loaded)


_DEATH_WAIT = 5.0
"""Seconds a failed send waits for the worker's death to be classified (normally milliseconds)."""


class Call:
    """One request in flight: its replies arrive in order; the last one is final."""

    def __init__(self, host: Host, op: int, kind: str) -> None:
        self.host = host
        self.op = op
        self.kind = kind
        self._replies: queue.SimpleQueue[Message | BaseException] = queue.SimpleQueue()
        self._done = False
        self._cancel_sent = False
        self._choices_sent: set[int] = set()

    def deliver(self, message: Message | BaseException) -> None:
        self._replies.put(message)

    def next_event(self, timeout: float | None = None) -> Message | None:
        """The next reply, or None if none came within ``timeout`` seconds (a ``Failed`` reply
        or the host's death is raised)."""
        if self._done:
            raise EngineError(f"the {self.kind} request already ended")
        try:
            item = self._replies.get(timeout=timeout)
        except queue.Empty:
            return None
        if isinstance(item, BaseException):
            self._done = True
            raise item
        if isinstance(item, Failed):
            self._done = True
            self.host.forget(self.op)
            raise error_from_reason(item.reason, item.message, dict(item.details))
        if isinstance(item, _FINAL):
            self._done = True
            self.host.forget(self.op)
        return item

    @property
    def done(self) -> bool:
        return self._done

    def events(self) -> Iterator[Message]:
        """Every reply up to and including the final one; a ``Failed`` reply is raised."""
        while not self._done:
            item = self.next_event()
            if item is not None:
                yield item

    def result(self, kind: type[_M]) -> _M:
        """Wait for the final reply, which must be a ``kind``."""
        final: Message | None = None
        for reply in self.events():
            final = reply
        if not isinstance(final, kind):
            raise EngineError(f"the engine answered {self.kind} with {type(final).__name__}")
        return final

    def cancel(self) -> None:
        """Ask the engine to stop this job before its next step (idempotent, never blocks)."""
        if not self._done and not self._cancel_sent:
            self._cancel_sent = True
            self.host.send_cancel(self.op)

    def grant(self, cells: int) -> None:
        """Let a generate job paused at its cell limit (a ``Room`` reply) fill ``cells`` more;
        0: it ends there (never blocks)."""
        if not self._done:
            self.host.send_grant(self.op, cells)

    def cancel_choice(self, choice: int) -> None:
        """Ask the engine to stop one choice of this generate job (``Generate.forks``); its other
        choices go on (idempotent, never blocks)."""
        if not self._done and not self._cancel_sent and choice not in self._choices_sent:
            self._choices_sent.add(choice)
            self.host.send_cancel(self.op, choice)


class Host:
    """A loaded runtime seen from the daemon (transport-neutral part)."""

    def __init__(self) -> None:
        self._ops = itertools.count(1)
        self._calls: dict[int, Call] = {}
        self._paused: set[int] = set()
        """Generate jobs paused at their cell limit (``Room``), until granted more."""
        self._lock = threading.Lock()
        self.layout: Layout | None = None
        self.vocab: Vocab | None = None
        self.pid = 0
        self.base_rss = 0
        """The worker's resident memory just before its model loaded (``Loaded.base_rss``)."""
        self.checkpoint_bytes: tuple[int, ...] = ()
        """What each sequence's checkpoints hold in the worker, by sequence, as its last reply
        that said so (``Result``, ``Finished``; ``ModelRuntime.checkpoint_bytes``)."""
        self.death: ModeldError | None = None
        self.started_at = time.time()
        self.last_reply_at = time.monotonic()
        self.tokens_done = 0
        """Progress counter: tokens evaluated or generated by this host (the stall watchdog's)."""

    # --- transport (subclasses) --------------------------------------------------------------------

    def _transmit(self, op: int, message: Message) -> None:
        raise NotImplementedError

    # --- requests ----------------------------------------------------------------------------------

    def call(self, message: Message) -> Call:
        """Send a request; the reply (or the host's death) arrives on the returned call."""
        with self._lock:
            op = next(self._ops)
            call = Call(self, op, message.kind)
            if self.death is not None:
                call.deliver(self.death)
                return call
            self._calls[op] = call
        try:
            self._transmit(op, message)
        except OSError as exc:
            self.forget(op)
            # The worker died under the send (EPIPE): the reader classifies its death (the
            # signal, a model file changed under it) as soon as it sees the socket's EOF; the
            # caller learns that rather than "broken pipe" (seen as a race on a loaded machine).
            deadline = time.monotonic() + _DEATH_WAIT
            while self.death is None and time.monotonic() < deadline:
                time.sleep(0.01)
            call.deliver(self.death or EngineError(f"the engine worker is gone: {exc}"))
        return call

    def send_cancel(self, op: int, choice: int = -1) -> None:
        if self.death is None:
            with contextlib.suppress(OSError):
                self._transmit(next(self._ops), Cancel(op, choice))

    def send_grant(self, op: int, cells: int) -> None:
        with self._lock:
            self._paused.discard(op)
        if self.death is None:
            with contextlib.suppress(OSError):
                self._transmit(next(self._ops), Grant(op, cells))

    def forget(self, op: int) -> None:
        with self._lock:
            self._calls.pop(op, None)
            self._paused.discard(op)

    def dispatch(self, op: int, message: Message) -> None:
        """A reply arrived (called by the transport)."""
        self.last_reply_at = time.monotonic()
        if isinstance(message, Tokens):
            self.tokens_done += len(message.tokens)
        elif isinstance(message, Progress):
            self.tokens_done += 1  # a batch step counts as progress even before it is big
        if isinstance(message, (Result, Finished)) and message.checkpoint_bytes is not None:
            self.checkpoint_bytes = message.checkpoint_bytes
        with self._lock:
            call = self._calls.get(op)
            if isinstance(message, Room):
                self._paused.add(op)  # waiting for the daemon, not for the engine
        if call is not None:
            call.deliver(message)

    def fail_all(self, error: ModeldError) -> None:
        """The runtime is gone: every call in flight fails at once with ``error``."""
        with self._lock:
            if self.death is None:
                self.death = error
            calls = list(self._calls.values())
            self._calls.clear()
        for call in calls:
            call.deliver(error)

    @property
    def busy(self) -> bool:
        """Requests in flight that wait for the engine (a generate job paused for room waits for
        the daemon: no stall)."""
        with self._lock:
            return len(self._calls) > len(self._paused)

    @property
    def alive(self) -> bool:
        return self.death is None

    # --- typed operations ------------------------------------------------------------------------

    def load(self, message: Load) -> None:
        loaded = self.call(message).result(Loaded)
        self.layout = loaded.layout
        self.vocab = loaded.vocab()
        self.pid = loaded.pid
        self.base_rss = loaded.base_rss

    def tokenize(self, text: str, *, add_bos: bool) -> list[int]:
        return list(self.call(Tokenize(text, add_bos)).result(Result).tokens)

    def start_generate(
        self,
        seq: int,
        config: DecodeConfig,
        max_tokens: int,
        interval: float = 0.0,
        forks: Sequence[int] = (),
        cells: int = 0,
    ) -> Call:
        """A generate job; tokens that come faster than ``interval`` seconds arrive together.
        ``forks``: the further sequences its choices decode on (``Generate.forks``); ``cells``:
        the KV cells it may fill before it asks for more (``Generate.cells``, 0: no limit)."""
        return self.call(Generate(seq, config, max_tokens, interval, tuple(forks), cells))

    # --- the cache's KV operations (modeld.cache.runtime.KVRuntime) ---------------------------------

    def copy(self, src: int, dst: int, n: int) -> None:
        self.call(Copy(src, dst, n)).result(Result)

    def drop(self, seq: int) -> None:
        self.call(Drop(seq)).result(Result)

    def share(self, src: int, dst: int, n: int) -> bool:
        return self.call(Share(src, dst, n)).result(Result).ok

    def sync(
        self, seq: int, keep: int, tokens: Sequence[int], segments: Sequence[int] | None = None
    ) -> SyncCall:
        marks = None if segments is None else tuple(segments)
        return SyncCall(self.call(Sync(seq, keep, tuple(tokens), marks)))

    def snapshot(self, seq: int) -> SnapshotCall:
        return SnapshotCall(self.call(Snapshot(seq)))

    def save(self, seq: int, path: str) -> SaveCall:
        return SaveCall(self.call(Save(seq, path)))

    def restore(self, seq: int, tokens: Sequence[int], blob: bytes | SnapshotFile) -> Restored:
        """Load a snapshot into ``seq``: a RAM blob, or a snapshot file the worker maps and
        verifies itself (``seq`` is empty when it was not restored)."""
        if isinstance(blob, SnapshotFile):
            message = Restore(seq, tuple(tokens), path=str(blob.path.absolute()), header=blob.header)
        else:
            message = Restore(seq, tuple(tokens), payload=blob)
        result = self.call(message).result(Result)
        if result.ok:
            return Restored(True)
        return Restored(False, result.detail or REFUSED, refused=result.detail in ("", REFUSED))

    def close(self) -> None:
        """Free the model and end the host (never raises)."""
        raise NotImplementedError


class SyncCall:
    """A sync job in flight, read as the cache's typed events (``KVRuntime.sync``)."""

    def __init__(self, call: Call) -> None:
        self.call = call

    def next_event(self, timeout: float | None = None) -> SyncStep | SyncEnd | None:
        event = self.call.next_event(timeout)
        if event is None:
            return None
        if isinstance(event, Progress):
            return event.step()
        if isinstance(event, Finished):
            return SyncEnd(event.resident, event.kept, event.canceled)
        raise EngineError(f"the engine answered sync with {type(event).__name__}")

    def wait(self) -> SyncEnd:
        final = self.call.result(Finished)
        return SyncEnd(final.resident, final.kept, final.canceled)

    def cancel(self) -> None:
        self.call.cancel()


class SnapshotCall:
    """A snapshot in flight (``KVRuntime.snapshot``): its request is already on its way."""

    def __init__(self, call: Call) -> None:
        self.call = call

    def result(self) -> bytes:
        return self.call.result(Result).payload


class SaveCall:
    """A save in flight (``KVRuntime.save``): its request is already on its way."""

    def __init__(self, call: Call) -> None:
        self.call = call

    def result(self) -> Saved:
        final = self.call.result(Result)
        if final.ok:
            return Saved(True, final.size)
        return Saved(False, detail=final.detail, errno=final.errno)


if TYPE_CHECKING:

    def _conformance(host: Host) -> KVRuntime:  # Host implements the cache's runtime protocol
        return host


class InlineHost(Host):
    """The scheduler on a thread of this process; messages pass as objects, unencoded."""

    def __init__(self, loader: Callable[[Load], tuple[ModelRuntime, int]], name: str = "engine") -> None:
        super().__init__()
        self._scheduler = Scheduler(self._reply, loader)
        self._thread = threading.Thread(target=self._run, name=f"engine-{name}", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        try:
            self._scheduler.run()
        finally:
            self.fail_all(EngineError("the in-process engine stopped"))

    def _reply(self, op: int, message: Message) -> None:
        self.dispatch(op, message)

    def _transmit(self, op: int, message: Message) -> None:
        self._scheduler.submit(op, message)

    def close(self) -> None:
        if self.death is None and self._thread.is_alive():
            with contextlib.suppress(ModeldError):
                self.call(Close()).result(Result)
        self._thread.join(timeout=30)
        self.fail_all(EngineError("the engine was closed"))
