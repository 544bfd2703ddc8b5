"""A fleet on one machine: several workers (``modeld serve --http`` daemons, or llama-servers)
behind SGLang's model gateway, ``smg``, all on loopback (blueprints/0020-fleet.md).

The processes the fleet test (``tests/test_fleet.py``) and the fleet benchmark
(``bench/fleet_bench.py``) start and stop: ``smg`` from ``scripts/install_smg.sh`` (pinned,
cached; :class:`SmgUnavailable` when the package index is unreachable), a modeld daemon on a
fresh data directory, a llama-server, and the gateway in front of them with sticky routing keys
(``--policy manual``, ``X-SMG-Routing-Key``) and a fast health check.
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx

from bench.systems.base import free_port
from modeld.lease import read_lease

__all__ = [
    "ROUTING_HEADER",
    "Gateway",
    "Reply",
    "SmgUnavailable",
    "Worker",
    "install_smg",
    "start_llama_server",
    "start_modeld",
]

REPO = Path(__file__).resolve().parent.parent
INSTALL_SCRIPT = REPO / "scripts" / "install_smg.sh"
REGISTRY_UNREACHABLE = 3  # install_smg.sh's exit code when pip cannot reach the package index
ROUTING_HEADER = "X-SMG-Routing-Key"
HEALTH_INTERVAL = 1  # seconds between the gateway's health checks of a worker
WORKER_HEADER = "x-smg-routed-worker-id"  # the worker that answered, as smg reports it


class SmgUnavailable(Exception):  # noqa: N818 - a reason to skip, not an error
    """smg could not be installed because the package index is unreachable (the message says why)."""


def install_smg() -> str:
    """The path of the pinned ``smg`` launcher (installed once, then cached)."""
    proc = subprocess.run([str(INSTALL_SCRIPT)], capture_output=True, text=True, timeout=900)
    if proc.returncode == REGISTRY_UNREACHABLE:
        lines = proc.stderr.strip().splitlines()
        raise SmgUnavailable(lines[-1] if lines else "install_smg.sh: the package index is unreachable")
    if proc.returncode != 0:
        raise RuntimeError(f"install_smg.sh failed ({proc.returncode}):\n{proc.stderr[-3000:]}")
    return proc.stdout.strip().splitlines()[-1]


@dataclass
class Worker:
    """One worker process: its base URL, and its data directory when it is a modeld daemon."""

    name: str
    url: str
    proc: subprocess.Popen[Any]
    log: Path
    data_dir: Path | None = None

    def kill(self) -> None:
        """SIGKILL, as a box that dies (a modeld engine worker follows its daemon)."""
        with contextlib.suppress(ProcessLookupError):
            os.killpg(self.proc.pid, signal.SIGKILL)
        self.proc.wait(timeout=30)

    def stop(self, timeout: float = 60.0) -> None:
        if self.proc.poll() is not None:
            return
        self.proc.terminate()
        try:
            self.proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            self.kill()

    def log_tail(self, n: int = 3000) -> str:
        with contextlib.suppress(OSError):
            return self.log.read_text(errors="replace")[-n:]
        return ""

    def metric(self, name: str, labels: str = "") -> float | None:
        """A sample of the daemon's ``/metrics`` (``labels`` as written there, e.g.
        ``event="written"``), or None when absent."""
        text = httpx.get(f"{self.url}/metrics", timeout=10).text
        want = f"{name}{{{labels}}}" if labels else name
        for line in text.splitlines():
            if line.startswith(want + " "):
                return float(line.rsplit(" ", 1)[1])
        return None


def start_modeld(name: str, data_dir: Path, *, backend: str, flags: Sequence[str] = ()) -> Worker:
    """``modeld serve --http 127.0.0.1:0`` on ``data_dir`` (its gRPC socket there too)."""
    data_dir.mkdir(parents=True, exist_ok=True)
    log = data_dir / "daemon.log"
    args = [sys.executable, "-m", "modeld.cli", "--data-dir", str(data_dir), "serve", "--backend", backend]
    with log.open("w") as out:
        proc = subprocess.Popen(
            [*args, "--listen", f"unix:{data_dir}/s.sock", "--http", "127.0.0.1:0", *flags],
            stdout=out,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
    deadline = time.monotonic() + 180
    while (record := read_lease(data_dir)) is None or record.state != "serving" or record.pid != proc.pid:
        if proc.poll() is not None or time.monotonic() > deadline:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGKILL)
            raise RuntimeError(f"modeld {name} did not start:\n{log.read_text()[-3000:]}")
        time.sleep(0.05)
    return Worker(name, record.http_endpoint, proc, log, data_dir)


def start_llama_server(name: str, binary: str, model: str, workdir: Path, flags: Sequence[str]) -> Worker:
    """llama.cpp's ``llama-server`` on a free loopback port, ready (``/health`` 200)."""
    workdir.mkdir(parents=True, exist_ok=True)
    port = free_port()
    log = workdir / "llama-server.log"
    with log.open("w") as out:
        proc = subprocess.Popen(
            [binary, "-m", model, "--host", "127.0.0.1", "--port", str(port), "--no-webui", *flags],
            stdout=out,
            stderr=subprocess.STDOUT,
            cwd=workdir,
            start_new_session=True,
        )
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 180
    while True:
        with contextlib.suppress(httpx.HTTPError):
            if httpx.get(f"{url}/health", timeout=2).status_code == 200:
                break
        if proc.poll() is not None or time.monotonic() > deadline:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGKILL)
            raise RuntimeError(f"llama-server {name} did not start:\n{log.read_text()[-3000:]}")
        time.sleep(0.1)
    return Worker(name, url, proc, log)


