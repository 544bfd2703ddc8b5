"""The asyncio runtime client: the same shape as :mod:`runtime_client.client`, awaitable.

``async with aconnect() as client`` (or ``client = await aconnect()``) gives an
:class:`AsyncClient`; its sessions have ``await session.ensure_prefix(...)``,
``await session.prefill_suffix(...)``, and ``stream = await session.decode(...)`` followed by
``async for chunk in stream``. Errors are the same typed exceptions as everywhere else, and
sessions resume across a daemon restart the same way (:mod:`runtime_client.resume`).
"""

from __future__ import annotations

import asyncio
import itertools
import time
from collections.abc import Awaitable, Callable, Generator
from pathlib import Path
from types import TracebackType
from typing import Any, TypeVar

import grpc
import grpc.aio

from modeld.contract import (
    AsyncClosing,
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
    ModeldError,
    NotOwnerError,
    StaleFenceError,
)
from modeld.observe.records import RecordQuery, RequestRecord
from modeld.observe.status import DaemonStatus, SessionSummary
from modeld.v1 import modeld_pb2 as pb
from modeld.v1 import modeld_pb2_grpc as pb_grpc
from modeld.wire import convert, records
from modeld.wire.status import from_rpc_error, from_status
from runtime_client.client import DEFAULT_MESSAGE_BYTES, channel_options, check_size, decode_chunk
from runtime_client.common import ClientBase, DecodeStreamBase, SessionBase
from runtime_client.discovery import Discovery, Endpoint
from runtime_client.resume import (
    LOST_REASONS,
    POLL_SECONDS,
    PROBE_TIMEOUT,
    RESUME_TIMEOUT,
    Resume,
)

__all__ = ["AsyncClient", "AsyncClientDecodeStream", "AsyncClientSession", "AsyncConnect", "aconnect"]

_Result = TypeVar("_Result")


