"""``python -m bench.batch_starts [--reps N] [--models hybrid-qwen35,swa-gemma3]``: what line starts
as batch starts cost a cold prefill on memory that cannot be cut at any token (blueprint 0016,
"Edits inside a segment").

In process, on the generated models (``modeld.testmodels.ARCH_SPECS``), the real llama.cpp, the
default micro-batch (512), 2 threads: a whole prompt prefilled into an empty sequence (checkpoints
taken as a daemon takes them), with the batch starts of

* ``grid``: multiples of 512, turn starts and segment starts only (the placement before line starts);
* ``64``: also the first line start 64 tokens or more after every batch start (a fixed spacing);
* ``64/32``: the same, the spacing growing past 2048 tokens to 1/32 of the position (the default:
  :data:`~modeld.backends.llama_checkpoints.LINE_SHARE`).

Two prompts: ``map``, the bench.hybrid conversation (a 60-line repo map in the system message,
four turns; ~2.5k tokens), and ``long``, ~7.5k tokens of code-like lines. The configurations run
interleaved, ``--reps`` times each; medians and ranges, with the load average. Figures from a
shared machine are noisy: read the ratios.
"""

from __future__ import annotations

import argparse
import functools
import os
import statistics
import sys
import time
from typing import Any

from bench.hybrid import _conversation

__all__ = ["main"]

CONFIGS = {"grid": None, "64": 10**9, "64/32": 32}
"""Line-start spacing share per configuration (None: no line starts)."""


def _prompts(runtime: Any) -> dict[str, list[int]]:
    def chatml(messages: list[dict[str, str]]) -> str:
        turns = "".join(f"<|im_start|>{m['role']}\n{m['content']}<|im_end|>\n" for m in messages)
        return turns + "<|im_start|>assistant\n"

    long = "".join(
        f"def handler_{i}(request):\n    return respond(compute({i}, request.body))\n" for i in range(260)
    )
    return {
        "map": runtime.tokenize(chatml(_conversation(3, 60, True)), add_bos=True),
        "long": runtime.tokenize(long, add_bos=True),
    }


def _model(name: str, reps: int) -> list[str]:
    from modeld import testmodels
    from modeld.backends import llama_checkpoints, llama_rewind
    from modeld.backends.base import LoadOptions
    from modeld.backends.llama import LlamaBackend
    from modeld.contract import Config, OpenSessionRequest

    spec = {s.name: s for s in testmodels.ARCH_SPECS}[name]
    backend = LlamaBackend()
    req = OpenSessionRequest(
        type="llama", path=str(testmodels.ensure_model(spec)), config=Config(num_ctx=8192, num_threads=2)
    )
    runtime: Any = backend.load(
        req, backend.describe(req), LoadOptions(n_seq=1, window=8192, pool_tokens=8192)
    )
    lines, original = runtime._lines, llama_checkpoints.canonical
    out = []
    try:
        for prompt, tokens in _prompts(runtime).items():
            times: dict[str, list[float]] = {k: [] for k in CONFIGS}
            batches: dict[str, int] = {}
            loads = []
            for _ in range(reps):
                for key, share in CONFIGS.items():
                    runtime._lines = lines if share else frozenset()
                    llama_rewind.canonical = functools.partial(original, share=share or 32)  # type: ignore[attr-defined]
                    runtime._cut(0, 0)
                    started = time.perf_counter()
                    for _step in runtime.sync(0, 0, tokens):
                        pass
                    times[key].append(time.perf_counter() - started)
                    batches[key] = len(runtime._marks(tokens, [])) + 1
                    loads.append(os.getloadavg()[0])
            base = statistics.median(times["grid"])
            for key, ts in times.items():
                m = statistics.median(ts)
                out.append(
                    f"| {name} | {prompt} | {len(tokens)} | {key} | {batches[key]} | {m * 1000:.0f} "
                    f"| {min(ts) * 1000:.0f}-{max(ts) * 1000:.0f} | {m / base:.2f} | {min(loads):.1f}-{max(loads):.1f} |"
                )
    finally:
        llama_rewind.canonical = original  # type: ignore[attr-defined]
        runtime.close()
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m bench.batch_starts", description=__doc__.split("\n\n")[0]
    )
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument("--models", default="hybrid-qwen35,swa-gemma3")
    args = parser.parse_args(argv)
    rows = [
        "| model | prompt | tokens | batch starts | batches | median ms | range | / grid | load average |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for name in [m for m in args.models.split(",") if m]:
        rows += _model(name, args.reps)
    print("\n".join(rows), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
