"""The Responses API's answers: a turn's events as a response object and as the documented
stream of events (``response.created`` ... ``response.completed``); the requests are parsed in
:mod:`modeld.server.http.responses.request` (``blueprints/0019-agent-apis.md``).
:data:`RESPONSES` is the dialect (OpenAI's error words); a request's :class:`ResponsesAsked`
carries the response's identity and what keeps it in the store."""

from __future__ import annotations

import time
import uuid
from collections.abc import AsyncIterator, Callable, Mapping
from dataclasses import dataclass
from typing import Any

from modeld.contract import PrefillProgress, ToolCall
from modeld.server.http.answers import chat_logprobs, extension, sse_event
from modeld.server.http.conversations import Collected, Delta, Event, Finished, Started, TurnUsage
from modeld.server.http.dialect import Asked, Dialect
from modeld.server.http.errors import HttpError, openai_error
from modeld.server.http.turn import Message, Turn

__all__ = [
    "RESPONSES",
    "ResponseShape",
    "ResponsesAsked",
    "complete_response",
    "history_message",
    "stream_response",
    "usage_dict",
]


def usage_dict(usage: TurnUsage) -> dict[str, Any]:
    return {
        "input_tokens": usage.prompt_tokens,
        "input_tokens_details": {
            "cached_tokens": usage.cached_tokens,
            "cache_write_tokens": usage.created_tokens,
        },
        "output_tokens": usage.completion_tokens,
        "output_tokens_details": {"reasoning_tokens": usage.reasoning_tokens},
        "total_tokens": usage.prompt_tokens + usage.completion_tokens,
    }


class ResponseShape:
    """One response's identity and the fields every snapshot of it repeats; its stream's event
    counter (``emit``: every event carries the next ``sequence_number``, keep-alives included)
    and whether ``response.created`` was sent (``announced``: a stream kept alive before its
    turn started sent it then). ``namespaces``: a namespaced tool's name as the model sees it
    (``NAMESPACE.NAME``) -> (namespace, name), so its calls come back with their namespace."""

    def __init__(self, turn: Turn, body: Mapping[str, Any], previous: str | None, store: bool) -> None:
        self.turn = turn
        self.id = f"resp_{turn.id}"
        self.created_at = int(time.time())  # seconds, an integer (the SDKs' type)
        self.previous = previous
        self.store = store
        self.body = body
        self.message_id = item_id("msg")
        self.reasoning_id = item_id("rs")
        self.namespaces = namespaced(body.get("tools"))
        self.sequence = 0
        self.announced = False

    def emit(self, kind: str, **fields: Any) -> bytes:
        """One event of this response's stream, with the next sequence number."""
        data = {"type": kind, "sequence_number": self.sequence, **fields}
        self.sequence += 1
        return sse_event(kind, data)

    def announce(self, started: Started | None) -> bytes:
        """``response.created`` and ``response.in_progress`` (once)."""
        if self.announced:
            return b""
        self.announced = True
        head = self.response("in_progress", [], None, started)
        return self.emit("response.created", response=head) + self.emit("response.in_progress", response=head)

    def alive(self, progress: PrefillProgress | None) -> bytes:
        """What keeps a silent stream alive: the announcement, then ``response.in_progress``."""
        if not self.announced:
            return self.announce(None)
        head = self.response("in_progress", [], None, None)
        if progress is not None:
            head["modeld"] = {
                "progress": {"stage": progress.stage, "done": progress.done, "total": progress.total}
            }
        return self.emit("response.in_progress", response=head)

    def failed(self, error: HttpError) -> bytes:
        """A failure inside the stream: ``response.failed`` carrying the error's code (where
        Codex reads ``context_length_exceeded``), after ``error`` (the SDKs' error event)."""
        out = self.announce(None)
        failed = self.response("failed", [], None, None, finish="error", error=error)
        return (
            out
            + self.emit("error", code=error.code, message=error.message, param=error.param)
            + self.emit("response.failed", response=failed)
        )

    def response(
        self,
        status: str,
        output: list[dict[str, Any]],
        usage: TurnUsage | None,
        started: Started | None,
        *,
        finish: str = "",
        error: HttpError | None = None,
    ) -> dict[str, Any]:
        body = self.body
        turn = self.turn
        out: dict[str, Any] = {
            "id": self.id,
            "object": "response",
            "created_at": self.created_at,
            "status": status,
            "model": turn.model,
            "output": output,
            "error": None if error is None else {"code": error.code, "message": error.message},
            "incomplete_details": {"reason": "max_output_tokens"} if status == "incomplete" else None,
            "instructions": body.get("instructions"),
            "max_output_tokens": body.get("max_output_tokens"),
            "parallel_tool_calls": turn.parallel_tool_calls,
            "previous_response_id": self.previous,
            "reasoning": body.get("reasoning"),
            "store": self.store,
            "temperature": turn.decode.temperature,
            "text": body.get("text") or {"format": {"type": "text"}},
            "tool_choice": body.get("tool_choice") or "auto",
            "tools": body.get("tools") or [],
            "top_p": turn.decode.top_p,
            "truncation": body.get("truncation") or "disabled",
            "usage": usage_dict(usage) if usage is not None else None,
            "metadata": body.get("metadata") or {},
        }
        if started is not None:
            out["modeld"] = {
                **extension(started),
                "finish_reason": finish or None,
                "omitted_tools": list(turn.omitted_tools),
            }
        return out

    def message_item(self, text: str, status: str, logprobs: Any = None) -> dict[str, Any]:
        part: dict[str, Any] = {"type": "output_text", "text": text, "annotations": []}
        if logprobs is not None:
            part["logprobs"] = logprobs
        return {
            "type": "message",
            "id": self.message_id,
            "status": status,
            "role": "assistant",
            "content": [part] if status != "in_progress" else [],
        }

    def reasoning_item(self, text: str) -> dict[str, Any]:
        return {
            "type": "reasoning",
            "id": self.reasoning_id,
            "summary": [],
            "content": [{"type": "reasoning_text", "text": text}],
        }

    def call_item(self, call: ToolCall, status: str = "completed") -> dict[str, Any]:
        item = {
            "type": "function_call",
            "id": f"fc_{call.id.removeprefix('call_')}",
            "call_id": call.id,
            "name": call.name,
            "arguments": call.arguments,
            "status": status,
        }
        if call.name in self.namespaces:  # a namespaced tool: its namespace and its own name
            item["namespace"], item["name"] = self.namespaces[call.name]
        return item

    def output(self, done: Collected) -> list[dict[str, Any]]:
        items: list[dict[str, Any]] = []
        if done.reasoning:
            items.append(self.reasoning_item(done.reasoning))
        status = "incomplete" if done.finished.finish == "length" else "completed"
        if done.text or not done.finished.calls:
            logprobs = (chat_logprobs(done.logprobs) or {}).get("content") if done.logprobs else None
            items.append(self.message_item(done.text, status, logprobs))
        items += [self.call_item(c) for c in done.finished.calls]
        return items


