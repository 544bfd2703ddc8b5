"""Workload 4: the daemon's own cost, apart from any engine.

The memory backend computes nothing, so what a turn costs is modeld itself: validation,
manifest checks and hashing, tokenizing (one token per byte), reuse planning, the engine's
threads, and for the daemon, gRPC over the unix socket. Each turn: ensure_prefix on an unchanged
8k-token prefix (with a manifest of segments, as a tool sends it), a 64-token suffix, a 32-token
decode. Measured in process (the engine), over the wire (daemon + runtime_client) with the engine
inline, and over the wire with the engine in a worker process: the wire's share and the worker's
IPC cost are the differences. Every token travels on its own (``--stream-interval 0``): the
cost per generated token is the cost of one streamed message, the most a decode can pay.
"""

from __future__ import annotations

import statistics
import time
from typing import Any

import runtime_client as rc
from bench.daemon import serve
from modeld.engine import Engine
from modeld.settings import Timeouts

__all__ = ["run_overhead"]


def _context(session: Any) -> rc.BuiltContext:
    repo = "".join(f"src/pkg/module_{i}.py: handler_{i}(), parse_{i}()\n" for i in range(200))
    b = rc.ContextBuilder(identity=session.identity)
    b.system("You are a careful engineer.\n" * 4).repo_map(repo[: 8000 - 120])
    b.user_turn("x" * 63 + "\n")
    return b.build()


def _turns(session: Any, turns: int) -> dict[str, float]:
    ctx = _context(session)
    session.ensure_prefix(ctx.prefix_input())  # the prefix is resident from here on
    ensure, suffix, ttft, per_token = [], [], [], []
    for _ in range(turns):
        t0 = time.perf_counter()
        status = session.ensure_prefix(ctx.prefix_input())
        t1 = time.perf_counter()
        session.prefill_suffix(ctx.suffix_input())
        t2 = time.perf_counter()
        first = last = 0.0
        n = 0
        with session.decode(rc.DecodeConfig(max_tokens=32)) as stream:
            for chunk in stream:
                now = time.perf_counter()
                if chunk.token_ids:
                    first = first or now
                    last = now
                    n += len(chunk.token_ids)
        assert status.reused_tokens == status.prefix_tokens
        ensure.append(t1 - t0)
        suffix.append(t2 - t1)
        ttft.append(first - t0)
        per_token.append((last - first) / max(1, n - 1))
    return {
        "prefix_tokens": float(status.prefix_tokens),
        "ensure_prefix_ms": statistics.median(ensure) * 1000,
        "prefill_suffix_ms": statistics.median(suffix) * 1000,
        "ttft_ms": statistics.median(ttft) * 1000,
        "per_token_ms": statistics.median(per_token) * 1000,
        "ttft_min_ms": min(ttft) * 1000,
        "ttft_max_ms": max(ttft) * 1000,
    }


def _daemon(request: rc.OpenSessionRequest, turns: int, isolation: str) -> dict[str, float]:
    with serve("memory", "--isolation", isolation, "--stream-interval", "0") as (client, _):
        session = client.open_session(request)
        out = _turns(session, turns)
        session.close()
    return out


def run_overhead(turns: int) -> dict[str, Any]:
    """In process, over the wire with the engine inline in the daemon, and over the wire with the
    engine in a worker process: the last two differ by the worker's IPC (blueprint 0017)."""
    request = rc.OpenSessionRequest(type="memory", path="bench", config=rc.Config(num_ctx=16384))
    with Engine(backends=("memory",), timeouts=Timeouts(stream_interval_seconds=0.0)) as engine:
        in_process = _turns(engine.open_session(request), turns)
    return {
        "in_process": in_process,
        "over_the_wire": _daemon(request, turns, "inline"),
        "worker_process": _daemon(request, turns, "process"),
    }
