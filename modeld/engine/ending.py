"""When a session can no longer be used, and why: its interruption and end notification.

A session ends when it is closed or interrupted: its owner epoch was revoked (a takeover), the
daemon is stopping, the transport that carried it went away, or its model file changed on disk
(``model_changed``: the engine ends every session of that model). :class:`SessionEnd` cancels
what the session is running at that moment (a sync job's hold, or a generate call), tells the
listeners a transport registered once (so streams end without polling), and names the error
every later operation raises: ``stale_fence``, ``shutting_down``, ``model_changed`` or
``session_closed``.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable
from typing import Protocol

from modeld.contract import ErrorDetail
from modeld.engine.owner import Owner
from modeld.errors import ModeldError, SessionClosedError, ShuttingDownError

__all__ = ["Cancelable", "SessionEnd"]

log = logging.getLogger("modeld.engine")


class Cancelable(Protocol):
    def cancel(self) -> None: ...


class SessionEnd:
    """One session's interruption flag, what it runs now, and its end listeners. Thread-safe."""

    def __init__(
        self, session_id: str, epoch: int, owner: Callable[[], Owner], stopping: Callable[[], bool]
    ) -> None:
        self._session_id = session_id
        self._epoch = epoch
        self._owner = owner
        self._stopping = stopping
        self._interrupted = threading.Event()
        self.running: Cancelable | None = None
        """What the session runs now (a sync job's hold, or a generate call): interrupting
        cancels it."""
        self._lock = threading.Lock()
        self._listeners: list[Callable[[ModeldError], None]] | None = []
        self._cause: ModeldError | None = None
        """Why the session was ended, when the engine said (``model_changed``)."""

    @property
    def interrupted(self) -> bool:
        return self._interrupted.is_set()

    def interrupt(self, *, notify: bool = True, cause: ModeldError | None = None) -> None:
        """Cancel what runs now and fail what comes next; tell the listeners (once). ``cause``:
        the error every later operation raises (the first one given wins)."""
        if cause is not None and self._cause is None:
            self._cause = cause
        self._interrupted.set()
        running = self.running
        if running is not None:
            running.cancel()
        if notify:
            self.notify()

    def run(self, job: Cancelable) -> None:
        """``job`` runs now: canceled at once if the session was interrupted meanwhile."""
        self.running = job
        if self._interrupted.is_set():
            job.cancel()

    def on_end(self, listener: Callable[[ModeldError], None]) -> None:
        """Call ``listener`` once, with the error operations now raise, when the session can no
        longer be used; at once if that already happened."""
        with self._lock:
            if self._listeners is not None:
                self._listeners.append(listener)
                return
        listener(self.error())

    def notify(self) -> None:
        with self._lock:
            listeners, self._listeners = self._listeners, None
        if not listeners:
            return
        error = self.error()
        for listener in listeners:
            try:
                listener(error)
            except Exception:
                log.exception("a session-end listener of %s failed", self._session_id)

    def error(self) -> ModeldError:
        """The error an operation of the ended session raises (why it ended)."""
        if self._cause is not None:
            return self._cause
        try:
            self._owner().check_epoch(self._epoch)
        except ModeldError as exc:
            return exc
        if self._stopping():
            return ShuttingDownError("the daemon is shutting down")
        return SessionClosedError(f"session {self._session_id} was closed", session_id=self._session_id)

    def detail(self) -> ErrorDetail | None:
        """Why a running decode must stop, or None while the session goes on."""
        if not self._interrupted.is_set():
            return None
        error = self.error()
        return ErrorDetail(reason=error.reason, message=error.message)
