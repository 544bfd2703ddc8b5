"""``WorkerHost``: a loaded runtime in a child process, spoken to over a socket pair.

The child is ``python -m modeld.workers.child`` started with ``subprocess`` in a new session
(its own process group, so the whole group can be signalled and no terminal signal reaches
it). A reader thread turns frames into replies; EOF on the socket means the child is gone, and
is noticed at once (no polling): the exit status is collected and every call in flight fails
with :class:`~modeld.errors.EngineRestartedError` naming the signal or exit code, or with the
reason the daemon killed it (:class:`~modeld.errors.StallTimeoutError`). A second thread keeps
the child's stderr (its log, llama.cpp's lines included) in a bounded ring buffer.
"""

from __future__ import annotations

import collections
import contextlib
import logging
import os
import queue
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from concurrent.futures import Future
from pathlib import Path

from modeld.errors import EngineRestartedError, ModeldError
from modeld.workers.child import read_frame
from modeld.workers.host import Host
from modeld.workers.protocol import Close, Message, ProtocolError, Result, encode_frame

__all__ = ["LOG_LINES", "WorkerHost", "describe_exit"]

log = logging.getLogger("modeld.worker")

LOG_LINES = 200
"""Lines of each worker's log kept for ``modeld status --debug``."""

_LINE_BYTES = 2000

_DEATH_GRACE = 1.0
"""Seconds a worker whose link broke is given to be seen dead (then its exit status names the
cause) before the break is blamed on the link and the worker killed."""


class _Spawner:
    """Starts child processes from one thread that lives as long as the daemon.

    The kernel sends ``PR_SET_PDEATHSIG`` when the *thread* that created the child exits, not
    the process: a worker started from a short-lived thread (a restart, a request) would be
    killed with it. So every worker is started here."""

    def __init__(self) -> None:
        self._jobs: queue.SimpleQueue[
            tuple[Callable[[], subprocess.Popen[bytes]], Future[subprocess.Popen[bytes]]]
        ]
        self._jobs = queue.SimpleQueue()
        self._lock = threading.Lock()
        self._thread: threading.Thread | None = None

    def popen(self, start: Callable[[], subprocess.Popen[bytes]]) -> subprocess.Popen[bytes]:
        with self._lock:
            if self._thread is None:
                self._thread = threading.Thread(target=self._run, name="worker-spawner", daemon=True)
                self._thread.start()
        done: Future[subprocess.Popen[bytes]] = Future()
        self._jobs.put((start, done))
        return done.result()

    def _run(self) -> None:
        while True:
            start, done = self._jobs.get()
            try:
                done.set_result(start())
            except BaseException as exc:
                done.set_exception(exc)


_spawner = _Spawner()


def describe_exit(code: int | None) -> tuple[str, dict[str, str | int]]:
    """A person's words and error details for a child's exit status."""
    if code is None:
        return "is gone (exit status unknown)", {}
    if code < 0:
        try:
            name = signal.Signals(-code).name
        except ValueError:
            name = f"signal {-code}"
        return f"was killed by {name}", {"signal": name}
    return f"exited with code {code}", {"exit_code": code}


