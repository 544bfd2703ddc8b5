"""What every HTTP API shares: access, bodies, errors, running a turn (the routes: ``routes.py``).

Routes: OpenAI (``GET /v1/models[/{name}]``, ``POST /v1/chat/completions``, ``POST
/v1/completions``, ``POST /v1/responses``, ``GET|DELETE /v1/responses/{id}``; the OpenAI routes
also without ``/v1``, as llama-server accepts them), Anthropic (``POST /v1/messages``, ``POST
/v1/messages/count_tokens``), Ollama (``/api/...``), the SGLang gateway's worker routes
(``/server_info``, ``/model_info``, ``/get_load``, ...), ``GET /health`` (never needs a key)
and ``GET /metrics``. Each API is a thin adapter over the one conversation layer
(:mod:`modeld.server.http.conversations`); this module owns what they share.

Access (``blueprints/0014-openai-http.md``): with an API key every route but ``/health`` needs
``Authorization: Bearer <key>`` or ``x-api-key: <key>`` (Anthropic's header); off loopback a key
is mandatory (``serve`` refuses to start without one). What a web page in a browser could send
is refused everywhere: a ``Host`` that is not a loopback name or the bound address (DNS
rebinding); any ``Origin`` that is not a loopback ``http(s)`` origin or on the allow-list
(``--allow-origin``), so ``Origin: null`` (sandboxed frames, ``file://`` pages) and extension
origins are refused; and a POST whose ``Content-Type`` is not JSON, so a page cannot send a
"simple" cross-site request that needs no preflight.

Bounds: a body is at most ``max_body_bytes``; the bodies of requests in flight together at most
``max_inflight_bytes`` (beyond it 503 with ``Retry-After``, ``limit_exceeded``); every string a
client sends is checked at the edge (a lone surrogate is a 400). Any unexpected exception is the
API's JSON error with an incident id (the traceback goes to the log, never to the client).
"""

from __future__ import annotations

import asyncio
import contextlib
import ipaddress
import json
import logging
import threading
from collections.abc import AsyncGenerator, AsyncIterator, Awaitable, Callable, Mapping, Sequence
from dataclasses import dataclass, replace
from typing import Any
from urllib.parse import urlsplit

from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse

from modeld.contract import Config, ModelInfo, OpenSessionRequest
from modeld.errors import ModeldError, ModelLoadError, echo
from modeld.server.auth import bearer_matches
from modeld.server.bridge import Bridge
from modeld.server.gateway import Gateway
from modeld.server.http.conversations import (
    Collected,
    Conversations,
    Event,
    Started,
    collect,
    collect_choices,
    first_event,
)
from modeld.server.http.errors import ErrorStyle, HttpError, from_modeld, incident_id
from modeld.server.http.fields import check_strings
from modeld.server.http.models import ModelEntry, ModelRegistry
from modeld.server.http.turn import Turn

__all__ = ["HttpService", "HttpSettings", "error_response", "guarded", "is_loopback_host"]

log = logging.getLogger("modeld.http")

DESCRIBE_SECONDS = 30.0


@dataclass(frozen=True)
class HttpSettings:
    backend: str
    api_key: str = ""
    loopback: bool = True
    bound_host: str = "127.0.0.1"
    num_ctx: int = 0  # 0: the model's own window, as large as the memory budget allows
    max_output_tokens: int = 0  # a request that sets no output limit gets this one (0: the window)
    kv_cache_type: str = Config().kv_cache_type
    flash_attn: bool = Config().flash_attn
    max_body_bytes: int = 16 << 20
    max_inflight_bytes: int = 64 << 20
    max_conversations: int = 16
    idle_seconds: float = 600.0
    allowed_origins: tuple[str, ...] = ()
    data_dir: str = ""


def is_loopback_host(host: str) -> bool:
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


def error_response(error: HttpError, style: ErrorStyle) -> JSONResponse:
    return JSONResponse(style(error), status_code=error.status, headers=error.headers())


