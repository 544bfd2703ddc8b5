"""Anthropic's Messages API, the answer: a ``message``, its SSE stream, the error envelope.

The turn's events become a ``message`` (:func:`message_complete`) or its stream
(:func:`message_stream`: ``message_start``, ``content_block_start``, ``content_block_delta``
with ``text_delta`` / ``input_json_delta`` / ``thinking_delta``, ``content_block_stop``,
``message_delta`` with the stop reason and usage, ``message_stop``; ``ping`` after the start and
whenever the stream is silent, ``error`` on a failure).
The request side is :mod:`modeld.server.http.anthropic.request`'s; the fields and the usage's
cache accounting are described there and in ``blueprints/0019-agent-apis.md``. :data:`ANTHROPIC`
is the dialect: Anthropic's error envelope (also for any path under ``/v1/messages``) with its
``request_id`` and 529 for an overloaded daemon, a ``request-id`` header on every answer.
"""

from __future__ import annotations

import uuid
from collections.abc import AsyncIterator, Mapping
from typing import Any

from modeld.contract import PrefillProgress, ToolCall
from modeld.server.http.answers import call_arguments, extension, sse_event
from modeld.server.http.anthropic.diagnosis import diagnostics_field
from modeld.server.http.anthropic.request import MessagesAsked
from modeld.server.http.conversations import Collected, Delta, Event, Finished, Started, TurnUsage
from modeld.server.http.dialect import Dialect
from modeld.server.http.errors import HttpError, WindowExceededError
from modeld.server.http.turn import Turn

__all__ = [
    "ANTHROPIC",
    "anthropic_error",
    "anthropic_status",
    "message_complete",
    "message_stream",
    "request_id",
    "usage_dict",
]

_STATUS_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    403: "permission_error",
    404: "not_found_error",
    413: "request_too_large",
    415: "invalid_request_error",
    429: "rate_limit_error",
    503: "overloaded_error",
    504: "timeout_error",
    529: "overloaded_error",
}
OVERLOADED = 529
"""Anthropic's status for "overloaded, retry" (modeld's 503s: a worker restarting, a drain)."""


def request_id() -> str:
    return f"req_{uuid.uuid4().hex[:24]}"


def anthropic_error(error: HttpError) -> dict[str, Any]:
    """Anthropic's error envelope: ``{"type": "error", "error": {"type", "message"},
    "request_id"}``. A prompt beyond the window says ``prompt is too long: N tokens > M
    maximum``, the words Claude Code reads both numbers from to compact the conversation."""
    kind = _STATUS_TYPES.get(error.status, "invalid_request_error" if error.status < 500 else "api_error")
    message = error.message
    if isinstance(error, WindowExceededError):
        message = f"prompt is too long: {error.prompt_tokens} tokens > {error.window - 1} maximum"
    return {"type": "error", "error": {"type": kind, "message": message}, "request_id": request_id()}


def anthropic_status(error: HttpError) -> int:
    """The status Anthropic answers ``error`` with: 529 where modeld says 503."""
    return OVERLOADED if error.status == 503 else error.status


def _stop_reason(finish: str) -> str:
    if finish == "length":
        return "max_tokens"
    if finish == "stop_sequence":
        return "stop_sequence"
    if finish in ("tool_calls", "signal"):
        return "tool_use"
    return "end_turn"


def _stop_sequence(finished: Finished) -> str | None:
    """Which stop sequence ended the answer (the engine names the one that matched)."""
    if finished.finish == "stop_sequence":
        return finished.stop_sequence or None
    return None


def usage_dict(usage: TurnUsage, *, output: int | None = None) -> dict[str, Any]:
    return {
        "input_tokens": usage.uncached_tokens,
        "cache_creation_input_tokens": usage.created_tokens,
        "cache_read_input_tokens": usage.cached_tokens,
        "output_tokens": usage.completion_tokens if output is None else output,
    }


def _message_id(turn: Turn) -> str:
    return f"msg_{turn.id}"


def _tool_use(call: ToolCall) -> dict[str, Any]:
    return {"type": "tool_use", "id": call.id, "name": call.name, "input": call_arguments(call)}


def message_complete(turn: Turn, done: Collected, thinking: str) -> dict[str, Any]:
    content: list[dict[str, Any]] = []
    if done.reasoning and thinking != "drop":
        content.append(
            {"type": "thinking", "thinking": done.reasoning if thinking == "show" else "", "signature": ""}
        )
    if done.text:
        content.append({"type": "text", "text": done.text})
    content += [_tool_use(c) for c in done.finished.calls]
    finish = done.finished.finish
    return {
        "id": _message_id(turn),
        "type": "message",
        "role": "assistant",
        "model": turn.model,
        "content": content,
        "stop_reason": _stop_reason(finish),
        "stop_sequence": _stop_sequence(done.finished),
        "usage": usage_dict(done.finished.usage),
        **diagnostics_field(turn, done.started),
        "modeld": {
            **extension(done.started),
            "finish_reason": finish,
            "omitted_tools": list(turn.omitted_tools),
        },
    }


