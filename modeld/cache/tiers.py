"""The RAM tier and the disk tier: warm contexts kept outside the KV pool, daemon-wide.

A tier entry is a snapshot of one KV sequence (the engine's opaque blob) labelled with what
makes it reusable: the model digest, the runtime identity of the manifest it was computed under,
the engine's ``snapshot_format``, and its tokens. Entries live in the daemon process (never in
an engine worker), so they survive a worker crash; the disk tier survives a daemon restart.

* **RAM tier**: blobs in memory, within ``ram_bytes`` and within the room the memory budget
  leaves beside the loaded models (:meth:`Tiers.limit_ram`). Over its limit, the least recently
  used entry moves to the disk tier (or is dropped when the disk tier is off); a blob on its way
  there counts until it is written, and a snapshot that pushed it out waits for that
  (:meth:`Tiers.make_ram_room`), so the tier never holds more than its limit.
* **Disk tier**: one file per entry under ``<data_dir>/kv/`` (``modeld/cache/snapfile.py``:
  atomic writes, checksums), within ``disk_bytes``, least recently used removed first. Files
  are written by one background thread; a daemon restart indexes them again (headers and
  tokens only; the payload is verified when it is used, by the engine worker that maps it).
  A disk that is full, read-only or failing turns the disk tier off with one logged line;
  serving goes on.

A budget of 0 switches a tier off. Every rejected file is removed with its reason logged and
kept in :attr:`Tiers.rejections` (``modeld status`` shows them). A cold turn that tried one says
why; so does the first cold turn a file refused while the directory was indexed would have served
(:meth:`Tiers.claim_refused`: what such a file still says it held, its header or its name).
Design record: ``blueprints/0016-warm-state.md``.

A **remote tier** (:class:`RemoteTier`, the shared store of ``modeld/cache/shared.py``) may be
attached: every snapshot persisted here is written through to it (a file the engine wrote, once
sealed), and a turn that misses locally looks there (:meth:`Tiers.remote_candidates`). Design
record: ``blueprints/0020-fleet.md``.
"""

from __future__ import annotations

import contextlib
import errno
import logging
import os
import queue
import threading
import time
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Protocol, TypeVar

from modeld.cache.reuse import common_prefix_len
from modeld.cache.runtime import Saved
from modeld.cache.snapfile import (
    SUFFIX,
    Salvaged,
    SnapshotError,
    SnapshotFile,
    SnapshotHeader,
    read_header,
    salvage,
    temporary,
    write_atomic,
)
from modeld.cache.snapfile import seal as seal_file
from modeld.manifest import bytes_hash, token_hash

__all__ = [
    "Refused",
    "Rejection",
    "RemoteTier",
    "TierEntry",
    "Tiers",
    "entry_key",
    "key_prefix",
    "writer_loop",
]

log = logging.getLogger("modeld.cache")

_DISK_OFF_ERRNOS = {
    errno.ENOSPC,  # full
    errno.EDQUOT,  # over quota
    errno.EFBIG,  # over a file size limit
    errno.EROFS,  # read-only
    errno.EACCES,
    errno.EPERM,
    errno.EIO,  # failing
    errno.ENOENT,  # the directory went away
    errno.ENOTDIR,
    errno.EISDIR,
}
"""Write errors that mean the disk tier cannot work here: it turns itself off (one log line)."""
_REJECTIONS_KEPT = 32


@dataclass(eq=False)
class TierEntry:
    """One snapshot in the RAM tier, the disk tier, or both."""

    key: str
    model_digest: str
    identity: str
    snapshot_format: str
    tokens: list[int]
    prefix_tokens: int
    nbytes: int
    blob: bytes | None = None
    path: Path | None = None
    header: SnapshotHeader | None = None
    last_used: float = field(default_factory=time.time)
    created: float = field(default_factory=time.time)
    writing: bool = False
    tmp: Path | None = None
    """A temporary file the engine writes this entry's blob into (:meth:`Tiers.reserve`)."""
    truncatable: bool = False
    leaving: bool = False
    """The blob leaves RAM once its file is written (its context is back in the KV pool, or
    the RAM tier is over budget)."""
    through: bool = False
    """Persisted: once its file is sealed, it is written through to the remote tier."""

    @classmethod
    def new(
        cls,
        model_digest: str,
        identity: str,
        snapshot_format: str,
        tokens: list[int],
        prefix_tokens: int,
        nbytes: int,
        *,
        writing: bool = False,
        truncatable: bool = False,
        through: bool = False,
    ) -> TierEntry:
        """An entry keyed by what it holds; its prefix never claims more than its tokens (a
        file claiming more is refused on reading)."""
        return cls(
            key=entry_key(model_digest, identity, snapshot_format, tokens),
            model_digest=model_digest,
            identity=identity,
            snapshot_format=snapshot_format,
            tokens=tokens,
            prefix_tokens=min(prefix_tokens, len(tokens)),
            nbytes=nbytes,
            writing=writing,
            truncatable=truncatable,
            through=through,
        )

    @property
    def tier(self) -> str:
        return "ram" if self.blob is not None else "disk"

    @property
    def short_id(self) -> str:
        """Its name for people (status, explain-context, a turn's ``reuse.context``): 8 hex
        characters of its key's hash, so snapshots of the same tokens under two runtime
        identities (two context sizes of one file) are told apart."""
        return bytes_hash(self.key)[:8]


