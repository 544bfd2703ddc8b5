"""runtime_client across daemon restarts (issue 21 item 5): real daemons, real signals.

A restart (SIGKILL or SIGTERM, then a new ``modeld serve``) costs an open session a restore
from the disk tier, not an error: its next call reopens it on the new daemon, replays its prefix
(and suffix, before a decode), and answers as if nothing happened -- the same greedy output as
before. A decode in flight fails with ``engine_restarted`` and the tool loop runs the turn
again. A takeover is never followed (``stale_fence``), also when the old owner was hung and
killed by the new one. ``resume=False`` keeps the old behaviour.
"""

from __future__ import annotations

import asyncio
import json
import signal
import subprocess
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
from daemon_proc import start_serve, stop, wait_serving

import runtime_client as rc
from modeld.contract import Config, DecodeConfig, OpenSessionRequest, PrefixInput, StreamChunk, SuffixInput
from modeld.lease import read_lease

pytestmark = pytest.mark.wire

PREFIX = "You are a careful engineer.\nrepo: src/app.py main() load_config()\nsrc/db.py connect()\n" * 3
SUFFIX = "fix the failing test\n"
SUFFIX2 = "why does migrate() hang?\n"


class Daemon:
    """A real ``modeld serve`` in ``data`` that can be killed and started again."""

    def __init__(self, data: Path, backend: str = "memory", *extra: str) -> None:
        self.data, self.backend, self.extra = data, backend, extra
        self.proc: subprocess.Popen[str] | None = None
        self.start()

    def start(self, *more: str) -> None:
        self.proc = start_serve(
            self.data,
            self.data / "d.sock",
            "--persist-min-tokens",
            "8",
            *self.extra,
            *more,
            backend=self.backend,
        )
        wait_serving(self.data, self.proc.pid, timeout=120)

    def stop(self, how: int = signal.SIGKILL) -> None:
        assert self.proc is not None
        _, err = stop(self.proc, how)
        assert "Traceback" not in err, err[-3000:]
        self.proc = None

    def restart(self, how: int) -> None:
        self.stop(how)
        self.start()

    def close(self) -> None:
        if self.proc is not None:
            stop(self.proc, signal.SIGKILL)


def _wait(predicate: Callable[[], object], timeout: float = 30) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.05)


def _snapshots(data: Path) -> int:
    return len(list((data / "kv").glob("*.kvs"))) if (data / "kv").is_dir() else 0


def _decode_with_fault(
    session: Any, config: DecodeConfig, fault: Callable[[], None], got: list[StreamChunk]
) -> None:
    """Decode, letting ``fault`` loose after the first chunk (the decode is then in flight)."""
    with session.decode(config) as stream:
        for chunk in stream:
            got.append(chunk)
            if len(got) == 1:
                fault()


def _persisted(data: Path, n_tokens: int) -> bool:
    """A complete snapshot file of ``n_tokens`` tokens is in the disk tier."""
    from modeld.cache.snapfile import SnapshotError, read_header

    for path in (data / "kv").glob("*.kvs") if (data / "kv").is_dir() else ():
        try:
            if read_header(path)[0].n_tokens == n_tokens:
                return True
        except (OSError, SnapshotError):
            continue
    return False


def _tokens(chunks: list[StreamChunk]) -> list[int]:
    assert chunks[-1].finish_reason in ("length", "stop"), chunks[-1]
    return [t for c in chunks for t in c.token_ids]


@pytest.fixture
def data(tmp_path: Path) -> Path:
    return tmp_path / "data"


@pytest.fixture(scope="module")
def tiny() -> str:
    testmodels = pytest.importorskip("modeld.testmodels")
    return str(testmodels.ensure_model(testmodels.TINY))


def _llama(path: str) -> OpenSessionRequest:
    return OpenSessionRequest(type="llama", path=path, config=Config(num_ctx=2048, num_batch=32))


# --- restarts between turns ----------------------------------------------------------------------