@dataclass
class Reply:
    """One answer through the gateway: status, body, the worker that answered, seconds to the
    whole answer."""

    status: int
    body: dict[str, Any]
    worker: str
    seconds: float
    text: str = ""
    modeld: dict[str, Any] = field(default_factory=dict)


class Gateway:
    """``smg launch`` in front of the workers: sticky routing keys (``--policy manual``,
    ``X-SMG-Routing-Key``), a health check every second that marks a worker unhealthy at its
    first failure, retries (smg's default: 5) on another worker."""

    def __init__(self, smg: str, workers: Sequence[Worker], log: Path, *, policy: str = "manual") -> None:
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.workers = list(workers)
        self.log = log
        self.args = [
            smg,
            "launch",
            *("--host", "127.0.0.1", "--port", str(self.port)),
            *("--policy", policy, "--routing-key-headers", ROUTING_HEADER),
            *("--worker-urls", *[w.url for w in workers]),
            *("--health-check-interval-secs", str(HEALTH_INTERVAL), "--health-failure-threshold", "1"),
            *("--prometheus-host", "127.0.0.1", "--prometheus-port", str(free_port())),
            *("--shutdown-grace-period-secs", "1", "--log-level", "warn"),
        ]
        with log.open("w") as out:
            self.proc = subprocess.Popen(self.args, stdout=out, stderr=subprocess.STDOUT, start_new_session=True)
        self.http = httpx.Client(base_url=self.url, timeout=600)
        try:
            self.wait_ready()
        except BaseException:
            self.close()
            raise

    def registered(self) -> dict[str, bool]:
        """Worker URL -> healthy, as the gateway sees them."""
        listed = self.http.get("/workers", timeout=5).json().get("workers", [])
        return {w["url"]: bool(w.get("is_healthy")) for w in listed}

    def wait_ready(self, timeout: float = 120) -> None:
        deadline = time.monotonic() + timeout
        want = {w.url for w in self.workers}
        while True:
            with contextlib.suppress(httpx.HTTPError, ValueError):
                seen = self.registered()
                if want <= {url for url, healthy in seen.items() if healthy}:
                    return
            if self.proc.poll() is not None or time.monotonic() > deadline:
                tail = self.log.read_text(errors="replace")[-3000:] if self.log.exists() else ""
                raise RuntimeError(f"smg did not register {sorted(want)}:\n{tail}")
            time.sleep(0.2)

    def wait_unhealthy(self, worker: Worker, timeout: float = 30) -> None:
        """Until the gateway has marked ``worker`` unhealthy (or forgotten it)."""
        deadline = time.monotonic() + timeout
        while self.registered().get(worker.url, False):
            if time.monotonic() > deadline:
                raise RuntimeError(f"smg still routes to {worker.url} after {timeout:g}s")
            time.sleep(0.1)

    def chat(self, key: str, body: dict[str, Any]) -> Reply:
        started = time.perf_counter()
        r = self.http.post("/v1/chat/completions", json=body, headers={ROUTING_HEADER: key})
        seconds = time.perf_counter() - started
        data: dict[str, Any] = {}
        with contextlib.suppress(ValueError):
            data = r.json()
        text = ""
        if r.status_code == 200:
            text = data["choices"][0]["message"].get("content") or ""
        return Reply(r.status_code, data, r.headers.get(WORKER_HEADER, ""), seconds, text, data.get("modeld", {}))

    def close(self) -> None:
        self.http.close()
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait(timeout=30)
