"""The Service: describes models, opens sessions, keeps models and their warm state.

:class:`Engine` implements :class:`~modeld.contract.Service` over any backend: the facade. It
owns the session registry, owner fencing, limits, the observers and the daemon-wide RAM and
disk tiers (``modeld/cache/tiers.py``). Loading models (which backend, describe, the layout,
room within the memory budget, unloading, a model whose file changed or whose worker restarted)
is its :class:`~modeld.engine.loading.ModelLoader`'s (``engine/loading.py``), each loaded model
with its supervised engine worker, warm-state cache and admission slots (``engine/model.py``).
The per-session contract lives in ``engine/session.py``; design records ``blueprints/0001``,
``0016`` (warm state) and ``0017`` (workers).
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
from modeld.backends import Backend
from modeld.backends.sizing import default_memory_budget
from modeld.cache.shared import DirectoryStore, SharedTier, StoreError, default_shared_budget
from modeld.cache.tiers import Tiers, default_budgets
from modeld.contract import (
    NUM_BATCH,
    Config,
    ContextReport,
    ModelInfo,
    OpenSessionRequest,
    PrefixInput,
    SuffixInput,
)
from modeld.decoding.speculation import SPECULATION_MODES
from modeld.engine.loading import ModelLoader
from modeld.engine.model import LoadedModel
from modeld.engine.owner import Owner
from modeld.engine.prepare import Preparer, identity_of
from modeld.engine.report import daemon_memory, fields_of, machine, model_summary, tier_status
from modeld.engine.session import EngineSession
from modeld.engine.validate import encode_text, validate_request
from modeld.errors import (
    InvalidArgumentError,
    LimitExceededError,
    ManifestMismatchError,
    ModeldError,
    SessionNotFoundError,
    ShuttingDownError,
    UnsupportedError,
)
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
        self._lock = threading.RLock()
        self._sessions: dict[str, EngineSession] = {}
        self._closed: OrderedDict[str, ContextReport] = OrderedDict()
        self._stopping = False
        self._observers: list[EngineObserver] = []
        self.loader = ModelLoader(
            backend_names=self.backend_names,
            default_backend=self.default_backend,
            limits=self.limits,
            residency=self.residency,
            timeouts=self.timeouts,
            restart=self.restart,
            tiers=self.tiers,
            memory_budget=self.memory_budget,
            worker_log_level=self.worker_log_level,
            lock=self._lock,
            notify=self._notify,
            sessions_of=lambda model: [s for s in self._sessions.values() if s.model is model],
        )
        """Model loading: backends, describe, layouts, the loaded models (``loading.py``)."""
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
        return self.loader.backend(name)

    def describe(self, request: OpenSessionRequest) -> ModelInfo:
        request = validate_request(request, self.limits)
        kind = self.loader.resolve_type(request)
        return self.loader.described(kind, request)

    def open_session(self, request: OpenSessionRequest) -> EngineSession:
        request = validate_request(request, self.limits)
        if self._stopping:
            raise ShuttingDownError("the daemon is shutting down")
        epoch = self.owner.check_open(request.fence)
        kind = self.loader.resolve_type(request)
        self._check_session_room()
        info = self.loader.described(kind, request)
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
        config = resolved(config, info)
        model = self.loader.model_for(kind, replace(request, config=config), info)
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
        kind = self.loader.resolve_type(request)
        info = self.loader.described(kind, request)
        config = resolved(request.config, info)
        model = self.loader.model_for(kind, replace(request, config=config), info)
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
                identity,
                config,
                info,
                self.limits,
                unbounded,
                model.vocab,
                renderer,
                model.tokenize,
                model.prefixes,
            )
            first = prep.prefix(prefix)
            if suffix is None:
                return len(first.tokens)
            tail = prep.suffix(suffix, current=first.manifest, chat=first.chat, prefix_tokens=first.tokens)
            return tail.keep + len(tail.tokens)

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
        return self.loader.models()

    def unload(self, path: str) -> int:
        """Unload the file's loaded models no session holds (Ollama's ``keep_alive: 0``)."""
        return self.loader.unload(path)

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
            models = tuple(model_summary(m, debug=debug, listed=listed) for m in self.loader.models())
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
        return self.loader.restarts

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
        for model in self.loader.clear():
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


def resolved(config: Config, info: ModelInfo) -> Config:
    """``config`` with what its zeros leave to the model made concrete: the window the memory
    budget gives (``num_ctx``) and the backend's micro-batch for the model (``num_batch``: its
    footprint's, else :data:`~modeld.contract.NUM_BATCH`). The runtime digest is taken over the
    concrete values, so a later change of either choice never reuses a warm context computed
    under the other."""
    batch = config.num_batch or info.footprint.micro_batch or NUM_BATCH
    return replace(config, num_ctx=info.effective_context, num_batch=batch)