class AsyncClient(ClientBase, AsyncClosing):
    """Implements the AsyncService contract over a grpc.aio channel. ``resume`` and ``job`` (the
    label the sessions' request records carry, sent as ``x-modeld-job`` metadata): as
    :class:`~runtime_client.client.Client`."""

    def __init__(
        self,
        endpoint: Endpoint,
        *,
        max_message_bytes: int = DEFAULT_MESSAGE_BYTES,
        resume: bool = True,
        resume_timeout: float = RESUME_TIMEOUT,
        discovery: Discovery | None = None,
        job: str = "",
    ) -> None:
        super().__init__(endpoint, max_message_bytes, resume, resume_timeout, discovery)
        self.job = job
        self._follow_lock = asyncio.Lock()
        self._retired: list[grpc.aio.Channel] = []
        self._channel = self._dial(endpoint.target)
        self._stub = pb_grpc.ModeldStub(self._channel)

    def _dial(self, target: str) -> grpc.aio.Channel:
        return grpc.aio.insecure_channel(target, options=channel_options(self.max_message_bytes))

    async def _call(self, method: Any, request: Any, timeout: float) -> Any:
        metadata = self.endpoint.metadata
        if self.job:
            metadata = (*(metadata or ()), ("x-modeld-job", self.job))
        try:
            return await method(request, timeout=timeout, metadata=metadata)
        except grpc.RpcError as exc:
            raise from_rpc_error(exc, self.endpoint.target) from None

    # --- following a restarted daemon -------------------------------------------------------

    async def _follow(self, old_instance: str, old_epoch: int, *, fenced: bool, deadline: float) -> None:
        """As :meth:`runtime_client.client.Client._follow`."""
        async with self._follow_lock:
            while True:
                try:
                    await self._find(old_instance, old_epoch, fenced=fenced)
                    return
                except ModeldError as exc:
                    self._still_lost(exc, deadline)
                await asyncio.sleep(POLL_SECONDS)

    async def _find(self, old_instance: str, old_epoch: int, *, fenced: bool) -> None:
        endpoint = self._discovery.find()
        record = self._discovery.owner_record(endpoint)
        channel = self._dial(endpoint.target)
        try:
            try:
                status = await pb_grpc.ModeldStub(channel).Status(
                    pb.StatusRequest(), timeout=PROBE_TIMEOUT, metadata=endpoint.metadata
                )
            except grpc.RpcError as exc:
                raise from_rpc_error(exc, endpoint.target) from None
            self._may_follow(endpoint, record, status.instance_id, old_instance, old_epoch, fenced=fenced)
        except BaseException:
            await channel.close()
            raise
        if self._is_current(endpoint, status.instance_id):
            await channel.close()
            return
        self._retired.append(self._channel)
        self._channel, self._stub = channel, pb_grpc.ModeldStub(channel)
        self._adopt(endpoint, status.instance_id, int(status.epoch))

    async def _open(self, request: OpenSessionRequest) -> tuple[Any, bool]:
        sent, auto = self._fenced(request)
        try:
            return await self._call(self._stub.OpenSession, convert.open_request_to_pb(sent), 600.0), auto
        except StaleFenceError:
            if not (self.resume and auto):
                raise
        await self._follow(sent.fence.owner_instance_id, self.endpoint.epoch, fenced=True, deadline=0.0)
        sent, auto = self._fenced(request)
        return await self._call(self._stub.OpenSession, convert.open_request_to_pb(sent), 600.0), auto

    # --- Service --------------------------------------------------------------------------

    async def describe(self, request: OpenSessionRequest) -> ModelInfo:
        msg = pb.DescribeRequest(model=convert.open_request_to_pb(request))
        return convert.model_info_from_pb((await self._call(self._stub.Describe, msg, 60.0)).info)

    async def open_session(self, request: OpenSessionRequest) -> AsyncClientSession:
        if not isinstance(request, OpenSessionRequest):
            raise InvalidArgumentError("expected an OpenSessionRequest", field="request")
        resp, auto = await self._open(request)
        session = AsyncClientSession(self, request=request, auto_fenced=auto)
        await session._attach(resp)
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

    async def list_requests(
        self,
        *,
        job: str = "",
        conversation: str = "",
        since: float = 0.0,
        limit: int = 100,
        running: bool = False,
    ) -> list[RequestRecord]:
        """The daemon's request records, the newest ``limit`` that match, oldest first."""
        query = RecordQuery(job=job, conversation=conversation, since=since, limit=limit, running=running)
        resp = await self._call(self._stub.ListRequests, records.query_to_pb(query), 30.0)
        return [records.record_from_pb(r) for r in resp.records]

    async def request(self, rid: str) -> RequestRecord | None:
        """One request record by its id (running or done), None when there is none."""
        resp = await self._call(self._stub.ListRequests, records.query_to_pb(RecordQuery(), rid), 30.0)
        return records.record_from_pb(resp.records[0]) if resp.records else None

    async def close(self) -> None:
        for channel in (*self._retired, self._channel):
            await channel.close()
        self._retired.clear()


