"""The systems measured side by side. Each runs in its own process; TTFT is client-observed.

* ``modeld``: ``modeld serve --backend llama`` and ``runtime_client`` over the unix socket, one
  session per workspace, manifests built with the ContextBuilder as a coding tool would.
* ``limit`` / ``cold``: :mod:`bench.direct` (llama-cpp-python directly, no daemon): a hot context
  per workspace evaluating only what changed, and a cleared context (full prefill).
* ``peer`` / ``peer+cache``: llama-cpp-python's OpenAI-compatible server
  (``python -m llama_cpp.server``), without and with ``--cache`` (its RAM prompt cache), driven
  over HTTP with streaming completions.
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx

import runtime_client as rc
from modeld.lease import read_lease

__all__ = ["DirectSystem", "ModeldSystem", "PeerSystem", "TurnResult", "peak_rss"]


@dataclass
class TurnResult:
    system: str
    workload: str
    turn: int
    ttft_s: float
    total_s: float
    completion_tokens: int
    decode_tps: float
    prefilled: int | None  # None: the system does not report it
    prompt_tokens: int | None = None
    outcome: str = ""
    token_ids: list[int] = field(default_factory=list)


def peak_rss(pid: int) -> int:
    """VmHWM (peak resident set) of a live process, in bytes."""
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) * 1024
    return 0


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class ModeldSystem:
    name = "modeld"

    def __init__(self, model: str, n_ctx: int, backend: str = "llama") -> None:
        self.model, self.n_ctx, self.backend = model, n_ctx, backend
        self.name = "modeld" if backend == "llama" else f"modeld-{backend}"
        self.tmp = Path(tempfile.mkdtemp(prefix="mdb"))
        self.log = (self.tmp / "daemon.log").open("w")
        self.proc = subprocess.Popen(
            [
                sys.executable,
                "-m",
                "modeld.cli",
                "--data-dir",
                str(self.tmp),
                "serve",
                "--backend",
                backend,
                "--listen",
                f"unix:{self.tmp}/s.sock",
            ],
            stdout=self.log,
            stderr=subprocess.STDOUT,
        )
        deadline = time.monotonic() + 60
        while (record := read_lease(self.tmp)) is None or record.state != "serving":
            if self.proc.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"modeld did not start: {(self.tmp / 'daemon.log').read_text()[-2000:]}")
            time.sleep(0.05)
        self.client = rc.connect(data_dir=self.tmp)
        self.sessions: dict[str, rc.ClientSession] = {}

    def _session(self, key: str) -> rc.ClientSession:
        if key not in self.sessions:
            config = rc.Config(num_ctx=self.n_ctx, num_batch=512)
            self.sessions[key] = self.client.open_session(
                rc.OpenSessionRequest(type=self.backend, path=self.model, config=config)
            )
        return self.sessions[key]

    def turn(
        self, workload: str, index: int, key: str, prefix: Any, suffix: Any, max_tokens: int
    ) -> TurnResult:
        session = self._session(key)
        builder = rc.ContextBuilder(identity=session.identity)
        for kind, text in (*prefix, *suffix):
            builder.add(kind, text)
        ctx = builder.build()
        started = time.perf_counter()
        p = session.ensure_prefix(ctx.prefix_input())
        s = session.prefill_suffix(ctx.suffix_input())
        first = last = 0.0
        ids: list[int] = []
        with session.decode(rc.DecodeConfig(max_tokens=max_tokens)) as stream:
            for chunk in stream:
                now = time.perf_counter()
                if chunk.token_ids and not first:
                    first = now
                if chunk.token_ids:
                    last = now
                ids.extend(chunk.token_ids)
        n = len(ids)
        return TurnResult(
            self.name,
            workload,
            index,
            first - started,
            last - started,
            n,
            (n - 1) / (last - first) if n > 1 and last > first else 0.0,
            p.prefilled_tokens + s.suffix_tokens + s.restored_tokens,
            p.prefix_tokens + s.suffix_tokens,
            f"{p.reuse.outcome}/{p.reuse.reason}",
            ids,
        )

    def peak_rss(self) -> int:
        return peak_rss(self.proc.pid)

    def close(self) -> None:
        for session in self.sessions.values():
            session.close()
        self.client.close()
        self.proc.terminate()
        self.proc.wait(timeout=30)
        self.log.close()


class DirectSystem:
    """The limit (hot, per-workspace context) and the cold baseline, in one worker process."""

    name = "limit"

    def __init__(self, model: str, n_ctx: int, threads: int) -> None:
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "bench.direct"],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
        )
        self._ask({"op": "load", "model": model, "n_ctx": n_ctx, "n_batch": 512, "threads": threads})

    def _ask(self, cmd: dict[str, Any]) -> dict[str, Any]:
        assert self.proc.stdin is not None
        assert self.proc.stdout is not None
        self.proc.stdin.write(json.dumps(cmd) + "\n")
        self.proc.stdin.flush()
        line = self.proc.stdout.readline()
        if not line:
            raise RuntimeError("the direct driver died")
        answer: dict[str, Any] = json.loads(line)
        return answer

    def turn(
        self,
        workload: str,
        index: int,
        key: str,
        prefix: str,
        suffix: str,
        max_tokens: int,
        *,
        cold: bool = False,
    ) -> TurnResult:
        a = self._ask(
            {
                "op": "turn",
                "name": key,
                "prefix": prefix,
                "suffix": suffix,
                "max_tokens": max_tokens,
                "cold": cold,
            }
        )
        return TurnResult(
            "cold" if cold else "limit",
            workload,
            index,
            a["ttft_s"],
            a["total_s"],
            a["completion_tokens"],
            a["decode_tps"],
            a["prefilled"],
            a["prompt_tokens"],
            "",
            a["token_ids"],
        )

    def peak_rss(self) -> int:
        return int(self._ask({"op": "peak_rss"})["bytes"])

    def close(self) -> None:
        assert self.proc.stdin is not None
        self.proc.stdin.write(json.dumps({"op": "quit"}) + "\n")
        self.proc.stdin.flush()
        self.proc.wait(timeout=30)


class PeerSystem:
    """llama-cpp-python's OpenAI-compatible server, over HTTP with streaming."""

    def __init__(self, model: str, n_ctx: int, threads: int, *, cache: bool) -> None:
        self.name = "peer+cache" if cache else "peer"
        self.port = _free_port()
        args = [
            sys.executable,
            "-m",
            "llama_cpp.server",
            "--model",
            model,
            "--n_ctx",
            str(n_ctx),
            "--n_batch",
            "512",
            "--n_threads",
            str(threads),
            "--n_threads_batch",
            str(threads),
            "--host",
            "127.0.0.1",
            "--port",
            str(self.port),
            "--verbose",
            "false",
        ]
        if cache:
            args += ["--cache", "true", "--cache_type", "ram"]
        self.log = tempfile.TemporaryFile()  # noqa: SIM115 - open for the server's life; closed in close()
        self.proc = subprocess.Popen(
            args, stdout=self.log, stderr=subprocess.STDOUT, env={**os.environ, "PYTHONWARNINGS": "ignore"}
        )
        self.http = httpx.Client(base_url=f"http://127.0.0.1:{self.port}", timeout=600.0)
        deadline = time.monotonic() + 120
        while True:
            if self.proc.poll() is not None or time.monotonic() > deadline:
                self.log.seek(0)
                raise RuntimeError(f"{self.name} did not start: {self.log.read()[-2000:]!r}")
            try:
                if self.http.get("/v1/models").status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            time.sleep(0.2)

    def turn(
        self, workload: str, index: int, key: str, prefix: str, suffix: str, max_tokens: int
    ) -> TurnResult:
        body = {"prompt": prefix + suffix, "max_tokens": max_tokens, "temperature": 0.0, "stream": True}
        started = time.perf_counter()
        first = last = 0.0
        events = 0
        with self.http.stream("POST", "/v1/completions", json=body) as resp:
            resp.raise_for_status()
            for line in resp.iter_lines():
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                payload = json.loads(line[len("data: ") :])
                if not payload.get("choices"):
                    continue
                now = time.perf_counter()
                if not first:
                    first = now
                last = now
                events += 1
        return TurnResult(
            self.name,
            workload,
            index,
            first - started,
            last - started,
            events,
            (events - 1) / (last - first) if events > 1 and last > first else 0.0,
            None,
        )

    def peak_rss(self) -> int:
        return peak_rss(self.proc.pid)

    def close(self) -> None:
        self.http.close()
        self.proc.terminate()
        try:
            self.proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            self.proc.kill()
        self.log.close()
