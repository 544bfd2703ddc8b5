"""The engine in a supervised worker process: a crash costs one turn, never the daemon.

Real worker processes, real signals, real files: a worker killed in the middle of a decode, a
model file truncated under a loaded model, a hung (stopped) worker, a crash loop, a daemon
killed with SIGKILL (no orphans), admission slots and queues, timeouts and progress reports.
"""

from __future__ import annotations

import itertools
import os
import shutil
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import psutil
import pytest
from daemon_proc import start_serve, stop, wait_serving

import runtime_client as rc
from modeld.backends.probe import identify
from modeld.contract import (
    Config,
    DecodeConfig,
    OpenSessionRequest,
    PrefillProgress,
    PrefixInput,
    StreamChunk,
    SuffixInput,
)
from modeld.engine import Engine, Limits
from modeld.errors import (
    BusyError,
    EngineRestartedError,
    ModelChangedError,
    NoSlotAvailableError,
    StallTimeoutError,
)
from modeld.settings import Residency, RestartPolicy, Timeouts

testmodels = pytest.importorskip("modeld.testmodels")

TEXT = "def handler(request):\n    return respond(request.body)\n" * 30


def _wait(predicate: Callable[[], object], timeout: float = 20.0) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():
            return True
        time.sleep(0.05)
    return False


def _worker_pid(engine: Engine) -> int:
    worker = engine.status().models[0].worker
    assert worker is not None
    return worker.pid


def _drain(stream: Iterator[StreamChunk]) -> list[StreamChunk]:
    return list(stream)


@pytest.fixture
def tiny_copy(tmp_path: Path) -> str:
    """A private copy of the tiny model (tests may damage it)."""
    path = tmp_path / "tiny.gguf"
    shutil.copyfile(testmodels.ensure_model(testmodels.TINY), path)
    return str(path)


def _llama(path: str, **config: object) -> OpenSessionRequest:
    return OpenSessionRequest(type="llama", path=path, config=Config(**{"num_ctx": 2048, **config}))  # type: ignore[arg-type]


# --- death is noticed at once, fails only what was in flight, and the worker comes back -----------


@pytest.mark.llama
def test_a_worker_killed_mid_decode_fails_that_decode_only_and_is_restarted(tiny_copy: str) -> None:
    with Engine(backends=("llama",)) as engine:
        s = engine.open_session(_llama(tiny_copy))
        s.ensure_prefix(PrefixInput(text=TEXT))
        s.prefill_suffix(SuffixInput(text="why?\n"))
        first_pid = _worker_pid(engine)
        stream = s.decode(DecodeConfig(max_tokens=1500))
        next(iter(stream))
        os.kill(first_pid, signal.SIGKILL)
        final = _drain(stream)[-1]
        assert final.finish_reason == "error"
        assert final.error is not None and final.error.reason == "engine_restarted"
        assert "SIGKILL" in final.error.message
        # The daemon keeps serving: the next turn waits for the new worker and is cold, saying why.
        again = s.ensure_prefix(PrefixInput(text=TEXT))
        assert (again.reuse.outcome, again.reuse.reason) == ("cold", "engine_reset")
        assert again.prefilled_tokens == again.prefix_tokens
        assert _worker_pid(engine) != first_pid
        worker = engine.status().models[0].worker
        assert worker is not None and worker.restarts == 1 and worker.state == "ready"
        assert "SIGKILL" in worker.last_restart_reason
        warm = s.ensure_prefix(PrefixInput(text=TEXT))
        assert warm.reuse.outcome == "warm"


