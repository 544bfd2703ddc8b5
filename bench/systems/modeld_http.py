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
from bench.systems.modeld import extra_flags, pool_flags, serve_help
from bench.systems.openai_http import HttpServerSystem
from bench.workloads import Turn, Workload

__all__ = ["ModeldHttpSystem"]


class ModeldHttpSystem(HttpServerSystem):
    name = "modeld-http"

    def __init__(self, model: str, load: Workload, threads: int) -> None:
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
        flags += pool_flags(load, notes) + extra_flags()
        data = Path(tempfile.mkdtemp(prefix="mdh"))
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
