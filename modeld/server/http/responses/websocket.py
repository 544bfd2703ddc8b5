"""The Responses API over a WebSocket, as Codex speaks it: ``GET /v1/responses`` upgraded.

Each turn is a ``response.create`` text frame holding a Responses create body (``stream`` is
ignored: every response streams); the answer is the same events as the HTTP stream's, one JSON text frame
each, from ``response.created`` to ``response.completed`` (or ``error`` and ``response.failed``).
A turn continues the previous one with ``previous_response_id`` and only its new input items:
the socket keeps its last response (its conversation) in memory, stored or not (``store:
false``), so nothing is resent and nothing need touch the disk; an earlier stored response is
found in the store as over HTTP. ``generate: false`` (or ``prompt_cache_options.prewarm``)
computes the prompt and keeps it warm without generating: Codex prewarms its first turn so.

The socket is the warm session: every turn on it runs on one conversation (its
``prompt_cache_key``, else the socket's own key), so the second turn reuses every token of the
first's prompt and answer. Turns on one socket run one after another, in the order sent.

Refusals: an upgrade the access checks refuse (key, Host, Origin: a browser sends ``Origin`` on a
cross-site WebSocket too) is closed before it is accepted (403); while the daemon drains, or when
:data:`MAX_SOCKETS` are open, the upgrade is answered 426 so the client falls back to HTTP (what
Codex does on a 426), and a plain ``GET /v1/responses`` is 426 too. A frame larger than the
daemon's message limit, one that is not JSON or not ``response.create``, ``stream_id`` (lanes) and
``background`` are answered with an ``error`` event (``status`` and OpenAI's error object), and
the socket stays open; ``previous_response_id`` naming neither the socket's last response nor a
stored one is ``previous_response_not_found``.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import uuid
from collections.abc import AsyncIterator, Callable, Mapping
from dataclasses import replace
from typing import Any

from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.websockets import WebSocket, WebSocketDisconnect, WebSocketState

from modeld.errors import ModeldError, echo
from modeld.server.http.conversations import Collected, first_event
from modeld.server.http.errors import HttpError, from_modeld, incident_id, openai_error
from modeld.server.http.fields import check_strings
from modeld.server.http.responses.answer import ResponseShape, history_after, stream_response
from modeld.server.http.responses.request import parse_response_request
from modeld.server.http.responses.store import ResponseStore, Stored
from modeld.server.http.runner import Runner
from modeld.server.http.turn import Turn

__all__ = ["MAX_SOCKETS", "ResponsesSockets", "upgrade_required"]

log = logging.getLogger("modeld.http")

MAX_SOCKETS = 64
"""Responses sockets open at once; beyond it an upgrade is refused with 426 (HTTP instead)."""
_TRANSPORT_FIELDS = frozenset({"type", "generate", "stream"})  # every response streams here
_REFUSED = {
    "stream_id": "WebSocket lanes (stream_id) are not supported: open one socket per conversation",
    "background": "background responses are not supported: modeld answers while you wait",
}


def upgrade_required(message: str) -> Response:
    """426: this resource is a WebSocket (the client falls back to ``POST /v1/responses``)."""
    error = HttpError(426, message, code="upgrade_required")
    return JSONResponse(openai_error(error), status_code=426, headers={"Upgrade": "websocket"})


async def plain_get(_request: Request) -> Response:
    """``GET /v1/responses`` without an upgrade."""
    return upgrade_required(
        "GET /v1/responses is the Responses WebSocket: upgrade the connection, or POST a response"
    )


def _frames(chunk: bytes) -> list[str]:
    """The JSON of each server-sent event in ``chunk`` (as the HTTP stream writes them)."""
    out = []
    for block in chunk.split(b"\n\n"):
        for line in block.split(b"\n"):
            if line.startswith(b"data: "):
                out.append(line[6:].decode())
    return out


def error_event(error: HttpError) -> str:
    """An error over the socket: the status and OpenAI's error object."""
    return json.dumps({"type": "error", "status": error.status, **openai_error(error)})


class ResponsesSockets:
    """The open Responses sockets of one endpoint: each runs its turns through ``runner``."""

    def __init__(
        self,
        runner: Runner,
        denied: Callable[[WebSocket], HttpError | None],
        store: ResponseStore | None,
        max_message_bytes: int,
        draining: Callable[[], bool],
    ) -> None:
        self.runner = runner
        self.denied = denied
        self.store = store
        self.max_message_bytes = max_message_bytes
        self.draining = draining
        self.open = 0

    async def serve(self, socket: WebSocket) -> None:
        refused = self.denied(socket)
        if refused is not None:
            await socket.close(code=1008, reason=refused.message[:120])
            return
        if self.draining() or self.open >= MAX_SOCKETS:
            why = "the daemon is draining" if self.draining() else f"{MAX_SOCKETS} Responses sockets are open"
            try:
                await socket.send_denial_response(upgrade_required(f"{why}: use POST /v1/responses"))
            except RuntimeError:  # a server without denial responses: a refused handshake (403)
                await socket.close(code=1013, reason=why)
            return
        self.open += 1
        try:
            await socket.accept()
            await _Socket(self, socket).run()
        finally:
            self.open -= 1


