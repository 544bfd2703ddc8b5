"""Admission control: how many operations a model runs at once, and a bounded, visible queue.

Each loaded model has ``slots``: operations (a prefill or a decode) it runs concurrently (the
engine interleaves them step by step, each on its own KV sequence). A caller that finds every
slot busy either gets :class:`~modeld.errors.NoSlotAvailableError` at once (it asked not to wait:
``no_wait``, the seeds' worker behaviour "if all slots are in use, submit returns immediately")
or waits its turn in a FIFO queue of at most ``max_queue`` callers, for at most
``wait_seconds``, after which it gets :class:`~modeld.errors.BusyError`. Waiting is
interruptible (the session closed, the daemon stopping), and who waits where is visible
(``explain-context`` shows a session's position and how long it has waited).
"""

from __future__ import annotations

import threading
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass

from modeld.errors import BusyError, LimitExceededError, NoSlotAvailableError

__all__ = ["Admission", "Ticket", "Waiter"]


@dataclass(eq=False)
class Waiter:
    session_id: str
    since: float


@dataclass(eq=False)
class Ticket:
    """A slot held by one operation; give it back with :meth:`Admission.release`."""

    session_id: str
    waited: float
    released: bool = False


class Admission:
    """Slots and a FIFO queue for one model. Thread-safe."""

    def __init__(
        self,
        slots: int,
        *,
        max_queue: int,
        wait_seconds: float,
        name: str = "",
        on_wait: Callable[[float], None] | None = None,
    ) -> None:
        self.slots = max(1, slots)
        self.max_queue = max(0, max_queue)
        self.wait_seconds = wait_seconds
        self.name = name
        self._busy = 0
        self._queue: deque[Waiter] = deque()
        self._cond = threading.Condition()
        self._on_wait = on_wait

    def acquire(self, session_id: str, *, no_wait: bool, interrupted: Callable[[], bool]) -> Ticket:
        """Take a slot, or raise (see the module docstring). ``interrupted`` is polled while waiting
        and makes the wait end with ``InterruptedError``."""
        with self._cond:
            if self._busy < self.slots and not self._queue:
                self._busy += 1
                return Ticket(session_id, 0.0)
            if no_wait:
                raise NoSlotAvailableError(
                    f"all {self.slots} slots of {self.name or 'the model'} are busy "
                    f"({len(self._queue)} waiting) and this call asked not to wait",
                    slots=self.slots,
                    queued=len(self._queue),
                )
            if len(self._queue) >= self.max_queue:
                raise LimitExceededError(
                    f"{len(self._queue)} operations already wait for {self.name or 'the model'}; "
                    f"the queue limit is {self.max_queue}",
                    limit="max_queue",
                    value=len(self._queue) + 1,
                    maximum=self.max_queue,
                )
            waiter = Waiter(session_id, time.monotonic())
            self._queue.append(waiter)
            deadline = waiter.since + self.wait_seconds
            try:
                while not (self._queue[0] is waiter and self._busy < self.slots):
                    left = deadline - time.monotonic()
                    if left <= 0:
                        raise BusyError(
                            f"{self.name or 'the model'} stayed busy for {self.wait_seconds:.0f}s "
                            f"({self.slots} slots); try again later",
                            wait_seconds=int(self.wait_seconds),
                        )
                    if interrupted():
                        raise InterruptedError
                    self._cond.wait(min(left, 0.05))
                self._busy += 1
                waited = time.monotonic() - waiter.since
                if self._on_wait is not None:
                    self._on_wait(waited)
                return Ticket(session_id, waited)
            finally:
                self._queue.remove(waiter)
                self._cond.notify_all()

    def release(self, ticket: Ticket) -> None:
        with self._cond:
            if ticket.released:
                return
            ticket.released = True
            self._busy -= 1
            self._cond.notify_all()

    def position(self, session_id: str) -> tuple[int, float]:
        """``(position, seconds waited)`` of a session in the queue (1 = next), or ``(0, 0)``."""
        now = time.monotonic()
        with self._cond:
            for i, waiter in enumerate(self._queue):
                if waiter.session_id == session_id:
                    return i + 1, now - waiter.since
        return 0, 0.0

    @property
    def busy(self) -> int:
        return self._busy

    @property
    def queued(self) -> int:
        return len(self._queue)
