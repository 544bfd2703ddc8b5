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
from modeld.server.http.openai.answer import OPENAI, models_response
from modeld.server.http.openai.request import parse_chat, parse_completion

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
        listed = [(e.name, e.created, model_meta(await service.catalog.describe(e))) for e in entries]
        by_name = {e.name: e for e in entries}
        for pattern, target in service.registry.aliases:  # an agent's default names, served by target
            if pattern not in by_name and (entry := by_name.get(target)) is not None:
                meta = model_meta(await service.catalog.describe(entry))
                alias = {**meta, "modeld": {**meta.get("modeld", {}), "alias_of": target}}
                listed.append((pattern, entry.created, alias))
        return JSONResponse(models_response(listed))

    async def model(request: Request) -> Response:
        name = request.path_params["name"]
        entry = service.catalog.entry(name)  # an alias's name (--alias) answers as itself
        meta = model_meta(await service.catalog.describe(entry))
        return JSONResponse(
            {"id": name, "object": "model", "created": entry.created, "owned_by": "modeld", **meta}
        )

    async def chat(request: Request) -> Response:
        async with service.bodies.read(request) as body:
            asked = parse_chat(body, request.headers, service.limits)
            return await service.runner.answer(request, OPENAI, asked)

    async def completions(request: Request) -> Response:
        async with service.bodies.read(request) as body:
            asked = parse_completion(body, request.headers, service.limits)
            return await service.runner.answer(request, OPENAI, asked)

    table = [("/models", models, "GET"), ("/models/{name:path}", model, "GET")]
    table += [("/chat/completions", chat, "POST"), ("/completions", completions, "POST")]
    # Each also without /v1, as llama-server accepts them.
    return [
        Route(f"{prefix}{path}", guarded(service, handler, OPENAI.error), methods=[method])
        for prefix in ("/v1", "")
        for path, handler, method in table
    ]
