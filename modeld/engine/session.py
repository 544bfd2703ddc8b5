"""A session: one client's logical context on one loaded model, as a small state machine.

States: *open* (no prefix yet) -> *prefixed* (``ensure_prefix`` done; ``prefill_suffix`` and
``decode`` allowed) -> *closed*. One operation runs at a time. Each operation:

1. is admitted (``_operation``: open, fenced, not shutting down, a model slot: see
   ``engine/admission.py``);
2. prepares its input (``engine/prepare.py``: pure, nothing resident changes on bad input);
3. holds its warm context in the model's cache (``modeld/cache/warm.py``: which sequence, what
   is reused, from where, and why), which brings that sequence to the target tokens with one
   sync job in the engine, reporting progress and honouring cancellation;
4. answers with exact accounting.

``decode`` hands its hold to an :class:`~modeld.engine.decode.EngineDecodeStream`, which ends
the turn. The service the session belongs to is reached only through :class:`SessionService`,
so this module does not import the engine (no import circle).
"""

from __future__ import annotations

import contextlib
import logging
import threading
import time
import uuid
from collections.abc import Callable, Iterator
from dataclasses import dataclass, replace
from typing import Protocol

from modeld.cache.hold import DECODE_CELLS, Forks, Hold, Synced
from modeld.cache.pool import SessionSlot
from modeld.cache.reuse import common_prefix_len
from modeld.context import SegmentChurn
from modeld.contract import (
    Closing,
    Config,
    ContextReport,
    DecodeConfig,
    ErrorDetail,
    ModelInfo,
    OpenSessionRequest,
    PrefixInput,
    PrefixStatus,
    ProgressCallback,
    SuffixInput,
    SuffixStatus,
)
from modeld.decoding.output import plan_decode
from modeld.decoding.speculation import DecodeStats
from modeld.engine.admission import Ticket
from modeld.engine.decode import ChoiceCall, ChoicesStream, DecodeRun, EngineDecodeStream
from modeld.engine.ending import SessionEnd
from modeld.engine.model import GenerateCall, LoadedModel
from modeld.engine.owner import Owner
from modeld.engine.prepare import (
    ChatState,
    PreparedPrefix,
    Preparer,
    identity_of,
    part_at,
    same_text,
    segment_at,
    template_note,
)
from modeld.engine.validate import validate_decode, validate_logit_bias
from modeld.errors import (
    BusyError,
    ModeldError,
    PrefixRequiredError,
    SessionClosedError,
    ShuttingDownError,
    UnsupportedError,
)
from modeld.manifest import ContextManifest
from modeld.observe.status import SessionSummary
from modeld.settings import Limits, Timeouts

__all__ = ["EngineDecodeStream", "EngineSession", "SessionService"]

log = logging.getLogger("modeld.engine")

_PROMPT_TAIL = 16
"""Tokens of the prompt's end read for whether it opened a thinking block (the generation prompt)."""


class SessionService(Protocol):
    """What a session needs from the service that opened it."""

    limits: Limits
    timeouts: Timeouts
    speculation: str
    """A decode's speculation mode when its config leaves it unset (``--speculation``)."""

    @property
    def owner(self) -> Owner: ...

    @property
    def stopping(self) -> bool: ...

    def forget(self, session: EngineSession, report: ContextReport) -> None: ...


@dataclass
class _Turn:
    """What the turn since the last ``ensure_prefix`` cost (a decode's usage reports it)."""

    computed: int = 0
    prefill_ms: float = 0.0
    restore_ms: float = 0.0

    def add(self, computed: int, synced: Synced, hold: Hold) -> None:
        self.computed += computed
        self.prefill_ms += synced.ms
        self.restore_ms += hold.restore_ms


