"""What only the wire can get wrong: stream lifecycle, disconnects, malformed and oversized
messages, unknown ids, limits, health and reflection. The daemon must answer each with a clear
error and keep serving."""

from __future__ import annotations

import asyncio
import time

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection_pb2, reflection_pb2_grpc
from harness import Harness

import runtime_client as rc
from modeld.contract import DecodeConfig, PrefixInput, SuffixInput
from modeld.daemon import Server
from modeld.errors import (
    InvalidArgumentError,
    LimitExceededError,
    ModeldError,
    SessionClosedError,
    SessionNotFoundError,
    StaleFenceError,
)
from modeld.v1 import modeld_pb2 as pb
from modeld.wire.status import from_rpc_error

pytestmark = pytest.mark.wire


def _channel(h: Harness) -> grpc.Channel:
    assert isinstance(h.service, rc.Client)
    return grpc.insecure_channel(h.service.target)


def _wait_for(predicate: object, timeout: float = 5.0) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():  # type: ignore[operator]
            return True
        time.sleep(0.02)
    return False


def test_status_health_and_reflection(wire: Harness) -> None:
    assert isinstance(wire.service, rc.Client)
    status = wire.service.status()
    assert status.instance_id == wire.engine.owner.instance_id
    assert status.backends == ("memory",)
    assert status.limits["max_sessions"] == wire.engine.limits.max_sessions
    with _channel(wire) as channel:
        health = health_pb2_grpc.HealthStub(channel)
        for service in ("", "modeld.v1.Modeld"):
            resp = health.Check(health_pb2.HealthCheckRequest(service=service), timeout=5)
            assert resp.status == health_pb2.HealthCheckResponse.SERVING
        stub = reflection_pb2_grpc.ServerReflectionStub(channel)
        answers = stub.ServerReflectionInfo(iter([reflection_pb2.ServerReflectionRequest(list_services="")]))
        names = {s.name for a in answers for s in a.list_services_response.service}
        assert {"modeld.v1.Modeld", "grpc.health.v1.Health"} <= names


def test_client_disconnect_closes_the_session(wire: Harness) -> None:
    client = rc.connect(wire.service.target)  # type: ignore[attr-defined]
    session = client.open_session(wire.request())
    session.ensure_prefix(PrefixInput(text="hello world\n"))
    assert [s.session_id for s in wire.engine.list_sessions()] == [session.session_id]
    client.close()  # the channel goes away without a Close
    assert _wait_for(lambda: not wire.engine.list_sessions())
    report = wire.engine.explain_context(session.session_id)
    assert report.closed


@pytest.mark.parametrize("backend", ["memory", pytest.param("llama", marks=pytest.mark.llama)])
def test_client_disconnect_mid_decode_stops_the_engine(backend: str) -> None:
    from harness import MODELS, wire_harness

    model = MODELS[backend]()
    with wire_harness(model) as wire:
        client = rc.connect(wire.service.target)  # type: ignore[attr-defined]
        session = client.open_session(wire.request())
        session.ensure_prefix(PrefixInput(text="hello world\n"))
        stream = session.decode(DecodeConfig(max_tokens=3000, extra=model.slow_extra))
        next(stream)
        client.close()
        assert _wait_for(lambda: not wire.engine.list_sessions())
        assert _wait_for(lambda: all(m.admission.busy == 0 for m in wire.engine.models()))
        with wire.open() as other:  # the model is free again, and what it holds is reusable
            assert other.ensure_prefix(PrefixInput(text="hello world\n")).reuse.outcome == "warm"


def test_malformed_unary_message_is_invalid_argument(wire: Harness) -> None:
    with _channel(wire) as channel:
        call = channel.unary_unary("/modeld.v1.Modeld/OpenSession")
        with pytest.raises(grpc.RpcError) as err:
            call(b"\xff\xff\xff\xff garbage", timeout=5)
        assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        mapped = from_rpc_error(err.value)
        assert isinstance(mapped, InvalidArgumentError)
        assert "malformed" in mapped.message
    assert wire.service.status().sessions == 0  # type: ignore[attr-defined]


def _server(h: Harness) -> Server:
    server = h.server
    assert isinstance(server, Server)
    return server


