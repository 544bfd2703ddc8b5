"""What every measured system shares: the result of a turn, process helpers, concurrent waves.

A system runs in its own process (or processes: a daemon and its worker) and is driven by the
bench process as a client; TTFT is always client-observed. Each system implements ``turn`` (one
request), ``wave`` (several requests sent at once from client threads), ``restart`` (stop and
start again, keeping whatever state the system can keep across a restart), ``pids``, ``close``.
A system that the installed software cannot run raises :class:`Unsupported` from its
constructor; the report names it and why.
"""

from __future__ import annotations

import contextlib
import socket
import subprocess
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol

from bench.workloads import Turn

__all__ = [
    "Unsupported",
    "System",
    "TurnResult",
    "free_port",
    "process_tree",
    "reset_peak",
    "settle",
    "stop_process",
    "threaded_wave",
    "tree_peak_rss",
    "tree_peak_rss_parts",
]


class Unsupported(Exception):  # noqa: N818 - a reason to skip, not an error
    """The installed software cannot run this system; the message says why."""


@dataclass
class TurnResult:
    system: str
    workload: str
    turn: int
    ttft_s: float
    total_s: float
    completion_tokens: int
    decode_tps: float
    prefilled: int | None  # None: the system does not say
    prompt_tokens: int | None = None
    cached: int | None = None  # tokens the system says it reused
    outcome: str = ""
    restore_s: float | None = None  # part of ttft_s spent restoring saved state (restart)
    error: str = ""
    token_ids: list[int] = field(default_factory=list)
    recomputed: int | None = None  # the daemon's count of tokens computed again (modeld; one turn)


class System(Protocol):
    name: str
    settings: dict[str, Any]

    def turn(self, workload: str, index: int, key: str, turn: Turn, max_tokens: int) -> TurnResult: ...

    def wave(
        self, workload: str, items: list[tuple[int, str, Turn]], max_tokens: int
    ) -> list[TurnResult]: ...

    def restart(self) -> float: ...

    def pids(self) -> list[int]: ...

    def close(self) -> None: ...


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def process_tree(pid: int) -> list[int]:
    """The process and its descendants (a daemon's engine worker counts as the daemon's)."""
    import psutil

    try:
        proc = psutil.Process(pid)
        return [pid, *(c.pid for c in proc.children(recursive=True))]
    except psutil.Error:
        return []


def reset_peak(pids: list[int]) -> None:
    """Reset VmHWM so the next reading is this workload's peak (Linux)."""
    for pid in pids:
        with contextlib.suppress(OSError):
            Path(f"/proc/{pid}/clear_refs").write_text("5")


def tree_peak_rss(pids: list[int]) -> int:
    """Sum of VmHWM over the processes: an upper bound of the system's peak resident set."""
    return sum(tree_peak_rss_parts(pids).values())


def tree_peak_rss_parts(pids: list[int]) -> dict[str, int]:
    """VmHWM per process, keyed by what the process is: its program, or ``-m`` module
    (``modeld.cli``: the daemon, ``modeld.workers.child``: an engine worker), with the pid."""
    out: dict[str, int] = {}
    for pid in pids:
        with contextlib.suppress(OSError, ValueError):
            peak = 0
            for line in Path(f"/proc/{pid}/status").read_text().splitlines():
                if line.startswith("VmHWM:"):
                    peak = int(line.split()[1]) * 1024
            argv = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
            name = Path(argv[0].decode(errors="replace")).name
            if b"-m" in argv[:-1]:
                name = argv[argv.index(b"-m") + 1].decode(errors="replace")
            out[f"{name} {pid}"] = peak
    return out


def settle(pids: list[int], timeout: float = 15.0) -> None:
    """Wait until processes stop using CPU (a cache save after a reply, spinning OpenMP threads)."""
    import psutil

    procs = []
    for pid in pids:
        with contextlib.suppress(psutil.Error):
            procs.append(psutil.Process(pid))

    def cpu() -> float:
        total = 0.0
        for p in procs:
            with contextlib.suppress(psutil.Error):
                total += sum(p.cpu_times()[:2])
        return total

    deadline = time.monotonic() + timeout
    previous = cpu()
    while time.monotonic() < deadline:
        time.sleep(0.1)
        now = cpu()
        if now - previous < 0.005:  # under 5% of a core over the last 100 ms
            return
        previous = now


def stop_process(proc: subprocess.Popen[Any], timeout: float = 60.0) -> None:
    """SIGTERM, wait, SIGKILL if it will not go."""
    if proc.poll() is not None:
        return
    proc.terminate()
    try:
        proc.wait(timeout=timeout)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait(timeout=30)


def threaded_wave(
    run: Callable[[int, str, Turn], TurnResult], items: list[tuple[int, str, Turn]]
) -> list[TurnResult]:
    """Send every request at once from its own client thread (a barrier releases them together);
    each request's TTFT is measured from that common start."""
    barrier = threading.Barrier(len(items))
    results: list[TurnResult | None] = [None] * len(items)
    errors: list[BaseException] = []

    def worker(k: int) -> None:
        index, key, turn = items[k]
        try:
            barrier.wait()
            results[k] = run(index, key, turn)
        except BaseException as e:  # re-raised in the caller's thread
            errors.append(e)

    threads = [threading.Thread(target=worker, args=(k,), daemon=True) for k in range(len(items))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    if errors:
        raise errors[0]
    return [r for r in results if r is not None]
