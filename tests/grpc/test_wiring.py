"""What a first integrator and foreign gRPC clients hit on the wire: the TCP token, counting
tokens, sha256 digests, client strings that are too long, relative paths, reflection-only
clients decoding error details, forged log lines, and the command line's rough edges."""

from __future__ import annotations

import hashlib
import os
import signal
import stat
import subprocess
import sys
import tempfile
import textwrap
import threading
from pathlib import Path

import grpc
import pytest
from daemon_proc import MODELD, modeld, start_serve, stop, wait_serving
from harness import Harness

import runtime_client as rc
from modeld.contract import DecodeConfig, PrefixInput, SuffixInput
from modeld.errors import (
    InvalidArgumentError,
    LimitExceededError,
    ModeldError,
    ModelLoadError,
    SessionClosedError,
    SessionNotFoundError,
    ShuttingDownError,
    StaleFenceError,
    UnauthenticatedError,
)
from modeld.observe.logs import SafeFormatter
from modeld.paths import token_path
from modeld.v1 import modeld_pb2 as pb
from modeld.wire.status import MAX_MESSAGE_CHARS, from_rpc_error

pytestmark = pytest.mark.wire


# --- TCP gRPC requires a token ----------------------------------------------------------------


def test_tcp_grpc_requires_the_token_that_only_the_daemons_user_can_read() -> None:
    tmp = Path(tempfile.mkdtemp(prefix="mdt"))
    proc = subprocess.Popen(
        [MODELD, "--data-dir", str(tmp), "serve", "--backend", "memory", "--listen", "127.0.0.1:0"],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=True,
    )
    try:
        record = wait_serving(tmp)
        assert record.endpoint.startswith("127.0.0.1:")
        token_file = token_path(tmp)
        assert stat.S_IMODE(token_file.stat().st_mode) == 0o600
        with grpc.insecure_channel(record.endpoint) as channel:
            status = channel.unary_unary("/modeld.v1.Modeld/Status")
            with pytest.raises(grpc.RpcError) as err:
                status(pb.StatusRequest().SerializeToString(), timeout=5)
            assert err.value.code() == grpc.StatusCode.UNAUTHENTICATED
            assert isinstance(from_rpc_error(err.value), UnauthenticatedError)
            with pytest.raises(grpc.RpcError) as err:
                status(b"", timeout=5, metadata=(("authorization", "Bearer not-the-token"),))
            assert err.value.code() == grpc.StatusCode.UNAUTHENTICATED
            health = channel.unary_unary("/grpc.health.v1.Health/Check")
            assert health(b"", timeout=5) == b"\x08\x01"  # SERVING, no token needed
        with rc.connect(data_dir=tmp) as client:  # reads the token like it reads the address
            assert client.status().endpoint == record.endpoint
            with client.open_session(rc.OpenSessionRequest(type="memory", path="tiny")) as session:
                assert session.ensure_prefix(PrefixInput(text="hello\n")).prefix_tokens == 7
        with (
            rc.connect(record.endpoint, data_dir=tmp, token="wrong") as client,
            pytest.raises(UnauthenticatedError),
        ):
            client.status()
    finally:
        stop(proc)


# --- counting tokens, digests, client strings ---------------------------------------------------


def test_count_tokens_budgets_text_without_touching_sessions(wire: Harness) -> None:
    assert isinstance(wire.service, rc.Client)
    text = "def f():\n    return 1\n"
    assert wire.service.count_tokens(wire.request(), text) == len(text.encode())
    assert wire.service.tokenize(wire.request(), "hé") == list("hé".encode())
    assert wire.service.status().sessions == 0
    with pytest.raises(LimitExceededError) as err:
        wire.service.count_tokens(wire.request(), "x" * (wire.engine.limits.max_text_bytes + 1))
    assert err.value.limit == "max_text_bytes"


