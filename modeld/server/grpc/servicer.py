"""The gRPC servicer: converts protobuf to the contract, delegates through the gateway, maps errors.

Thin by design: no engine logic here, and no engine import: it reaches the engine only through
:class:`~modeld.server.gateway.Gateway` (the contract plus observers), the same path the HTTP
endpoint takes. It runs on a ``grpc.aio`` server (``modeld/daemon.py``): the event loop
only waits; every call into the engine goes through the one asyncio bridge
(:mod:`modeld.server.bridge`), which the HTTP APIs share: Session operations on the
``sessions`` pool, OpenSession and CountTokens on ``calls`` (a model load: no timeout),
Describe on ``probes`` (``describe_seconds``), Status, ListSessions, ExplainContext and Metrics
on ``observers`` (``busy`` after the observer timeout).

A Session stream holds no thread while it waits: not for its attach message (a stream that
never attaches is ended after ``attach_timeout_seconds``), not between operations. What only
this transport knows about:

* the Session stream's life: attach first, one stream per session, the session closed when
  the stream ends for any reason (the client closes it, disconnects, or the daemon stops);
  the stream ends at once when the session ends elsewhere (a takeover revoked its epoch, the
  daemon is stopping): the gateway's end notification puts that error in the stream's inbox;
* ``cancel_decode`` read concurrently with a running decode (a reader task feeds the inbox and
  delivers cancels directly), so the engine stops within one step;
* malformed messages (which fail to parse) answered with INVALID_ARGUMENT instead of gRPC's
  generic INTERNAL, and every other failure mapped through the error table.

What not: blocking the event loop. Only quick, non-blocking calls run on it (attach
bookkeeping, ``DecodeStream.cancel``, ``interrupt``).
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import logging
import threading
import uuid
from collections.abc import AsyncGenerator, AsyncIterator, Callable
from dataclasses import dataclass
from typing import Any, TypeVar

import grpc
from google.protobuf.message import DecodeError, Message

from modeld.contract import PrefillProgress, PrefixStatus, SuffixStatus
from modeld.errors import (
    InternalError,
    InvalidArgumentError,
    LimitExceededError,
    ModeldError,
    ModelLoadError,
    NotOwnerError,
    SessionClosedError,
    ShuttingDownError,
    StaleFenceError,
)
from modeld.server.bridge import Bridge, BridgedSession, BridgedStream, Pools
from modeld.server.gateway import Gateway, TransportSession
from modeld.v1 import modeld_pb2 as pb
from modeld.wire import convert, records
from modeld.wire.status import to_grpc_status, to_status

__all__ = [
    "SERVICE_NAME",
    "ModeldServicer",
    "add_to_server",
    "max_streams",
]

log = logging.getLogger("modeld.server")

SERVICE_NAME = "modeld.v1.Modeld"
_FATAL = (StaleFenceError, NotOwnerError, ShuttingDownError, SessionClosedError)
"""Errors after which a Session stream cannot continue: it ends with that status."""

_T = TypeVar("_T")
_Req = TypeVar("_Req", bound=Message)


def max_streams(max_sessions: int) -> int:
    """Session streams open at once: one per session, once more while sessions change hands,
    plus 16 waiting to attach. Beyond it a new stream is refused at once (``limit_exceeded``)."""
    return 2 * max_sessions + 16


@dataclass(frozen=True, slots=True)
class _Malformed:
    """What a safe deserializer returns for bytes that are not a valid message."""

    type_name: str
    error: str


@dataclass(frozen=True, slots=True)
class _Ended:
    """Put in a stream's inbox when its session ended elsewhere."""

    error: ModeldError


_EOF = object()


def _safe(cls: type[_Req]) -> Callable[[bytes], _Req | _Malformed]:
    def parse(data: bytes) -> _Req | _Malformed:
        try:
            return cls.FromString(data)
        except (DecodeError, ValueError, RuntimeError) as exc:
            return _Malformed(cls.DESCRIPTOR.full_name, str(exc)[:200] or type(exc).__name__)

    return parse


