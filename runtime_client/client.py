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
from collections.abc import Iterator
from dataclasses import replace
from types import TracebackType
from typing import Any

import grpc
from google.protobuf.message import Message

from modeld.contract import (
    ContextReport,
    DaemonStatus,
    DecodeConfig,
    Fence,
    ModelInfo,
    OpenSessionRequest,
    PrefixInput,
    PrefixStatus,
    ProgressCallback,
    SessionSummary,
    StreamChunk,
    SuffixInput,
    SuffixStatus,
)
from modeld.errors import (
    InternalError,
    InvalidArgumentError,
    LimitExceededError,
    ModeldError,
    SessionClosedError,
)
from modeld.manifest import ContextManifest
from modeld.v1 import modeld_pb2 as pb
from modeld.v1 import modeld_pb2_grpc as pb_grpc
from modeld.wire import convert
from modeld.wire.status import from_rpc_error, from_status
from runtime_client.discovery import Endpoint, discover

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


class Client:
    """A connection to the daemon. Implements the Service contract, plus observer calls.

    Timeouts: ``describe`` 60 s, ``open_session`` 600 s (it may load a model), observer calls
    10 s. Session operations have no deadline (a long prefill is legitimate); close the session
    to abandon one.
    """

    def __init__(
        self,
        endpoint: Endpoint,
        *,
        max_message_bytes: int = DEFAULT_MESSAGE_BYTES,
        keepalive_ms: int = KEEPALIVE_MS,
    ) -> None:
        self.endpoint = endpoint
        self.max_message_bytes = max_message_bytes
        self._channel = grpc.insecure_channel(
            endpoint.target, options=channel_options(max_message_bytes, keepalive_ms)
        )
        self._stub = pb_grpc.ModeldStub(self._channel)

    @property
    def target(self) -> str:
        return self.endpoint.target

    def _call(self, method: Any, request: Any, timeout: float) -> Any:
        try:
            return method(request, timeout=timeout, metadata=self.endpoint.metadata)
        except grpc.RpcError as exc:
            raise from_rpc_error(exc, self.endpoint.target) from None

    # --- Service --------------------------------------------------------------------------

    def describe(self, request: OpenSessionRequest) -> ModelInfo:
        msg = pb.DescribeRequest(model=convert.open_request_to_pb(request))
        return convert.model_info_from_pb(self._call(self._stub.Describe, msg, 60.0).info)

    def open_session(self, request: OpenSessionRequest) -> ClientSession:
        if not isinstance(request, OpenSessionRequest):
            raise InvalidArgumentError("expected an OpenSessionRequest", field="request")
        if not request.fence.owner_instance_id and self.endpoint.instance_id:
            request = replace(request, fence=Fence(self.endpoint.instance_id))
        resp = self._call(self._stub.OpenSession, convert.open_request_to_pb(request), 600.0)
        return ClientSession(
            self,
            session_id=resp.session_id,
            info=convert.model_info_from_pb(resp.info),
            identity=convert.manifest_from_pb(resp.identity),
            epoch=resp.owner_epoch,
        )

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

    def close(self) -> None:
        self._channel.close()

    def __enter__(self) -> Client:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.close()


