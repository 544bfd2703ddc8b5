"""The synchronous runtime client: the modeld contract over gRPC.

:class:`Client` implements :class:`~modeld.contract.Service` and its sessions implement
:class:`~modeld.contract.Session`, raising the same typed errors as an in-process backend, so
a caller cannot tell the daemon from a local engine. Each session is one bidirectional
``Session`` stream: requests go out in order, responses come back in order, and a decode's
chunks are read as they arrive. Cancelling a decode sends ``cancel_decode`` on the same stream;
the engine stops within one token step and the stream ends with a ``canceled`` chunk.
"""

from __future__ import annotations

import itertools
import queue
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any, TypeVar

import grpc
from google.protobuf.message import Message

from modeld.contract import (
    Closing,
    ContextReport,
    DecodeConfig,
    ModelInfo,
    OpenSessionRequest,
    PrefixInput,
    PrefixStatus,
    ProgressCallback,
    StreamChunk,
    SuffixInput,
    SuffixStatus,
)
from modeld.errors import (
    InternalError,
    InvalidArgumentError,
    LimitExceededError,
    ModeldError,
    NotOwnerError,
    StaleFenceError,
)
from modeld.manifest import ContextManifest
from modeld.observe.records import RecordQuery, RequestRecord
from modeld.observe.status import DaemonStatus, SessionSummary
from modeld.v1 import modeld_pb2 as pb
from modeld.v1 import modeld_pb2_grpc as pb_grpc
from modeld.wire import convert, records
from modeld.wire.status import from_rpc_error, from_status
from runtime_client.common import ClientBase, DecodeStreamBase, SessionBase
from runtime_client.discovery import Discovery, Endpoint
from runtime_client.resume import (
    LOST_REASONS,
    POLL_SECONDS,
    PROBE_TIMEOUT,
    RESUME_TIMEOUT,
    Resume,
)

__all__ = [
    "Client",
    "ClientDecodeStream",
    "ClientSession",
    "channel_options",
    "check_size",
    "connect",
    "decode_chunk",
]

DEFAULT_MESSAGE_BYTES = 16 << 20
_END = object()


KEEPALIVE_MS = 30_000
"""How often the client pings during a call with no messages (a long prefill): a dead daemon is
noticed within keepalive + timeout. The daemon accepts pings every 10 s (MIN_CLIENT_PING_INTERVAL_MS)."""


def channel_options(
    max_message_bytes: int = DEFAULT_MESSAGE_BYTES, keepalive_ms: int = KEEPALIVE_MS
) -> list[tuple[str, Any]]:
    return [
        ("grpc.max_receive_message_length", max_message_bytes),
        ("grpc.max_send_message_length", max_message_bytes),
        ("grpc.keepalive_time_ms", keepalive_ms),
        ("grpc.keepalive_timeout_ms", 10_000),
        # Keep pinging through a long quiet call (a prefill of minutes), not just twice: a daemon
        # that died mid-prefill is then noticed within keepalive + timeout.
        ("grpc.http2.max_pings_without_data", 0),
        ("grpc.enable_retries", 0),
    ]


def check_size(message: Message, maximum: int) -> None:
    """Refuse a message gRPC would refuse, before it is sent (so the session stream survives)."""
    size = message.ByteSize()
    if size > maximum:
        raise LimitExceededError(
            f"the request is {size} bytes; the largest message is {maximum} bytes",
            limit="max_message_bytes",
            value=size,
            maximum=maximum,
        )


