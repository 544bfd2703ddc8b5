"""A session: one client's logical context on one loaded model, as a small state machine.

States: *open* (no prefix yet) -> *prefixed* (``ensure_prefix`` done; ``prefill_suffix`` and
``decode`` allowed) -> *closed*. One operation runs at a time. Each operation:

1. is admitted (``_operation``: open, fenced, not shutting down, a model slot: see
   ``engine/admission.py``);
2. prepares its input (``engine/prepare.py``: pure, nothing resident changes on bad input);
3. takes a lease on a warm context from the model's cache (``modeld/cache/residency.py``: which
   sequence, what is reused, from where, and why) and brings that sequence to the target tokens
   with one sync job in the engine, reporting progress and honouring cancellation;
4. records the engine's own counts in the cache and answers with exact accounting.

``decode`` hands the lease to an :class:`~modeld.engine.decode.EngineDecodeStream`, which ends
the turn. The service the session belongs to is reached only through :class:`SessionHost`, so
this module does not import the engine (no import circle).
"""

from __future__ import annotations

import contextlib
import logging
import threading
import time
import uuid
from collections.abc import Callable, Iterator
from dataclasses import replace
from types import TracebackType
from typing import Protocol

from modeld.backends.base import SyncStep
from modeld.cache.residency import Lease, SessionSlot
from modeld.contract import (
    Config,
    ContextReport,
    DecodeConfig,
    ErrorDetail,
    ModelInfo,
    OpenSessionRequest,
    PrefillProgress,
    PrefixInput,
    PrefixStatus,
    ProgressCallback,
    SessionSummary,
    SuffixInput,
    SuffixStatus,
    WarmContextInfo,
)
from modeld.decoding.output import plan_decode
from modeld.engine.admission import Ticket
from modeld.engine.churn import SegmentChurn
from modeld.engine.decode import DecodeRun, EngineDecodeStream
from modeld.engine.limits import Limits
from modeld.engine.model import LoadedModel
from modeld.engine.owner import Owner
from modeld.engine.prepare import ChatState, identity_of, prepare_prefix, prepare_suffix
from modeld.engine.validate import validate_decode, validate_logit_bias
from modeld.errors import (
    BusyError,
    EngineRestartedError,
    ModeldError,
    OperationTimeoutError,
    PrefixRequiredError,
    SessionClosedError,
    ShuttingDownError,
    StallTimeoutError,
)
from modeld.manifest import ContextManifest
from modeld.settings import Timeouts
from modeld.workers.host import Call
from modeld.workers.protocol import Finished, Progress

__all__ = ["EngineDecodeStream", "EngineSession", "SessionHost"]

log = logging.getLogger("modeld.engine")

PROGRESS_INTERVAL = 0.5
"""Seconds between two progress reports of a long prefill."""

_DEAD = (EngineRestartedError, StallTimeoutError)
"""Errors after which the engine's state is gone (the cache is reset by the supervisor)."""


class SessionHost(Protocol):
    """What a session needs from the service that opened it."""

    limits: Limits
    timeouts: Timeouts

    @property
    def owner(self) -> Owner: ...

    @property
    def stopping(self) -> bool: ...

    def forget(self, session: EngineSession, report: ContextReport) -> None: ...

    def changed(self, model: LoadedModel, identity: ContextManifest) -> tuple[str, str, str] | None:
        """The runtime field that differs from the last warm state of this model file, if any."""
        ...

    def touched(self, model: LoadedModel, identity: ContextManifest) -> None: ...


