"""The gRPC servicer: converts protobuf to the contract, delegates through the gateway, maps errors.

Thin by design: no engine logic here, and no engine import: it reaches the engine only through
:class:`~modeld.server.gateway.Gateway` (the contract plus observers), the same path the HTTP
endpoint takes. What it adds is what only this transport knows about:

* the Session stream's life: attach first, one stream per session, the session closed when
  the stream ends for any reason (the client closes it, disconnects, or the daemon stops);
  the stream ends at once when the session ends elsewhere (a takeover revoked its epoch, the
  daemon is stopping): the gateway's end notification puts that error in the stream's inbox;
* ``cancel_decode`` read concurrently with a running decode (a reader thread feeds an inbox,
  so a cancel reaches the engine within one token step);
* malformed messages (which fail to parse) answered with INVALID_ARGUMENT instead of gRPC's
  generic INTERNAL, and every other failure mapped through the error table.
"""

from __future__ import annotations

import logging
import queue
import threading
import uuid
from collections.abc import Callable, Generator, Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any, Generic, TypeVar

import grpc
from google.protobuf.message import DecodeError, Message

from modeld.contract import DecodeStream, PrefillProgress, ProgressCallback
from modeld.errors import (
    InternalError,
    InvalidArgumentError,
    ModeldError,
    NotOwnerError,
    SessionClosedError,
    ShuttingDownError,
    StaleFenceError,
)
from modeld.server.gateway import Gateway, Hosted
from modeld.v1 import modeld_pb2 as pb
from modeld.wire import convert
from modeld.wire.status import to_grpc_status, to_status

__all__ = ["SERVICE_NAME", "ModeldServicer", "add_to_server"]

log = logging.getLogger("modeld.server")

SERVICE_NAME = "modeld.v1.Modeld"
_FATAL = (StaleFenceError, NotOwnerError, ShuttingDownError, SessionClosedError)
"""Errors after which a Session stream cannot continue: it ends with that status."""

_Req = TypeVar("_Req", bound=Message)
_In = TypeVar("_In")
_Out = TypeVar("_Out")


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


