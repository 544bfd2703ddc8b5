"""The owner lease: one owner per data directory, epochs that only grow, takeover that fails
the old daemon's sessions with stale_fence, and a clean release on SIGTERM. The process tests
run the real ``modeld serve``."""

from __future__ import annotations

import os
import signal
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from daemon_proc import start_serve, stop, wait_serving

import runtime_client as rc
from modeld.contract import PrefixInput
from modeld.lease import AlreadyOwnedError, Lease, read_lease


@pytest.fixture
def tmp() -> Iterator[Path]:
    path = Path(tempfile.mkdtemp(prefix="mdl"))  # short, for unix sockets
    yield path
    for child in sorted(path.rglob("*"), reverse=True):
        child.unlink() if not child.is_dir() else child.rmdir()
    path.rmdir()


def test_second_lease_in_the_same_directory_is_refused(tmp: Path) -> None:
    first = Lease(tmp, "one")
    record = first.acquire()
    assert (record.epoch, record.state) == (1, "starting")
    first.publish("unix:/x.sock")
    with pytest.raises(AlreadyOwnedError) as err:
        Lease(tmp, "two").acquire()
    assert err.value.record is not None
    assert err.value.record.instance_id == "one"
    assert "--takeover" in str(err.value)
    first.release()
    assert read_lease(tmp).state == "released"  # type: ignore[union-attr]
    second = Lease(tmp, "two").acquire()
    assert second.epoch == 2


def test_owner_notices_a_replaced_lock_file_and_a_takeover_request(tmp: Path) -> None:
    lease = Lease(tmp, "one")
    lease.acquire()
    lease.publish("unix:/x.sock")
    assert lease.check() is None
    (tmp / "owner.lock").unlink()
    assert lease.check() == "the lock file was removed"
    lease.release()

    lease = Lease(tmp, "two")
    lease.acquire()
    assert lease.check() is None
    (tmp / "takeover.json").write_text(
        f'{{"by": "three", "pid": 1, "target": "two", "requested_at": {time.time() + 1}}}'
    )
    assert "three" in (lease.check() or "")
    lease.release(handed_over=True)


def test_sixteen_concurrent_serves_leave_exactly_one_owner(tmp: Path) -> None:
    procs = [start_serve(tmp, tmp / "s.sock") for _ in range(16)]
    try:
        record = wait_serving(tmp)
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline and sum(p.poll() is None for p in procs) > 1:
            time.sleep(0.1)
        running = [p for p in procs if p.poll() is None]
        assert len(running) == 1
        assert running[0].pid == record.pid
        for p in procs:
            if p is not running[0]:
                assert p.returncode == 3
                err = p.stderr.read() if p.stderr else ""
                assert "already owns this machine" in err
                assert "Traceback" not in err
    finally:
        for p in procs:
            stop(p)


def test_takeover_fails_old_sessions_with_stale_fence(tmp: Path) -> None:
    old = start_serve(tmp, tmp / "s.sock")
    new = None
    try:
        first = wait_serving(tmp, old.pid)
        client = rc.connect(data_dir=tmp)
        session = client.open_session(rc.OpenSessionRequest(type="memory", path="tiny"))
        session.ensure_prefix(PrefixInput(text="warm prefix\n"))
        assert client.endpoint.instance_id == first.instance_id

        new = start_serve(tmp, tmp / "s.sock", "--takeover")
        second = wait_serving(tmp, new.pid)
        assert second.epoch == first.epoch + 1
        assert second.instance_id != first.instance_id
        with pytest.raises(rc.StaleFenceError):
            session.ensure_prefix(PrefixInput(text="warm prefix\n"))
        code, err = stop(old, sig=0, timeout=20)  # it exits by itself
        assert code == 0
        assert "took over" in err
        client.close()

        again = rc.connect(data_dir=tmp)
        assert again.status().epoch == second.epoch
        # A client that still believes in the old owner is fenced at open.
        stale = rc.Client(rc.Endpoint(second.endpoint, instance_id=first.instance_id))
        with pytest.raises(rc.StaleFenceError):
            stale.open_session(rc.OpenSessionRequest(type="memory", path="tiny"))
        stale.close()
        again.close()
    finally:
        stop(old)
        if new is not None:
            stop(new)


def test_takeover_of_a_hung_owner_signals_it(tmp: Path) -> None:
    old = start_serve(tmp, tmp / "s.sock")
    new = None
    try:
        first = wait_serving(tmp, old.pid)
        os.kill(old.pid, signal.SIGSTOP)  # hung: it will never look at the takeover request
        new = start_serve(tmp, tmp / "s.sock", "--takeover", "--takeover-timeout", "1")
        second = wait_serving(tmp, new.pid, timeout=30)
        assert second.epoch == first.epoch + 1
        old.wait(timeout=10)
        assert old.returncode == -signal.SIGKILL
    finally:
        stop(old, sig=signal.SIGKILL)
        if new is not None:
            stop(new)


def test_sigterm_releases_the_lease_and_removes_the_socket(tmp: Path) -> None:
    proc = start_serve(tmp, tmp / "s.sock")
    record = wait_serving(tmp, proc.pid)
    client = rc.connect(data_dir=tmp)
    session = client.open_session(rc.OpenSessionRequest(type="memory", path="tiny"))
    session.ensure_prefix(PrefixInput(text="x\n"))
    code, err = stop(proc)
    assert code == 0
    assert "received SIGTERM" in err
    assert not (tmp / "s.sock").exists()
    after = read_lease(tmp)
    assert after is not None
    assert (after.state, after.epoch, after.endpoint) == ("released", record.epoch, "")
    with pytest.raises(rc.ModeldError) as got:
        session.ensure_prefix(PrefixInput(text="x\n"))
    assert got.value.reason in ("shutting_down", "unavailable", "session_closed")
    client.close()
    with pytest.raises(rc.DaemonUnavailableError):
        rc.connect(data_dir=tmp)


def test_renewal_touches_the_record_instead_of_rewriting_it(tmp: Path) -> None:
    """Renewing every 2 s used to rewrite and fsync an unchanged record (~42,000 writes a day);
    now it only moves the file's mtime, and readers see the renewal all the same."""
    from modeld.lease import RENEW_INTERVAL

    lease = Lease(tmp, "one")
    lease.acquire()
    lease.publish("unix:/x.sock", http_endpoint="http://127.0.0.1:8080")
    path = tmp / "owner.json"
    before_bytes, before_inode = path.read_bytes(), path.stat().st_ino
    published = read_lease(tmp)
    assert published is not None and published.http_endpoint == "http://127.0.0.1:8080"
    time.sleep(0.05)
    lease._last_renew -= RENEW_INTERVAL  # the renewal is due
    assert lease.check() is None
    assert (path.read_bytes(), path.stat().st_ino) == (before_bytes, before_inode)  # not rewritten
    renewed = read_lease(tmp)
    assert renewed is not None and renewed.renewed_at > published.renewed_at
    lease.release()
    released = read_lease(tmp)
    assert released is not None and (released.state, released.http_endpoint) == ("released", "")