def test_a_sha256_digest_of_the_model_file_is_verified_once_per_file_identity(wire: Harness) -> None:
    model = wire.tmp / "weights.bin"
    model.write_bytes(b"registry weights v1\n")
    digest = "sha256:" + hashlib.sha256(b"registry weights v1\n").hexdigest()
    request = wire.request(path=str(model), digest=digest)
    with wire.service.open_session(request) as session:
        assert session.info.path == str(model)
    wrong = "sha256:" + "0" * 64
    with pytest.raises(ModelLoadError) as err:
        wire.service.describe(wire.request(path=str(model), digest=wrong))
    assert err.value.details["expected"] == wrong and err.value.details["actual"] == digest
    # Verified once per (device, inode, size, mtime): rewriting the bytes in place under the same
    # identity is not noticed; a real change of the file (another mtime) is.
    st = model.stat()
    with model.open("r+b") as f:
        f.write(b"REGISTRY")
    os.utime(model, ns=(st.st_atime_ns, st.st_mtime_ns))
    assert wire.service.describe(request).path == str(model)
    os.utime(model, ns=(st.st_atime_ns, st.st_mtime_ns + 1_000_000_000))
    with pytest.raises(ModelLoadError):
        wire.service.describe(request)
    with pytest.raises(InvalidArgumentError) as bad:
        wire.service.describe(wire.request(path=str(model), digest="sha256:xyz"))
    assert bad.value.field == "digest"


def test_huge_client_strings_get_their_own_error_in_a_status_that_fits(wire: Harness) -> None:
    assert isinstance(wire.service, rc.Client)
    huge = "s" * 20_000
    with pytest.raises(SessionNotFoundError) as err:
        wire.service.explain_context(huge)
    assert len(err.value.message) < 200 and "20000 characters" in err.value.message
    with pytest.raises(SessionNotFoundError):
        rc.ClientSession(wire.service, session_id=huge, info=None, identity=None, epoch=1)  # type: ignore[arg-type]
    with pytest.raises(LimitExceededError) as limit:
        wire.service.open_session(wire.request(kv_cache_type="q" * 20_000))
    assert limit.value.limit == "max_string_bytes"
    with pytest.raises(InvalidArgumentError) as invalid:
        wire.service.open_session(wire.request(prompt_format="p" * 60))
    assert invalid.value.field == "config.prompt_format" and len(invalid.value.message) < 300
    with wire.open() as session:
        ctx = rc.ContextBuilder(identity=session.identity).system("sys\n").build()
        segment = ctx.manifest.segments[0]
        from dataclasses import replace

        bad = replace(ctx.manifest, segments=(replace(segment, kind="k" * 5000),))
        with pytest.raises(LimitExceededError) as seg:
            session.ensure_prefix(PrefixInput(text=ctx.prefix_text, manifest=bad))
        assert seg.value.details["limit"] == "max_string_bytes"
    # Whatever an error repeats, the status stays small.
    from modeld.wire.status import to_status

    status = to_status(ModelLoadError("m" * 100_000, path="p" * 100_000))
    assert len(status.message) == MAX_MESSAGE_CHARS and status.ByteSize() < 2048


def test_a_relative_model_path_error_says_the_daemon_resolves_it(wire: Harness) -> None:
    with pytest.raises(ModelLoadError) as err:
        wire.service.open_session(wire.request(path="models/missing.gguf"))
    assert "relative" in err.value.message and "daemon's working directory" in err.value.message


def test_negative_max_tokens_names_the_field_over_the_wire(wire: Harness) -> None:
    with wire.open() as session:
        session.ensure_prefix(PrefixInput(text="x\n"))
        with pytest.raises(InvalidArgumentError) as err:
            session.decode(DecodeConfig(max_tokens=-1))
        assert err.value.field == "max_tokens" and "max_tokens" in err.value.message


# --- the session's end reaches its stream at once ----------------------------------------------


