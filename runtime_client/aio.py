"""The asyncio runtime client: the same shape as :mod:`runtime_client.client`, awaitable.

``async with await aconnect() as client`` gives an :class:`AsyncClient`; its sessions have
``await session.ensure_prefix(...)``, ``await session.prefill_suffix(...)``, and
``stream = await session.decode(...)`` followed by ``async for chunk in stream``. Errors are
the same typed exceptions as everywhere else.
"""

from __future__ import annotations

import asyncio
import itertools
from dataclasses import replace
from types import TracebackType
from typing import Any

import grpc
import grpc.aio

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
from modeld.errors import InternalError, InvalidArgumentError, ModeldError, SessionClosedError
from modeld.manifest import ContextManifest
from modeld.v1 import modeld_pb2 as pb
from modeld.v1 import modeld_pb2_grpc as pb_grpc
from modeld.wire import convert
from modeld.wire.status import from_rpc_error, from_status
from runtime_client.client import DEFAULT_MESSAGE_BYTES, channel_options, check_size, decode_chunk
from runtime_client.discovery import Endpoint, discover

__all__ = ["AsyncClient", "AsyncClientDecodeStream", "AsyncClientSession", "aconnect"]


class AsyncClient:
    """Implements the AsyncService contract over a grpc.aio channel."""

    def __init__(self, endpoint: Endpoint, *, max_message_bytes: int = DEFAULT_MESSAGE_BYTES) -> None:
        self.endpoint = endpoint
        self.max_message_bytes = max_message_bytes
        self._channel = grpc.aio.insecure_channel(endpoint.target, options=channel_options(max_message_bytes))
        self._stub = pb_grpc.ModeldStub(self._channel)

    async def _call(self, method: Any, request: Any, timeout: float) -> Any:
        try:
            return await method(request, timeout=timeout, metadata=self.endpoint.metadata)
        except grpc.RpcError as exc:
            raise from_rpc_error(exc, self.endpoint.target) from None

    async def describe(self, request: OpenSessionRequest) -> ModelInfo:
        msg = pb.DescribeRequest(model=convert.open_request_to_pb(request))
        return convert.model_info_from_pb((await self._call(self._stub.Describe, msg, 60.0)).info)

    async def open_session(self, request: OpenSessionRequest) -> AsyncClientSession:
        if not isinstance(request, OpenSessionRequest):
            raise InvalidArgumentError("expected an OpenSessionRequest", field="request")
        if not request.fence.owner_instance_id and self.endpoint.instance_id:
            request = replace(request, fence=Fence(self.endpoint.instance_id))
        resp = await self._call(self._stub.OpenSession, convert.open_request_to_pb(request), 600.0)
        session = AsyncClientSession(
            self,
            session_id=resp.session_id,
            info=convert.model_info_from_pb(resp.info),
            identity=convert.manifest_from_pb(resp.identity),
            epoch=resp.owner_epoch,
        )
        await session._attach()
        return session

    async def status(self, *, debug: bool = False) -> DaemonStatus:
        """The daemon's status; ``debug`` adds each engine worker's last log lines."""
        return convert.status_from_pb(
            await self._call(self._stub.Status, pb.StatusRequest(debug=debug), 10.0)
        )

    async def list_sessions(self) -> list[SessionSummary]:
        resp = await self._call(self._stub.ListSessions, pb.ListSessionsRequest(), 10.0)
        return [convert.summary_from_pb(s) for s in resp.sessions]

    async def explain_context(self, session_id: str) -> ContextReport:
        req = pb.ExplainContextRequest(session_id=session_id)
        return convert.report_from_pb((await self._call(self._stub.ExplainContext, req, 10.0)).report)

    async def count_tokens(self, request: OpenSessionRequest, text: str) -> int:
        msg = convert.count_tokens_request_to_pb(request, text, False)
        return int((await self._call(self._stub.CountTokens, msg, 600.0)).count)

    async def tokenize(self, request: OpenSessionRequest, text: str) -> list[int]:
        msg = convert.count_tokens_request_to_pb(request, text, True)
        return list((await self._call(self._stub.CountTokens, msg, 600.0)).token_ids)

    async def metrics(self) -> str:
        return str((await self._call(self._stub.Metrics, pb.MetricsRequest(), 10.0)).text)

    async def close(self) -> None:
        await self._channel.close()

    async def __aenter__(self) -> AsyncClient:
        return self

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        await self.close()


