"""Session streams and unary calls do not share one thread pool, a stream that never attaches
holds no thread, and Status always answers (issue 9, item 8).

Before: one ``ThreadPoolExecutor`` of max_sessions + 16 threads ran every RPC, streams
included, so 64 attached sessions plus 16 streams that never attached took every thread and
``Status`` got "Concurrent RPC limit exceeded"; a Describe of a path that blocked held its
thread forever."""

from __future__ import annotations

import shutil
import tempfile
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import grpc
import psutil
import pytest
from daemon_proc import start_serve, stop, wait_serving
from harness import TEST_LIMITS, memory_model

import runtime_client as rc
from modeld.contract import ModelInfo, OpenSessionRequest, PrefixInput
from modeld.daemon import Server, parse_listen
from modeld.engine import Engine
from modeld.errors import InvalidArgumentError, ModelLoadError
from modeld.wire.status import from_rpc_error

pytestmark = pytest.mark.wire

_SESSION = "/modeld.v1.Modeld/Session"


def _never(release: threading.Event) -> Iterator[bytes]:
    """A request stream that sends nothing until released (a client that never attaches)."""
    release.wait()
    return
    yield b""  # pragma: no cover - makes this a generator


def _settled_threads(daemon: psutil.Process, expected: int, wait: float = 10.0) -> int:
    """The daemon's thread count once it is at most ``expected``, or the last count read."""
    deadline = time.monotonic() + wait
    while True:
        count = daemon.num_threads()
        if count <= expected or time.monotonic() > deadline:
            return count
        time.sleep(0.1)


def test_status_answers_with_64_sessions_and_16_streams_that_never_attach() -> None:
    data = Path(tempfile.mkdtemp(prefix="mdg"))
    proc = start_serve(data, data / "s.sock", "--max-sessions", "64", "--attach-timeout", "3")
    release = threading.Event()
    try:
        record = wait_serving(data, proc.pid)
        daemon = psutil.Process(proc.pid)
        with rc.connect(data_dir=data) as client, grpc.insecure_channel(record.endpoint) as channel:
            # 64 sessions, each attached to its own Session stream, each with a prefix.
            sessions = [
                client.open_session(OpenSessionRequest(type="memory", path="tiny")) for _ in range(64)
            ]
            for session in sessions:
                assert session.ensure_prefix(PrefixInput(text="shared prefix\n")).prefix_tokens == 15
            threads = daemon.num_threads()

            # 16 more streams that never send their attach message.
            waiting = [channel.stream_stream(_SESSION)(_never(release)) for _ in range(16)]
            status = client.status()  # answered at once, not "Concurrent RPC limit exceeded"
            assert status.sessions == 64

            # Each waiting stream is ended by the attach timeout with a clear error.
            for call in waiting:
                with pytest.raises(grpc.RpcError) as ended:
                    next(call)
                error = from_rpc_error(ended.value)
                assert isinstance(error, InvalidArgumentError)
                assert error.field == "attach"
                assert "no attach message arrived within 3s" in error.message

            # None of them held a thread of the daemon while it waited (the Status call's own
            # observer thread is the only one started since). Threads the daemon starts for a
            # moment on its own (a hardware inventory refresh, a session's close) may still be
            # ending: the count is read until it settles, for at most 10 s.
            assert _settled_threads(daemon, threads + 1) <= threads + 1

            # And every session still works.
            assert sessions[0].ensure_prefix(PrefixInput(text="shared prefix\n")).reuse.outcome == "warm"
            assert sessions[63].explain_context().prefix_tokens == 15
            for session in sessions:
                session.close()
    finally:
        release.set()
        stop(proc)
        shutil.rmtree(data, ignore_errors=True)


def test_describes_that_hang_time_out_and_status_keeps_answering(monkeypatch: pytest.MonkeyPatch) -> None:
    """40 describes of paths that never finish reading (a hung file system, here a describe
    that blocks until released) each fail with model_load_failed after the describe timeout,
    while Status answers throughout; nothing they hold is shared with Status or sessions."""
    tmp = Path(tempfile.mkdtemp(prefix="mdd"))
    engine = Engine(backends=("memory",), limits=TEST_LIMITS)
    server = Server(engine, parse_listen(f"unix:{tmp}/s.sock"), TEST_LIMITS, describe_timeout=1.0)
    endpoint = server.start()
    release = threading.Event()
    real_describe = engine.describe

    def hung_describe(request: OpenSessionRequest) -> ModelInfo:
        if request.path.startswith("/slow/"):
            release.wait()
        return real_describe(request)

    monkeypatch.setattr(engine, "describe", hung_describe)
    results: list[BaseException | ModelInfo] = []
    lock = threading.Lock()

    def describe(i: int) -> None:
        with rc.Client(rc.Endpoint(endpoint)) as client:
            try:
                info: BaseException | ModelInfo = client.describe(
                    OpenSessionRequest(type="memory", path=f"/slow/model-{i}.gguf")
                )
            except BaseException as exc:
                info = exc
        with lock:
            results.append(info)

    callers = [threading.Thread(target=describe, args=(i,)) for i in range(40)]
    try:
        with rc.Client(rc.Endpoint(endpoint)) as client:
            for caller in callers:
                caller.start()
            answered = 0
            while any(c.is_alive() for c in callers):
                assert client.status().sessions == 0
                answered += 1
            for caller in callers:
                caller.join()
            assert answered > 0
            assert len(results) == 40
            for result in results:
                assert isinstance(result, ModelLoadError)
                assert result.details["timeout"] == "describe_seconds"
                assert "took longer than 1s" in result.message
            # A session opens and works meanwhile (the sessions pool is another pool).
            with client.open_session(OpenSessionRequest(type="memory", path=memory_model().path)) as s:
                assert s.ensure_prefix(PrefixInput(text="still serving\n")).prefix_tokens == 15
    finally:
        release.set()
        server.stop(grace=0.2)
        shutil.rmtree(tmp, ignore_errors=True)
