"""The test run ends what it started, even when it is killed.

A pytest run stopped by SIGTERM (a CI job cancelled, ``timeout``, an impatient ``kill``) or SIGHUP
(its terminal closed) dies without running fixture teardown, so the ``modeld serve`` daemons its
tests started, their engine workers and the llama-servers of the benchmark systems kept running,
for hours. :func:`install` (called by ``tests/conftest.py`` when pytest loads it) handles those
signals: it ends every process descending from this one, then dies of the signal as it would
have. :func:`sweep` ends what is still running when the session finishes (teardown that never
ran: a timeout inside a fixture), and says what it ended.

How: the descendants are read from ``/proc`` (each process's parent) before anything is
signalled, so a daemon's workers are found before the daemon's end reparents them; each gets
SIGTERM (a daemon stops in order: its workers close, its lease is released), and whatever is
still there after :data:`GRACE_SECONDS` gets SIGKILL. A process is known by its pid and its start
time, so a pid reused meanwhile is never signalled. Without ``/proc`` (not Linux) it does nothing.
Nothing in the daemon knows about it: it is the launcher's own clean-up.
"""

from __future__ import annotations

import contextlib
import os
import signal
import time
from collections.abc import Callable
from pathlib import Path
from types import FrameType

__all__ = ["GRACE_SECONDS", "Proc", "alive", "descendants", "end", "install", "sweep"]

GRACE_SECONDS = 5.0
"""How long the processes have to stop after SIGTERM before SIGKILL."""

Proc = tuple[int, int]
"""A process: its pid and its start time (clock ticks after boot, ``/proc/<pid>/stat`` field 22)."""

_PROC = Path("/proc")


def _stat(pid: int) -> tuple[str, int, int] | None:
    """``pid``'s state, parent and start time, or None once it is gone."""
    try:
        raw = (_PROC / str(pid) / "stat").read_bytes()
    except OSError:
        return None
    fields = raw[raw.rindex(b")") + 2 :].split()  # after "pid (comm) ": the name may hold anything
    return fields[0].decode(), int(fields[1]), int(fields[19])


def descendants(root: int) -> list[Proc]:
    """Every live process under ``root`` (children, their children, ...), parents first."""
    if not _PROC.is_dir():
        return []
    children: dict[int, list[Proc]] = {}
    for entry in _PROC.iterdir():
        if not entry.name.isdigit():
            continue
        stat = _stat(int(entry.name))
        if stat is not None and stat[0] != "Z":
            children.setdefault(stat[1], []).append((int(entry.name), stat[2]))
    found: list[Proc] = []
    todo = [root]
    while todo:
        for proc in children.get(todo.pop(), []):
            found.append(proc)
            todo.append(proc[0])
    return found


def alive(proc: Proc) -> bool:
    """Whether ``proc`` still runs (a zombie does not; a reused pid is another process)."""
    stat = _stat(proc[0])
    return stat is not None and stat[0] != "Z" and stat[2] == proc[1]


def _signal(proc: Proc, sig: int) -> None:
    if alive(proc):
        with contextlib.suppress(ProcessLookupError):
            os.kill(proc[0], sig)


def end(procs: list[Proc], grace: float = GRACE_SECONDS) -> list[Proc]:
    """SIGTERM to ``procs``, SIGKILL to those still alive after ``grace`` seconds, and to
    anything they started meanwhile; those that had to be killed."""
    for proc in procs:
        _signal(proc, signal.SIGTERM)
    deadline = time.monotonic() + grace
    while any(alive(p) for p in procs) and time.monotonic() < deadline:
        time.sleep(0.05)
    late = [p for p in procs if alive(p)]
    late += [q for p in late for q in descendants(p[0]) if q not in late]
    for proc in late:
        _signal(proc, signal.SIGKILL)
    return late


def _describe(procs: list[Proc]) -> str:
    names = []
    for pid, _ in procs:
        names.append(f"{pid} {_command(pid)[:160]}")
    return "\n  ".join(names)


def _command(pid: int) -> str:
    """The command line of ``pid``; its name when the kernel shows no command line (a process
    between fork and exec, or being torn down, reads empty for a moment: asked again first)."""
    for _ in range(10):
        try:
            cmd = (_PROC / str(pid) / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
        except OSError:
            return "?"
        if cmd.strip():
            return cmd.strip()
        time.sleep(0.02)
    try:
        return f"[{(_PROC / str(pid) / 'comm').read_text().strip()}]"
    except OSError:
        return "?"


def install(say: Callable[[str], None], signals: tuple[int, ...] = (signal.SIGTERM, signal.SIGHUP)) -> None:
    """Handle ``signals`` by ending this process's descendants first, saying which (``say``: on
    the terminal, pytest's capture set aside), then dying of the signal. From the main thread
    only, as Python's signal handlers are."""

    def on_signal(signum: int, frame: FrameType | None) -> None:
        del frame
        procs = descendants(os.getpid())
        if procs:
            with contextlib.suppress(Exception):  # saying so must not keep them running
                name = signal.Signals(signum).name
                say(
                    f"tests: {name}: ending the {len(procs)} processes this run started:\n  {_describe(procs)}"
                )
            end(procs)
        signal.signal(signum, signal.SIG_DFL)
        os.kill(os.getpid(), signum)  # die of it, as the sender expects

    for sig in signals:
        signal.signal(sig, on_signal)


def sweep(say: Callable[[str], None]) -> list[Proc]:
    """End the processes still running under this one (teardown that never ran), saying which."""
    procs = descendants(os.getpid())
    if procs:
        say(f"tests: {len(procs)} processes were still running at the end, ended:\n  {_describe(procs)}")
        end(procs)
    return procs
