"""A logging stand-in for the model APIs the coding agents call, for tests and fixture capture.

``CaptureServer`` records every request (method, path, query, headers, body) and answers with
minimal, spec-shaped responses so that Claude Code (the Anthropic Messages API) and Codex CLI (the
OpenAI Responses API) finish a headless run: what each reply is (text, a tool call, an HTTP error)
is decided per request by ``CaptureServer.reply``, a callable the test sets. It knows nothing of
models: it is how the fixtures in tests/fixtures/agents/ were made and how a test can see what
an agent sends, never a replacement for modeld's own endpoints.

It also runs an egress sentinel: a forward proxy that refuses everything and records what was
asked of it. An agent started with HTTP(S)_PROXY pointing there shows every attempt to reach the
internet (telemetry, update checks) as a ``CONNECT host:port`` record instead of a silent DNS
failure.

Wire shapes follow the providers' API references (Anthropic: Messages streaming; OpenAI:
Responses streaming events). ``Shape`` switches parts of them off, to find what a client reads.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import json
import socket
import threading
import time
import uuid
from collections.abc import AsyncIterator, Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

import uvicorn
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.routing import Route

# --- what to answer -------------------------------------------------------------------------


@dataclass(frozen=True)
class Text:
    """An assistant message holding ``text`` (streamed in ``chunks`` pieces)."""

    text: str
    chunks: int = 3


@dataclass(frozen=True)
class ToolCall:
    """One tool call: Anthropic ``tool_use`` / Responses ``function_call`` (``text`` before it)."""

    name: str
    arguments: dict[str, Any]
    text: str = ""


@dataclass(frozen=True)
class HttpError:
    """An HTTP error answer: ``body`` as JSON, extra ``headers`` (e.g. Retry-After)."""

    status: int
    body: dict[str, Any]
    headers: dict[str, str] = field(default_factory=dict)


Reply = Text | ToolCall | HttpError


@dataclass(frozen=True)
class Shape:
    """Which optional parts of the streamed answers to send (all on = the documented shape).

    ``drop_events`` names SSE event types never sent (e.g. "ping", "response.in_progress");
    ``drop_fields`` names fields removed from every event payload at any depth (e.g.
    "sequence_number", "usage"); ``sse_event_lines`` False leaves out the ``event:`` lines;
    ``tool_input_in_start`` puts a ``tool_use`` block's whole input in its
    ``content_block_start`` and sends no ``input_json_delta``.
    """

    drop_events: frozenset[str] = frozenset()
    drop_fields: frozenset[str] = frozenset()
    sse_event_lines: bool = True
    tool_input_in_start: bool = False


@dataclass
class Record:
    """One request as it arrived."""

    seq: int
    time: float
    method: str
    path: str
    query: str
    headers: list[tuple[str, str]]
    body: Any  # parsed JSON when the body is JSON, else the text ("" when empty)
    body_bytes: int
    answer: str = ""  # what the server answered: "text", "tool_call", "http 429", "models", ...

    def header(self, name: str) -> str | None:
        name = name.lower()
        return next((v for k, v in self.headers if k.lower() == name), None)

    def as_json(self) -> dict[str, Any]:
        return {
            "method": self.method,
            "path": self.path,
            "query": self.query,
            "headers": [list(h) for h in self.headers],
            "body": self.body,
            "body_bytes": self.body_bytes,
            "answer": self.answer,
        }


def default_reply(api: str, record: Record) -> Reply:
    return Text(f"Hello from the capture server ({api}).")


# --- wire shapes ----------------------------------------------------------------------------


def _strip(value: Any, fields: frozenset[str]) -> Any:
    if not fields:
        return value
    if isinstance(value, dict):
        return {k: _strip(v, fields) for k, v in value.items() if k not in fields}
    if isinstance(value, list):
        return [_strip(v, fields) for v in value]
    return value


def _pieces(text: str, n: int) -> list[str]:
    if not text:
        return []
    step = max(1, -(-len(text) // max(1, n)))
    return [text[i : i + step] for i in range(0, len(text), step)]


def _rough_tokens(body: Any) -> int:
    """A stand-in token count (4 bytes a token): the capture server has no tokenizer."""
    return max(1, len(json.dumps(body, ensure_ascii=False)) // 4)


def anthropic_events(
    reply: Text | ToolCall, model: str, input_tokens: int, tool_input_in_start: bool = False
) -> list[dict[str, Any]]:
    """The Messages API stream for one reply, as event payloads (each has its ``type``)."""
    usage = {
        "input_tokens": input_tokens,
        "cache_creation_input_tokens": 0,
        "cache_read_input_tokens": 0,
        "output_tokens": 1,
    }
    events: list[dict[str, Any]] = [
        {
            "type": "message_start",
            "message": {
                "id": f"msg_{uuid.uuid4().hex[:24]}",
                "type": "message",
                "role": "assistant",
                "model": model,
                "content": [],
                "stop_reason": None,
                "stop_sequence": None,
                "usage": usage,
            },
        },
        {"type": "ping"},
    ]
    text = reply.text
    output_tokens = 0
    index = 0
    if text:
        events.append(
            {"type": "content_block_start", "index": index, "content_block": {"type": "text", "text": ""}}
        )
        for piece in _pieces(text, reply.chunks if isinstance(reply, Text) else 2):
            events.append(
                {
                    "type": "content_block_delta",
                    "index": index,
                    "delta": {"type": "text_delta", "text": piece},
                }
            )
            output_tokens += 1
        events.append({"type": "content_block_stop", "index": index})
        index += 1
    stop_reason = "end_turn"
    if isinstance(reply, ToolCall):
        stop_reason = "tool_use"
        events.append(
            {
                "type": "content_block_start",
                "index": index,
                "content_block": {
                    "type": "tool_use",
                    "id": f"toolu_{uuid.uuid4().hex[:24]}",
                    "name": reply.name,
                    "input": reply.arguments if tool_input_in_start else {},
                },
            }
        )
        for piece in [] if tool_input_in_start else _pieces(json.dumps(reply.arguments), 3):
            events.append(
                {
                    "type": "content_block_delta",
                    "index": index,
                    "delta": {"type": "input_json_delta", "partial_json": piece},
                }
            )
            output_tokens += 1
        events.append({"type": "content_block_stop", "index": index})
    events.append(
        {
            "type": "message_delta",
            "delta": {"stop_reason": stop_reason, "stop_sequence": None},
            "usage": {**usage, "output_tokens": max(1, output_tokens)},
        }
    )
    events.append({"type": "message_stop"})
    return events


def anthropic_message(reply: Text | ToolCall, model: str, input_tokens: int) -> dict[str, Any]:
    """The non-streamed Messages API answer for one reply."""
    content: list[dict[str, Any]] = []
    if reply.text:
        content.append({"type": "text", "text": reply.text})
    if isinstance(reply, ToolCall):
        content.append(
            {
                "type": "tool_use",
                "id": f"toolu_{uuid.uuid4().hex[:24]}",
                "name": reply.name,
                "input": reply.arguments,
            }
        )
    return {
        "id": f"msg_{uuid.uuid4().hex[:24]}",
        "type": "message",
        "role": "assistant",
        "model": model,
        "content": content,
        "stop_reason": "tool_use" if isinstance(reply, ToolCall) else "end_turn",
        "stop_sequence": None,
        "usage": {
            "input_tokens": input_tokens,
            "cache_creation_input_tokens": 0,
            "cache_read_input_tokens": 0,
            "output_tokens": max(1, len(reply.text) // 4),
        },
    }


def responses_events(reply: Text | ToolCall, model: str, input_tokens: int) -> list[dict[str, Any]]:
    """The Responses API stream for one reply (``sequence_number`` added by the sender)."""
    created = int(time.time())
    response: dict[str, Any] = {
        "id": f"resp_{uuid.uuid4().hex}",
        "object": "response",
        "created_at": created,
        "status": "in_progress",
        "error": None,
        "incomplete_details": None,
        "instructions": None,
        "max_output_tokens": None,
        "model": model,
        "output": [],
        "parallel_tool_calls": True,
        "previous_response_id": None,
        "reasoning": {"effort": None, "summary": None},
        "store": False,
        "temperature": 1.0,
        "text": {"format": {"type": "text"}},
        "tool_choice": "auto",
        "tools": [],
        "top_p": 1.0,
        "truncation": "disabled",
        "usage": None,
        "metadata": {},
    }
    events: list[dict[str, Any]] = [
        {"type": "response.created", "response": dict(response)},
        {"type": "response.in_progress", "response": dict(response)},
    ]
    output: list[dict[str, Any]] = []
    output_tokens = 0
    if reply.text:
        item_id = f"msg_{uuid.uuid4().hex}"
        oi = len(output)
        item: dict[str, Any] = {
            "id": item_id,
            "type": "message",
            "status": "in_progress",
            "role": "assistant",
            "content": [],
        }
        events.append({"type": "response.output_item.added", "output_index": oi, "item": dict(item)})
        part = {"type": "output_text", "text": "", "annotations": []}
        events.append(
            {
                "type": "response.content_part.added",
                "item_id": item_id,
                "output_index": oi,
                "content_index": 0,
                "part": part,
            }
        )
        for piece in _pieces(reply.text, reply.chunks if isinstance(reply, Text) else 2):
            events.append(
                {
                    "type": "response.output_text.delta",
                    "item_id": item_id,
                    "output_index": oi,
                    "content_index": 0,
                    "delta": piece,
                    "logprobs": [],
                }
            )
            output_tokens += 1
        done_part = {"type": "output_text", "text": reply.text, "annotations": []}
        events.append(
            {
                "type": "response.output_text.done",
                "item_id": item_id,
                "output_index": oi,
                "content_index": 0,
                "text": reply.text,
                "logprobs": [],
            }
        )
        events.append(
            {
                "type": "response.content_part.done",
                "item_id": item_id,
                "output_index": oi,
                "content_index": 0,
                "part": done_part,
            }
        )
        done_item = {**item, "status": "completed", "content": [done_part]}
        events.append({"type": "response.output_item.done", "output_index": oi, "item": done_item})
        output.append(done_item)
    if isinstance(reply, ToolCall):
        item_id = f"fc_{uuid.uuid4().hex}"
        oi = len(output)
        arguments = json.dumps(reply.arguments)
        call: dict[str, Any] = {
            "id": item_id,
            "type": "function_call",
            "status": "in_progress",
            "call_id": f"call_{uuid.uuid4().hex[:24]}",
            "name": reply.name,
            "arguments": "",
        }
        events.append({"type": "response.output_item.added", "output_index": oi, "item": dict(call)})
        for piece in _pieces(arguments, 3):
            events.append(
                {
                    "type": "response.function_call_arguments.delta",
                    "item_id": item_id,
                    "output_index": oi,
                    "delta": piece,
                }
            )
            output_tokens += 1
        events.append(
            {
                "type": "response.function_call_arguments.done",
                "item_id": item_id,
                "output_index": oi,
                "name": reply.name,
                "arguments": arguments,
            }
        )
        done_call = {**call, "status": "completed", "arguments": arguments}
        events.append({"type": "response.output_item.done", "output_index": oi, "item": done_call})
        output.append(done_call)
    output_tokens = max(1, output_tokens)
    events.append(
        {
            "type": "response.completed",
            "response": {
                **response,
                "status": "completed",
                "output": output,
                "usage": {
                    "input_tokens": input_tokens,
                    "input_tokens_details": {"cached_tokens": 0},
                    "output_tokens": output_tokens,
                    "output_tokens_details": {"reasoning_tokens": 0},
                    "total_tokens": input_tokens + output_tokens,
                },
            },
        }
    )
    return events


# --- the server -----------------------------------------------------------------------------


class CaptureServer:
    """Serve the agents' APIs on 127.0.0.1 from a background thread; ``with`` starts and stops it.

    ``reply(api, record)`` picks each answer (``api`` is "anthropic" or "responses"); ``models``
    is the JSON answered to ``GET /v1/models``; ``shape`` trims the streamed answers.
    """

    def __init__(
        self,
        reply: Callable[[str, Record], Reply] = default_reply,
        *,
        model: str = "capture-model",
        models: dict[str, Any] | None = None,
        shape: Shape | None = None,
    ) -> None:
        self.reply = reply
        self.model = model
        self.models = models
        self.shape = shape or Shape()
        self.records: list[Record] = []
        self.egress: list[str] = []  # request lines the sentinel refused ("CONNECT host:443 HTTP/1.1")
        self._seq = itertools.count()
        self._lock = threading.Lock()
        self._loop: asyncio.AbstractEventLoop | None = None
        self._thread: threading.Thread | None = None
        self._server: uvicorn.Server | None = None
        self._sentinel: asyncio.Server | None = None
        self._api_socket = socket.create_server(("127.0.0.1", 0))
        self._proxy_socket = socket.create_server(("127.0.0.1", 0))
        self.port: int = self._api_socket.getsockname()[1]
        self.proxy_port: int = self._proxy_socket.getsockname()[1]

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    @property
    def proxy_url(self) -> str:
        return f"http://127.0.0.1:{self.proxy_port}"

    def requests(self, path: str | None = None) -> list[Record]:
        with self._lock:
            return [r for r in self.records if path is None or r.path == path]

    # lifecycle

    def __enter__(self) -> CaptureServer:
        self.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def start(self) -> None:
        app = Starlette(
            routes=[
                Route("/v1/messages", self._messages, methods=["POST"]),
                Route("/v1/messages/count_tokens", self._count_tokens, methods=["POST"]),
                Route("/v1/responses", self._responses, methods=["POST"]),
                Route("/v1/models", self._models, methods=["GET"]),
                Route("/{rest:path}", self._unknown, methods=["GET", "POST", "PUT", "DELETE", "HEAD"]),
            ]
        )
        config = uvicorn.Config(app, log_level="warning", lifespan="off", access_log=False)
        self._server = uvicorn.Server(config)
        ready = threading.Event()

        def run() -> None:
            loop = asyncio.new_event_loop()
            self._loop = loop

            async def main() -> None:
                assert self._server is not None
                self._sentinel = await asyncio.start_server(self._refuse, sock=self._proxy_socket)
                ready.set()
                await self._server.serve(sockets=[self._api_socket])
                self._sentinel.close()

            loop.run_until_complete(main())
            loop.close()

        self._thread = threading.Thread(target=run, name="agent-capture", daemon=True)
        self._thread.start()
        if not ready.wait(10):
            raise RuntimeError("the capture server did not start")
        deadline = time.monotonic() + 10
        while not self._server.started:
            if time.monotonic() > deadline:
                raise RuntimeError("the capture server did not start")
            time.sleep(0.01)

    def stop(self) -> None:
        if self._server is not None:
            self._server.should_exit = True
        if self._thread is not None:
            self._thread.join(10)
        self._api_socket.close()
        self._proxy_socket.close()

    # recording

    async def _record(self, request: Request) -> Record:
        raw = await request.body()
        body: Any = raw.decode("utf-8", "replace")
        if raw:
            with contextlib.suppress(ValueError):
                body = json.loads(raw)
        record = Record(
            seq=next(self._seq),
            time=time.time(),
            method=request.method,
            path=request.url.path,
            query=request.url.query,
            headers=[(k.decode("latin-1"), v.decode("latin-1")) for k, v in request.headers.raw],
            body=body,
            body_bytes=len(raw),
        )
        with self._lock:
            self.records.append(record)
        return record

    async def _refuse(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        with contextlib.suppress(Exception):
            line = await asyncio.wait_for(reader.readline(), 10)
            with self._lock:
                self.egress.append(line.decode("latin-1").strip())
            while (await asyncio.wait_for(reader.readline(), 10)).strip():
                pass
            writer.write(b"HTTP/1.1 403 Forbidden\r\nContent-Length: 0\r\nConnection: close\r\n\r\n")
            await writer.drain()
        writer.close()

    # answers

    def _sse(self, events: list[dict[str, Any]], numbered: bool) -> StreamingResponse:
        shape = self.shape
        kept = [e for e in events if e["type"] not in shape.drop_events]

        async def body() -> AsyncIterator[bytes]:
            for n, event in enumerate(kept):
                payload = {**event, "sequence_number": n} if numbered else event
                payload = _strip(payload, shape.drop_fields)
                head = f"event: {event['type']}\n" if shape.sse_event_lines else ""
                yield f"{head}data: {json.dumps(payload)}\n\n".encode()
                await asyncio.sleep(0)

        return StreamingResponse(
            body(), media_type="text/event-stream", headers={"cache-control": "no-cache"}
        )

    @staticmethod
    def _error(reply: HttpError) -> JSONResponse:
        return JSONResponse(reply.body, status_code=reply.status, headers=reply.headers)

    async def _messages(self, request: Request) -> Response:
        record = await self._record(request)
        body = record.body if isinstance(record.body, dict) else {}
        reply = self.reply("anthropic", record)
        if isinstance(reply, HttpError):
            record.answer = f"http {reply.status}"
            return self._error(reply)
        record.answer = "tool_call" if isinstance(reply, ToolCall) else "text"
        model = str(body.get("model", self.model))
        tokens = _rough_tokens(body)
        if body.get("stream"):
            events = anthropic_events(reply, model, tokens, self.shape.tool_input_in_start)
            return self._sse(events, numbered=False)
        return JSONResponse(_strip(anthropic_message(reply, model, tokens), self.shape.drop_fields))

    async def _count_tokens(self, request: Request) -> Response:
        record = await self._record(request)
        record.answer = "count_tokens"
        return JSONResponse({"input_tokens": _rough_tokens(record.body)})

    async def _responses(self, request: Request) -> Response:
        record = await self._record(request)
        body = record.body if isinstance(record.body, dict) else {}
        reply = self.reply("responses", record)
        if isinstance(reply, HttpError):
            record.answer = f"http {reply.status}"
            return self._error(reply)
        record.answer = "tool_call" if isinstance(reply, ToolCall) else "text"
        model = str(body.get("model", self.model))
        events = responses_events(reply, model, _rough_tokens(body))
        if body.get("stream"):
            return self._sse(events, numbered=True)
        return JSONResponse(_strip(events[-1]["response"], self.shape.drop_fields))

    async def _models(self, request: Request) -> Response:
        record = await self._record(request)
        record.answer = "models"
        if self.models is not None:
            return JSONResponse(self.models)
        return JSONResponse(
            {
                "object": "list",
                "data": [{"id": self.model, "object": "model", "created": 0, "owned_by": "capture"}],
            }
        )

    async def _unknown(self, request: Request) -> Response:
        record = await self._record(request)
        record.answer = "http 404"
        return JSONResponse(
            {"type": "error", "error": {"type": "not_found_error", "message": f"no route {record.path}"}},
            status_code=404,
        )


@contextlib.contextmanager
def capture(**kwargs: Any) -> Iterator[CaptureServer]:
    server = CaptureServer(**kwargs)
    server.start()
    try:
        yield server
    finally:
        server.stop()
