"""A test run killed by SIGTERM ends what it started (``tests/helpers/reaper.py``, installed by
``tests/conftest.py``): a real pytest, with the suite's conftest, runs a test that starts a real
``modeld serve`` whose model runs in a worker process, and a plain child; it is killed while the
test sleeps, before any teardown; nothing it started is left. A run that ends with something of
its own still running (a teardown that never ran) ends it too, and says so."""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import textwrap
import time
from pathlib import Path

import pytest
from reaper import Proc, alive, descendants

TESTS = Path(__file__).resolve().parent.parent

VICTIM = textwrap.dedent(
    """
    import json
    import os
    import subprocess
    import time
    from pathlib import Path

    import runtime_client as rc
    from daemon_proc import serve_http
    from modeld.contract import OpenSessionRequest, PrefixInput


    def test_started_things_and_sleeps() -> None:
        data = Path(os.environ["VICTIM_DATA"])
        proc, _ = serve_http(data, "--isolation", "process")
        with rc.connect(data_dir=data) as client, client.open_session(
            OpenSessionRequest(type="memory", path="notes")
        ) as session:
            session.ensure_prefix(PrefixInput(text="A prefix the worker holds. " * 8))
        sleeper = subprocess.Popen(["sleep", "600"])
        (data / "started.json").write_text(json.dumps({"daemon": proc.pid, "sleeper": sleeper.pid}))
        time.sleep(600)  # killed here: no teardown runs
    """
)


LEAKER = textwrap.dedent(
    """
    import os
    import subprocess
    from pathlib import Path


    def test_leaves_a_child_running() -> None:
        sleeper = subprocess.Popen(["sleep", "600"], start_new_session=True)
        (Path(os.environ["VICTIM_DATA"]) / "sleeper").write_text(str(sleeper.pid))
    """
)


def _pytest(work: Path, test: str, source: str) -> subprocess.Popen[str]:
    """A real pytest with the suite's conftest (and not the repository's settings) on ``source``."""
    (work / test).write_text(source)
    env = {
        **os.environ,
        "VICTIM_DATA": str(work / "d"),
        "PYTHONPATH": os.pathsep.join([str(TESTS), os.environ.get("PYTHONPATH", "")]),
    }
    plugins = ["-p", "conftest", "-p", "no:cacheprovider"]  # the suite's conftest, nothing written
    alone = ["-c", os.devnull, "--rootdir", str(work)]
    return subprocess.Popen(
        [sys.executable, "-m", "pytest", "-q", *plugins, *alone, str(work / test)],
        cwd=work,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=True,
    )


def _wait_for(path: Path, proc: subprocess.Popen[str], timeout: float) -> dict[str, int]:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if path.exists():
            return dict(json.loads(path.read_text()))
        if proc.poll() is not None:
            out, err = proc.communicate()
            raise AssertionError(f"the run ended before it started anything:\n{out[-3000:]}\n{err[-3000:]}")
        time.sleep(0.1)
    raise AssertionError("the run started nothing in time")


def _gone(procs: list[Proc], timeout: float) -> list[Proc]:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        left = [p for p in procs if alive(p)]
        if not left:
            return []
        time.sleep(0.1)
    return [p for p in procs if alive(p)]


@pytest.mark.skipif(not Path("/proc").is_dir(), reason="the reaper reads /proc")
def test_a_run_killed_by_sigterm_ends_the_daemons_workers_and_children_it_started() -> None:
    work = Path(tempfile.mkdtemp(prefix="mdrp"))  # short: the daemon's unix socket lives in it
    try:
        data = work / "d"
        data.mkdir()
        run = _pytest(work, "test_victim.py", VICTIM)
        try:
            started = _wait_for(data / "started.json", run, timeout=120)
            procs = descendants(run.pid)
            pids = {pid for pid, _ in procs}
            assert {started["daemon"], started["sleeper"]} <= pids
            workers = [p for p in procs if f"--parent {started['daemon']}" in _cmdline(p[0])]
            assert workers, "the daemon's model runs in a worker process"
            run.send_signal(signal.SIGTERM)
            _, err = run.communicate(timeout=60)
        finally:
            if run.poll() is None:
                os.killpg(run.pid, signal.SIGKILL)
                run.communicate()
        assert run.returncode == -signal.SIGTERM  # it died of the signal, as its sender expects
        assert "SIGTERM: ending the" in err
        assert _gone(procs, timeout=10) == []
    finally:
        shutil.rmtree(work, ignore_errors=True)


def _cmdline(pid: int) -> str:
    try:
        return (Path("/proc") / str(pid) / "cmdline").read_bytes().replace(b"\0", b" ").decode()
    except OSError:
        return ""


@pytest.mark.skipif(not Path("/proc").is_dir(), reason="the reaper reads /proc")
def test_what_a_finished_run_left_running_is_ended_and_named() -> None:
    work = Path(tempfile.mkdtemp(prefix="mdrp"))
    try:
        (work / "d").mkdir()
        run = _pytest(work, "test_leaker.py", LEAKER)
        out, err = run.communicate(timeout=120)
        assert run.returncode == 0, out + err
        pid = int((work / "d" / "sleeper").read_text())
        assert "1 processes were still running at the end, ended" in out and f"{pid} sleep 600" in out
        assert not Path(f"/proc/{pid}").exists() or _cmdline(pid) == ""  # gone (or a zombie of init)
    finally:
        shutil.rmtree(work, ignore_errors=True)
