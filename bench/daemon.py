"""A ``modeld serve`` on a fresh temporary data directory, for the benchmarks that need their own
daemon (``bench.constraints``, ``bench.tool_loop``, the overhead rows): the real daemon, reached only through
``runtime_client``. A fresh data directory means no warm context, RAM or disk tier from before.
"""

from __future__ import annotations

import contextlib
import shutil
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

import runtime_client as rc
from bench.systems.base import stop_process
from modeld.lease import LeaseRecord, read_lease

__all__ = ["serve", "serve_llama"]


@contextlib.contextmanager
def serve(backend: str, *flags: str) -> Iterator[tuple[rc.Client, LeaseRecord]]:
    """``modeld serve --backend BACKEND FLAGS`` on a fresh data directory: its client and lease
    record (the HTTP endpoint is there); the daemon is stopped and its directory removed after."""
    tmp = Path(tempfile.mkdtemp(prefix="mdd"))
    log = (tmp / "daemon.log").open("w")
    args = [sys.executable, "-m", "modeld.cli", "--data-dir", str(tmp), "serve", "--backend", backend]
    proc = subprocess.Popen(
        [*args, "--listen", f"unix:{tmp}/s.sock", *flags], stdout=log, stderr=subprocess.STDOUT
    )
    try:
        deadline = time.monotonic() + 120
        while (record := read_lease(tmp)) is None or record.state != "serving":
            if proc.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"modeld did not start: {(tmp / 'daemon.log').read_text()[-2000:]}")
            time.sleep(0.05)
        with rc.connect(data_dir=tmp) as client:
            yield client, record
    finally:
        stop_process(proc)
        log.close()
        shutil.rmtree(tmp, ignore_errors=True)


@contextlib.contextmanager
def serve_llama() -> Iterator[rc.Client]:
    """A started llama daemon's client (see :func:`serve`)."""
    with serve("llama") as (client, _):
        yield client
