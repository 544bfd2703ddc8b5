"""One OpenAI request run on a session: ensure_prefix, prefill_suffix, decode.

A :class:`Job` runs on a worker thread (the contract is synchronous) and reports
:class:`Started`, then each ``StreamChunk``, or :class:`Failed`, through a callback the event
loop drains; it always ends with a final chunk or a Failed. :meth:`Job.cancel` (the client
went away) cancels the decode within one token step, or interrupts a prefill in progress.
"""

from __future__ import annotations

import logging
import threading
import uuid
from collections.abc import Callable
from dataclasses import dataclass, replace

from modeld.contract import DecodeStream, OpenSessionRequest, PrefixStatus, Session, StreamChunk
from modeld.errors import InternalError, ModeldError, SessionClosedError
from modeld.server.gateway import Hosted
from modeld.server.http.conversations import Conversations
from modeld.server.http.openai import Turn, with_tool_format

__all__ = ["Failed", "Job", "Started"]

log = logging.getLogger("modeld.http")


@dataclass(frozen=True, slots=True)
class Started:
    """The decode started: which session serves the turn, and its prefix's reuse."""

    session_id: str
    status: PrefixStatus
    diverged_message: int | None  # the message (index) where the prefix diverged, when known


@dataclass(frozen=True, slots=True)
class Failed:
    error: ModeldError
    incident: str


Event = Started | StreamChunk | Failed


def _diverged_message(session: Session, status: PrefixStatus) -> int | None:
    """The index of the message holding the first token that differed from what was resident."""
    token = status.reuse.diverged_at_token
    if token is None:
        return None
    manifest = session.explain_context().manifest
    if manifest is None:
        return None
    for index, seg in enumerate(manifest.segments):
        if seg.token_end is not None and seg.token_end > token:
            return index
    return None


class Job:
    """One request's turn on its conversation's session."""

    def __init__(
        self,
        turn: Turn,
        request: OpenSessionRequest,
        conversations: Conversations,
        emit: Callable[[Event], None],
    ) -> None:
        self.turn = turn
        self._request = request
        self._conversations = conversations
        self._emit = emit
        self._lock = threading.Lock()
        self._cancelled = False
        self._hosted: Hosted | None = None
        self._stream: DecodeStream | None = None

    def cancel(self) -> None:
        """The client went away: stop the decode, or the prefill it is waiting for."""
        with self._lock:
            self._cancelled = True
            stream, hosted = self._stream, self._hosted
        if stream is not None:
            stream.cancel()
        elif hosted is not None:
            hosted.interrupt()  # a prefill in progress; the conversation reopens next time

    def run(self) -> None:
        try:
            self._run()
        except ModeldError as exc:
            self._emit(Failed(exc, uuid.uuid4().hex[:12]))
        except Exception as exc:
            incident = uuid.uuid4().hex[:12]
            log.error("internal error serving %s (incident %s)", self.turn.kind, incident, exc_info=exc)
            self._emit(Failed(InternalError(f"internal error (incident {incident})"), incident))

    def _run(self) -> None:
        turn = self.turn
        with self._conversations.session(turn.conversation, self._request) as hosted:
            with self._lock:
                if self._cancelled:
                    raise SessionClosedError("the client went away")
                self._hosted = hosted
            try:
                session = hosted.session
                if turn.kind == "chat":  # calls in the history, in the model's format
                    turn = with_tool_format(turn, session.info.tool_format, self._conversations.recall_calls)
                status = session.ensure_prefix(turn.prefix)
                if turn.suffix is not None:
                    session.prefill_suffix(turn.suffix)
                config = turn.decode
                if not turn.max_tokens_given:
                    config = replace(config, max_tokens=session.info.effective_context)
                message = _diverged_message(session, status) if turn.kind == "chat" else None
                if status.reuse.diverged_at_token is not None:
                    role = turn.roles[message] if message is not None and message < len(turn.roles) else "?"
                    log.info(
                        "%s: %s prefix (%s), reused %d of %d tokens; diverged at token %d, message %s (%s)",
                        turn.conversation,
                        status.reuse.outcome,
                        status.reuse.reason,
                        status.reused_tokens,
                        status.prefix_tokens,
                        status.reuse.diverged_at_token,
                        "?" if message is None else message,
                        role,
                    )
                stream = session.decode(config)
                with self._lock:
                    self._stream = stream
                    cancelled = self._cancelled
                if cancelled:
                    stream.cancel()
                self._emit(Started(hosted.session_id, status, message))
                with stream:
                    for chunk in stream:
                        if chunk.tool_calls:
                            ids = tuple(c.id for c in chunk.tool_calls)
                            self._conversations.remember_calls(ids, chunk.tool_text)
                        self._emit(chunk)
            finally:
                with self._lock:
                    self._hosted = None
                    self._stream = None
