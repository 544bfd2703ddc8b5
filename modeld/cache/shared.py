"""The shared snapshot store: warm contexts that outlive their box.

Several daemons (one per box) mount one directory (NFS, a shared volume; ``modeld serve
--shared-store DIR``). Every snapshot a daemon persists (a long prefix just computed, every warm
context at an orderly stop or a drain) is written through to it; a turn that finds nothing long
enough in its own KV and tiers looks there before prefilling. A conversation the gateway moves
to another box (its box died, drained or was rebalanced) is then ``restored_from_shared``
instead of cold. Design record: ``blueprints/0020-fleet.md``.

Two layers:

* :class:`SnapshotStore`, the store's interface: ``keys``, ``items``, ``head``, ``get``,
  ``put``, ``delete``, ``discard`` (remove what failed a check, never a good file written
  since), ``make_room``. Every read is verified (:func:`verify_key` and the file
  format's own checks: magic, version, sizes, token hash, payload checksum) and a file is only
  ever named by what it holds (the disk tier's key: model, runtime identity, engine format,
  tokens), so a torn, corrupt or foreign file is refused, never loaded. :class:`DirectoryStore`
  implements it on a directory; an object store (S3-compatible: list with a prefix, a ranged
  GET for ``head``, GET, an atomic PUT, DELETE, a conditional DELETE on the ETag read for
  ``discard``, the last use kept in metadata) fits the same interface.
* :class:`SharedTier`, the daemon's side (the :class:`~modeld.cache.tiers.RemoteTier` the tiers
  hold): the candidates of a model and identity (the store's keys with that prefix; headers and
  tokens read once per key and cached), verified loads, a background writer (at nice 19, as the
  disk tier's), counters and the rejections.

Concurrency (many daemons read and write the same directory at once):

* **Writes** go to a hidden temporary file unique to the writer (host, process, random tag),
  are fsync'd and renamed over the final name: a reader sees the old file or the new one,
  whole. Two writers of one key both rename; the last one wins, and either file is valid for
  that key (the same tokens under the same runtime identity and engine format).
* **Reads** open the file once and read it whole through that descriptor: a rename or an unlink
  meanwhile does not change what was opened. A file that fails a check is moved aside and
  removed unless it turns out to be another, good file a writer renamed over it in between
  (:meth:`DirectoryStore.discard`): a bad read never costs a good snapshot.
* **Eviction**: least recently used first, by modification time, which a read and a repeated
  write touch (access times are unreliable: ``noatime``, ``relatime``). One daemon evicts at a
  time (a non-blocking ``flock`` on ``.evict.lock``; a daemon that finds it taken skips, and the
  evicting daemon lists the store again after its pass, up to three times, to count what the
  others wrote meanwhile; the store may be over its budget by the writes in flight), and it evicts to
  90% of the budget, so daemons do not each cut a little on every write. Unlinking a file a
  reader has open is safe on a local file system (the reader keeps the inode); over NFS the
  reader may get ``ESTALE``, which is a miss (the turn prefills), never a bad load. Temporary
  files older than an hour (a writer that died) are removed by the evicting daemon.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import logging
import os
import queue
import secrets
import socket
import threading
import time
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol

from modeld.cache.snapfile import (
    SUFFIX,
    SnapshotError,
    SnapshotFile,
    SnapshotHeader,
    read_header_from,
    read_verified,
    write_atomic,
)
from modeld.cache.tiers import Rejection, TierEntry, entry_key, key_prefix, writer_loop

__all__ = [
    "DirectoryStore",
    "SharedEntry",
    "SharedTier",
    "SnapshotStore",
    "StoreError",
    "StoredItem",
    "default_shared_budget",
    "verify_key",
]

log = logging.getLogger("modeld.cache")

LOW_WATER = 0.9
"""Over its budget, the store is cut to this share of it (one eviction pass serves many writes)."""
STALE_TMP_SECONDS = 3600.0
"""A temporary file this old belongs to a writer that died: the evicting daemon removes it."""
STATS_SECONDS = 5.0
"""The store's size (a listing) is recounted at most this often for status and metrics."""
_LOCK_NAME = ".evict.lock"
EVICT_PASSES = 3
"""The most listings an evicting daemon makes while it holds the lock: each one counts what
other daemons wrote (without evicting) during the last."""
_REJECTIONS_KEPT = 32