@pytest.mark.llama
@pytest.mark.parametrize("how", [signal.SIGKILL, signal.SIGTERM], ids=["SIGKILL", "SIGTERM"])
def test_a_session_resumes_across_restarts_restored_from_disk_with_the_same_output(
    data: Path, tiny: str, how: int
) -> None:
    daemon = Daemon(data, "llama")
    cause = "unavailable" if how == signal.SIGKILL else "shutting_down"
    try:
        client = rc.connect(data_dir=data)
        session = client.open_session(_llama(tiny))
        first_epoch, first_id = session.epoch, session.session_id
        size = session.ensure_prefix(PrefixInput(text=PREFIX)).prefix_tokens
        session.prefill_suffix(SuffixInput(text=SUFFIX))
        before = _tokens(list(session.decode(DecodeConfig(max_tokens=8))))
        session.prefill_suffix(SuffixInput(text=SUFFIX2))
        before2 = _tokens(list(session.decode(DecodeConfig(max_tokens=8))))
        # The next turn is sent, then the daemon goes away before its decode.
        session.ensure_prefix(PrefixInput(text=PREFIX))
        session.prefill_suffix(SuffixInput(text=SUFFIX))
        _wait(lambda: _snapshots(data) >= 1)  # the prefix was written through to disk
        daemon.restart(how)

        # 1. The decode is the next call: prefix and suffix are replayed, the prefix from disk.
        after = _tokens(list(session.decode(DecodeConfig(max_tokens=8))))
        assert after == before
        resumed = session.last_resume
        assert resumed is not None and resumed.cause == cause
        assert resumed.prefix is not None and resumed.suffix is not None
        assert (resumed.prefix.reuse.outcome, resumed.prefix.reuse.reason, resumed.prefix.reuse.tier) == (
            "warm",
            "restored_from_disk",
            "disk",
        )
        assert (resumed.prefix.reused_tokens, resumed.prefix.prefilled_tokens) == (size, 0)
        assert resumed.suffix.suffix_tokens > 0
        assert (resumed.old_session_id, resumed.old_epoch) == (first_id, first_epoch)
        assert session.session_id == resumed.session_id != first_id
        assert session.epoch == resumed.epoch == first_epoch + 1
        assert resumed.instance_id == read_lease(data).instance_id != resumed.old_instance_id  # type: ignore[union-attr]
        # The daemon's own view of the resumed session says the same.
        assert session.explain_context().last_reuse.reason == "restored_from_disk"  # type: ignore[union-attr]

        # 2. A suffix is the next call: the prefix is replayed; its tokens count as restored.
        daemon.restart(how)
        status = session.prefill_suffix(SuffixInput(text=SUFFIX2))
        assert len(session.resumes) == 2 and session.resumes[1].suffix is None
        replayed = session.resumes[1].prefix
        assert replayed is not None and replayed.reuse.reason == "restored_from_disk"
        assert status.restored_tokens == replayed.prefilled_tokens == 0
        assert _tokens(list(session.decode(DecodeConfig(max_tokens=8)))) == before2

        # 3. A new turn is the next call: its own ensure_prefix restores from disk.
        daemon.restart(how)
        turn = session.ensure_prefix(PrefixInput(text=PREFIX))
        assert (turn.reuse.reason, turn.reused_tokens) == ("restored_from_disk", size)
        assert len(session.resumes) == 3 and session.resumes[2].prefix is None
        session.prefill_suffix(SuffixInput(text=SUFFIX))
        assert _tokens(list(session.decode(DecodeConfig(max_tokens=8)))) == before

        # New sessions of the same client open on the daemon serving now (its fence followed).
        with client.open_session(_llama(tiny)) as other:
            assert other.ensure_prefix(PrefixInput(text=PREFIX)).reuse.outcome == "warm"
        session.close()
        client.close()
    finally:
        daemon.close()