@pytest.mark.llama
def test_a_killed_workers_next_turn_restores_its_context_from_disk(tiny_copy: str, tmp_path: Path) -> None:
    """The write-behind is the crash safety of a live context: the engine writes a long prefix
    to the disk tier (the RAM tier holds no copy of a context in the KV), so when the worker
    dies its next turn restores from disk instead of prefilling."""
    residency = Residency(persist_min_tokens=64)
    with Engine(backends=("llama",), data_dir=tmp_path / "data", residency=residency) as engine:
        s = engine.open_session(_llama(tiny_copy))
        first = s.ensure_prefix(PrefixInput(text=TEXT))
        assert first.prefilled_tokens >= 64
        assert engine.tiers.flush(30)
        tiers = engine.status().tiers
        assert tiers is not None and (tiers.ram_entries, tiers.ram_bytes, tiers.disk_entries) == (0, 0, 1)
        first_pid = _worker_pid(engine)
        os.kill(first_pid, signal.SIGKILL)
        assert _wait(lambda: (w := engine.status().models[0].worker) is not None and w.restarts == 1)
        again = s.ensure_prefix(PrefixInput(text=TEXT))
        assert (again.reuse.outcome, again.reuse.reason, again.reuse.tier) == (
            "warm",
            "restored_from_disk",
            "disk",
        )
        assert again.reused_tokens == first.prefix_tokens and again.prefilled_tokens == 0
        assert _worker_pid(engine) != first_pid


@pytest.mark.llama
@pytest.mark.parametrize("sig", [signal.SIGABRT, signal.SIGSEGV])
def test_a_native_crash_is_named_by_its_signal(tiny_copy: str, sig: signal.Signals) -> None:
    """What a GGML_ASSERT (SIGABRT) or a bad pointer (SIGSEGV) in llama.cpp does to a worker."""
    with Engine(backends=("llama",)) as engine:
        s = engine.open_session(_llama(tiny_copy))
        s.ensure_prefix(PrefixInput(text=TEXT))
        stream = s.decode(DecodeConfig(max_tokens=1500))
        next(iter(stream))
        os.kill(_worker_pid(engine), sig)
        final = _drain(stream)[-1]
        assert final.error is not None and final.error.reason == "engine_restarted"
        assert sig.name in final.error.message
        assert s.ensure_prefix(PrefixInput(text=TEXT)).reuse.reason == "engine_reset"


@pytest.mark.llama
@pytest.mark.parametrize("sig", [signal.SIGKILL, signal.SIGBUS, signal.SIGTERM])
def test_a_worker_killed_while_idle_is_named_by_its_signal(tiny_copy: str, sig: signal.Signals) -> None:
    """An idle worker killed just as a request reaches it dies with those bytes unread: its
    link resets (ECONNRESET) as it goes. Before issue 21 that was reported as "sent a broken
    frame" (every time, on this machine), not by the signal that killed it."""
    # A model file written in the last 2 s is described again before every turn (it may still be
    # being written), which gives the death time to be noticed before the request is sent.
    while not identify(tiny_copy).settled():
        time.sleep(0.1)
    with Engine(backends=("llama",)) as engine:
        s = engine.open_session(_llama(tiny_copy))
        s.ensure_prefix(PrefixInput(text=TEXT))
        (model,) = engine.models()
        os.kill(_worker_pid(engine), sig)
        with pytest.raises(EngineRestartedError) as err:  # its tokenize request meets the death
            s.ensure_prefix(PrefixInput(text=TEXT + "one more line\n"))
        assert f"was killed by {sig.name}" in err.value.message, err.value.message
        assert err.value.details.get("signal") == sig.name
        reason = model.supervisor.status().last_error
        assert f"was killed by {sig.name}" in reason and "broken frame" not in reason, reason
        status = s.ensure_prefix(PrefixInput(text=TEXT))
        assert status.reuse.reason == "engine_reset" and sig.name in status.reuse.message