class StoreError(Exception):
    """The store cannot be used (its directory is missing, not writable, ...)."""


@dataclass(frozen=True, slots=True)
class StoredItem:
    """One snapshot in a store: its key, size and last use (what eviction orders by)."""

    key: str
    size: int
    last_used: float


class SnapshotStore(Protocol):
    """A place several daemons keep snapshots in, by key (see the module docstring).

    ``head`` and ``get`` raise ``SnapshotError`` (with ``version`` set when known) for a
    snapshot that must not be used, and ``OSError`` when the key is gone or unreadable (a
    miss, nothing to remove)."""

    location: str
    budget: int

    def keys(self, prefix: str) -> list[str]: ...

    def items(self) -> list[StoredItem]: ...

    def head(self, key: str) -> tuple[SnapshotHeader, list[int]]: ...

    def get(self, key: str) -> tuple[SnapshotHeader, list[int], bytes, str]: ...

    def put(
        self,
        key: str,
        *,
        model_digest: str,
        identity: str,
        snapshot_format: str,
        tokens: Sequence[int],
        prefix_tokens: int,
        payload: bytes,
    ) -> bool: ...

    def delete(self, key: str) -> bool: ...

    def discard(self, key: str, version: str) -> bool: ...

    def make_room(self, nbytes: int) -> int: ...


def verify_key(key: str, header: SnapshotHeader, tokens: Sequence[int]) -> None:
    """A snapshot is named by what it holds: a file whose contents do not give its own name
    (renamed, copied from another model or engine build) is foreign. Raises ``SnapshotError``."""
    if key != entry_key(header.model_digest, header.identity, header.snapshot_format, tokens):
        raise SnapshotError("its name does not match its contents (a foreign or renamed file)")


def _rejected(exc: SnapshotError, version: str) -> SnapshotError:
    exc.version = version  # type: ignore[attr-defined]
    return exc


def _version(st: os.stat_result) -> str:
    """Which file a name held when it was read (a rename over it makes another inode; an inode
    number freed and reused gets another change time, or, within one clock tick, is read
    again whole by :meth:`DirectoryStore.discard`)."""
    return f"{st.st_dev}:{st.st_ino}:{st.st_ctime_ns}:{st.st_size}"