@dataclass(frozen=True, slots=True)
class Rejection:
    """A snapshot that was refused and removed, and why."""

    at: float
    file: str
    reason: str


@dataclass(frozen=True, slots=True)
class Refused:
    """A snapshot file refused while the disk tier was indexed, and what it still says it held
    (:func:`~modeld.cache.snapfile.salvage`), until the cold turn it would have served claims it."""

    rejection: Rejection
    held: Salvaged

    def would_serve(
        self, model_digest: str, identity: str, snapshot_format: str, target: Sequence[int], min_tokens: int
    ) -> bool:
        """Whether this file claimed to be a snapshot a turn for ``target`` under this model,
        identity and engine format would have restored (``min_tokens`` of ``target`` at least,
        when its tokens are known)."""
        held = self.held
        if not (held.model_digest and held.identity and held.format_hash):
            return False
        if not (model_digest.startswith(held.model_digest) and identity.startswith(held.identity)):
            return False
        if bytes_hash(snapshot_format)[:8] != held.format_hash:
            return False
        if held.tokens is None:
            return True
        return common_prefix_len(list(held.tokens), list(target)) >= max(1, min(min_tokens, len(target)))


def key_prefix(model_digest: str, identity: str, snapshot_format: str) -> str:
    """What every entry key of one model, runtime identity and engine format starts with."""
    fmt = bytes_hash(snapshot_format)[:8]
    return f"{model_digest[:16]}-{identity[:12]}-{fmt}-"


def entry_key(model_digest: str, identity: str, snapshot_format: str, tokens: Sequence[int]) -> str:
    """A snapshot's name: the model, the runtime identity, the engine format and the tokens
    (content-addressed: the same key always means the same reusable state)."""
    return key_prefix(model_digest, identity, snapshot_format) + token_hash(tokens)[:20]


class RemoteTier(Protocol):
    """A tier beyond this daemon (``modeld/cache/shared.py``): persisted snapshots are written
    through to it, and a local miss looks it up. Its entries are :class:`TierEntry` objects it
    made (``owns``); ``load`` returns their verified payload."""

    def candidates(self, model_digest: str, identity: str, snapshot_format: str) -> list[TierEntry]: ...

    def owns(self, entry: TierEntry) -> bool: ...

    def load(self, entry: TierEntry) -> bytes: ...

    def write(self, entry: TierEntry, source: bytes | SnapshotFile) -> None: ...

    def reject(self, entry: TierEntry, reason: str) -> str: ...

    @property
    def rejections(self) -> Sequence[Rejection]: ...

    def flush(self, timeout: float) -> bool: ...

    def close(self) -> None: ...

    def stats(self) -> dict[str, int | str]: ...


SPILL_WAIT = 60.0
"""How long a snapshot entering a full RAM tier waits at most for the blobs it pushes out to be
written to disk (:meth:`Tiers.make_ram_room`): past it the daemon goes over its memory budget
until they are, and says so in its log."""

SLOW_SPILL = 1.0
"""A wait for spilled blobs at least this long is logged (the disk is what a turn waits for)."""

WRITER_NICE = 19
"""The disk writer's scheduling priority (Linux ``nice`` is per thread): write-behind of a prefix
just computed runs while that turn's suffix and decode compute, and its hashing and copying into
the page cache took CPU from the engine's threads on a small machine (blueprint 0016)."""


_Item = TypeVar("_Item")


def writer_loop(writes: queue.SimpleQueue[_Item | None], write: Callable[[_Item], None]) -> None:
    """A writer thread's life (the disk tier's, the shared store's): at :data:`WRITER_NICE`, each
    queued item through ``write`` until None is queued."""
    with contextlib.suppress(OSError):  # lowering one's own priority needs no privilege
        os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), WRITER_NICE)
    while True:
        item = writes.get()
        if item is None:
            return
        write(item)