class ModeldServicer:
    """Implements modeld.v1.Modeld over a :class:`~modeld.server.gateway.Gateway`."""

    def __init__(self, gateway: Gateway) -> None:
        self.gateway = gateway
        # Session operations run here while the stream's thread sends their progress reports.
        self._ops = ThreadPoolExecutor(
            max_workers=gateway.limits.max_sessions + 4, thread_name_prefix="session-op"
        )

    # --- unary ----------------------------------------------------------------------------

    def _unary(
        self, name: str, fn: Callable[[Any], Message], request: Any, context: grpc.ServicerContext
    ) -> Message:
        try:
            _check(request)
            return fn(request)
        except ModeldError as exc:
            context.abort_with_status(to_grpc_status(exc))
        except Exception as exc:
            context.abort_with_status(to_grpc_status(_internal(exc, name)))
        raise AssertionError("unreachable")  # pragma: no cover - abort raises

    def Describe(self, request: Any, context: grpc.ServicerContext) -> Message:
        def run(req: pb.DescribeRequest) -> Message:
            info = self.gateway.describe(convert.open_request_from_pb(req.model))
            return pb.DescribeResponse(
                info=convert.model_info_to_pb(info), machine=convert.machine_to_pb(self.gateway.machine())
            )

        return self._unary("Describe", run, request, context)

    def OpenSession(self, request: Any, context: grpc.ServicerContext) -> Message:
        def run(req: pb.OpenSessionRequest) -> Message:
            hosted = self.gateway.open(convert.open_request_from_pb(req), "grpc")
            session = hosted.session
            owner = self.gateway.owner
            return pb.OpenSessionResponse(
                session_id=session.session_id,
                info=convert.model_info_to_pb(session.info),
                owner_epoch=owner.epoch,
                owner_instance_id=owner.instance_id,
                identity=convert.manifest_to_pb(session.identity),
            )

        return self._unary("OpenSession", run, request, context)

    def ExplainContext(self, request: Any, context: grpc.ServicerContext) -> Message:
        def run(req: pb.ExplainContextRequest) -> Message:
            report = self.gateway.explain(req.session_id)
            return pb.ExplainContextResponse(report=convert.report_to_pb(report))

        return self._unary("ExplainContext", run, request, context)

    def ListSessions(self, request: Any, context: grpc.ServicerContext) -> Message:
        def run(req: pb.ListSessionsRequest) -> Message:
            sessions = [convert.summary_to_pb(s) for s in self.gateway.list_sessions()]
            return pb.ListSessionsResponse(sessions=sessions)

        return self._unary("ListSessions", run, request, context)

    def Status(self, request: Any, context: grpc.ServicerContext) -> Message:
        return self._unary(
            "Status",
            lambda req: convert.status_to_pb(self.gateway.status(debug=req.debug)),
            request,
            context,
        )

    def CountTokens(self, request: Any, context: grpc.ServicerContext) -> Message:
        def run(req: pb.CountTokensRequest) -> Message:
            model, text, with_ids = convert.count_tokens_request_from_pb(req)
            ids = self.gateway.tokenize(model, text)
            return pb.CountTokensResponse(count=len(ids), token_ids=ids if with_ids else ())

        return self._unary("CountTokens", run, request, context)

    def Metrics(self, request: Any, context: grpc.ServicerContext) -> Message:
        def run(_req: pb.MetricsRequest) -> Message:
            text, content_type = self.gateway.metrics_text()
            return pb.MetricsResponse(text=text.decode("utf-8"), content_type=content_type)

        return self._unary("Metrics", run, request, context)

    # --- the Session stream ---------------------------------------------------------------

    def Session(
        self, request_iterator: Iterator[Any], context: grpc.ServicerContext
    ) -> Iterator[pb.SessionResponse]:
        inbox: queue.SimpleQueue[object] = queue.SimpleQueue()
        state = _StreamState()

        def reader() -> None:
            try:
                for req in request_iterator:
                    if isinstance(req, pb.SessionRequest) and req.WhichOneof("op") == "cancel_decode":
                        state.cancel(req.request_id)
                        continue
                    inbox.put(req)
            except Exception:  # the RPC ended (client gone or cancelled)
                pass
            inbox.put(_EOF)

        threading.Thread(target=reader, name="session-reader", daemon=True).start()
        failure: ModeldError | None = None
        try:
            yield from self._session_stream(inbox, state, context)
        except ModeldError as exc:
            failure = exc
        except Exception as exc:
            failure = _internal(exc, "Session")
        finally:
            hosted = state.hosted
            if hosted is not None:
                threading.Thread(target=hosted.close, name="session-close", daemon=True).start()
        if failure is not None:
            context.abort_with_status(to_grpc_status(failure))  # raises: ends the stream

    def _session_stream(
        self, inbox: queue.SimpleQueue[object], state: _StreamState, context: grpc.ServicerContext
    ) -> Iterator[pb.SessionResponse]:
        try:
            first = inbox.get(timeout=self.gateway.limits.attach_timeout_seconds)
        except queue.Empty:
            raise InvalidArgumentError("no attach message arrived in time", field="attach") from None
        if first is _EOF:
            return
        _check(first)
        assert isinstance(first, pb.SessionRequest)
        if first.WhichOneof("op") != "attach":
            raise InvalidArgumentError("the first message on a Session stream must be attach", field="op")
        hosted = self.gateway.hosted(first.attach.session_id)
        if not self.gateway.attach(hosted):
            raise InvalidArgumentError(
                f"session {hosted.session_id} is already attached to another stream",
                field="attach.session_id",
            )
        state.hosted = hosted
        hosted.on_end(lambda error: inbox.put(_Ended(error)))
        context.add_callback(lambda: _on_rpc_done(hosted))
        session = hosted.session
        yield pb.SessionResponse(
            request_id=first.request_id, attached=pb.Attached(session_id=hosted.session_id)
        )
        while True:
            item = inbox.get()
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
                    status = yield from self._reporting(rid, session.ensure_prefix, prefix)
                    yield pb.SessionResponse(
                        request_id=rid, prefix_status=convert.prefix_status_to_pb(status)
                    )
                elif op == "prefill_suffix":
                    suffix = convert.suffix_input_from_pb(item.prefill_suffix)
                    sstatus = yield from self._reporting(rid, session.prefill_suffix, suffix)
                    yield pb.SessionResponse(
                        request_id=rid, suffix_status=convert.suffix_status_to_pb(sstatus)
                    )
                elif op == "decode":
                    stream = session.decode(convert.decode_config_from_pb(item.decode))
                    state.start(rid, stream)
                    try:
                        yield pb.SessionResponse(request_id=rid, decode_started=pb.DecodeStarted())
                        for chunk in stream:
                            yield pb.SessionResponse(request_id=rid, chunk=convert.chunk_to_pb(chunk))
                    finally:
                        state.finish(stream)
                elif op == "explain_context":
                    report = session.explain_context()
                    yield pb.SessionResponse(request_id=rid, context=convert.report_to_pb(report))
                elif op == "close":
                    session.close()
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

    def _reporting(
        self, rid: int, operation: Callable[[_In, ProgressCallback], _Out], argument: _In
    ) -> Generator[pb.SessionResponse, None, _Out]:
        """Run a prefill on the operation pool, sending its progress reports on this stream;
        return its result (or raise its error)."""
        out: queue.SimpleQueue[pb.SessionResponse | _Outcome[_Out]] = queue.SimpleQueue()

        def report(progress: PrefillProgress) -> None:
            out.put(pb.SessionResponse(request_id=rid, progress=convert.progress_to_pb(progress)))

        def work() -> None:
            try:
                out.put(_Outcome(operation(argument, report), None))
            except BaseException as exc:
                out.put(_Outcome(None, exc))

        self._ops.submit(work)
        while True:
            item = out.get()
            if isinstance(item, _Outcome):
                if item.error is not None:
                    raise item.error
                assert item.value is not None
                return item.value
            yield item

    def close(self) -> None:
        self._ops.shutdown(wait=False, cancel_futures=True)


