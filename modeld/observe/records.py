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
as a JSON line in ``requests/*.jsonl`` under the data directory (:mod:`modeld.observe.recordfile`:
appended by a thread of its own, retention by age and bytes a segment at a time;
:meth:`Records.close` writes what is pending). A restarted daemon reads the newest records back
into its ring. For the live page it keeps, as records finish, each conversation's sums
(:meth:`Records.tallies`) and each model's since it started (:meth:`Records.by_model`).

What not: no prompt text (above), no HTTP or gRPC (the transports shape these dicts), no
engine import.
"""

from __future__ import annotations

import itertools
import json
import logging
import threading
import time
import uuid
from collections import OrderedDict, deque
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field, fields, replace
from pathlib import Path
from typing import Any

from modeld.observe.recordfile import RecordFile

__all__ = [
    "AHEAD",
    "COUNTED",
    "MAX_LABEL_CHARS",
    "MAX_QUERY_RECORDS",
    "REFUSALS",
    "Recording",
    "RecordQuery",
    "Records",
    "RequestRecord",
    "Tally",
    "clean_label",
    "conversation_of",
    "sums",
]

log = logging.getLogger("modeld.records")

AHEAD = "ahead"
"""The finish of a record of work a turn left its session (:meth:`Recording.follow_up`): no turn."""
MAX_LABEL_CHARS = 256
"""The longest job label, agent name or conversation key a record keeps (a longer one is
refused where a client sends it)."""
MAX_QUERY_RECORDS = 1000
"""The most records one query returns."""
REFUSALS = (
    "no_slot_available",
    "busy",
    "limit_exceeded",
    "shutting_down",
    "draining",
    "context_overflow",
    "context_length_exceeded",
)
"""Error codes the page lists as refusals (admission, and a prompt over the window: the contract's
``context_overflow``, which OpenAI's words call ``context_length_exceeded``)."""
REFUSALS_KEPT = 50
MIN_RATE_MS = 50.0
"""The shortest decode a record gives a rate for."""
EXCERPT_BYTES = 240
"""Bytes of the prefix around the point it diverged, kept only with ``--ui-show-prompts``."""
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
    ``canceled``, ...), ``prefix`` for a turn that only put a prefix in place, or ``ahead`` for
    the next turn's prefix computed while the user read an answer (``--prefill-ahead``: no turn
    of its own, its work counted here; the turn after it reuses it).
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
        """Generated tokens per second of decoding (0 when unknown, or too short to say: a
        decode of a few milliseconds)."""
        if self.decode_ms < MIN_RATE_MS or self.generated_tokens <= 1:
            return 0.0
        return self.generated_tokens / (self.decode_ms / 1000.0)

    def to_json(self) -> dict[str, Any]:
        """The record as JSON (with its derived ``reused_tokens`` and ``decode_tps``)."""
        out = {name: getattr(self, name) for name in _NAMES}
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


def conversation_of(record: RequestRecord) -> str:
    """The conversation a record belongs to (a gRPC session's turns: the session)."""
    return record.conversation or f"{record.api}:{record.session}"


@dataclass(slots=True)
class Tally:
    """A conversation's finished records in the ring: how many turns, the counts of every record
    summed (a prefill ahead of a turn, finish ``ahead``, included), the newest turn's record."""

    key: str
    turns: int = 0
    sums: dict[str, int] = field(default_factory=lambda: dict.fromkeys(COUNTED, 0))
    last: RequestRecord | None = None


_FIELDS = tuple(f.name for f in fields(RequestRecord))
_NAMES = _FIELDS
_DEFAULTS: dict[str, Any] = {f.name: f.default for f in fields(RequestRecord) if f.name not in ("id", "api")}


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
    """A record as its turn goes (thread-safe: every change takes the store's lock). Its fields
    are a plain dict while it changes (an update on a turn's path costs a dict write, not a new
    record); :attr:`record` is a snapshot, kept until the next change. ``external``: the
    transport that opened it finishes it (the HTTP runner, after the last byte); else the
    session's observer does, at the decode's end."""

    def __init__(self, store: Records, values: dict[str, Any], *, external: bool) -> None:
        self._store = store
        self._values = values
        self._snapshot: RequestRecord | None = None
        self._json: str | None = None
        self._holds = 1  # who still works on the turn: its opener, and a session it was handed to
        self.external = external
        self.id: str = values["id"]
        self.show_prompts = store.show_prompts

    @property
    def record(self) -> RequestRecord:
        with self._store._lock:
            return self._record()

    def _record(self) -> RequestRecord:  # with the store's lock held
        if self._snapshot is None:
            self._snapshot = RequestRecord(**self._values)
            self._json = None
        return self._snapshot

    def _json_text(self) -> str:  # with the store's lock held; a finished record's is made once
        if self._snapshot is None or self._json is None:
            self._json = json.dumps(self._record().to_json(), separators=(",", ":"))
        return self._json

    @property
    def state(self) -> str:
        return str(self._values["state"])

    def get(self, name: str) -> Any:
        return self._values[name]

    def add(self, **counts: int) -> None:
        """Add to the record's counts (the same numbers the metrics count)."""
        values = self._values
        with self._store._lock:
            for k, v in counts.items():
                values[k] += v
            self._snapshot = None
            if values["state"] == "done":  # counted after it was let go (an abandoned turn's engine)
                self._store._retally(self, counts)

    def set(self, **values: Any) -> None:
        with self._store._lock:
            self._values.update(values)
            self._snapshot = None
            if "stage" in values:
                self._store.version += 1

    def hold(self) -> None:
        """One more party works on the turn (the session its transport handed it to)."""
        with self._store._lock:
            self._holds += 1

    def follow_up(self) -> Recording:
        """A record for work this turn left its session (a prefill ahead of the next turn:
        finish ``ahead``), with the turn's API, model, job, agent and conversation; its opener
        finishes it, as the transport does a turn's."""
        v = self._values
        labels = {k: v[k] for k in ("model", "job", "agent", "conversation")}
        return self._store.begin(v["api"], external=True, finish=AHEAD, **labels)

    def finish(self, **values: Any) -> None:
        """A party is done with the turn (its transport after the last byte; the session at its
        decode's end): ``values`` are set, and when the last lets go the record is done."""
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
        self.show_prompts = show_prompts
        self._clock = clock
        self._lock = threading.Lock()
        self._records: OrderedDict[str, Recording] = OrderedDict()
        self.version = 0  # moves on every start, stage change and finish (the live page waits on it)
        self.running_count = 0  # records not done
        self._file: RecordFile | None = None
        self._tallies: OrderedDict[str, Tally] = OrderedDict()  # the last finished last
        self.started_at = clock()
        self._models: dict[str, dict[str, int]] = {}  # since started_at, by model (never trimmed)
        self._refused: deque[Recording] = deque(maxlen=REFUSALS_KEPT)
        if directory is not None and max_bytes > 0:
            try:
                self._file = RecordFile(
                    directory, max_bytes=max_bytes, max_age_seconds=max_age_seconds, clock=clock
                )
                self._load()
            except OSError as exc:
                log.warning("request records will not be kept on disk (%s): %s", directory, exc)

    @classmethod
    def under(cls, data_dir: Path, **kwargs: Any) -> Records:
        return cls(data_dir / DIR_NAME, **kwargs)

    # --- recording ----------------------------------------------------------------------------

    def begin(self, api: str, *, external: bool = False, rid: str = "", **labels: Any) -> Recording:
        """Open a record for a turn starting now."""
        values = {
            **_DEFAULTS,
            **labels,
            "id": rid or uuid.uuid4().hex[:24],
            "api": api,
            "started_at": self._clock(),
        }
        recording = Recording(self, values, external=external)
        with self._lock:
            self._records[recording.id] = recording
            self._records.move_to_end(recording.id)
            self.running_count += 1
            self._trim()
            self.version += 1
        return recording

    def _trim(self) -> None:
        """Keep the ring's size: the oldest finished records leave first (running ones stay)."""
        excess = len(self._records) - self.ring
        if excess <= 0:
            return
        done: list[str] = []
        for key, recording in self._records.items():  # oldest first: stop once enough are found
            if recording.state != "running":
                done.append(key)
                if len(done) == excess:
                    break
        for key in done:
            self._untally(self._records.pop(key))

    def _finish(self, recording: Recording, values: dict[str, Any]) -> None:
        with self._lock:
            if recording.state == "done":
                return
            recording._values.update(values)
            recording._snapshot = None
            recording._holds -= 1
            if recording._holds > 0:
                return
            recording._values.update(state="done", stage="", ended_at=self._clock(), progress_done=0)
            self.running_count -= 1
            record = recording._record()
            self._tally(recording)
            if record.error in REFUSALS:
                self._refused.append(recording)
            self.version += 1
        if self._file is not None:  # written behind, as it is then (a late count included)
            self._file.put(lambda: recording.record.to_json())

    def flush(self) -> None:
        """Wait until every finished record is in the file."""
        if self._file is not None:
            self._file.flush()

    def close(self) -> None:
        """Write what is pending and stop the writer (the daemon stops)."""
        if self._file is not None:
            self._file.close()

    # --- reading ------------------------------------------------------------------------------

    def get(self, rid: str) -> RequestRecord | None:
        """A record by id: from the ring, else from the file."""
        with self._lock:
            found = self._records.get(rid)
            if found is not None:
                return found._record()
        for record in self._from_file():
            if record.id == rid:
                return record
        return None

    def recent(self) -> list[RequestRecord]:
        """Every record in the ring, oldest first."""
        with self._lock:
            return [r._record() for r in self._records.values()]

    def query(self, q: RecordQuery) -> list[RequestRecord]:
        """The newest ``q.limit`` records that match, oldest first; the file is read when the ring
        may not hold them all."""
        limit = max(1, min(q.limit, MAX_QUERY_RECORDS))
        with self._lock:
            ring = [r._record() for r in self._records.values()]
            full = len(ring) >= self.ring
        found = [r for r in ring if q.matches(r)]
        if len(found) < limit and full and not q.running:
            oldest = ring[0].started_at if ring else float("inf")
            seen = {r.id for r in ring}
            older = [
                r for r in self._from_file() if r.id not in seen and r.started_at < oldest and q.matches(r)
            ]
            found = sorted(older, key=lambda r: r.started_at)[-(limit - len(found)) :] + found
        return found[-limit:]

    def _from_file(self) -> Iterator[RequestRecord]:
        """The file's records, newest first, within the age limit."""
        if self._file is None:
            return
        cutoff = self._clock() - self.max_age_seconds if self.max_age_seconds > 0 else 0.0
        for data in self._file.read():
            try:
                record = RequestRecord.from_json(data)
            except TypeError:
                continue
            if record.started_at >= cutoff:
                yield record

    def _load(self) -> None:
        """Fill the ring with the newest records of the file (a restart keeps them)."""
        loaded: list[RequestRecord] = []
        for record in self._from_file():
            loaded.append(record)
            if len(loaded) >= self.ring:
                break
        for record in reversed(loaded):
            recording = Recording(self, {n: getattr(record, n) for n in _FIELDS}, external=True)
            self._records[record.id] = recording
            self._tally(recording)

    # --- what the live page reads ------------------------------------------------------------

    def _tally(self, recording: Recording) -> None:  # with the lock held (or alone, at start)
        r = recording._record()
        key = conversation_of(r)
        tally = self._tallies.get(key)
        if tally is None:
            tally = self._tallies[key] = Tally(key)
        ahead = r.finish == AHEAD  # work a turn left (counted, but no turn, nor the last one)
        tally.turns += 0 if ahead else 1
        counts = {name: getattr(r, name) for name in COUNTED}
        for name, value in counts.items():
            tally.sums[name] += value
        if not ahead and (tally.last is None or r.started_at >= tally.last.started_at):
            tally.last = r
            self._tallies.move_to_end(key)
        if r.started_at >= self.started_at:
            model = self._models.setdefault(r.model, dict.fromkeys(COUNTED, 0))
            for name, value in counts.items():
                model[name] += value

    def _retally(self, recording: Recording, counts: dict[str, int]) -> None:  # with the lock held
        r = recording._record()
        tally = self._tallies.get(conversation_of(r))
        model = self._models.get(r.model) if r.started_at >= self.started_at else None
        for sums_ in (tally.sums if tally is not None else None, model):
            if sums_ is not None:
                for name, value in counts.items():
                    if name in sums_:
                        sums_[name] += value
        self.version += 1

    def _untally(self, recording: Recording) -> None:  # with the lock held
        r = recording._record()
        key = conversation_of(r)
        tally = self._tallies.get(key)
        if tally is None:
            return
        tally.turns -= 0 if r.finish == AHEAD else 1
        if tally.turns <= 0:
            del self._tallies[key]
            return
        for name in COUNTED:
            tally.sums[name] -= getattr(r, name)

    def tallies(self, limit: int | None = None) -> tuple[list[Tally], int]:
        """The conversations of the finished records in the ring, the most recently finished
        first (at most ``limit``), each with its turns, its counts' sums and its newest record
        (kept as records finish and leave the ring: no scan); and how many there are."""
        with self._lock:
            chosen = itertools.islice(reversed(self._tallies.values()), limit)
            return [replace(t, sums=dict(t.sums)) for t in chosen], len(self._tallies)

    def by_model(self) -> dict[str, dict[str, int]]:
        """The counts of the records finished since this store started (this daemon's run: what
        its metrics count), summed by model; kept as they finish, whatever the ring still holds."""
        with self._lock:
            return {model: dict(counts) for model, counts in self._models.items()}

    def running(self) -> list[RequestRecord]:
        with self._lock:
            return [r._record() for r in self._records.values() if r.state == "running"]

    def refused(self) -> list[RequestRecord]:
        """The newest refused turns (:data:`REFUSALS`)."""
        with self._lock:
            return [r._record() for r in self._refused]

    def newest_json(self, count: int) -> list[str]:
        """The newest ``count`` records as JSON text (a finished record's text is made once)."""
        with self._lock:
            chosen = list(itertools.islice(reversed(self._records.values()), count))
            return [r._json_text() for r in reversed(chosen)]

    def stats(self) -> dict[str, int]:
        """What the file holds now (``modeld status``, the page)."""
        files, total = self._file.stats() if self._file is not None else (0, 0)
        with self._lock:
            kept = len(self._records)
        return {"ring": kept, "ring_limit": self.ring, "files": files, "file_bytes": total}


def sums(records: list[RequestRecord], key: Callable[[RequestRecord], str]) -> dict[str, dict[str, int]]:
    """The counted fields (:data:`COUNTED`) of ``records`` summed by ``key``."""
    out: dict[str, dict[str, int]] = {}
    for r in records:
        group = out.setdefault(key(r), dict.fromkeys(COUNTED, 0))
        for name in COUNTED:
            group[name] += getattr(r, name)
    return out