@pytest.mark.llama
def test_a_model_file_rewritten_in_place_is_named_as_the_cause(tiny_copy: str) -> None:
    """A re-download over a loaded model (the same inode, cut short): the next turn fails with
    ``model_changed`` naming what happened, before the worker touches a vanished page; a worker
    that dies of it (SIGBUS on its mapping) is reported with it too, and is not restarted on the
    new bytes. The daemon serves on (issue 21: the file is checked before every turn)."""
    with Engine(backends=("llama",)) as engine:
        s = engine.open_session(_llama(tiny_copy))
        s.ensure_prefix(PrefixInput(text=TEXT))
        (model,) = engine.models()
        original = Path(tiny_copy).read_bytes()
        with open(tiny_copy, "r+b") as f:  # the same inode, cut short (as a download restarting)
            f.truncate(4096)
        try:
            os.kill(model.supervisor.status().pid, signal.SIGBUS)  # what touching a lost page does
            deadline = time.monotonic() + 30
            while "SIGBUS" not in model.supervisor.status().last_error:
                assert time.monotonic() < deadline
                time.sleep(0.05)
            assert "the model file was truncated in place" in model.supervisor.status().last_error
            with pytest.raises(ModelChangedError) as err:
                s.ensure_prefix(PrefixInput(text=TEXT + "one more line\n" * 50))
            assert err.value.details["change"] == f"truncated in place ({len(original)} -> 4096 bytes)"
            while model.supervisor.status().state != "stopped":  # never restarted on the cut file
                assert time.monotonic() < deadline
                time.sleep(0.05)
            assert model.supervisor.restarts == 0
        finally:
            Path(tiny_copy).write_bytes(original)
        again = engine.open_session(_llama(tiny_copy))  # the file as it is now (the original)
        assert again.ensure_prefix(PrefixInput(text=TEXT)).prefix_tokens > 0


@pytest.mark.llama
def test_a_hung_worker_is_a_stall_and_is_restarted(tiny_copy: str) -> None:
    """A stopped worker makes no progress and uses no CPU: after stall_seconds it is killed,
    the operation fails with stall_timeout, and the next one runs on a new worker."""
    with Engine(backends=("llama",), timeouts=Timeouts(stall_seconds=2.0)) as engine:
        s = engine.open_session(_llama(tiny_copy, num_batch=8))
        s.ensure_prefix(PrefixInput(text=TEXT))
        pid = _worker_pid(engine)
        os.kill(pid, signal.SIGSTOP)
        started = time.monotonic()
        with pytest.raises(StallTimeoutError) as err:
            s.ensure_prefix(PrefixInput(text=TEXT + "and one more line\n"))
        assert time.monotonic() - started < 30
        assert err.value.details["seconds"] == "2"
        assert not psutil.pid_exists(pid) or psutil.Process(pid).status() == psutil.STATUS_ZOMBIE
        assert s.ensure_prefix(PrefixInput(text=TEXT)).reuse.reason == "engine_reset"


@pytest.mark.slow
@pytest.mark.llama
def test_a_long_prefill_that_uses_cpu_is_not_a_stall() -> None:
    """Liveness is progress or CPU time: a worker busy for seconds in one step (a batch of over
    1000 tokens of the realistic model, no progress report until it ends) is alive."""
    realistic = str(testmodels.ensure_model(testmodels.REALISTIC))
    with Engine(backends=("llama",), timeouts=Timeouts(stall_seconds=1.0)) as engine:
        s = engine.open_session(_llama(realistic, num_ctx=4096, num_batch=2048))
        status = s.ensure_prefix(PrefixInput(text=TEXT * 3))
        assert status.prefilled_tokens == status.prefix_tokens > 1000  # one batch: seconds without a report
        worker = engine.status().models[0].worker
        assert worker is not None and worker.restarts == 0


def test_a_crash_loop_marks_the_model_failed_until_a_client_asks_again() -> None:
    policy = RestartPolicy(backoff_initial=0.05, backoff_max=0.1, crash_limit=3, crash_window=60)
    residency = Residency(isolation="process")
    with Engine(backends=("memory",), restart=policy, residency=residency) as engine:
        request = OpenSessionRequest(type="memory", path="crashy")
        s = engine.open_session(request)
        s.ensure_prefix(PrefixInput(text="hello\n"))
        for _ in range(3):
            pid = _worker_pid(engine)
            os.kill(pid, signal.SIGKILL)
            assert _wait(
                lambda pid=pid: (
                    engine.status().models[0].worker.pid != pid  # type: ignore[union-attr]
                    or engine.status().models[0].worker.state == "failed"
                )
            )  # type: ignore[union-attr]
        assert _wait(lambda: engine.status().models[0].worker.state == "failed")  # type: ignore[union-attr]
        with pytest.raises(EngineRestartedError, match="marked failed"):
            s.ensure_prefix(PrefixInput(text="hello\n"))
        again = engine.open_session(request)  # a client asks again: the model is retried
        assert again.ensure_prefix(PrefixInput(text="hello\n")).prefix_tokens == 7