class WorkerHost(Host):
    """One engine worker process."""

    def __init__(
        self,
        name: str,
        *,
        log_level: str = "INFO",
        on_exit: Callable[[WorkerHost], None] | None = None,
        explain_exit: Callable[[], str | None] | None = None,
    ) -> None:
        super().__init__()
        self.name = name
        self._on_exit = on_exit
        self._explain_exit = explain_exit
        self.log_lines: collections.deque[str] = collections.deque(maxlen=LOG_LINES)
        self.kill_reason: ModeldError | None = None
        self.stopping = False  # the daemon is stopping it on purpose: its exit is no failure
        self._send_lock = threading.Lock()
        self.exit_code: int | None = None
        ours, theirs = socket.socketpair()
        self._sock = ours
        env = dict(os.environ)
        root = str(Path(__file__).resolve().parents[2])
        env["PYTHONPATH"] = root + (os.pathsep + env["PYTHONPATH"] if env.get("PYTHONPATH") else "")

        try:
            self.proc = _spawner.popen(
                lambda: subprocess.Popen(
                    [
                        sys.executable,
                        "-m",
                        "modeld.workers.child",
                        "--fd",
                        str(theirs.fileno()),
                        "--parent",
                        str(os.getpid()),
                        "--log-level",
                        log_level,
                    ],
                    pass_fds=(theirs.fileno(),),
                    stdin=subprocess.DEVNULL,
                    stdout=subprocess.DEVNULL,
                    stderr=subprocess.PIPE,
                    start_new_session=True,
                    env=env,
                )
            )
        finally:
            theirs.close()
        self.pid = self.proc.pid
        self._reader = threading.Thread(target=self._read, name=f"worker-{name}", daemon=True)
        self._reader.start()
        self._log_reader = threading.Thread(target=self._read_log, name=f"worker-log-{name}", daemon=True)
        self._log_reader.start()

    # --- transport ----------------------------------------------------------------------------

    def _transmit(self, op: int, message: Message) -> None:
        parts = encode_frame(op, message)
        with self._send_lock:
            for part in parts:
                self._sock.sendall(part)

    def _read(self) -> None:
        try:
            while True:
                frame = read_frame(self._sock)
                if frame is None:
                    break
                self.dispatch(*frame)
        except (OSError, ProtocolError) as exc:
            # A worker that dies with bytes unread in its socket resets the link (ECONNRESET),
            # or leaves a frame cut short: that is its death, named by its exit status below.
            # Only a worker still alive after a broken frame broke the protocol (blueprint 0017).
            try:
                self.proc.wait(timeout=_DEATH_GRACE)
            except subprocess.TimeoutExpired:
                log.error("worker %s: the link broke: %s", self.name, exc)
                self.kill_reason = self.kill_reason or EngineRestartedError(
                    f"the engine worker for {self.name} sent a broken frame ({exc})"
                )
                self._kill_group(signal.SIGKILL)
            else:
                log.debug("worker %s: the link ended as the worker died: %s", self.name, exc)
        self._exited()

    def _read_log(self) -> None:
        stderr = self.proc.stderr
        assert stderr is not None
        with stderr:
            for raw in stderr:
                line = raw[:_LINE_BYTES].decode("utf-8", errors="replace").rstrip()
                line = line.encode("unicode_escape", errors="backslashreplace").decode("ascii")
                if line:
                    self.log_lines.append(line)
                    log.debug("worker %s: %s", self.name, line)

    def _exited(self) -> None:
        try:
            self.exit_code = self.proc.wait(timeout=10)
        except subprocess.TimeoutExpired:  # EOF but alive: the socket was closed under it
            self._kill_group(signal.SIGKILL)
            self.exit_code = self.proc.wait()
        self._kill_group(signal.SIGKILL)  # anything the worker started dies with it
        with contextlib.suppress(OSError):
            self._sock.close()
        error = self.kill_reason
        if error is None:
            words, details = describe_exit(self.exit_code)
            why = self._explain_exit() if self._explain_exit is not None else None
            message = f"the engine worker for {self.name} {words}"
            if why:
                message += f"; {why}"
                details["why"] = why
            tail = next((line for line in reversed(self.log_lines) if line), "")
            if tail and self.exit_code != 0:
                message += f" (last log line: {tail[:300]})"
            error = EngineRestartedError(message + "; it is being restarted, nothing was replayed", **details)
        if self.stopping and self.kill_reason is None:
            log.debug("worker %s stopped (%s)", self.name, describe_exit(self.exit_code)[0])
        elif self.exit_code not in (0, None) or self.kill_reason is not None:
            log.error("%s", error.message)
        self.fail_all(error)
        if self._on_exit is not None:
            self._on_exit(self)

    # --- control ----------------------------------------------------------------------------------

    def _kill_group(self, sig: signal.Signals) -> None:
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(self.proc.pid, sig)

    def kill(self, reason: ModeldError) -> None:
        """Kill the worker's process group now; calls in flight fail with ``reason``."""
        if self.kill_reason is None:
            self.kill_reason = reason
        self._kill_group(signal.SIGKILL)

    def terminate(self, grace: float) -> None:
        """SIGTERM the group, then SIGKILL it after ``grace`` seconds; wait for the exit."""
        self.stopping = True
        self._kill_group(signal.SIGTERM)
        try:
            self.proc.wait(timeout=grace)
        except subprocess.TimeoutExpired:
            self._kill_group(signal.SIGKILL)
            self.proc.wait()
        self._reader.join(timeout=10)
        self._log_reader.join(timeout=10)

    def close(self, grace: float = 5.0) -> None:
        """Ask the worker to free its model and exit; terminate it if it does not."""
        self.stopping = True
        if self.proc.poll() is None and self.death is None:
            call = self.call(Close())
            done = threading.Event()

            def wait() -> None:
                with contextlib.suppress(ModeldError):
                    call.result(Result)
                done.set()

            threading.Thread(target=wait, daemon=True).start()
            if done.wait(grace):
                with contextlib.suppress(subprocess.TimeoutExpired):
                    self.proc.wait(timeout=grace)  # it exits by itself after answering
        with contextlib.suppress(OSError):
            self._sock.shutdown(socket.SHUT_RDWR)
        if self.proc.poll() is None:
            self.terminate(grace)
        self._reader.join(timeout=10)
        self._log_reader.join(timeout=10)

    @property
    def running(self) -> bool:
        return self.proc.poll() is None

    def cpu_seconds(self) -> float:
        """User + system CPU time of the worker (all its threads), from /proc."""
        try:
            fields = Path(f"/proc/{self.proc.pid}/stat").read_text().rsplit(")", 1)[1].split()
        except (OSError, IndexError):
            return 0.0
        ticks = os.sysconf("SC_CLK_TCK")
        return (int(fields[11]) + int(fields[12])) / ticks

    def rss_bytes(self) -> int:
        try:
            pages = int(Path(f"/proc/{self.proc.pid}/statm").read_text().split()[1])
        except (OSError, IndexError, ValueError):
            return 0
        return pages * os.sysconf("SC_PAGE_SIZE")

    def uptime(self) -> float:
        return time.time() - self.started_at