def _check(request: object) -> None:
    if isinstance(request, _Malformed):
        raise InvalidArgumentError(
            f"malformed request: not a valid {request.type_name} ({request.error})",
            field="request",
        )


def _internal(exc: BaseException, where: str) -> InternalError:
    incident = uuid.uuid4().hex[:12]
    log.error("internal error in %s (incident %s)", where, incident, exc_info=exc)
    return InternalError(
        f"internal error in {where} (incident {incident}; see the daemon's log)", incident=incident
    )


def _post(loop: asyncio.AbstractEventLoop, queue: asyncio.Queue[Any], item: object) -> None:
    with contextlib.suppress(RuntimeError):
        loop.call_soon_threadsafe(queue.put_nowait, item)


class ModeldServicer:
    """Implements modeld.v1.Modeld over a :class:`~modeld.server.gateway.Gateway`.
    ``describe_timeout``: how long Describe waits for the engine to read a model file before
    answering ``model_load_failed`` (a hung network file system must not hang the caller;
    ``modeld serve --describe-timeout``)."""

    def __init__(
        self,
        gateway: Gateway,
        bridge: Bridge | None = None,
        *,
        describe_timeout: float,
    ) -> None:
        self.gateway = gateway
        self.bridge = bridge or Bridge(Pools.for_sessions(gateway.limits.max_sessions))
        self.describe_timeout = describe_timeout
        self.max_streams = max_streams(gateway.limits.max_sessions)
        self._streams = 0  # touched on the event loop only

    # --- unary ----------------------------------------------------------------------------

    async def _unary(
        self,
        name: str,
        call: Callable[[], Any],
        request: object,
        context: grpc.aio.ServicerContext[Any, Any],
    ) -> Message:
        try:
            _check(request)
            result: Message = await call()
            return result
        except ModeldError as exc:
            await context.abort_with_status(to_grpc_status(exc))
        except asyncio.CancelledError:
            raise
        except Exception as exc:
            await context.abort_with_status(to_grpc_status(_internal(exc, name)))
        raise AssertionError("unreachable")  # pragma: no cover - abort raises

    async def Describe(self, request: Any, context: grpc.aio.ServicerContext[Any, Any]) -> Message:
        async def run() -> Message:
            model = convert.open_request_from_pb(request.model)

            def late() -> ModeldError:
                return ModelLoadError(
                    f"describing the model took longer than {self.describe_timeout:g}s (a slow or "
                    "hung file system?); the daemon stopped waiting",
                    path=model.path[:200],
                    timeout="describe_seconds",
                )

            info = await self.bridge.probe(
                self.gateway.describe, model, timeout=self.describe_timeout, late=late
            )
            return pb.DescribeResponse(
                info=convert.model_info_to_pb(info), machine=convert.machine_to_pb(self.gateway.machine())
            )

        return await self._unary("Describe", run, request, context)

    async def OpenSession(self, request: Any, context: grpc.aio.ServicerContext[Any, Any]) -> Message:
        async def run() -> Message:
            job = _job(context)
            hosted = await self.bridge.call(
                functools.partial(self.gateway.open, job=job),
                convert.open_request_from_pb(request),
                "grpc",
                abandoned=_close_soon,
            )
            session = hosted.session
            owner = self.gateway.owner
            return pb.OpenSessionResponse(
                session_id=session.session_id,
                info=convert.model_info_to_pb(session.info),
                owner_epoch=owner.epoch,
                owner_instance_id=owner.instance_id,
                identity=convert.manifest_to_pb(session.identity),
            )

        return await self._unary("OpenSession", run, request, context)

    async def ExplainContext(self, request: Any, context: grpc.aio.ServicerContext[Any, Any]) -> Message:
        async def run() -> Message:
            report = await self.bridge.observe(
                lambda: self.gateway.explain_context(request.session_id), "ExplainContext"
            )
            return pb.ExplainContextResponse(report=convert.report_to_pb(report))

        return await self._unary("ExplainContext", run, request, context)

    async def ListSessions(self, request: Any, context: grpc.aio.ServicerContext[Any, Any]) -> Message:
        async def run() -> Message:
            sessions = await self.bridge.observe(self.gateway.list_sessions, "ListSessions")
            return pb.ListSessionsResponse(sessions=[convert.summary_to_pb(s) for s in sessions])

        return await self._unary("ListSessions", run, request, context)

    async def Status(self, request: Any, context: grpc.aio.ServicerContext[Any, Any]) -> Message:
        async def run() -> Message:
            status = await self.bridge.observe(lambda: self.gateway.status(debug=request.debug), "Status")
            return convert.status_to_pb(status)

        return await self._unary("Status", run, request, context)

    async def CountTokens(self, request: Any, context: grpc.aio.ServicerContext[Any, Any]) -> Message:
        async def run() -> Message:
            model, text, with_ids = convert.count_tokens_request_from_pb(request)
            ids = await self.bridge.call(self.gateway.tokenize, model, text)
            return pb.CountTokensResponse(count=len(ids), token_ids=ids if with_ids else ())

        return await self._unary("CountTokens", run, request, context)

    async def Metrics(self, request: Any, context: grpc.aio.ServicerContext[Any, Any]) -> Message:
        async def run() -> Message:
            text, content_type = await self.bridge.observe(self.gateway.metrics_text, "Metrics")
            return pb.MetricsResponse(text=text.decode("utf-8"), content_type=content_type)

        return await self._unary("Metrics", run, request, context)

    async def ListRequests(self, request: Any, context: grpc.aio.ServicerContext[Any, Any]) -> Message:
        async def run() -> Message:
            query, rid = records.query_from_pb(request)
            found = await self.bridge.observe(lambda: self.gateway.requests(query, rid), "ListRequests")
            return pb.ListRequestsResponse(records=[records.record_to_pb(r) for r in found])

        return await self._unary("ListRequests", run, request, context)

    # --- the Session stream ---------------------------------------------------------------

    async def Session(
        self, request_iterator: AsyncIterator[Any], context: grpc.aio.ServicerContext[Any, Any]
    ) -> AsyncIterator[pb.SessionResponse]:
        if self._streams >= self.max_streams:
            error = LimitExceededError(
                f"{self._streams} Session streams are open; the limit is {self.max_streams}",
                limit="max_streams",
                value=self._streams + 1,
                maximum=self.max_streams,
            )
            await context.abort_with_status(to_grpc_status(error))
        self._streams += 1
        inbox: asyncio.Queue[object] = asyncio.Queue()
        state = _StreamState()
        reader = asyncio.create_task(_read(request_iterator, inbox, state))
        failure: ModeldError | None = None
        try:
            async with contextlib.aclosing(self._session_stream(inbox, state, context)) as responses:
                async for response in responses:
                    yield response
        except ModeldError as exc:
            failure = exc
        except asyncio.CancelledError:
            raise
        except Exception as exc:
            failure = _internal(exc, "Session")
        finally:
            self._streams -= 1
            reader.cancel()
            state.cancel(0)  # a decode still running has nobody to stream to
            if state.session is not None:
                _close_when_idle(state.session)
        if failure is not None:
            await context.abort_with_status(to_grpc_status(failure))  # raises: ends the stream

    async def _session_stream(
        self,
        inbox: asyncio.Queue[object],
        state: _StreamState,
        context: grpc.aio.ServicerContext[Any, Any],
    ) -> AsyncGenerator[pb.SessionResponse, None]:
        loop = asyncio.get_running_loop()
        timeout = self.gateway.limits.attach_timeout_seconds
        try:
            first = await asyncio.wait_for(inbox.get(), timeout)
        except TimeoutError:
            raise InvalidArgumentError(
                f"no attach message arrived within {timeout:g}s (attach_timeout_seconds)", field="attach"
            ) from None
        if first is _EOF:
            return
        _check(first)
        assert isinstance(first, pb.SessionRequest)
        if first.WhichOneof("op") != "attach":
            raise InvalidArgumentError("the first message on a Session stream must be attach", field="op")
        hosted = self.gateway.transport_session(first.attach.session_id)
        if not self.gateway.attach(hosted):
            raise InvalidArgumentError(
                f"session {hosted.session_id} is already attached to another stream",
                field="attach.session_id",
            )
        session = self.bridge.session(hosted)
        state.session = session
        hosted.on_end(lambda error: _post(loop, inbox, _Ended(error)))
        # (grpc-stubs declare the callback as a class, not a protocol)
        context.add_done_callback(lambda _context: _on_rpc_done(session))  # type: ignore[arg-type]
        yield pb.SessionResponse(
            request_id=first.request_id, attached=pb.Attached(session_id=hosted.session_id)
        )
        while True:
            item = await inbox.get()
            if item is _EOF:
                return
            if isinstance(item, _Ended):
                raise item.error
            if isinstance(item, _Malformed):
                yield _error(
                    0,
                    InvalidArgumentError(
                        f"malformed request: not a valid {item.type_name} ({item.error})", field="request"
                    ),
                )
                continue
            assert isinstance(item, pb.SessionRequest)
            rid = item.request_id
            op = item.WhichOneof("op")
            try:
                if op == "ensure_prefix":
                    prefix = convert.prefix_input_from_pb(item.ensure_prefix)
                    async for step in session.reporting(session.ensure_prefix, prefix):
                        yield (
                            _reported(rid, step)
                            if isinstance(step, PrefillProgress)
                            else _prefix_done(rid, step)
                        )
                elif op == "prefill_suffix":
                    suffix = convert.suffix_input_from_pb(item.prefill_suffix)
                    async for sstep in session.reporting(session.prefill_suffix, suffix):
                        yield (
                            _reported(rid, sstep)
                            if isinstance(sstep, PrefillProgress)
                            else _suffix_done(rid, sstep)
                        )
                elif op == "decode":
                    stream = await session.decode(convert.decode_config_from_pb(item.decode))
                    state.start(rid, stream)
                    try:
                        yield pb.SessionResponse(request_id=rid, decode_started=pb.DecodeStarted())
                        async for chunk in stream:
                            yield pb.SessionResponse(request_id=rid, chunk=convert.chunk_to_pb(chunk))
                    finally:
                        await state.finish(stream)
                elif op == "explain_context":
                    report = await session.explain_context()
                    yield pb.SessionResponse(request_id=rid, context=convert.report_to_pb(report))
                elif op == "close":
                    await session.close()
                    yield pb.SessionResponse(request_id=rid, closed=pb.Closed())
                    return
                elif op == "attach":
                    raise InvalidArgumentError("this stream is already attached", field="attach")
                else:
                    raise InvalidArgumentError("the request names no operation", field="op")
            except _FATAL:
                raise
            except ModeldError as exc:
                yield _error(rid, exc)
            except Exception as exc:
                yield _error(rid, _internal(exc, f"Session.{op}"))

    def close(self) -> None:
        self.bridge.shutdown()