class AsyncClientSession:
    """A session over one Session stream (asyncio). Operations are serialized by a lock."""

    def __init__(
        self, client: AsyncClient, *, session_id: str, info: ModelInfo, identity: ContextManifest, epoch: int
    ) -> None:
        self._client = client
        self._id = session_id
        self._info = info
        self._identity = identity
        self.epoch = epoch
        self._ids = itertools.count(1)
        self._lock = asyncio.Lock()
        self._call = client._stub.Session(metadata=client.endpoint.metadata)
        self._stream: AsyncClientDecodeStream | None = None
        self._failure: ModeldError | None = None
        self._closed = False

    @property
    def session_id(self) -> str:
        return self._id

    @property
    def info(self) -> ModelInfo:
        return self._info

    @property
    def identity(self) -> ContextManifest:
        return self._identity

    async def _attach(self) -> None:
        resp = await self._request(pb.SessionRequest(attach=pb.Attach(session_id=self._id)))
        if resp.WhichOneof("result") != "attached":
            raise InternalError(f"unexpected answer to attach: {resp.WhichOneof('result')}")

    async def _send(self, request: pb.SessionRequest, rid: int | None = None) -> int:
        request.request_id = next(self._ids) if rid is None else rid
        check_size(request, self._client.max_message_bytes)
        try:
            await self._call.write(request)
        except grpc.RpcError as exc:
            self._failure = from_rpc_error(exc, self._client.endpoint.target)
            raise self._failure from None
        except asyncio.InvalidStateError:  # the stream already ended: report how
            while True:
                await self._receive()  # raises the status that ended it (or EOF)
        return request.request_id

    async def _receive(self) -> pb.SessionResponse:
        if self._failure is not None:
            raise self._failure
        try:
            resp = await self._call.read()
        except grpc.RpcError as exc:
            self._failure = from_rpc_error(exc, self._client.endpoint.target)
            raise self._failure from None
        if resp is grpc.aio.EOF:
            self._failure = SessionClosedError(
                f"session {self._id}: the daemon ended the stream", session_id=self._id
            )
            raise self._failure
        assert isinstance(resp, pb.SessionResponse)
        return resp

    async def _request(
        self, request: pb.SessionRequest, progress: ProgressCallback | None = None
    ) -> pb.SessionResponse:
        if self._closed:
            raise SessionClosedError(f"session {self._id} is closed", session_id=self._id)
        if self._failure is not None:
            raise self._failure
        rid = await self._send(request)
        while True:
            resp = await self._receive()
            if resp.request_id != rid:
                continue
            if resp.WhichOneof("result") != "progress":
                break
            if progress is not None:
                progress(convert.progress_from_pb(resp.progress))
        if resp.WhichOneof("result") == "error":
            raise from_status(resp.error)
        return resp

    async def _finish_stream(self) -> None:
        if self._stream is not None:
            await self._stream.aclose()
            self._stream = None

    async def ensure_prefix(
        self, prefix: PrefixInput, progress: ProgressCallback | None = None
    ) -> PrefixStatus:
        if not isinstance(prefix, PrefixInput):
            raise InvalidArgumentError("expected a PrefixInput", field="prefix")
        async with self._lock:
            await self._finish_stream()
            msg = pb.SessionRequest(ensure_prefix=convert.prefix_input_to_pb(prefix))
            return convert.prefix_status_from_pb((await self._request(msg, progress)).prefix_status)

    async def prefill_suffix(
        self, suffix: SuffixInput, progress: ProgressCallback | None = None
    ) -> SuffixStatus:
        if not isinstance(suffix, SuffixInput):
            raise InvalidArgumentError("expected a SuffixInput", field="suffix")
        async with self._lock:
            await self._finish_stream()
            msg = pb.SessionRequest(prefill_suffix=convert.suffix_input_to_pb(suffix))
            return convert.suffix_status_from_pb((await self._request(msg, progress)).suffix_status)

    async def decode(self, config: DecodeConfig) -> AsyncClientDecodeStream:
        if not isinstance(config, DecodeConfig):
            raise InvalidArgumentError("expected a DecodeConfig", field="decode")
        async with self._lock:
            await self._finish_stream()
            started = await self._request(pb.SessionRequest(decode=convert.decode_config_to_pb(config)))
            if started.WhichOneof("result") != "decode_started":
                raise InternalError(f"unexpected answer to decode: {started.WhichOneof('result')}")
            self._stream = AsyncClientDecodeStream(self, started.request_id)
            return self._stream

    async def explain_context(self) -> ContextReport:
        async with self._lock:
            if self._closed:
                return await self._client.explain_context(self._id)
            await self._finish_stream()
            msg = pb.SessionRequest(explain_context=pb.ExplainContextRequest())
            return convert.report_from_pb((await self._request(msg)).context)

    async def close(self) -> None:
        async with self._lock:
            if self._closed:
                return
            try:
                await self._finish_stream()
                if self._failure is None:
                    await self._request(pb.SessionRequest(close=pb.CloseRequest()))
                    await self._call.done_writing()
            except ModeldError:
                pass
            finally:
                self._closed = True
                self._call.cancel()

    async def __aenter__(self) -> AsyncClientSession:
        return self

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        await self.close()


class AsyncClientDecodeStream:
    """The chunks of one decode (asyncio). Implements the AsyncDecodeStream contract."""

    def __init__(self, session: AsyncClientSession, request_id: int) -> None:
        self._session = session
        self._rid = request_id
        self._done = False
        self._cancel_sent = False

    def __aiter__(self) -> AsyncClientDecodeStream:
        return self

    async def __anext__(self) -> StreamChunk:
        if self._done:
            raise StopAsyncIteration
        while True:
            try:
                chunk = decode_chunk(await self._session._receive(), self._rid)
            except ModeldError:
                self._done = True
                raise
            if chunk is not None:
                self._done = chunk.final
                return chunk

    async def cancel(self) -> None:
        if self._done or self._cancel_sent:
            return
        self._cancel_sent = True
        await self._session._send(pb.SessionRequest(cancel_decode=pb.CancelDecode()), rid=self._rid)

    async def aclose(self) -> None:
        if self._done:
            return
        await self.cancel()
        async for _ in self:
            pass


async def aconnect(
    address: str | None = None,
    *,
    data_dir: Any = None,
    max_message_bytes: int = DEFAULT_MESSAGE_BYTES,
    token: str | None = None,
) -> AsyncClient:
    """Find the daemon (argument, ``MODELD_ADDRESS``, then the owner lease) and connect."""
    return AsyncClient(discover(address, data_dir, token), max_message_bytes=max_message_bytes)
