"""modeld through its OpenAI endpoint: ``modeld serve --http 127.0.0.1:PORT``.

Driven exactly like the other HTTP servers (raw prompt on ``/v1/completions``, streamed,
greedy), with the workspace as the OpenAI ``user`` field (the endpoint's conversation affinity).
Its prefill count is ``usage.prompt_tokens - usage.prompt_tokens_details.cached_tokens``.

Pluggable: when the installed ``modeld serve --help`` has no ``--http``, the system raises
:class:`Unsupported` and the report says so. Optional flags are passed only when the help lists
them: ``--model bench=PATH`` (else the request names the model by path), ``--kv-pool-tokens``
for the small-pool workload, and a context-size flag (``--num-ctx``) for the workload's context.
A separate daemon (its own data directory) from the gRPC system, so neither warms the other.
Readiness is ``GET /health``; if the endpoint loads its model on the first request, that time
counts in the first turn (and in the first turn after a restart), where the gRPC system opens
its sessions before the clock starts.
"""

from __future__ import annotations

import re
import sys
import tempfile
from pathlib import Path
from typing import Any

from bench.systems.base import Unsupported, free_port
from bench.systems.modeld import extra_flags, pool_flags, recomputed, serve_help
from bench.systems.openai_http import HttpServerSystem
from bench.workloads import Turn, Workload

__all__ = ["RECORD_FIELDS", "ModeldHttpSystem"]

RECORD_FIELDS = (
    "api",
    "conversation",
    "outcome",
    "reason",
    "tier",
    "prefix_tokens",
    "prefilled_tokens",
    "cached_tokens",
    "prompt_tokens",
    "ttft_ms",
    "prefill_ms",
    "restore_ms",
    "decode_ms",
    "finish",
    "error",
)
"""What :meth:`ModeldHttpSystem.records` keeps of each of the daemon's request records."""


class ModeldHttpSystem(HttpServerSystem):
    name = "modeld-http"

    def __init__(self, model: str, load: Workload, threads: int, extra: tuple[str, ...] = ()) -> None:
        help_text = serve_help()
        if "--http" not in help_text:
            raise Unsupported("the installed `modeld serve` has no `--http` (the OpenAI endpoint, issue 10)")
        self.port = free_port()
        notes: list[str] = []
        flags = ["--backend", "llama", "--http", f"127.0.0.1:{self.port}"]
        self.model_name = model
        if re.search(r"--model(?![-\w])", help_text):
            flags += ["--model", f"bench={model}"]
            self.model_name = "bench"
        for flag in ("--num-ctx", "--ctx-size"):
            if flag in help_text:
                flags += [flag, str(load.n_ctx)]
                break
        else:
            notes.append(
                "`modeld serve --help` has no context-size flag: the endpoint chose its own context size"
            )
        flags += pool_flags(load, notes) + extra_flags() + list(extra)
        data = Path(tempfile.mkdtemp(prefix="mdh"))
        self.data_dir = data
        args = [
            sys.executable,
            "-m",
            "modeld.cli",
            "--data-dir",
            str(data),
            "serve",
            "--listen",
            f"unix:{data}/s.sock",
            *flags,
        ]
        super().__init__(args, cwd=data)
        self.notes = notes
        self.settings = {"command": "modeld serve --listen unix:… " + " ".join(flags).replace(model, "MODEL")}

    def recomputed(self) -> int:
        """The daemon's ``recomputed`` counter, over its gRPC socket (the same daemon)."""
        return recomputed(self.data_dir)

    def records(self, since: float, limit: int = 500) -> list[dict[str, Any]]:
        """What the daemon did for each request that started after ``since`` (its request
        records: reuse outcome, reason and tier, tokens computed, its own TTFT, prefill and
        restore times), oldest first, each with the daemon's ``recomputed`` count when read: a
        slow turn then says whether modeld restored, waited or computed, or whether the time
        went outside the daemon."""
        import runtime_client as rc

        with rc.connect(data_dir=self.data_dir) as client:
            again = sum(int(m.counters.get("recomputed", 0)) for m in client.status().models)
            return [
                {
                    "started_at": r.started_at,
                    "daemon_ms": round((r.ended_at - r.started_at) * 1000, 1),
                    **{k: getattr(r, k) for k in RECORD_FIELDS},
                    "recomputed_so_far": again,
                }
                for r in client.list_requests(since=since, limit=limit)
            ]

    @property
    def base_url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def body(self, key: str, turn: Turn, max_tokens: int) -> dict[str, Any]:
        return {
            **super().body(key, turn, max_tokens),
            "model": self.model_name,
            "user": key,
            "stream_options": {"include_usage": True},
        }