async def _read(
    request_iterator: AsyncIterator[Any], inbox: asyncio.Queue[object], state: _StreamState
) -> None:
    """Feed a stream's inbox; deliver ``cancel_decode`` at once (a decode is running)."""
    try:
        async for req in request_iterator:
            if isinstance(req, pb.SessionRequest) and req.WhichOneof("op") == "cancel_decode":
                state.cancel(req.request_id)
                continue
            inbox.put_nowait(req)
    except asyncio.CancelledError:
        return
    except Exception:  # the RPC ended (client gone, cancelled, aborted)
        pass
    inbox.put_nowait(_EOF)


class _StreamState:
    """The session a stream is attached to and the decode it is running (for cancel_decode)."""

    def __init__(self) -> None:
        self.session: BridgedSession | None = None
        self._lock = threading.Lock()
        self._decode: tuple[int, BridgedStream] | None = None

    def start(self, request_id: int, stream: BridgedStream) -> None:
        with self._lock:
            self._decode = (request_id, stream)

    async def finish(self, stream: BridgedStream) -> None:
        """The stream stopped streaming this decode: a decode still running is cancelled (its
        pump reads it to its end)."""
        with self._lock:
            if self._decode is not None and self._decode[1] is stream:
                self._decode = None
        await stream.aclose()

    def cancel(self, request_id: int) -> None:
        with self._lock:
            current = self._decode
        if current is not None and (request_id == 0 or request_id == current[0]):
            current[1].cancel_now()


