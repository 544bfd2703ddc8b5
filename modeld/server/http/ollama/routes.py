"""Ollama's routes: ``GET /`` and ``HEAD /`` ("Ollama is running", clients' health probe), ``GET /api/version``, ``GET /api/tags``, ``POST /api/show``, ``GET
/api/ps``, ``POST /api/chat``, ``POST /api/generate`` (the fields: ``request.py``)."""

from __future__ import annotations

import time
from dataclasses import asdict

from starlette.background import BackgroundTask
from starlette.requests import Request
from starlette.responses import JSONResponse, PlainTextResponse, Response
from starlette.routing import Route

from modeld.errors import echo
from modeld.server.http.app import HttpService, guarded
from modeld.server.http.chat_template import template_meta
from modeld.server.http.errors import HttpError, bad
from modeld.server.http.ollama.answer import OLLAMA, OLLAMA_API_VERSION, details, digest, modified, now
from modeld.server.http.ollama.request import OllamaAsked, parse_chat, parse_generate

__all__ = ["routes"]


def routes(service: HttpService) -> list[Route]:
    async def version(_request: Request) -> Response:
        return JSONResponse({"version": OLLAMA_API_VERSION})

    async def tags(_request: Request) -> Response:
        models = []
        for entry in service.registry.entries():
            info = await service.catalog.describe(entry)
            models.append(
                {
                    "name": entry.name,
                    "model": entry.name,
                    "modified_at": modified(entry),
                    "size": info.weights_bytes if info is not None else 0,
                    "digest": digest(info),
                    "details": details(info),
                }
            )
        return JSONResponse({"models": models})

    async def show(request: Request) -> Response:
        async with service.bodies.read(request) as body:
            name = body.get("model") or body.get("name")
            if not isinstance(name, str) or not name:
                raise bad("model", "model is required")
            entry = service.catalog.entry(name.removesuffix(":latest"))
        info = await service.catalog.describe(entry)
        if info is None:
            raise HttpError(500, f"the model {echo(entry.name)} could not be read", code="model_load_failed")
        arch = info.architecture or info.backend
        capabilities = ["completion"]
        if info.tool_format:
            capabilities.append("tools")
        if info.reasoning_format:
            capabilities.append("thinking")
        return JSONResponse(
            {
                "modelfile": f"# served by modeld\nFROM {entry.name}\nPARAMETER num_ctx {info.effective_context}\n",
                "parameters": f"num_ctx {info.effective_context}",
                "template": info.chat_template,
                "details": details(info),
                "model_info": {
                    "general.architecture": arch,
                    "general.name": info.model_name,
                    f"{arch}.context_length": info.effective_context,
                    "modeld.trained_context_length": info.model_max_context,
                    # What it takes in memory here (``modeld describe``): weights, KV per
                    # token, the layout's KV and compute, the total, the largest window.
                    **{f"modeld.{k}": v for k, v in asdict(info.footprint).items()},
                    # Which chat template it renders with (GET /v1/models says the same).
                    **{f"modeld.chat_template.{k}": v for k, v in template_meta(info).items()},
                },
                "capabilities": capabilities,
                "modified_at": modified(entry),
            }
        )

    async def ps(_request: Request) -> Response:
        status = await service.bridge.observe(service.gateway.status, "ps")
        entries = {e.path: e for e in service.registry.entries()}
        models = []
        for m in status.models:
            entry = entries.get(m.path)
            name = entry.name if entry is not None else m.model_name
            info = await service.catalog.describe(entry) if entry is not None else None
            mem = m.memory
            # Ollama's size: the model in memory. The weights (the file, as describe reads it;
            # the pages measured resident when it cannot), the KV the engine allocated (a ring
            # of sliding-window cells is smaller: --no-swa-full), checkpoints and compute.
            weights = info.weights_bytes if info is not None else mem.weights_bytes
            parts = {
                "weights": weights,
                "kv_allocated": mem.kv_allocated_bytes,
                "kv_used": mem.kv_used_bytes,
                "checkpoints": mem.checkpoint_bytes,
                "compute": mem.compute_bytes,
            }
            models.append(
                {
                    "name": name,
                    "model": name,
                    "size": weights + mem.kv_allocated_bytes + mem.checkpoint_bytes + mem.compute_bytes,
                    "size_vram": 0,
                    "digest": m.model_digest,
                    "details": {"format": "gguf" if m.backend in ("llama", "openvino") else m.backend},
                    "expires_at": None,
                    "context_length": m.n_ctx,
                    "modeld": {
                        "backend": m.backend,
                        "sessions": m.sessions,
                        "memory_bytes": parts,
                        "contexts": [
                            {
                                "id": c.id,
                                "tier": c.tier,
                                "tokens": c.tokens,
                                "bytes": c.bytes,
                                "checkpoint_bytes": c.checkpoint_bytes,
                                "pinned": c.pinned,
                            }
                            for c in m.contexts
                        ],
                    },
                }
            )
        return JSONResponse({"models": models})

    def unloading(response: Response, asked: OllamaAsked) -> Response:
        """``keep_alive: 0``: the model is unloaded once the answer has been sent."""
        if asked.unload:
            response.background = BackgroundTask(service.runner.unload, asked.turn.model)
        return response

    async def root(_request: Request) -> Response:
        return PlainTextResponse("Ollama is running")  # the health probe Ollama clients use

    async def chat(request: Request) -> Response:
        began = time.monotonic()
        async with service.bodies.read(request) as body:
            asked = parse_chat(body, request.headers, service.limits, began)
            return unloading(await service.runner.answer(request, OLLAMA, asked), asked)

    async def generate(request: Request) -> Response:
        began = time.monotonic()
        async with service.bodies.read(request) as body:
            asked = parse_generate(body, request.headers, service.limits, began)
            if not body.get("prompt") and asked.unload:  # Ollama's "unload this model now"
                await service.runner.unload(asked.turn.model)
                return JSONResponse(
                    {
                        "model": asked.turn.model,
                        "created_at": now(),
                        "response": "",
                        "done": True,
                        "done_reason": "unload",
                    }
                )
            if not body.get("prompt"):  # an empty prompt only loads the model (Ollama's preload)
                await service.runner.load(asked.turn)
                return JSONResponse(
                    {
                        "model": asked.turn.model,
                        "created_at": now(),
                        "response": "",
                        "done": True,
                        "done_reason": "load",
                    }
                )
            return unloading(await service.runner.answer(request, OLLAMA, asked), asked)

    return [
        Route("/", guarded(service, root, OLLAMA.error), methods=["GET", "HEAD"]),
        Route("/api/version", guarded(service, version, OLLAMA.error), methods=["GET", "HEAD"]),
        Route("/api/tags", guarded(service, tags, OLLAMA.error), methods=["GET", "HEAD"]),
        Route("/api/show", guarded(service, show, OLLAMA.error), methods=["POST"]),
        Route("/api/ps", guarded(service, ps, OLLAMA.error), methods=["GET"]),
        Route("/api/chat", guarded(service, chat, OLLAMA.error), methods=["POST"]),
        Route("/api/generate", guarded(service, generate, OLLAMA.error), methods=["POST"]),
    ]