class EngineSession:
    """A session: one client's logical context on one loaded model."""

    def __init__(
        self,
        service: SessionHost,
        model: LoadedModel,
        request: OpenSessionRequest,
        info: ModelInfo,
        config: Config,
        epoch: int,
    ) -> None:
        self._service = service
        self.model = model
        self.request = request
        self._info = info
        self.config = config
        self.epoch = epoch
        self._id = uuid.uuid4().hex[:16]
        self._identity = identity_of(info, config)
        self._window = model.window
        self.slot: SessionSlot = model.cache.slot(
            self._id,
            self._identity.digest(),
            pinned=request.pin,
            keep_alive=request.keep_alive_seconds or None,
        )
        self._tokens: list[int] = []
        self._n_prefix = 0
        self._n_suffix = 0
        self._manifest: ContextManifest | None = None
        self._chat: ChatState | None = None
        self._tools_json = ""  # the chat prefix's tools (what a decode's tool calls may name)
        self._churn = SegmentChurn()
        self._prefix_status: PrefixStatus | None = None
        self._turn_computed = 0
        self._turn_prefill_ms = 0.0
        self._turn_restore_ms = 0.0
        self._closed = False
        self._interrupted = threading.Event()
        self._stream: EngineDecodeStream | None = None
        self._call: Call | None = None
        self._op_lock = threading.Lock()
        self._last_wait = 0.0
        self.opened_at = time.time()
        self.last_used_at = self.opened_at
        self._end_lock = threading.Lock()
        self._end_listeners: list[Callable[[ModeldError], None]] | None = []

    # --- contract ------------------------------------------------------------------------

    @property
    def session_id(self) -> str:
        return self._id

    @property
    def info(self) -> ModelInfo:
        return self._info

    @property
    def identity(self) -> ContextManifest:
        """The runtime fields this session's manifests carry (what a builder should fill in)."""
        return self._identity

    @property
    def closed(self) -> bool:
        return self._closed

    def ensure_prefix(self, prefix: PrefixInput, progress: ProgressCallback | None = None) -> PrefixStatus:
        with self._operation(getattr(prefix, "no_wait", None)) as ticket:
            del ticket
            model = self.model
            prep = prepare_prefix(
                prefix,
                identity=self._identity,
                config=self.config,
                info=self._info,
                limits=self._service.limits,
                window=self._window,
                vocab=model.vocab,
                renderer=model.chat_renderer,
                tokenize=model.tokenize,
            )
            tokens = prep.tokens
            changed = self._service.changed(model, self._identity)
            before = self.model.cache.kv_tokens(self.slot, self._tokens)
            lease = model.cache.begin(self.slot, tokens, manifest=prep.manifest, floor=0, changed=changed)
            try:
                evaluated, prefill_ms = self._sync(lease, tokens, "prefix", progress)
                model.cache.set_prefix(lease, len(tokens))
                model.cache.persist_prefix(lease, evaluated)
            finally:
                model.cache.release(lease)
            self._service.touched(model, self._identity)
            decision = lease.decision
            if decision.diverged_at_token is not None:
                k = decision.diverged_at_token
                decision = replace(decision, diverged_at_byte=prep.ends[k - 1] if k > 0 else 0)
            self._tokens = list(tokens)
            self._n_prefix, self._n_suffix = len(tokens), 0
            self._manifest = prep.manifest
            self._chat = prep.chat
            self._tools_json = prefix.tools_json if prep.chat is not None else ""
            self._churn.observe(prep.manifest)
            self._turn_computed = len(tokens) - lease.keep
            self._turn_prefill_ms = prefill_ms
            self._turn_restore_ms = lease.restore_ms
            status = PrefixStatus(
                reused_tokens=lease.keep,
                prefilled_tokens=len(tokens) - lease.keep,
                dropped_tokens=max(0, before - lease.keep),
                prefix_tokens=len(tokens),
                resident_tokens=len(tokens),
                available_tokens=self._window - len(tokens),
                stable_byte_hash=prep.manifest.stable_byte_hash,
                stable_token_hash=prep.manifest.stable_token_hash,
                manifest_digest=prep.manifest.digest(),
                reuse=decision,
                prefill_ms=round(prefill_ms, 3),
                restore_ms=round(lease.restore_ms, 3),
            )
            self._prefix_status = status
            return status

    def prefill_suffix(self, suffix: SuffixInput, progress: ProgressCallback | None = None) -> SuffixStatus:
        with self._operation(getattr(suffix, "no_wait", None)):
            if self._manifest is None:
                raise PrefixRequiredError("prefill_suffix needs a prefix: call ensure_prefix first")
            model = self.model
            prep = prepare_suffix(
                suffix,
                current=self._manifest,
                chat=self._chat,
                n_prefix=self._n_prefix,
                identity=self._identity,
                limits=self._service.limits,
                window=self._window,
                vocab=model.vocab,
                renderer=model.chat_renderer,
                tokenize=model.tokenize,
            )
            target = self._tokens[: self._n_prefix] + prep.tokens
            lease = model.cache.begin(self.slot, target, manifest=prep.manifest, floor=self._n_prefix)
            try:
                _, prefill_ms = self._sync(lease, target, "suffix", progress)
            finally:
                model.cache.release(lease)
            restored = max(0, self._n_prefix - lease.keep)
            self._tokens = target
            self._n_suffix = len(prep.tokens)
            self._manifest = prep.manifest
            self._turn_computed += len(target) - lease.keep
            self._turn_prefill_ms += prefill_ms
            self._turn_restore_ms += lease.restore_ms
            return SuffixStatus(
                suffix_tokens=len(prep.tokens),
                prefix_tokens=self._n_prefix,
                resident_tokens=len(target),
                available_tokens=self._window - len(target),
                manifest_digest=prep.manifest.digest(),
                restored_tokens=restored,
                prefill_ms=round(prefill_ms, 3),
                restore_ms=round(lease.restore_ms, 3),
            )

    def decode(self, config: DecodeConfig) -> EngineDecodeStream:
        no_wait = getattr(config, "no_wait", None)
        with self._operation(no_wait, keep_ticket=True) as ticket:
            model = self.model
            validate_decode(config, self._service.limits, self._info.capabilities, self._window)
            validate_logit_bias(config, self._info.vocab_size)
            if self._manifest is None or not self._tokens:
                raise PrefixRequiredError("decode needs a resident context: call ensure_prefix first")
            chat = self._chat is not None
            plan = plan_decode(  # tools, tool_choice, the constraint compiled (cached by digest)
                config,
                prefix_tools_json=self._tools_json,
                chat_template=self._info.chat_template if chat else "",
            )
            engine_config = plan.engine_config(config)
            host = model.host()
            host.check_decode(engine_config)
            tokens = list(self._tokens)
            room = max(0, min(config.max_tokens, self._window - len(tokens)))
            lease = model.cache.begin(
                self.slot, tokens, manifest=self._manifest, floor=self._n_prefix, extra_cells=room
            )
            try:
                _, prefill_ms = self._sync(lease, tokens, "decode", None)
                call = host.start_generate(
                    lease.context.seq, engine_config, room, self._service.timeouts.stream_interval_seconds
                )
            except BaseException:
                model.cache.release(lease)
                raise
            self._call = call
            self._turn_computed += len(tokens) - lease.keep
            self._turn_prefill_ms += prefill_ms
            self._turn_restore_ms += lease.restore_ms
            timeouts = self._service.timeouts
            run = DecodeRun(
                call=call,
                vocab=model.vocab,
                config=config,
                plan=plan,
                requested=room,
                prompt=len(tokens),
                cached=max(0, len(tokens) - self._turn_computed),
                prefill_ms=round(self._turn_prefill_ms, 3),
                restore_ms=round(self._turn_restore_ms, 3),
                idle_seconds=timeouts.idle_stream_seconds,
                deadline=(time.monotonic() + timeouts.operation_seconds)
                if timeouts.operation_seconds
                else None,
                interrupted=self._interrupt_detail,
                finish=lambda emitted, sampled, resident, exc: self._decoded(
                    lease, ticket, emitted, sampled, resident, exc
                ),
            )
            stream = EngineDecodeStream(run)
            self._stream = stream
            return stream

    def explain_context(self) -> ContextReport:
        manifest = self._manifest
        n = len(self._tokens)
        model = self.model
        kv = 0 if self._closed else model.cache.kv_tokens(self.slot, self._tokens)
        position, waited = model.admission.position(self._id)
        context = self.slot.context
        return ContextReport(
            session_id=self._id,
            model_name=self._info.model_name,
            backend=self._info.backend,
            num_ctx=self._window,
            resident_tokens=n,
            prefix_tokens=self._n_prefix,
            suffix_tokens=self._n_suffix,
            generated_tokens=n - self._n_prefix - self._n_suffix,
            available_tokens=self._window - n,
            kv_tokens=kv,
            stable_byte_hash=manifest.stable_byte_hash if manifest else "",
            stable_token_hash=manifest.stable_token_hash if manifest else "",
            volatile_token_hash=manifest.volatile_token_hash if manifest else "",
            manifest_digest=manifest.digest() if manifest else "",
            manifest=manifest,
            closed=self._closed,
            last_reuse=self._prefix_status.reuse if self._prefix_status else None,
            last_prefix=self._prefix_status,
            owner_epoch=self.epoch,
            opened_at=self.opened_at,
            last_used_at=self.last_used_at,
            context_id=context.id if context is not None and kv else "",
            contexts=warm_contexts(model),
            queue_position=position,
            queue_wait_seconds=round(waited if position else self._last_wait, 3),
            pinned=self.slot.pinned,
            keep_alive_seconds=self.slot.keep_alive or 0.0,
            changing_segments=self._churn.changing(),
            kv_layout=model.layout.name,
            warm_exact=model.layout.exact,
        )

    def interrupt(self) -> None:
        """Stop whatever this session is running (its stream ended, shutdown, lost ownership)."""
        self._interrupted.set()
        call = self._call
        if call is not None:
            call.cancel()
        self._notify_end()

    def on_end(self, listener: Callable[[ModeldError], None]) -> None:
        """Call ``listener`` once, with the error operations now raise, when this session can no
        longer be used: closed, or interrupted (owner revoked, daemon stopping, its transport
        gone). At once if that already happened. Transports end their streams on it instead of
        polling the session."""
        with self._end_lock:
            if self._end_listeners is not None:
                self._end_listeners.append(listener)
                return
        listener(self._end_error())

    def close(self) -> None:
        if self._closed:
            return
        self._interrupted.set()
        call = self._call
        if call is not None:
            call.cancel()
        stream = self._stream
        if stream is not None:
            stream.close()
        with self._op_lock:
            self._closed = True
            self._stream = None
            report = self.explain_context()
            self.model.cache.forget_session(self.slot)
            self._service.forget(self, report)
        self._notify_end()
        log.info("session %s closed", self._id)

    def __enter__(self) -> EngineSession:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.close()

    # --- observers -----------------------------------------------------------------------

    def summary(self) -> SessionSummary:
        n = len(self._tokens)
        return SessionSummary(
            session_id=self._id,
            model_name=self._info.model_name,
            backend=self._info.backend,
            path=self._info.path,
            owner_epoch=self.epoch,
            opened_at=self.opened_at,
            last_used_at=self.last_used_at,
            num_ctx=self._window,
            resident_tokens=n,
            prefix_tokens=self._n_prefix,
            available_tokens=self._window - n,
            last_outcome=self._prefix_status.reuse.outcome if self._prefix_status else "",
            closed=self._closed,
        )

    # --- internals -----------------------------------------------------------------------

    @contextlib.contextmanager
    def _operation(self, no_wait: bool | None, *, keep_ticket: bool = False) -> Iterator[Ticket]:
        """Admission for every operation: open, fenced, not shutting down, one at a time, a slot.

        With ``keep_ticket`` the slot stays taken when the operation succeeds (a decode gives it
        back when its stream ends)."""
        if self._closed:
            raise SessionClosedError(f"session {self._id} is closed", session_id=self._id)
        self._service.owner.check_epoch(self.epoch)
        if self._service.stopping:
            raise ShuttingDownError("the daemon is shutting down")
        stream = self._stream
        if stream is not None:  # a new operation ends the previous decode
            stream.close()
            self._stream = None
        if not self._op_lock.acquire(blocking=False):
            raise BusyError(
                f"session {self._id} is already running an operation; sessions are not for concurrent use"
            )
        ticket: Ticket | None = None
        handed_over = False
        try:
            if self._closed:
                raise SessionClosedError(f"session {self._id} is closed", session_id=self._id)
            wait = self.request.no_wait if no_wait is None else no_wait
            try:
                ticket = self.model.admission.acquire(
                    self._id, no_wait=wait, interrupted=self._interrupted.is_set
                )
            except InterruptedError:
                self._raise_interrupted()
            assert ticket is not None
            self._last_wait = ticket.waited
            self.last_used_at = time.time()
            self.model.last_used_at = self.last_used_at
            yield ticket
            handed_over = keep_ticket
        finally:
            self._call = None if not handed_over else self._call
            if ticket is not None and not handed_over:
                self.model.admission.release(ticket)
            self._op_lock.release()

    def _sync(
        self, lease: Lease, target: list[int], stage: str, progress: ProgressCallback | None
    ) -> tuple[int, float]:
        """Bring the lease's sequence to ``target``: (tokens evaluated, milliseconds)."""
        model = self.model
        keep = lease.keep
        if (
            keep >= len(target)
            and lease.context.tokens[: len(target)] == target
            and len(lease.context.tokens) == len(target)
        ):
            return 0, 0.0
        started = time.monotonic()
        deadline = (
            started + self._service.timeouts.operation_seconds
            if self._service.timeouts.operation_seconds
            else None
        )
        reporter = _Progress(stage, started, progress)
        try:
            host = model.host()
            for _attempt in range(2):
                call = host.start_sync(lease.context.seq, keep, target[keep:])
                self._call = call
                if self._interrupted.is_set():
                    call.cancel()
                finished = _wait_sync(call, reporter, deadline)
                model.cache.synced(lease, kept=finished.kept, resident=finished.resident, target=target)
                if finished.canceled:
                    break
                if finished.kept < keep:  # the engine could not keep that much: evaluate the rest
                    keep = finished.kept
                    continue
                break
        except OperationTimeoutError:
            raise
        except _DEAD as exc:
            model.cache.fail(lease, exc, engine_alive=False)
            raise
        except ModeldError as exc:
            model.cache.fail(lease, exc, engine_alive=True)
            raise
        finally:
            self._call = None
        if finished.canceled or finished.resident < len(target):
            if deadline is not None and time.monotonic() >= deadline:
                raise OperationTimeoutError(
                    f"the {stage} prefill ran past the operation timeout (operation_seconds): it was stopped "
                    f"after {finished.resident} of {len(target)} tokens",
                    timeout="operation_seconds",
                )
            self._raise_interrupted()
        return len(target) - keep, (time.monotonic() - started) * 1000.0

    def _decoded(
        self,
        lease: Lease,
        ticket: Ticket,
        emitted: list[int],
        sampled: list[int],
        resident: int | None,
        exc: ModeldError | None,
    ) -> None:
        """The decode stream ended: record what the engine holds, give back the lease and slot."""
        cache = self.model.cache
        try:
            if resident is not None:
                cache.generated(lease, sampled, resident)
            elif exc is not None:
                cache.fail(lease, exc, engine_alive=not isinstance(exc, _DEAD))
        finally:
            cache.release(lease)
            self.model.admission.release(ticket)
            self._call = None
        self._tokens.extend(emitted)
        self._turn_computed += len(emitted)

    def _raise_interrupted(self) -> None:
        """Raise the error that explains why an operation was interrupted."""
        raise self._end_error()

    def _interrupt_detail(self) -> ErrorDetail | None:
        if not self._interrupted.is_set():
            return None
        error = self._end_error()
        return ErrorDetail(reason=error.reason, message=error.message)

    def _notify_end(self) -> None:
        with self._end_lock:
            listeners, self._end_listeners = self._end_listeners, None
        if not listeners:
            return
        error = self._end_error()
        for listener in listeners:
            try:
                listener(error)
            except Exception:
                log.exception("a session-end listener of %s failed", self._id)

    def _end_error(self) -> ModeldError:
        try:
            self._service.owner.check_epoch(self.epoch)
        except ModeldError as exc:
            return exc
        if self._service.stopping:
            return ShuttingDownError("the daemon is shutting down")
        return SessionClosedError(f"session {self._id} was closed", session_id=self._id)


