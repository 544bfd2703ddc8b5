"""What every HTTP API shares, put together: :class:`HttpService` (the routes: ``routes.py``).

Routes: OpenAI (``GET /v1/models[/{name}]``, ``POST /v1/chat/completions``, ``POST
/v1/completions``, ``POST /v1/responses``, ``GET|DELETE /v1/responses/{id}``; the OpenAI routes
also without ``/v1``, as llama-server accepts them), Anthropic (``POST /v1/messages``, ``POST
/v1/messages/count_tokens``), Ollama (``/api/...``), the SGLang gateway's worker routes
(``/server_info``, ``/model_info``, ``/get_load``, ...), ``GET /health`` (never needs a key)
and ``GET /metrics``. Each API is a folder of its own over the one conversation layer
(:mod:`modeld.server.http.conversations`) and the shared request layer
(:mod:`modeld.server.http.requests`).

The service is split by job, each a module of its own: who may call and how much of their
requests is held (:mod:`~modeld.server.http.access`), draining
(:mod:`~modeld.server.http.drain`), the models served (:mod:`~modeld.server.http.catalog`),
running a turn and answering it in its dialect's words (:mod:`~modeld.server.http.runner`).
Here: putting them together, ``/health``, ``/metrics``, and :func:`guarded` (a route behind the
access checks, every failure as the API's JSON error with an incident id: the traceback goes
to the log, never to the client).
"""

from __future__ import annotations

import asyncio
import logging
import threading
from collections.abc import Awaitable, Callable
from pathlib import Path

from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from modeld.errors import ModeldError
from modeld.server.bridge import Bridge, Pools
from modeld.server.gateway import Gateway
from modeld.server.http.access import Access, Bodies
from modeld.server.http.catalog import Catalog
from modeld.server.http.conversations import Conversations
from modeld.server.http.drain import Drain
from modeld.server.http.errors import ErrorStyle, HttpError, from_modeld, incident_id
from modeld.server.http.models import ModelRegistry
from modeld.server.http.runner import Runner, error_response
from modeld.settings import HttpSettings, Limits, Serving, parse_tool_formats

__all__ = ["HttpService", "error_response", "guarded"]

log = logging.getLogger("modeld.http")


class HttpService:
    """The endpoint's state, one part per job: the gateway and the bridge to the engine,
    :attr:`access` and :attr:`bodies`, :attr:`drain`, :attr:`catalog` (the models),
    :attr:`conversations` and :attr:`runner` (turns). ``data_dir``: where the Responses API
    keeps stored responses (None: none are stored); ``describe_seconds``: the describe timeout
    (``modeld serve --describe-timeout``, the gRPC Describe's too)."""

    def __init__(
        self,
        gateway: Gateway,
        registry: ModelRegistry,
        settings: HttpSettings,
        bridge: Bridge | None = None,
        *,
        data_dir: Path | None = None,
        describe_seconds: float | None = None,
        starting: bool = False,
    ) -> None:
        self.gateway = gateway
        # The daemon binds this listener before its gRPC server and its owner record: until it
        # has said it serves (:meth:`announce`), ``/health`` is 503 "starting", so a client that
        # waited for a 200 finds the gRPC endpoint in the owner record too.
        self._announced = threading.Event()
        if not starting:
            self._announced.set()
        self.registry = registry
        self.settings = settings
        self.data_dir = data_dir
        self.bridge = bridge or Bridge(Pools.for_sessions(gateway.limits.max_sessions))
        self._own_bridge = bridge is None
        bound_host = settings.http.rpartition(":")[0].strip("[]") or "127.0.0.1"
        self.access = Access(settings.api_key, settings.allowed_origins, bound_host)
        self.bodies = Bodies(gateway.limits.max_message_bytes, settings.max_inflight_bytes)
        self.drain = Drain()
        seconds = Serving().describe_seconds if describe_seconds is None else describe_seconds
        self.catalog = Catalog(gateway, registry, self.bridge, settings, seconds)
        self.conversations = Conversations(
            gateway,
            self.bridge,
            max_conversations=settings.max_conversations,
            idle_seconds=settings.conversation_idle_seconds,
            tool_formats=parse_tool_formats(settings.tool_formats),
            fit_tool_results=settings.fit_tool_results,
            prefill_ahead=settings.prefill_ahead,
        )
        self.runner = Runner(
            gateway,
            self.bridge,
            self.catalog,
            self.conversations,
            self.drain,
            settings.max_output_tokens,
            settings.keepalive_seconds,
        )

    @property
    def limits(self) -> Limits:
        """The daemon's limits on what a request may hold (``modeld serve --max-...``)."""
        return self.gateway.limits

    def announce(self) -> None:
        """The daemon serves on every listener and its owner record says so: ``/health`` may
        say 200 from now on."""
        self._announced.set()

    def close(self) -> None:
        self.conversations.close_all()
        if self._own_bridge:
            self.bridge.shutdown()

    async def health(self, _request: Request) -> Response:
        """200 when the daemon serves; 503 while it starts, stops, drains or lost its ownership."""
        if not self._announced.is_set():
            return JSONResponse({"status": "unavailable", "reason": "starting"}, status_code=503)
        try:
            status = await self.bridge.observe(self.gateway.status, "health")
            lost = status.owner_lost
        except ModeldError:
            lost = "status unavailable"
        draining = self.drain.draining
        if self.gateway.stopping or draining or lost:
            reason = lost or ("draining" if draining else "shutting down")
            return JSONResponse({"status": "unavailable", "reason": reason}, status_code=503)
        return JSONResponse({"status": "ok"})

    async def metrics(self, request: Request) -> Response:
        text, content_type = await self.bridge.observe(
            lambda: self.gateway.metrics_text(request.headers.get("accept", "")), "metrics"
        )
        return Response(text, media_type=content_type)


Handler = Callable[[Request], Awaitable[Response]]


def guarded(
    service: HttpService,
    handler: Handler,
    style: ErrorStyle,
    status: Callable[[HttpError], int] | None = None,
) -> Handler:
    """``handler`` behind the access checks, with every failure as the API's JSON error (and
    the status the API gives it, ``status``: Anthropic's 529)."""

    async def run(request: Request) -> Response:
        denied = service.access.denied(request)
        if denied is not None:
            return error_response(denied, style, status)
        try:
            return await handler(request)
        except HttpError as exc:
            return error_response(exc, style, status)
        except ModeldError as exc:
            return error_response(from_modeld(exc, incident_id()), style, status)
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
            return error_response(error, style, status)

    return run
