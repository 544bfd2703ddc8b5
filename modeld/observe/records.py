"""Request records: one per turn, over every API and gRPC, kept in a ring and an append-only file.

What: :class:`Records` is the daemon's journal of turns. A turn's record is opened where the
turn starts (the HTTP runner, for a request of any API; the first operation of a gRPC
session's turn) and finished where it ends (the response's last byte; the decode's final
chunk). While it runs, the session's :class:`~modeld.observe.metrics.ObservedSession` adds to
it the very numbers it adds to the Prometheus counters, at the same points (:meth:`Recording.add`
is called beside every ``inc``), so the records of a model sum to ``/metrics`` exactly, and
the live page, ``modeld requests``, ``modeld top`` and ``modeld status`` read the same counts
(blueprint 0022, "One truth").

A record (:class:`RequestRecord`) holds ids and labels (its id, job label, agent, API,
conversation key, session, model), its timings (TTFT, prefill, restore, decode), its reuse
(prefix tokens looked up, reused and from where, restored, computed, generated; where a prefix
that was not fully warm diverged: token, byte, segment kind, message), its finish, its error,
and the bytes in and out. Never prompt text: ``excerpt`` (a bounded slice of the prefix at the
point it diverged) is filled only when the daemon was started with ``--ui-show-prompts``.

Kept: the newest ``ring`` records in memory (running ones included), and every finished one
as a JSON line in ``requests/*.jsonl`` under the data directory. The file is cut in segments
of an eighth of the byte budget; a segment whose newest record is older than ``max_age`` goes,
and the oldest segments go while the whole exceeds ``max_bytes`` (retention applies a segment
at a time). A restarted daemon reads the newest records back into its ring.

What not: no prompt text (above), no HTTP or gRPC (the transports shape these dicts), no
engine import.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import threading
import time
import uuid
from collections import OrderedDict
from collections.abc import Callable, Iterator
from dataclasses import asdict, dataclass, fields, replace
from pathlib import Path
from typing import Any

__all__ = [
    "COUNTED",
    "MAX_LABEL_CHARS",
    "MAX_QUERY_RECORDS",
    "Recording",
    "RecordQuery",
    "Records",
    "RequestRecord",
    "clean_label",
    "sums",
]

log = logging.getLogger("modeld.records")

MAX_LABEL_CHARS = 256
"""The longest job label, agent name or conversation key a record keeps (a longer one is
refused where a client sends it)."""
MAX_QUERY_RECORDS = 1000
"""The most records one query returns."""
EXCERPT_BYTES = 240
"""Bytes of the prefix around the point it diverged, kept only with ``--ui-show-prompts``."""
SEGMENTS = 8
"""The byte budget is kept in this many files at most (retention drops a whole file)."""
MIN_SEGMENT_BYTES = 64 << 10
DIR_NAME = "requests"

COUNTED = (
    "prefix_tokens",
    "reused_kv",
    "reused_ram",
    "reused_disk",
    "reused_shared",
    "prefilled_tokens",
    "prompt_tokens",
    "cached_tokens",
    "generated_tokens",
    "decodes",
    "drafted_tokens",
    "accepted_tokens",
    "draft_batches",
    "forced_tokens",
)
"""The record's counts that are also Prometheus counters (``modeld_prefix_cache_queries``,
``..._hits{source}``, ``modeld_prompt_tokens_prefilled``, ``modeld_prompt_tokens``,
``..._cached``, ``modeld_generation_tokens``, ``modeld_requests``, the speculation series), added
to both by the same call."""


@dataclass(frozen=True, slots=True)
class RequestRecord:
    """One turn. Times are Unix seconds (``started_at``, ``ended_at``) and milliseconds.

    ``state``: ``running`` or ``done``; ``stage`` while running: ``waiting`` (for its session or a
    slot), ``prefix``, ``suffix``, ``decode``, ``answer`` (the last bytes to the client).
    ``finish``: the decode's finish reason (``stop``, ``length``, ``tool_calls``, ...), ``error``
    with ``error`` the stable reason token (``no_slot_available``, ``context_overflow``,
    ``canceled``, ...), or ``prefix`` for a turn that only put a prefix in place.
    ``reused_{kv,ram,disk,shared}``: the prefix's reused tokens by where they came from (a turn
    of ``n`` choices decoded one by one puts its prefix in place once per choice: each counts).
    """

    id: str
    api: str  # openai, responses, anthropic, ollama, grpc
    model: str = ""
    job: str = ""
    agent: str = ""  # the client program (its User-Agent's product), when it says
    conversation: str = ""
    session: str = ""
    state: str = "running"
    stage: str = "waiting"
    started_at: float = 0.0
    ended_at: float = 0.0
    finish: str = ""
    error: str = ""
    error_message: str = ""
    status: int = 0  # the HTTP status (0 over gRPC)
    bytes_in: int = 0
    bytes_out: int = 0
    outcome: str = ""  # warm, partial, cold (the last prefix put in place)
    reason: str = ""
    tier: str = ""  # where the reused tokens came from (kv, ram, disk, shared)
    diverged_at_token: int | None = None
    diverged_at_byte: int | None = None
    diverged_segment: str = ""
    diverged_message: int | None = None
    prefix_tokens: int = 0
    reused_kv: int = 0
    reused_ram: int = 0
    reused_disk: int = 0
    reused_shared: int = 0
    restored_tokens: int = 0  # of the suffix's, restored with a displaced prefix
    prefilled_tokens: int = 0  # prompt tokens computed
    prompt_tokens: int = 0
    cached_tokens: int = 0
    generated_tokens: int = 0
    decodes: int = 0  # decodes finished (choices)
    drafted_tokens: int = 0
    accepted_tokens: int = 0
    draft_batches: int = 0
    forced_tokens: int = 0
    ttft_ms: float | None = None
    prefill_ms: float = 0.0
    restore_ms: float = 0.0
    decode_ms: float = 0.0
    progress_done: int = 0  # a long prefill's progress (running)
    progress_total: int = 0
    excerpt: str = ""  # only with --ui-show-prompts

    @property
    def reused_tokens(self) -> int:
        return self.reused_kv + self.reused_ram + self.reused_disk + self.reused_shared

    @property
    def decode_tps(self) -> float:
        """Generated tokens per second of decoding (0 when unknown)."""
        if self.decode_ms <= 0 or self.generated_tokens <= 1:
            return 0.0
        return self.generated_tokens / (self.decode_ms / 1000.0)

    def to_json(self) -> dict[str, Any]:
        """The record as JSON (with its derived ``reused_tokens`` and ``decode_tps``)."""
        out = asdict(self)
        out["reused_tokens"] = self.reused_tokens
        out["decode_tps"] = round(self.decode_tps, 2)
        return out

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> RequestRecord:
        names = {f.name for f in fields(cls)}
        return cls(**{k: v for k, v in data.items() if k in names})


def clean_label(text: str, what: str = "label") -> str:
    """A label a client sent, as a record keeps it: at most :data:`MAX_LABEL_CHARS` printable
    characters. Raises ``ValueError`` naming ``what`` otherwise (the transport refuses it)."""
    if len(text) > MAX_LABEL_CHARS:
        raise ValueError(f"the {what} is {len(text)} characters; the limit is {MAX_LABEL_CHARS}")
    if any(not ch.isprintable() for ch in text):
        raise ValueError(f"the {what} holds a control character")
    return text


@dataclass(frozen=True, slots=True)
class RecordQuery:
    """Which records a listing wants: ``job`` and ``conversation`` exactly, ``since`` a Unix time
    (records started at or after it), the newest ``limit`` (oldest first)."""

    job: str = ""
    conversation: str = ""
    since: float = 0.0
    limit: int = 100
    running: bool = False  # only the turns running now

    def matches(self, record: RequestRecord) -> bool:
        return (
            (not self.job or record.job == self.job)
            and (not self.conversation or record.conversation == self.conversation)
            and record.started_at >= self.since
            and (not self.running or record.state == "running")
        )


class Recording:
    """A running record, updated as its turn goes (thread-safe: every change takes the store's
    lock). ``external``: the transport that opened it finishes it (the HTTP runner, after the
    last byte); else the session's observer does, at the decode's end."""

    def __init__(self, store: Records, record: RequestRecord, *, external: bool) -> None:
        self._store = store
        self.record = record
        self.external = external
        self.id = record.id
        self.show_prompts = store.show_prompts

    def add(self, **counts: int) -> None:
        """Add to the record's counts (the same numbers the metrics count)."""
        with self._store._lock:
            r = self.record
            self.record = replace(r, **{k: getattr(r, k) + v for k, v in counts.items()})

    def set(self, **values: Any) -> None:
        with self._store._lock:
            self.record = replace(self.record, **values)
        if "stage" in values:
            self._store._changed()

    def finish(self, **values: Any) -> None:
        """The turn ended: the record is written to the file (once)."""
        self._store._finish(self, values)