class _Progress:
    """Reports a long prefill at most every :data:`PROGRESS_INTERVAL` seconds."""

    def __init__(self, stage: str, started: float, callback: ProgressCallback | None) -> None:
        self.stage = stage
        self.started = started
        self.callback = callback
        self.last = started

    def __call__(self, step: SyncStep) -> None:
        if self.callback is None:
            return
        now = time.monotonic()
        if now - self.last < PROGRESS_INTERVAL:
            return  # at most one report per interval (and none for a short prefill)
        self.last = now
        try:
            self.callback(
                PrefillProgress(self.stage, step.evaluated, step.total, (now - self.started) * 1000.0)
            )
        except Exception:
            log.exception("a progress callback failed")


def _wait_sync(call: Call, progress: _Progress, deadline: float | None) -> Finished:
    """Read a sync job's replies to its end, cancelling it at ``deadline``."""
    while True:
        timeout = None if deadline is None else max(0.0, deadline - time.monotonic())
        event = call.next_event(timeout=timeout if timeout is None else max(timeout, 0.01))
        if event is None:
            call.cancel()
            deadline = None
            continue
        if isinstance(event, Progress):
            progress(event.step())
        elif isinstance(event, Finished):
            return event


def warm_contexts(model: LoadedModel) -> tuple[WarmContextInfo, ...]:
    return tuple(
        WarmContextInfo(
            id=v.id,
            tier=v.tier,
            tokens=v.tokens,
            prefix_tokens=v.prefix_tokens,
            bytes=v.bytes,
            shared_bytes=v.shared_bytes,
            last_used_at=v.last_used,
            pinned=v.pinned,
            session_id=v.session,
        )
        for v in model.cache.views()
    )
