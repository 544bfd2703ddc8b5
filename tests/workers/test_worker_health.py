"""Per-model gRPC health, worker status, logs and worker metrics, with a real daemon whose
engine worker is killed by a real signal (issue 9, items 2 and 6).

The model's health service (``model:<name>``) follows the worker's state as the engine reports
it (no polling): SERVING when loaded, NOT_SERVING while restarting or failed, SERVING again
after a restart. ``modeld status`` names the worker's pid, state, restarts and why; ``modeld
logs`` prints its last log lines (llama.cpp's own at ``--log-level debug``); the metrics count
the restart and show the state."""

from __future__ import annotations

import json
import os
import queue
import shutil
import signal
import subprocess
import tempfile
import threading
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import grpc
import pytest
from daemon_proc import MODELD, modeld, stop, wait_serving
from grpc_health.v1 import health_pb2, health_pb2_grpc
from prometheus_client.parser import text_string_to_metric_families

import runtime_client as rc
from modeld.contract import DecodeConfig, OpenSessionRequest, PrefixInput
from modeld.errors import EngineRestartedError
from modeld.server.health import health_service_name

pytestmark = [pytest.mark.wire, pytest.mark.llama]

Status = health_pb2.HealthCheckResponse
NAME = "tinyname"


@dataclass
class Daemon:
    data: Path
    proc: subprocess.Popen[str]
    endpoint: str
    model: str


@pytest.fixture
def daemon(request: pytest.FixtureRequest) -> Iterator[Daemon]:
    from modeld.testmodels import TINY, ensure_model

    data = Path(tempfile.mkdtemp(prefix="mdw"))
    extra: tuple[str, ...] = getattr(request, "param", ())
    # At debug level the daemon logs every line of its workers: to a file, not an unread pipe.
    with (data / "daemon.log").open("w") as log:
        command = [MODELD, "--data-dir", str(data), "serve", "--backend", "llama"]
        proc = subprocess.Popen(
            [*command, "--listen", f"unix:{data}/s.sock", "--log-level", "debug", *extra],
            stdout=log,
            stderr=log,
            text=True,
            start_new_session=True,
        )
    try:
        record = wait_serving(data, proc.pid)
        yield Daemon(data, proc, record.endpoint, str(ensure_model(TINY)))
    finally:
        stop(proc)
        shutil.rmtree(data, ignore_errors=True)


class Watch:
    """A health Watch stream read on a thread: the statuses in the order they arrived."""

    def __init__(self, endpoint: str, service: str) -> None:
        self.channel = grpc.insecure_channel(endpoint)
        self.seen: queue.Queue[int] = queue.Queue()
        stub = health_pb2_grpc.HealthStub(self.channel)
        self._call = stub.Watch(health_pb2.HealthCheckRequest(service=service))
        threading.Thread(target=self._read, daemon=True).start()

    def _read(self) -> None:
        try:
            for response in self._call:
                self.seen.put(response.status)
        except grpc.RpcError:
            pass

    def next(self, timeout: float = 60) -> int:
        return self.seen.get(timeout=timeout)

    def close(self) -> None:
        self._call.cancel()
        self.channel.close()


def _status(d: Daemon) -> dict[str, object]:
    out = modeld("status", "--json", data_dir=d.data)
    assert out.returncode == 0, out.stderr
    status: dict[str, object] = json.loads(out.stdout)
    return status


def _worker(d: Daemon) -> dict[str, object]:
    models = _status(d)["models"]
    assert isinstance(models, list) and len(models) == 1
    worker: dict[str, object] = models[0]["worker"]
    return worker


def _metrics(d: Daemon) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    text = modeld("metrics", data_dir=d.data).stdout
    return {
        (s.name, tuple(sorted(s.labels.items()))): s.value
        for family in text_string_to_metric_families(text)
        for s in family.samples
    }


def _check(d: Daemon, service: str) -> int:
    with grpc.insecure_channel(d.endpoint) as channel:
        return int(
            health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(service=service)).status
        )


