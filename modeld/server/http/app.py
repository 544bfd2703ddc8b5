"""The Starlette application: routes, access control, streaming.

Routes (each also without the ``/v1`` prefix, as llama-server accepts them):
``GET /v1/models``, ``GET /v1/models/{name}``, ``POST /v1/chat/completions``,
``POST /v1/completions``, ``GET /health`` (never needs a key), ``GET /metrics``.

Access (``blueprints/0014-openai-http.md``): with an API key every route but ``/health``
needs ``Authorization: Bearer <key>``, and off loopback a key is mandatory (``serve`` refuses
to start without one). On loopback without a key, as local OpenAI servers do, anyone on the
machine may call it; it exposes registered model names only, never paths or other sessions'
data. What a web page in a browser could send is refused there: a ``Host`` that is not a
loopback name (DNS rebinding) and a cross-site ``Origin``.

A request's turn runs on a worker thread (:mod:`turns`); its events reach the event loop
through a queue. A client that goes away cancels the decode within one token step.
"""

from __future__ import annotations

import asyncio
import contextlib
import ipaddress
import json
import logging
from collections.abc import AsyncIterator, Callable, Mapping
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any
from urllib.parse import urlsplit

from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.routing import Route

from modeld.contract import Config, OpenSessionRequest, StreamChunk, TokenLogprob
from modeld.errors import echo, error_from_reason
from modeld.server.auth import bearer_matches
from modeld.server.gateway import Gateway
from modeld.server.http.conversations import Conversations
from modeld.server.http.models import ModelRegistry
from modeld.server.http.openai import (
    ApiError,
    Turn,
    api_error,
    chat_chunk,
    chat_delta,
    chat_logprobs,
    chat_response,
    completion_chunk,
    completion_logprobs,
    completion_response,
    finish_reason,
    modeld_info,
    models_response,
    parse_chat,
    parse_completion,
)
from modeld.server.http.turns import Event, Failed, Job, Started

__all__ = ["HttpService", "HttpSettings", "build_app"]

log = logging.getLogger("modeld.http")

_NDJSON = {"separators": (",", ":"), "ensure_ascii": False}


@dataclass(frozen=True)
class HttpSettings:
    backend: str
    api_key: str = ""
    loopback: bool = True
    bound_host: str = "127.0.0.1"
    num_ctx: int = Config().num_ctx
    kv_cache_type: str = Config().kv_cache_type
    flash_attn: bool = Config().flash_attn
    max_body_bytes: int = 16 << 20
    max_conversations: int = 16
    idle_seconds: float = 600.0


def _sse(obj: Mapping[str, Any]) -> bytes:
    return b"data: " + json.dumps(obj, **_NDJSON).encode() + b"\n\n"  # type: ignore[arg-type]


def _error(error: ApiError) -> JSONResponse:
    headers = {"WWW-Authenticate": "Bearer"} if error.status == 401 else None
    return JSONResponse(error.body(), status_code=error.status, headers=headers)


def _is_loopback_host(host: str) -> bool:
    name = host.strip()
    if name.startswith("["):
        name = name[1 : name.find("]")] if "]" in name else name[1:]
    elif name.count(":") == 1:
        name = name.split(":", 1)[0]
    if name.lower() == "localhost" or name.lower().endswith(".localhost"):
        return True
    try:
        return ipaddress.ip_address(name).is_loopback
    except ValueError:
        return False