class AsyncClientSession(SessionBase, AsyncClosing):
    """A session over one Session stream (asyncio). Operations are serialized by a lock.
    Resumes across a daemon restart as :class:`~runtime_client.client.ClientSession` does."""

    def __init__(
        self, client: AsyncClient, *, request: OpenSessionRequest, auto_fenced: bool = False
    ) -> None:
        super().__init__(client, request, auto_fenced)
        self._client: AsyncClient = client
        self._lock = asyncio.Lock()
        self._stream: AsyncClientDecodeStream | None = None
        self._id = ""
        self._call: Any = None  # the Session stream (a grpc.aio stream-stream call)

    async def _attach(self, opened: Any) -> None:
        """Open a Session stream for the freshly opened session and attach to it."""
        self._id = opened.session_id
        self._info = convert.model_info_from_pb(opened.info)
        self._identity = convert.manifest_from_pb(opened.identity)
        self.epoch = int(opened.owner_epoch)
        self._instance = opened.owner_instance_id
        self._ids = itertools.count(1)
        self._failure = None
        if self._call is not None:
            self._call.cancel()  # the stream of the session this one replaces
        self._call = self._client._stub.Session(metadata=self._client.endpoint.metadata)
        resp = await self._request(pb.SessionRequest(attach=pb.Attach(session_id=self._id)))
        if resp.WhichOneof("result") != "attached":
            raise InternalError(f"unexpected answer to attach: {resp.WhichOneof('result')}")

    async def _send(self, request: pb.SessionRequest, rid: int | None = None) -> int:
        request.request_id = next(self._ids) if rid is None else rid
        check_size(request, self._client.max_message_bytes)
        try:
            await self._call.write(request)
        except grpc.RpcError as exc:
            raise self._note(from_rpc_error(exc, self._client.endpoint.target)) from None
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
            raise self._note(from_rpc_error(exc, self._client.endpoint.target)) from None
        if resp is grpc.aio.EOF:
            raise self._ended()
        assert isinstance(resp, pb.SessionResponse)
        return resp

    async def _request(
        self, request: pb.SessionRequest, progress: ProgressCallback | None = None
    ) -> pb.SessionResponse:
        self._check_usable()
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

    async def _ensure(self, prefix: PrefixInput, progress: ProgressCallback | None) -> PrefixStatus:
        msg = pb.SessionRequest(ensure_prefix=convert.prefix_input_to_pb(prefix))
        return convert.prefix_status_from_pb((await self._request(msg, progress)).prefix_status)

    async def _prefill(self, suffix: SuffixInput, progress: ProgressCallback | None) -> SuffixStatus:
        msg = pb.SessionRequest(prefill_suffix=convert.suffix_input_to_pb(suffix))
        return convert.suffix_status_from_pb((await self._request(msg, progress)).suffix_status)

    # --- resuming across a daemon restart ----------------------------------------------------

    async def _resumable(
        self, operation: Callable[[], Awaitable[_Result]], replay: int
    ) -> tuple[_Result, Resume | None]:
        resumed = await self._resume(replay) if self._lost else None
        try:
            return await operation(), resumed
        except ModeldError:
            if resumed is not None or not self._lost:
                raise
        resumed = await self._resume(replay)
        return await operation(), resumed

    async def _resume(self, replay: int) -> Resume:
        client = self._client
        started = time.monotonic()
        cause = self._lost
        old = (self._id, self._instance, self.epoch)
        deadline = started + client.resume_timeout
        while True:
            try:
                await client._follow(self._instance, self.epoch, fenced=self._auto_fenced, deadline=deadline)
                sent = self._reopen_request()
                opened = await client._call(client._stub.OpenSession, convert.open_request_to_pb(sent), 600.0)
                await self._attach(opened)
                break
            except (StaleFenceError, NotOwnerError) as exc:
                self._taken_over(exc)
                raise
            except ModeldError as exc:
                if exc.reason not in LOST_REASONS or time.monotonic() >= deadline:
                    raise
                await asyncio.sleep(POLL_SECONDS)
        self._reopened()
        prefix_status: PrefixStatus | None = None
        suffix_status: SuffixStatus | None = None
        try:
            if replay >= 1 and self._prefix is not None:
                prefix_status = await self._ensure(self._prefix, None)
                if replay >= 2 and self._suffix is not None:
                    suffix_status = await self._prefill(self._suffix, None)
        except ModeldError:
            self._replay_failed()
            raise
        return self._resumed(cause, old, started, replay, prefix_status, suffix_status)

    # --- contract ---------------------------------------------------------------------------

    async def ensure_prefix(
        self, prefix: PrefixInput, progress: ProgressCallback | None = None
    ) -> PrefixStatus:
        if not isinstance(prefix, PrefixInput):
            raise InvalidArgumentError("expected a PrefixInput", field="prefix")
        async with self._lock:
            await self._finish_stream()
            status, _ = await self._resumable(lambda: self._ensure(prefix, progress), 0)
            self._prefix, self._suffix = prefix, None
            self._continued = self._generated_lost = False
            return status

    async def prefill_suffix(
        self, suffix: SuffixInput, progress: ProgressCallback | None = None
    ) -> SuffixStatus:
        if not isinstance(suffix, SuffixInput):
            raise InvalidArgumentError("expected a SuffixInput", field="suffix")
        async with self._lock:
            await self._finish_stream()
            status, resumed = await self._resumable(lambda: self._prefill(suffix, progress), 1)
            self._suffix = suffix
            self._continued = self._generated_lost = False
            return self._with_replay(status, resumed)

    async def decode(self, config: DecodeConfig) -> AsyncClientDecodeStream:
        if not isinstance(config, DecodeConfig):
            raise InvalidArgumentError("expected a DecodeConfig", field="decode")
        async with self._lock:
            await self._finish_stream()
            msg = pb.SessionRequest(decode=convert.decode_config_to_pb(config))

            async def start() -> pb.SessionResponse:
                self._check_continuation()
                return await self._request(msg)

            started, _ = await self._resumable(start, 2)
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
            report, _ = await self._resumable(lambda: self._request(msg), 2)
            return convert.report_from_pb(report.context)

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
                self._lost = ""
                self._call.cancel()


