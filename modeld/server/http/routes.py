"""The Starlette application: every HTTP API's routes on one port (what they share: ``app.py``).

OpenAI (``openai_routes.py``, ``responses.py``), Anthropic (``anthropic.py``), Ollama
(``ollama.py``), the SGLang gateway's worker routes (``gateway_routes.py``), ``GET /health``
(never needs a key) and ``GET /metrics``. Any route's failure, and a route or method that does not
exist, is answered in the error shape of the API its path belongs to.
"""

from __future__ import annotations

import logging

from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import BaseRoute, Route

from modeld.server.http.anthropic import request as anthropic
from modeld.server.http.anthropic.answer import anthropic_error
from modeld.server.http.app import HttpService, error_response, guarded
from modeld.server.http.errors import ErrorStyle, HttpError, incident_id
from modeld.server.http.ollama import request as ollama
from modeld.server.http.openai import routes as openai_routes
from modeld.server.http.openai.request import openai_error
from modeld.server.http.responses import request as responses
from modeld.server.http.sglang import routes as gateway_routes

__all__ = ["build_app"]

app_log = logging.getLogger("modeld.http")


def build_app(service: HttpService) -> Starlette:
    routes: list[BaseRoute] = []
    routes += openai_routes.routes(service)
    routes += responses.routes(service)
    routes += anthropic.routes(service)
    routes += ollama.routes(service)
    routes += gateway_routes.routes(service)
    routes += [
        Route("/health", service.health, methods=["GET", "HEAD"]),
        Route("/metrics", guarded(service, service.metrics, openai_error), methods=["GET"]),
    ]

    def style_of(path: str) -> ErrorStyle:
        if path.startswith("/v1/messages"):
            return anthropic_error
        if path.startswith("/api/"):
            return ollama.ollama_error
        return openai_error

    async def not_found(request: Request, _exc: Exception) -> Response:
        return error_response(HttpError(404, "no such route", code="not_found"), style_of(request.url.path))

    async def not_allowed(request: Request, _exc: Exception) -> Response:
        return error_response(
            HttpError(405, "method not allowed", code="method_not_allowed"), style_of(request.url.path)
        )

    async def crashed(request: Request, exc: Exception) -> Response:
        incident = incident_id()
        app_log.error("internal error serving %s (incident %s)", request.url.path, incident, exc_info=exc)
        error = HttpError(500, f"internal error (incident {incident}; see the daemon's log)", code="internal")
        return error_response(error, style_of(request.url.path))

    return Starlette(routes=routes, exception_handlers={404: not_found, 405: not_allowed, Exception: crashed})