@pytest.mark.parametrize("daemon", [("--crash-limit", "1")], indirect=True)
def test_a_killed_worker_beyond_the_crash_limit_marks_the_model_not_serving(daemon: Daemon) -> None:
    d = daemon
    service = health_service_name(NAME)
    assert service == "model:tinyname"
    watch = Watch(d.endpoint, service)
    try:
        assert watch.next() == Status.SERVICE_UNKNOWN  # not loaded yet
        with rc.connect(data_dir=d.data) as client:
            session = client.open_session(OpenSessionRequest(type="llama", path=d.model, model_name=NAME))
            assert session.ensure_prefix(PrefixInput(text="hello world\n")).prefix_tokens > 0
            assert watch.next() == Status.SERVING
            assert _check(d, service) == Status.SERVING
            assert _check(d, "") == Status.SERVING

            worker = _worker(d)
            assert worker["state"] == "ready" and worker["isolation"] == "process"
            pid = worker["pid"]
            assert isinstance(pid, int) and pid > 0
            lines = modeld("logs", NAME, data_dir=d.data).stdout.splitlines()
            assert lines[0] == f"== {NAME} (llama, ready) (last {len(lines) - 1} lines of worker pid {pid})"
            assert any("llama" in line for line in lines[1:])  # llama.cpp's own log

            os.kill(pid, signal.SIGKILL)
            assert watch.next() == Status.NOT_SERVING  # one death is the crash limit: failed
            with pytest.raises(EngineRestartedError):
                session.ensure_prefix(PrefixInput(text="hello world\n"))
            assert _check(d, service) == Status.NOT_SERVING
            assert _check(d, "") == Status.SERVING  # the daemon itself still serves

            worker = _worker(d)
            assert worker["state"] == "failed"
            assert worker["restarts"] == 0
            assert "killed by SIGKILL" in str(worker["last_restart_reason"])
            human = modeld("status", data_dir=d.data).stdout
            assert f"pid {pid} · failed (process)" in human
            assert "last restart: the engine worker for" in human
            m = _metrics(d)
            assert m[("modeld_worker_restarts_total", ())] == 1
            assert m[("modeld_worker_state", (("model", NAME), ("state", "failed")))] == 1
            assert m[("modeld_worker_state", (("model", NAME), ("state", "ready")))] == 0
            session.close()
    finally:
        watch.close()


def test_a_killed_worker_is_restarted_and_its_model_serves_again(daemon: Daemon) -> None:
    d = daemon
    service = health_service_name(NAME)
    watch = Watch(d.endpoint, service)
    try:
        assert watch.next() == Status.SERVICE_UNKNOWN
        with rc.connect(data_dir=d.data) as client:
            session = client.open_session(OpenSessionRequest(type="llama", path=d.model, model_name=NAME))
            session.ensure_prefix(PrefixInput(text="hello world\n"))
            assert watch.next() == Status.SERVING
            pid = _worker(d)["pid"]
            assert isinstance(pid, int)

            os.kill(pid, signal.SIGKILL)
            assert watch.next() == Status.NOT_SERVING  # restarting
            assert watch.next(timeout=15) == Status.SERVING  # ready again (the tiny model loads in ~1s)

            # The turn after the restart works on the new worker, cold: the KV died with it.
            status = session.ensure_prefix(PrefixInput(text="hello world\n"))
            assert (status.reuse.outcome, status.reuse.reason) == ("cold", "engine_reset")
            chunks = list(session.decode(DecodeConfig(max_tokens=4)))
            assert chunks[-1].finish_reason == "length"
            assert _check(d, service) == Status.SERVING

            worker = _worker(d)
            assert worker["state"] == "ready"
            assert worker["restarts"] == 1
            assert worker["pid"] != pid
            assert "killed by SIGKILL" in str(worker["last_restart_reason"])
            m = _metrics(d)
            assert m[("modeld_worker_restarts_total", ())] == 1
            assert m[("modeld_worker_state", (("model", NAME), ("state", "ready")))] == 1
            session.close()
    finally:
        watch.close()