class AsyncClientDecodeStream(DecodeStreamBase):
    """The chunks of one decode (asyncio). Implements the AsyncDecodeStream contract."""

    _session: AsyncClientSession

    def __aiter__(self) -> AsyncClientDecodeStream:
        return self

    async def __anext__(self) -> StreamChunk:
        if self._done:
            raise StopAsyncIteration
        while True:
            try:
                chunk = decode_chunk(await self._session._receive(), self._rid)
            except ModeldError as exc:
                raise self._failed(exc) from None
            if chunk is not None:
                return self._took(chunk)

    async def cancel(self) -> None:
        if self._may_cancel():
            await self._session._send(pb.SessionRequest(cancel_decode=pb.CancelDecode()), rid=self._rid)

    async def aclose(self) -> None:
        if self._done:
            return
        try:
            await self.cancel()
            async for _ in self:
                pass
        except ModeldError:
            pass  # the stream's daemon went away: its session has recorded why


class AsyncConnect:
    """What :func:`aconnect` returns: await it for an :class:`AsyncClient`, or use it as
    ``async with aconnect(...) as client`` (closed on exit)."""

    def __init__(self, make: Callable[[], AsyncClient]) -> None:
        self._make = make
        self._client: AsyncClient | None = None

    async def _connect(self) -> AsyncClient:
        return self._make()

    def __await__(self) -> Generator[Any, None, AsyncClient]:
        return self._connect().__await__()

    async def __aenter__(self) -> AsyncClient:
        self._client = self._make()
        return self._client

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        if self._client is not None:
            await self._client.close()
            self._client = None


def aconnect(
    address: str | None = None,
    *,
    data_dir: Any = None,
    max_message_bytes: int = DEFAULT_MESSAGE_BYTES,
    token: str | None = None,
    resume: bool = True,
    resume_timeout: float = RESUME_TIMEOUT,
    job: str = "",
) -> AsyncConnect:
    """Find the daemon (argument, ``MODELD_ADDRESS``, then the owner lease) and connect: the
    asyncio twin of :func:`~runtime_client.client.connect` (``job`` too). ``async with
    aconnect() as client`` and ``client = await aconnect()`` both work."""
    where = Discovery(address, Path(data_dir) if data_dir is not None else None, token)

    def make() -> AsyncClient:
        return AsyncClient(
            where.find(),
            max_message_bytes=max_message_bytes,
            resume=resume,
            resume_timeout=resume_timeout,
            discovery=where,
            job=job,
        )

    return AsyncConnect(make)