class DirectoryStore:
    """:class:`SnapshotStore` on a directory several daemons mount (see the module docstring)."""

    def __init__(self, directory: Path, budget: int) -> None:
        self.directory = directory
        self.location = str(directory)
        self.budget = max(0, budget)
        try:
            directory.mkdir(parents=True, exist_ok=True, mode=0o700)
        except OSError as exc:
            raise StoreError(f"{directory} cannot be created ({exc.strerror or exc})") from None
        if not directory.is_dir():
            raise StoreError(f"{directory} is not a directory")
        if not os.access(directory, os.R_OK | os.W_OK | os.X_OK):
            raise StoreError(f"{directory} is not readable and writable by this user")
        self._tag = f"{socket.gethostname()[:32]}"

    def _path(self, key: str) -> Path:
        if not key or "/" in key or key.startswith("."):
            raise SnapshotError(f"not a snapshot key: {key[:80]!r}")
        return self.directory / f"{key}{SUFFIX}"

    def keys(self, prefix: str) -> list[str]:
        out = []
        with os.scandir(self.directory) as it:
            for item in it:
                name = item.name
                if name.endswith(SUFFIX) and name.startswith(prefix) and not name.startswith("."):
                    out.append(name[: -len(SUFFIX)])
        return out

    def items(self) -> list[StoredItem]:
        out = []
        with os.scandir(self.directory) as it:
            for item in it:
                name = item.name
                if not name.endswith(SUFFIX) or name.startswith("."):
                    continue
                with contextlib.suppress(OSError):  # removed meanwhile
                    st = item.stat(follow_symlinks=False)
                    out.append(StoredItem(name[: -len(SUFFIX)], st.st_size, st.st_mtime))
        return out

    def head(self, key: str) -> tuple[SnapshotHeader, list[int]]:
        with self._path(key).open("rb") as f:
            try:
                header, tokens = read_header_from(f)
                verify_key(key, header, tokens)
            except SnapshotError as exc:
                raise _rejected(exc, _version(os.fstat(f.fileno()))) from None
        return header, tokens

    def get(self, key: str) -> tuple[SnapshotHeader, list[int], bytes, str]:
        """The snapshot, verified whole; touched (its last use is now). Returns the header,
        tokens, payload and the version of the file read."""
        path = self._path(key)
        with path.open("rb") as f:
            version = _version(os.fstat(f.fileno()))
            try:
                header, tokens, payload = read_verified(f)
                verify_key(key, header, tokens)
            except SnapshotError as exc:
                raise _rejected(exc, version) from None
        with contextlib.suppress(OSError):
            os.utime(path)
        return header, tokens, payload, version

    def put(
        self,
        key: str,
        *,
        model_digest: str,
        identity: str,
        snapshot_format: str,
        tokens: Sequence[int],
        prefix_tokens: int,
        payload: bytes,
    ) -> bool:
        """Write a snapshot unless the key is there already (then touch it); True if written.
        Raises ``OSError``."""
        path = self._path(key)
        if key != entry_key(model_digest, identity, snapshot_format, tokens):
            raise SnapshotError("the key does not name these contents")
        try:
            os.utime(path)
            return False  # content-addressed: the same key holds the same reusable state
        except FileNotFoundError:
            pass
        self.make_room(len(payload) + 4 * len(tokens) + 1024)
        write_atomic(
            path,
            model_digest=model_digest,
            identity=identity,
            snapshot_format=snapshot_format,
            tokens=tokens,
            prefix_tokens=prefix_tokens,
            payload=payload,
            tmp_tag=f"{self._tag}.{secrets.token_hex(6)}",
        )
        return True

    def delete(self, key: str) -> bool:
        """Remove a snapshot (True if it was there)."""
        try:
            self._path(key).unlink()
        except FileNotFoundError:
            return False
        return True

    def discard(self, key: str, version: str) -> bool:
        """Remove the snapshot that was read as ``version`` and failed a check, but never a good
        one: the file is moved aside (a rename takes whatever the name holds now), and unless it
        is the one read, it is checked again whole; a good file goes back (a link, which fails
        if a writer filled the name meanwhile). True if a bad file was removed."""
        path = self._path(key)
        aside = self.directory / f".{key}.{self._tag}.{secrets.token_hex(6)}.discard.tmp"
        try:
            os.rename(path, aside)
        except FileNotFoundError:
            return False
        try:
            with aside.open("rb") as f:
                st = os.fstat(f.fileno())
                if _version(st) != version:
                    try:
                        header, tokens, _ = read_verified(f)
                        verify_key(key, header, tokens)
                    except SnapshotError:
                        pass
                    else:
                        with contextlib.suppress(FileExistsError):
                            os.link(aside, path)
                        return False
            return True
        finally:
            with contextlib.suppress(OSError):
                aside.unlink()

    def make_room(self, nbytes: int) -> int:
        """Over the budget with ``nbytes`` more: the least recently used snapshots go, down to
        :data:`LOW_WATER` of the budget, by one daemon at a time. Returns how many went."""
        if not self.budget:
            return 0
        items = self.items()
        if sum(i.size for i in items) + nbytes <= self.budget:
            return 0
        lock = os.open(self.directory / _LOCK_NAME, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600)
        try:
            try:
                fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except OSError as exc:
                if exc.errno in (errno.EWOULDBLOCK, errno.EAGAIN, errno.EACCES):
                    return 0  # another daemon is evicting now
                raise
            self._remove_stale_tmp()
            target = int(self.budget * LOW_WATER) - nbytes
            removed = 0
            # Writers that found the lock taken wrote without evicting: what they wrote during
            # this pass is counted by the next one (a slow pass on a loaded box let a writer
            # write twice, and the store stayed over its budget after every writer had ended).
            for again in range(EVICT_PASSES):
                items = sorted(self.items(), key=lambda i: i.last_used)
                used = sum(i.size for i in items)
                if again and used + nbytes <= self.budget:
                    break
                for item in items:
                    if used <= target:
                        break
                    with contextlib.suppress(FileNotFoundError):
                        (self.directory / f"{item.key}{SUFFIX}").unlink()
                        removed += 1
                    used -= item.size
            if removed:
                log.info("shared store %s: removed %d least recently used snapshots", self.location, removed)
            return removed
        finally:
            os.close(lock)  # closing releases the lock

    def _remove_stale_tmp(self) -> None:
        cutoff = time.time() - STALE_TMP_SECONDS
        with os.scandir(self.directory) as it:
            for item in it:
                if item.name.startswith(".") and item.name.endswith(".tmp"):
                    with contextlib.suppress(OSError):
                        if item.stat(follow_symlinks=False).st_mtime < cutoff:
                            os.unlink(item.path)