@dataclass(frozen=True, slots=True)
class _Outcome(Generic[_Out]):
    value: _Out | None
    error: BaseException | None


class _StreamState:
    """The session a stream is attached to and the decode it is running (for cancel_decode)."""

    def __init__(self) -> None:
        self.hosted: Hosted | None = None
        self._lock = threading.Lock()
        self._decode: tuple[int, DecodeStream] | None = None

    def start(self, request_id: int, stream: DecodeStream) -> None:
        with self._lock:
            self._decode = (request_id, stream)

    def finish(self, stream: DecodeStream) -> None:
        with self._lock:
            if self._decode is not None and self._decode[1] is stream:
                self._decode = None
        stream.close()

    def cancel(self, request_id: int) -> None:
        with self._lock:
            current = self._decode
        if current is not None and (request_id == 0 or request_id == current[0]):
            current[1].cancel()


def _on_rpc_done(hosted: Hosted) -> None:
    """The RPC ended (any reason): stop the session's work and close it off gRPC's thread."""
    if hosted.ended is None:
        hosted.interrupt()
        threading.Thread(target=hosted.close, name="session-close", daemon=True).start()


def _error(request_id: int, exc: ModeldError) -> pb.SessionResponse:
    return pb.SessionResponse(request_id=request_id, error=to_status(exc))


def add_to_server(servicer: ModeldServicer, server: grpc.Server) -> None:
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
        "Session": grpc.stream_stream_rpc_method_handler(
            servicer.Session,
            request_deserializer=_safe(pb.SessionRequest),
            response_serializer=pb.SessionResponse.SerializeToString,
        ),
    }
    server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler(SERVICE_NAME, handlers),))
