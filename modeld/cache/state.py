"""The state one model's cache shares with the holds it hands out (:class:`CacheState`).

:class:`~modeld.cache.warm.ModelCache` chooses, places and makes room for a turn, then hands
the operation a :class:`~modeld.cache.hold.Hold`; both work on the same pool, under the same
lock, and wake the same waiters. That shared part is this one public object, made by the cache
and handed to each hold, so a hold reaches nothing private of the cache (``hold.py`` does not
import ``warm.py``, which imports it). Design record: ``blueprints/0016-warm-state.md``.
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Callable

from modeld.cache import eviction
from modeld.cache.pool import Pool, WarmContext
from modeld.cache.reuse import RuntimeHistory
from modeld.cache.runtime import KVRuntime
from modeld.errors import ModeldError

__all__ = ["CacheState"]


class CacheState:
    """What a model's cache and its holds share (see the module docstring). Every field but
    :attr:`closed` is set once; read and change the pool under :attr:`lock`."""

    def __init__(
        self,
        *,
        pool: Pool,
        runtime: Callable[[], KVRuntime],
        history: RuntimeHistory,
        file_key: tuple[str, str],
    ) -> None:
        self.pool = pool
        """The model's KV pool: its warm contexts, sessions' slots, ledger, costs, counters."""
        self.runtime = runtime
        """The live runtime (waits while its worker restarts; raises when it cannot)."""
        self.history = history
        """Which model files were warm under which runtime (``RuntimeHistory``)."""
        self.file_key = file_key
        """The (backend, path) the history knows this model's file by."""
        self.lock = threading.RLock()
        self.room = threading.Condition(self.lock)
        """Notified whenever an operation ends (its context idle: evictable) or cells free up."""
        self.closed = False
        """The cache was closed: nothing waits for room any more."""
        self.growing: set[WarmContext] = set()
        """Decodes waiting for more cells (``Hold.grow``): when every operation holding cells
        is one of them, the one that asks next gives way instead of waiting for ever."""
        self.saver = eviction.WriteBehind(pool, self.lock)
        """Snapshots of just-computed prefixes, written to the tiers in the background."""

    def room_freed(self) -> None:
        """An operation ended or cells were freed: the turns waiting for room try again."""
        with self.lock:
            self.room.notify_all()

    def failed(self, context: WarmContext, error: ModeldError, *, engine_alive: bool) -> None:
        """A job on ``context`` failed: what its sequence holds is unknown, so it is emptied
        (when the engine died, its restart empties everything anyway: nothing is sent to it)."""
        with self.lock:
            context.busy = context.ahead = False
            if self.pool.holds(context):
                self.pool.reserved.pop(context.seq, None)
            self.room.notify_all()
            if engine_alive and self.pool.holds(context):
                with contextlib.suppress(ModeldError):
                    self.runtime().drop(context.seq)
            self.pool.record_failure(context, error.message)