@pytest.mark.parametrize("how", ["revoke", "shutdown", "close"])
def test_the_engine_tells_the_transport_when_a_session_ends(wire: Harness, how: str) -> None:
    gateway = wire.server.gateway
    hosted = gateway.open(wire.request(), "grpc")
    seen: list[ModeldError] = []
    done = threading.Event()
    hosted.on_end(lambda error: (seen.append(error), done.set()))
    if how == "revoke":
        wire.engine.owner.revoke("instance x took over")
    elif how == "shutdown":
        wire.engine.begin_shutdown()
    else:
        hosted.close()
    assert done.wait(5)
    expected = {"revoke": StaleFenceError, "shutdown": ShuttingDownError, "close": SessionClosedError}[how]
    assert [type(e) for e in seen] == [expected]
    with pytest.raises(SessionNotFoundError):
        gateway.transport_session(hosted.session_id)  # gone from the transport's registry
    late: list[ModeldError] = []
    hosted.on_end(late.append)  # a listener added afterwards is told at once
    assert [type(e) for e in late] == [expected]


def test_a_stream_ends_when_its_session_is_closed_elsewhere(wire: Harness) -> None:
    session = wire.open()
    session.ensure_prefix(PrefixInput(text="hello\n"))
    wire.server.gateway.transport_session(session.session_id).close()  # e.g. reaped, or closed by the daemon
    with pytest.raises(SessionClosedError):
        session.prefill_suffix(SuffixInput(text="x"))


# --- reflection-only clients ----------------------------------------------------------------------

_REFLECTION_CLIENT = textwrap.dedent(
    """
    import sys
    import grpc
    from google.protobuf import descriptor_pb2, descriptor_pool, message_factory
    from grpc_reflection.v1alpha import reflection_pb2, reflection_pb2_grpc

    target = sys.argv[1]
    assert "modeld" not in sys.modules
    channel = grpc.insecure_channel(target)

    def ask(method, **request):
        call = channel.stream_stream(method, request_serializer=lambda m: m.SerializeToString(),
                                     response_deserializer=reflection_pb2.ServerReflectionResponse.FromString)
        return next(iter(call(iter([reflection_pb2.ServerReflectionRequest(**request)]), timeout=10)))

    services = {s.name for s in ask("/grpc.reflection.v1.ServerReflection/ServerReflectionInfo",
                                    list_services="").list_services_response.service}
    assert {"modeld.v1.Modeld", "grpc.reflection.v1.ServerReflection",
            "grpc.reflection.v1alpha.ServerReflection"} <= services, services
    # As grpc-requests and grpc-js do: load only the files the service's file needs.
    files = ask("/grpc.reflection.v1alpha.ServerReflection/ServerReflectionInfo",
                file_containing_symbol="modeld.v1.Modeld").file_descriptor_response.file_descriptor_proto
    pool = descriptor_pool.DescriptorPool()
    protos = [descriptor_pb2.FileDescriptorProto.FromString(b) for b in files]
    added = set()
    while len(added) < len(protos):
        for fdp in protos:
            if fdp.name not in added and all(d in added for d in fdp.dependency):
                pool.Add(fdp)
                added.add(fdp.name)
    cls = lambda name: message_factory.GetMessageClass(pool.FindMessageTypeByName(name))
    Request, Response = cls("modeld.v1.SessionRequest"), cls("modeld.v1.SessionResponse")
    OpenRequest, OpenResponse = cls("modeld.v1.OpenSessionRequest"), cls("modeld.v1.OpenSessionResponse")
    ErrorInfo = cls("google.rpc.ErrorInfo")
    opened = channel.unary_unary("/modeld.v1.Modeld/OpenSession", request_serializer=lambda m: m.SerializeToString(),
                                 response_deserializer=OpenResponse.FromString)(
        OpenRequest(path="tiny", type=3), timeout=10)
    session = channel.stream_stream("/modeld.v1.Modeld/Session", request_serializer=lambda m: m.SerializeToString(),
                                    response_deserializer=Response.FromString)
    requests = [Request(request_id=1, attach={"session_id": opened.session_id}),
                Request(request_id=2, prefill_suffix={"text": "no prefix yet"}),
                Request(request_id=3, close={})]
    answers = list(session(iter(requests), timeout=10))
    error = answers[1].error
    assert error.details[0].type_url == "type.googleapis.com/google.rpc.ErrorInfo", error.details[0].type_url
    info = ErrorInfo.FromString(error.details[0].value)
    print(info.domain, info.reason, answers[2].WhichOneof("result"))
    """
)