Shape = Callable[[Turn, Collected], dict[str, Any]]
Choices = Callable[[Turn, Sequence[Collected]], dict[str, Any]]
Stream = Callable[[Turn, Started, AsyncIterator[Event]], AsyncIterator[bytes]]


class HttpService:
    """The endpoint's state: the gateway, the bridge, model names, conversations, byte budget."""

    def __init__(
        self, gateway: Gateway, registry: ModelRegistry, settings: HttpSettings, bridge: Bridge | None = None
    ) -> None:
        from modeld.server.bridge import Pools

        self.gateway = gateway
        self.registry = registry
        self.settings = settings
        self.bridge = bridge or Bridge(Pools.for_sessions(gateway.limits.max_sessions))
        self._own_bridge = bridge is None
        self.conversations = Conversations(
            gateway,
            self.bridge,
            max_conversations=settings.max_conversations,
            idle_seconds=settings.idle_seconds,
        )
        self._inflight = 0
        self._inflight_lock = threading.Lock()
        self._infos: dict[tuple[str, float, str], ModelInfo] = {}
        self.draining = False
        self._drained = threading.Event()
        self._running = 0

    # --- draining (blueprints/0020-fleet.md) ------------------------------------------------

    def begin_drain(self) -> None:
        """From now on ``/health`` is 503 ("draining") and a new turn is held, then refused with
        503 and ``Retry-After`` once :meth:`release_drain` says the warm state is saved (a
        gateway retries it on another box, which restores it from the shared store); turns
        already running go on."""
        self.draining = True

    def release_drain(self) -> None:
        """The warm contexts are saved: the held turns get their 503 now."""
        self._drained.set()

    @property
    def running_turns(self) -> int:
        """Turns started and not yet answered in full (a stream counts until its end)."""
        with self._inflight_lock:
            return self._running

    def _enter(self) -> Callable[[], None]:
        """Count a running turn; returns what ends it (idempotent)."""
        with self._inflight_lock:
            self._running += 1
        left = False

        def leave() -> None:
            nonlocal left
            with self._inflight_lock:
                if not left:
                    left = True
                    self._running -= 1

        return leave

    async def refuse_while_draining(self) -> None:
        """Raise the drain's 503 (after the warm state is saved) when the daemon drains."""
        if not self.draining:
            return
        while not self._drained.is_set():
            await asyncio.sleep(0.05)
        raise HttpError(
            503,
            "the daemon is draining: its warm contexts are saved (to the shared store when it has "
            "one); send the turn again, and a gateway sends it to another box",
            code="draining",
            retry_after=1,
        )

    def close(self) -> None:
        self.conversations.close_all()
        if self._own_bridge:
            self.bridge.shutdown()

    # --- access -----------------------------------------------------------------------------

    def denied(self, request: Request) -> HttpError | None:
        """Why this request may not be served (None: it may)."""
        origin = request.headers.get("origin")
        if origin is not None and not self._origin_allowed(origin):
            return HttpError(
                403,
                f"requests from the web page at Origin {echo(origin)} are refused (only loopback http(s) "
                "origins, or those given to modeld serve --allow-origin)",
                code="forbidden_origin",
            )
        if self.settings.api_key:
            given = request.headers.get("x-api-key")
            if given is not None and given == self.settings.api_key:
                return None
            if bearer_matches(request.headers.get("authorization", ""), self.settings.api_key):
                return None
            return HttpError(
                401,
                "a valid API key is required: send 'Authorization: Bearer <key>' or 'x-api-key: <key>' (the key "
                "given to modeld serve with --api-key or MODELD_API_KEY)",
                code="invalid_api_key",
            )
        host = request.headers.get("host", "")
        if not (is_loopback_host(host) or host.split(":")[0] == self.settings.bound_host):
            return HttpError(403, f"Host {echo(host)} is not a loopback name", code="forbidden_host")
        return None

    def _origin_allowed(self, origin: str) -> bool:
        if origin in self.settings.allowed_origins:
            return True
        parts = urlsplit(origin)
        return parts.scheme in ("http", "https") and bool(parts.netloc) and is_loopback_host(parts.netloc)

    @contextlib.asynccontextmanager
    async def body(self, request: Request) -> AsyncIterator[dict[str, Any]]:
        """The request's JSON object, its bytes counted against the in-flight budget while the
        request is handled."""
        if request.method == "POST":
            kind = request.headers.get("content-type", "").split(";", 1)[0].strip().lower()
            if kind != "application/json" and not kind.endswith("+json"):
                raise HttpError(
                    415,
                    f"the request body must be JSON: send 'Content-Type: application/json' (got {echo(kind or 'none')})",
                    code="unsupported_media_type",
                )
        limit = self.settings.max_body_bytes
        length = request.headers.get("content-length", "")
        if length.isdigit() and int(length) > limit:
            raise HttpError(
                413, f"the request body is {length} bytes; the limit is {limit}", code="limit_exceeded"
            )
        held = 0
        try:
            parts: list[bytes] = []
            async for part in request.stream():
                held += len(part)
                self._hold(len(part))
                if held > limit:
                    raise HttpError(413, f"the request body exceeds {limit} bytes", code="limit_exceeded")
                parts.append(part)
            data = b"".join(parts)
            try:
                body = json.loads(data) if data else {}
            except (ValueError, RecursionError) as exc:
                raise HttpError(
                    400, f"the request body is not valid JSON ({str(exc)[:120]})", code="invalid_json"
                ) from None
            if not isinstance(body, dict):
                raise HttpError(400, "the request body must be a JSON object", code="invalid_json")
            check_strings(body)
            yield body
        finally:
            with self._inflight_lock:
                self._inflight -= held

    def _hold(self, size: int) -> None:
        with self._inflight_lock:
            if self._inflight + size > self.settings.max_inflight_bytes:
                raise HttpError(
                    503,
                    f"the daemon is reading {self._inflight} bytes of requests; the limit is "
                    f"{self.settings.max_inflight_bytes} (max_inflight_bytes): retry shortly",
                    code="limit_exceeded",
                    param="max_inflight_bytes",
                    retry_after=1,
                )
            self._inflight += size

    # --- models -----------------------------------------------------------------------------

    def entry(self, name: str) -> ModelEntry:
        entry = self.registry.get(name)
        if entry is None:
            raise HttpError(
                404,
                f"the model {echo(name)} does not exist (GET /v1/models lists them)",
                code="model_not_found",
                param="model",
            )
        return entry

    def open_request(
        self, entry: ModelEntry, turn: Turn, keep_alive: float | None = None
    ) -> OpenSessionRequest:
        num_ctx = turn.num_ctx or self.settings.num_ctx or self.gateway.limits.max_context_tokens
        return OpenSessionRequest(
            model_name=entry.name,
            type=self.settings.backend,
            path=entry.path,
            config=Config(
                num_ctx=num_ctx,
                prompt_format="chat" if turn.chat else "raw",
                kv_cache_type=self.settings.kv_cache_type,
                flash_attn=self.settings.flash_attn,
            ),
            keep_alive_seconds=keep_alive or 0.0,
            chat_template=entry.chat_template,
        )

    async def load(self, turn: Turn) -> None:
        """Load the turn's model (count its prompt: nothing is computed or kept)."""
        await self.refuse_while_draining()
        entry = self.entry(turn.model)
        await self.bridge.call(self.gateway.tokenize, self.open_request(entry, turn), "")

    async def describe(self, entry: ModelEntry) -> ModelInfo | None:
        """What the model can do here (cached per file version); None if it cannot be read."""
        key = (entry.path, float(entry.created), entry.chat_template)
        info = self._infos.get(key)
        if info is not None:
            return info
        request = OpenSessionRequest(
            model_name=entry.name,
            type=self.settings.backend,
            path=entry.path,
            config=Config(
                num_ctx=self.settings.num_ctx or self.gateway.limits.max_context_tokens,
                kv_cache_type=self.settings.kv_cache_type,
                flash_attn=self.settings.flash_attn,
            ),
            chat_template=entry.chat_template,
        )

        def late() -> ModeldError:
            return ModelLoadError(f"describing took longer than {DESCRIBE_SECONDS:g}s", path=entry.name)

        try:
            info = await self.bridge.probe(
                self.gateway.describe, request, timeout=DESCRIBE_SECONDS, late=late
            )
        except ModeldError as exc:
            log.info("describing %s: %s", entry.name, exc)
            return None
        if len(self._infos) > 256:
            self._infos.clear()
        self._infos[key] = info
        return info

    # --- running a turn ---------------------------------------------------------------------

    async def turn(
        self,
        request: Request,
        turn: Turn,
        complete: Shape,
        stream: Stream,
        style: ErrorStyle,
        media_type: str = "text/event-stream",
        headers: Mapping[str, str] | None = None,
        keep_alive: float | None = None,
    ) -> Response:
        """Run ``turn`` and answer it: a stream (``stream``) or one JSON body (``complete``).

        Counted in :attr:`running_turns` from here to its last byte (a drain waits for it);
        while the daemon drains, a new turn is refused (:meth:`refuse_while_draining`)."""
        leave = self._enter()  # before the check: a drain beginning now waits for this turn or refuses it
        handed = False  # to the stream, which leaves when it ends
        try:
            if self.draining:
                leave()
                await self.refuse_while_draining()
            entry = self.entry(turn.model)
            if turn.max_tokens is None and self.settings.max_output_tokens:
                turn = replace(turn, max_tokens=self.settings.max_output_tokens)
            events = self.conversations.run(turn, self.open_request(entry, turn, keep_alive))
            task = asyncio.current_task()
            watcher = asyncio.create_task(_watch_disconnect(request, task))
            try:
                started = await first_event(events)
                answer_headers = {"X-Modeld-Session": started.session_id, **(headers or {})}
                if turn.stream:
                    watcher.cancel()  # the streaming response watches for the disconnect from here on
                    answer_headers["Cache-Control"] = "no-cache"
                    response = StreamingResponse(
                        _closing(
                            stream(turn, started, events),
                            events,
                            style,
                            ndjson=media_type != "text/event-stream",
                            done=leave,
                        ),
                        media_type=media_type,
                        headers=answer_headers,
                    )
                    handed = True
                    return response
                async with contextlib.aclosing(events):
                    done = await collect(started, events)
                if done.finished.error is not None:
                    return error_response(done.finished.error, style)
                return JSONResponse(complete(turn, done), headers=answer_headers)
            except BaseException:
                await events.aclose()
                raise
            finally:
                watcher.cancel()
        finally:
            if not handed:
                leave()

    async def choices(self, turn: Turn, complete: Choices, style: ErrorStyle) -> Response:
        """Run ``turn.n`` choices in the turn's conversation and answer them in one JSON body:
        decoded together from the prompt's KV where the engine can fork it, else (the backend
        decodes one choice at a time, or the KV pool has no room for the forks) the first, then
        the others one after another, each reusing the warm prompt; greedy choices are all the
        same, so they are decoded once (the answer says which, ``choices_note``)."""
        entry = self.entry(turn.model)
        if turn.max_tokens is None and self.settings.max_output_tokens:
            turn = replace(turn, max_tokens=self.settings.max_output_tokens)
        greedy = turn.decode.temperature <= 0
        first = turn.choice(0) if greedy else turn
        events = self.conversations.run(first, self.open_request(entry, first))
        async with contextlib.aclosing(events):
            started = await first_event(events)
            dones = await collect_choices(started, events)
        if greedy:  # no draw to differ by: every choice is the first, exactly
            why = "greedy decoding (temperature 0) gives every choice the same tokens"
            once = replace(dones[0], started=replace(started, decoded="once", why=why))
            dones = [once] * turn.n
        for index in range(len(dones), turn.n if dones[0].finished.error is None else 0):
            one = turn.choice(index)
            more = self.conversations.run(one, self.open_request(entry, one))
            async with contextlib.aclosing(more):
                dones.append(await collect(await first_event(more), more))
            if dones[-1].finished.error is not None:
                break
        for done in dones:
            if done.finished.error is not None:
                return error_response(done.finished.error, style)
        return JSONResponse(complete(turn, dones), headers={"X-Modeld-Session": started.session_id})

    async def count_tokens(self, turn: Turn) -> int:
        """How many tokens the turn's prompt takes on its model (nothing is computed)."""
        entry = self.entry(turn.model)
        info = await self.describe(entry)
        if info is None:
            raise HttpError(500, f"the model {echo(turn.model)} could not be read", code="model_load_failed")
        prefix, suffix = self.conversations.inputs(turn, info)
        request = self.open_request(entry, turn)
        return await self.bridge.call(self.gateway.count_tokens, request, prefix, suffix)

    # --- shared routes ----------------------------------------------------------------------

    async def health(self, _request: Request) -> Response:
        """200 when the daemon serves; 503 while it stops, drains or lost its ownership."""
        try:
            status = await self.bridge.observe(self.gateway.status, "health")
            lost = status.owner_lost
        except ModeldError:
            lost = "status unavailable"
        if self.gateway.stopping or self.draining or lost:
            reason = lost or ("draining" if self.draining else "shutting down")
            return JSONResponse({"status": "unavailable", "reason": reason}, status_code=503)
        return JSONResponse({"status": "ok"})

    async def metrics(self, request: Request) -> Response:
        text, content_type = await self.bridge.observe(
            lambda: self.gateway.metrics_text(request.headers.get("accept", "")), "metrics"
        )
        return Response(text, media_type=content_type)


