"""The Responses API's routes: ``POST /v1/responses`` (a turn, stored unless ``store`` is false),
``GET`` and ``DELETE /v1/responses/{id}`` (a stored response), each also without ``/v1``."""

from __future__ import annotations

from typing import Any

from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from modeld.errors import echo
from modeld.server.http.app import HttpService, guarded
from modeld.server.http.conversations import Collected
from modeld.server.http.errors import HttpError
from modeld.server.http.fields import string
from modeld.server.http.responses.answer import RESPONSES, ResponsesAsked, ResponseShape, history_message
from modeld.server.http.responses.request import parse_response_request
from modeld.server.http.responses.store import ResponseStore, Stored

__all__ = ["routes"]


def routes(service: HttpService) -> list[Route]:
    directory = service.data_dir
    store = ResponseStore(directory / "responses") if directory is not None else None

    def stored(response_id: str) -> Stored:
        found = store.get(response_id) if store is not None else None
        if found is None:
            raise HttpError(404, f"no stored response {echo(response_id)}", code="not_found")
        return found

    def previous_of(response_id: str) -> Stored:
        """The response a request continues: unknown is OpenAI's 400 ``previous_response_not_found``."""
        found = store.get(response_id) if store is not None else None
        if found is None:
            raise HttpError(
                400,
                f"Previous response with id {echo(response_id)} not found.",
                code="previous_response_not_found",
                param="previous_response_id",
            )
        return found

    async def create(request: Request) -> Response:
        async with service.bodies.read(request) as body:
            previous_id = string(body, "previous_response_id")
            previous = previous_of(previous_id) if previous_id else None
            turn, keep_it, new = parse_response_request(body, request.headers, previous, service.limits)
            shape = ResponseShape(turn, body, previous_id, keep_it and store is not None)

            def keep(done: Collected, response: dict[str, Any]) -> None:
                if shape.store and store is not None and done.finished.error is None:
                    history = (*(previous.history if previous else ()), *new, history_message(done))
                    store.put(Stored(shape.id, response, history, turn.conversation(), shape.created_at))

            asked = ResponsesAsked(turn, shape=shape, keep=keep)
            return await service.runner.answer(request, RESPONSES, asked)

    async def fetch(request: Request) -> Response:
        return JSONResponse(stored(request.path_params["id"]).response)

    async def delete(request: Request) -> Response:
        response_id = request.path_params["id"]
        if store is None or not store.delete(response_id):
            raise HttpError(404, f"no stored response {echo(response_id)}", code="not_found")
        return JSONResponse({"id": response_id, "object": "response.deleted", "deleted": True})

    table = [
        ("/responses", create, "POST"),
        ("/responses/{id}", fetch, "GET"),
        ("/responses/{id}", delete, "DELETE"),
    ]
    return [
        Route(f"{prefix}{path}", guarded(service, handler, RESPONSES.error), methods=[method])
        for prefix in ("/v1", "")
        for path, handler, method in table
    ]
