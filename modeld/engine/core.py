"""The backend-neutral session engine: the contract implemented once, over any backend.

:class:`Engine` implements :class:`~modeld.contract.Service`; its sessions implement
:class:`~modeld.contract.Session`. It owns the session registry, owner fencing, limits, the
manifest checks, reuse decisions and accounting, and decoding's text handling. A backend only
provides a :class:`~modeld.backends.base.ModelRuntime` (tokenize, cut, evaluate, sample).

State (see ``blueprints/0001-the-seam.md``):

* A :class:`LoadedModel` holds one runtime and its single resident KV sequence, labelled with
  the manifest it was computed under. It stays loaded after its sessions close, so the next
  session (a new client process, an hour later) reuses what it shares.
* A session holds its *logical* context: prefix, suffix and generated tokens. The KV is a cache
  of it. Several sessions on one model take turns (the model's lock); before each operation the
  engine brings the KV to the session's context, reusing the longest common prefix, so one
  session's tokens are never interleaved into another's and accounting stays exact.
"""

from __future__ import annotations

import bisect
import contextlib
import itertools
import logging
import os
import queue
import threading
import time
import uuid
from collections import OrderedDict
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, replace
from types import TracebackType

from modeld.backends import Backend, Interrupted, ModelRuntime, load_backend
from modeld.contract import (
    Config,
    ContextReport,
    DaemonStatus,
    DecodeConfig,
    ErrorDetail,
    LoadedModelSummary,
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
from modeld.engine.limits import Limits
from modeld.engine.owner import Owner
from modeld.engine.reuse import ReusePlan, common_prefix_len, plan_reuse
from modeld.engine.text import TextAssembler
from modeld.engine.validate import (
    encode_text,
    validate_decode,
    validate_manifest_size,
    validate_request,
)
from modeld.errors import (
    BackendMismatchError,
    BusyError,
    ContextOverflowError,
    EngineError,
    InvalidArgumentError,
    LimitExceededError,
    ManifestMismatchError,
    ModeldError,
    PrefixRequiredError,
    SessionClosedError,
    SessionNotFoundError,
    ShuttingDownError,
    UnsupportedError,
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

__all__ = ["Engine", "EngineDecodeStream", "EngineSession", "LoadedModel"]

log = logging.getLogger("modeld.engine")

VERSION = "0.1.0"


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
        runtime_digest=runtime_digest(
            num_ctx=config.num_ctx,
            num_batch=config.num_batch,
            num_gpu_layers=config.num_gpu_layers,
            tensor_split=config.tensor_split,
            flash_attn=config.flash_attn,
            kv_cache_type=config.kv_cache_type,
        ),
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


class LoadedModel:
    """A loaded runtime, its resident KV's label, and the lock sessions take turns on."""

    def __init__(self, key: tuple[str, str, str], runtime: ModelRuntime, info: ModelInfo) -> None:
        self.key = key
        self.runtime = runtime
        self.info = info
        self.lock = threading.Lock()
        self.manifest: ContextManifest | None = None  # what the resident KV was computed under
        self.prefix_tokens = 0  # length of the prefix part of the resident context
        self.reset_reason = ""
        self.sessions = 0
        self.loaded_at = time.time()
        self.last_used_at = self.loaded_at
        self._piece_len: dict[int, int] = {}

    def piece_len(self, token: int) -> int:
        n = self._piece_len.get(token)
        if n is None:
            n = self._piece_len[token] = len(self.runtime.piece(token))
        return n

    def byte_ends(self, tokens: Sequence[int], base: int) -> list[int]:
        """Cumulative byte end offset of each token, starting at ``base``."""
        return list(itertools.accumulate((self.piece_len(t) for t in tokens), initial=base))[1:]

    @contextlib.contextmanager
    def turn(self, wait: float, interrupt: Callable[[], bool]) -> Iterator[ModelRuntime]:
        """Hold the model for one operation; wait at most ``wait`` seconds for other sessions."""
        deadline = time.monotonic() + wait
        while not self.lock.acquire(timeout=min(0.05, max(0.0, deadline - time.monotonic()))):
            if interrupt():
                raise Interrupted
            if time.monotonic() >= deadline:
                raise BusyError(
                    f"the model stayed busy with other sessions for {wait:.0f}s",
                    wait_seconds=int(wait),
                )
        try:
            self.last_used_at = time.time()
            yield self.runtime
        finally:
            self.lock.release()

    def summary(self) -> LoadedModelSummary:
        return LoadedModelSummary(
            backend=self.info.backend,
            path=self.info.path,
            model_name=self.info.model_name,
            model_digest=self.info.model_digest,
            n_ctx=self.runtime.n_ctx,
            resident_tokens=len(self.runtime.resident),
            sessions=self.sessions,
            loaded_at=self.loaded_at,
            last_used_at=self.last_used_at,
        )


@dataclass
class _Sync:
    plan: ReusePlan
    dropped: int
    evaluated: int


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
        self._models: dict[tuple[str, str, str], LoadedModel] = {}
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
        validate_request(request, self.limits)
        return self.backend(self._resolve_type(request)).describe(request)

    def open_session(self, request: OpenSessionRequest) -> EngineSession:
        validate_request(request, self.limits)
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
        model = self._model_for(kind, request, info)
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

    def _model_for(self, kind: str, request: OpenSessionRequest, info: ModelInfo) -> LoadedModel:
        key = (kind, info.path, info.model_digest)
        with self._load_lock:
            with self._lock:
                model = self._models.get(key)
                if model is not None:
                    model.sessions += 1
                    return model
                self._evict_for_load()
            runtime = self.backend(kind).load(request, info)
            model = LoadedModel(key, runtime, info)
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
            victim.runtime.close()
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
            version=VERSION,
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
            session._interrupted.set()

    def begin_shutdown(self) -> None:
        """Stop taking work and interrupt every session's running operation."""
        self._stopping = True
        for session in self.sessions():
            session._interrupted.set()

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
                model.runtime.close()

    def __enter__(self) -> Engine:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.shutdown()


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
        self._prefix_status: PrefixStatus | None = None
        self._turn_computed = 0
        self._closed = False
        self._interrupted = threading.Event()  # close from elsewhere, revocation, shutdown
        self._stream: EngineDecodeStream | None = None
        self._op_lock = threading.Lock()
        self.opened_at = time.time()
        self.last_used_at = self.opened_at
        self.attached = False

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
            tokens = self.model.runtime.tokenize(prefix.text, add_bos=bool(self._identity.add_bos))
            if len(tokens) > self._n_ctx:
                raise ContextOverflowError(
                    stage="prefix", resident=0, additional=len(tokens), window=self._n_ctx
                )
            manifest = self._with_token_ranges(manifest, tokens, 0, 0, stable=True)
            manifest = replace(manifest, stable_token_hash=token_hash(tokens))
            with self._turn() as runtime:
                sync = self._sync(runtime, tokens, manifest, prefix_tokens=len(tokens))
            decision = sync.plan.decision
            if decision.diverged_at_token is not None:
                start = self.model.byte_ends(tokens[: decision.diverged_at_token], 0)
                decision = replace(decision, diverged_at_byte=start[-1] if start else 0)
            self._tokens = tokens
            self._n_prefix, self._n_suffix = len(tokens), 0
            self._has_prefix = True
            self._manifest = manifest
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
            tokens = self.model.runtime.tokenize(suffix.text, add_bos=False)
            if self._n_prefix + len(tokens) > self._n_ctx:
                raise ContextOverflowError(
                    stage="suffix",
                    resident=self._n_prefix,
                    additional=len(tokens),
                    window=self._n_ctx,
                )
            manifest = self._with_token_ranges(
                manifest, tokens, manifest.stable_bytes, self._n_prefix, stable=False
            )
            manifest = replace(manifest, volatile_token_hash=token_hash(tokens))
            target = self._tokens[: self._n_prefix] + tokens
            with self._turn() as runtime:
                restored = self._n_prefix - min(self._n_prefix, self._kv_lcp(runtime, target))
                sync = self._sync(runtime, target, manifest, prefix_tokens=self._n_prefix)
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
            stream = EngineDecodeStream(self, config)
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
            attached=self.attached,
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

    def _kv_lcp(self, runtime: ModelRuntime, target: Sequence[int]) -> int:
        if self.model.manifest is None or self._manifest is None:
            return 0
        if not self.model.manifest.compatible_runtime(self._manifest).ok:
            return 0
        return common_prefix_len(list(runtime.resident), list(target))

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

    def _with_token_ranges(
        self,
        manifest: ContextManifest,
        tokens: Sequence[int],
        byte_base: int,
        token_base: int,
        *,
        stable: bool,
    ) -> ContextManifest:
        wanted = [s for s in manifest.segments if s.stable == stable]
        if not wanted:
            return manifest
        ends = self.model.byte_ends(tokens, byte_base)
        out: list[Segment] = []
        for seg in manifest.segments:
            if seg.stable != stable:
                out.append(seg)
                continue
            out.append(
                replace(
                    seg,
                    token_start=token_base + bisect.bisect_right(ends, seg.byte_start),
                    token_end=token_base + bisect.bisect_right(ends, seg.byte_end),
                )
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
        try:
            with self._turn(interrupt) as runtime:
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
    """A decode running on its own thread, read as an iterator of chunks.

    The generation runs on a producer thread that holds the model's lock, so an abandoned
    iterator can never leave the model locked: cancel() (or close(), or dropping the stream)
    stops the engine at the next token step.
    """

    def __init__(self, session: EngineSession, config: DecodeConfig) -> None:
        self._session = session
        self._config = config
        self._queue: queue.SimpleQueue[StreamChunk] = queue.SimpleQueue()
        self._cancel = threading.Event()
        self._done = False
        self._thread = threading.Thread(
            target=self._produce, name=f"decode-{session.session_id}", daemon=True
        )

    def start(self) -> None:
        self._thread.start()

    def _produce(self) -> None:
        self._session._run_decode(self._config, self._cancel, self._queue.put)

    def __iter__(self) -> EngineDecodeStream:
        return self

    def __next__(self) -> StreamChunk:
        if self._done:
            raise StopIteration
        chunk = self._queue.get()
        if chunk.final:
            self._done = True
            self._thread.join()
        return chunk

    def cancel(self) -> None:
        self._cancel.set()

    def close(self) -> None:
        """Cancel if still running and wait for the engine to stop."""
        if self._done:
            return
        self._cancel.set()
        if threading.current_thread() is self._thread:
            return
        self._thread.join()
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
