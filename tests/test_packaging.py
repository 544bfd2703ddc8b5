"""Packaging invariants: generated code matches the proto, public names are pinned, and the
runtime client never drags in the engine, the backends or the server."""

from __future__ import annotations

import importlib.util
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent


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
    import runtime_client

    assert sorted(runtime_client.__all__) == sorted(
        """AsyncClient AsyncClientSession BackendMismatchError BuiltContext Client ClientDecodeStream
        ClientSession Config ContextBuilder ContextManifest ContextOverflowError ContextReport DaemonStatus
        DaemonUnavailableError DecodeConfig Endpoint Fence InvalidArgumentError ManifestMismatchError ModelInfo
        ModeldError NotOwnerError OpenSessionRequest PrefixInput PrefixStatus ReuseDecision Segment
        SessionClosedError SessionSummary StaleFenceError StreamChunk SuffixInput SuffixStatus Usage aconnect
        connect discover Constraint ToolCall ToolCallDelta ToolLoopResult ToolRound ToolRunner AsyncToolRunner
        arun_tools run_tools""".split()
    )
    for name in runtime_client.__all__:
        assert hasattr(runtime_client, name)
    for name in modeld.contract.__all__:
        assert hasattr(modeld.contract, name)


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