def item_id(kind: str) -> str:
    """A new output item's id (every item of a response has its own)."""
    return f"{kind}_{uuid.uuid4().hex[:24]}"


def namespaced(tools: Any) -> dict[str, tuple[str, str]]:
    """Namespaced tools' names as the model sees them (``NAMESPACE.NAME``) -> (namespace, name)."""
    out: dict[str, tuple[str, str]] = {}
    for tool in tools if isinstance(tools, list) else ():
        if isinstance(tool, dict) and tool.get("type") == "namespace" and isinstance(tool.get("name"), str):
            for inner in tool.get("tools") or ():
                if isinstance(inner, dict) and isinstance(inner.get("name"), str):
                    out[f"{tool['name']}.{inner['name']}"] = (tool["name"], inner["name"])
    return out


def _status(finish: str) -> str:
    return "incomplete" if finish == "length" else "completed"


def complete_response(shape: ResponseShape, done: Collected) -> dict[str, Any]:
    finished = done.finished
    return shape.response(
        _status(finished.finish), shape.output(done), finished.usage, done.started, finish=finished.finish
    )


def history_message(done: Collected) -> Message:
    """The response's output as the assistant turn the next request continues."""
    return Message("assistant", done.text, done.finished.calls, done.reasoning)


Keep = Callable[[Collected, dict[str, Any]], None]
"""What a finished response is handed to (the store keeps it, when the request said ``store``)."""