class _Blocks:
    """The content blocks of a streamed message, opened and closed in order."""

    def __init__(self) -> None:
        self.index = -1
        self.kind = ""
        self.calls: dict[int, int] = {}  # tool-call index -> block index

    def open(self, kind: str, block: Mapping[str, Any]) -> bytes:
        out = self.close()
        self.index += 1
        self.kind = kind
        return out + sse_event(
            "content_block_start",
            {"type": "content_block_start", "index": self.index, "content_block": block},
        )

    def close(self) -> bytes:
        if self.kind == "":
            return b""
        self.kind = ""
        return sse_event("content_block_stop", {"type": "content_block_stop", "index": self.index})

    def delta(self, delta: Mapping[str, Any]) -> bytes:
        return sse_event(
            "content_block_delta", {"type": "content_block_delta", "index": self.index, "delta": delta}
        )


async def message_stream(
    turn: Turn, started: Started, events: AsyncIterator[Event], thinking: str
) -> AsyncIterator[bytes]:
    start_usage = usage_dict(started.usage, output=0)
    yield sse_event(
        "message_start",
        {
            "type": "message_start",
            "message": {
                "id": _message_id(turn),
                "type": "message",
                "role": "assistant",
                "model": turn.model,
                "content": [],
                "stop_reason": None,
                "stop_sequence": None,
                "usage": start_usage,
                **diagnostics_field(turn, started),
                # what the message's own ``modeld`` object says before the answer: the reuse,
                # what was left out of the prompt (the finish reason is message_delta's)
                "modeld": {**extension(started), "omitted_tools": list(turn.omitted_tools)},
            },
        },
    ) + sse_event("ping", {"type": "ping"})
    blocks = _Blocks()
    async for event in events:
        if isinstance(event, Delta):
            out = b""
            if event.reasoning and thinking != "drop":
                if blocks.kind != "thinking":
                    out += blocks.open("thinking", {"type": "thinking", "thinking": "", "signature": ""})
                if thinking == "show":
                    out += blocks.delta({"type": "thinking_delta", "thinking": event.reasoning})
            if event.text:
                if blocks.kind != "text":
                    out += blocks.open("text", {"type": "text", "text": ""})
                out += blocks.delta({"type": "text_delta", "text": event.text})
            for piece in event.calls:
                if not turn.parallel_tool_calls and piece.index > 0:
                    continue
                if piece.id or piece.name:
                    out += blocks.open(
                        "tool_use", {"type": "tool_use", "id": piece.id, "name": piece.name, "input": {}}
                    )
                    blocks.calls[piece.index] = blocks.index
                if piece.arguments and blocks.calls.get(piece.index) == blocks.index:
                    out += blocks.delta({"type": "input_json_delta", "partial_json": piece.arguments})
            if out:
                yield out
        elif isinstance(event, Finished):
            if event.error is not None:
                yield blocks.close() + stream_error(event.error)
                return
            out = blocks.close()
            out += sse_event(
                "message_delta",
                {
                    "type": "message_delta",
                    "delta": {
                        "stop_reason": _stop_reason(event.finish),
                        "stop_sequence": _stop_sequence(event),
                    },
                    "usage": usage_dict(event.usage),
                },
            )
            yield out + sse_event("message_stop", {"type": "message_stop"})
            return


def stream_error(error: HttpError) -> bytes:
    """A failure inside a stream: an ``error`` event (with its ``event:`` line, which the SDKs
    read it by)."""
    return sse_event("error", anthropic_error(error))


def _request_id() -> Mapping[str, str]:
    return {"request-id": request_id()}


def _ping(_asked: MessagesAsked, _progress: PrefillProgress | None) -> bytes:
    return sse_event("ping", {"type": "ping"})


ANTHROPIC: Dialect[MessagesAsked] = Dialect(
    "anthropic",
    anthropic_error,
    lambda asked, done: message_complete(asked.turn, done, asked.thinking),
    lambda asked, started, events: message_stream(asked.turn, started, events, asked.thinking),
    headers=_request_id,
    paths=("/v1/messages",),
    alive=_ping,
    failed=lambda _asked, error: stream_error(error),
    status=anthropic_status,
)
"""Anthropic's Messages API."""
