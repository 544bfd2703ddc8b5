"""The models the HTTP APIs serve, as a request meets them: a name to its file (the registry,
``models.py``), what the model can do here (described once per file version, within the describe
timeout), and the session a turn opens on it (the window, KV precision and flash attention of
HTTP sessions: ``modeld serve --num-ctx``, ``--kv-cache-type``, ``--flash-attn``).
"""

from __future__ import annotations

import logging
from dataclasses import replace

from modeld.contract import Config, ModelInfo, OpenSessionRequest
from modeld.errors import ModeldError, ModelLoadError, echo
from modeld.server.bridge import Bridge
from modeld.server.gateway import Gateway
from modeld.server.http.errors import HttpError
from modeld.server.http.models import ModelEntry, ModelRegistry
from modeld.server.http.turn import Turn
from modeld.settings import HttpSettings

__all__ = ["Catalog"]

log = logging.getLogger("modeld.http")

MAX_DESCRIBED = 256
"""Model file versions whose description is kept (more: the cache starts again)."""


class Catalog:
    """Names to models, what each can do here, and how a turn opens a session on one."""

    def __init__(
        self,
        gateway: Gateway,
        registry: ModelRegistry,
        bridge: Bridge,
        settings: HttpSettings,
        describe_seconds: float,
    ) -> None:
        self.gateway = gateway
        self.registry = registry
        self.bridge = bridge
        self.settings = settings
        self.describe_seconds = describe_seconds
        self._infos: dict[tuple[str, float, str], ModelInfo] = {}

    @property
    def backend(self) -> str:
        return self.registry.backend

    def entry(self, name: str) -> ModelEntry:
        """The model registered as ``name``, else a 404 (``model_not_found``)."""
        entry = self.registry.get(name)
        if entry is None:
            raise HttpError(
                404,
                f"the model {echo(name)} does not exist (GET /v1/models lists them)",
                code="model_not_found",
                param="model",
            )
        return entry

    def _config(self, num_ctx: int = 0) -> Config:
        return Config(
            num_ctx=num_ctx or self.settings.num_ctx or self.gateway.limits.max_context_tokens,
            kv_cache_type=self.settings.kv_cache_type,
            flash_attn=self.settings.flash_attn,
        )

    def open_request(
        self, entry: ModelEntry, turn: Turn, keep_alive: float | None = None
    ) -> OpenSessionRequest:
        """The session ``turn`` runs on (its own window when it asks for one: Ollama's ``num_ctx``)."""
        return OpenSessionRequest(
            model_name=entry.name,
            type=self.backend,
            path=entry.path,
            config=replace(self._config(turn.num_ctx), prompt_format="chat" if turn.chat else "raw"),
            keep_alive_seconds=max(keep_alive or 0.0, 0.0),
            chat_template=entry.chat_template,
        )

    async def describe(self, entry: ModelEntry) -> ModelInfo | None:
        """What the model can do here (cached per file version); None if it cannot be read."""
        key = (entry.path, float(entry.created), entry.chat_template)
        info = self._infos.get(key)
        if info is not None:
            return info
        request = OpenSessionRequest(
            model_name=entry.name,
            type=self.backend,
            path=entry.path,
            config=self._config(),
            chat_template=entry.chat_template,
        )
        seconds = self.describe_seconds

        def late() -> ModeldError:
            return ModelLoadError(f"describing took longer than {seconds:g}s", path=entry.name)

        try:
            info = await self.bridge.probe(self.gateway.describe, request, timeout=seconds, late=late)
        except ModeldError as exc:
            log.info("describing %s: %s", entry.name, exc)
            return None
        if len(self._infos) > MAX_DESCRIBED:
            self._infos.clear()
        self._infos[key] = info
        return info