class Client(ClientBase, Closing):
    """A connection to the daemon. Implements the Service contract, plus observer calls.

    Timeouts: ``describe`` 60 s, ``open_session`` 600 s (it may load a model), observer calls
    10 s. Session operations have no deadline (a long prefill is legitimate); close the session
    to abandon one.

    ``resume`` (default on): when the daemon restarts, open sessions resume on the new one at
    their next call and new sessions open there (:mod:`runtime_client.resume`); a takeover is
    never followed. Off: a session whose daemon went away fails for good, as before.

    ``job``: a label the sessions' request records carry (``modeld requests --job``, the live
    page), sent as ``x-modeld-job`` metadata.
    """

    def __init__(
        self,
        endpoint: Endpoint,
        *,
        max_message_bytes: int = DEFAULT_MESSAGE_BYTES,
        keepalive_ms: int = KEEPALIVE_MS,
        resume: bool = True,
        resume_timeout: float = RESUME_TIMEOUT,
        discovery: Discovery | None = None,
        job: str = "",
    ) -> None:
        super().__init__(endpoint, max_message_bytes, resume, resume_timeout, discovery)
        self._keepalive_ms = keepalive_ms
        self.job = job
        self._follow_lock = threading.Lock()
        self._retired: list[grpc.Channel] = []
        self._channel = self._dial(endpoint.target)
        self._stub = pb_grpc.ModeldStub(self._channel)

    def _dial(self, target: str) -> grpc.Channel:
        return grpc.insecure_channel(
            target, options=channel_options(self.max_message_bytes, self._keepalive_ms)
        )

    def _call(self, method: Any, request: Any, timeout: float) -> Any:
        metadata = self.endpoint.metadata
        if self.job:
            metadata = (*(metadata or ()), ("x-modeld-job", self.job))
        try:
            return method(request, timeout=timeout, metadata=metadata)
        except grpc.RpcError as exc:
            raise from_rpc_error(exc, self.endpoint.target) from None

    # --- following a restarted daemon -------------------------------------------------------

    def _follow(self, old_instance: str, old_epoch: int, *, fenced: bool, deadline: float) -> None:
        """Find the daemon serving now and talk to it from now on, if a session of
        ``old_instance`` at ``old_epoch`` may follow it (:func:`check_follow`: raises
        :class:`StaleFenceError` after a takeover). Waits until ``deadline`` (monotonic) while
        none serves, then raises :class:`DaemonUnavailableError`."""
        with self._follow_lock:
            while True:
                try:
                    self._find(old_instance, old_epoch, fenced=fenced)
                    return
                except ModeldError as exc:
                    self._still_lost(exc, deadline)
                time.sleep(POLL_SECONDS)

    def _find(self, old_instance: str, old_epoch: int, *, fenced: bool) -> None:
        endpoint = self._discovery.find()
        record = self._discovery.owner_record(endpoint)
        channel = self._dial(endpoint.target)
        try:
            try:
                status = pb_grpc.ModeldStub(channel).Status(
                    pb.StatusRequest(), timeout=PROBE_TIMEOUT, metadata=endpoint.metadata
                )
            except grpc.RpcError as exc:
                raise from_rpc_error(exc, endpoint.target) from None
            self._may_follow(endpoint, record, status.instance_id, old_instance, old_epoch, fenced=fenced)
        except BaseException:
            channel.close()
            raise
        if self._is_current(endpoint, status.instance_id):
            channel.close()
            return
        # Sessions still streaming on the old channel keep it until the client closes.
        self._retired.append(self._channel)
        self._channel, self._stub = channel, pb_grpc.ModeldStub(channel)
        self._adopt(endpoint, status.instance_id, int(status.epoch))

    def _open(self, request: OpenSessionRequest) -> tuple[pb.OpenSessionResponse, bool]:
        sent, auto = self._fenced(request)
        try:
            return self._call(self._stub.OpenSession, convert.open_request_to_pb(sent), 600.0), auto
        except StaleFenceError:
            if not (self.resume and auto):
                raise
        # Our fence names an owner that is gone: follow the one serving now if it restarted
        # (never after a takeover), once.
        self._follow(sent.fence.owner_instance_id, self.endpoint.epoch, fenced=True, deadline=0.0)
        sent, auto = self._fenced(request)
        return self._call(self._stub.OpenSession, convert.open_request_to_pb(sent), 600.0), auto

    # --- Service --------------------------------------------------------------------------

    def describe(self, request: OpenSessionRequest) -> ModelInfo:
        msg = pb.DescribeRequest(model=convert.open_request_to_pb(request))
        return convert.model_info_from_pb(self._call(self._stub.Describe, msg, 60.0).info)

    def open_session(self, request: OpenSessionRequest) -> ClientSession:
        if not isinstance(request, OpenSessionRequest):
            raise InvalidArgumentError("expected an OpenSessionRequest", field="request")
        resp, auto = self._open(request)
        return ClientSession._opened(self, resp, request, auto)

    # --- observers ------------------------------------------------------------------------

    def status(self, *, debug: bool = False) -> DaemonStatus:
        """The daemon's status; ``debug`` adds each engine worker's last log lines."""
        return convert.status_from_pb(self._call(self._stub.Status, pb.StatusRequest(debug=debug), 10.0))

    def list_sessions(self) -> list[SessionSummary]:
        resp = self._call(self._stub.ListSessions, pb.ListSessionsRequest(), 10.0)
        return [convert.summary_from_pb(s) for s in resp.sessions]

    def explain_context(self, session_id: str) -> ContextReport:
        resp = self._call(self._stub.ExplainContext, pb.ExplainContextRequest(session_id=session_id), 10.0)
        return convert.report_from_pb(resp.report)

    def count_tokens(self, request: OpenSessionRequest, text: str) -> int:
        """How many tokens ``text`` makes under the model (no BOS): budget before sending."""
        msg = convert.count_tokens_request_to_pb(request, text, False)
        return int(self._call(self._stub.CountTokens, msg, 600.0).count)

    def tokenize(self, request: OpenSessionRequest, text: str) -> list[int]:
        """The token ids ``text`` makes under the model (no BOS)."""
        msg = convert.count_tokens_request_to_pb(request, text, True)
        return list(self._call(self._stub.CountTokens, msg, 600.0).token_ids)

    def metrics(self) -> str:
        """The daemon's metrics in the Prometheus text format."""
        return str(self._call(self._stub.Metrics, pb.MetricsRequest(), 10.0).text)

    def list_requests(
        self,
        *,
        job: str = "",
        conversation: str = "",
        since: float = 0.0,
        limit: int = 100,
        running: bool = False,
    ) -> list[RequestRecord]:
        """The daemon's request records (one per turn, every API and gRPC), the newest ``limit``
        that match, oldest first."""
        query = RecordQuery(job=job, conversation=conversation, since=since, limit=limit, running=running)
        resp = self._call(self._stub.ListRequests, records.query_to_pb(query), 30.0)
        return [records.record_from_pb(r) for r in resp.records]

    def request(self, rid: str) -> RequestRecord | None:
        """One request record by its id (running or done), None when there is none."""
        resp = self._call(self._stub.ListRequests, records.query_to_pb(RecordQuery(), rid), 30.0)
        return records.record_from_pb(resp.records[0]) if resp.records else None

    def close(self) -> None:
        for channel in (*self._retired, self._channel):
            channel.close()
        self._retired.clear()