def test_a_call_waits_for_the_daemon_to_come_back(data: Path) -> None:
    daemon = Daemon(data)
    try:
        with rc.connect(data_dir=data, resume_timeout=60) as client:
            session = client.open_session(OpenSessionRequest(type="memory", path="tiny"))
            session.ensure_prefix(PrefixInput(text=PREFIX))
            _wait(lambda: _snapshots(data) >= 1)
            daemon.stop(signal.SIGKILL)
            later = threading.Timer(1.0, daemon.start)  # the call below is already waiting
            later.start()
            try:
                started = time.monotonic()
                status = session.ensure_prefix(PrefixInput(text=PREFIX))
                waited = time.monotonic() - started
            finally:
                later.join()
            assert status.reuse.reason == "restored_from_disk" and waited >= 1.0
            assert session.last_resume is not None and session.last_resume.cause == "unavailable"

            # Nobody comes back: the call fails with `unavailable` after resume_timeout, and the
            # session is still resumable afterwards.
            daemon.stop(signal.SIGKILL)
            client.resume_timeout = 0.5
            with pytest.raises(rc.DaemonUnavailableError, match="resume_timeout"):
                session.ensure_prefix(PrefixInput(text=PREFIX))
            daemon.start()
            assert session.ensure_prefix(PrefixInput(text=PREFIX)).reuse.reason == "restored_from_disk"
            assert len(session.resumes) == 2
    finally:
        daemon.close()


# --- a decode in flight ------------------------------------------------------------------------

TOOLS = json.dumps(
    [
        {
            "type": "function",
            "function": {
                "name": "read_file",
                "parameters": {
                    "type": "object",
                    "properties": {"path": {"type": "string", "minLength": 1, "maxLength": 12}},
                    "required": ["path"],
                    "additionalProperties": False,
                },
            },
        }
    ]
)
CHAT = OpenSessionRequest(type="memory", path="agent", config=Config(prompt_format="chat"))
SLOW = {"delay_ms": "40"}  # with speculation off, 60 tokens take ~2.4 s: long enough to kill the daemon in it


def _builder(session: Any) -> rc.ContextBuilder:
    return (
        rc.ContextBuilder(identity=session.identity, tools_json=TOOLS)
        .system("You are a coding agent. Read files before you answer.\n")
        .user_turn("Why does main() crash?")
    )


def _read_file(call: rc.ToolCall) -> str:
    return f"contents of {json.loads(call.arguments)['path']}: def main(): return 1 / 0\n"


class KillInDecode:
    """A session that lets ``fault`` loose (kill the daemon, restart it) once, after the first
    chunk of its ``nth`` decode arrived: the decode is then in flight. The session itself is the
    real client session; only the moment is chosen."""

    def __init__(self, session: rc.ClientSession, nth: int, fault: Callable[[], None]) -> None:
        self.session, self.nth, self.fault = session, nth, fault
        self.decodes = 0

    def __getattr__(self, name: str) -> Any:
        return getattr(self.session, name)

    def decode(self, config: DecodeConfig) -> Any:
        self.decodes += 1
        stream = self.session.decode(config)
        if self.decodes != self.nth:
            return stream
        return _FaultAfterFirst(stream, self.fault)


class _FaultAfterFirst:
    def __init__(self, stream: rc.ClientDecodeStream, fault: Callable[[], None]) -> None:
        self.stream, self.fault, self.seen = stream, fault, 0

    def __iter__(self) -> Iterator[StreamChunk]:
        for chunk in self.stream:
            self.seen += 1
            if self.seen == 1:
                assert not chunk.final
                self.fault()
            yield chunk

    def __enter__(self) -> _FaultAfterFirst:
        return self

    def __exit__(self, *exc: object) -> None:
        self.stream.close()