class Records:
    """The ring of recent records and the append-only file (module docstring). ``directory``
    None: memory only (an engine without a data directory)."""

    def __init__(
        self,
        directory: Path | None,
        *,
        ring: int = 4096,
        max_age_seconds: float = 7 * 86400.0,
        max_bytes: int = 64 << 20,
        show_prompts: bool = False,
        clock: Callable[[], float] = time.time,
    ) -> None:
        self.directory = directory
        self.ring = max(1, ring)
        self.max_age_seconds = max_age_seconds
        self.max_bytes = max_bytes
        self.show_prompts = show_prompts
        self._clock = clock
        self._lock = threading.Lock()
        self._write_lock = threading.Lock()
        self._records: OrderedDict[str, Recording] = OrderedDict()
        self.version = 0  # moves on every start, stage change and finish (the live page waits on it)
        self._segment: Path | None = None
        self._file_broken = False
        if directory is not None and max_bytes > 0:
            try:
                directory.mkdir(parents=True, exist_ok=True, mode=0o700)
                self._prune()
                self._load()
            except OSError as exc:
                log.warning("request records will not be kept on disk (%s): %s", directory, exc)
                self._file_broken = True

    @classmethod
    def under(cls, data_dir: Path, **kwargs: Any) -> Records:
        return cls(data_dir / DIR_NAME, **kwargs)

    # --- recording ----------------------------------------------------------------------------

    def begin(self, api: str, *, external: bool = False, rid: str = "", **labels: Any) -> Recording:
        """Open a record for a turn starting now."""
        record = RequestRecord(id=rid or uuid.uuid4().hex[:24], api=api, started_at=self._clock(), **labels)
        recording = Recording(self, record, external=external)
        with self._lock:
            self._records[record.id] = recording
            self._records.move_to_end(record.id)
            self._trim()
            self.version += 1
        return recording

    def _changed(self) -> None:
        with self._lock:
            self.version += 1

    def _trim(self) -> None:
        """Keep the ring's size: the oldest finished records leave first (running ones stay)."""
        excess = len(self._records) - self.ring
        if excess <= 0:
            return
        for key in [k for k, r in self._records.items() if r.record.state != "running"][:excess]:
            del self._records[key]

    def _finish(self, recording: Recording, values: dict[str, Any]) -> None:
        with self._lock:
            if recording.record.state == "done":
                return
            recording.record = replace(
                recording.record, **values, state="done", stage="", ended_at=self._clock(), progress_done=0
            )
            record = recording.record
            self.version += 1
        self._append(record)

    # --- reading ------------------------------------------------------------------------------

    def get(self, rid: str) -> RequestRecord | None:
        """A record by id: from the ring, else from the file."""
        with self._lock:
            found = self._records.get(rid)
            if found is not None:
                return found.record
        for record in self._from_files():
            if record.id == rid:
                return record
        return None

    def recent(self) -> list[RequestRecord]:
        """Every record in the ring, oldest first."""
        with self._lock:
            return [r.record for r in self._records.values()]

    def query(self, q: RecordQuery) -> list[RequestRecord]:
        """The newest ``q.limit`` records that match, oldest first; the file is read when the ring
        may not hold them all."""
        limit = max(1, min(q.limit, MAX_QUERY_RECORDS))
        with self._lock:
            ring = [r.record for r in self._records.values()]
            full = len(ring) >= self.ring
        found = [r for r in ring if q.matches(r)]
        if len(found) < limit and full and not q.running:
            oldest = ring[0].started_at if ring else float("inf")
            seen = {r.id for r in ring}
            older = [
                r for r in self._from_files() if r.id not in seen and r.started_at < oldest and q.matches(r)
            ]
            found = sorted(older, key=lambda r: r.started_at)[-(limit - len(found)) :] + found
        return found[-limit:]

    # --- the file -----------------------------------------------------------------------------

    def _segments(self) -> list[Path]:
        if self.directory is None or not self.directory.is_dir():
            return []
        return sorted(self.directory.glob("requests-*.jsonl"))

    def _segment_bytes(self) -> int:
        return max(MIN_SEGMENT_BYTES, self.max_bytes // SEGMENTS)

    def _append(self, record: RequestRecord) -> None:
        if self.directory is None or self.max_bytes <= 0 or self._file_broken:
            return
        line = (json.dumps(record.to_json(), separators=(",", ":")) + "\n").encode()
        with self._write_lock:
            try:
                segment = self._segment
                if segment is None or not segment.exists() or segment.stat().st_size >= self._segment_bytes():
                    segment = self.directory / f"requests-{time.time_ns():020d}.jsonl"
                    self._segment = segment
                    self._prune()
                fd = os.open(segment, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o600)
                try:
                    os.write(fd, line)
                finally:
                    os.close(fd)
            except OSError as exc:
                log.warning("a request record could not be written (%s); records stay in memory", exc)
                self._file_broken = True

    def _prune(self) -> None:
        """Retention: segments past the age, then the oldest while over the bytes."""
        now = self._clock()
        segments = self._segments()
        sizes: dict[Path, int] = {}
        for path in segments:
            try:
                st = path.stat()
            except OSError:
                continue
            if (
                self.max_age_seconds > 0
                and st.st_mtime < now - self.max_age_seconds
                and path != self._segment
            ):
                with contextlib.suppress(OSError):
                    path.unlink()
                continue
            sizes[path] = st.st_size
        total = sum(sizes.values())
        for path in sorted(sizes):
            if total <= self.max_bytes or path == self._segment:
                break
            with contextlib.suppress(OSError):
                path.unlink()
            total -= sizes[path]

    def _from_files(self) -> Iterator[RequestRecord]:
        """Every record in the file, newest segment first (a bad line is skipped)."""
        cutoff = self._clock() - self.max_age_seconds if self.max_age_seconds > 0 else 0.0
        for path in reversed(self._segments()):
            try:
                lines = path.read_bytes().splitlines()
            except OSError:
                continue
            for line in reversed(lines):
                try:
                    record = RequestRecord.from_json(json.loads(line))
                except (ValueError, TypeError):
                    continue
                if record.started_at >= cutoff:
                    yield record

    def _load(self) -> None:
        """Fill the ring with the newest records of the file (a restart keeps them)."""
        loaded: list[RequestRecord] = []
        for record in self._from_files():
            loaded.append(record)
            if len(loaded) >= self.ring:
                break
        for record in reversed(loaded):
            self._records[record.id] = Recording(self, record, external=True)

    def stats(self) -> dict[str, int]:
        """What the file holds now (``modeld status``, the page)."""
        segments = self._segments()
        total = 0
        for path in segments:
            with contextlib.suppress(OSError):
                total += path.stat().st_size
        with self._lock:
            kept = len(self._records)
        return {"ring": kept, "ring_limit": self.ring, "files": len(segments), "file_bytes": total}


def sums(records: list[RequestRecord], key: Callable[[RequestRecord], str]) -> dict[str, dict[str, int]]:
    """The counted fields (:data:`COUNTED`) of ``records`` summed by ``key``."""
    out: dict[str, dict[str, int]] = {}
    for r in records:
        group = out.setdefault(key(r), dict.fromkeys(COUNTED, 0))
        for name in COUNTED:
            group[name] += getattr(r, name)
    return out