# --- no orphans ---------------------------------------------------------------------------------


@pytest.mark.llama
def test_a_daemon_killed_with_sigkill_leaves_no_worker_behind(tmp_path: Path) -> None:
    data, sock = tmp_path / "data", tmp_path / "d.sock"
    proc = start_serve(data, sock, backend="llama")
    try:
        wait_serving(data, proc.pid)
        client = rc.connect(f"unix:{sock}")
        session = client.open_session(_llama(str(testmodels.ensure_model(testmodels.TINY))))
        session.ensure_prefix(PrefixInput(text=TEXT))
        workers = [c.pid for c in psutil.Process(proc.pid).children(recursive=True)]
        assert workers, "the model runs in a worker process"
        os.kill(proc.pid, signal.SIGKILL)
        proc.wait(timeout=10)
        client.close()
        assert _wait(lambda: not any(psutil.pid_exists(p) and _alive(p) for p in workers), timeout=5)
    finally:
        stop(proc, signal.SIGKILL)


def _alive(pid: int) -> bool:
    try:
        return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


@pytest.mark.llama
def test_serve_stopping_terminates_its_workers(tmp_path: Path) -> None:
    data, sock = tmp_path / "data", tmp_path / "d.sock"
    proc = start_serve(data, sock, backend="llama")
    try:
        wait_serving(data, proc.pid)
        client = rc.connect(f"unix:{sock}")
        session = client.open_session(_llama(str(testmodels.ensure_model(testmodels.TINY))))
        session.ensure_prefix(PrefixInput(text=TEXT))
        workers = [c.pid for c in psutil.Process(proc.pid).children(recursive=True)]
        client.close()
        code, _ = stop(proc, signal.SIGTERM)
        assert code == 0
        assert _wait(lambda: not any(_alive(p) for p in workers), timeout=5)
    finally:
        stop(proc, signal.SIGKILL)


def test_a_worker_exits_when_its_socket_closes() -> None:
    """The second guard: a worker whose daemon end of the socket is gone exits by itself."""
    import socket as socketlib

    ours, theirs = socketlib.socketpair()
    child = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "modeld.workers.child",
            "--fd",
            str(theirs.fileno()),
            "--parent",
            str(os.getpid()),
        ],
        pass_fds=(theirs.fileno(),),
        stderr=subprocess.DEVNULL,
    )
    theirs.close()
    ours.close()
    assert child.wait(timeout=10) == 0


# --- admission -----------------------------------------------------------------------------------


def test_no_wait_gets_no_slot_available_at_once_and_waiters_are_visible() -> None:
    slow = {"delay_ms": "30"}
    with Engine(backends=("memory",), residency=Residency(slots=1)) as engine:
        a = engine.open_session(OpenSessionRequest(type="memory", path="m"))
        b = engine.open_session(OpenSessionRequest(type="memory", path="m", no_wait=True))
        c = engine.open_session(OpenSessionRequest(type="memory", path="m"))
        a.ensure_prefix(PrefixInput(text="workspace a\n"))
        stream = a.decode(DecodeConfig(max_tokens=200, extra=slow))  # holds the only slot
        next(iter(stream))
        started = time.monotonic()
        with pytest.raises(NoSlotAvailableError) as err:
            b.ensure_prefix(PrefixInput(text="workspace b\n"))
        assert time.monotonic() - started < 1.0
        assert err.value.details["slots"] == "1"
        done: list[object] = []
        waiter = threading.Thread(
            target=lambda: done.append(c.ensure_prefix(PrefixInput(text="workspace c\n")))
        )
        waiter.start()
        assert _wait(lambda: c.explain_context().queue_position == 1, timeout=5)
        assert c.explain_context().queue_wait_seconds >= 0
        stream.close()  # the slot is free: the waiter runs
        waiter.join(timeout=10)
        assert done and c.explain_context().queue_position == 0
        # Per call, no_wait may be asked for or waived.
        stream = a.decode(DecodeConfig(max_tokens=200, extra=slow))
        next(iter(stream))
        with pytest.raises(NoSlotAvailableError):
            c.ensure_prefix(PrefixInput(text="workspace c\n", no_wait=True))
        stream.close()


