"""The worker routes the SGLang model gateway (``smg``, sglang-router, vllm-router) reads, so
several modeld daemons run behind it as first-class workers (``blueprints/0019-agent-apis.md``,
the README's deployment guide).

* ``GET /server_info`` and ``GET /model_info`` (and their ``/get_`` aliases) in SGLang's shape:
  the gateway registers a worker from them (a worker without them is registered as model
  ``unknown``). ``model_path`` is the served name: the HTTP endpoint never shows file paths.
* ``GET /get_load``: SGLang's load report, one entry (modeld has one scheduler per daemon):
  ``num_reqs`` operations running on the engine's slots, ``num_waiting_reqs`` waiting for one,
  ``num_tokens`` KV cells in use, with modeld's own ``kv_capacity_tokens``, ``busy_slots``,
  ``slots`` and ``draining``. It counts what the daemon runs, whoever sent it, where the
  gateway's own load counts only what it forwarded.
* ``/health`` (in :mod:`modeld.server.http.app`) is 503 while the daemon is loading its first
  model, draining or stopping, so the gateway stops sending before a restart.
"""

from __future__ import annotations

from typing import Any

from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from modeld import __version__
from modeld.contract import DaemonStatus
from modeld.server.http.app import HttpService, guarded
from modeld.server.http.openai_chat import openai_error

__all__ = ["load_report", "routes"]


def load_report(status: DaemonStatus, draining: bool) -> list[dict[str, Any]]:
    """SGLang's ``/get_load`` list from the daemon's status (one scheduler: one entry)."""
    models = status.models
    return [
        {
            "dp_rank": 0,
            "num_reqs": sum(m.busy_slots for m in models),
            "num_waiting_reqs": sum(m.queued for m in models),
            "num_tokens": sum(m.resident_tokens for m in models),
            "num_pending_tokens": 0,
            "kv_capacity_tokens": sum(m.pool_tokens for m in models),
            "busy_slots": sum(m.busy_slots for m in models),
            "slots": sum(m.slots for m in models),
            "sessions": status.sessions,
            "draining": draining,
        }
    ]


def routes(service: HttpService) -> list[Route]:
    async def served() -> tuple[str, dict[str, Any]]:
        entries = service.registry.entries()
        name = entries[0].name if entries else ""
        info = await service.describe(entries[0]) if entries else None
        return name, {
            "context_length": info.effective_context if info else 0,
            "architecture": info.architecture if info else "",
            "models": [e.name for e in entries],
        }

    async def server_info(_request: Request) -> Response:
        name, meta = await served()
        status = await service.bridge.observe(service.gateway.status, "server_info")
        loaded = [m for m in status.models]
        slots = sum(m.slots for m in loaded) or int(status.settings.get("sequences", "1") or 1)
        pool = sum(m.pool_tokens for m in loaded) or meta["context_length"]
        return JSONResponse(
            {
                "model_path": name,
                "served_model_name": name,
                "tokenizer_path": name,
                "max_total_tokens": pool,
                "max_running_requests": slots,
                "context_length": meta["context_length"],
                "version": __version__,
                "modeld": {
                    "models": meta["models"],
                    "backend": service.settings.backend,
                    "instance_id": status.instance_id,
                },
            }
        )

    async def model_info(_request: Request) -> Response:
        name, meta = await served()
        return JSONResponse(
            {
                "model_path": name,
                "tokenizer_path": name,
                "is_generation": True,
                "model_type": meta["architecture"],
                "architectures": [meta["architecture"]] if meta["architecture"] else [],
                "context_length": meta["context_length"],
            }
        )

    async def get_load(_request: Request) -> Response:
        status = await service.bridge.observe(service.gateway.status, "get_load")
        return JSONResponse(load_report(status, service.draining))

    out: list[Route] = []
    for path, handler in (("server_info", server_info), ("model_info", model_info)):
        for prefix in ("/", "/get_"):
            out.append(Route(f"{prefix}{path}", guarded(service, handler, openai_error), methods=["GET"]))
    out.append(Route("/get_load", guarded(service, get_load, openai_error), methods=["GET"]))
    return out
