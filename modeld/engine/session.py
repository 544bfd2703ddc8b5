"""A session: one client's logical context on one loaded model, and its decode streams.

This is the contract implemented once for every backend (``blueprints/0001-the-seam.md``):
validation, manifest completion and checks, chat rendering, reuse planning and exact
accounting, UTF-8-safe streaming with stop strings, finish reasons and usage. The backend is
only reached through :class:`~modeld.backends.base.ModelRuntime`.
"""

from __future__ import annotations

import bisect
import contextlib
import functools
import logging
import queue
import threading
import time
import uuid
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import Future
from dataclasses import dataclass, replace
from types import TracebackType
from typing import TYPE_CHECKING, Any

from modeld.backends import Interrupted, ModelRuntime
from modeld.contract import (
    Config,
    ContextReport,
    DecodeConfig,
    ErrorDetail,
    ModelInfo,
    OpenSessionRequest,
    PrefixInput,
    PrefixStatus,
    SessionSummary,
    StreamChunk,
    SuffixInput,
    SuffixStatus,
    Usage,
)
from modeld.engine.chat import Message, messages_for, parse_tools
from modeld.engine.model import LoadedModel
from modeld.engine.reuse import ReusePlan, common_prefix_len, plan_reuse
from modeld.engine.text import TextAssembler
from modeld.engine.validate import encode_text, validate_decode, validate_manifest_size
from modeld.errors import (
    BusyError,
    ContextOverflowError,
    EngineError,
    InvalidArgumentError,
    ManifestMismatchError,
    ModeldError,
    PrefixRequiredError,
    SessionClosedError,
    ShuttingDownError,
)
from modeld.manifest import (
    DEFAULT_CACHE_CLASS,
    RUNTIME_FIELDS,
    ContextManifest,
    Segment,
    bytes_hash,
    check_text,
    runtime_digest,
    token_hash,
)

if TYPE_CHECKING:
    from modeld.engine.engine import Engine

__all__ = ["EngineDecodeStream", "EngineSession", "config_runtime_digest"]

log = logging.getLogger("modeld.engine")


def config_runtime_digest(config: Config) -> str:
    """The manifest's ``runtime_digest`` for a session config (``blueprints/0002``)."""
    return runtime_digest(
        num_ctx=config.num_ctx,
        num_batch=config.num_batch,
        num_gpu_layers=config.num_gpu_layers,
        tensor_split=config.tensor_split,
        flash_attn=config.flash_attn,
        kv_cache_type=config.kv_cache_type,
    )


def _identity(info: ModelInfo, config: Config) -> ContextManifest:
    """The runtime fields every manifest of a session must carry."""
    if config.prompt_template_digest:
        template = config.prompt_template_digest
    else:
        template = info.template_digest if config.prompt_format == "chat" else ""
    return ContextManifest(
        backend=info.backend,
        backend_version=info.backend_version,
        model_digest=info.model_digest,
        tokenizer_digest=info.tokenizer_digest,
        prompt_format=config.prompt_format,
        prompt_template_digest=template,
        runtime_digest=config_runtime_digest(config),
        add_bos=info.add_bos and not config.disable_bos,
    )


def _complete(manifest: ContextManifest, identity: ContextManifest) -> ContextManifest:
    """Fill unstated runtime fields from the session; refuse ones that contradict it."""
    filled: dict[str, object] = {}
    for name in RUNTIME_FIELDS:
        ours = getattr(identity, name)
        theirs = getattr(manifest, name)
        if theirs is None or theirs == "":
            filled[name] = ours
        elif theirs != ours:
            raise ManifestMismatchError(
                f"the manifest's {name} is {theirs!r} but this session's is {ours!r}; "
                f"build the manifest for this session's model and config",
                field=name,
                expected=str(ours),
                got=str(theirs),
            )
    return replace(manifest, **filled)  # type: ignore[arg-type]


def _fill_segments(segments: Sequence[Segment], data: bytes, base: int, stable: bool) -> list[Segment]:
    out: list[Segment] = []
    for seg in segments:
        if seg.stable != stable:
            out.append(seg)
            continue
        out.append(
            replace(
                seg,
                hash=seg.hash or bytes_hash(data[seg.byte_start - base : seg.byte_end - base]),
                cache_class=seg.cache_class or DEFAULT_CACHE_CLASS.get(seg.kind, "turn"),
            )
        )
    return out