# SIGTERM drains (blueprint 0020): a decode in flight finishes whole before the daemon exits
# (tests/http/test_fleet.py's drain test); a lost daemon is a SIGKILL.
@pytest.mark.parametrize("how", [signal.SIGKILL], ids=["SIGKILL"])
def test_a_decode_in_flight_fails_with_engine_restarted_and_the_next_call_resumes(
    data: Path, how: int
) -> None:
    daemon = Daemon(data)
    try:
        with rc.connect(data_dir=data) as client:
            session = client.open_session(OpenSessionRequest(type="memory", path="tiny"))
            session.ensure_prefix(PrefixInput(text=PREFIX))
            session.prefill_suffix(SuffixInput(text=SUFFIX))
            reference = _tokens(list(session.decode(DecodeConfig(max_tokens=60))))
            session.prefill_suffix(SuffixInput(text=SUFFIX))
            _wait(lambda: _snapshots(data) >= 1)
            got: list[StreamChunk] = []
            with pytest.raises(rc.EngineRestartedError) as lost:
                _decode_with_fault(
                    session,
                    DecodeConfig(max_tokens=60, extra=SLOW, speculation="off"),
                    lambda: daemon.stop(how),
                    got,
                )
            assert len(got) >= 1 and not any(c.final for c in got)  # never a partial answer as final
            assert lost.value.details["daemon"] == "lost"
            assert lost.value.details["cause"] == (
                "unavailable" if how == signal.SIGKILL else "shutting_down"
            )
            # Typed and retryable: the same class a worker crash raises.
            assert lost.value.reason == "engine_restarted" and lost.value.status == "UNAVAILABLE"
            daemon.start()
            # Running the decode again generates from prefix + suffix, restored from disk.
            assert _tokens(list(session.decode(DecodeConfig(max_tokens=60)))) == reference
            assert session.last_resume is not None and session.last_resume.prefix is not None
            assert session.last_resume.prefix.reuse.reason == "restored_from_disk"
    finally:
        daemon.close()


def test_the_tool_loop_runs_a_turn_lost_in_a_restart_once_more_and_completes(data: Path) -> None:
    daemon = Daemon(data)
    try:
        with rc.connect(data_dir=data) as client:
            first = DecodeConfig(max_tokens=200, tool_choice="read_file")
            later = DecodeConfig(max_tokens=60, tool_choice="none", extra=SLOW)
            with client.open_session(CHAT) as plain:
                if "grammar" not in plain.info.capabilities.constraints:
                    pytest.skip("the engine does not parse tool calls")
                reference = rc.run_tools(plain, _builder(plain), _read_file, first, after_first=later)
            assert [r.finish_reason for r in reference.rounds] == ["tool_calls", "length"]

            def fault() -> None:
                # The reference computed round two's prefix; wait until it is written through.
                _wait(lambda: _persisted(data, reference.rounds[1].prefix.prefix_tokens))
                daemon.restart(signal.SIGKILL)

            session = client.open_session(CHAT)
            faulty = KillInDecode(session, 2, fault)
            result = rc.run_tools(faulty, _builder(session), _read_file, first, after_first=later)
            assert faulty.decodes == 3  # round one, round two, round two again
            one, two = result.rounds
            assert (one.retry_reason, two.retry_reason) == ("", "engine_restarted")
            assert result.text == reference.text and result.finish_reason == "length"
            assert two.prefix.reuse.reason == "restored_from_disk"
            assert two.prefix.prefilled_tokens == 0  # the round's whole prefix came back
            assert len(session.resumes) == 1 and session.resumes[0].cause == "unavailable"

            # A turn lost twice is not run a third time: the error reaches the caller.
            timers: list[threading.Timer] = []

            def kill() -> None:
                daemon.stop(signal.SIGKILL)
                timers.append(threading.Timer(0.5, daemon.start))
                timers[-1].start()

            again = _Twice(session, kill)
            with pytest.raises(rc.EngineRestartedError):
                rc.run_tools(
                    again,
                    _builder(session),
                    _read_file,
                    DecodeConfig(max_tokens=60, extra=SLOW, speculation="off"),
                )
            assert again.decodes == 2
            for timer in timers:
                timer.join()
            session.close()
    finally:
        daemon.close()


class _Twice(KillInDecode):
    """Faults in every decode."""

    def __init__(self, session: rc.ClientSession, fault: Callable[[], None]) -> None:
        super().__init__(session, 0, fault)

    def decode(self, config: DecodeConfig) -> Any:
        self.decodes += 1
        return _FaultAfterFirst(self.session.decode(config), self.fault)


# --- takeovers, and resume=False ---------------------------------------------------------------


