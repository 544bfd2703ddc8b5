"""Owner fencing inside one process: which instance and epoch this engine serves under.

The file-based lease (``modeld/lease.py``) decides who owns the machine; this object is
what the engine consults on every operation. A session is bound to the epoch it was opened
under; once ownership is lost (a takeover), every session of that epoch fails with
``stale_fence`` and new sessions get ``not_owner``.
"""

from __future__ import annotations

import threading
import uuid
from collections.abc import Callable

from modeld.contract import Fence
from modeld.errors import NotOwnerError, StaleFenceError

__all__ = ["Owner", "new_instance_id"]


def new_instance_id() -> str:
    return uuid.uuid4().hex


class Owner:
    """The current owner identity; ``revoke`` marks it lost and tells the listeners."""

    def __init__(self, instance_id: str | None = None, epoch: int = 1) -> None:
        self.instance_id = instance_id or new_instance_id()
        self.epoch = epoch
        self._lost: str | None = None
        self._lock = threading.Lock()
        self._listeners: list[Callable[[str], None]] = []

    @property
    def lost(self) -> str | None:
        """Why ownership was lost, or None while this instance owns the machine."""
        return self._lost

    def revoke(self, why: str) -> None:
        with self._lock:
            if self._lost is not None:
                return
            self._lost = why
            listeners = list(self._listeners)
        for listener in listeners:
            listener(why)

    def on_revoke(self, listener: Callable[[str], None]) -> None:
        with self._lock:
            self._listeners.append(listener)

    def check_open(self, fence: Fence) -> int:
        """Admit a new session under ``fence``; returns the epoch it is bound to."""
        if self._lost is not None:
            raise NotOwnerError(
                f"this daemon no longer owns the machine ({self._lost}); reconnect",
                instance_id=self.instance_id,
                epoch=self.epoch,
            )
        if fence.owner_instance_id and fence.owner_instance_id != self.instance_id:
            raise StaleFenceError(
                f"the fence names owner {fence.owner_instance_id}, but {self.instance_id} "
                f"owns the machine (epoch {self.epoch}); rediscover the daemon",
                expected=fence.owner_instance_id,
                owner=self.instance_id,
                epoch=self.epoch,
            )
        return self.epoch

    def check_epoch(self, epoch: int) -> None:
        """Raise ``stale_fence`` unless ``epoch`` is the current, still-owned epoch."""
        if self._lost is not None or epoch != self.epoch:
            why = self._lost or f"epoch {epoch} is not the current epoch {self.epoch}"
            raise StaleFenceError(
                f"session's owner epoch {epoch} is stale: {why}",
                session_epoch=epoch,
                owner=self.instance_id,
            )