def test_a_caller_that_waits_too_long_gets_busy() -> None:
    limits = Limits(model_wait_seconds=0.3)
    with Engine(backends=("memory",), residency=Residency(slots=1), limits=limits) as engine:
        a = engine.open_session(OpenSessionRequest(type="memory", path="m"))
        b = engine.open_session(OpenSessionRequest(type="memory", path="m"))
        a.ensure_prefix(PrefixInput(text="a\n"))
        stream = a.decode(DecodeConfig(max_tokens=200, extra={"delay_ms": "30"}))
        next(iter(stream))
        with pytest.raises(BusyError):
            b.ensure_prefix(PrefixInput(text="b\n"))
        stream.close()


# --- timeouts and progress ------------------------------------------------------------------------


def test_a_decode_past_the_operation_timeout_stops_with_timeout() -> None:
    with Engine(backends=("memory",), timeouts=Timeouts(operation_seconds=0.5)) as engine:
        s = engine.open_session(OpenSessionRequest(type="memory", path="m"))
        s.ensure_prefix(PrefixInput(text="x\n"))
        final = _drain(s.decode(DecodeConfig(max_tokens=1000, extra={"delay_ms": "100"})))[-1]
        assert final.finish_reason == "error"
        assert final.error is not None and final.error.reason == "timeout"
        assert "operation_seconds" in final.error.message
        assert s.ensure_prefix(PrefixInput(text="x\n")).reuse.outcome == "warm"  # the session goes on


def test_a_decode_with_no_token_for_too_long_stops_with_timeout() -> None:
    with Engine(backends=("memory",), timeouts=Timeouts(idle_stream_seconds=0.5)) as engine:
        s = engine.open_session(OpenSessionRequest(type="memory", path="m"))
        s.ensure_prefix(PrefixInput(text="x\n"))
        final = _drain(s.decode(DecodeConfig(max_tokens=3, extra={"delay_ms": "2000"})))[-1]
        assert final.error is not None and final.error.reason == "timeout"
        assert "idle_stream_seconds" in final.error.message


@pytest.mark.llama
def test_a_long_prefill_reports_its_progress(tiny_copy: str) -> None:
    reports: list[PrefillProgress] = []
    with Engine(backends=("llama",)) as engine:
        # 7.7k tokens two at a time: about 2.6 s on 2 cores (a bigger batch is done in 0.2 s)
        s = engine.open_session(_llama(tiny_copy, num_ctx=8192, num_batch=2))
        status = s.ensure_prefix(PrefixInput(text=TEXT * 16), progress=reports.append)
    assert reports, "a prefill of several seconds reports progress"
    assert all(r.stage == "prefix" and r.total == status.prefilled_tokens for r in reports)
    assert [r.done for r in reports] == sorted(r.done for r in reports)
    # "at most every 0.5 s" (both figures come from the daemon's monotonic clock)
    assert all(b.elapsed_ms - a.elapsed_ms >= 499.9 for a, b in itertools.pairwise(reports))


@pytest.mark.llama
def test_a_batch_smaller_than_the_number_of_sequences_loads_and_computes(tiny_copy: str) -> None:
    # llama.cpp aborted while reserving its graphs when n_ubatch < n_seq_max (4 by default): the
    # worker died at load and the session failed with engine_restarted.
    with Engine(backends=("llama",)) as engine:
        s = engine.open_session(_llama(tiny_copy, num_batch=1))
        status = s.ensure_prefix(PrefixInput(text=TEXT))
        assert status.prefilled_tokens == status.prefix_tokens > 100
        assert engine.status().models[0].worker.restarts == 0