def test_a_takeover_still_ends_the_session_with_stale_fence(data: Path) -> None:
    daemon = Daemon(data)
    new: subprocess.Popen[str] | None = None
    try:
        with rc.connect(data_dir=data) as client:
            session = client.open_session(OpenSessionRequest(type="memory", path="tiny"))
            session.ensure_prefix(PrefixInput(text=PREFIX))
            assert read_lease(data).takeover_epoch == 0  # type: ignore[union-attr]
            new = start_serve(data, data / "d.sock", "--takeover")
            record = wait_serving(data, new.pid)
            assert record.takeover_epoch == record.epoch == session.epoch + 1
            with pytest.raises(rc.StaleFenceError):
                session.ensure_prefix(PrefixInput(text=PREFIX))
            with pytest.raises(rc.StaleFenceError):  # for good: it is not resumed later either
                session.prefill_suffix(SuffixInput(text=SUFFIX))
            assert session.resumes == ()
            # The client does not follow a takeover for new sessions either.
            with pytest.raises(rc.StaleFenceError):
                client.open_session(OpenSessionRequest(type="memory", path="tiny"))
    finally:
        daemon.close()
        if new is not None:
            stop(new)


def test_a_hung_owner_killed_by_a_takeover_is_not_mistaken_for_a_restart(data: Path) -> None:
    """The old owner never says stale_fence (it was SIGSTOPped, then SIGKILLed by the new one):
    the session sees its stream break, as in a restart; the owner record tells them apart."""
    daemon = Daemon(data)
    new: subprocess.Popen[str] | None = None
    try:
        with rc.connect(data_dir=data) as client:
            session = client.open_session(OpenSessionRequest(type="memory", path="tiny"))
            session.ensure_prefix(PrefixInput(text=PREFIX))
            assert daemon.proc is not None
            daemon.proc.send_signal(signal.SIGSTOP)
            new = start_serve(data, data / "d.sock", "--takeover", "--takeover-timeout", "1")
            wait_serving(data, new.pid, timeout=60)
            daemon.proc.wait(timeout=30)
            with pytest.raises(rc.StaleFenceError, match="taken over") as fenced:
                session.ensure_prefix(PrefixInput(text=PREFIX))
            assert fenced.value.details["takeover_epoch"] == str(session.epoch + 1)
            # Later restarts do not wash the takeover out: the record carries it forward.
            stop(new, signal.SIGKILL)
            new = start_serve(data, data / "d.sock")
            record = wait_serving(data, new.pid)
            assert (record.epoch, record.takeover_epoch) == (session.epoch + 2, session.epoch + 1)
            with pytest.raises(rc.StaleFenceError):
                session.ensure_prefix(PrefixInput(text=PREFIX))
    finally:
        daemon.close()
        if new is not None:
            stop(new, signal.SIGKILL)


def test_resume_false_keeps_the_old_behaviour(data: Path) -> None:
    daemon = Daemon(data)
    try:
        with rc.connect(data_dir=data, resume=False) as client:
            session = client.open_session(OpenSessionRequest(type="memory", path="tiny"))
            session.ensure_prefix(PrefixInput(text=PREFIX))
            session.prefill_suffix(SuffixInput(text=SUFFIX))
            with pytest.raises(rc.DaemonUnavailableError):  # not engine_restarted: nothing resumes
                _decode_with_fault(
                    session,
                    DecodeConfig(max_tokens=60, extra=SLOW, speculation="off"),
                    lambda: daemon.restart(signal.SIGKILL),
                    [],
                )
            with pytest.raises(rc.DaemonUnavailableError):
                session.ensure_prefix(PrefixInput(text=PREFIX))
            with pytest.raises(rc.StaleFenceError):  # fenced to the owner that is gone
                client.open_session(OpenSessionRequest(type="memory", path="tiny"))
            assert session.resumes == ()
    finally:
        daemon.close()


def test_a_session_opened_by_address_resumes_too(data: Path) -> None:
    daemon = Daemon(data)
    try:
        with rc.connect(f"unix:{data / 'd.sock'}") as client:
            session = client.open_session(OpenSessionRequest(type="memory", path="tiny"))
            session.ensure_prefix(PrefixInput(text=PREFIX))
            _wait(lambda: _snapshots(data) >= 1)
            daemon.restart(signal.SIGTERM)
            assert session.ensure_prefix(PrefixInput(text=PREFIX)).reuse.reason == "restored_from_disk"
            assert session.last_resume is not None and session.last_resume.cause == "shutting_down"
    finally:
        daemon.close()


# --- asyncio -----------------------------------------------------------------------------------


