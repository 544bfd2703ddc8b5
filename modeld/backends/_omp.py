"""OpenMP settings for llama.cpp, set before libgomp loads (import this before ``llama_cpp``).

OpenMP's threads spin after every ``llama_decode`` by default (GOMP: 300k rounds, throttled); on
a small machine they took the cores the daemon needed to relay each token when the engine ran on
a thread of the daemon (measured on 2 cores: 240 ms per token instead of 0.5 ms). Passive waiting
fixed that but halves decode speed, because ggml's barriers between a graph's nodes are OpenMP
barriers and every one of them then sleeps (realistic model, 2 cores, through a worker: 37 tok/s
passive against 66 with a short spin at a 300-token context, 31 against 54 at 2.3k; three
concurrent decodes 33 against 61 in all). A spin of 10k rounds keeps the barriers inside a graph
hot and lets the threads sleep soon after it. The operator's own OpenMP settings win.

libgomp reads its environment once, when it is loaded: the first ``import llama_cpp`` of the
process. ``_llama_lib``, through which every module of modeld loads llama.cpp, imports this module first (an earlier
version set the variable in ``llama_runtime`` after a sibling module had already loaded
llama.cpp, so the setting silently did nothing).
"""

from __future__ import annotations

import os

SPIN_COUNT = "10000"

if "OMP_WAIT_POLICY" not in os.environ and "GOMP_SPINCOUNT" not in os.environ:
    os.environ["GOMP_SPINCOUNT"] = SPIN_COUNT