def test_malformed_message_inside_a_session_stream_keeps_the_stream(wire: Harness) -> None:
    opened = _server(wire).gateway.open(wire.request(), "grpc")
    with _channel(wire) as channel:
        call = channel.stream_stream("/modeld.v1.Modeld/Session")
        attach = pb.SessionRequest(request_id=1, attach=pb.Attach(session_id=opened.session_id))
        explain = pb.SessionRequest(request_id=3, explain_context=pb.ExplainContextRequest())
        responses = list(
            call(iter([attach.SerializeToString(), b"\x0a\xff\xff", explain.SerializeToString()]), timeout=5)
        )
        kinds = [pb.SessionResponse.FromString(r).WhichOneof("result") for r in responses]
        assert kinds == ["attached", "error", "context"]


def test_oversized_message_is_refused_and_the_daemon_survives(wire: Harness) -> None:
    too_big = "a" * (wire.engine.limits.max_message_bytes + 10)
    with wire.open() as s:  # the client refuses before sending: the session survives
        with pytest.raises(LimitExceededError) as err:
            s.ensure_prefix(PrefixInput(text=too_big))
        assert err.value.limit == "max_message_bytes"
        assert s.ensure_prefix(PrefixInput(text="still here\n")).prefix_tokens > 0
    # A client with a larger limit than the daemon's: gRPC refuses it at the daemon, which
    # ends that stream and closes its session, and keeps serving everyone else.
    big_client = rc.connect(wire.service.target, max_message_bytes=64 << 20)  # type: ignore[attr-defined]
    s2 = big_client.open_session(wire.request())
    with pytest.raises(LimitExceededError):
        s2.ensure_prefix(PrefixInput(text=too_big))
    big_client.close()
    assert _wait_for(lambda: wire.service.status().sessions == 0)  # type: ignore[attr-defined]
    with wire.open() as s:
        assert s.ensure_prefix(PrefixInput(text="still serving\n")).prefix_tokens > 0


def test_unknown_session_ids_are_not_found(wire: Harness) -> None:
    assert isinstance(wire.service, rc.Client)
    with pytest.raises(SessionNotFoundError):
        wire.service.explain_context("no-such-session")
    with pytest.raises(SessionNotFoundError):
        rc.ClientSession(
            wire.service,
            session_id="no-such-session",
            info=None,
            identity=None,
            epoch=1,  # type: ignore[arg-type]
        )


def test_a_session_attaches_to_one_stream_only(wire: Harness) -> None:
    assert isinstance(wire.service, rc.Client)
    with wire.open() as s:
        with pytest.raises(InvalidArgumentError):
            rc.ClientSession(wire.service, session_id=s.session_id, info=s.info, identity=s.identity, epoch=1)
        assert s.ensure_prefix(PrefixInput(text="still mine\n")).prefix_tokens > 0


def test_unattached_session_is_reaped(wire: Harness) -> None:
    gateway = _server(wire).gateway
    opened = gateway.open(wire.request(), "grpc")
    kept = gateway.open(wire.request(), "http", attached=True)  # another transport's: not reaped
    opened.opened -= wire.engine.limits.attach_timeout_seconds + 1
    kept.opened -= wire.engine.limits.attach_timeout_seconds + 1
    assert gateway.reap_unattached() == [opened.session_id]
    assert isinstance(opened.ended, SessionClosedError)
    assert wire.engine.explain_context(opened.session_id).closed
    assert [s.session_id for s in gateway.list_sessions()] == [kept.session_id]
    kept.close()


def test_takeover_ends_open_streams_with_stale_fence(wire: Harness) -> None:
    s = wire.open()
    s.ensure_prefix(PrefixInput(text="hello\n"))
    wire.engine.owner.revoke("instance other took over")
    with pytest.raises(StaleFenceError):
        s.prefill_suffix(SuffixInput(text="x"))
    with pytest.raises(StaleFenceError):  # and it stays stale
        s.explain_context()


def test_every_error_crosses_the_wire_as_the_same_type(
    wire: Harness, monkeypatch: pytest.MonkeyPatch
) -> None:
    from modeld.errors import ERRORS_BY_REASON

    assert isinstance(wire.service, rc.Client)
    for reason, cls in ERRORS_BY_REASON.items():
        err = cls.from_wire(f"boom {reason}", {"field": "f", "stage": "prefix", "window": "7"})

        def describe(_request: object, err: ModeldError = err) -> object:
            raise err

        monkeypatch.setattr(wire.engine, "describe", describe)
        with pytest.raises(ModeldError) as got:
            wire.service.describe(wire.request())
        assert type(got.value) is cls, reason
        assert got.value.reason == reason
        assert got.value.message == f"boom {reason}"
        assert got.value.details["window"] == "7"


