"""gRPC health checking: the daemon as a whole, and each loaded model by name.

The standard ``grpc.health.v1.Health`` service (grpcio-health-checking's asyncio servicer)
answers for:

* ``""`` and ``modeld.v1.Modeld``: SERVING while the daemon serves, NOT_SERVING once it stops;
* ``model:<name>`` for every model a worker has loaded, ``<name>`` being the model's name as
  ``modeld status`` shows it (the session's ``model_name``, the HTTP endpoint's model name, or
  the GGUF's ``general.name``). SERVING while its worker is ready (or busy); NOT_SERVING while it
  is loading, restarting or failed; SERVICE_UNKNOWN once the model is unloaded (it loads again
  on demand). A model never loaded is NOT_FOUND to ``Check`` (SERVICE_UNKNOWN to ``Watch``).

It is driven by the engine's events (:meth:`ModelHealth.model_state`, an engine observer), not
by polling: a ``Watch`` sees a worker's death and its restart as they happen. Several loaded
models with the same name (one file under two runtime configs) share one service name; the
last state change reported wins.

What not: per-session health, or anything a client could use to learn paths (names only).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Coroutine, Iterable
from typing import Any

from grpc_health.v1 import health, health_pb2

__all__ = ["MODEL_PREFIX", "ModelHealth", "health_service_name", "serving_status"]

log = logging.getLogger("modeld.server")

MODEL_PREFIX = "model:"
_Status = health_pb2.HealthCheckResponse
_SERVING_STATES = frozenset({"ready", "busy"})


def health_service_name(model_name: str) -> str:
    """The health service name of a loaded model."""
    return MODEL_PREFIX + model_name


def serving_status(state: str) -> int:
    """The health status for a worker state (``WorkerInfo.state``)."""
    if state in _SERVING_STATES:
        return int(_Status.SERVING)
    if state == "stopped":
        return int(_Status.SERVICE_UNKNOWN)
    return int(_Status.NOT_SERVING)


class ModelHealth:
    """The health servicer and what feeds it: daemon-wide states and engine events.

    Thread-safe: events arrive on engine threads and are handed to the server's event loop.
    Implements the engine observer protocol (``queue_waited`` and ``worker_restarted`` are
    metrics' business and ignored here)."""

    def __init__(self) -> None:
        self.servicer = health.aio.HealthServicer()
        self._loop: asyncio.AbstractEventLoop | None = None

    def bind(self, loop: asyncio.AbstractEventLoop) -> None:
        """The event loop the server (and so the servicer) runs on."""
        self._loop = loop

    def _submit(self, coroutine: Coroutine[Any, Any, None]) -> None:
        loop = self._loop
        if loop is None or loop.is_closed():
            coroutine.close()
            return
        with contextlib.suppress(RuntimeError):  # the loop closed in between
            asyncio.run_coroutine_threadsafe(coroutine, loop)
            return
        coroutine.close()

    def serving(self, services: Iterable[str]) -> None:
        for name in services:
            self._submit(self.servicer.set(name, _Status.SERVING))

    def shutting_down(self) -> None:
        """Every service NOT_SERVING from now on (later events are ignored)."""
        self._submit(self.servicer.enter_graceful_shutdown())

    # --- engine observer ------------------------------------------------------------------

    def model_state(self, model_name: str, state: str) -> None:
        log.debug("health: model %r is %s", model_name[:64], state)
        self._submit(self.servicer.set(health_service_name(model_name), serving_status(state)))

    def queue_waited(self, seconds: float) -> None:
        del seconds

    def worker_restarted(self) -> None:
        return None
