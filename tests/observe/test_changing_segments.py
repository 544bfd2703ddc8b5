"""explain-context names a stable segment that changes on every turn (a timestamp in the system
prompt) as the likely cause of repeated misses: in process, over the wire, and in the CLI."""

from __future__ import annotations

import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest
from daemon_proc import modeld, start_serve, stop, wait_serving

import runtime_client as rc
from modeld.contract import ChangingSegment, OpenSessionRequest, Session
from modeld.engine import Engine


def turn(session: Session, now: str, repo_map: str = "a.py\nb.py\n") -> None:
    ctx = (
        rc.ContextBuilder(identity=session.identity)
        .system(f"You are a coding agent. The time is {now}.\n")
        .repo_map(repo_map)
        .user_turn("Fix the test.\n")
        .build()
    )
    session.ensure_prefix(ctx.prefix_input())


def test_a_timestamp_in_the_system_prompt_is_named_after_three_changes() -> None:
    engine = Engine(backends=("memory",))
    try:
        with engine.open_session(OpenSessionRequest(type="memory", path="agent")) as s:
            for minute in range(3):  # two changes so far: not yet a pattern
                turn(s, f"09:0{minute}")
            assert s.explain_context().changing_segments == ()
            turn(s, "09:03")  # the third change in a row
            assert s.explain_context().changing_segments == (ChangingSegment("system", 0, 0, 3),)
            turn(s, "09:04", repo_map="a.py\nc.py\n")  # a repo map edit is one change, not a pattern
            assert s.explain_context().changing_segments == (ChangingSegment("system", 0, 0, 4),)
            turn(s, "09:04", repo_map="a.py\nc.py\n")  # the same prefix again: nothing changes
            assert s.explain_context().changing_segments == ()
    finally:
        engine.shutdown()


@pytest.fixture
def daemon() -> Iterator[Path]:
    data = Path(tempfile.mkdtemp(prefix="mdg"))
    proc = start_serve(data, data / "s.sock")
    try:
        wait_serving(data, proc.pid)
        yield data
    finally:
        stop(proc)


@pytest.mark.wire
def test_the_cli_names_the_changing_segment(daemon: Path) -> None:
    with rc.connect(data_dir=daemon) as client:
        session = client.open_session(rc.OpenSessionRequest(type="memory", path="tiny"))
        for minute in range(4):
            turn(session, f"10:1{minute}")
        report = session.explain_context()  # over the wire
        assert report.changing_segments == (ChangingSegment("system", 0, 0, 3),)
        out = modeld("explain-context", session.session_id, data_dir=daemon)
        assert out.returncode == 0, out.stderr
        assert (
            "likely cause of repeated misses: stable segment 'system' #0 (segment 0) changed on each of "
            "the last 3 prefixes" in out.stdout
        )
        session.close()
