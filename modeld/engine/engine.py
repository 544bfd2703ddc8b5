"""The Service: describes models, opens sessions, keeps models and their KV warm.

:class:`Engine` implements :class:`~modeld.contract.Service` over any backend. It owns the
session registry, owner fencing, limits and the set of loaded models (see
``blueprints/0001-the-seam.md``); the per-session contract lives in ``engine/session.py``.
"""

from __future__ import annotations

import contextlib
import functools
import logging
import os
import threading
import time
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import replace
from pathlib import Path
from types import TracebackType

from modeld import __version__
from modeld.backends import Backend, load_backend
from modeld.contract import (
    ContextReport,
    DaemonStatus,
    ModelInfo,
    OpenSessionRequest,
    SessionSummary,
)
from modeld.engine.limits import Limits
from modeld.engine.model import EngineThread, LoadedModel
from modeld.engine.owner import Owner
from modeld.engine.session import EngineSession, config_runtime_digest
from modeld.engine.validate import encode_text, validate_request
from modeld.errors import (
    BackendMismatchError,
    InvalidArgumentError,
    LimitExceededError,
    ManifestMismatchError,
    ModeldError,
    SessionNotFoundError,
    ShuttingDownError,
    UnsupportedError,
)
from modeld.manifest import ContextManifest

__all__ = ["Engine"]

log = logging.getLogger("modeld.engine")


