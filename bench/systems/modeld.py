"""modeld over gRPC: ``modeld serve --backend llama`` driven through ``runtime_client``.

One session per workspace, manifests built with the ContextBuilder as a coding tool would
(stable segments in the prefix, the turn's segments in the suffix). Only the public client API
and ``modeld serve`` flags are used; optional flags (``--kv-pool-tokens``) are passed only when
``modeld serve --help`` lists them, so the harness runs on today's main and after the warm-state
work lands. A restart stops the daemon with SIGTERM and starts it on the same data directory
(whatever it persisted there is its to use); sessions are re-opened (model load included) before
the next turn is timed.
"""

from __future__ import annotations

import functools
import os
import shlex
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import runtime_client as rc
from bench.systems.base import TurnResult, process_tree, stop_process, threaded_wave
from bench.workloads import Turn, Workload
from modeld.lease import read_lease

__all__ = ["ModeldSystem", "extra_flags", "pool_flags", "recomputed", "serve_help"]


def recomputed(data_dir: Path) -> int:
    """The daemon's ``recomputed`` counter, summed over its loaded models: prompt tokens a session
    had in its warm context before and computed again (``modeld status``, blueprint 0016 "Where
    the missing tokens went"). Read through its gRPC socket; it starts at 0 with each daemon
    process (a restart), and per loaded model (the bench loads one)."""
    client = rc.connect(data_dir=data_dir)
    try:
        return sum(int(m.counters.get("recomputed", 0)) for m in client.status().models)
    finally:
        client.close()


@functools.cache
def serve_help() -> str:
    """``modeld serve --help`` of the installed modeld (to probe optional flags)."""
    out = subprocess.run(
        [sys.executable, "-m", "modeld.cli", "serve", "--help"], capture_output=True, text=True, timeout=60
    )
    return out.stdout + out.stderr


