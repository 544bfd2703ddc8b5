"""The OpenAI routes: models, chat completions, completions (each also without ``/v1``)."""

from __future__ import annotations

from dataclasses import asdict
from typing import Any

from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from modeld.contract import ModelInfo
from modeld.server.http.app import HttpService, guarded
from modeld.server.http.chat_template import template_meta
from modeld.server.http.models import ModelEntry
from modeld.server.http.openai_answers import (
    chat_choices,
    chat_complete,
    chat_stream,
    completion_choices,
    completion_complete,
    completion_stream,
    models_response,
)
from modeld.server.http.openai_chat import openai_error, parse_chat, parse_completion

__all__ = ["model_meta", "routes"]


def model_meta(info: ModelInfo | None) -> dict[str, Any]:
    """What clients read about a model beside its name: the context window under the names
    Codex (``context_window``), LiteLLM and vLLM clients (``max_model_len``) and llama-server
    clients (``meta.n_ctx_train``) look for; ``modeld.footprint`` its memory (weights, KV per
    token, the configured layout's KV and compute, the total, the largest window that fits);
    ``modeld.chat_template`` the template it renders with (:func:`template_meta`)."""
    if info is None:
        return {}
    return {
        "context_length": info.effective_context,
        "context_window": info.effective_context,
        "max_model_len": info.effective_context,
        "max_input_tokens": info.effective_context,
        "meta": {
            "n_ctx_train": info.model_max_context,
            "n_ctx": info.effective_context,
            "n_vocab": info.vocab_size,
            "size": info.weights_bytes,
        },
        # What it takes in memory here, known before it loads (``modeld describe``'s figures).
        "modeld": {"footprint": asdict(info.footprint), "chat_template": template_meta(info)},
    }


def routes(service: HttpService) -> list[Route]:
    async def models(_request: Request) -> Response:
        entries: list[ModelEntry] = service.registry.entries()
        listed = [(e.name, e.created, model_meta(await service.describe(e))) for e in entries]
        return JSONResponse(models_response(listed))

    async def model(request: Request) -> Response:
        entry = service.entry(request.path_params["name"])
        meta = model_meta(await service.describe(entry))
        return JSONResponse(
            {"id": entry.name, "object": "model", "created": entry.created, "owned_by": "modeld", **meta}
        )

    async def chat(request: Request) -> Response:
        async with service.body(request) as body:
            turn, include_usage = parse_chat(body, request.headers, service.gateway.limits)
            if turn.n > 1:
                return await service.choices(turn, chat_choices, openai_error)
            return await service.turn(
                request,
                turn,
                chat_complete,
                lambda t, s, e: chat_stream(t, s, e, include_usage),
                openai_error,
            )

    async def completions(request: Request) -> Response:
        async with service.body(request) as body:
            turn, include_usage = parse_completion(body, request.headers, service.gateway.limits)
            if turn.n > 1:
                return await service.choices(turn, completion_choices, openai_error)
            return await service.turn(
                request,
                turn,
                completion_complete,
                lambda t, s, e: completion_stream(t, s, e, include_usage),
                openai_error,
            )

    out: list[Route] = []
    for prefix in ("/v1", ""):
        out += [
            Route(f"{prefix}/models", guarded(service, models, openai_error), methods=["GET"]),
            Route(f"{prefix}/models/{{name:path}}", guarded(service, model, openai_error), methods=["GET"]),
            Route(f"{prefix}/chat/completions", guarded(service, chat, openai_error), methods=["POST"]),
            Route(f"{prefix}/completions", guarded(service, completions, openai_error), methods=["POST"]),
        ]
    return out