def test_a_reflection_only_client_decodes_an_in_stream_errors_error_info(wire: Harness) -> None:
    target = wire.service.target  # type: ignore[attr-defined]
    out = subprocess.run(
        [sys.executable, "-c", _REFLECTION_CLIENT, target], capture_output=True, text=True, timeout=60
    )
    assert out.returncode == 0, out.stderr
    assert out.stdout.split() == ["modeld", "prefix_required", "closed"]


# --- log lines, the command line ---------------------------------------------------------------------


def test_a_newline_in_a_client_string_cannot_forge_a_log_line(tmp_path: Path) -> None:
    tmp = Path(tempfile.mkdtemp(prefix="mdg"))
    proc = start_serve(tmp, tmp / "s.sock")
    try:
        wait_serving(tmp)
        with rc.connect(data_dir=tmp) as client:
            forged = "tiny\n2026-01-01 00:00:00,000 WARNING modeld.daemon: FORGED"
            with client.open_session(rc.OpenSessionRequest(type="memory", path=forged)):
                pass
    finally:
        _, err = stop(proc)
    lines = err.splitlines()
    assert not any(line.startswith("2026-01-01") for line in lines)
    assert any("tiny\\n2026-01-01 00:00:00,000 WARNING modeld.daemon: FORGED" in line for line in lines)


def test_safe_formatter_keeps_tracebacks_but_escapes_messages() -> None:
    import logging

    formatter = SafeFormatter("%(levelname)s %(message)s")
    try:
        raise ValueError("boom")
    except ValueError:
        record = logging.LogRecord("x", logging.ERROR, "f", 1, "path %s", ("a\rb\x1b[31m",), sys.exc_info())
    lines = formatter.format(record).splitlines()
    assert lines[0] == "ERROR path a\\rb\\x1b[31m"
    assert lines[1] == "Traceback (most recent call last):" and lines[-1] == "ValueError: boom"


def test_global_options_are_accepted_after_the_command_and_a_closed_pipe_is_quiet(tmp_path: Path) -> None:
    tmp = Path(tempfile.mkdtemp(prefix="mdc"))
    proc = start_serve(tmp, tmp / "s.sock")
    try:
        wait_serving(tmp)
        after = subprocess.run(
            [MODELD, "status", "--data-dir", str(tmp), "--json"], capture_output=True, text=True, timeout=60
        )
        assert after.returncode == 0, after.stderr
        assert f'"endpoint": "unix:{tmp}/s.sock"' in after.stdout
        metrics = modeld("metrics", "--address", f"unix:{tmp}/s.sock")
        assert metrics.returncode == 0 and "# TYPE modeld_sessions_open gauge" in metrics.stdout
        read, write = os.pipe()
        os.close(read)  # the reader is gone before modeld writes: `modeld status | head -0`
        piped = subprocess.run(
            [MODELD, "--data-dir", str(tmp), "status"],
            stdout=write,
            stderr=subprocess.PIPE,
            text=True,
            timeout=60,
        )
        os.close(write)
        assert piped.returncode == 141
        assert piped.stderr == ""
    finally:
        stop(proc, signal.SIGTERM)


@pytest.mark.llama
def test_errors_never_repeat_a_files_bytes(tmp_path: Path) -> None:
    """Through a model path a client could read the start of a file only the daemon's user may
    read (measured on /etc/shadow); the error must say what is wrong, not what is there."""
    from modeld.engine import Engine

    secret = tmp_path / "shadow"
    secret.write_bytes(b"Qz9x:$6$secret\n")  # (not "root": pytest's tmp_path contains it)
    with Engine(backends=("llama",)) as engine, pytest.raises(ModelLoadError) as err:
        engine.describe(rc.OpenSessionRequest(type="llama", path=str(secret)))
    assert "Qz9x" not in err.value.message and "Qz9x" not in str(err.value.details)
