"""The worker routes the SGLang model gateway (``smg``, sglang-router, vllm-router) reads, so
several modeld daemons run behind it as first-class workers (``blueprints/0019-agent-apis.md``,
the README's deployment guide).

* ``GET /server_info`` and ``GET /model_info`` (and their ``/get_`` aliases) in SGLang's shape:
  the gateway registers a worker from them (a worker without them is registered as model
  ``unknown``). ``model_path`` is the served name: the HTTP endpoint never shows file paths.
* The load, from the engine's real slots, queue and KV pool, whoever sent the work (the
  gateway's own count sees only what it forwarded), in two shapes:

  - ``GET /v1/loads``: what ``smg`` polls (every ``--load-monitor-interval`` seconds, 10 by
    default) and feeds to its load-aware placement and its worker overload protection, in its
    ``WorkerLoadResponse`` shape: one rank, ``num_running_reqs`` operations on the slots,
    ``num_waiting_reqs`` waiting for one, ``num_used_tokens`` KV cells held by running
    operations of ``max_total_num_tokens``, ``token_usage`` their ratio, ``utilization`` busy
    slots of ``max_running_requests``, ``cache_hit_rate`` prompt tokens reused of those looked
    up since the model loaded.
  - ``GET /get_load``: SGLang's own list: ``num_reqs`` (running and waiting),
    ``num_waiting_reqs``, ``num_tokens`` (KV cells held by running operations), with modeld's
    ``resident_tokens``, ``kv_capacity_tokens``, ``busy_slots``, ``slots`` and ``draining``.

  Idle warm contexts are not load: they are a cache that gives way (to the RAM and disk tiers)
  when a turn needs the cells, as SGLang leaves its evictable radix cache out of its own. A
  pool full of warm conversations must not look overloaded to the gateway.
* ``/health`` (in :mod:`modeld.server.http.app`) is 503 while the daemon is loading its first
  model, draining or stopping, so the gateway stops sending before a restart.
"""

from __future__ import annotations

import time
from typing import Any

from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from modeld import __version__
from modeld.server.http.app import HttpService, guarded
from modeld.server.http.errors import openai_error
from modeld.server.http.sglang.answer import load_report, worker_loads

__all__ = ["routes"]


def routes(service: HttpService) -> list[Route]:
    async def served() -> tuple[str, dict[str, Any]]:
        entries = service.registry.entries()
        name = entries[0].name if entries else ""
        info = await service.catalog.describe(entries[0]) if entries else None
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
                    "backend": service.catalog.backend,
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
        return JSONResponse(load_report(status, service.drain.draining))

    async def loads(_request: Request) -> Response:
        # smg asks for ?include=core,disagg,queues,memory: the core is all there is here.
        status = await service.bridge.observe(service.gateway.status, "loads")
        return JSONResponse(worker_loads(status, time.time()))

    out: list[Route] = []
    for path, handler in (("server_info", server_info), ("model_info", model_info)):
        for prefix in ("/", "/get_"):
            out.append(Route(f"{prefix}{path}", guarded(service, handler, openai_error), methods=["GET"]))
    out.append(Route("/get_load", guarded(service, get_load, openai_error), methods=["GET"]))
    out.append(Route("/v1/loads", guarded(service, loads, openai_error), methods=["GET"]))
    return out