async def stream_response(
    shape: ResponseShape, started: Started, events: AsyncIterator[Event], keep: Keep
) -> AsyncIterator[bytes]:
    emit = shape.emit
    yield shape.announce(started)
    items: list[dict[str, Any]] = []
    text: list[str] = []
    reasoning: list[str] = []
    logprobs: list[Any] = []
    open_kind = ""  # "reasoning" | "message" | "call"
    begun = {"reasoning": 0, "message": 0}  # where the open item's text starts
    calls: dict[int, dict[str, Any]] = {}  # call index -> its item (as streamed)

    def close() -> bytes:
        nonlocal open_kind
        out = b""
        index = len(items) - 1
        if open_kind == "reasoning":
            whole = "".join(reasoning[begun["reasoning"] :])
            out += emit(
                "response.reasoning_text.done",
                item_id=shape.reasoning_id,
                output_index=index,
                content_index=0,
                text=whole,
            )
            items[index] = shape.reasoning_item(whole)
            out += emit("response.output_item.done", output_index=index, item=items[index])
        elif open_kind == "message":
            whole = "".join(text[begun["message"] :])
            part = {"type": "output_text", "text": whole, "annotations": []}
            out += emit(
                "response.output_text.done",
                item_id=shape.message_id,
                output_index=index,
                content_index=0,
                text=whole,
                logprobs=logprobs,
            )
            out += emit(
                "response.content_part.done",
                item_id=shape.message_id,
                output_index=index,
                content_index=0,
                part=part,
            )
            items[index] = {**shape.message_item(whole, "completed"), "content": [part]}
            out += emit("response.output_item.done", output_index=index, item=items[index])
        open_kind = ""
        return out

    async for event in events:
        if isinstance(event, Delta):
            out = b""
            if event.reasoning:
                if open_kind != "reasoning":
                    out += close()
                    shape.reasoning_id = item_id("rs")  # every item its own id
                    begun["reasoning"] = len(reasoning)
                    items.append({**shape.reasoning_item(""), "content": []})
                    out += emit("response.output_item.added", output_index=len(items) - 1, item=items[-1])
                    open_kind = "reasoning"
                reasoning.append(event.reasoning)
                out += emit(
                    "response.reasoning_text.delta",
                    item_id=shape.reasoning_id,
                    output_index=len(items) - 1,
                    content_index=0,
                    delta=event.reasoning,
                )
            if event.text:
                if open_kind != "message":
                    out += close()
                    shape.message_id = item_id("msg")
                    begun["message"] = len(text)
                    items.append(shape.message_item("", "in_progress"))
                    index = len(items) - 1
                    out += emit("response.output_item.added", output_index=index, item=items[-1])
                    part = {"type": "output_text", "text": "", "annotations": []}
                    out += emit(
                        "response.content_part.added",
                        item_id=shape.message_id,
                        output_index=index,
                        content_index=0,
                        part=part,
                    )
                    open_kind = "message"
                text.append(event.text)
                lp = (chat_logprobs(event.logprobs) or {}).get("content", []) if event.logprobs else []
                logprobs.extend(lp)
                out += emit(
                    "response.output_text.delta",
                    item_id=shape.message_id,
                    output_index=len(items) - 1,
                    content_index=0,
                    delta=event.text,
                    logprobs=lp,
                )
            for piece in event.calls:
                if not shape.turn.parallel_tool_calls and piece.index > 0:
                    continue
                if piece.id or piece.name:
                    out += close()
                    item = shape.call_item(ToolCall(piece.id, piece.name, ""), "in_progress")
                    items.append(item)
                    calls[piece.index] = item
                    out += emit("response.output_item.added", output_index=len(items) - 1, item=item)
                    open_kind = "call"
                if piece.arguments and piece.index in calls:
                    item = calls[piece.index]
                    item["arguments"] += piece.arguments
                    out += emit(
                        "response.function_call_arguments.delta",
                        item_id=item["id"],
                        output_index=items.index(item),
                        delta=piece.arguments,
                    )
            if out:
                yield out
        elif isinstance(event, Finished):
            out = close()
            if event.error is not None:
                failed = shape.response(
                    "failed", items, event.usage, started, finish="error", error=event.error
                )
                yield (
                    out
                    + emit(
                        "error", code=event.error.code, message=event.error.message, param=event.error.param
                    )
                    + emit("response.failed", response=failed)
                )
                return
            status = _status(event.finish)
            by_id = {c.id: c for c in event.calls}
            for index, item in enumerate(items):
                if item["type"] != "function_call":
                    continue
                call = by_id.get(item["call_id"])
                final = shape.call_item(call) if call is not None else {**item, "status": "incomplete"}
                items[index] = final
                out += emit(
                    "response.function_call_arguments.done",
                    item_id=final["id"],
                    output_index=index,
                    arguments=final["arguments"],
                    name=final["name"],
                )
                out += emit("response.output_item.done", output_index=index, item=final)
            if not items:  # an empty answer is still a message
                items.append(shape.message_item("", status))
                out += emit("response.output_item.added", output_index=0, item=items[0]) + emit(
                    "response.output_item.done", output_index=0, item=items[0]
                )
            whole = shape.response(status, items, event.usage, started, finish=event.finish)
            keep(Collected(started, "".join(text), "".join(reasoning), (), event), whole)
            yield out + emit(
                "response.incomplete" if status == "incomplete" else "response.completed", response=whole
            )
            return


@dataclass(frozen=True, kw_only=True)
class ResponsesAsked(Asked):
    """A Responses request: its turn, the response's identity, and what keeps it."""

    shape: ResponseShape
    keep: Keep


def _complete(asked: ResponsesAsked, done: Collected) -> dict[str, Any]:
    response = complete_response(asked.shape, done)
    asked.keep(done, response)
    return response


def _stream(asked: ResponsesAsked, started: Started, events: AsyncIterator[Event]) -> AsyncIterator[bytes]:
    return stream_response(asked.shape, started, events, asked.keep)


RESPONSES: Dialect[ResponsesAsked] = Dialect(
    "responses",
    openai_error,
    _complete,
    _stream,
    alive=lambda asked, progress: asked.shape.alive(progress),
    failed=lambda asked, error: asked.shape.failed(error),
    overflow_in_stream=True,
)
"""OpenAI's Responses API (OpenAI's error words; a full window inside the stream, where Codex
looks for it)."""
