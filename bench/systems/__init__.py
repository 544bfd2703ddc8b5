"""The systems measured side by side, each in its own process; TTFT is client-observed.

=============  =========================================================================
modeld         ``modeld serve --backend llama`` over gRPC (``runtime_client``), one session
               per workspace, manifests from the ContextBuilder
modeld-http    the same daemon's OpenAI endpoint (``serve --http``), when the installed
               modeld has it
limit / cold   llama-cpp-python driven directly (``bench/direct.py``): a hot context per
               workspace / a cleared context (full prefill)
llama-server   llama.cpp's own server from the engine's llama.cpp commit, set up per workload
lcp-server     llama-cpp-python's OpenAI server with ``--cache``
=============  =========================================================================
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from bench.systems.base import System, TurnResult, Unsupported
from bench.systems.direct import DirectSystem
from bench.systems.lcp_server import LcpServerSystem
from bench.systems.llama_server import LlamaServerSystem
from bench.systems.modeld import ModeldSystem
from bench.systems.modeld_http import ModeldHttpSystem
from bench.workloads import Workload

__all__ = ["ALL_SYSTEMS", "DirectSystem", "System", "TurnResult", "Unsupported", "factories"]

ALL_SYSTEMS = ("modeld", "modeld-http", "limit", "llama-server", "lcp-server")

Factory = Callable[[Workload, bool], Any]


def factories(model: str, threads: int, llama_server: str) -> dict[str, Factory]:
    """name -> (first workload of a group, whether the group restarts) -> a started system."""
    return {
        "modeld": lambda load, _restart: ModeldSystem(model, load, threads),
        "modeld-http": lambda load, _restart: ModeldHttpSystem(model, load, threads),
        "limit": lambda load, _restart: DirectSystem(model, load, threads),
        "llama-server": lambda load, _restart: LlamaServerSystem(llama_server, model, load, threads),
        "lcp-server": lambda load, restart: LcpServerSystem(model, load, threads, disk=restart),
    }
