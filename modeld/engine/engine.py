"""The Service: describes models, opens sessions, keeps models and their warm state.

:class:`Engine` implements :class:`~modeld.contract.Service` over any backend. It owns the
session registry, owner fencing, limits, the set of loaded models (each with its supervised
engine worker, warm-state cache and admission slots: ``engine/model.py``) and the daemon-wide
RAM and disk tiers (``modeld/cache/tiers.py``). The per-session contract lives in
``engine/session.py``; design records ``blueprints/0001``, ``0016`` (warm state) and ``0017``
(workers).
"""

from __future__ import annotations

import contextlib
import functools
import logging
import os
import threading
import time
from collections import OrderedDict
from collections.abc import Iterator, Sequence
from dataclasses import replace
from pathlib import Path
from types import TracebackType

import psutil

from modeld import __version__
from modeld.backends import Backend, load_backend
from modeld.backends.base import LoadOptions
from modeld.backends.sizing import (
    default_memory_budget,
    footprint,
    load_cost,
    max_window,
    plan_layout,
)
from modeld.cache.pool import CacheSettings
from modeld.cache.reuse import RuntimeHistory
from modeld.cache.shared import DirectoryStore, SharedTier, StoreError, default_shared_budget
from modeld.cache.tiers import Tiers, default_budgets
from modeld.contract import Config, ContextReport, ModelInfo, OpenSessionRequest, PrefixInput, SuffixInput
from modeld.decoding.speculation import SPECULATION_MODES
from modeld.engine.chat import with_template
from modeld.engine.model import LoadedModel, ModelKey
from modeld.engine.owner import Owner
from modeld.engine.prepare import Preparer, identity_of
from modeld.engine.report import daemon_memory, fields_of, machine, model_summary, tier_status
from modeld.engine.session import EngineSession
from modeld.engine.validate import encode_text, validate_request
from modeld.errors import (
    BackendMismatchError,
    InvalidArgumentError,
    LimitExceededError,
    ManifestMismatchError,
    ModelChangedError,
    ModeldError,
    SessionNotFoundError,
    ShuttingDownError,
    UnsupportedError,
)
from modeld.manifest import config_runtime_digest
from modeld.observe.status import (
    DaemonStatus,
    EngineObserver,
    Machine,
    SessionSummary,
)
from modeld.settings import ISOLATIONS, Limits, Residency, RestartPolicy, Timeouts

__all__ = ["Engine"]

log = logging.getLogger("modeld.engine")

