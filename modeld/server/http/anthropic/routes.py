"""The Messages API's routes: ``POST /v1/messages`` (a turn) and ``POST
/v1/messages/count_tokens`` (the prompt's tokens, nothing computed)."""

from __future__ import annotations

from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from modeld.server.http.anthropic.answer import ANTHROPIC
from modeld.server.http.anthropic.request import count_tokens_body, parse_messages
from modeld.server.http.app import HttpService, guarded

__all__ = ["routes"]


def routes(service: HttpService) -> list[Route]:
    async def messages(request: Request) -> Response:
        async with service.bodies.read(request) as body:
            asked = parse_messages(body, request.headers, service.limits)
            return await service.runner.answer(request, ANTHROPIC, asked)

    async def count_tokens(request: Request) -> Response:
        async with service.bodies.read(request) as body:
            asked = parse_messages(count_tokens_body(body), request.headers, service.limits, count_only=True)
            count = await service.runner.count_tokens(asked.turn)
        return JSONResponse({"input_tokens": count})

    return [
        Route(
            "/v1/messages", guarded(service, messages, ANTHROPIC.error, ANTHROPIC.status), methods=["POST"]
        ),
        Route(
            "/v1/messages/count_tokens",
            guarded(service, count_tokens, ANTHROPIC.error, ANTHROPIC.status),
            methods=["POST"],
        ),
    ]