def _job(context: grpc.aio.ServicerContext[Any, Any]) -> str:
    """The job label a client put in the call's ``x-modeld-job`` metadata ("" when none), as
    the session's request records carry it (the gateway refuses a bad one)."""
    for key, value in context.invocation_metadata() or ():
        if key == "x-modeld-job":
            return value.decode("utf-8", errors="replace") if isinstance(value, bytes) else str(value)
    return ""


def _close_soon(hosted: TransportSession) -> None:
    """Close a session off the event loop (closing waits for its running operation)."""
    threading.Thread(target=hosted.close, name="session-close", daemon=True).start()


def _close_when_idle(session: BridgedSession) -> None:
    """Close a session once no operation or decode pump of it runs any more."""
    session.when_idle(lambda: _close_soon(session.hosted))


def _on_rpc_done(session: BridgedSession) -> None:
    """The RPC ended (any reason): stop the session's work and close it off the event loop."""
    if session.hosted.ended is None:
        session.interrupt()
        _close_when_idle(session)


def _reported(request_id: int, progress: PrefillProgress) -> pb.SessionResponse:
    return pb.SessionResponse(request_id=request_id, progress=convert.progress_to_pb(progress))


def _prefix_done(request_id: int, status: PrefixStatus) -> pb.SessionResponse:
    return pb.SessionResponse(request_id=request_id, prefix_status=convert.prefix_status_to_pb(status))


