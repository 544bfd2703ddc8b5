"""The table of conversation sessions under the HTTP APIs: one warm session per conversation.

:class:`SessionTable` keeps at most ``max_conversations`` sessions by conversation key (model
and prompt format included); the least recently used idle one is closed to make room, one idle
for ``idle_seconds`` is closed by :meth:`SessionTable.sweep`. A request for a conversation whose
session is busy runs on a session of its own, closed when it finishes (sessions are not for
concurrent use), unless the session is busy only because the engine is finishing a turn whose
request is over: then it waits for it (:data:`FINISHING_WAIT`). A session goes back to its
conversation only once the engine has really stopped working on it (a cancelled request
interrupts the engine first). :class:`~modeld.server.http.conversations.Conversations` runs turns
on it (blueprint 0014).

A turn may leave its session a follow-up (:meth:`SessionTable.follow`): work on the same
session once the turn's engine work has stopped and before anyone else takes it (the prefix its
next turn will render, computed while the user reads: blueprint 0010, "Ahead of the next
turn"). The conversation stays busy meanwhile; a request for it waits for the follow-up (at most
:data:`AHEAD_WAIT`), which is computing what that request needs.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import threading
import time
from collections import OrderedDict
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass, field

from modeld.contract import OpenSessionRequest
from modeld.errors import LimitExceededError, ModeldError
from modeld.server.bridge import Bridge, BridgedSession
from modeld.server.gateway import Gateway, TransportSession

__all__ = ["AHEAD_WAIT", "FINISHING_WAIT", "FollowUp", "SessionTable"]

FINISHING_WAIT = 2.0
"""Seconds a request waits for its conversation's session when the turn before is over for its
client and only the engine is still finishing it (a decode's last bookkeeping after the answer
went out; a cancelled turn's engine stopping). An agent sends its next turn the moment it has
the answer: without the wait, that turn ran on a session of its own, closed after it, and the
conversation went on from the turn before it (computing again what it had computed)."""

AHEAD_WAIT = 120.0
"""Seconds a request waits for its conversation's session while a follow-up of the turn before
runs on it (a prefill of the prefix the next turn renders, whose tokens that request reuses).
The follow-up is at most one prefix's prefill; past this the request runs on a session of its
own, as it does when the conversation is busy."""

FollowUp = Callable[[BridgedSession], Awaitable[None]]
"""Work a turn leaves for its session (:meth:`SessionTable.follow`)."""

log = logging.getLogger("modeld.http")


@dataclass
class _Entry:
    hosted: TransportSession
    busy: bool
    last_used: float
    finishing: bool = False
    """Busy only until the engine has stopped: its request is over (:data:`FINISHING_WAIT`)."""
    ahead: bool = False
    """Busy with the turn's follow-up (:data:`AHEAD_WAIT`)."""
    waiters: list[tuple[asyncio.AbstractEventLoop, asyncio.Future[None]]] = field(default_factory=list)


class SessionTable:
    """Conversation key -> its session (thread-safe)."""

    def __init__(
        self, gateway: Gateway, bridge: Bridge, *, max_conversations: int, idle_seconds: float
    ) -> None:
        self._gateway = gateway
        self._bridge = bridge
        self.max_conversations = max_conversations
        self.idle_seconds = idle_seconds
        self._table: OrderedDict[tuple[str, str, str], _Entry] = OrderedDict()
        self._lock = threading.Lock()
        self._follow: dict[int, FollowUp] = {}  # id(BridgedSession) -> its turn's follow-up
        self._tasks: set[asyncio.Task[None]] = set()  # follow-ups running

    def __len__(self) -> int:
        with self._lock:
            return len(self._table)

    # --- sessions ---------------------------------------------------------------------------

    def _open(self, request: OpenSessionRequest) -> TransportSession:
        try:
            return self._gateway.open(request, "http", attached=True)
        except LimitExceededError as exc:
            if exc.limit not in ("max_loaded_models", "max_sessions"):
                raise
        # Idle conversations pin their models and sessions: let them go and try once more.
        self.close_idle()
        return self._gateway.open(request, "http", attached=True)

    @contextlib.asynccontextmanager
    async def session(self, key: str, request: OpenSessionRequest) -> AsyncIterator[BridgedSession]:
        """The conversation's session for one request (its own if the conversation is busy)."""
        k = (key, request.model_name, request.config.prompt_format)
        entry: _Entry | None = None
        asked = time.monotonic()
        while True:
            waiting: asyncio.Future[None] | None = None
            with self._lock:
                found = self._table.get(k)
                if found is not None and found.hosted.ended is not None:
                    del self._table[k]
                    found = None
                deadline = asked + (AHEAD_WAIT if found is not None and found.ahead else FINISHING_WAIT)
                if found is not None and not found.busy:
                    found.busy = True
                    self._table.move_to_end(k)
                    entry = found
                elif found is not None and (found.finishing or found.ahead) and time.monotonic() < deadline:
                    loop = asyncio.get_running_loop()
                    waiting = loop.create_future()
                    found.waiters.append((loop, waiting))
                shared = found is None
            if waiting is None:
                break
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(waiting, max(0.0, deadline - time.monotonic()))
        if entry is None:
            hosted = await self._bridge.call(self._open, request, abandoned=_close_soon)
            if shared:
                entry = self._adopt(k, hosted)
        else:
            hosted = entry.hosted
        bridged = self._bridge.session(hosted)
        try:
            yield bridged
        finally:
            then = self._follow.pop(id(bridged), None)
            if entry is None:
                bridged.when_idle(lambda: _close_soon(hosted))
            else:
                with self._lock:
                    entry.finishing = True
                if then is None:
                    bridged.when_idle(lambda: self._release(entry))
                else:
                    loop = asyncio.get_running_loop()
                    bridged.when_idle(lambda: self._hand_over(loop, entry, bridged, then))

    def follow(self, session: BridgedSession, then: FollowUp) -> None:
        """Run ``then(session)`` once the current turn's engine work on ``session`` has stopped,
        before the conversation's next request takes it (see the module docstring). Only a
        conversation's own session has follow-ups; on one of a busy conversation's extra
        sessions (closed after its request) this does nothing."""
        self._follow[id(session)] = then

    def _hand_over(
        self, loop: asyncio.AbstractEventLoop, entry: _Entry, session: BridgedSession, then: FollowUp
    ) -> None:
        """The turn's engine work stopped (any thread): the entry stays busy for ``then``."""
        with self._lock:
            entry.finishing = False
            entry.ahead = True
            waiters, entry.waiters = entry.waiters, []  # their deadline is AHEAD_WAIT now: look again
        for waiter_loop, waiting in waiters:
            with contextlib.suppress(RuntimeError):
                waiter_loop.call_soon_threadsafe(_wake, waiting)

        def start() -> None:
            task = loop.create_task(self._run_follow(entry, session, then))
            self._tasks.add(task)
            task.add_done_callback(self._tasks.discard)

        try:
            loop.call_soon_threadsafe(start)
        except RuntimeError:  # the loop is closed: nobody will ask again
            self._release(entry)

    async def _run_follow(self, entry: _Entry, session: BridgedSession, then: FollowUp) -> None:
        try:
            await then(session)
        except ModeldError as exc:
            log.info("a follow-up on session %s ended: %s", session.session_id, exc.message)
        except Exception:
            log.exception("a follow-up on session %s failed", session.session_id)
        finally:
            session.when_idle(lambda: self._release(entry))

    def _adopt(self, k: tuple[str, str, str], hosted: TransportSession) -> _Entry | None:
        """Keep a new session as the conversation's, making room (None: no room, or a racing
        request already keeps one)."""
        evicted: list[TransportSession] = []
        entry: _Entry | None = None
        with self._lock:
            if k not in self._table:
                while len(self._table) >= self.max_conversations:
                    idle = next((key_ for key_, e in self._table.items() if not e.busy), None)
                    if idle is None:
                        break
                    evicted.append(self._table.pop(idle).hosted)
                if len(self._table) < self.max_conversations:
                    entry = _Entry(hosted, True, time.monotonic())
                    self._table[k] = entry
        for old in evicted:
            _close_soon(old)
        return entry

    def _release(self, entry: _Entry) -> None:
        with self._lock:
            entry.busy = False
            entry.finishing = False
            entry.ahead = False
            entry.last_used = time.monotonic()
            waiters, entry.waiters = entry.waiters, []
        for loop, waiting in waiters:  # the first to run takes the session; the rest go on
            with contextlib.suppress(RuntimeError):  # a loop already closed: nobody waits
                loop.call_soon_threadsafe(_wake, waiting)

    def sweep(self) -> int:
        """Close conversations idle for longer than ``idle_seconds`` (0: never); returns how many."""
        if self.idle_seconds <= 0:
            return 0
        cutoff = time.monotonic() - self.idle_seconds
        return self._close_idle_where(lambda k, e: e.last_used < cutoff)

    def close_idle(self) -> None:
        self._close_idle_where(lambda k, e: True)

    def close_model(self, model_name: str) -> int:
        """Close the idle conversations on the model ``model_name`` (before it is unloaded)."""
        return self._close_idle_where(lambda k, e: k[1] == model_name)

    def _close_idle_where(self, chosen: Callable[[tuple[str, str, str], _Entry], bool]) -> int:
        """Close the idle conversations ``chosen`` picks (by key and entry); returns how many."""
        with self._lock:
            stale = [k for k, e in self._table.items() if not e.busy and chosen(k, e)]
            closing = [self._table.pop(k).hosted for k in stale]
        for hosted in closing:
            _close(hosted)
        return len(closing)

    def close_all(self) -> None:
        with self._lock:
            closing = [e.hosted for e in self._table.values()]
            self._table.clear()
        for hosted in closing:
            _close(hosted)

    def busy_sessions(self) -> int:
        """Conversations with a request running now."""
        with self._lock:
            return sum(1 for e in self._table.values() if e.busy)


def _close(hosted: TransportSession) -> None:
    try:
        hosted.close()
    except ModeldError as exc:
        log.debug("closing session %s: %s", hosted.session_id, exc)


def _wake(waiting: asyncio.Future[None]) -> None:
    if not waiting.done():  # a waiter that gave up (its wait timed out, its client went away)
        waiting.set_result(None)


def _close_soon(hosted: TransportSession) -> None:
    """Close a session off the caller's thread (the event loop must not wait for it)."""
    threading.Thread(target=_close, args=(hosted,), name="session-close", daemon=True).start()