_JANITOR_SECONDS = 2.0


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
        residency: Residency | None = None,
        timeouts: Timeouts | None = None,
        restart: RestartPolicy | None = None,
        data_dir: Path | None = None,
        worker_log_level: str = "INFO",
        speculation: str = "ngram",
    ) -> None:
        if not backends:
            raise InvalidArgumentError("at least one backend is required", field="backends")
        self.backend_names = tuple(backends)
        self.default_backend = default_backend or self.backend_names[0]
        self.owner = owner or Owner()
        self.limits = limits or Limits()
        self.residency = residency or Residency()
        if self.residency.isolation not in ISOLATIONS:
            raise InvalidArgumentError(
                f"isolation must be one of {', '.join(ISOLATIONS)}, got {self.residency.isolation!r}",
                field="isolation",
            )
        if speculation not in SPECULATION_MODES:
            raise InvalidArgumentError(
                f"speculation must be one of {', '.join(SPECULATION_MODES)}, got {speculation!r}",
                field="speculation",
            )
        self.speculation = speculation
        """What a decode that leaves ``DecodeConfig.speculation`` unset gets (``--speculation``)."""
        self.timeouts = timeouts or Timeouts()
        self.restart = restart or RestartPolicy()
        self.endpoint = endpoint
        self.data_dir = data_dir
        self.worker_log_level = worker_log_level
        self.started_at = time.time()
        self._started_mono = time.monotonic()
        ram, disk = default_budgets(data_dir, available_ram=psutil.virtual_memory().available)
        self.tiers = Tiers(
            data_dir=data_dir,
            ram_bytes=ram if self.residency.ram_tier_bytes < 0 else self.residency.ram_tier_bytes,
            disk_bytes=disk if self.residency.disk_tier_bytes < 0 else self.residency.disk_tier_bytes,
        )
        if self.residency.shared_store:
            self.tiers.attach_remote(_shared_tier(self.residency))
        budget = self.residency.memory_budget_bytes
        self.memory_budget = default_memory_budget() if budget < 0 else budget
        self.tiers.limit_ram(self.memory_budget)  # one budget: the RAM tier within what models leave
        self._backends: dict[str, Backend] = {}
        self._lock = threading.RLock()
        self._load_lock = threading.Lock()
        self._models: dict[ModelKey, LoadedModel] = {}
        self._history = RuntimeHistory()
        self._sessions: dict[str, EngineSession] = {}
        self._closed: OrderedDict[str, ContextReport] = OrderedDict()
        self._stopping = False
        self._restarts = 0
        self._observers: list[EngineObserver] = []
        self._janitor_stop = threading.Event()
        self.owner.on_revoke(self._on_revoke)
        threading.Thread(target=self._janitor, name="engine-janitor", daemon=True).start()

    # --- observers ----------------------------------------------------------------------

    def add_observer(self, observer: EngineObserver) -> None:
        self._observers.append(observer)

    def _notify(self, event: str, *args: object) -> None:
        for observer in list(self._observers):
            try:
                getattr(observer, event)(*args)
            except Exception:
                log.exception("an engine observer failed on %s", event)

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
        kind = self._resolve_type(request)
        return self._described(kind, request)

    def open_session(self, request: OpenSessionRequest) -> EngineSession:
        request = validate_request(request, self.limits)
        if self._stopping:
            raise ShuttingDownError("the daemon is shutting down")
        epoch = self.owner.check_open(request.fence)
        kind = self._resolve_type(request)
        self._check_session_room()
        info = self._described(kind, request)
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
        try:
            session = EngineSession(self, model, request, info, config, epoch)
            self._check_session_room()
        except BaseException:
            with self._lock:
                model.sessions -= 1
            raise
        with self._lock:
            self._sessions[session.session_id] = session
        log.info("session %s opened on %s %s (epoch %d)", session.session_id, kind, info.path, epoch)
        return session

    def _check_session_room(self) -> None:
        with self._lock:
            if len(self._sessions) >= self.limits.max_sessions:
                raise LimitExceededError(
                    f"{len(self._sessions)} sessions are open; the limit is {self.limits.max_sessions}",
                    limit="max_sessions",
                    value=len(self._sessions) + 1,
                    maximum=self.limits.max_sessions,
                )

    def tokenize(self, request: OpenSessionRequest, text: str) -> list[int]:
        """The token ids of ``text`` under a model (no BOS), loading the model if needed.

        Opens no session and changes nothing resident: a tool budgets a repo map with it.
        """
        request = validate_request(request, self.limits)
        encode_text(text, "text", self.limits)
        with self._lent(request) as (model, _info, _config):
            return model.tokenize(text, False)

    @contextlib.contextmanager
    def _lent(self, request: OpenSessionRequest) -> Iterator[tuple[LoadedModel, ModelInfo, Config]]:
        """The model ``request`` names (loaded if needed) for a question that opens no session,
        held as a session would hold it until the question is answered."""
        if self._stopping:
            raise ShuttingDownError("the daemon is shutting down")
        kind = self._resolve_type(request)
        info = self._described(kind, request)
        config = replace(request.config, num_ctx=info.effective_context)
        model = self._model_for(kind, replace(request, config=config), info)
        try:
            yield model, info, config
        finally:
            with self._lock:
                model.sessions -= 1

    def count_tokens(
        self, request: OpenSessionRequest, prefix: PrefixInput, suffix: SuffixInput | None = None
    ) -> int:
        """How many tokens ``prefix`` (and ``suffix`` after it) take once rendered and
        tokenized as a session would (chat templates and BOS included), whatever the window.
        Opens no session and changes nothing resident (Anthropic's count_tokens)."""
        request = validate_request(request, self.limits)
        with self._lent(request) as (model, info, config):
            unbounded = 1 << 40  # counting: no window applies
            renderer = functools.partial(model.chat_renderer, info.chat_template)
            identity = identity_of(info, config)
            prep = Preparer(
                identity, config, info, self.limits, unbounded, model.vocab, renderer, model.tokenize
            )
            first = prep.prefix(prefix)
            if suffix is None:
                return len(first.tokens)
            tail = prep.suffix(suffix, current=first.manifest, chat=first.chat, prefix_tokens=first.tokens)
            return tail.keep + len(tail.tokens)

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
        )

    def _described(self, kind: str, request: OpenSessionRequest) -> ModelInfo:
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

    def _model_for(self, kind: str, request: OpenSessionRequest, info: ModelInfo) -> LoadedModel:
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
            ended = [s for s in self._sessions.values() if s.model is model]
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

    # --- what sessions ask (SessionService) ----------------------------------------------------

    def forget(self, session: EngineSession, report: ContextReport) -> None:
        with self._lock:
            if self._sessions.pop(session.session_id, None) is None:
                return
            session.model.sessions -= 1
            self._closed[session.session_id] = report
            while len(self._closed) > self.limits.closed_reports_kept:
                self._closed.popitem(last=False)

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

    def models(self) -> list[LoadedModel]:
        with self._lock:
            return list(self._models.values())

    def list_sessions(self) -> list[SessionSummary]:
        return [s.summary() for s in self.sessions()]

    def explain_context(self, session_id: str) -> ContextReport:
        with self._lock:
            session = self._sessions.get(session_id)
            closed = self._closed.get(session_id)
        if session is not None:
            return session.explain_context()
        if closed is not None:
            return closed
        raise SessionNotFoundError(session_id)

    def status(self, *, debug: bool = False) -> DaemonStatus:
        with self._lock:
            listed: set[str] = set()  # each tier snapshot under one model, never under two
            models = tuple(model_summary(m, debug=debug, listed=listed) for m in self._models.values())
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
            tiers=tier_status(self.tiers, self.memory_budget),
            machine=self.machine(),
            memory=daemon_memory(models, self.tiers),
            settings={
                **self.residency.as_dict(),
                "speculation": self.speculation,
                **{f"timeout_{k}": str(v) for k, v in fields_of(self.timeouts).items()},
                **{f"restart_{k}": str(v) for k, v in fields_of(self.restart).items()},
            },
        )

    def machine(self) -> Machine:
        """The machine, for placement (hardware inventory; never waits for a slow probe)."""
        return machine(self.data_dir)

    @property
    def stopping(self) -> bool:
        return self._stopping

    @property
    def worker_restarts(self) -> int:
        return self._restarts

    def _on_revoke(self, why: str) -> None:
        log.warning("ownership lost: %s; failing %d sessions", why, len(self._sessions))
        for session in self.sessions():
            session.interrupt()

    def _janitor(self) -> None:
        """Idle warm contexts past their keep-alive leave the KV pool; contexts whose agent runs
        a tool come back into it before they are asked for (``ModelCache.prefetch``)."""
        while not self._janitor_stop.wait(_JANITOR_SECONDS):
            now = time.time()
            for model in self.models():
                with contextlib.suppress(ModeldError):
                    model.cache.expire(now)
                    model.cache.prefetch(now)

    def running_operations(self) -> int:
        """Operations running on a model's slots or waiting for one, now (a drain waits for
        them: blueprint 0020)."""
        return sum(m.admission.busy + m.admission.queued for m in self.models())

    def persist_warm_state(self, timeout: float) -> bool:
        """Write every idle warm context, whole (what was generated too), to the disk tier and
        through to the shared store now, and wait for the writes (a drain, before the gateway
        moves the conversations away); True when they all finished within ``timeout`` seconds."""
        for model in self.models():
            with contextlib.suppress(ModeldError):
                model.cache.persist_all(whole=True)
        return self.tiers.flush(timeout)

    def begin_shutdown(self) -> None:
        """Stop taking work and interrupt every session's running operation."""
        self._stopping = True
        for session in self.sessions():
            session.interrupt()

    def shutdown(self, *, persist_seconds: float = 30.0) -> None:
        """Stop taking work, close every session (cancelling decodes), write the warm contexts
        to the disk tier (for at most ``persist_seconds``), stop every worker."""
        self.begin_shutdown()
        self._janitor_stop.set()
        for session in self.sessions():
            with contextlib.suppress(ModeldError):
                session.close()
        with self._lock:
            models = list(self._models.values())
            self._models.clear()
        for model in models:
            model.close(persist=True)
        if not self.tiers.flush(persist_seconds):
            log.warning("the disk tier did not finish writing within %.0fs", persist_seconds)
        self.tiers.close()

    def __enter__(self) -> Engine:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.shutdown()


def _shared_tier(residency: Residency) -> SharedTier:
    """The shared snapshot store of ``--shared-store`` (blueprint 0020); a directory that cannot
    be used is a configuration error at start, not a silent miss on every turn."""
    directory = Path(residency.shared_store).expanduser().absolute()
    budget = residency.shared_store_bytes
    if budget < 0:
        budget = default_shared_budget(directory)
    if budget <= 0:
        raise InvalidArgumentError(
            f"--shared-store: the budget of {directory} is 0 (give --shared-store-bytes, e.g. 50G)",
            field="shared_store_bytes",
        )
    try:
        store = DirectoryStore(directory, budget)
    except StoreError as exc:
        raise InvalidArgumentError(f"--shared-store: {exc}", field="shared_store") from None
    return SharedTier(store)