_Result = TypeVar("_Result")


class ClientSession(SessionBase, Closing):
    """A session over one Session stream. Not for concurrent use by several threads.

    With the client's ``resume`` on, the session remembers its last prefix and suffix (the
    inputs, not the tokens) so that it can resume on a restarted daemon: ``session_id``,
    ``epoch`` and ``identity`` are then the new session's, and :attr:`resumes` lists what
    happened."""

    def __init__(
        self,
        client: Client,
        *,
        session_id: str,
        info: ModelInfo,
        identity: ContextManifest,
        epoch: int,
        instance_id: str = "",
        request: OpenSessionRequest | None = None,
        auto_fenced: bool = False,
    ) -> None:
        """Attach to the open session ``session_id``. ``request`` (what opened it) lets it be
        reopened on a restarted daemon; without it the session does not resume."""
        super().__init__(client, request, auto_fenced)
        self._client: Client = client
        self._lock = threading.RLock()
        self._stream: ClientDecodeStream | None = None
        self._attach(session_id, info, identity, epoch, instance_id)

    @classmethod
    def _opened(
        cls, client: Client, resp: pb.OpenSessionResponse, request: OpenSessionRequest, auto_fenced: bool
    ) -> ClientSession:
        return cls(
            client,
            session_id=resp.session_id,
            info=convert.model_info_from_pb(resp.info),
            identity=convert.manifest_from_pb(resp.identity),
            epoch=int(resp.owner_epoch),
            instance_id=resp.owner_instance_id,
            request=request,
            auto_fenced=auto_fenced,
        )

    def _attach(
        self, session_id: str, info: ModelInfo, identity: ContextManifest, epoch: int, instance_id: str
    ) -> None:
        """Open a Session stream for the open session ``session_id`` and attach to it."""
        if hasattr(self, "_outbox"):
            self._drop_stream()  # the stream of the session this one replaces
        self._id = session_id
        self._info = info
        self._identity = identity
        self.epoch = epoch
        self._instance = instance_id
        self._outbox: queue.SimpleQueue[object] = queue.SimpleQueue()
        self._ids = itertools.count(1)
        self._failure = None
        self._responses: Iterator[pb.SessionResponse] = self._client._stub.Session(
            iter(self._outbox.get, _END), metadata=self._client.endpoint.metadata
        )
        attached = self._request(pb.SessionRequest(attach=pb.Attach(session_id=session_id)))
        if attached.WhichOneof("result") != "attached":
            raise InternalError(f"unexpected answer to attach: {attached.WhichOneof('result')}")

    # --- plumbing ---------------------------------------------------------------------------

    def _send(self, request: pb.SessionRequest) -> int:
        rid = next(self._ids)
        request.request_id = rid
        check_size(request, self._client.max_message_bytes)
        self._outbox.put(request)
        return rid

    def _receive(self) -> pb.SessionResponse:
        if self._failure is not None:
            raise self._failure
        try:
            return next(self._responses)
        except StopIteration:
            raise self._ended() from None
        except grpc.RpcError as exc:
            raise self._note(from_rpc_error(exc, self._client.target)) from None

    def _request(
        self, request: pb.SessionRequest, progress: ProgressCallback | None = None
    ) -> pb.SessionResponse:
        """Send one request and read its answer (raises the typed error if it failed).

        ``progress`` receives the daemon's progress reports of a long prefill, which arrive
        before the answer."""
        self._check_usable()
        rid = self._send(request)
        while True:
            resp = self._receive()
            if resp.request_id != rid:  # a late answer to something abandoned: skip it
                continue
            if resp.WhichOneof("result") != "progress":
                break
            if progress is not None:
                progress(convert.progress_from_pb(resp.progress))
        if resp.WhichOneof("result") == "error":
            raise from_status(resp.error)
        return resp

    def _finish_stream(self) -> None:
        stream = self._stream
        if stream is not None:
            stream.close()
            self._stream = None

    def _drop_stream(self) -> None:
        """Let go of a stream whose daemon is gone."""
        self._outbox.put(_END)
        cancel = getattr(self._responses, "cancel", None)
        if callable(cancel):
            cancel()

    def _ensure(self, prefix: PrefixInput, progress: ProgressCallback | None) -> PrefixStatus:
        msg = pb.SessionRequest(ensure_prefix=convert.prefix_input_to_pb(prefix))
        return convert.prefix_status_from_pb(self._request(msg, progress).prefix_status)

    def _prefill(self, suffix: SuffixInput, progress: ProgressCallback | None) -> SuffixStatus:
        msg = pb.SessionRequest(prefill_suffix=convert.suffix_input_to_pb(suffix))
        return convert.suffix_status_from_pb(self._request(msg, progress).suffix_status)

    # --- resuming across a daemon restart ----------------------------------------------------

    def _resumable(self, operation: Callable[[], _Result], replay: int) -> tuple[_Result, Resume | None]:
        """Run ``operation``, resuming first if the daemon went away (at most once per call).
        ``replay``: what the operation needs back: 0 nothing, 1 the prefix, 2 prefix and suffix."""
        resumed = self._resume(replay) if self._lost else None
        try:
            return operation(), resumed
        except ModeldError:
            if resumed is not None or not self._lost:
                raise
        resumed = self._resume(replay)
        return operation(), resumed

    def _resume(self, replay: int) -> Resume:
        client = self._client
        self._reopen_request()  # raises when there is nothing to reopen the session with
        started = time.monotonic()
        cause = self._lost
        old = (self._id, self._instance, self.epoch)
        deadline = started + client.resume_timeout
        while True:
            try:
                client._follow(self._instance, self.epoch, fenced=self._auto_fenced, deadline=deadline)
                sent = self._reopen_request()
                opened = client._call(client._stub.OpenSession, convert.open_request_to_pb(sent), 600.0)
                self._attach(
                    opened.session_id,
                    convert.model_info_from_pb(opened.info),
                    convert.manifest_from_pb(opened.identity),
                    int(opened.owner_epoch),
                    opened.owner_instance_id,
                )
                break
            except (StaleFenceError, NotOwnerError) as exc:
                self._taken_over(exc)
                raise
            except ModeldError as exc:
                if exc.reason not in LOST_REASONS or time.monotonic() >= deadline:
                    raise  # still lost: the next call tries again
                time.sleep(POLL_SECONDS)
        self._reopened()
        prefix_status: PrefixStatus | None = None
        suffix_status: SuffixStatus | None = None
        try:
            if replay >= 1 and self._prefix is not None:
                prefix_status = self._ensure(self._prefix, None)
                if replay >= 2 and self._suffix is not None:
                    suffix_status = self._prefill(self._suffix, None)
        except ModeldError:
            self._replay_failed()
            raise
        return self._resumed(cause, old, started, replay, prefix_status, suffix_status)

    # --- contract ---------------------------------------------------------------------------

    def ensure_prefix(self, prefix: PrefixInput, progress: ProgressCallback | None = None) -> PrefixStatus:
        """Make the session's context equal ``prefix`` (see the contract); ``progress`` is called
        with the daemon's progress reports while a long prefill runs (at most every 0.5 s)."""
        if not isinstance(prefix, PrefixInput):
            raise InvalidArgumentError("expected a PrefixInput", field="prefix")
        with self._lock:
            self._finish_stream()
            status, _ = self._resumable(lambda: self._ensure(prefix, progress), 0)
            self._prefix, self._suffix = prefix, None
            self._continued = self._generated_lost = False
            return status

    def prefill_suffix(self, suffix: SuffixInput, progress: ProgressCallback | None = None) -> SuffixStatus:
        """Make the context prefix + ``suffix``. After a resume, ``restored_tokens`` counts the
        prefix tokens the new daemon had to compute again (``last_resume.prefix`` says why)."""
        if not isinstance(suffix, SuffixInput):
            raise InvalidArgumentError("expected a SuffixInput", field="suffix")
        with self._lock:
            self._finish_stream()
            status, resumed = self._resumable(lambda: self._prefill(suffix, progress), 1)
            self._suffix = suffix
            self._continued = self._generated_lost = False
            return self._with_replay(status, resumed)

    def decode(self, config: DecodeConfig) -> ClientDecodeStream:
        """Generate (see the contract). If the daemon goes away mid-stream, the stream raises
        :class:`EngineRestartedError` (``details["daemon"] == "lost"``) and the next call resumes."""
        if not isinstance(config, DecodeConfig):
            raise InvalidArgumentError("expected a DecodeConfig", field="decode")
        with self._lock:
            self._finish_stream()
            msg = pb.SessionRequest(decode=convert.decode_config_to_pb(config))

            def start() -> pb.SessionResponse:
                self._check_continuation()
                return self._request(msg)

            started, _ = self._resumable(start, 2)
            if started.WhichOneof("result") != "decode_started":
                raise InternalError(f"unexpected answer to decode: {started.WhichOneof('result')}")
            self._stream = ClientDecodeStream(self, started.request_id)
            return self._stream

    def explain_context(self, _session_id: str | None = None) -> ContextReport:
        with self._lock:
            if self._closed:
                return self._client.explain_context(self._id)
            self._finish_stream()
            msg = pb.SessionRequest(explain_context=pb.ExplainContextRequest())
            report, _ = self._resumable(lambda: self._request(msg), 2)
            return convert.report_from_pb(report.context)

    def close(self) -> None:
        with self._lock:
            if self._closed:
                return
            try:
                self._finish_stream()
                if self._failure is None:
                    self._request(pb.SessionRequest(close=pb.CloseRequest()))
            except ModeldError:
                pass  # closing a broken session: nothing more to say
            finally:
                self._closed = True
                self._lost = ""
                self._drop_stream()

    def __del__(self) -> None:
        if not getattr(self, "_closed", True):
            self._outbox.put(_END)