def _identity_spans(segments: Sequence[Segment], base: int, *, stable: bool) -> dict[int, tuple[int, int]]:
    """Raw format: the evaluated text is the input text, so spans are the byte ranges."""
    return {i: (s.byte_start - base, s.byte_end - base) for i, s in enumerate(segments) if s.stable == stable}


@dataclass(frozen=True)
class _ChatState:
    """What a chat-format prefix was rendered from (the suffix continues the conversation)."""

    messages: list[Message]
    tools: list[Any] | None


@dataclass
class _Sync:
    plan: ReusePlan
    dropped: int
    evaluated: int


class EngineSession:
    """A session: one client's logical context on one loaded model."""

    def __init__(
        self,
        engine: Engine,
        model: LoadedModel,
        request: OpenSessionRequest,
        info: ModelInfo,
        config: Config,
        epoch: int,
    ) -> None:
        self._engine = engine
        self.model = model
        self.request = request
        self._info = info
        self.config = config
        self.epoch = epoch
        self._id = uuid.uuid4().hex[:16]
        self._identity = _identity(info, config)
        self._n_ctx = config.num_ctx
        self._tokens: list[int] = []
        self._n_prefix = 0
        self._n_suffix = 0
        self._has_prefix = False
        self._manifest: ContextManifest | None = None
        self._chat: _ChatState | None = None
        self._prefix_status: PrefixStatus | None = None
        self._turn_computed = 0
        self._closed = False
        self._interrupted = threading.Event()  # close from elsewhere, revocation, shutdown
        self._stream: EngineDecodeStream | None = None
        self._op_lock = threading.Lock()
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

    def ensure_prefix(self, prefix: PrefixInput) -> PrefixStatus:
        with self._operation():
            if not isinstance(prefix, PrefixInput):
                raise InvalidArgumentError("expected a PrefixInput", field="prefix")
            tools = encode_text(prefix.tools_json, "tools_json", self._engine.limits)
            data = encode_text(prefix.text, "text", self._engine.limits, extra_bytes=len(tools))
            if tools and self.config.prompt_format == "raw":
                raise InvalidArgumentError(
                    "tools_json needs prompt_format 'chat' (the model's template renders it); "
                    "with prompt_format 'raw' put tool definitions in the text",
                    field="tools_json",
                )
            validate_manifest_size(prefix.manifest, self._engine.limits)
            manifest = _complete(
                prefix.manifest or ContextManifest(stable_bytes=len(data), total_bytes=len(data)),
                self._identity,
            )
            check_text(manifest, data, start=0, stable=True)
            manifest = replace(
                manifest,
                stable_byte_hash=manifest.stable_byte_hash or bytes_hash(data),
                total_bytes=max(manifest.total_bytes, len(data)),
                segments=tuple(_fill_segments(manifest.segments, data, 0, stable=True)),
            )
            chat: _ChatState | None = None
            if self.config.prompt_format == "chat":
                renderer = self.model.chat_renderer()
                tool_list = parse_tools(prefix.tools_json)
                messages = messages_for(manifest.segments, data, 0, stable=True, default_role="system")
                rendered = renderer.render_prefix(messages, manifest.segments, data, 0, tool_list)
                text, spans = rendered.text, rendered.spans
                chat = _ChatState(messages, tool_list)
            else:
                text, spans = prefix.text, _identity_spans(manifest.segments, 0, stable=True)
            added_bos = self._add_bos(text)
            tokens = self.model.runtime.tokenize(text, add_bos=added_bos)
            if len(tokens) > self._n_ctx:
                raise ContextOverflowError(
                    stage="prefix", resident=0, additional=len(tokens), window=self._n_ctx
                )
            # Byte offsets of the tokens, computed once: for segment token ranges and, below, for
            # the byte where a prefix diverged.
            ends = self.model.byte_ends(tokens, added_bos=added_bos) if spans else None
            if ends is not None:
                manifest = self._with_token_ranges(manifest, ends, spans, 0)
            manifest = replace(manifest, stable_token_hash=token_hash(tokens))
            with self._turn() as runtime:
                sync = self.model.thread.run(
                    functools.partial(self._sync, runtime, tokens, manifest, prefix_tokens=len(tokens))
                )
            decision = sync.plan.decision
            if decision.diverged_at_token is not None:
                if ends is None:
                    ends = self.model.byte_ends(tokens, added_bos=added_bos)
                k = decision.diverged_at_token
                decision = replace(decision, diverged_at_byte=ends[k - 1] if k > 0 else 0)
            self._tokens = tokens
            self._n_prefix, self._n_suffix = len(tokens), 0
            self._has_prefix = True
            self._manifest = manifest
            self._chat = chat
            self._turn_computed = sync.evaluated
            status = PrefixStatus(
                reused_tokens=sync.plan.keep,
                prefilled_tokens=len(tokens) - sync.plan.keep,
                dropped_tokens=sync.dropped,
                prefix_tokens=len(tokens),
                resident_tokens=len(tokens),
                available_tokens=self._n_ctx - len(tokens),
                stable_byte_hash=manifest.stable_byte_hash,
                stable_token_hash=manifest.stable_token_hash,
                manifest_digest=manifest.digest(),
                reuse=decision,
            )
            self._prefix_status = status
            return status

    def prefill_suffix(self, suffix: SuffixInput) -> SuffixStatus:
        with self._operation():
            if not isinstance(suffix, SuffixInput):
                raise InvalidArgumentError("expected a SuffixInput", field="suffix")
            data = encode_text(suffix.text, "text", self._engine.limits)
            if not self._has_prefix or self._manifest is None:
                raise PrefixRequiredError("prefill_suffix needs a prefix: call ensure_prefix first")
            validate_manifest_size(suffix.manifest, self._engine.limits)
            manifest = self._suffix_manifest(suffix.manifest, data)
            base = manifest.stable_bytes
            if self._chat is not None:
                messages = messages_for(manifest.segments, data, base, stable=False, default_role="user")
                rendered = self.model.chat_renderer().render_suffix(
                    self._chat.messages, messages, manifest.segments, data, base, self._chat.tools
                )
                text, spans = rendered.text, rendered.spans
            else:
                text, spans = suffix.text, _identity_spans(manifest.segments, base, stable=False)
            tokens = self.model.runtime.tokenize(text, add_bos=False)
            if self._n_prefix + len(tokens) > self._n_ctx:
                raise ContextOverflowError(
                    stage="suffix", resident=self._n_prefix, additional=len(tokens), window=self._n_ctx
                )
            if spans:
                ends = self.model.byte_ends(tokens, added_bos=False)
                manifest = self._with_token_ranges(manifest, ends, spans, self._n_prefix)
            manifest = replace(manifest, volatile_token_hash=token_hash(tokens))
            target = self._tokens[: self._n_prefix] + tokens
            with self._turn() as runtime:
                sync = self.model.thread.run(
                    functools.partial(self._sync, runtime, target, manifest, prefix_tokens=self._n_prefix)
                )
            # Prefix tokens the sync had to recompute (another session displaced them).
            restored = max(0, self._n_prefix - sync.plan.keep)
            self._tokens = target
            self._n_suffix = len(tokens)
            self._manifest = manifest
            self._turn_computed += sync.evaluated
            return SuffixStatus(
                suffix_tokens=len(tokens),
                prefix_tokens=self._n_prefix,
                resident_tokens=len(target),
                available_tokens=self._n_ctx - len(target),
                manifest_digest=manifest.digest(),
                restored_tokens=restored,
            )

    def decode(self, config: DecodeConfig) -> EngineDecodeStream:
        with self._operation():
            validate_decode(config, self._engine.limits, self._info.capabilities, self._n_ctx)
            self.model.runtime.check_decode(config)
            if not self._has_prefix or not self._tokens:
                raise PrefixRequiredError("decode needs a resident context: call ensure_prefix first")
            try:
                self.model.acquire(self._engine.limits.model_wait_seconds, self._interrupt)
            except Interrupted:
                self._raise_interrupted()
            stream = EngineDecodeStream(self, config)  # releases the model when it ends
            self._stream = stream
            stream.start()
            return stream

    def explain_context(self) -> ContextReport:
        manifest = self._manifest
        resident = list(self.model.runtime.resident)
        kv = common_prefix_len(resident, self._tokens) if self._tokens else 0
        n = len(self._tokens)
        return ContextReport(
            session_id=self._id,
            model_name=self._info.model_name,
            backend=self._info.backend,
            num_ctx=self._n_ctx,
            resident_tokens=n,
            prefix_tokens=self._n_prefix,
            suffix_tokens=self._n_suffix,
            generated_tokens=n - self._n_prefix - self._n_suffix,
            available_tokens=self._n_ctx - n,
            kv_tokens=0 if self._closed else kv,
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
        )

    def interrupt(self) -> None:
        """Stop whatever this session is running (its stream ended, shutdown, lost ownership)."""
        self._interrupted.set()
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
            self._engine.owner.check_epoch(self.epoch)
        except ModeldError as exc:
            return exc
        if self._engine.stopping:
            return ShuttingDownError("the daemon is shutting down")
        return SessionClosedError(f"session {self._id} was closed", session_id=self._id)

    def close(self) -> None:
        if self._closed:
            return
        self._interrupted.set()
        stream = self._stream
        if stream is not None:
            stream.close()
        with self._op_lock:
            self._closed = True
            self._stream = None
            self._engine._forget(self, self.explain_context())
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
            num_ctx=self._n_ctx,
            resident_tokens=n,
            prefix_tokens=self._n_prefix,
            available_tokens=self._n_ctx - n,
            last_outcome=self._prefix_status.reuse.outcome if self._prefix_status else "",
            closed=self._closed,
        )

    # --- internals -----------------------------------------------------------------------

    @contextlib.contextmanager
    def _operation(self) -> Iterator[None]:
        """Admission for every operation: open, fenced, not shutting down, one at a time."""
        if self._closed:
            raise SessionClosedError(f"session {self._id} is closed", session_id=self._id)
        self._engine.owner.check_epoch(self.epoch)
        if self._engine.stopping:
            raise ShuttingDownError("the daemon is shutting down")
        stream = self._stream
        if stream is not None:  # a new operation ends the previous decode
            stream.close()
            self._stream = None
        if not self._op_lock.acquire(blocking=False):
            raise BusyError(
                f"session {self._id} is already running an operation; sessions are not for concurrent use"
            )
        try:
            if self._closed:
                raise SessionClosedError(f"session {self._id} is closed", session_id=self._id)
            self.last_used_at = time.time()
            yield
        finally:
            self._op_lock.release()

    def _interrupt(self) -> bool:
        return self._interrupted.is_set()

    @contextlib.contextmanager
    def _turn(self, interrupt: Callable[[], bool] | None = None) -> Iterator[ModelRuntime]:
        check = interrupt or self._interrupt
        try:
            with self.model.turn(self._engine.limits.model_wait_seconds, check) as runtime:
                yield runtime
        except Interrupted:
            self._raise_interrupted()

    def _raise_interrupted(self) -> None:
        """Raise the error that explains why an operation was interrupted."""
        self._engine.owner.check_epoch(self.epoch)
        if self._engine.stopping:
            raise ShuttingDownError("the daemon is shutting down")
        raise SessionClosedError(f"session {self._id} was closed during the operation")

    def _sync(
        self,
        runtime: ModelRuntime,
        target: Sequence[int],
        manifest: ContextManifest,
        *,
        prefix_tokens: int,
        interrupt: Callable[[], bool] | None = None,
    ) -> _Sync:
        """Bring the KV to ``target`` (called with the model's lock held)."""
        model = self.model
        old_len = len(runtime.resident)
        plan = plan_reuse(
            resident=list(runtime.resident),
            resident_manifest=model.manifest,
            resident_prefix_tokens=model.prefix_tokens,
            target=list(target),
            manifest=manifest,
            can_truncate=runtime.can_truncate,
            reset_reason=model.reset_reason,
            last_manifest=self._engine._last_manifest_for(model),
        )
        try:
            if runtime.configure(self.config):
                plan = replace(plan, keep=0)
            runtime.truncate(plan.keep)
            model.manifest = manifest
            model.prefix_tokens = prefix_tokens
            model.reset_reason = ""
            self._engine._remember(model, manifest)
            runtime.extend(target[plan.keep :], interrupt or self._interrupt)
        except Interrupted:
            self._raise_interrupted()
        except ModeldError:
            raise
        except Exception as exc:
            self._reset_model(runtime, exc)
            raise EngineError(f"the {self._info.backend} engine failed: {exc}") from exc
        return _Sync(plan=plan, dropped=old_len - plan.keep, evaluated=len(target) - plan.keep)

    def _reset_model(self, runtime: ModelRuntime, exc: BaseException) -> None:
        log.error("engine failure on %s: %r; resetting its KV", self._info.path, exc)
        self.model.manifest = None
        self.model.reset_reason = "engine_reset"
        with contextlib.suppress(Exception):
            runtime.truncate(0)

    def _suffix_manifest(self, given: ContextManifest | None, data: bytes) -> ContextManifest:
        assert self._manifest is not None
        current = self._manifest
        if given is None:
            stable = current.stable_segments
            return replace(
                current,
                total_bytes=current.stable_bytes + len(data),
                volatile_token_hash="",
                segments=stable,
            )
        manifest = _complete(given, self._identity)
        if manifest.stable_bytes != current.stable_bytes or (
            manifest.stable_byte_hash and manifest.stable_byte_hash != current.stable_byte_hash
        ):
            raise ManifestMismatchError(
                "this suffix's manifest was built for a different prefix than the resident one "
                "(stable_byte_hash differs); call ensure_prefix with its prefix first",
                field="stable_byte_hash",
                expected=current.stable_byte_hash,
                got=manifest.stable_byte_hash,
            )
        ours = [
            replace(s, hash="", cache_class="", token_start=None, token_end=None)
            for s in current.stable_segments
        ]
        theirs = [
            replace(s, hash="", cache_class="", token_start=None, token_end=None)
            for s in manifest.stable_segments
        ]
        if ours != theirs:
            raise ManifestMismatchError(
                "this suffix's manifest describes different stable segments than the resident prefix",
                field="segments",
            )
        check_text(manifest, data, start=current.stable_bytes, stable=False)
        volatile = _fill_segments(manifest.volatile_segments, data, current.stable_bytes, stable=False)
        return replace(
            current,
            profile_id=manifest.profile_id or current.profile_id,
            total_bytes=current.stable_bytes + len(data),
            segments=current.stable_segments + tuple(volatile),
        )

    def _add_bos(self, text: str) -> bool:
        """The BOS policy, unless a chat template already wrote the BOS token as text."""
        bos = self._info.bos_token
        if self.config.prompt_format == "chat" and bos and text.startswith(bos):
            return False
        return bool(self._identity.add_bos)

    @staticmethod
    def _with_token_ranges(
        manifest: ContextManifest,
        ends: Sequence[int],
        spans: dict[int, tuple[int, int]],
        token_base: int,
    ) -> ContextManifest:
        """Fill token ranges for segments whose bytes are located in the evaluated text.

        ``spans`` maps a segment index to its byte range in the text that was tokenized, ``ends``
        gives each token's end byte in it. A token belongs to the segment its last byte falls in;
        zero-length tokens (BOS) to none.
        """
        out = list(manifest.segments)
        for index, (start, end) in spans.items():
            out[index] = replace(
                out[index],
                token_start=token_base + bisect.bisect_right(ends, start),
                token_end=token_base + bisect.bisect_right(ends, end),
            )
        return replace(manifest, segments=tuple(out))

    # --- decode (runs on the stream's producer thread) -----------------------------------

    def _run_decode(
        self, config: DecodeConfig, cancel: threading.Event, emit: Callable[[StreamChunk], None]
    ) -> None:
        """Generate and emit chunks; always ends with exactly one final chunk."""

        def interrupt() -> bool:
            return cancel.is_set() or self._interrupted.is_set()

        prompt = len(self._tokens)
        completion = 0
        cached = 0
        pending: list[int] = []

        def final(finish: str, text: str = "", error: ErrorDetail | None = None) -> None:
            usage = Usage(prompt_tokens=prompt, cached_tokens=cached, completion_tokens=completion)
            emit(
                StreamChunk(
                    text=text,
                    token_ids=tuple(pending),
                    finish_reason=finish,
                    usage=usage,
                    error=error,
                )
            )

        assembler = TextAssembler(config.stop)
        finish = "length"
        assert self._manifest is not None
        runtime = self.model.runtime  # the caller took the model for this decode (see decode())
        try:
            sync = self._sync(
                runtime,
                self._tokens,
                self._manifest,
                prefix_tokens=self._n_prefix,
                interrupt=interrupt,
            )
            self._turn_computed += sync.evaluated
            cached = max(0, prompt - self._turn_computed)
            gen = runtime.generate(config, interrupt) if prompt < self._n_ctx else iter(())
            try:
                for token in gen:
                    if runtime.is_eog(token):
                        finish = "stop"
                        break
                    self._tokens.append(token)
                    completion += 1
                    self._turn_computed += 1
                    pending.append(token)
                    text = assembler.feed(runtime.piece(token))
                    if text or assembler.stopped:
                        emit(StreamChunk(text=text, token_ids=tuple(pending)))
                        pending.clear()
                    if assembler.stopped:
                        finish = "stop_sequence"
                        break
                    if completion >= config.max_tokens or len(self._tokens) >= self._n_ctx:
                        finish = "length"
                        break
                    if interrupt():
                        finish = "interrupted"
                        break
                else:  # the runtime stopped on its own: interrupted, or the window is full
                    finish = "interrupted" if interrupt() else "length"
            except ModeldError:
                raise
            except Exception as exc:
                self._reset_model(runtime, exc)
                raise EngineError(f"the {self._info.backend} engine failed: {exc}") from exc
            finally:
                close = getattr(gen, "close", None)
                if close is not None:
                    close()
        except ModeldError as exc:
            if cancel.is_set() and not self._interrupted.is_set():
                final("canceled")
            else:
                final("error", error=ErrorDetail(reason=exc.reason, message=exc.message))
            return
        except Exception as exc:  # a bug: report it in the stream, never lose the stream's end
            log.exception("decode failed in session %s", self._id)
            final("error", error=ErrorDetail(reason="internal", message=f"internal error: {exc!r}"))
            return
        if finish == "interrupted":
            if cancel.is_set() and not self._interrupted.is_set():
                final("canceled", assembler.flush())
            else:
                final("error", assembler.flush(), self._interrupt_detail())
            return
        final(finish, assembler.flush())

    def _interrupt_detail(self) -> ErrorDetail:
        try:
            self._raise_interrupted()
        except ModeldError as exc:
            return ErrorDetail(reason=exc.reason, message=exc.message)
        return ErrorDetail(reason="internal", message="interrupted")  # pragma: no cover


