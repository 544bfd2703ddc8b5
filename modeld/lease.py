"""The owner lease: which daemon instance owns this machine's warm state.

Protocol (``blueprints/0005-owner-lease.md``). Files in the data directory:

* ``owner.lock`` -- held with an exclusive ``flock`` by the owner for its whole life. The kernel
  releases it when the process dies, so a crashed owner never blocks the next one.
* ``owner.json`` -- the record: instance id, epoch, pid, endpoint (gRPC), http_endpoint (the
  OpenAI-compatible endpoint, when served), started_at, renewed_at, state (``starting`` |
  ``serving`` | ``released``), takeover_epoch (the epoch of the latest owner that took the lease
  from a live holder, carried forward by every later owner; 0 if none ever did). Written only by the lock holder, atomically (temp file +
  rename), and only when it changes: renewal touches the file's mtime instead of rewriting and
  fsyncing an unchanged record every 2 s, and readers take ``renewed_at`` as the later of the
  recorded value and the mtime. It survives release so that epochs only ever grow.
* ``takeover.json`` -- a request from a daemon started with ``--takeover``: who asks and which
  instance it replaces.

A second ``serve`` fails to take the lock and reports the owner. With ``--takeover`` it writes
a request, and the owner, which checks every ``CHECK_INTERVAL`` seconds, fails its sessions
with ``stale_fence``, stops and releases the lock; the new daemon takes it with epoch + 1. If
the owner does not let go within the takeover timeout (hung), the new daemon sends it SIGTERM,
then SIGKILL -- only if the pid in the record is alive and is a modeld process.

The owner also watches that the lock file is still the one it locked (deleting the data
directory must not create two owners) and that ``owner.json`` still names it.
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
import signal
import socket
import time
from dataclasses import asdict, dataclass, replace
from pathlib import Path

__all__ = [
    "CHECK_INTERVAL",
    "AlreadyOwnedError",
    "Lease",
    "LeaseError",
    "LeaseRecord",
    "read_lease",
]

CHECK_INTERVAL = 0.2
RENEW_INTERVAL = 2.0
LOCK_FILE = "owner.lock"
RECORD_FILE = "owner.json"
TAKEOVER_FILE = "takeover.json"


@dataclass(frozen=True, slots=True)
class LeaseRecord:
    instance_id: str
    epoch: int
    pid: int
    endpoint: str
    started_at: float
    renewed_at: float
    state: str
    version: str = ""
    hostname: str = ""
    http_endpoint: str = ""
    takeover_epoch: int = 0
    """The epoch of the latest owner that took the lease by ``--takeover`` from a live holder
    (carried forward by every later owner; 0: never). A session opened at epoch E survived only
    restarts, never a takeover, iff ``takeover_epoch <= E``: how ``runtime_client`` tells a
    daemon that restarted (it resumes its sessions) from one that was taken over (they end with
    ``stale_fence``)."""

    @property
    def alive(self) -> bool:
        """The record says serving/starting and its process exists."""
        return self.state in ("starting", "serving") and _pid_alive(self.pid)

    def describe(self) -> str:
        age = time.time() - self.renewed_at
        return (
            f"instance {self.instance_id} (pid {self.pid}, epoch {self.epoch}) "
            f"at {self.endpoint or '(no endpoint yet)'}, renewed {age:.1f}s ago"
        )


class LeaseError(Exception):
    """The lease could not be taken or kept (a clear message for the operator)."""


class AlreadyOwnedError(LeaseError):
    def __init__(self, record: LeaseRecord | None) -> None:
        self.record = record
        who = record.describe() if record else "another process (no record yet)"
        super().__init__(
            f"modeld already owns this machine: {who}. Stop it, or start with --takeover to replace it."
        )


def _pid_alive(pid: int) -> bool:
    if pid <= 0:
        return False
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def _is_modeld_process(pid: int) -> bool:
    try:
        cmdline = Path(f"/proc/{pid}/cmdline").read_bytes()
    except OSError:
        return False
    return b"modeld" in cmdline


def _as_float(value: object) -> float:
    try:
        return float(value)  # type: ignore[arg-type]
    except (TypeError, ValueError):
        return 0.0


def _write_json(path: Path, data: dict[str, object]) -> None:
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "w") as f:
        json.dump(data, f, indent=1, sort_keys=True)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


def _read_json(path: Path) -> dict[str, object] | None:
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError):
        return None
    return data if isinstance(data, dict) else None


def read_lease(data_dir: Path) -> LeaseRecord | None:
    """The current owner record, or None if there is none (or it is unreadable)."""
    path = data_dir / RECORD_FILE
    data = _read_json(path)
    if data is None:
        return None
    try:
        touched = path.stat().st_mtime
    except OSError:
        touched = 0.0
    try:
        record = LeaseRecord(
            instance_id=str(data["instance_id"]),
            epoch=int(data["epoch"]),  # type: ignore[call-overload]
            pid=int(data["pid"]),  # type: ignore[call-overload]
            endpoint=str(data.get("endpoint", "")),
            started_at=float(data.get("started_at", 0.0)),  # type: ignore[arg-type]
            renewed_at=float(data.get("renewed_at", 0.0)),  # type: ignore[arg-type]
            state=str(data.get("state", "")),
            version=str(data.get("version", "")),
            hostname=str(data.get("hostname", "")),
            http_endpoint=str(data.get("http_endpoint", "")),
            takeover_epoch=int(data.get("takeover_epoch", 0)),  # type: ignore[call-overload]
        )
    except (KeyError, TypeError, ValueError):
        return None
    if record.state == "serving" and touched > record.renewed_at:
        record = replace(record, renewed_at=touched)
    return record


class Lease:
    """The lease held by one daemon instance."""

    def __init__(self, data_dir: Path, instance_id: str, version: str = "") -> None:
        self.data_dir = data_dir
        self.instance_id = instance_id
        self.version = version
        self.record: LeaseRecord | None = None
        self._fd: int | None = None
        self._inode: tuple[int, int] | None = None
        self._last_renew = 0.0

    @property
    def lock_path(self) -> Path:
        return self.data_dir / LOCK_FILE

    @property
    def record_path(self) -> Path:
        return self.data_dir / RECORD_FILE

    @property
    def takeover_path(self) -> Path:
        return self.data_dir / TAKEOVER_FILE

    # --- taking the lease ----------------------------------------------------------------

    def _try_lock(self) -> bool:
        fd = os.open(self.lock_path, os.O_RDWR | os.O_CREAT, 0o600)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            os.close(fd)
            return False
        st = os.fstat(fd)
        try:
            on_disk = os.stat(self.lock_path)
        except FileNotFoundError:
            on_disk = None
        if on_disk is None or (on_disk.st_dev, on_disk.st_ino) != (st.st_dev, st.st_ino):
            os.close(fd)  # the file was replaced between open and lock: try again
            return False
        self._fd = fd
        self._inode = (st.st_dev, st.st_ino)
        return True

    def acquire(self, *, takeover: bool = False, takeover_timeout: float = 10.0) -> LeaseRecord:
        """Take the lease (epoch = previous + 1) or raise :class:`AlreadyOwnedError`.

        With ``takeover``, ask the owner to hand over and wait ``takeover_timeout`` seconds; then
        SIGTERM it, and after as long again (at most 5 s) SIGKILL it.
        """
        kill_timeout = min(5.0, takeover_timeout)
        self.data_dir.mkdir(parents=True, exist_ok=True, mode=0o700)
        took_over = False
        if not self._try_lock():
            if not takeover:
                raise AlreadyOwnedError(self._wait_for_record())
            self._take_over(takeover_timeout, kill_timeout)
            took_over = True  # someone held the lock: its sessions are fenced for good
        previous = read_lease(self.data_dir)
        now = time.time()
        epoch = (previous.epoch if previous else 0) + 1
        self.record = LeaseRecord(
            instance_id=self.instance_id,
            epoch=epoch,
            pid=os.getpid(),
            endpoint="",
            started_at=now,
            renewed_at=now,
            state="starting",
            version=self.version,
            hostname=socket.gethostname(),
            takeover_epoch=epoch if took_over else (previous.takeover_epoch if previous else 0),
        )
        self._write()
        request = _read_json(self.takeover_path)
        if request is not None and request.get("by") == self.instance_id:
            with contextlib.suppress(FileNotFoundError):
                self.takeover_path.unlink()
        return self.record

    def _wait_for_record(self) -> LeaseRecord | None:
        """The owner may have taken the lock a moment ago: give it a second to write its record."""
        deadline = time.monotonic() + 2.0
        record = read_lease(self.data_dir)
        while time.monotonic() < deadline:
            if record is not None and record.alive:
                return record
            time.sleep(0.05)
            record = read_lease(self.data_dir)
        return record

    def _take_over(self, timeout: float, kill_timeout: float) -> None:
        deadline = time.monotonic() + timeout
        signalled: int | None = None
        while True:
            target = read_lease(self.data_dir)
            _write_json(
                self.takeover_path,
                {
                    "by": self.instance_id,
                    "pid": os.getpid(),
                    "target": target.instance_id if target else "",
                    "requested_at": time.time(),
                },
            )
            if self._try_lock():
                return
            time.sleep(0.05)
            if time.monotonic() < deadline or target is None:
                continue
            if not (target.alive and _is_modeld_process(target.pid)):
                continue  # someone holds the lock but the record is not theirs: keep asking
            sig = signal.SIGTERM if signalled is None else signal.SIGKILL
            if signalled == signal.SIGKILL:
                raise LeaseError(f"could not take over from {target.describe()}: it ignored SIGKILL")
            with contextlib.suppress(ProcessLookupError):
                os.kill(target.pid, sig)
            signalled = sig
            deadline = time.monotonic() + kill_timeout

    # --- keeping it -----------------------------------------------------------------------

    def _write(self) -> None:
        assert self.record is not None
        _write_json(self.record_path, asdict(self.record))

    def publish(self, endpoint: str, http_endpoint: str = "") -> None:
        """Record the endpoints clients should use; the lease is now serving."""
        assert self.record is not None
        self.record = replace(
            self.record,
            endpoint=endpoint,
            http_endpoint=http_endpoint,
            state="serving",
            renewed_at=time.time(),
        )
        self._write()
        self._last_renew = time.monotonic()

    def _renew(self) -> None:
        """Show the owner is alive: touch the record (no rewrite, no fsync of unchanged data)."""
        try:
            os.utime(self.record_path)
        except OSError:
            assert self.record is not None
            self.record = replace(self.record, renewed_at=time.time())
            self._write()

    def check(self) -> str | None:
        """Renew when due; return why ownership is lost, or None while it is held."""
        if self._fd is None or self.record is None:
            return "the lease is not held"
        request = _read_json(self.takeover_path)
        if (
            request is not None
            and request.get("by") != self.instance_id
            and request.get("target") in (self.instance_id, "")
            and _as_float(request.get("requested_at")) >= self.record.started_at
        ):
            return f"instance {request.get('by')} (pid {request.get('pid')}) took over"
        try:
            st = os.stat(self.lock_path)
        except FileNotFoundError:
            return "the lock file was removed"
        if (st.st_dev, st.st_ino) != self._inode:
            return "the lock file was replaced"
        record = read_lease(self.data_dir)
        if record is None or record.instance_id != self.instance_id:
            return "the owner record no longer names this instance"
        if time.monotonic() - self._last_renew >= RENEW_INTERVAL:
            self._renew()
            self._last_renew = time.monotonic()
        return None

    def release(self, *, handed_over: bool = False) -> None:
        """Mark the record released (unless another instance took over) and unlock."""
        if self._fd is None:
            return
        if self.record is not None and not handed_over:
            current = read_lease(self.data_dir)
            if current is not None and current.instance_id == self.instance_id:
                self.record = replace(
                    self.record, state="released", endpoint="", http_endpoint="", renewed_at=time.time()
                )
                with contextlib.suppress(OSError):
                    self._write()
        fcntl.flock(self._fd, fcntl.LOCK_UN)
        os.close(self._fd)
        self._fd = None