class ClientSession:
    """A session over one Session stream. Not for concurrent use by several threads."""

    def __init__(
        self, client: Client, *, session_id: str, info: ModelInfo, identity: ContextManifest, epoch: int
    ) -> None:
        self._client = client
        self._id = session_id
        self._info = info
        self._identity = identity
        self.epoch = epoch
        self._outbox: queue.SimpleQueue[object] = queue.SimpleQueue()
        self._ids = itertools.count(1)
        self._lock = threading.RLock()
        self._stream: ClientDecodeStream | None = None
        self._failure: ModeldError | None = None
        self._closed = False
        self._responses: Iterator[pb.SessionResponse] = client._stub.Session(
            iter(self._outbox.get, _END), metadata=client.endpoint.metadata
        )
        attached = self._request(pb.SessionRequest(attach=pb.Attach(session_id=session_id)))
        if attached.WhichOneof("result") != "attached":
            raise InternalError(f"unexpected answer to attach: {attached.WhichOneof('result')}")

    @property
    def session_id(self) -> str:
        return self._id

    @property
    def info(self) -> ModelInfo:
        return self._info

    @property
    def identity(self) -> ContextManifest:
        return self._identity

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
            self._failure = SessionClosedError(
                f"session {self._id}: the daemon ended the stream", session_id=self._id
            )
        except grpc.RpcError as exc:
            self._failure = from_rpc_error(exc, self._client.target)
        raise self._failure

    def _request(
        self, request: pb.SessionRequest, progress: ProgressCallback | None = None
    ) -> pb.SessionResponse:
        """Send one request and read its answer (raises the typed error if it failed).

        ``progress`` receives the daemon's progress reports of a long prefill, which arrive
        before the answer."""
        if self._closed:
            raise SessionClosedError(f"session {self._id} is closed", session_id=self._id)
        if self._failure is not None:
            raise self._failure
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

    # --- contract ---------------------------------------------------------------------------

    def ensure_prefix(self, prefix: PrefixInput, progress: ProgressCallback | None = None) -> PrefixStatus:
        """Make the session's context equal ``prefix`` (see the contract); ``progress`` is called
        with the daemon's progress reports while a long prefill runs (at most every 0.5 s)."""
        if not isinstance(prefix, PrefixInput):
            raise InvalidArgumentError("expected a PrefixInput", field="prefix")
        with self._lock:
            self._finish_stream()
            msg = pb.SessionRequest(ensure_prefix=convert.prefix_input_to_pb(prefix))
            return convert.prefix_status_from_pb(self._request(msg, progress).prefix_status)

    def prefill_suffix(self, suffix: SuffixInput, progress: ProgressCallback | None = None) -> SuffixStatus:
        if not isinstance(suffix, SuffixInput):
            raise InvalidArgumentError("expected a SuffixInput", field="suffix")
        with self._lock:
            self._finish_stream()
            msg = pb.SessionRequest(prefill_suffix=convert.suffix_input_to_pb(suffix))
            return convert.suffix_status_from_pb(self._request(msg, progress).suffix_status)

    def decode(self, config: DecodeConfig) -> ClientDecodeStream:
        if not isinstance(config, DecodeConfig):
            raise InvalidArgumentError("expected a DecodeConfig", field="decode")
        with self._lock:
            self._finish_stream()
            msg = pb.SessionRequest(decode=convert.decode_config_to_pb(config))
            started = self._request(msg)
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
            return convert.report_from_pb(self._request(msg).context)

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
                self._outbox.put(_END)
                cancel = getattr(self._responses, "cancel", None)
                if callable(cancel):
                    cancel()

    def __enter__(self) -> ClientSession:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.close()

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


class ClientDecodeStream:
    """The chunks of one decode, as they arrive. Implements the DecodeStream contract."""

    def __init__(self, session: ClientSession, request_id: int) -> None:
        self._session = session
        self._rid = request_id
        self._done = False
        self._cancel_sent = False

    def __iter__(self) -> ClientDecodeStream:
        return self

    def __next__(self) -> StreamChunk:
        if self._done:
            raise StopIteration
        while True:
            try:
                chunk = decode_chunk(self._session._receive(), self._rid)
            except ModeldError:
                self._done = True
                raise
            if chunk is not None:
                self._done = chunk.final
                return chunk

    def cancel(self) -> None:
        """Ask the engine to stop; the stream then ends with a ``canceled`` chunk."""
        if self._done or self._cancel_sent:
            return
        self._cancel_sent = True
        self._session._outbox.put(pb.SessionRequest(request_id=self._rid, cancel_decode=pb.CancelDecode()))

    def close(self) -> None:
        """Cancel if still running and read up to the final chunk."""
        if self._done:
            return
        self.cancel()
        for _ in self:
            pass

    def __enter__(self) -> ClientDecodeStream:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.close()


def connect(
    address: str | None = None,
    *,
    data_dir: Any = None,
    max_message_bytes: int = DEFAULT_MESSAGE_BYTES,
    token: str | None = None,
) -> Client:
    """Find the daemon (argument, ``MODELD_ADDRESS``, then the owner lease) and connect to it.

    A TCP endpoint's token comes from ``token``, else ``MODELD_TOKEN``, else the data directory.
    """
    return Client(discover(address, data_dir, token), max_message_bytes=max_message_bytes)