class Tiers:
    """The daemon's RAM and disk tiers (see the module docstring). Thread-safe."""

    def __init__(self, *, data_dir: Path | None, ram_bytes: int, disk_bytes: int) -> None:
        self.ram_budget = max(0, ram_bytes)
        self.ram_room: int | None = None
        """What the memory budget leaves the RAM tier beside the loaded models (None: no budget
        applies); :attr:`ram_limit` is the smaller of this and :attr:`ram_budget`."""
        self.disk_budget = max(0, disk_bytes) if data_dir is not None else 0
        self.directory = data_dir / "kv" if data_dir is not None else None
        self.disk_off_reason = "" if self.disk_budget else "disk tier off (budget 0)"
        self._lock = threading.RLock()
        self._entries: dict[str, TierEntry] = {}
        self.rejections: deque[Rejection] = deque(maxlen=_REJECTIONS_KEPT)
        self._refused: deque[Refused] = deque(maxlen=_REJECTIONS_KEPT)
        self.counters = {"written": 0, "write_failures": 0, "spilled_to_disk": 0, "dropped": 0, "rejected": 0}
        self._writes: queue.SimpleQueue[tuple[TierEntry, bytes | None] | None] = queue.SimpleQueue()
        self._pending_writes = 0
        self._idle = threading.Condition(self._lock)
        self._writer: threading.Thread | None = None
        self.remote: RemoteTier | None = None
        if self.disk_budget and self.directory is not None:
            try:
                self.directory.mkdir(parents=True, exist_ok=True, mode=0o700)
                self._scan()
            except OSError as exc:
                self._disk_off(f"{self.directory} is not usable ({exc.strerror or exc})")
            else:
                self._writer = threading.Thread(target=self._write_loop, name="kv-disk-writer", daemon=True)
                self._writer.start()

    # --- state ------------------------------------------------------------------------------------

    @property
    def ram_limit(self) -> int:
        """The bytes the RAM tier may hold now: its own budget, within the memory budget's room."""
        room = self.ram_room
        return self.ram_budget if room is None else max(0, min(self.ram_budget, room))

    def limit_ram(self, room: int) -> None:
        """The memory budget leaves the RAM tier ``room`` bytes (the budget minus what the loaded
        models take: one budget for both). A smaller room moves the least recently used blobs to
        disk (or drops them) at once; they leave the daemon's memory as their writes finish."""
        with self._lock:
            self.ram_room = room
            self._enforce_ram()

    @property
    def disk_on(self) -> bool:
        return self.disk_budget > 0 and not self.disk_off_reason

    @property
    def persistent(self) -> bool:
        """A persisted snapshot goes somewhere that outlives this daemon (the disk tier, or the
        remote tier)."""
        return self.disk_on or self.remote is not None

    def attach_remote(self, remote: RemoteTier) -> None:
        """Write persisted snapshots through to ``remote`` and look it up on a miss."""
        self.remote = remote

    def remote_candidates(self, model_digest: str, identity: str, snapshot_format: str) -> list[TierEntry]:
        """The remote tier's snapshots a runtime with this identity and format may restore
        (looked up when the local tiers and the KV miss; [] without a remote tier)."""
        remote = self.remote
        return [] if remote is None else remote.candidates(model_digest, identity, snapshot_format)

    def get(self, key: str) -> TierEntry | None:
        """The entry of that key, if the tiers still hold it."""
        with self._lock:
            return self._entries.get(key)

    def entries(self, model_digest: str | None = None) -> list[TierEntry]:
        with self._lock:
            return [
                e for e in self._entries.values() if model_digest is None or e.model_digest == model_digest
            ]

    def candidates(self, model_digest: str, identity: str, snapshot_format: str) -> list[TierEntry]:
        """Entries a runtime with this identity and snapshot format may restore.

        Entries written by another engine build or KV layout are never handed to this runtime;
        they stay (a daemon started with the other layout again uses them) until the budget
        removes them, least recently used first."""
        with self._lock:
            return [
                e
                for e in self._entries.values()
                if e.model_digest == model_digest
                and e.identity == identity
                and e.snapshot_format == snapshot_format
            ]

    # --- adding -----------------------------------------------------------------------------------

    def _same(self, e: TierEntry, model_digest: str, identity: str, snapshot_format: str) -> bool:
        return (
            e.model_digest == model_digest and e.identity == identity and e.snapshot_format == snapshot_format
        )

    def _covering(
        self, model_digest: str, identity: str, snapshot_format: str, tokens: list[int], truncatable: bool
    ) -> TierEntry | None:
        """An entry that already holds ``tokens`` (the same ones, or more when a restored
        sequence can be cut)."""
        existing = self._entries.get(entry_key(model_digest, identity, snapshot_format, tokens))
        if existing is not None:
            return existing
        if truncatable:
            for e in self._entries.values():
                if (
                    self._same(e, model_digest, identity, snapshot_format)
                    and len(e.tokens) >= len(tokens)
                    and e.tokens[: len(tokens)] == tokens
                ):
                    return e
        return None

    def _supersede(self, entry: TierEntry, *, files: bool = True) -> None:
        """Remove the entries whose tokens are a prefix of a new entry's (a restored sequence is
        cut to whatever prefix a turn needs). ``files`` False: only entries in RAM alone go (a
        blob entering RAM does not remove the crash-safe file of its start; its own file, once
        written, does)."""
        for e in list(self._entries.values()):
            if (
                e is not entry
                and (files or (e.path is None and not e.writing))
                and self._same(e, entry.model_digest, entry.identity, entry.snapshot_format)
                and len(e.tokens) < len(entry.tokens)
                and entry.tokens[: len(e.tokens)] == e.tokens
            ):
                self._remove(e, "superseded by a longer snapshot of the same context")

    def put(
        self,
        *,
        model_digest: str,
        identity: str,
        snapshot_format: str,
        tokens: Sequence[int],
        prefix_tokens: int,
        blob: bytes,
        truncatable: bool,
        remote: bool = False,
    ) -> TierEntry | None:
        """Keep the snapshot of a context that leaves the KV pool (in RAM, or straight on disk
        when the RAM tier is off or too small); ``remote``: persisted, written through to the
        remote tier too.

        Entries of the same identity whose tokens are a prefix of ``tokens`` are superseded
        when the engine can cut a restored sequence (``truncatable``); an entry that already
        covers ``tokens`` makes this one unnecessary. None if no tier could take it."""
        tokens = list(tokens)
        with self._lock:
            covering = self._covering(model_digest, identity, snapshot_format, tokens, truncatable)
            if covering is not None:
                covering.last_used = time.time()
                if remote:
                    self.persist(covering)
                return covering
            entry = TierEntry.new(model_digest, identity, snapshot_format, tokens, prefix_tokens, len(blob))
            key = entry.key
            if remote and self.remote is not None:
                self.remote.write(entry, blob)
            if self.ram_limit >= len(blob):
                if truncatable:
                    self._supersede(entry, files=False)
                entry.truncatable = truncatable
                entry.blob = blob
                self._entries[key] = entry
                self._enforce_ram()
                self._await_ram(0, SPILL_WAIT)
                return entry
            if self.disk_on and self.disk_budget >= len(blob):
                if truncatable:
                    self._supersede(entry)
                self._entries[key] = entry
                self._queue_write(entry, blob)
                return entry
            self.counters["dropped"] += 1
            return None

    def write_remote(
        self,
        *,
        model_digest: str,
        identity: str,
        snapshot_format: str,
        tokens: Sequence[int],
        prefix_tokens: int,
        blob: bytes,
    ) -> None:
        """Write a snapshot of a context that stays in the KV pool through to the remote tier
        only (no disk tier here to write it to; no RAM-tier copy)."""
        if self.remote is None:
            return
        entry = TierEntry.new(model_digest, identity, snapshot_format, list(tokens), prefix_tokens, len(blob))
        self.remote.write(entry, blob)

    def reserve(
        self,
        *,
        model_digest: str,
        identity: str,
        snapshot_format: str,
        tokens: Sequence[int],
        prefix_tokens: int,
        truncatable: bool,
        through: bool = True,
    ) -> tuple[TierEntry, Path | None] | None:
        """An entry for the snapshot of a context that stays in the KV pool, written to disk
        for crash safety and never kept in RAM (blueprint 0016), and through to the remote
        tier unless ``through`` is False (an eviction's, not a persisted copy): the entry and the temporary
        file the engine is to write its blob into (then :meth:`seal`, or :meth:`abandon`), or
        an entry that holds these tokens already and None (nothing to write), or None when
        the disk tier is off.

        The new entry is listed at once (a turn that chooses it waits for its file,
        :meth:`load`); the entries it covers are removed only when its file is sealed. An
        entry in RAM that holds exactly these tokens is written to disk instead and leaves
        RAM (the KV pool holds those bytes now)."""
        tokens = list(tokens)
        with self._lock:
            if not self.disk_on:
                return None
            covering = self._covering(model_digest, identity, snapshot_format, tokens, truncatable)
            if covering is not None:
                covering.last_used = time.time()
                if covering.path is None and covering.blob is not None:
                    if len(covering.tokens) == len(tokens):
                        self._leave_ram(covering)
                    else:
                        self._queue_write(covering, covering.blob)
                if through:
                    covering.through = True
                    self.persist(covering)
                return covering, None
            assert self.directory is not None
            entry = TierEntry.new(
                model_digest,
                identity,
                snapshot_format,
                tokens,
                prefix_tokens,
                0,
                writing=True,
                truncatable=truncatable,
                through=through,
            )
            key = entry.key
            self._entries[key] = entry
            entry.tmp = temporary(self.directory / f"{key}{SUFFIX}")
            self._pending_writes += 1  # until it is sealed (the writer's) or abandoned
            return entry, entry.tmp

    def seal(self, entry: TierEntry, saved: Saved) -> None:
        """The engine wrote (or failed to write) ``entry``'s temporary file: seal and index it
        on the writer thread, or record the failure (a file system that refuses writes turns
        the disk tier off, as the daemon's own writes do)."""
        if not saved.ok:
            self.abandon(entry)
            self._write_failed(entry, saved.errno or None, saved.detail)
            return
        with self._lock:
            entry.nbytes = saved.size
            self._writes.put((entry, None))

    def abandon(self, entry: TierEntry) -> None:
        """The engine did not write a reserved entry's file (it failed, or died): forget the
        entry and its file."""
        with self._lock:
            if entry.tmp is not None:
                with contextlib.suppress(OSError):
                    entry.tmp.unlink()
                entry.tmp = None
            entry.writing = False
            self._pending_writes -= 1
            self._idle.notify_all()
            if entry.path is None and entry.blob is None:
                self._entries.pop(entry.key, None)

    def _leave_ram(self, entry: TierEntry) -> None:
        """``entry``'s context is back in the KV pool: its RAM copy goes (on disk it stays, or
        is written there first when the disk tier is on; else the entry goes)."""
        if entry.blob is None:
            return
        if entry.path is not None:
            entry.blob = None
        elif self.disk_on and self.disk_budget >= entry.nbytes:
            entry.leaving = True
            self._queue_write(entry, entry.blob)  # the writer drops the blob once it is written
        else:
            self._entries.pop(entry.key, None)
            entry.blob = None

    def make_ram_room(self, nbytes: int, timeout: float = SPILL_WAIT) -> bool:
        """Room in the RAM tier for a blob of about ``nbytes`` about to be taken: the least
        recently used blobs move to disk (or are dropped), and this waits until those on their
        way there have left memory, so the tier with the newcomer stays within
        :attr:`ram_limit`. False when such a blob cannot be kept in RAM at all (larger than the
        limit): the caller has it written to disk without passing through here."""
        with self._lock:
            if nbytes > self.ram_limit:
                return False
            self._enforce_ram(nbytes)
            self._await_ram(nbytes, timeout)
            return True

    def _ram_held(self) -> int:
        """The bytes of blobs in memory: those kept, and those on their way to disk."""
        return sum(e.nbytes for e in self._entries.values() if e.blob is not None)

    def _spilling(self) -> bool:
        """Some blob in memory is being written to disk (it may leave RAM when that ends)."""
        return any(e.blob is not None and e.writing for e in self._entries.values())

    def _await_ram(self, extra: int, timeout: float) -> None:
        """Wait (the lock released meanwhile) until the blobs :meth:`_enforce_ram` sent to disk
        have left memory and ``extra`` more bytes fit, or nothing more is on its way, or
        ``timeout`` passes (logged: the daemon is over its budget until the writes finish).
        A full tier of blobs with no disk copy so slows an eviction to the disk's speed,
        rather than letting the writer's queue (and the daemon) grow past the budget."""
        started = time.monotonic()
        deadline = started + timeout
        while self._ram_held() + extra > self.ram_limit:
            if not self._spilling():
                self._enforce_ram(extra)  # a write failed (its blob stayed) or the limit fell
                if not self._spilling():
                    break
            if self._writer is None or not self._writer.is_alive():
                return  # closed: nothing will be written
            left = deadline - time.monotonic()
            if left <= 0:
                log.warning(
                    "the RAM tier holds %d bytes over its limit of %d while their writes to disk "
                    "finish (waited %.0f s)",
                    self._ram_held() + extra - self.ram_limit,
                    self.ram_limit,
                    timeout,
                )
                return
            self._idle.wait(left)
        waited = time.monotonic() - started
        if waited >= SLOW_SPILL:
            log.info("an eviction waited %.1f s for the RAM tier's blobs to be written to disk", waited)

    def _enforce_ram(self, extra: int = 0) -> None:
        """Over the RAM budget (with ``extra`` bytes about to arrive): move the least recently
        used blobs to disk, or drop them. A blob whose write is under way leaves when it ends."""
        used = self._ram_held() + extra
        limit = self.ram_limit
        if used <= limit:
            return
        for e in sorted(self._entries.values(), key=lambda e: e.last_used):
            if used <= limit:
                break
            if e.blob is None:
                continue
            used -= e.nbytes
            if e.path is not None or e.writing:
                e.blob = None if e.path is not None else e.blob
                if e.path is None:  # its write is queued: the writer drops the blob when done
                    e.leaving = True
                    continue
            elif self.disk_on and self.disk_budget >= e.nbytes:
                self.counters["spilled_to_disk"] += 1
                e.leaving = True
                self._queue_write(e, e.blob)
            else:
                self._entries.pop(e.key, None)
                e.blob = None
                self.counters["dropped"] += 1

    # --- using ------------------------------------------------------------------------------------

    def load(self, entry: TierEntry, timeout: float = 60.0) -> bytes | SnapshotFile:
        """The entry's blob from RAM, or the file and header to restore it from (the engine
        worker verifies and reads the file itself; a 100 MB payload read here and sent over the
        worker's socket cost 130-300 ms). An entry whose file the engine is still writing is
        waited for. Raises ``SnapshotError`` when neither is left."""
        remote = self.remote
        if remote is not None and remote.owns(entry):
            entry.last_used = time.time()
            return remote.load(entry)
        deadline = time.monotonic() + timeout
        with self._lock:
            entry.last_used = time.time()
            while entry.blob is None and entry.path is None and entry.writing:
                left = deadline - time.monotonic()
                if left <= 0:
                    break
                self._idle.wait(left)
            blob = entry.blob
            path, header = entry.path, entry.header
        if blob is not None:
            return blob
        if path is None or header is None:
            raise SnapshotError("the snapshot is no longer available")
        return SnapshotFile(path, header)

    def take(self, entry: TierEntry) -> None:
        """A restore brought ``entry``'s whole context back into the KV pool: a context live in
        the KV is not also held in the RAM tier (moved, not copied). Its disk copy stays, or
        is written first (crash safety: a worker that dies takes the KV with it)."""
        with self._lock:
            if self._entries.get(entry.key) is entry:
                self._leave_ram(entry)

    def persist(self, entry: TierEntry) -> None:
        """Write an entry that is only in RAM to the disk tier too (write-behind), and write it
        through to the remote tier (one whose file is still being written, once sealed)."""
        with self._lock:
            if entry.path is None and entry.blob is not None and self.disk_on and entry.key in self._entries:
                self._queue_write(entry, entry.blob)
            entry.through = True
            remote = self.remote
            if remote is not None and not remote.owns(entry):
                source: bytes | SnapshotFile | None = entry.blob
                if source is None and entry.path is not None and entry.header is not None:
                    source = SnapshotFile(entry.path, entry.header)
                if source is not None:
                    remote.write(entry, source)

    def touch(self, entry: TierEntry) -> None:
        with self._lock:
            entry.last_used = time.time()

    def claim_refused(
        self, model_digest: str, identity: str, snapshot_format: str, target: Sequence[int], min_tokens: int
    ) -> Rejection | None:
        """The rejection of a file refused at indexing that would have served a cold turn for
        ``target`` (:meth:`Refused.would_serve`), once: the first such turn says
        ``snapshot_rejected`` with its reason, later ones say what happened to them."""
        with self._lock:
            for refused in self._refused:
                if refused.would_serve(model_digest, identity, snapshot_format, target, min_tokens):
                    self._refused.remove(refused)
                    return refused.rejection
        return None

    def reject(self, entry: TierEntry, reason: str) -> None:
        """Remove an entry that must not be used, with its reason logged."""
        remote = self.remote
        if remote is not None and remote.owns(entry):
            remote.reject(entry, reason)  # counted and kept there
            return
        where = str(entry.path) if entry.path is not None else f"ram:{entry.key}"
        log.warning("removed KV snapshot %s: %s", where, reason)
        with self._lock:
            self.rejections.append(Rejection(time.time(), where, reason))
            self.counters["rejected"] += 1
            self._remove(entry, "")

    def _remove(self, entry: TierEntry, why: str) -> None:
        self._entries.pop(entry.key, None)
        entry.blob = None
        if entry.path is not None:
            with contextlib.suppress(OSError):
                entry.path.unlink()
            entry.path = None
        if why:
            log.debug("removed KV snapshot %s: %s", entry.key, why)

    # --- the disk ---------------------------------------------------------------------------------

    def _queue_write(self, entry: TierEntry, blob: bytes) -> None:
        if entry.writing or entry.path is not None or self._writer is None:
            return
        entry.writing = True
        self._pending_writes += 1
        self._writes.put((entry, blob))

    def _write_loop(self) -> None:
        writer_loop(self._writes, self._write_one)

    def _write_one(self, item: tuple[TierEntry, bytes | None]) -> None:
        entry, blob = item
        try:
            self._write(entry, blob)
        finally:
            with self._lock:
                entry.writing = False
                if entry.tmp is not None:  # not sealed: the entry has nothing to restore from
                    with contextlib.suppress(OSError):
                        entry.tmp.unlink()
                    entry.tmp = None
                    if entry.path is None and entry.blob is None:
                        self._entries.pop(entry.key, None)
                self._pending_writes -= 1
                self._idle.notify_all()

    def _write(self, entry: TierEntry, blob: bytes | None) -> None:
        """Write a RAM blob to its file, or seal a file the engine wrote (``blob`` None)."""
        assert self.directory is not None
        with self._lock:
            if not self.disk_on or entry.key not in self._entries:
                if entry.blob is None:
                    self._entries.pop(entry.key, None)
                return
            self._make_disk_room(entry.nbytes)
        path = self.directory / f"{entry.key}{SUFFIX}"
        fields = {
            "model_digest": entry.model_digest,
            "identity": entry.identity,
            "snapshot_format": entry.snapshot_format,
            "tokens": entry.tokens,
            "prefix_tokens": entry.prefix_tokens,
        }
        try:
            if blob is not None:
                header = write_atomic(path, payload=blob, **fields)  # type: ignore[arg-type]
            else:
                assert entry.tmp is not None
                header = seal_file(entry.tmp, path, **fields)  # type: ignore[arg-type]
                entry.tmp = None
        except (OSError, SnapshotError) as exc:
            self._write_failed(
                entry, exc.errno if isinstance(exc, OSError) else None, f"writing {path.name} failed ({exc})"
            )
            return
        with self._lock:
            self.counters["written"] += 1
            if entry.key not in self._entries:  # removed while it was being written
                with contextlib.suppress(OSError):
                    path.unlink()
                return
            entry.path = path
            entry.header = header
            entry.nbytes = header.payload_bytes
            if entry.truncatable:
                self._supersede(entry)
            remote = self.remote
            if entry.through and remote is not None and not remote.owns(entry):
                remote.write(entry, SnapshotFile(path, header))
            if entry.leaving or self._ram_held() > self.ram_limit:
                entry.blob = None
                entry.leaving = False

    def _write_failed(self, entry: TierEntry, code: int | None, detail: str) -> None:
        with self._lock:
            self.counters["write_failures"] += 1
            if entry.blob is None:
                self._entries.pop(entry.key, None)
        if code in _DISK_OFF_ERRNOS or code is None:
            self._disk_off(
                detail if detail.startswith("writing") else f"writing {entry.key}{SUFFIX} failed ({detail})"
            )
        else:
            log.warning("%s", detail)

    def _make_disk_room(self, nbytes: int) -> None:
        used = sum(e.nbytes for e in self._entries.values() if e.path is not None)
        for e in sorted(self._entries.values(), key=lambda e: e.last_used):
            if used + nbytes <= self.disk_budget:
                return
            if e.path is None:
                continue
            used -= e.nbytes
            if e.blob is not None:
                with contextlib.suppress(OSError):
                    e.path.unlink()
                e.path = None
                e.header = None
            else:
                self._remove(e, "disk tier full")
                self.counters["dropped"] += 1

    def _disk_off(self, reason: str) -> None:
        with self._lock:
            if self.disk_off_reason:
                return
            self.disk_off_reason = reason
            for e in list(self._entries.values()):
                if e.blob is None and not e.writing:
                    self._entries.pop(e.key, None)
        log.error("the disk tier is off: %s; serving continues with the RAM tier only", reason)

    def _scan(self) -> None:
        """Index the snapshot files a previous daemon left (headers and tokens only)."""
        assert self.directory is not None
        found = 0
        for path in sorted(self.directory.iterdir()):
            name = path.name
            if name.startswith(".") and name.endswith(".tmp"):
                with contextlib.suppress(OSError):
                    path.unlink()  # a write the previous daemon did not finish
                continue
            if not name.endswith(SUFFIX) or not path.is_file():
                continue
            try:
                header, tokens = read_header(path)
            except (OSError, SnapshotError) as exc:
                reason = str(exc) if isinstance(exc, SnapshotError) else f"unreadable ({exc})"
                self._refuse_at_scan(path, reason, salvage(path))
                continue
            key = name[: -len(SUFFIX)]
            if key != entry_key(header.model_digest, header.identity, header.snapshot_format, tokens):
                held = Salvaged(
                    header.model_digest,
                    header.identity,
                    bytes_hash(header.snapshot_format)[:8],
                    tuple(tokens),
                )
                self._refuse_at_scan(path, "its name does not match its contents", held)
                continue
            self._entries[key] = TierEntry(
                key=key,
                model_digest=header.model_digest,
                identity=header.identity,
                snapshot_format=header.snapshot_format,
                tokens=tokens,
                prefix_tokens=header.prefix_tokens,
                nbytes=path.stat().st_size,
                path=path,
                header=header,
                last_used=path.stat().st_mtime,
                created=header.created,
            )
            found += 1
        if found:
            log.info("disk tier: %d KV snapshots found in %s", found, self.directory)
        with self._lock:
            self._make_disk_room(0)

    def _refuse_at_scan(self, path: Path, reason: str, held: Salvaged) -> None:
        """Remove a file that failed indexing; keep what it held for the turn it would serve."""
        log.warning("removed KV snapshot %s: %s", path, reason)
        rejection = Rejection(time.time(), str(path), reason)
        self.rejections.append(rejection)
        self._refused.append(Refused(rejection, held))
        self.counters["rejected"] += 1
        with contextlib.suppress(OSError):
            path.unlink()

    def flush(self, timeout: float) -> bool:
        """Wait until every queued write, and every file an engine was asked to write, is on
        disk and through to the remote tier (True) or ``timeout`` passes (False)."""
        deadline = time.monotonic() + timeout
        with self._lock:
            while self._pending_writes:
                left = deadline - time.monotonic()
                if left <= 0:
                    return False
                self._idle.wait(left)
        remote = self.remote
        return remote is None or remote.flush(max(0.0, deadline - time.monotonic()))

    def close(self) -> None:
        if self._writer is not None:
            self._writes.put(None)
            self._writer.join(timeout=30)
        if self.remote is not None:
            self.remote.close()

    def recent_rejections(self) -> list[Rejection]:
        """The snapshots refused lately, here and in the remote tier, oldest first."""
        with self._lock:
            mine = list(self.rejections)
        theirs = list(self.remote.rejections) if self.remote is not None else []
        return sorted(mine + theirs, key=lambda r: r.at)[-_REJECTIONS_KEPT:]

    def stats(self) -> dict[str, int | str]:
        remote = self.remote.stats() if self.remote is not None else {}
        with self._lock:
            ram = [e for e in self._entries.values() if e.blob is not None]
            disk = [e for e in self._entries.values() if e.path is not None]
            if self.remote is not None:
                # A snapshot still being written to disk goes through to the store once sealed:
                # it is on its way there too (what a SIGKILL now would lose).
                owns = self.remote.owns
                remote["shared_pending"] = int(remote.get("shared_pending", 0)) + sum(
                    1 for e in self._entries.values() if e.writing and e.through and not owns(e)
                )
            return {
                **remote,
                "ram_entries": len(ram),
                "ram_bytes": sum(e.nbytes for e in ram),
                "ram_budget": self.ram_limit,
                "disk_entries": len(disk),
                "disk_bytes": sum(e.nbytes for e in disk),
                "disk_budget": self.disk_budget,
                "disk_off_reason": self.disk_off_reason,
                **self.counters,
            }


def default_budgets(data_dir: Path | None, *, available_ram: int, ram_cap: int = 8 << 30) -> tuple[int, int]:
    """Default tier budgets: a quarter of the RAM available at start (at most 8 GiB) and a tenth
    of the free disk under the data directory (at most 32 GiB)."""
    ram = min(ram_cap, available_ram // 4)
    disk = 0
    if data_dir is not None:
        probe = data_dir
        while not probe.exists() and probe != probe.parent:
            probe = probe.parent
        try:
            st = os.statvfs(probe)
            disk = min(32 << 30, st.f_bavail * st.f_frsize // 10)
        except OSError:
            disk = 0
    return ram, disk
