"""The request records' append-only file (``modeld/observe/records.py`` keeps the ring).

:class:`RecordFile` appends one JSON line per finished record to ``requests-<ns>.jsonl`` under
its directory, from a thread of its own (a turn never waits for the disk), and keeps it within
its retention: it is cut in segments of an eighth of the byte budget; a segment whose newest line
is older than the age limit goes, and the oldest go while the whole exceeds the bytes (a segment
at a time). It reads the lines back newest first (a restart, a query the ring cannot answer).

What not: what a record holds (its lines are JSON objects to it); no prompt text is ever given
to it (the records hold none unless ``--ui-show-prompts``).
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import queue
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

__all__ = ["MIN_SEGMENT_BYTES", "SEGMENTS", "RecordFile"]

log = logging.getLogger("modeld.records")

SEGMENTS = 8
"""The byte budget is kept in this many files at most (retention drops a whole file)."""
MIN_SEGMENT_BYTES = 64 << 10


class RecordFile:
    """The records' file under ``directory`` (created 0700, its segments 0600)."""

    def __init__(
        self, directory: Path, *, max_bytes: int, max_age_seconds: float, clock: Callable[[], float]
    ) -> None:
        self.directory = directory
        self.max_bytes = max_bytes
        self.max_age_seconds = max_age_seconds
        self._clock = clock
        self._segment: Path | None = None
        self.broken = False
        self._lock = threading.Lock()
        self._queue: queue.Queue[Callable[[], dict[str, Any]] | None] = queue.Queue()
        self._writer: threading.Thread | None = None
        directory.mkdir(parents=True, exist_ok=True, mode=0o700)
        self.prune()

    # --- writing ------------------------------------------------------------------------------

    def put(self, line: Callable[[], dict[str, Any]]) -> None:
        """Append ``line()`` (called on the writer's thread, so a late change is in it)."""
        if self.broken:
            return
        self._queue.put(line)
        if self._writer is None:
            with self._lock:
                if self._writer is None:
                    self._writer = threading.Thread(target=self._write_behind, name="records", daemon=True)
                    self._writer.start()

    def _write_behind(self) -> None:
        while True:
            line = self._queue.get()
            try:
                if line is None:
                    return
                self._append(line())
            finally:
                self._queue.task_done()

    def flush(self) -> None:
        """Wait until every line put is in the file."""
        if self._writer is not None:
            self._queue.join()

    def close(self) -> None:
        """Write what is pending and stop the writer."""
        if self._writer is not None:
            self._queue.put(None)
            self._writer.join(30)
            self._writer = None

    def _segment_bytes(self) -> int:
        return max(MIN_SEGMENT_BYTES, self.max_bytes // SEGMENTS)

    def _append(self, data: dict[str, Any]) -> None:
        if self.broken:
            return
        line = (json.dumps(data, separators=(",", ":")) + "\n").encode()
        try:
            segment = self._segment
            if segment is None or not segment.exists() or segment.stat().st_size >= self._segment_bytes():
                segment = self.directory / f"requests-{time.time_ns():020d}.jsonl"
                self._segment = segment
                self.prune()
            fd = os.open(segment, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o600)
            try:
                os.write(fd, line)
            finally:
                os.close(fd)
        except OSError as exc:
            log.warning("a request record could not be written (%s); records stay in memory", exc)
            self.broken = True

    # --- retention and reading ----------------------------------------------------------------

    def segments(self) -> list[Path]:
        if not self.directory.is_dir():
            return []
        return sorted(self.directory.glob("requests-*.jsonl"))

    def prune(self) -> None:
        """Retention: segments past the age, then the oldest while over the bytes."""
        now = self._clock()
        sizes: dict[Path, int] = {}
        for path in self.segments():
            try:
                st = path.stat()
            except OSError:
                continue
            old = self.max_age_seconds > 0 and st.st_mtime < now - self.max_age_seconds
            if old and path != self._segment:
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

    def read(self) -> Iterator[dict[str, Any]]:
        """Every line, newest first (a bad one is skipped)."""
        self.flush()
        for path in reversed(self.segments()):
            try:
                lines = path.read_bytes().splitlines()
            except OSError:
                continue
            for line in reversed(lines):
                try:
                    data = json.loads(line)
                except ValueError:
                    continue
                if isinstance(data, dict):
                    yield data

    def stats(self) -> tuple[int, int]:
        """Its segments and their bytes."""
        self.flush()
        segments = self.segments()
        total = 0
        for path in segments:
            with contextlib.suppress(OSError):
                total += path.stat().st_size
        return len(segments), total
