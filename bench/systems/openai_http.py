"""OpenAI-compatible servers driven over loopback HTTP: streaming ``/v1/completions``.

Every HTTP system gets the same raw prompt text (prefix + suffix, no chat template) with greedy
decoding, streamed, and the client times the first and last token events. Subclasses say how to
start the server, what to add to the request body and how to read the tokens it prefilled.
"""

from __future__ import annotations

import json
import os
import subprocess
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx

from bench.systems.base import TurnResult, process_tree, stop_process, threaded_wave
from bench.workloads import Turn

__all__ = ["HttpServerSystem", "Streamed", "stream_completion"]


@dataclass
class Streamed:
    started: float
    first: float
    last: float
    tokens: int
    final: dict[str, Any]  # the last payload that carried usage or timings ({} if none did)


def stream_completion(http: httpx.Client, body: dict[str, Any], started: float) -> Streamed:
    """POST a streaming completion; token events are choices without a finish_reason."""
    first = last = 0.0
    events = 0
    final: dict[str, Any] = {}
    with http.stream("POST", "/v1/completions", json=body) as resp:
        if resp.status_code != 200:
            resp.read()
            raise RuntimeError(f"HTTP {resp.status_code}: {resp.text[:500]}")
        for line in resp.iter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            payload = json.loads(line[len("data: ") :])
            if "error" in payload:
                raise RuntimeError(f"stream error: {json.dumps(payload['error'])[:500]}")
            if payload.get("usage") or payload.get("timings"):
                final = payload
            choices = payload.get("choices") or []
            if choices and choices[0].get("finish_reason") is None:
                now = time.perf_counter()
                first = first or now
                last = now
                events += 1
    usage = final.get("usage") or {}
    tokens = int(usage.get("completion_tokens") or events)
    return Streamed(started, first, last, tokens, final)


class HttpServerSystem:
    """A server process on a loopback port; subclasses fill in ``args`` and the accounting."""

    name = "http"
    ready_path = "/health"

    def __init__(self, args: list[str], *, start_timeout: float = 180.0, cwd: Path | None = None) -> None:
        self.args = args
        self.cwd = cwd or Path(tempfile.mkdtemp(prefix="bhs"))
        self.start_timeout = start_timeout
        self.log_path = self.cwd / "server.log"
        self.settings: dict[str, Any] = {}
        self.notes: list[str] = []
        self._start()

    def _start(self) -> None:
        self.log = self.log_path.open("ab")
        self.proc = subprocess.Popen(
            self.args,
            stdout=self.log,
            stderr=subprocess.STDOUT,
            cwd=self.cwd,
            env={**os.environ, "PYTHONWARNINGS": "ignore"},
        )
        self.http = httpx.Client(base_url=self.base_url, timeout=900.0)
        deadline = time.monotonic() + self.start_timeout
        while True:
            if self.proc.poll() is not None or time.monotonic() > deadline:
                tail = self.log_path.read_bytes()[-2000:]
                stop_process(self.proc)
                raise RuntimeError(f"{self.name} did not start: {tail!r}")
            try:
                if self.http.get(self.ready_path).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            time.sleep(0.2)

    @property
    def base_url(self) -> str:
        raise NotImplementedError

    def body(self, key: str, turn: Turn, max_tokens: int) -> dict[str, Any]:
        return {
            "prompt": turn.prefix_text + turn.suffix_text,
            "max_tokens": max_tokens,
            "temperature": 0.0,
            "stream": True,
        }

    def accounting(self, streamed: Streamed, turn: Turn) -> tuple[int | None, int | None]:
        """(tokens prefilled, tokens reported cached) for this request, None where unknown."""
        details = (streamed.final.get("usage") or {}).get("prompt_tokens_details") or {}
        cached = details.get("cached_tokens")
        if cached is None:
            return None, None
        prompt = int(streamed.final["usage"].get("prompt_tokens") or turn.prompt_tokens)
        return prompt - int(cached), int(cached)

    def before_turn(self) -> float | None:
        """Work a client must do before its request (a slot restore after a restart), timed."""
        return None

    def turn(self, workload: str, index: int, key: str, turn: Turn, max_tokens: int) -> TurnResult:
        started = time.perf_counter()
        restore = self.before_turn()
        s = stream_completion(self.http, self.body(key, turn, max_tokens), started)
        prefilled, cached = self.accounting(s, turn)
        return self._result(workload, index, turn, s, prefilled, cached, restore)

    def _result(
        self,
        workload: str,
        index: int,
        turn: Turn,
        s: Streamed,
        prefilled: int | None,
        cached: int | None,
        restore: float | None = None,
    ) -> TurnResult:
        usage = s.final.get("usage") or {}
        return TurnResult(
            self.name,
            workload,
            index,
            s.first - s.started,
            s.last - s.started,
            s.tokens,
            (s.tokens - 1) / (s.last - s.first) if s.tokens > 1 and s.last > s.first else 0.0,
            prefilled,
            int(usage.get("prompt_tokens") or turn.prompt_tokens),
            cached,
            restore_s=restore,
        )

    def wave(self, workload: str, items: list[tuple[int, str, Turn]], max_tokens: int) -> list[TurnResult]:
        return threaded_wave(lambda i, k, t: self.turn(workload, i, k, t, max_tokens), items)

    def stop(self) -> None:
        self.http.close()
        stop_process(self.proc)
        self.log.close()

    def restart(self) -> float:
        started = time.perf_counter()
        self.stop()
        self._start()
        return time.perf_counter() - started

    def pids(self) -> list[int]:
        return process_tree(self.proc.pid)

    def close(self) -> None:
        self.stop()
