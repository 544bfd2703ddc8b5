"""The one path every listener takes to the engine: the gRPC servicer and the HTTP endpoint.

What: :class:`Gateway` sees the engine only as the contract's Service plus the small observer
protocol :class:`ServedEngine` (status, sessions, explain, tokenize; the engine satisfies it,
checked by mypy where the daemon builds it, ``modeld/daemon.py``). It never imports ``modeld.engine``. It keeps:

* the sessions opened through a transport (:class:`TransportSession`) with the state only a transport
  has: which transport, whether a stream is attached, when it was opened. The engine's
  session knows nothing about streams;
* one end notification per session: the engine calls back once when a session can no longer
  be used (closed, its owner epoch revoked, the daemon stopping), with the error its
  operations now raise. A transport ends its stream on it at once; nothing polls;
* metrics and request records: every hosted session is wrapped in an
  :class:`~modeld.observe.metrics.ObservedSession`, so both transports count turns alike, and
  each turn gets a record in :attr:`Gateway.records` (``blueprints/0022-live-page.md``).

What not: engine logic (admission, fencing, reuse and limits stay in the engine), protobuf,
HTTP. Why: the servicer used to import the concrete Engine, repeat the session's admission
checks in a 0.25 s poll loop and store ``attached`` on the engine's session
(``blueprints/0007-wire.md``).
"""

from __future__ import annotations

import contextlib
import logging
import threading
import time
from collections.abc import Callable
from dataclasses import replace
from typing import TYPE_CHECKING, Protocol, runtime_checkable

from modeld.contract import ContextReport, ModelInfo, OpenSessionRequest, PrefixInput, Session, SuffixInput
from modeld.errors import InvalidArgumentError, ModeldError, SessionNotFoundError
from modeld.observe.metrics import Metrics, ObservedSession
from modeld.observe.records import RecordQuery, Records, RequestRecord, clean_label
from modeld.observe.status import DaemonStatus, Machine, SessionSummary

if TYPE_CHECKING:
    from modeld.settings import Limits

__all__ = ["Gateway", "InterruptibleSession", "TransportSession", "OwnerView", "ServedEngine"]

log = logging.getLogger("modeld.server")


class OwnerView(Protocol):
    """Who owns the machine: what an OpenSession answer names."""

    @property
    def instance_id(self) -> str: ...

    @property
    def epoch(self) -> int: ...


@runtime_checkable
class InterruptibleSession(Session, Protocol):
    """A contract Session a transport can host: it can be interrupted (the transport went
    away) and it says once when it can no longer be used."""

    def interrupt(self) -> None: ...

    def on_end(self, listener: Callable[[ModeldError], None]) -> None: ...


class ServedEngine(Protocol):
    """The engine as the listeners see it: the Service contract plus observers."""

    endpoint: str

    @property
    def owner(self) -> OwnerView: ...

    @property
    def stopping(self) -> bool: ...

    def describe(self, request: OpenSessionRequest) -> ModelInfo: ...

    def open_session(self, request: OpenSessionRequest) -> InterruptibleSession: ...

    def tokenize(self, request: OpenSessionRequest, text: str) -> list[int]: ...

    def count_tokens(
        self, request: OpenSessionRequest, prefix: PrefixInput, suffix: SuffixInput | None = None
    ) -> int: ...

    def explain_context(self, session_id: str) -> ContextReport: ...

    def list_sessions(self) -> list[SessionSummary]: ...

    def status(self, *, debug: bool = False) -> DaemonStatus: ...

    def machine(self) -> Machine: ...

    def unload(self, path: str) -> int: ...


class TransportSession:
    """A session opened through a transport, and what that transport holds about it."""

    def __init__(self, raw: InterruptibleSession, session: ObservedSession, transport: str) -> None:
        self.raw = raw
        self.session = session  # what the transport drives (counted by the metrics)
        self.transport = transport
        self.session_id = raw.session_id
        self.opened = time.monotonic()
        self.attached = False
        self._lock = threading.Lock()
        self._ended: ModeldError | None = None
        self._listeners: list[Callable[[ModeldError], None]] = []

    @property
    def ended(self) -> ModeldError | None:
        """Why the session can no longer be used, or None while it can."""
        return self._ended

    def on_end(self, listener: Callable[[ModeldError], None]) -> None:
        """Call ``listener`` once when the session ends (at once if it already has)."""
        with self._lock:
            if self._ended is None:
                self._listeners.append(listener)
                return
            error = self._ended
        listener(error)

    def _end(self, error: ModeldError) -> None:
        with self._lock:
            if self._ended is not None:
                return
            self._ended = error
            listeners, self._listeners = self._listeners, []
        for listener in listeners:
            try:
                listener(error)
            except Exception:
                log.exception("a session-end listener failed")

    def interrupt(self) -> None:
        """Stop whatever the session is running (its transport went away)."""
        self.raw.interrupt()

    def close(self) -> None:
        self.session.close()


