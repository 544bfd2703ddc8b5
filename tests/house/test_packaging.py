"""Packaging invariants: generated code matches the proto, public names are pinned, and the
runtime client never drags in the engine, the backends or the server."""

from __future__ import annotations

import importlib.util
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


def test_generated_code_matches_the_proto(tmp_path: Path) -> None:
    pytest.importorskip("grpc_tools")
    spec = importlib.util.spec_from_file_location("gen_proto", ROOT / "scripts" / "gen_proto.py")
    assert spec is not None and spec.loader is not None
    gen = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(gen)
    for fresh in gen.generate(tmp_path):
        committed = ROOT / "modeld" / "v1" / fresh.name
        assert committed.read_text() == fresh.read_text(), f"{committed} drifted: run `make proto`"


def test_runtime_client_imports_no_engine_backend_or_server() -> None:
    code = (
        "import sys, runtime_client\n"
        "bad = [m for m in sys.modules if m.startswith(('modeld.engine', 'modeld.backends', 'modeld.server',"
        " 'llama_cpp', 'openvino'))]\n"
        "print(','.join(bad))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == ""


def test_public_names_are_pinned() -> None:
    import modeld.contract
    import modeld.errors
    import runtime_client

    assert sorted(runtime_client.__all__) == sorted(
        """AsyncClient AsyncClientSession BackendMismatchError BackendUnavailableError BuiltContext BusyError
        Client ClientDecodeStream ClientSession Config ContextBuilder ContextManifest ContextOverflowError
        ContextReport DaemonStatus DaemonUnavailableError DeadlineExceededError DecodeConfig Endpoint EngineError
        EngineRestartedError Fence InternalError InvalidArgumentError LimitExceededError ManifestMismatchError
        ModelChangedError ModelInfo ModelLoadError ModeldError NoSlotAvailableError NotOwnerError OpenSessionRequest
        OperationTimeoutError PrefillProgress PrefixInput PrefixRequiredError PrefixStatus Resume ReuseDecision
        Segment SessionClosedError SessionNotFoundError SessionSummary ShuttingDownError StaleFenceError
        StallTimeoutError StreamChunk SuffixInput SuffixStatus UnauthenticatedError UnsupportedError Usage
        WarmContextInfo aconnect connect discover Constraint ToolCall ToolCallDelta ToolLoopResult ToolRound
        ToolRunner AsyncToolRunner arun_tools run_tools""".split()
    )
    for name in runtime_client.__all__:
        assert hasattr(runtime_client, name)
    for name in modeld.contract.__all__:
        assert hasattr(modeld.contract, name)
    # `except rc.BusyError` works for every error a tool can receive: all 26 classes are exported.
    errors = {name for name in modeld.errors.__all__ if name.endswith("Error")}
    assert len(errors) == 26
    assert errors <= set(runtime_client.__all__)
    assert all(getattr(runtime_client, name) is getattr(modeld.errors, name) for name in errors)


def test_transports_reach_the_engine_only_through_the_gateway() -> None:
    """The gRPC servicer and the HTTP endpoint import no engine or backend module; the engine
    imports no transport (the daemon, the composition root, is the one place that builds both)."""
    code = (
        "import sys\n"
        "import modeld.server.grpc.servicer, modeld.server.gateway, modeld.server.http.app\n"
        "bad = [m for m in sys.modules if m.startswith(('modeld.engine', 'modeld.backends', 'llama_cpp', 'openvino'))]\n"
        "print(','.join(sorted(bad)))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == ""
    code = (
        "import sys, modeld.engine, modeld.backends.memory, modeld.observe.metrics\n"
        "bad = [m for m in sys.modules if m.split('.')[0] in ('grpc', 'starlette', 'uvicorn', 'fastapi')"
        " or m.startswith(('google.protobuf', 'modeld.server', 'modeld.wire'))]\n"
        "print(','.join(sorted(bad)))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == ""


def test_implementations_conform_to_the_protocols() -> None:
    from modeld.contract import DecodeStream, Service, Session
    from modeld.engine import Engine

    engine = Engine(backends=("memory",))
    assert isinstance(engine, Service)
    from modeld.contract import OpenSessionRequest, PrefixInput

    with engine.open_session(OpenSessionRequest(path="tiny")) as session:
        assert isinstance(session, Session)
        session.ensure_prefix(PrefixInput(text="x"))
        with session.decode(__import__("modeld.contract").contract.DecodeConfig(max_tokens=1)) as stream:
            assert isinstance(stream, DecodeStream)
    engine.shutdown()


def test_decoding_imports_no_wire_http_or_native_engine() -> None:
    code = (
        "import sys, modeld.decoding.output, modeld.decoding.constraints, modeld.decoding.toolcalls\n"
        "bad = [m for m in sys.modules if m.startswith(('grpc', 'google.protobuf', 'modeld.v1', 'modeld.wire',"
        " 'modeld.server', 'modeld.engine', 'modeld.backends', 'llama_cpp', 'openvino', 'llguidance', 'fastapi',"
        " 'starlette', 'httpx'))]\n"
        "print(','.join(bad))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == ""
