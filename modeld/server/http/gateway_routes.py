"""(being written)"""

from __future__ import annotations

from typing import Any

from starlette.routing import Route

from modeld.server.http.errors import HttpError


def routes(service: Any) -> list[Route]:
    return []


def anthropic_error(error: HttpError) -> dict[str, Any]:
    return {"type": "error", "error": {"type": "api_error", "message": error.message}}


def ollama_error(error: HttpError) -> dict[str, Any]:
    return {"error": error.message}
