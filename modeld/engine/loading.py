"""Model loading: which backend, describe, the layout, and the loaded models within one budget.

:class:`ModelLoader` is the part of the :class:`~modeld.engine.engine.Engine` that loads
models: it resolves a request's backend, describes the model (its window capped by what fits in
the memory budget under the configured KV layout), plans each model's layout, loads it into a
supervised worker (``engine/model.py``) after making room (the least recently used idle model
unloaded first), unloads, and handles a model whose file changed or whose worker restarted. It
keeps the registry of loaded models under the engine's lock (the engine's sessions are read
under the same lock); the engine stays the Service facade. Design records ``blueprints/0001``,
``0016`` (the memory budget) and ``0017`` (workers).
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable, Sequence
from dataclasses import replace
from typing import TYPE_CHECKING

from modeld.backends import Backend, load_backend
from modeld.backends.base import LoadOptions
from modeld.backends.sizing import (
    footprint,
    load_cost,
    max_window,
    plan_layout,
)
from modeld.cache.pool import CacheSettings
from modeld.cache.reuse import RuntimeHistory
from modeld.cache.tiers import Tiers
from modeld.contract import ModelInfo, OpenSessionRequest
from modeld.engine.chat import with_template
from modeld.engine.model import LoadedModel, ModelKey
from modeld.errors import BackendMismatchError, LimitExceededError, ModelChangedError, ModeldError
from modeld.manifest import config_runtime_digest
from modeld.settings import Limits, Residency, RestartPolicy, Timeouts

if TYPE_CHECKING:
    from modeld.engine.session import EngineSession

__all__ = ["ModelLoader"]

log = logging.getLogger("modeld.engine")


class ModelLoader:
    """Loads models and keeps the loaded ones (see the module docstring)."""

    def __init__(
        self,
        *,
        backend_names: tuple[str, ...],
        default_backend: str,
        limits: Limits,
        residency: Residency,
        timeouts: Timeouts,
        restart: RestartPolicy,
        tiers: Tiers,
        memory_budget: int,
        worker_log_level: str,
        lock: threading.RLock,
        notify: Callable[..., None],
        sessions_of: Callable[[LoadedModel], Sequence[EngineSession]],
    ) -> None:
        self.backend_names = backend_names
        self.default_backend = default_backend
        self.limits = limits
        self.residency = residency
        self.timeouts = timeouts
        self.restart = restart
        self.tiers = tiers
        self.memory_budget = memory_budget
        self.worker_log_level = worker_log_level
        self._lock = lock
        """The engine's lock: the registry of loaded models and the engine's sessions under one."""
        self._notify = notify
        """The engine's observers (``EngineObserver``): ``_notify(event, *args)``."""
        self._sessions_of = sessions_of
        """The open sessions of a loaded model (read under :attr:`_lock`)."""
        self._backends: dict[str, Backend] = {}
        self._load_lock = threading.Lock()
        self._models: dict[ModelKey, LoadedModel] = {}
        self._history = RuntimeHistory()
        self._restarts = 0

    @property
    def restarts(self) -> int:
        """Engine workers that lost their state since the daemon started."""
        return self._restarts

    def models(self) -> list[LoadedModel]:
        with self._lock:
            return list(self._models.values())

    def clear(self) -> list[LoadedModel]:
        """Forget every loaded model (the daemon is stopping); returns them, to be closed."""
        with self._lock:
            models = list(self._models.values())
            self._models.clear()
        return models

    def backend(self, name: str) -> Backend:
        with self._lock:
            if name not in self._backends:
                self._backends[name] = load_backend(name)
            return self._backends[name]

    def resolve_type(self, request: OpenSessionRequest) -> str:
        kind = request.type or self.default_backend
        if kind not in self.backend_names:
            raise BackendMismatchError(
                f"the model is typed {kind!r} but this service runs {', '.join(self.backend_names)}",
                requested=kind,
                available=",".join(self.backend_names),
            )
        return kind

    def _unified(self, kind: str) -> bool:
        return self.residency.kv_unified and kind in ("llama", "memory")

    def _plan(self, kind: str, info: ModelInfo, window: int, room: int | None) -> tuple[LoadOptions, str]:
        r = self.residency
        return plan_layout(
            sequences=r.sequences,
            unified=self._unified(kind),
            pool_tokens=r.pool_tokens,
            window=window,
            fp=info.footprint,
            room=room,
            checkpoints=r.checkpoints,
            swa_full=r.swa_full,
        )

    def described(self, kind: str, request: OpenSessionRequest) -> ModelInfo:
        """The backend's describe with the session's template (0010), its context capped by what
        fits in the memory budget under the configured KV layout, and its footprint completed with
        that layout (``modeld describe``)."""
        described = self.backend(kind).describe(request, memory_budget=self.memory_budget)
        info = with_template(described, request.chat_template)
        fp = info.footprint
        if fp.kv_bytes_per_token <= 0 and fp.state_bytes <= 0:
            return info
        fit = max_window(
            fp,
            unified=self._unified(kind),
            pool_tokens=self.residency.pool_tokens,
            budget=self.memory_budget,
            trained=info.model_max_context,
        )
        effective = min(info.effective_context, fit)
        options, _ = self._plan(kind, info, effective, self.memory_budget)  # loaded alone
        return replace(
            info,
            effective_context=effective,
            footprint=footprint(
                fp, options, budget=self.memory_budget, trained=info.model_max_context, max_fit=fit
            ),
        )

    def _options(self, kind: str, info: ModelInfo, config_window: int, threads: int) -> LoadOptions:
        """How many sequences, of how many cells: the settings, within the memory budget
        (:func:`~modeld.backends.sizing.plan_layout`: a split KV gets fewer sequences, a unified
        pool a smaller size, when the budget left after the loaded models is short)."""
        with self._lock:
            used = sum(m.cost for m in self._models.values())
        options, note = self._plan(kind, info, config_window, self.memory_budget - used)
        if note:
            log.warning("%s: %s", info.path, note)
        return replace(options, threads=threads)

    def _isolation(self, kind: str) -> str:
        chosen = self.residency.isolation
        if chosen == "auto":
            return "inline" if kind == "memory" else "process"
        return chosen

    def model_for(self, kind: str, request: OpenSessionRequest, info: ModelInfo) -> LoadedModel:
        """The loaded model for (backend, path, digest, runtime config), loading it if needed.

        Each runtime config gets its own engine worker, so tools with different windows or KV
        types each stay warm (llama.cpp maps the weights: a second context costs its KV).
        Loading beyond ``max_loaded_models`` or the memory budget first unloads the least
        recently used model that has no session (its warm contexts go to the tiers)."""
        key = (kind, info.path, info.model_digest, config_runtime_digest(request.config))
        with self._lock:
            stale = [m for k, m in self._models.items() if k[:2] == key[:2] and k[2] != key[2]]
        for other in stale:  # the file now describes as another model: is that one gone from it?
            other.file_changed()
        with self._load_lock:
            with self._lock:
                model = self._models.get(key)
                if model is not None and model.supervisor.state != "stopped":
                    model.sessions += 1
                    if model.supervisor.state == "failed":
                        model.supervisor.revive()  # a client asks for it again: retry
                    return model
            options = self._options(kind, info, request.config.num_ctx, request.config.num_threads)
            cost = load_cost(info.footprint, options)
            self._make_room_for_load(cost)
            self._budget_ram_tier(loading=cost)  # the tier makes room before the worker allocates
            model = LoadedModel(
                key,
                request,
                info,
                options,
                backend=self.backend(kind),
                isolation=self._isolation(kind),
                tiers=self.tiers,
                history=self._history,
                cache_settings=CacheSettings(
                    snapshot_min_tokens=self.residency.snapshot_min_tokens,
                    persist_min_tokens=self.residency.persist_min_tokens,
                    room_wait_seconds=self.limits.model_wait_seconds,
                ),
                timeouts=self.timeouts,
                restart=self.restart,
                slots=self.residency.slots,
                max_queue=self.residency.max_queue,
                wait_seconds=self.limits.model_wait_seconds,
                log_level=self.worker_log_level,
                on_restart=self._worker_restarted,
                on_state=lambda name, state: self._notify("model_state", name, state),
                on_wait=lambda seconds: self._notify("queue_waited", seconds),
                on_changed=self._model_changed,
            )
            model.cost = cost
            model.sessions = 1
            with self._lock:
                self._models[key] = model
            self._budget_ram_tier()
            log.info(
                "loaded %s model %s (%s): %d sequences of %d tokens, %s",
                kind,
                info.path,
                info.model_digest[:12],
                model.layout.n_seq,
                model.layout.window,
                model.isolation,
            )
            return model

    def _make_room_for_load(self, cost: int) -> None:
        while True:
            with self._lock:
                loaded = list(self._models.values())
            used = sum(m.cost for m in loaded)
            if len(loaded) < self.limits.max_loaded_models and used + cost <= self.memory_budget:
                return
            idle = [m for m in loaded if m.sessions == 0 and m.admission.busy == 0]
            if not idle:
                if len(loaded) >= self.limits.max_loaded_models:
                    raise LimitExceededError(
                        f"{len(loaded)} models are loaded and in use; the limit is {self.limits.max_loaded_models}",
                        limit="max_loaded_models",
                        value=len(loaded) + 1,
                        maximum=self.limits.max_loaded_models,
                    )
                raise LimitExceededError(
                    f"loading this model needs about {cost >> 20} MiB; the loaded models in use take "
                    f"{used >> 20} MiB of the {self.memory_budget >> 20} MiB memory budget",
                    limit="memory_budget_bytes",
                    value=used + cost,
                    maximum=self.memory_budget,
                )
            victim = min(idle, key=lambda m: m.last_used_at)
            self._unload(
                victim, "it was the least recently used idle model and another model needed the room"
            )

    def unload(self, path: str) -> int:
        """Unload the file's loaded models no session holds (Ollama's ``keep_alive: 0``)."""
        idle = [m for m in self.models() if m.info.path == path and not m.sessions and not m.admission.busy]
        for model in idle:
            self._unload(model, "a client asked for it (keep_alive 0)")
        return len(idle)

    def _unload(self, model: LoadedModel, why: str) -> None:
        with self._lock:
            if self._models.get(model.key) is model:
                del self._models[model.key]
        model.cache.retire(f"the model was unloaded: {why}")
        model.close(persist=False)
        self._budget_ram_tier()
        log.info("unloaded model %s: %s", model.info.path, why)

    def _budget_ram_tier(self, loading: int = 0) -> None:
        """One memory budget for the loaded models and the RAM tier: the tier may hold what the
        models leave of it (a model loaded into that room spills the tier's least recently used
        contexts to disk first, before any model is unloaded)."""
        with self._lock:
            used = sum(m.cost for m in self._models.values())
        self.tiers.limit_ram(self.memory_budget - used - loading)

    def _model_changed(self, model: LoadedModel, error: ModelChangedError) -> None:
        """A loaded model's file no longer holds it (``LoadedModel.file_changed``): no new
        session gets it, every open session of it ends with ``error`` (their transports end
        their streams; a client opens a new session, which loads the file as it is now), and it
        is retired without saving its warm contexts, in the background."""
        with self._lock:
            if self._models.get(model.key) is model:
                del self._models[model.key]
            ended = list(self._sessions_of(model))
        log.warning("retiring model %s: its file changed; ending %d sessions", model.info.path, len(ended))
        for session in ended:
            session.interrupt(error)

        def retire() -> None:
            model.cache.reset(error)  # forgets every warm context; nothing goes to the tiers
            model.close(persist=False)

        threading.Thread(target=retire, name="model-retire", daemon=True).start()
        self._budget_ram_tier()

    def _worker_restarted(self, model: LoadedModel, error: ModeldError) -> None:
        with self._lock:
            self._restarts += 1
        log.warning("engine worker of %s lost its state: %s", model.info.path, error.message)
        self._notify("worker_restarted")
