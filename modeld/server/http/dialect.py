"""An API dialect as a value: how it writes errors, a whole answer and a stream.

Every API (``openai/``, ``responses/``, ``anthropic/``, ``ollama/``) declares one
:class:`Dialect` in its ``answer.py``; its routes hand the turn runner
(:mod:`modeld.server.http.runner`) the dialect and the parsed request (:class:`Asked`, or the
API's own subclass carrying what its answers need: OpenAI's ``include_usage``, Anthropic's
thinking display, ...). The runner does the rest the same way for every API: a stream or one
JSON body, ``n`` choices where the dialect has an answer for them, errors in the dialect's
words, the turn counted for a drain. So a route is parse-then-answer, with no twin per endpoint,
and the error style of a path is the dialect's that owns it (:attr:`Dialect.paths`), not a
switch on the path.
"""

from __future__ import annotations

import json
from collections.abc import AsyncIterator, Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Generic, TypeVar

from modeld.contract import PrefillProgress
from modeld.server.http.answers import sse
from modeld.server.http.conversations import Collected, Event, Started
from modeld.server.http.errors import ErrorStyle, HttpError
from modeld.server.http.turn import Turn

__all__ = ["Asked", "Dialect", "comment"]


@dataclass(frozen=True)
class Asked:
    """A request as its API parsed it: the turn, and (Ollama's ``keep_alive``) how long its
    conversation's warm context may stay idle in the KV, or whether the model is unloaded once
    the answer is sent (``keep_alive: 0``: nothing is then computed ahead of a next turn). An
    API subclasses it with what its answers need."""

    turn: Turn
    keep_alive: float | None = None
    unload: bool = False


A = TypeVar("A", bound=Asked)


def _no_headers() -> Mapping[str, str]:
    return {}


def comment(_asked: Asked, progress: PrefillProgress | None) -> bytes:
    """An SSE comment (``: ...``): every SSE reader skips it, and it keeps the connection alive
    (llama-server's ``--sse-ping-interval`` sends ``:``); it says how far a prefill got."""
    if progress is None:
        return b": modeld is working\n\n"
    return f": modeld {progress.stage} prefill {progress.done}/{progress.total} tokens\n\n".encode()


@dataclass(frozen=True)
class Dialect(Generic[A]):
    """One API's words: its error body, a whole answer (``complete``), the stream of one
    (``stream``), and, where the API has them, ``n`` choices in one answer (``choices``)."""

    name: str
    error: ErrorStyle
    complete: Callable[[A, Collected], dict[str, Any]]
    stream: Callable[[A, Started, AsyncIterator[Event]], AsyncIterator[bytes]]
    choices: Callable[[A, Sequence[Collected]], dict[str, Any]] | None = None
    media_type: str = "text/event-stream"
    """A stream's content type (``application/x-ndjson``: a JSON object per line)."""
    headers: Callable[[], Mapping[str, str]] = field(default=_no_headers)
    """Headers of every answer (Anthropic's ``request-id``)."""
    paths: tuple[str, ...] = ()
    """Path prefixes whose failures (a route that does not exist, a method it does not take)
    this dialect words."""
    alive: Callable[[A, PrefillProgress | None], bytes] = field(default=comment)
    """What a silent stream sends to stay alive (a long prefill, hidden thinking), in the API's
    form; it never changes what the answer says (the prefill's progress where it has one)."""
    failed: Callable[[A, HttpError], bytes] | None = None
    """A failure inside a stream, as the API's error event (None: ``data: <the error body>``,
    what OpenAI's clients read)."""
    status: Callable[[HttpError], int] | None = None
    """The status the API answers an error with, where it is not modeld's (Anthropic's 529)."""
    overflow_in_stream: bool = False
    """A prompt beyond the window is answered inside the stream (``failed``), not with a 400:
    the Responses API's way, where Codex recognizes a full window."""

    @property
    def ndjson(self) -> bool:
        return self.media_type != "text/event-stream"

    def late_headers(self, asked: A, headers: Mapping[str, str]) -> bytes:
        """modeld's headers of a stream that began before its turn did (they were not known when
        the stream's headers were sent), once known: one SSE comment per header
        (``: X-Modeld-Prefix: reused=...``, skipped by every SSE reader); in NDJSON, an empty
        piece of the answer (the keep-alive's) carrying them in ``modeld.headers``."""
        if self.ndjson:
            line = json.loads(self.alive(asked, None))
            line["modeld"] = {"headers": dict(headers)}
            return json.dumps(line, ensure_ascii=False).encode() + b"\n"
        return "".join(f": {name}: {value}\n" for name, value in headers.items()).encode() + b"\n"

    def stream_error(self, asked: A, error: HttpError) -> bytes:
        """``error`` inside a stream, in this API's words."""
        if self.failed is not None:
            return self.failed(asked, error)
        body = self.error(error)
        return json.dumps(body, ensure_ascii=False).encode() + b"\n" if self.ndjson else sse(body)