class EngineSession(Closing):
    """A session: one client's logical context on one loaded model."""

    def __init__(
        self,
        service: SessionService,
        model: LoadedModel,
        request: OpenSessionRequest,
        info: ModelInfo,
        config: Config,
        epoch: int,
    ) -> None:
        self._service = service
        self._spec_mode = ""  # the last decode's speculation mode
        self._spec_total = DecodeStats()  # what speculation did over the session's decodes
        self.model = model
        self.request = request
        self._info = info
        self.config = config
        self.epoch = epoch
        self._id = uuid.uuid4().hex[:16]
        self._identity = identity_of(info, config)
        self._window = model.window
        self._prepare = Preparer(
            self._identity,
            config,
            info,
            service.limits,
            model.window,
            model.vocab,
            lambda: model.chat_renderer(info.chat_template),
            model.tokenize,
            model.prefixes,
        )
        pinned, keep_alive = request.pin, request.keep_alive_seconds or None
        self.slot: SessionSlot = model.cache.slot(
            self._id, self._identity.digest(), pinned=pinned, keep_alive=keep_alive
        )
        self._tokens: list[int] = []
        self._n_prefix = 0
        self._n_suffix = 0
        self._manifest: ContextManifest | None = None
        self._chat: ChatState | None = None
        self._tools_json = ""  # the chat prefix's tools (what a decode's tool calls may name)
        self._chat_format = config.prompt_format == "chat"
        self._tools_tokens: tuple[int, int] | None = None  # where the template put them
        self._churn = SegmentChurn()
        self._prefix_status: PrefixStatus | None = None
        self._ahead_status: PrefixStatus | None = None  # the last prefix computed ahead of a turn
        self._turn = _Turn()
        self._closed = False
        self._end = SessionEnd(self._id, epoch, lambda: service.owner, lambda: service.stopping)
        self._stream: EngineDecodeStream | ChoicesStream | None = None
        self._op_lock = threading.Lock()
        self._last_wait = 0.0
        self.opened_at = time.time()
        self.last_used_at = self.opened_at

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
        with self._operation(getattr(prefix, "no_wait", None)):
            prep = self._prepare.prefix(prefix)
            tokens = prep.tokens
            ahead = getattr(prefix, "ahead", False)  # no turn: its report apart, its cells idle after
            before = self.model.cache.kv_tokens(self.slot, self._tokens)
            had = list(self._tokens)
            prior = (self._manifest, self._n_prefix + self._n_suffix)  # the manifest, the prompt's size
            head = self._head(tokens)
            with self.model.cache.hold(
                self.slot, tokens, stage="prefix", manifest=prep.manifest, head=head, ahead=ahead
            ) as hold:
                synced = self._sync(hold, progress)
                self.model.check_file()  # changed during the prefill: never commit (or persist) it
                hold.commit(prefix=len(tokens))
            self._tokens, self._n_prefix, self._n_suffix = list(tokens), len(tokens), 0
            self._manifest, self._chat = prep.manifest, prep.chat
            self._tools_json = prefix.tools_json if prep.chat is not None else ""
            self._tools_tokens = prep.tools
            if not ahead:
                self._churn.observe(prep.manifest.segments)
            self._turn = _Turn(len(tokens) - hold.keep, synced.ms, hold.restore_ms)
            dropped = max(0, before - hold.keep)
            status = self._status(prep, hold, synced, dropped=dropped, had=had, previous=prior)
            if ahead:  # ContextReport.ahead; the last turn's report stays
                self._ahead_status = status
            else:
                self._prefix_status = status
            return status

    def prefill_suffix(self, suffix: SuffixInput, progress: ProgressCallback | None = None) -> SuffixStatus:
        with self._operation(getattr(suffix, "no_wait", None)):
            if self._manifest is None:
                raise PrefixRequiredError("prefill_suffix needs a prefix: call ensure_prefix first")
            prep = self._prepare.suffix(
                suffix, current=self._manifest, chat=self._chat, prefix_tokens=self._tokens[: self._n_prefix]
            )
            keep = prep.keep
            target = self._tokens[:keep] + prep.tokens
            cache = self.model.cache
            with cache.hold(self.slot, target, stage="suffix", manifest=prep.manifest, floor=keep) as hold:
                synced = self._sync(hold, progress)
            if keep < self._n_prefix:
                self._cut_prefix(keep, prep.manifest)
                # What ensure_prefix computed past the cut is not part of the prompt: the usage
                # counts a prompt token as computed (not cached) only where this turn computed it.
                reused = self._prefix_status.reused_tokens if self._prefix_status else 0
                self._turn.computed -= max(0, self._n_prefix - max(keep, reused))
            self._tokens, self._n_suffix, self._manifest = target, len(prep.tokens), prep.manifest
            self._n_prefix = keep
            self._turn.add(len(target) - hold.keep, synced, hold)
            return SuffixStatus(
                suffix_tokens=len(prep.tokens),
                prefix_tokens=keep,
                resident_tokens=len(target),
                available_tokens=self._window - len(target),
                manifest_digest=prep.manifest.digest(),
                restored_tokens=max(0, keep - hold.keep),
                prefill_ms=round(synced.ms, 3),
                restore_ms=round(hold.restore_ms, 3),
                reused_tokens=max(0, hold.keep - keep),
            )

    def _cut_prefix(self, keep: int, manifest: ContextManifest) -> None:
        """The chat template renders the prefix otherwise once the suffix follows it (or a token
        straddles the cut): the prefix was cut back to its first ``keep`` tokens. The turn's reuse
        explanation (explain-context) and the log say where, in which message, and why."""
        cut = self._n_prefix
        index = segment_at(manifest, keep)
        where = (
            f"message {index} ({manifest.segments[index].chat_role})"
            if index is not None
            else "the template's text"
        )
        words = (
            f"the chat template renders the whole conversation otherwise than the prefix from token {keep} "
            f"({where}) on: the prefix was cut back from {cut} to {keep} tokens and the rest computed with "
            "the suffix (the template did it, not the client)"
        )
        log.info("session %s: %s", self._id, words)
        status = self._prefix_status
        if status is not None:
            reuse = replace(status.reuse, message=f"{status.reuse.message}; then {words}")
            self._prefix_status = replace(status, reuse=reuse)

    def decode(self, config: DecodeConfig) -> EngineDecodeStream | ChoicesStream:
        """The decode's stream. ``config.n`` > 1: its choices decoded together on sequences
        forked from this one (:class:`ChoicesStream`; the session's own context then holds choice
        0, as a one-choice decode leaves it), or ``unsupported`` naming ``n`` with the reason
        when the backend or the KV pool cannot (no code ran: the caller decodes the choices one
        after another)."""
        with self._operation(getattr(config, "no_wait", None), keep_ticket=True) as ticket:
            model = self.model
            validate_decode(config, self._service.limits, self._info.capabilities, self._window)
            validate_logit_bias(config, self._info.vocab_size)
            model.backend.check_decode(config)  # here, not in the worker: no round trip
            if self._manifest is None or not self._tokens:
                raise PrefixRequiredError("decode needs a resident context: call ensure_prefix first")
            chat_template = self._info.chat_template if self._chat is not None else ""
            limits = self._service.limits
            tail = b"".join(model.vocab.piece(t) for t in self._tokens[-_PROMPT_TAIL:])
            plan = plan_decode(
                config,
                prefix_tools_json=self._tools_json,
                chat_template=chat_template,
                model_format=self._info.tool_format if self._chat is not None else "",
                prompt_tail=tail.decode("utf-8", errors="replace") if chat_template else "",
                max_tools=limits.max_tools,
                max_constraint_bytes=limits.max_constraint_bytes,
            )
            engine_config = plan.engine_config(config)  # tools, tool_choice, the constraint compiled
            n = config.n
            # Choices decode plainly, together (a batch of one token per choice per step).
            speculation = self._speculation(config) if n == 1 else "off"
            engine_config = replace(engine_config, speculation=speculation)
            self._spec_mode = engine_config.speculation
            host = model.host()
            tokens = list(self._tokens)
            room = max(0, min(config.max_tokens, self._window - len(tokens)))
            # On a shared pool a decode takes its cells as it grows (DECODE_CELLS at a time), never
            # its whole room up front; choices decoded together reserve theirs (Hold.fork).
            grows = n == 1 and model.layout.shared_cells and room > DECODE_CELLS
            cells = DECODE_CELLS if grows else room
            hold = model.cache.hold(
                self.slot,
                tokens,
                stage="decode",
                manifest=self._manifest,
                floor=self._n_prefix,
                extra_cells=cells,
            )
            timeouts = self._service.timeouts
            forks: Forks | None = None
            try:
                synced = self._sync(hold, None)
                if n > 1:
                    got = hold.fork(n - 1, room)
                    if isinstance(got, str):
                        log.info("session %s: %d choices decoded one after another: %s", self._id, n, got)
                        raise UnsupportedError(got, field="n")
                    forks = got
                call = GenerateCall(
                    host.start_generate(
                        hold.seq,
                        engine_config,
                        room,
                        timeouts.stream_interval_seconds,
                        forks.seqs if forks is not None else (),
                        cells=cells if grows else 0,
                    )
                )
            except BaseException:
                if forks is not None:
                    forks.release()
                hold.release()
                raise
            self._end.running = call
            self._turn.add(len(tokens) - hold.keep, synced, hold)

            def run(choice: int) -> DecodeRun:
                def finish(
                    emitted: list[int], sampled: list[int], resident: int | None, exc: ModeldError | None
                ) -> None:
                    if choice == 0:  # a fork's tokens leave no warm state (its cells are freed)
                        self._decoded(hold, ticket, emitted, sampled, resident, exc)

                return DecodeRun(
                    call=call if forks is None else ChoiceCall(call, choice),
                    vocab=model.vocab,
                    config=config,
                    plan=plan,
                    requested=room,
                    prompt=len(tokens),
                    cached=max(0, len(tokens) - self._turn.computed),
                    prefill_ms=round(self._turn.prefill_ms, 3),
                    restore_ms=round(self._turn.restore_ms, 3),
                    idle_seconds=timeouts.idle_stream_seconds,
                    deadline=self._deadline(),
                    interrupted=self._end.detail,
                    verify=self._model_intact,
                    finish=finish,
                    speculated=self._speculated if choice == 0 else None,
                    ended=hold.ended if choice == 0 else None,
                    room=hold.grower(len(tokens) + room) if grows else None,
                    room_error=(lambda: hold.grow_error) if grows else None,
                )

            if forks is None:
                self._stream = EngineDecodeStream(run(0))
            else:
                streams = [EngineDecodeStream(run(i), i) for i in range(n)]
                self._stream = ChoicesStream(call, streams, forks.release)
            return self._stream

    def _speculated(self, stats: DecodeStats) -> None:
        total = self._spec_total
        total.drafted += stats.drafted
        total.accepted += stats.accepted
        total.verifies += stats.verifies
        total.forced += stats.forced

    def _speculation(self, config: DecodeConfig) -> str:
        """The decode's speculation mode: the request's, else the daemon's where the backend
        offers it, else off (blueprint 0021)."""
        if config.speculation:
            return config.speculation
        default = self._service.speculation
        return default if default in self._info.capabilities.speculation else "off"

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
            contexts=model.warm_contexts(),
            queue_position=position,
            queue_wait_seconds=round(waited if position else self._last_wait, 3),
            pinned=self.slot.pinned,
            keep_alive_seconds=self.slot.keep_alive or 0.0,
            changing_segments=self._churn.changing(),
            tools_token_start=self._tools_tokens[0] if self._tools_tokens else None,
            tools_token_end=self._tools_tokens[1] if self._tools_tokens else None,
            kv_layout=model.layout.name,
            warm_exact=model.layout.exact,
            speculation=self._spec_mode,
            drafted_tokens=self._spec_total.drafted,
            accepted_tokens=self._spec_total.accepted,
            draft_batches=self._spec_total.verifies,
            forced_tokens=self._spec_total.forced,
            ahead=self._ahead_status,
        )

    def interrupt(self, cause: ModeldError | None = None) -> None:
        """Stop whatever this session is running (its stream ended, shutdown, lost ownership, its
        model file changed). ``cause``: the error its operations raise from now on."""
        self._end.interrupt(cause=cause)

    def on_end(self, listener: Callable[[ModeldError], None]) -> None:
        """Call ``listener`` once, with the error operations now raise, when this session can no
        longer be used: closed, or interrupted (owner revoked, daemon stopping, its transport
        gone). At once if that already happened. Transports end their streams on it instead of
        polling the session."""
        self._end.on_end(listener)

    def close(self) -> None:
        if self._closed:
            return
        self._end.interrupt(notify=False)
        stream = self._stream
        if stream is not None:
            stream.close()
        with self._op_lock:
            self._closed = True
            self._stream = None
            report = self.explain_context()
            self.model.cache.forget_session(self.slot)
            self._service.forget(self, report)
        self._end.notify()
        log.info("session %s closed", self._id)

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
            kv_tokens=0 if self._closed else self.model.cache.kv_tokens(self.slot, self._tokens),
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
        self.model.check_file()  # never reuse KV of a model file that changed since (model_changed)
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
                    self._id, no_wait=wait, interrupted=lambda: self._end.interrupted
                )
            except InterruptedError:
                raise self._end.error() from None
            assert ticket is not None
            self._last_wait = ticket.waited
            self.last_used_at = time.time()
            self.model.last_used_at = self.last_used_at
            yield ticket
            handed_over = keep_ticket
        finally:
            self._end.running = None if not handed_over else self._end.running
            if ticket is not None and not handed_over:
                self.model.admission.release(ticket)
            self._op_lock.release()

    def _head(self, tokens: list[int]) -> int:
        """How many of a prefix's first tokens any prefix of this session's format starts with
        (the chat template's head, or BOS): sharing no more is a new conversation, cold."""
        heads = self.model.prefix_heads(
            self._chat_format, bool(self._identity.add_bos), self._info.chat_template
        )
        return max((common_prefix_len(tokens, list(h)) for h in heads), default=0)

    def _model_intact(self) -> ErrorDetail | None:
        """Why a decode's tokens cannot be trusted: its model file changed under it (checked as
        it runs, and once more when the engine finished, before the final chunk)."""
        problem = self.model.file_changed()
        return ErrorDetail(reason=problem.reason, message=problem.message) if problem else None

    def _deadline(self) -> float | None:
        """When the operation starting now is stopped (``operation_seconds``; monotonic)."""
        seconds = self._service.timeouts.operation_seconds
        return time.monotonic() + seconds if seconds else None

    def _sync(self, hold: Hold, progress: ProgressCallback | None) -> Synced:
        """Bring the hold's sequence to its target; cancelable by :meth:`interrupt`."""
        self._end.run(hold)
        try:
            synced = hold.sync(progress, self._deadline())
        finally:
            self._end.running = None
        if not synced.complete:
            raise self._end.error()
        return synced

    def _status(
        self,
        prep: PreparedPrefix,
        hold: Hold,
        synced: Synced,
        dropped: int,
        had: list[int],
        previous: tuple[ContextManifest | None, int],
    ) -> PrefixStatus:
        """An ensure_prefix's accounting; a divergence names its byte in the prefix too, says
        when the text there is the same and only its tokens differ (:func:`~modeld.engine.prepare.same_text`), and
        when the chat template rendered an unchanged message otherwise (``template_note``;
        ``previous``: last turn's manifest and prompt length)."""
        decision = hold.decision
        segment: int | None = None
        part = ""  # a chat prefix's system, tools or messages: the HTTP diagnosis words it
        if decision.diverged_at_token is not None:
            k = decision.diverged_at_token
            segment = segment_at(prep.manifest, k)
            part = part_at(k, prep.manifest.segments, prep.tools) if prep.chat is not None else ""
            decision = replace(decision, diverged_at_byte=prep.ends[k - 1] if k > 0 else 0)
            note = ""
            if prep.chat is not None:
                manifest, prompt = previous  # last turn's; what followed its prompt was generated
                generated = b"".join(self.model.vocab.piece(t) for t in had[prompt:])
                note = template_note(manifest, prep.manifest, k, generated, prep.chat.data)
            if note:
                decision = replace(decision, message=f"{decision.message}; {note}")
                log.info("session %s: prefix diverged at token %d: %s", self._id, k, note)
            if same_text(self.model.vocab.piece, had, prep.tokens, k):
                decision = replace(
                    decision,
                    message=f"{decision.message}; the text there is the same, its tokens are not: the model "
                    "wrote it as a split the tokenizer does not make (the turn uses the text's own "
                    "tokens, so its output equals a fresh evaluation)",
                )
        n = len(prep.tokens)
        return PrefixStatus(
            reused_tokens=hold.keep,
            prefilled_tokens=n - hold.keep,
            dropped_tokens=dropped,
            prefix_tokens=n,
            resident_tokens=n,
            available_tokens=self._window - n,
            stable_byte_hash=prep.manifest.stable_byte_hash,
            stable_token_hash=prep.manifest.stable_token_hash,
            manifest_digest=prep.manifest.digest(),
            reuse=decision,
            prefill_ms=round(synced.ms, 3),
            restore_ms=round(hold.restore_ms, 3),
            diverged_segment_index=segment,
            diverged_part=part,
            context_id=hold.context.id if n else "",
        )

    def _decoded(
        self,
        hold: Hold,
        ticket: Ticket,
        emitted: list[int],
        sampled: list[int],
        resident: int | None,
        exc: ModeldError | None,
    ) -> None:
        """The decode stream ended: record what the engine holds, give back the hold and slot."""
        try:
            hold.decoded(sampled, resident, exc)
        finally:
            self.model.admission.release(ticket)
            self._end.running = None
        self._tokens.extend(emitted)
        self._turn.computed += len(emitted)