class Engine:
    """The Service: describes models, opens sessions, and keeps models and their KV warm."""

    def __init__(
        self,
        *,
        backends: Sequence[str] = ("memory",),
        default_backend: str | None = None,
        owner: Owner | None = None,
        limits: Limits | None = None,
        endpoint: str = "",
    ) -> None:
        if not backends:
            raise InvalidArgumentError("at least one backend is required", field="backends")
        self.backend_names = tuple(backends)
        self.default_backend = default_backend or self.backend_names[0]
        self.owner = owner or Owner()
        self.limits = limits or Limits()
        self.endpoint = endpoint
        self.started_at = time.time()
        self._started_mono = time.monotonic()
        self._backends: dict[str, Backend] = {}
        self._lock = threading.RLock()
        self._load_lock = threading.Lock()
        self._models: dict[tuple[str, str, str, str], LoadedModel] = {}
        self._last_manifest: dict[tuple[str, str], ContextManifest] = {}
        self._sessions: dict[str, EngineSession] = {}
        self._closed: OrderedDict[str, ContextReport] = OrderedDict()
        self._stopping = False
        self.owner.on_revoke(self._on_revoke)

    # --- Service -------------------------------------------------------------------------

    def backend(self, name: str) -> Backend:
        with self._lock:
            if name not in self._backends:
                self._backends[name] = load_backend(name)
            return self._backends[name]

    def _resolve_type(self, request: OpenSessionRequest) -> str:
        kind = request.type or self.default_backend
        if kind not in self.backend_names:
            raise BackendMismatchError(
                f"the model is typed {kind!r} but this service runs {', '.join(self.backend_names)}",
                requested=kind,
                available=",".join(self.backend_names),
            )
        return kind

    def describe(self, request: OpenSessionRequest) -> ModelInfo:
        request = validate_request(request, self.limits)
        return self.backend(self._resolve_type(request)).describe(request)

    def open_session(self, request: OpenSessionRequest) -> EngineSession:
        request = validate_request(request, self.limits)
        if self._stopping:
            raise ShuttingDownError("the daemon is shutting down")
        epoch = self.owner.check_open(request.fence)
        kind = self._resolve_type(request)
        with self._lock:
            if len(self._sessions) >= self.limits.max_sessions:
                raise LimitExceededError(
                    f"{len(self._sessions)} sessions are open; the limit is {self.limits.max_sessions}",
                    limit="max_sessions",
                    value=len(self._sessions) + 1,
                    maximum=self.limits.max_sessions,
                )
        info = self.backend(kind).describe(request)
        config = request.config
        if config.prompt_format not in info.capabilities.prompt_formats:
            raise UnsupportedError(
                f"the {kind} backend does not support prompt_format {config.prompt_format!r} "
                f"(supported: {', '.join(info.capabilities.prompt_formats)})",
                field="config.prompt_format",
            )
        if (
            config.prompt_format == "chat"
            and config.prompt_template_digest
            and config.prompt_template_digest != info.template_digest
        ):
            raise ManifestMismatchError(
                "config.prompt_template_digest does not match the model's chat template",
                field="prompt_template_digest",
                expected=info.template_digest,
                got=config.prompt_template_digest,
            )
        config = replace(config, num_ctx=info.effective_context)
        model = self._model_for(kind, replace(request, config=config), info)
        session = EngineSession(self, model, request, info, config, epoch)
        with self._lock:
            if len(self._sessions) >= self.limits.max_sessions:
                model.sessions -= 1
                raise LimitExceededError(
                    f"{len(self._sessions)} sessions are open; the limit is {self.limits.max_sessions}",
                    limit="max_sessions",
                    value=len(self._sessions) + 1,
                    maximum=self.limits.max_sessions,
                )
            self._sessions[session.session_id] = session
        log.info("session %s opened on %s %s (epoch %d)", session.session_id, kind, info.path, epoch)
        return session

    def tokenize(self, request: OpenSessionRequest, text: str) -> list[int]:
        """The token ids of ``text`` under a model (no BOS), loading the model if needed.

        Opens no session and changes nothing resident: a tool budgets a repo map with it.
        """
        request = validate_request(request, self.limits)
        encode_text(text, "text", self.limits)
        if self._stopping:
            raise ShuttingDownError("the daemon is shutting down")
        kind = self._resolve_type(request)
        info = self.backend(kind).describe(request)
        config = replace(request.config, num_ctx=info.effective_context)
        model = self._model_for(kind, replace(request, config=config), info)
        try:
            return model.thread.run(functools.partial(model.runtime.tokenize, text, add_bos=False))
        finally:
            with self._lock:
                model.sessions -= 1

    def _model_for(self, kind: str, request: OpenSessionRequest, info: ModelInfo) -> LoadedModel:
        """The loaded model for (backend, path, digest, runtime config), loading it if needed.

        Each runtime config gets its own context, so tools with different windows or KV types
        each stay warm (with mmap'd weights a second context of a file costs only its KV);
        ``max_loaded_models`` bounds how many are kept.
        """
        key = (kind, info.path, info.model_digest, config_runtime_digest(request.config))
        with self._load_lock:
            with self._lock:
                model = self._models.get(key)
                if model is not None:
                    model.sessions += 1
                    return model
                self._evict_for_load()
            thread = EngineThread(Path(info.path).name[:12] or kind)
            try:
                runtime = thread.run(self.backend(kind).load, request, info)
            except BaseException:
                thread.shutdown()
                raise
            model = LoadedModel(key, runtime, info, thread)
            model.sessions = 1
            with self._lock:
                self._models[key] = model
            log.info("loaded %s model %s (%s)", kind, info.path, info.model_digest[:12])
            return model

    def _evict_for_load(self) -> None:
        while len(self._models) >= self.limits.max_loaded_models:
            idle = [m for m in self._models.values() if m.sessions == 0 and not m.lock.locked()]
            if not idle:
                raise LimitExceededError(
                    f"{len(self._models)} models are loaded and in use; the limit is "
                    f"{self.limits.max_loaded_models}",
                    limit="max_loaded_models",
                    value=len(self._models) + 1,
                    maximum=self.limits.max_loaded_models,
                )
            victim = min(idle, key=lambda m: m.last_used_at)
            del self._models[victim.key]
            victim.close()
            log.info("unloaded idle model %s to make room", victim.info.path)

    # --- registry and observers ----------------------------------------------------------

    def session(self, session_id: str) -> EngineSession:
        with self._lock:
            session = self._sessions.get(session_id)
        if session is None:
            raise SessionNotFoundError(session_id)
        return session

    def sessions(self) -> list[EngineSession]:
        with self._lock:
            return list(self._sessions.values())

    def list_sessions(self) -> list[SessionSummary]:
        return [s.summary() for s in self.sessions()]

    def explain(self, session_id: str) -> ContextReport:
        with self._lock:
            session = self._sessions.get(session_id)
            closed = self._closed.get(session_id)
        if session is not None:
            return session.explain_context()
        if closed is not None:
            return closed
        raise SessionNotFoundError(session_id)

    def status(self) -> DaemonStatus:
        with self._lock:
            models = tuple(m.summary() for m in self._models.values())
            sessions = len(self._sessions)
        return DaemonStatus(
            instance_id=self.owner.instance_id,
            epoch=self.owner.epoch,
            pid=os.getpid(),
            endpoint=self.endpoint,
            version=__version__,
            started_at=self.started_at,
            uptime_seconds=time.monotonic() - self._started_mono,
            backends=self.backend_names,
            default_backend=self.default_backend,
            models=models,
            sessions=sessions,
            limits=self.limits.as_dict(),
            owner_lost=self.owner.lost or "",
        )

    def _forget(self, session: EngineSession, report: ContextReport) -> None:
        with self._lock:
            if self._sessions.pop(session.session_id, None) is None:
                return
            session.model.sessions -= 1
            self._closed[session.session_id] = report
            while len(self._closed) > self.limits.closed_reports_kept:
                self._closed.popitem(last=False)

    def _remember(self, model: LoadedModel, manifest: ContextManifest) -> None:
        self._last_manifest[(model.key[0], model.key[1])] = manifest

    def _last_manifest_for(self, model: LoadedModel) -> ContextManifest | None:
        return self._last_manifest.get((model.key[0], model.key[1]))

    @property
    def stopping(self) -> bool:
        return self._stopping

    def _on_revoke(self, why: str) -> None:
        log.warning("ownership lost: %s; failing %d sessions", why, len(self._sessions))
        for session in self.sessions():
            session.interrupt()

    def begin_shutdown(self) -> None:
        """Stop taking work and interrupt every session's running operation."""
        self._stopping = True
        for session in self.sessions():
            session.interrupt()

    def shutdown(self) -> None:
        """Stop taking work, close every session (cancelling decodes), unload every model."""
        self.begin_shutdown()
        for session in self.sessions():
            with contextlib.suppress(ModeldError):
                session.close()
        with self._lock:
            models = list(self._models.values())
            self._models.clear()
        for model in models:
            with model.lock:
                model.close()

    def __enter__(self) -> Engine:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.shutdown()