def decode_chunk(resp: pb.SessionResponse, request_id: int) -> StreamChunk | None:
    """The chunk a Session response carries for decode ``request_id``: None when the response is
    for something else, the typed error when the decode failed."""
    if resp.request_id != request_id:
        return None
    kind = resp.WhichOneof("result")
    if kind == "error":
        raise from_status(resp.error)
    if kind != "chunk":
        return None
    return convert.chunk_from_pb(resp.chunk)


class ClientDecodeStream(DecodeStreamBase, Closing):
    """The chunks of one decode, as they arrive. Implements the DecodeStream contract."""

    _session: ClientSession

    def __iter__(self) -> ClientDecodeStream:
        return self

    def __next__(self) -> StreamChunk:
        if self._done:
            raise StopIteration
        while True:
            try:
                chunk = decode_chunk(self._session._receive(), self._rid)
            except ModeldError as exc:
                raise self._failed(exc) from None
            if chunk is not None:
                return self._took(chunk)

    def cancel(self) -> None:
        """Ask the engine to stop; the stream then ends with a ``canceled`` chunk."""
        if self._may_cancel():
            self._session._outbox.put(
                pb.SessionRequest(request_id=self._rid, cancel_decode=pb.CancelDecode())
            )

    def close(self) -> None:
        """Cancel if still running and read up to the final chunk (a stream whose daemon went
        away just ends: its session has recorded why)."""
        if self._done:
            return
        self.cancel()
        try:
            for _ in self:
                pass
        except ModeldError:
            pass


def connect(
    address: str | None = None,
    *,
    data_dir: Any = None,
    max_message_bytes: int = DEFAULT_MESSAGE_BYTES,
    token: str | None = None,
    resume: bool = True,
    resume_timeout: float = RESUME_TIMEOUT,
    job: str = "",
) -> Client:
    """Find the daemon (argument, ``MODELD_ADDRESS``, then the owner lease) and connect to it.

    A TCP endpoint's token comes from ``token``, else ``MODELD_TOKEN``, else the data directory.
    ``resume``: follow a restarted daemon (sessions resume at their next call, waiting up to
    ``resume_timeout`` seconds for it), never a takeover (:mod:`runtime_client.resume`).
    """
    where = Discovery(address, Path(data_dir) if data_dir is not None else None, token)
    return Client(
        where.find(),
        max_message_bytes=max_message_bytes,
        resume=resume,
        resume_timeout=resume_timeout,
        discovery=where,
        job=job,
    )
