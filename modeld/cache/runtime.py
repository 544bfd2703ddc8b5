"""What the cache asks of a loaded runtime: operations on its numbered KV sequences.

The cache decides what is warm where; the runtime holds the KV. The cache reaches it only
through :class:`KVRuntime`, a protocol this package owns, so nothing in ``modeld/cache/``
imports the engine or the workers: ``modeld/workers/host.py``'s ``Host`` implements it (the
runtime in a worker process or on a thread of the daemon), one protocol message per call.

* :meth:`~KVRuntime.copy`, :meth:`~KVRuntime.drop` and :meth:`~KVRuntime.share` are atomic;
* :meth:`~KVRuntime.sync` starts a job that reports :class:`~modeld.backends.base.SyncStep`
  progress and ends with :class:`SyncEnd` (the engine's own counts: the truth after a cancel);
* :meth:`~KVRuntime.snapshot` sends its request before it returns (so the engine takes the
  snapshot before any later job on the sequence) and answers later (:class:`PendingSnapshot`);
* :meth:`~KVRuntime.save` is a snapshot the runtime writes into a file itself (the disk tier's
  temporary file: the blob never reaches the daemon), sent and answered as ``snapshot``
  (:class:`PendingSave`, :class:`Saved`);
* :meth:`~KVRuntime.restore` answers :class:`Restored`.

Every call raises the runtime's contract error (``engine_restarted`` when its worker died).
Design record: ``blueprints/0016-warm-state.md``.
"""

from __future__ import annotations

import threading
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol

from modeld.backends.base import SyncStep
from modeld.cache.snapfile import SnapshotFile

__all__ = [
    "Counted",
    "KVRuntime",
    "PendingSave",
    "PendingSnapshot",
    "Restored",
    "Saved",
    "SyncEnd",
    "SyncJob",
    "Tally",
]


@dataclass(frozen=True, slots=True)
class SyncEnd:
    """A sync job ended: its sequence holds ``resident`` tokens, of which the first ``kept`` were
    kept before evaluating (fewer than asked when the memory could not be cut there);
    ``canceled`` when it stopped before the target."""

    resident: int
    kept: int
    canceled: bool = False


@dataclass(frozen=True, slots=True)
class Restored:
    """A restore's answer. When not ``ok`` the sequence is empty and ``detail`` says why;
    ``refused`` when the blob passed every check and the engine itself would not load it."""

    ok: bool
    detail: str = ""
    refused: bool = False


@dataclass(frozen=True, slots=True)
class Saved:
    """A save's answer: ``size`` bytes written, or (not ``ok``) why the file system refused
    the write (``errno``: its error number, 0 when unknown); the file is gone then."""

    ok: bool
    size: int = 0
    detail: str = ""
    errno: int = 0


class SyncJob(Protocol):
    """A sync job in flight."""

    def next_event(self, timeout: float | None = None) -> SyncStep | SyncEnd | None:
        """The job's next step, its end, or None when nothing came within ``timeout`` seconds;
        the error that ended the job is raised."""
        ...

    def wait(self) -> SyncEnd:
        """Read the job to its end (progress is ignored)."""
        ...

    def cancel(self) -> None:
        """Stop the job before its next step (idempotent, never blocks)."""
        ...


class PendingSnapshot(Protocol):
    def result(self) -> bytes:
        """The blob (waits for the engine's answer)."""
        ...


class PendingSave(Protocol):
    def result(self) -> Saved:
        """What became of the file (waits for the engine's answer)."""
        ...


class KVRuntime(Protocol):
    """The KV operations of one loaded runtime (see the module docstring)."""

    def copy(self, src: int, dst: int, n: int) -> None:
        """``dst`` := the first ``n`` tokens of ``src``."""
        ...

    def drop(self, seq: int) -> None:
        """Empty ``seq``."""
        ...

    def share(self, src: int, dst: int, n: int) -> bool:
        """``dst``'s first ``n`` tokens (the same as ``src``'s) are held in ``src``'s cells from
        now on, ``dst``'s own freed; False when not (nothing changed)."""
        ...

    def sync(
        self, seq: int, keep: int, tokens: Sequence[int], segments: Sequence[int] | None = None
    ) -> SyncJob:
        """Start a job that keeps ``seq``'s first ``keep`` tokens, then evaluates ``tokens``;
        ``segments``: where the manifest's segments start in that target (None: not known)."""
        ...

    def snapshot(self, seq: int) -> PendingSnapshot:
        """Ask for ``seq``'s state as a blob (the request is on its way when this returns)."""
        ...

    def save(self, seq: int, path: str) -> PendingSave:
        """Ask for ``seq``'s state written into a new file at ``path`` (the request is on its
        way when this returns)."""
        ...

    def restore(self, seq: int, tokens: Sequence[int], blob: bytes | SnapshotFile) -> Restored:
        """Load a RAM-tier blob, or a snapshot file the runtime maps and verifies itself."""
        ...


class Tally:
    """How many operations began on a runtime: every call the cache sends it (``Counted``) and
    every turn's hold (``ModelCache`` counts it as it begins: a turn whose prompt is resident
    goes to its decode without a KV call). A measurement that reads it before and after knows
    whether anything else ran on the engine in between, even an operation that began and ended
    inside it (a busy flag seen at both ends misses those)."""

    __slots__ = ("_lock", "_operations")

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._operations = 0

    @property
    def operations(self) -> int:
        return self._operations

    def count(self) -> None:
        with self._lock:  # the cache's threads call the runtime without the cache's lock
            self._operations += 1


class Counted:
    """A runtime whose every call counts in a :class:`Tally` first (see :class:`KVRuntime`)."""

    __slots__ = ("_runtime", "_tally")

    def __init__(self, runtime: KVRuntime, tally: Tally) -> None:
        self._runtime = runtime
        self._tally = tally

    def copy(self, src: int, dst: int, n: int) -> None:
        self._tally.count()
        self._runtime.copy(src, dst, n)

    def drop(self, seq: int) -> None:
        self._tally.count()
        self._runtime.drop(seq)

    def share(self, src: int, dst: int, n: int) -> bool:
        self._tally.count()
        return self._runtime.share(src, dst, n)

    def sync(
        self, seq: int, keep: int, tokens: Sequence[int], segments: Sequence[int] | None = None
    ) -> SyncJob:
        self._tally.count()
        return self._runtime.sync(seq, keep, tokens, segments)

    def snapshot(self, seq: int) -> PendingSnapshot:
        self._tally.count()
        return self._runtime.snapshot(seq)

    def save(self, seq: int, path: str) -> PendingSave:
        self._tally.count()
        return self._runtime.save(seq, path)

    def restore(self, seq: int, tokens: Sequence[int], blob: bytes | SnapshotFile) -> Restored:
        self._tally.count()
        return self._runtime.restore(seq, tokens, blob)