@dataclass(eq=False)
class SharedEntry(TierEntry):
    """A snapshot in the shared store, as a candidate of the choice (its tier is ``shared``)."""

    @property
    def tier(self) -> str:
        return "shared"


class SharedTier:
    """The daemon's side of a shared store (see the module docstring). Thread-safe."""

    def __init__(self, store: SnapshotStore) -> None:
        self.store = store
        self._lock = threading.Lock()
        self._known: dict[str, SharedEntry] = {}
        self._writes: queue.SimpleQueue[tuple[TierEntry, bytes | SnapshotFile] | None] = queue.SimpleQueue()
        self._pending = 0
        self._queued: set[str] = set()
        self._idle = threading.Condition(self._lock)
        self.rejections: deque[Rejection] = deque(maxlen=_REJECTIONS_KEPT)
        self.counters = {
            "written": 0,
            "write_failures": 0,
            "restored": 0,
            "rejected": 0,
            "lookups": 0,
            "read_failures": 0,
        }
        self._size: tuple[float, int, int] = (0.0, 0, 0)  # when counted, entries, bytes
        self._writer = threading.Thread(target=self._write_loop, name="kv-shared-writer", daemon=True)
        self._writer.start()

    # --- the choice -------------------------------------------------------------------------

    def candidates(self, model_digest: str, identity: str, snapshot_format: str) -> list[TierEntry]:
        """The store's snapshots of this model, identity and engine format (headers and
        tokens read once per key; a bad one is removed and skipped)."""
        prefix = key_prefix(model_digest, identity, snapshot_format)
        try:
            keys = self.store.keys(prefix)
        except OSError as exc:
            log.warning("shared store %s cannot be listed: %s", self.store.location, exc)
            return []
        listed = set(keys)
        with self._lock:
            self.counters["lookups"] += 1
            for key in [k for k in self._known if k.startswith(prefix) and k not in listed]:
                del self._known[key]  # evicted or removed by another daemon
            missing = [k for k in keys if k not in self._known]
        for key in missing:
            try:
                header, tokens = self.store.head(key)
            except SnapshotError as exc:
                self._reject_key(key, str(exc), getattr(exc, "version", ""))
                continue
            except OSError:
                continue  # removed meanwhile
            if (header.model_digest, header.identity, header.snapshot_format) != (
                model_digest,
                identity,
                snapshot_format,
            ):
                continue  # a key prefix shared by another model or identity (truncated digests)
            entry = SharedEntry(
                key=key,
                model_digest=header.model_digest,
                identity=header.identity,
                snapshot_format=header.snapshot_format,
                tokens=tokens,
                prefix_tokens=header.prefix_tokens,
                nbytes=header.payload_bytes,
                header=header,
                created=header.created,
            )
            with self._lock:
                self._known[key] = entry
        with self._lock:
            return [e for k, e in self._known.items() if k.startswith(prefix)]

    def owns(self, entry: TierEntry) -> bool:
        return isinstance(entry, SharedEntry)

    def load(self, entry: TierEntry) -> bytes:
        """The entry's payload, verified (checksum, model, runtime identity, engine format,
        tokens). Raises ``SnapshotError``: ``rejected`` (removed) or gone (a miss)."""
        try:
            header, tokens, payload, version = self.store.get(entry.key)
        except SnapshotError as exc:
            where = self.reject(entry, str(exc), getattr(exc, "version", ""))
            raise SnapshotError(f"{where}: {exc}") from None
        except OSError as exc:
            with self._lock:
                self.counters["read_failures"] += 1
                self._known.pop(entry.key, None)
            raise SnapshotError(f"the shared snapshot {entry.key} is gone ({exc.strerror or exc})") from None
        expected = (entry.model_digest, entry.identity, entry.snapshot_format, list(entry.tokens))
        if (header.model_digest, header.identity, header.snapshot_format, tokens) != expected:
            reason = "its model, runtime identity, engine format or tokens are not the ones indexed"
            where = self.reject(entry, reason, version)
            raise SnapshotError(f"{where}: {reason}")
        with self._lock:
            self.counters["restored"] += 1
        return payload

    def reject(self, entry: TierEntry, reason: str, version: str = "") -> str:
        """Remove a snapshot that must not be used (if it is still the file that was read)."""
        return self._reject_key(entry.key, reason, version)

    def _reject_key(self, key: str, reason: str, version: str) -> str:
        where = f"shared:{key}"
        log.warning("removed KV snapshot %s from the shared store %s: %s", key, self.store.location, reason)
        with contextlib.suppress(OSError, SnapshotError):
            self.store.discard(key, version)
        with self._lock:
            self._known.pop(key, None)
            self.counters["rejected"] += 1
            self.rejections.append(Rejection(time.time(), where, reason))
        return where

    # --- writing through --------------------------------------------------------------------

    def write(self, entry: TierEntry, source: bytes | SnapshotFile) -> None:
        """Write a persisted snapshot through to the store (in the background)."""
        with self._lock:
            if entry.key in self._queued:
                return
            self._queued.add(entry.key)
            self._pending += 1
        self._writes.put((entry, source))

    def _write_loop(self) -> None:
        writer_loop(self._writes, self._write_one)

    def _write_one(self, item: tuple[TierEntry, bytes | SnapshotFile]) -> None:
        entry, source = item
        try:
            self._write(entry, source)
        finally:
            with self._lock:
                self._queued.discard(entry.key)
                self._pending -= 1
                self._idle.notify_all()

    def _write(self, entry: TierEntry, source: bytes | SnapshotFile) -> None:
        try:
            if isinstance(source, SnapshotFile):
                with source.path.open("rb") as f:
                    header, tokens, payload = read_verified(f)  # never spread a bad file
                if header.payload_hash != source.header.payload_hash or tokens != list(entry.tokens):
                    raise SnapshotError("the local file changed since it was indexed")
            else:
                payload = source
            written = self.store.put(
                entry.key,
                model_digest=entry.model_digest,
                identity=entry.identity,
                snapshot_format=entry.snapshot_format,
                tokens=entry.tokens,
                prefix_tokens=entry.prefix_tokens,
                payload=payload,
            )
        except (OSError, SnapshotError) as exc:
            with self._lock:
                self.counters["write_failures"] += 1
            log.warning(
                "writing KV snapshot %s to the shared store %s failed: %s",
                entry.key,
                self.store.location,
                exc,
            )
            return
        if written:
            with self._lock:
                self.counters["written"] += 1

    def flush(self, timeout: float) -> bool:
        """Wait until every queued write is in the store (True) or ``timeout`` passes (False)."""
        deadline = time.monotonic() + timeout
        with self._lock:
            while self._pending:
                left = deadline - time.monotonic()
                if left <= 0:
                    return False
                self._idle.wait(left)
        return True

    def close(self) -> None:
        self._writes.put(None)
        self._writer.join(timeout=30)

    # --- observers --------------------------------------------------------------------------

    def stats(self) -> dict[str, int | str]:
        """The store's contents (recounted at most every :data:`STATS_SECONDS`) and counters."""
        counted, entries, held = self._size
        if time.monotonic() - counted > STATS_SECONDS:
            try:
                items = self.store.items()
            except OSError:
                items = []
            entries, held = len(items), sum(i.size for i in items)
            self._size = (time.monotonic(), entries, held)
        with self._lock:
            return {
                "shared_location": self.store.location,
                "shared_entries": entries,
                "shared_bytes": held,
                "shared_budget": self.store.budget,
                "shared_pending": self._pending,
                **{f"shared_{k}": v for k, v in self.counters.items()},
            }


def default_shared_budget(directory: Path) -> int:
    """A tenth of the free space of the store's file system, at most 64 GiB (give every daemon
    of a fleet the same ``--shared-store-bytes`` instead: each evicts to its own budget)."""
    probe = directory
    while not probe.exists() and probe != probe.parent:
        probe = probe.parent
    try:
        st = os.statvfs(probe)
    except OSError:
        return 0
    return min(64 << 30, st.f_bavail * st.f_frsize // 10)
