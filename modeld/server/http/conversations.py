"""Conversation affinity: the same warm session for the same conversation, bounded.

A tool resends its whole conversation every turn. Reuse does not depend on the session (the
engine reuses the longest common token prefix of whatever is resident), but keeping one
session per conversation makes a conversation one line in ``modeld explain-context``, with
the last turn's reuse and its miss explanation, and it will let the warm-state cache keep a
context per conversation.

The key is the client's (``X-Modeld-Conversation`` header, ``prompt_cache_key`` or ``user``)
or, without one, a digest of the conversation's first system and user messages. At most
``max_conversations`` sessions are kept; the least recently used idle one is closed to make
room, and one idle for ``idle_seconds`` is closed by :meth:`Conversations.sweep`. A request for
a conversation whose session is busy with another request runs on a session of its own,
closed when it finishes (sessions are not for concurrent use).

It also remembers the exact text of the tool calls it returned (the last
:data:`REMEMBERED_CALLS` replies, by their call ids), so when a tool sends those calls back in
the history they are written as the model generated them and the next turn reuses every
generated token (``blueprints/0018``).
"""

from __future__ import annotations

import contextlib
import logging
import threading
import time
from collections import OrderedDict
from collections.abc import Iterator
from dataclasses import dataclass

from modeld.contract import OpenSessionRequest
from modeld.errors import LimitExceededError, ModeldError
from modeld.server.gateway import Gateway, Hosted

__all__ = ["REMEMBERED_CALLS", "Conversations"]

REMEMBERED_CALLS = 256
"""Replies with tool calls whose exact text is kept (a few KiB each at most)."""

log = logging.getLogger("modeld.http")


@dataclass
class _Entry:
    hosted: Hosted
    busy: bool
    last_used: float


class Conversations:
    """The table of conversation sessions (thread-safe)."""

    def __init__(self, gateway: Gateway, *, max_conversations: int = 16, idle_seconds: float = 600.0) -> None:
        self._gateway = gateway
        self.max_conversations = max_conversations
        self.idle_seconds = idle_seconds
        self._table: OrderedDict[tuple[str, str, str], _Entry] = OrderedDict()
        self._lock = threading.Lock()
        self._calls: OrderedDict[tuple[str, ...], str] = OrderedDict()

    def __len__(self) -> int:
        with self._lock:
            return len(self._table)

    def _open(self, request: OpenSessionRequest) -> Hosted:
        try:
            return self._gateway.open(request, "http", attached=True)
        except LimitExceededError as exc:
            if exc.limit not in ("max_loaded_models", "max_sessions"):
                raise
        # Idle conversations pin their models and sessions: let them go and try once more.
        self.close_idle()
        return self._gateway.open(request, "http", attached=True)

    @contextlib.contextmanager
    def session(self, key: str, request: OpenSessionRequest) -> Iterator[Hosted]:
        """The conversation's session for one request (its own if the conversation is busy)."""
        k = (key, request.model_name, request.config.prompt_format)
        entry: _Entry | None = None
        evicted: list[Hosted] = []
        with self._lock:
            found = self._table.get(k)
            if found is not None and found.hosted.ended is not None:
                del self._table[k]
                found = None
            if found is not None and not found.busy:
                found.busy = True
                self._table.move_to_end(k)
                entry = found
            shared = found is None
        if entry is None:
            hosted = self._open(request)
            if shared:
                with self._lock:
                    if k not in self._table:
                        while len(self._table) >= self.max_conversations:
                            idle = next((key_ for key_, e in self._table.items() if not e.busy), None)
                            if idle is None:
                                break
                            evicted.append(self._table.pop(idle).hosted)
                        if len(self._table) < self.max_conversations:
                            entry = _Entry(hosted, True, time.monotonic())
                            self._table[k] = entry
            for old in evicted:
                _close(old)
        else:
            hosted = entry.hosted
        try:
            yield hosted
        finally:
            if entry is None:
                _close(hosted)
            else:
                with self._lock:
                    entry.busy = False
                    entry.last_used = time.monotonic()

    def remember_calls(self, ids: tuple[str, ...], text: str) -> None:
        """The calls ``ids`` of a reply were generated as ``text`` (``StreamChunk.tool_text``)."""
        if not ids or not text:
            return
        with self._lock:
            self._calls[ids] = text
            self._calls.move_to_end(ids)
            while len(self._calls) > REMEMBERED_CALLS:
                self._calls.popitem(last=False)

    def recall_calls(self, ids: tuple[str, ...]) -> str | None:
        """The generated text of the calls ``ids`` (in order, as returned), if remembered."""
        with self._lock:
            return self._calls.get(ids)

    def sweep(self) -> int:
        """Close conversations idle for longer than ``idle_seconds``; returns how many."""
        cutoff = time.monotonic() - self.idle_seconds
        with self._lock:
            stale = [k for k, e in self._table.items() if not e.busy and e.last_used < cutoff]
            closing = [self._table.pop(k).hosted for k in stale]
        for hosted in closing:
            _close(hosted)
        return len(closing)

    def close_idle(self) -> None:
        with self._lock:
            stale = [k for k, e in self._table.items() if not e.busy]
            closing = [self._table.pop(k).hosted for k in stale]
        for hosted in closing:
            _close(hosted)

    def close_all(self) -> None:
        with self._lock:
            closing = [e.hosted for e in self._table.values()]
            self._table.clear()
        for hosted in closing:
            _close(hosted)


def _close(hosted: Hosted) -> None:
    try:
        hosted.close()
    except ModeldError as exc:
        log.debug("closing session %s: %s", hosted.session_id, exc)