def _suffix_done(request_id: int, status: SuffixStatus) -> pb.SessionResponse:
    return pb.SessionResponse(request_id=request_id, suffix_status=convert.suffix_status_to_pb(status))


def _error(request_id: int, exc: ModeldError) -> pb.SessionResponse:
    return pb.SessionResponse(request_id=request_id, error=to_status(exc))


def add_to_server(servicer: ModeldServicer, server: grpc.aio.Server) -> None:
    """Register the service with safe deserializers (malformed input -> INVALID_ARGUMENT)."""

    def unary(fn: Any, req: type[Message], resp: type[Message]) -> grpc.RpcMethodHandler[Any, Any]:
        return grpc.unary_unary_rpc_method_handler(
            fn, request_deserializer=_safe(req), response_serializer=resp.SerializeToString
        )

    handlers = {
        "Describe": unary(servicer.Describe, pb.DescribeRequest, pb.DescribeResponse),
        "OpenSession": unary(servicer.OpenSession, pb.OpenSessionRequest, pb.OpenSessionResponse),
        "ExplainContext": unary(servicer.ExplainContext, pb.ExplainContextRequest, pb.ExplainContextResponse),
        "ListSessions": unary(servicer.ListSessions, pb.ListSessionsRequest, pb.ListSessionsResponse),
        "Status": unary(servicer.Status, pb.StatusRequest, pb.StatusResponse),
        "CountTokens": unary(servicer.CountTokens, pb.CountTokensRequest, pb.CountTokensResponse),
        "Metrics": unary(servicer.Metrics, pb.MetricsRequest, pb.MetricsResponse),
        "ListRequests": unary(servicer.ListRequests, pb.ListRequestsRequest, pb.ListRequestsResponse),
        "Session": grpc.stream_stream_rpc_method_handler(
            servicer.Session,
            request_deserializer=_safe(pb.SessionRequest),
            response_serializer=pb.SessionResponse.SerializeToString,
        ),
    }
    server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler(SERVICE_NAME, handlers),))
