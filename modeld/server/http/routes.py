"""The Starlette application: every HTTP API's routes on one port (what they share: ``app.py``).

Each API is a folder with the same files (``request.py``: its wire format to the one turn;
``answer.py``: the turn's events to its wire format, and its :class:`~modeld.server.http.dialect.Dialect`;
``routes.py``; a store where the API has one): OpenAI chat completions and completions
(``openai/``), the Responses API (``responses/``), Anthropic's Messages API (``anthropic/``),
Ollama's API (``ollama/``), and the SGLang gateway's worker routes (``sglang/``: GET routes
only, no request to parse). This module is the only one that imports them all: an API imports
the shared layer only, never another API (``tests/house/test_house.py``), so a new API is a new folder
and one line in :data:`APIS`.

``GET /health`` (never needs a key) and ``GET /metrics`` are here. A failure outside any route
(a route or method that does not exist, an unexpected exception) is answered in the words of
the dialect that owns the path (:attr:`Dialect.paths`), else OpenAI's.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from typing import Any

from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import BaseRoute, Route

from modeld.server.http.anthropic import routes as anthropic
from modeld.server.http.anthropic.answer import ANTHROPIC
from modeld.server.http.app import HttpService, guarded
from modeld.server.http.dialect import Dialect
from modeld.server.http.errors import ErrorStyle, HttpError, incident_id, openai_error
from modeld.server.http.ollama import routes as ollama
from modeld.server.http.ollama.answer import OLLAMA
from modeld.server.http.openai import routes as openai
from modeld.server.http.openai.answer import OPENAI
from modeld.server.http.responses import routes as responses
from modeld.server.http.responses.answer import RESPONSES
from modeld.server.http.runner import error_response
from modeld.server.http.sglang import routes as sglang
from modeld.server.http.ui import routes as ui

__all__ = ["APIS", "DIALECTS", "build_app"]

app_log = logging.getLogger("modeld.http")

APIS: tuple[Callable[[HttpService], Sequence[BaseRoute]], ...] = (
    openai.routes,
    responses.routes,
    anthropic.routes,
    ollama.routes,
    sglang.routes,
    ui.routes,
)
"""Every API's routes, in the order they are matched."""

DIALECTS: tuple[Dialect[Any], ...] = (OPENAI, RESPONSES, ANTHROPIC, OLLAMA)
"""Every dialect; the one whose :attr:`~Dialect.paths` holds a path words its failures."""


def style_of(path: str) -> ErrorStyle:
    """The error words of the dialect that owns ``path`` (OpenAI's by default)."""
    owners = [(len(p), d.error) for d in DIALECTS for p in d.paths if path.startswith(p)]
    return max(owners, key=lambda owner: owner[0])[1] if owners else openai_error


def build_app(service: HttpService) -> Starlette:
    routes: list[BaseRoute] = [route for api in APIS for route in api(service)]
    routes += [
        Route("/health", service.health, methods=["GET", "HEAD"]),
        Route("/metrics", guarded(service, service.metrics, openai_error), methods=["GET"]),
    ]

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