def test_aconnect_is_an_async_context_manager_and_an_awaitable(data: Path) -> None:
    daemon = Daemon(data)
    address = f"unix:{data / 'd.sock'}"

    async def scenario() -> None:
        async with rc.aconnect(address) as client:
            assert isinstance(client, rc.AsyncClient)
            assert (await client.status()).epoch == 1
        async with await rc.aconnect(address) as again:  # the older spelling keeps working
            assert (await again.status()).epoch == 1
        plain = await rc.aconnect(data_dir=data)
        try:
            assert plain.endpoint.source == "lease"
        finally:
            await plain.close()
        with pytest.raises(rc.DaemonUnavailableError):
            async with rc.aconnect(data_dir=data / "nowhere"):
                pass

    try:
        asyncio.run(scenario())
    finally:
        daemon.close()


class AsyncKillInDecode:
    """:class:`KillInDecode` for an asyncio session."""

    def __init__(self, session: rc.AsyncClientSession, nth: int, fault: Callable[[], None]) -> None:
        self.session, self.nth, self.fault = session, nth, fault
        self.decodes = 0

    def __getattr__(self, name: str) -> Any:
        return getattr(self.session, name)

    async def decode(self, config: DecodeConfig) -> Any:
        self.decodes += 1
        stream = await self.session.decode(config)
        return stream if self.decodes != self.nth else _AsyncFaultAfterFirst(stream, self.fault)


class _AsyncFaultAfterFirst:
    def __init__(self, stream: Any, fault: Callable[[], None]) -> None:
        self.stream, self.fault, self.seen = stream, fault, 0

    def __aiter__(self) -> _AsyncFaultAfterFirst:
        return self

    async def __anext__(self) -> StreamChunk:
        chunk: StreamChunk = await self.stream.__anext__()
        self.seen += 1
        if self.seen == 1:
            await asyncio.to_thread(self.fault)
        return chunk

    async def aclose(self) -> None:
        await self.stream.aclose()


def test_an_asyncio_session_resumes_and_its_tool_loop_retries(data: Path) -> None:
    daemon = Daemon(data)

    async def scenario() -> None:
        async with rc.aconnect(data_dir=data) as client:
            first = DecodeConfig(max_tokens=200, tool_choice="read_file")
            later = DecodeConfig(max_tokens=60, tool_choice="none", extra=SLOW)
            session = await client.open_session(CHAT)
            try:
                if "grammar" not in session.info.capabilities.constraints:
                    pytest.skip("the engine does not parse tool calls")
                reference = await rc.arun_tools(
                    session, _builder(session), _read_file, first, after_first=later
                )

                # Between turns: the next call resumes, restored from disk, the same output.
                known = _snapshots(data)
                await session.ensure_prefix(PrefixInput(text=PREFIX))
                await session.prefill_suffix(SuffixInput(text=SUFFIX))
                before = [c async for c in await session.decode(DecodeConfig(max_tokens=20))]
                await session.prefill_suffix(SuffixInput(text=SUFFIX))
                _wait(lambda: _snapshots(data) > known)
                await asyncio.to_thread(daemon.restart, signal.SIGKILL)
                after = [c async for c in await session.decode(DecodeConfig(max_tokens=20))]
                assert _tokens(after) == _tokens(before)
                resumed = session.last_resume
                assert resumed is not None and resumed.cause == "unavailable" and resumed.suffix is not None
                assert resumed.prefix is not None and resumed.prefix.reuse.reason == "restored_from_disk"

                # A decode in flight: engine_restarted inside the loop, which runs the turn again.
                def fault() -> None:
                    _wait(lambda: _persisted(data, reference.rounds[1].prefix.prefix_tokens))
                    daemon.restart(signal.SIGKILL)

                faulty = AsyncKillInDecode(session, 2, fault)
                result = await rc.arun_tools(faulty, _builder(session), _read_file, first, after_first=later)
                assert faulty.decodes == 3
                assert [r.retry_reason for r in result.rounds] == ["", "engine_restarted"]
                assert result.text == reference.text
                assert result.rounds[1].prefix.reuse.reason == "restored_from_disk"
                assert len(session.resumes) == 2
            finally:
                await session.close()

    try:
        asyncio.run(scenario())
    finally:
        daemon.close()
