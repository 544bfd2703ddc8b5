"""Run real ``modeld`` processes for tests (serve, status, ...), with clean-up."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

from modeld.lease import LeaseRecord, read_lease

MODELD = str(Path(sys.executable).parent / "modeld")


def modeld(
    *args: str, data_dir: Path | None = None, timeout: float = 60, env: dict[str, str] | None = None
) -> subprocess.CompletedProcess[str]:
    """Run the real command line and wait for it."""
    full = [MODELD, *(["--data-dir", str(data_dir)] if data_dir else []), *args]
    return subprocess.run(
        full, capture_output=True, text=True, timeout=timeout, env={**os.environ, **(env or {})}
    )


def start_serve(data_dir: Path, socket: Path, *extra: str, backend: str = "memory") -> subprocess.Popen[str]:
    return subprocess.Popen(
        [
            MODELD,
            "--data-dir",
            str(data_dir),
            "serve",
            "--backend",
            backend,
            "--listen",
            f"unix:{socket}",
            *extra,
        ],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=True,
    )


def wait_serving(data_dir: Path, pid: int | None = None, timeout: float = 30) -> LeaseRecord:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        record = read_lease(data_dir)
        if record is not None and record.state == "serving" and (pid is None or record.pid == pid):
            return record
        time.sleep(0.05)
    raise TimeoutError(f"no daemon became serving in {data_dir}")


def stop(proc: subprocess.Popen[str], sig: int = signal.SIGTERM, timeout: float = 15) -> tuple[int, str]:
    if proc.poll() is None:
        proc.send_signal(sig)
    try:
        _, err = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        _, err = proc.communicate()
    return proc.returncode, err


def serve_http(
    data_dir: Path, *extra: str, backend: str = "memory", http: str = "127.0.0.1:0", timeout: float = 120
) -> tuple[subprocess.Popen[str], LeaseRecord]:
    """A real ``modeld serve --http`` on a free port, its unix socket in ``data_dir``; returns
    the process and its owner record (``http_endpoint`` is the base URL)."""
    proc = start_serve(data_dir, data_dir / "s.sock", "--http", http, *extra, backend=backend)
    try:
        record = wait_serving(data_dir, timeout=timeout)
    except TimeoutError:
        _, err = stop(proc)
        raise RuntimeError(f"modeld serve --http did not start:\n{err[-3000:]}") from None
    return proc, record