class HttpService:
    """The endpoint's state: the gateway, the model names, the conversations, a thread pool."""

    def __init__(self, gateway: Gateway, registry: ModelRegistry, settings: HttpSettings) -> None:
        self.gateway = gateway
        self.registry = registry
        self.settings = settings
        self.conversations = Conversations(
            gateway, max_conversations=settings.max_conversations, idle_seconds=settings.idle_seconds
        )
        self.pool = ThreadPoolExecutor(
            max_workers=gateway.limits.max_sessions, thread_name_prefix="http-turn"
        )

    def close(self) -> None:
        self.conversations.close_all()
        self.pool.shutdown(wait=False, cancel_futures=True)

    # --- access -----------------------------------------------------------------------------

    def denied(self, request: Request) -> Response | None:
        if self.settings.api_key:
            if bearer_matches(request.headers.get("authorization", ""), self.settings.api_key):
                return None
            return _error(
                ApiError(
                    401,
                    "a valid API key is required: send 'Authorization: Bearer <key>' (the key given to "
                    "modeld serve with --api-key or MODELD_API_KEY)",
                    code="invalid_api_key",
                )
            )
        host = request.headers.get("host", "")
        if not (_is_loopback_host(host) or host.split(":")[0] == self.settings.bound_host):
            return _error(ApiError(403, f"Host {echo(host)} is not a loopback name", code="forbidden_host"))
        origin = request.headers.get("origin")
        if origin:
            parts = urlsplit(origin)
            if parts.scheme in ("http", "https") and not _is_loopback_host(parts.netloc):
                return _error(
                    ApiError(
                        403,
                        f"cross-site requests (Origin {echo(origin)}) are refused",
                        code="forbidden_origin",
                    )
                )
        return None

    async def _body(self, request: Request) -> dict[str, Any]:
        limit = self.settings.max_body_bytes
        length = request.headers.get("content-length", "")
        if length.isdigit() and int(length) > limit:
            raise ApiError(
                413, f"the request body is {length} bytes; the limit is {limit}", code="limit_exceeded"
            )
        parts: list[bytes] = []
        size = 0
        async for part in request.stream():
            size += len(part)
            if size > limit:
                raise ApiError(413, f"the request body exceeds {limit} bytes", code="limit_exceeded")
            parts.append(part)
        try:
            body = json.loads(b"".join(parts))
        except (ValueError, RecursionError) as exc:
            raise ApiError(
                400, f"the request body is not valid JSON ({str(exc)[:120]})", code="invalid_json"
            ) from None
        if not isinstance(body, dict):
            raise ApiError(400, "the request body must be a JSON object", code="invalid_json")
        return body

    # --- routes -------------------------------------------------------------------------------

    async def health(self, _request: Request) -> Response:
        lost = ""
        try:
            lost = self.gateway.status().owner_lost
        except Exception:
            lost = "status unavailable"
        if self.gateway.stopping or lost:
            return JSONResponse({"status": "unavailable", "reason": lost or "shutting down"}, status_code=503)
        return JSONResponse({"status": "ok"})

    async def metrics(self, request: Request) -> Response:
        denied = self.denied(request)
        if denied is not None:
            return denied
        text, content_type = self.gateway.metrics_text(request.headers.get("accept", ""))
        return Response(text, media_type=content_type)

    async def models(self, request: Request) -> Response:
        denied = self.denied(request)
        if denied is not None:
            return denied
        entries = await asyncio.to_thread(self.registry.entries)
        return JSONResponse(models_response([(e.name, e.created) for e in entries]))

    async def model(self, request: Request) -> Response:
        denied = self.denied(request)
        if denied is not None:
            return denied
        name = request.path_params["name"]
        entry = await asyncio.to_thread(self.registry.get, name)
        if entry is None:
            return _error(_no_model(name))
        return JSONResponse(
            {"id": entry.name, "object": "model", "created": entry.created, "owned_by": "modeld"}
        )

    async def chat(self, request: Request) -> Response:
        return await self._serve(request, parse_chat)

    async def completions(self, request: Request) -> Response:
        return await self._serve(request, parse_completion)

    # --- running a turn ---------------------------------------------------------------------

    async def _serve(self, request: Request, parse: Callable[..., Turn]) -> Response:
        denied = self.denied(request)
        if denied is not None:
            return denied
        try:
            body = await self._body(request)
            turn = parse(body, conversation_header=request.headers.get("x-modeld-conversation", ""))
            entry = self.registry.get(turn.model)
            if entry is None:
                raise _no_model(turn.model)
        except ApiError as exc:
            return _error(exc)
        open_request = OpenSessionRequest(
            model_name=entry.name,
            type=self.settings.backend,
            path=entry.path,
            config=Config(
                num_ctx=self.settings.num_ctx,
                prompt_format=turn.prompt_format,
                kv_cache_type=self.settings.kv_cache_type,
                flash_attn=self.settings.flash_attn,
            ),
        )
        loop = asyncio.get_running_loop()
        events: asyncio.Queue[Event] = asyncio.Queue()

        def emit(event: Event) -> None:
            loop.call_soon_threadsafe(events.put_nowait, event)

        job = Job(turn, open_request, self.conversations, emit)
        watcher = asyncio.create_task(_watch_disconnect(request, job))
        self.pool.submit(job.run)
        try:
            first = await events.get()
            if isinstance(first, Failed):
                return _error(self._failed(first))
            assert isinstance(first, Started)
            if turn.stream:
                watcher.cancel()  # StreamingResponse watches for the disconnect from here on
                headers = {"Cache-Control": "no-cache", "X-Modeld-Session": first.session_id}
                return StreamingResponse(
                    self._stream(turn, first, events, job), media_type="text/event-stream", headers=headers
                )
            return await self._collect(turn, first, events)
        finally:
            watcher.cancel()

    def _failed(self, failed: Failed) -> ApiError:
        error = api_error(failed.error, failed.incident)
        if error.status >= 500:
            log.error(
                "request failed (incident %s): %s [%s]",
                failed.incident,
                failed.error.message,
                failed.error.reason,
            )
        return error

    async def _collect(self, turn: Turn, started: Started, events: asyncio.Queue[Event]) -> Response:
        parts: list[str] = []
        logprobs: list[TokenLogprob] = []
        while True:
            event = await events.get()
            if isinstance(event, Failed):
                return _error(self._failed(event))
            assert isinstance(event, StreamChunk)
            parts.append(event.text)
            logprobs.extend(event.logprobs)
            if event.final:
                break
        if event.finish_reason == "error" and event.error is not None:
            return _error(self._chunk_error(event))
        extension = modeld_info(started.session_id, started.status, started.diverged_message)
        text = "".join(parts)
        body = (
            chat_response(turn, text, event, extension, tuple(logprobs))
            if turn.kind == "chat"
            else completion_response(turn, text, event, extension, tuple(logprobs))
        )
        return JSONResponse(body, headers={"X-Modeld-Session": started.session_id})

    def _chunk_error(self, chunk: StreamChunk) -> ApiError:
        assert chunk.error is not None
        error = error_from_reason(chunk.error.reason, chunk.error.message, {})
        return self._failed(Failed(error, "decode"))

    async def _stream(
        self, turn: Turn, started: Started, events: asyncio.Queue[Event], job: Job
    ) -> AsyncIterator[bytes]:
        chat = turn.kind == "chat"
        extension = modeld_info(started.session_id, started.status, started.diverged_message)
        done = False
        offset = 0  # completions: characters sent so far (logprobs' text_offset)
        try:
            if chat:
                yield _sse(chat_chunk(turn, {"role": "assistant", "content": ""}))
            while True:
                event = await events.get()
                if isinstance(event, Failed):
                    done = True
                    yield _sse(self._failed(event).body())
                    return
                assert isinstance(event, StreamChunk)
                if chat:
                    delta = chat_delta(turn, event)
                    if delta is not None or event.logprobs:
                        yield _sse(chat_chunk(turn, delta or {}, logprobs=chat_logprobs(event.logprobs)))
                elif event.text or event.logprobs:
                    yield _sse(
                        completion_chunk(
                            turn, event.text, logprobs=completion_logprobs(event.logprobs, offset)
                        )
                    )
                    offset += len(event.text)
                if not event.final:
                    continue
                done = True
                if event.finish_reason == "error" and event.error is not None:
                    yield _sse(self._chunk_error(event).body())
                    return
                finish = finish_reason(event)
                tail = None if turn.include_usage else extension
                last = _sse(
                    chat_chunk(turn, {}, finish, extension=tail)
                    if chat
                    else completion_chunk(turn, "", finish, extension=tail)
                )
                if turn.include_usage:
                    last += _sse(
                        chat_chunk(turn, None, usage=event.usage, extension=extension)
                        if chat
                        else completion_chunk(turn, None, usage=event.usage, extension=extension)
                    )
                yield last + b"data: [DONE]\n\n"  # the last events in one write
                return
        finally:
            if not done:
                job.cancel()