class _Socket:
    """One connection: its frames in order, its last response, its conversation key."""

    def __init__(self, sockets: ResponsesSockets, socket: WebSocket) -> None:
        self.sockets = sockets
        self.socket = socket
        self.key = f"responses-socket:{uuid.uuid4().hex[:16]}"
        self.last: Stored | None = None
        self.headers: Mapping[str, str] = {k.lower(): v for k, v in socket.headers.items()}

    async def run(self) -> None:
        frames: asyncio.Queue[str | None] = asyncio.Queue()
        reader = asyncio.create_task(self._read(frames))
        try:
            while True:
                frame = await frames.get()
                if frame is None:
                    return
                turn = asyncio.create_task(self._turn(frame))
                gone = asyncio.create_task(_closed(reader))
                done, _ = await asyncio.wait({turn, gone}, return_when=asyncio.FIRST_COMPLETED)
                if gone in done and turn not in done:  # the client left: stop the decode
                    turn.cancel()
                    with contextlib.suppress(asyncio.CancelledError):
                        await turn
                    return
                gone.cancel()
                try:
                    turn.result()
                except WebSocketDisconnect:  # the client left while its answer was being sent
                    return
        finally:
            reader.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await reader

    async def _read(self, frames: asyncio.Queue[str | None]) -> None:
        try:
            while True:
                message = await self.socket.receive()
                if message["type"] == "websocket.disconnect":
                    break
                text = message.get("text")
                if text is None and message.get("bytes") is not None:
                    text = message["bytes"].decode("utf-8", errors="replace")
                if text is not None:
                    await frames.put(text)
        except WebSocketDisconnect:
            pass
        finally:
            await frames.put(None)

    async def _send(self, text: str) -> None:
        if self.socket.application_state == WebSocketState.CONNECTED:
            await self.socket.send_text(text)

    async def _turn(self, frame: str) -> None:
        try:
            await self._answer(frame)
        except HttpError as exc:
            await self._send(error_event(exc))
        except ModeldError as exc:
            await self._send(error_event(from_modeld(exc, incident_id())))
        except (asyncio.CancelledError, WebSocketDisconnect):
            raise
        except Exception as exc:
            incident = incident_id()
            log.error("internal error on a Responses socket (incident %s)", incident, exc_info=exc)
            await self._send(
                error_event(
                    HttpError(
                        500, f"internal error (incident {incident}; see the daemon's log)", code="internal"
                    )
                )
            )

    def _body(self, frame: str) -> dict[str, Any]:
        if len(frame.encode()) > self.sockets.max_message_bytes:
            raise HttpError(
                413,
                f"the frame is larger than the daemon's message limit of {self.sockets.max_message_bytes} bytes",
            )
        try:
            event = json.loads(frame)
        except (ValueError, RecursionError):
            raise HttpError(400, "a frame must be a JSON object", code="invalid_json") from None
        check_strings(event)
        if not isinstance(event, dict) or event.get("type") != "response.create":
            kind = event.get("type") if isinstance(event, dict) else None
            raise HttpError(
                400,
                f"unknown event type {echo(kind)}: send response.create",
                code="invalid_type",
                param="type",
            )
        for name, why in _REFUSED.items():
            if event.get(name):
                raise HttpError(400, why, code="unsupported_parameter", param=name)
        generate = event.get("generate", True)
        if not isinstance(generate, bool):
            raise HttpError(400, "generate must be a boolean", code="invalid_type", param="generate")
        body = {k: v for k, v in event.items() if k not in _TRANSPORT_FIELDS}
        if not generate:
            options = body.get("prompt_cache_options")
            body["prompt_cache_options"] = {**(options if isinstance(options, dict) else {}), "prewarm": True}
        return body

    def _previous(self, body: Mapping[str, Any]) -> Stored | None:
        previous_id = body.get("previous_response_id")
        if previous_id is None:
            return None
        if self.last is not None and previous_id == self.last.id:
            return self.last
        found = (
            self.sockets.store.get(previous_id)
            if self.sockets.store is not None and isinstance(previous_id, str)
            else None
        )
        if found is None:
            raise HttpError(
                400,
                f"previous response {echo(previous_id)} is neither this socket's last response nor a stored one",
                code="previous_response_not_found",
                param="previous_response_id",
            )
        return found

    async def _answer(self, frame: str) -> None:
        body = self._body(frame)
        previous = self._previous(body)
        runner = self.sockets.runner
        turn, keep_it, new = parse_response_request(
            {**body, "stream": True}, self.headers, previous, runner.gateway.limits
        )
        named = body.get("prompt_cache_key") or turn.keys.header or turn.keys.routing or turn.keys.user
        if not named:  # the socket is the conversation
            turn = replace(turn, keys=replace(turn.keys, header=self.key))
        store = self.sockets.store
        shape = ResponseShape(turn, body, previous.id if previous else None, keep_it and store is not None)

        def keep(done: Collected, response: dict[str, Any]) -> None:
            if done.finished.error is not None:
                return
            history = (*(previous.history if previous else ()), *new, *history_after(done, shape))
            stored = Stored(shape.id, response, history, turn.conversation(), shape.created_at)
            self.last = stored
            if shape.store and store is not None:
                store.put(stored)

        async for chunk in self._stream(turn, shape, keep):
            for data in _frames(chunk):
                await self._send(data)

    async def _stream(
        self, turn: Turn, shape: ResponseShape, keep: Callable[[Collected, dict[str, Any]], None]
    ) -> AsyncIterator[bytes]:
        runner = self.sockets.runner
        leave = runner.drain.enter()
        try:
            if runner.drain.draining:
                await runner.drain.refuse()
            turn = runner.budgeted(turn)
            entry = runner.catalog.entry(turn.model)
            events = runner.conversations.run(turn, runner.catalog.open_request(entry, turn))
            try:
                started = await first_event(events)
                async for chunk in stream_response(shape, started, events, keep):
                    yield chunk
            except (HttpError, ModeldError) as exc:
                error = exc if isinstance(exc, HttpError) else from_modeld(exc, incident_id())
                yield f"data: {error_event(error)}\n\n".encode()
            finally:
                await events.aclose()
        finally:
            leave()


async def _closed(reader: asyncio.Task[None]) -> None:
    """Returns when the reader has seen the socket close."""
    await asyncio.shield(reader)
