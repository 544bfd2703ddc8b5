"""The limit and the cold baseline: :mod:`bench.direct` (llama-cpp-python, no daemon) in its
own process, one hot context per workspace.

A concurrent wave is served one request after another in workspace order (the driver has one
thread, like llama.cpp's own decode loop): each request's TTFT then includes the time of the
requests served before it, which is what a client sending them at once would observe.
"""

from __future__ import annotations

import json
import subprocess
import sys
import tempfile
import time
from typing import Any

from bench.systems.base import TurnResult, stop_process
from bench.workloads import Turn, Workload

__all__ = ["DirectSystem"]


class DirectSystem:
    name = "limit"

    def __init__(self, model: str, load: Workload, threads: int) -> None:
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "bench.direct"], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True
        )
        self.tmp = tempfile.mkdtemp(prefix="bdr")
        self.notes: list[str] = []
        self.settings: dict[str, Any] = {
            "command": f"bench/direct.py: n_ctx {load.n_ctx}, n_batch 512, {threads} threads, flash attention off",
        }
        self._ask({"op": "load", "model": model, "n_ctx": load.n_ctx, "n_batch": 512, "threads": threads})

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
        self, workload: str, index: int, key: str, turn: Turn, max_tokens: int, *, cold: bool = False
    ) -> TurnResult:
        a = self._ask(
            {
                "op": "turn",
                "name": key,
                "prefix": turn.prefix_text,
                "suffix": turn.suffix_text,
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
            a["prompt_tokens"] - a["prefilled"],
            restore_s=a["restore_s"] or None,
            token_ids=a["token_ids"],
        )

    def wave(self, workload: str, items: list[tuple[int, str, Turn]], max_tokens: int) -> list[TurnResult]:
        out = []
        waited = 0.0
        for index, key, turn in sorted(items, key=lambda item: item[2].workspace):
            r = self.turn(workload, index, key, turn, max_tokens)
            r.ttft_s += waited
            r.total_s += waited
            waited = r.total_s
            out.append(r)
        return out

    def restart(self) -> float:
        started = time.perf_counter()
        self._ask({"op": "restart", "directory": self.tmp})
        return time.perf_counter() - started

    def pids(self) -> list[int]:
        return [self.proc.pid]

    def close(self) -> None:
        assert self.proc.stdin is not None
        self.proc.stdin.write(json.dumps({"op": "quit"}) + "\n")
        self.proc.stdin.flush()
        try:
            self.proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            stop_process(self.proc)