def _no_model(name: str) -> ApiError:
    return ApiError(
        404,
        f"the model {echo(name)} does not exist (GET /v1/models lists them)",
        code="model_not_found",
        param="model",
    )


async def _watch_disconnect(request: Request, job: Job) -> None:
    """Cancel the job when the client disconnects before its answer is complete."""
    with contextlib.suppress(asyncio.CancelledError):
        while True:
            message = await request.receive()
            if message["type"] == "http.disconnect":
                job.cancel()
                return


def build_app(service: HttpService) -> Starlette:
    routes: list[Route] = []
    for prefix in ("/v1", ""):
        routes += [
            Route(f"{prefix}/models", service.models, methods=["GET"]),
            Route(f"{prefix}/models/{{name:path}}", service.model, methods=["GET"]),
            Route(f"{prefix}/chat/completions", service.chat, methods=["POST"]),
            Route(f"{prefix}/completions", service.completions, methods=["POST"]),
        ]
    routes += [
        Route("/health", service.health, methods=["GET"]),
        Route("/metrics", service.metrics, methods=["GET"]),
    ]

    async def not_found(_request: Request, _exc: Exception) -> Response:
        return _error(ApiError(404, "no such route", code="not_found"))

    async def not_allowed(_request: Request, _exc: Exception) -> Response:
        return _error(ApiError(405, "method not allowed", code="method_not_allowed"))

    return Starlette(routes=routes, exception_handlers={404: not_found, 405: not_allowed})