async def _closing(
    body: AsyncIterator[bytes],
    events: AsyncGenerator[Event, None],
    style: ErrorStyle,
    *,
    ndjson: bool,
    done: Callable[[], None],
) -> AsyncIterator[bytes]:
    """A streamed answer that always closes its turn (the client went away: the decode stops)
    and writes an unexpected failure as the API's error event instead of a broken stream."""

    def frame(error: HttpError) -> bytes:
        data = json.dumps(style(error)).encode()
        return data + b"\n" if ndjson else b"data: " + data + b"\n\n"

    try:
        async for part in body:
            yield part
    except (HttpError, ModeldError) as exc:
        yield frame(exc if isinstance(exc, HttpError) else from_modeld(exc, incident_id()))
    except Exception as exc:
        incident = incident_id()
        log.error("internal error while streaming (incident %s)", incident, exc_info=exc)
        yield frame(
            HttpError(500, f"internal error (incident {incident}; see the daemon's log)", code="internal")
        )
    finally:
        try:
            await events.aclose()
        finally:
            done()


async def _watch_disconnect(request: Request, task: asyncio.Task[Any] | None) -> None:
    """Cancel the request's task when the client disconnects before its answer is complete."""
    with contextlib.suppress(asyncio.CancelledError):
        while True:
            message = await request.receive()
            if message["type"] == "http.disconnect":
                if task is not None:
                    task.cancel()
                return


Handler = Callable[[Request], Awaitable[Response]]


def guarded(service: HttpService, handler: Handler, style: ErrorStyle) -> Handler:
    """``handler`` behind the access checks, with every failure as the API's JSON error."""

    async def run(request: Request) -> Response:
        denied = service.denied(request)
        if denied is not None:
            return error_response(denied, style)
        try:
            return await handler(request)
        except HttpError as exc:
            return error_response(exc, style)
        except ModeldError as exc:
            return error_response(from_modeld(exc, incident_id()), style)
        except asyncio.CancelledError:
            raise
        except Exception as exc:
            incident = incident_id()
            log.error(
                "internal error serving %s %s (incident %s)",
                request.method,
                request.url.path,
                incident,
                exc_info=exc,
            )
            error = HttpError(
                500, f"internal error (incident {incident}; see the daemon's log)", code="internal"
            )
            return error_response(error, style)

    return run