def test_unexpected_exception_becomes_internal_with_an_incident(
    wire: Harness, monkeypatch: pytest.MonkeyPatch
) -> None:
    def describe(_request: object) -> object:
        raise RuntimeError("a bug")

    monkeypatch.setattr(wire.engine, "describe", describe)
    with pytest.raises(ModeldError) as got:
        wire.service.describe(wire.request())
    assert got.value.reason == "internal"
    assert got.value.details["incident"]
    assert "a bug" not in got.value.message  # internals stay in the daemon's log


def test_asyncio_client_has_the_same_shape(wire: Harness) -> None:
    async def scenario() -> None:
        async with await rc.aconnect(wire.service.target) as client:  # type: ignore[attr-defined]
            session = await client.open_session(wire.request())
            first = await session.ensure_prefix(PrefixInput(text="async prefix\n"))
            again = await session.ensure_prefix(PrefixInput(text="async prefix\n"))
            assert (first.reuse.outcome, again.reuse.outcome) == ("cold", "warm")
            await session.prefill_suffix(SuffixInput(text="question\n"))
            stream = await session.decode(DecodeConfig(max_tokens=6))
            chunks = [c async for c in stream]
            assert chunks[-1].finish_reason == "length"
            assert chunks[-1].usage is not None and chunks[-1].usage.completion_tokens == 6
            slow = await session.decode(DecodeConfig(max_tokens=2000, extra={"delay_ms": "20"}))
            await slow.__anext__()
            await slow.cancel()
            rest = [c async for c in slow]
            assert rest[-1].finish_reason == "canceled"
            report = await session.explain_context()
            assert report.prefix_tokens == again.prefix_tokens
            await session.close()
            with pytest.raises(SessionClosedError):
                await session.ensure_prefix(PrefixInput(text="x"))
            assert (await client.explain_context(session.session_id)).closed

    asyncio.run(scenario())


def test_unreachable_daemon_is_a_clear_unavailable_error(tmp_path: object) -> None:
    client = rc.connect("unix:/nonexistent/modeld.sock")
    with pytest.raises(rc.DaemonUnavailableError) as err:
        client.status()
    assert "unix:/nonexistent/modeld.sock" in str(err.value)
    client.close()


def test_a_long_quiet_operation_survives_client_keepalive_pings() -> None:
    """A prefill can run for minutes without a message; the client's keepalive pings must not
    make the daemon drop the connection ("too_many_pings"). Scaled down: client B pings every
    0.5 s (the daemon allowing every 0.25 s) while its ensure_prefix waits ~4 s, with nothing
    sent, for the model that client A's slow decode holds."""
    import tempfile
    import threading

    from harness import TEST_LIMITS, memory_model

    from modeld.daemon import Server, parse_listen
    from modeld.engine import Engine

    tmp = tempfile.mkdtemp(prefix="mdk")
    engine = Engine(backends=("memory",), limits=TEST_LIMITS)
    server = Server(engine, parse_listen(f"unix:{tmp}/s.sock"), TEST_LIMITS, min_ping_interval_ms=250)
    endpoint = server.start()
    request = rc.OpenSessionRequest(type="memory", path=memory_model().path)
    busy, quiet = rc.Client(rc.Endpoint(endpoint)), rc.Client(rc.Endpoint(endpoint), keepalive_ms=500)
    try:
        a, b = busy.open_session(request), quiet.open_session(request)
        a.ensure_prefix(PrefixInput(text="busy\n"))
        stream = a.decode(DecodeConfig(max_tokens=20, extra={"delay_ms": "200"}))
        drain = threading.Thread(target=lambda: list(stream))
        drain.start()
        status = b.ensure_prefix(PrefixInput(text="quiet\n"))  # waits ~4 s for the model
        drain.join()
        assert status.prefix_tokens == 7
        assert b.ensure_prefix(PrefixInput(text="quiet\n")).reuse.outcome == "warm"
    finally:
        busy.close()
        quiet.close()
        server.stop(grace=0.2)