def pool_flags(load: Workload, notes: list[str]) -> list[str]:
    """The KV capacity llama-server gets in this workload (its ``-c``: the workload's small pool,
    or a window per workspace), given to modeld too, so both hold the same warm capacity.

    modeld's default KV is one unified pool of one window that every sequence may fill
    (blueprint 0016): a single-workspace workload needs no flag; with several workspaces the
    pool is ``--kv-pool-tokens`` cells, as llama-server's ``-c``, and where it holds a window per
    workspace modeld gets a sequence per workspace too (``--sequences``, llama-server's ``-np``;
    modeld then lays the pool out as split streams). A modeld whose default is split streams
    (before the unified default) gets ``--sequences`` windows instead.
    ``MODELD_BENCH_CAPACITY=default`` leaves modeld at its default capacity (one window, the rest
    through the tiers) to measure what several workspaces cost there."""
    if (load.workspaces <= 1 and not load.pool_tokens) or os.environ.get(
        "MODELD_BENCH_CAPACITY"
    ) == "default":
        return []
    pool = load.pool_tokens or load.workspaces * load.n_ctx
    help_text = serve_help()
    if "--no-kv-unified" in help_text:
        every = [] if load.pool_tokens else ["--sequences", str(load.workspaces)]
        return ["--kv-pool-tokens", str(pool), *every]
    if "--sequences" in help_text:
        return ["--sequences", str(max(1, pool // load.n_ctx))]
    notes.append(
        f"`modeld serve --help` has no `--sequences`: modeld ran with its default pool "
        f"(the workload asks for {pool} tokens)"
    )
    return []


def extra_flags() -> list[str]:
    """``MODELD_BENCH_FLAGS``: more ``modeld serve`` flags, to measure a setting against the
    default (``--no-kv-unified``, ``--sequences 1``); the report prints the command."""
    return shlex.split(os.environ.get("MODELD_BENCH_FLAGS", ""))


class ModeldSystem:
    name = "modeld"

    def __init__(self, model: str, load: Workload, threads: int) -> None:
        self.model, self.n_ctx = model, load.n_ctx
        # At both systems' defaults modeld picks its own micro-batch (64 for attention on the
        # CPU); elsewhere 512, llama-server's, so the two compute in the same batches.
        self.batch = 0 if load.defaults else 512
        self.notes: list[str] = []
        self.tmp = Path(tempfile.mkdtemp(prefix="mdb"))
        self.args = [
            sys.executable,
            "-m",
            "modeld.cli",
            "--data-dir",
            str(self.tmp),
            "serve",
            "--backend",
            "llama",
            "--listen",
            f"unix:{self.tmp}/s.sock",
            *pool_flags(load, self.notes),
            *extra_flags(),
        ]
        self.settings: dict[str, Any] = {
            "command": " ".join(["modeld serve --backend llama --listen unix:…", *self.args[10:]]),
            "session": f"num_ctx {self.n_ctx}, num_batch {self.batch or 'default'}, one session per workspace",
        }
        self.sessions: dict[str, rc.ClientSession] = {}
        self._start()

    def _start(self) -> None:
        self.log = (self.tmp / "daemon.log").open("a")
        self.proc = subprocess.Popen(self.args, stdout=self.log, stderr=subprocess.STDOUT)
        deadline = time.monotonic() + 120
        while (record := read_lease(self.tmp)) is None or record.state != "serving":
            if self.proc.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"modeld did not start: {(self.tmp / 'daemon.log').read_text()[-2000:]}")
            time.sleep(0.05)
        self.client = rc.connect(data_dir=self.tmp)

    def _session(self, key: str) -> rc.ClientSession:
        if key not in self.sessions:
            config = rc.Config(num_ctx=self.n_ctx, num_batch=self.batch)
            self.sessions[key] = self.client.open_session(
                rc.OpenSessionRequest(type="llama", path=self.model, config=config)
            )
        return self.sessions[key]

    def turn(self, workload: str, index: int, key: str, turn: Turn, max_tokens: int) -> TurnResult:
        session = self._session(key)
        builder = rc.ContextBuilder(identity=session.identity)
        for kind, text in (*turn.prefix, *turn.suffix):
            builder.add(kind, text)
        ctx = builder.build()
        started = time.perf_counter()
        p = session.ensure_prefix(ctx.prefix_input())
        s = session.prefill_suffix(ctx.suffix_input())
        first = last = 0.0
        ids: list[int] = []
        in_first = 0  # tokens of the first chunk (the daemon streams fast tokens together)
        usage = None
        with session.decode(rc.DecodeConfig(max_tokens=max_tokens)) as stream:
            for chunk in stream:
                now = time.perf_counter()
                if chunk.token_ids:
                    if not first:
                        first, in_first = now, len(chunk.token_ids)
                    last = now
                ids.extend(chunk.token_ids)
                if chunk.error is not None:
                    raise RuntimeError(f"decode failed: {chunk.error.reason}: {chunk.error.message}")
                usage = chunk.usage or usage
        n = len(ids)
        prompt = p.prefix_tokens + s.suffix_tokens
        # The statuses' exact accounting: prefix tokens prefilled, the suffix but what of it is
        # still resident from the last turn (the same first tokens), and prefix tokens
        # re-prefilled because another session displaced them in between.
        prefilled = p.prefilled_tokens + s.suffix_tokens - s.reused_tokens + s.restored_tokens
        cached = usage.cached_tokens if usage is not None else None
        restore_ms = p.restore_ms + s.restore_ms  # the daemon's own account of the turn's restores
        return TurnResult(
            self.name,
            workload,
            index,
            first - started,
            last - started,
            n,
            (n - in_first) / (last - first) if last > first else 0.0,
            prefilled,
            prompt,
            cached,
            f"{p.reuse.outcome}/{p.reuse.reason}",
            restore_s=restore_ms / 1000 or None,
            token_ids=ids,
        )

    def wave(self, workload: str, items: list[tuple[int, str, Turn]], max_tokens: int) -> list[TurnResult]:
        for _, key, _turn in items:
            self._session(key)  # opened before the clock starts, as in a sequential turn
        return threaded_wave(lambda i, k, t: self.turn(workload, i, k, t, max_tokens), items)

    def restart(self) -> float:
        started = time.perf_counter()
        keys = list(self.sessions)
        self.sessions.clear()
        self.client.close()
        stop_process(self.proc)
        self.log.close()
        self._start()
        for key in keys:
            self._session(key)
        return time.perf_counter() - started

    def recomputed(self) -> int:
        """The daemon's ``recomputed`` counter (the runner reads it before and after each turn)."""
        return sum(int(m.counters.get("recomputed", 0)) for m in self.client.status().models)

    def pids(self) -> list[int]:
        return process_tree(self.proc.pid)

    def close(self) -> None:
        for session in self.sessions.values():
            session.close()
        self.client.close()
        stop_process(self.proc)
        self.log.close()
