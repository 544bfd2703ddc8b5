"""Draining the HTTP APIs (``blueprints/0020-fleet.md``): the turns running, and the 503 the
new ones get while the daemon saves its warm state before it exits.

:meth:`Drain.begin` (SIGTERM, ``modeld drain``): from then on ``/health`` is 503 ("draining")
and a new turn is held, then refused with 503 and ``Retry-After`` once :meth:`Drain.release`
says the warm state is saved (a gateway retries it on another box, which restores it from the
shared store); turns already running go on, and the daemon waits for :attr:`Drain.running` to
reach 0 (or its drain timeout).
"""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Callable

from modeld.server.http.errors import HttpError

__all__ = ["Drain"]


class Drain:
    """The turns running, and whether the daemon drains (thread-safe)."""

    def __init__(self) -> None:
        self.draining = False
        self._drained = threading.Event()
        self._running = 0
        self._lock = threading.Lock()

    def begin(self) -> None:
        """Hold new turns from now on (they are refused once :meth:`release` is called)."""
        self.draining = True

    def release(self) -> None:
        """The warm contexts are saved: the held turns get their 503 now."""
        self._drained.set()

    @property
    def running(self) -> int:
        """Turns started and not yet answered in full (a stream counts until its end)."""
        with self._lock:
            return self._running

    def enter(self) -> Callable[[], None]:
        """Count a running turn; returns what ends it (idempotent)."""
        with self._lock:
            self._running += 1
        left = False

        def leave() -> None:
            nonlocal left
            with self._lock:
                if not left:
                    left = True
                    self._running -= 1

        return leave

    async def refuse(self) -> None:
        """Raise the drain's 503 (after the warm state is saved) when the daemon drains."""
        if not self.draining:
            return
        while not self._drained.is_set():
            await asyncio.sleep(0.05)
        raise HttpError(
            503,
            "the daemon is draining: its warm contexts are saved (to the shared store when it has "
            "one); send the turn again, and a gateway sends it to another box",
            code="draining",
            retry_after=1,
        )