class Gateway:
    """The engine as every transport reaches it, with the transports' session registry."""

    def __init__(
        self,
        engine: ServedEngine,
        limits: Limits,
        metrics: Metrics | None = None,
        records: Records | None = None,
    ) -> None:
        self.engine = engine
        self.limits = limits
        self.metrics = metrics if metrics is not None else Metrics(engine.status)
        self.records = records if records is not None else Records(None)
        """Every turn's request record (memory only unless the daemon gives it a directory)."""
        self._hosted: dict[str, TransportSession] = {}
        self._lock = threading.Lock()
        self.names: Callable[[str], str | None] = lambda _path: None
        """The name a model file is served under (the HTTP endpoint's registry sets it; None:
        the file has none there)."""

    def named(self, request: OpenSessionRequest) -> OpenSessionRequest:
        """The request with the name its model is served under: the one function that names a
        model, so one file has one name on every transport. The request's own name, else the
        name the HTTP endpoint serves the file under (``--model NAME=PATH``, ``--models-dir``,
        the generated defaults), else none here: the file's own (GGUF ``general.name``)."""
        if request.model_name:
            return request
        name = self.names(request.path)
        return replace(request, model_name=name) if name else request

    # --- the Service, for transports ------------------------------------------------------

    @property
    def owner(self) -> OwnerView:
        return self.engine.owner

    @property
    def stopping(self) -> bool:
        return self.engine.stopping

    def describe(self, request: OpenSessionRequest) -> ModelInfo:
        return self.engine.describe(self.named(request))

    def open(
        self, request: OpenSessionRequest, transport: str, *, attached: bool = False, job: str = ""
    ) -> TransportSession:
        """Open a session for ``transport``; it leaves the registry when it ends. ``job``: the
        label its turns' records carry (a gRPC client's ``x-modeld-job`` metadata)."""
        try:
            job = clean_label(job, "job label (x-modeld-job)")
        except ValueError as exc:
            raise InvalidArgumentError(str(exc), field="x-modeld-job") from None
        raw = self.engine.open_session(self.named(request))
        hosted = TransportSession(raw, self.metrics.observe(raw, self.records, transport, job), transport)
        hosted.attached = attached
        with self._lock:
            self._hosted[hosted.session_id] = hosted
        raw.on_end(lambda error: self._ended(hosted, error))
        return hosted

    def _ended(self, hosted: TransportSession, error: ModeldError) -> None:
        with self._lock:
            if self._hosted.get(hosted.session_id) is hosted:
                del self._hosted[hosted.session_id]
        hosted._end(error)

    def transport_session(self, session_id: str) -> TransportSession:
        """The open session a transport opened under this id."""
        with self._lock:
            hosted = self._hosted.get(session_id)
        if hosted is None:
            raise SessionNotFoundError(session_id)
        return hosted

    def attach(self, hosted: TransportSession) -> bool:
        """Mark ``hosted`` attached to a stream; False if another stream already has it."""
        with self._lock:
            if hosted.attached:
                return False
            hosted.attached = True
            return True

    def tokenize(self, request: OpenSessionRequest, text: str) -> list[int]:
        return self.engine.tokenize(self.named(request), text)

    def unload(self, path: str) -> int:
        """Unload the model file's idle loaded models (how many)."""
        return self.engine.unload(path)

    def count_tokens(
        self, request: OpenSessionRequest, prefix: PrefixInput, suffix: SuffixInput | None = None
    ) -> int:
        return self.engine.count_tokens(self.named(request), prefix, suffix)

    # --- observers ------------------------------------------------------------------------

    def status(self, *, debug: bool = False) -> DaemonStatus:
        return self.engine.status(debug=debug)

    def machine(self) -> Machine:
        return self.engine.machine()

    def explain_context(self, session_id: str) -> ContextReport:
        report = self.engine.explain_context(session_id)
        self.metrics.reports.labels(self.metrics.label(report.model_name)).inc()
        return report

    def list_sessions(self) -> list[SessionSummary]:
        """The engine's sessions, with the transport's view of whether a stream holds each."""
        with self._lock:
            attached = {sid: h.attached for sid, h in self._hosted.items()}
        return [
            replace(s, attached=attached[s.session_id]) if s.session_id in attached else s
            for s in self.engine.list_sessions()
        ]

    def requests(self, query: RecordQuery, rid: str = "") -> list[RequestRecord]:
        """The request records a query asks for (``rid``: that one record, if it exists); a
        filter that is too long or holds a control character is refused."""
        try:
            for what, text in (("job", query.job), ("conversation", query.conversation), ("id", rid)):
                clean_label(text, what)
        except ValueError as exc:
            raise InvalidArgumentError(str(exc)) from None
        if rid:
            found = self.records.get(rid)
            return [found] if found is not None else []
        return self.records.query(query)

    def metrics_text(self, accept: str = "") -> tuple[bytes, str]:
        return self.metrics.render(accept)

    # --- housekeeping ---------------------------------------------------------------------

    def reap_unattached(self) -> list[str]:
        """Close gRPC sessions opened but never attached within the attach timeout."""
        cutoff = time.monotonic() - self.limits.attach_timeout_seconds
        with self._lock:
            stale = [
                h
                for h in self._hosted.values()
                if h.transport == "grpc" and not h.attached and h.opened < cutoff
            ]
        for hosted in stale:
            log.info("closing session %s: never attached", hosted.session_id)
            with contextlib.suppress(ModeldError):
                hosted.close()
        return [h.session_id for h in stale]