class EngineDecodeStream:
    """A decode running on the model's engine thread, read as an iterator of chunks.

    The session took the model before starting it; the engine thread gives it back when the
    generation ends, so an abandoned iterator can never leave the model locked: cancel() (or
    close(), or dropping the stream) stops the engine at the next token step.
    """

    def __init__(self, session: EngineSession, config: DecodeConfig) -> None:
        self._session = session
        self._config = config
        self._queue: queue.SimpleQueue[StreamChunk] = queue.SimpleQueue()
        self._cancel = threading.Event()
        self._done = False
        self._future: Future[None] | None = None

    def start(self) -> None:
        self._future = self._session.model.thread.submit(self._produce)

    def _produce(self) -> None:
        try:
            self._session._run_decode(self._config, self._cancel, self._queue.put)
        finally:
            self._session.model.release()

    def __iter__(self) -> EngineDecodeStream:
        return self

    def __next__(self) -> StreamChunk:
        if self._done:
            raise StopIteration
        chunk = self._queue.get()
        if chunk.final:
            self._done = True
            self._wait()
        return chunk

    def _wait(self) -> None:
        if self._future is not None and not self._session.model.thread.is_current():
            self._future.result()

    def cancel(self) -> None:
        self._cancel.set()

    def close(self) -> None:
        """Cancel if still running and wait for the engine to stop."""
        if self._done:
            return
        self._cancel.set()
        self._wait()
        self._done = True

    def __enter__(self) -> EngineDecodeStream:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.close()

    def __del__(self) -> None:
        self._cancel.set()
