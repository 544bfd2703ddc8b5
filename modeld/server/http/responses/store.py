"""Stored responses of the OpenAI Responses API: what ``previous_response_id`` continues.

A response created with ``store`` (the API's default) is kept as one JSON file in
``<data dir>/responses/``: the response object as it was returned, and the conversation it
ended (every message through the response's own output, in the conversation layer's form), so
a later request may send only its new input with ``previous_response_id`` and continue on the
same warm session. Files are written atomically (a temporary file, then a rename) and read
back checked (its id, its shape); one that does not read is removed with a logged reason.

Bounds (:class:`StoreSettings`, fixed: blueprint 0019): responses older than ``max_age_seconds``
are removed; beyond
``max_bytes`` in all, the oldest go first; one response is at most ``max_record_bytes``
(larger ones are not stored, and the answer says so in its ``modeld`` object). ``GET`` and
``DELETE /v1/responses/{id}`` read and remove one. The store belongs to the daemon that owns
the data directory (one owner at a time: the lease).
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import re
import tempfile
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from modeld.contract import ToolCall
from modeld.server.http.turn import Message

__all__ = ["ResponseStore", "StoreSettings", "Stored"]

log = logging.getLogger("modeld.http")

_ID = re.compile(r"^resp_[0-9a-f]{24}$")


@dataclass(frozen=True, slots=True)
class StoreSettings:
    max_age_seconds: float = 30 * 24 * 3600.0
    max_bytes: int = 256 << 20
    max_record_bytes: int = 16 << 20


@dataclass(frozen=True, slots=True)
class Stored:
    """A stored response: the object returned, the conversation through it, its key."""

    id: str
    response: dict[str, Any]
    history: tuple[Message, ...]
    conversation: str
    created_at: float


def _message_json(m: Message) -> dict[str, Any]:
    """A message as stored: every field the template is given (0010), so a conversation that
    continues from a stored response renders its history as it rendered it then."""
    out: dict[str, Any] = {"role": m.role, "content": m.content}
    if m.calls:
        out["calls"] = [[c.id, c.name, c.arguments] for c in m.calls]
    if m.reasoning:
        out["reasoning"] = m.reasoning
    if m.tool_call_id:
        out["tool_call_id"] = m.tool_call_id
    if m.name:
        out["name"] = m.name
    if m.parts:
        out["parts"] = list(m.parts)
    return out


def _message(obj: Any) -> Message:
    if (
        not isinstance(obj, dict)
        or not isinstance(obj.get("role"), str)
        or not isinstance(obj.get("content"), str)
    ):
        raise ValueError("a stored message is malformed")
    calls = tuple(ToolCall(str(c[0]), str(c[1]), str(c[2])) for c in obj.get("calls", []))
    parts = obj.get("parts", [])
    if not isinstance(parts, list) or not all(isinstance(p, str) for p in parts):
        raise ValueError("a stored message's parts are malformed")
    return Message(
        obj["role"],
        obj["content"],
        calls,
        str(obj.get("reasoning", "")),
        tool_call_id=str(obj.get("tool_call_id", "")),
        name=str(obj.get("name", "")),
        parts=tuple(parts),
    )


class ResponseStore:
    """Stored responses under one directory (thread-safe)."""

    def __init__(self, directory: Path, settings: StoreSettings | None = None) -> None:
        self.directory = directory
        self.settings = settings or StoreSettings()
        self._lock = threading.Lock()
        self._last_sweep = 0.0

    @staticmethod
    def valid_id(response_id: str) -> bool:
        return bool(_ID.match(response_id))

    def _path(self, response_id: str) -> Path:
        return self.directory / f"{response_id}.json"

    def put(self, stored: Stored) -> bool:
        """Keep a response (False: it is larger than ``max_record_bytes``, or writing failed)."""
        record = {
            "id": stored.id,
            "response": stored.response,
            "history": [_message_json(m) for m in stored.history],
            "conversation": stored.conversation,
            "created_at": stored.created_at,
        }
        data = json.dumps(record, ensure_ascii=False, separators=(",", ":")).encode()
        if len(data) > self.settings.max_record_bytes:
            log.info(
                "response %s is %d bytes: not stored (limit %d)",
                stored.id,
                len(data),
                self.settings.max_record_bytes,
            )
            return False
        try:
            self.directory.mkdir(parents=True, exist_ok=True, mode=0o700)
            fd, tmp = tempfile.mkstemp(dir=self.directory, prefix=".tmp-", suffix=".json")
            try:
                with os.fdopen(fd, "wb") as f:
                    f.write(data)
                os.replace(tmp, self._path(stored.id))
            except BaseException:
                with contextlib.suppress(OSError):
                    os.unlink(tmp)
                raise
        except OSError as exc:
            log.warning("could not store response %s: %s", stored.id, exc)
            return False
        self.sweep()
        return True

    def get(self, response_id: str) -> Stored | None:
        if not self.valid_id(response_id):
            return None
        path = self._path(response_id)
        try:
            data = path.read_bytes()
        except FileNotFoundError:
            return None
        except OSError as exc:
            log.warning("could not read stored response %s: %s", response_id, exc)
            return None
        try:
            record = json.loads(data)
            if not isinstance(record, dict) or record.get("id") != response_id:
                raise ValueError("the file names another response")
            response = record["response"]
            if not isinstance(response, dict):
                raise ValueError("the response is not an object")
            stored = Stored(
                id=response_id,
                response=response,
                history=tuple(_message(m) for m in record["history"]),
                conversation=str(record.get("conversation", "")),
                created_at=float(record["created_at"]),
            )
        except (ValueError, KeyError, TypeError, IndexError) as exc:
            log.warning("stored response %s is unreadable (%s): removed", response_id, exc)
            with contextlib.suppress(OSError):
                path.unlink()
            return None
        if time.time() - stored.created_at > self.settings.max_age_seconds:
            self.delete(response_id)
            return None
        return stored

    def delete(self, response_id: str) -> bool:
        if not self.valid_id(response_id):
            return False
        try:
            self._path(response_id).unlink()
        except FileNotFoundError:
            return False
        return True

    def sweep(self, *, force: bool = False) -> int:
        """Remove expired responses, then the oldest beyond the byte budget; returns how many."""
        now = time.time()
        with self._lock:
            if not force and now - self._last_sweep < 5.0:
                return 0
            self._last_sweep = now
        try:
            entries = []
            for path in self.directory.glob("resp_*.json"):
                with contextlib.suppress(OSError):
                    st = path.stat()
                    entries.append((st.st_mtime, st.st_size, path))
        except OSError:
            return 0
        entries.sort()
        total = sum(size for _, size, _ in entries)
        removed = 0
        for mtime, size, path in entries:
            if now - mtime <= self.settings.max_age_seconds and total <= self.settings.max_bytes:
                break
            with contextlib.suppress(OSError):
                path.unlink()
                removed += 1
            total -= size
        for tmp in self.directory.glob(".tmp-*.json"):  # a write that died half-way
            with contextlib.suppress(OSError):
                if now - tmp.stat().st_mtime > 60:
                    tmp.unlink()
        return removed
