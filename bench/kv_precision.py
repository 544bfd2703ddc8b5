"""``python -m bench.kv_precision [--models tiny,realistic,copying]``: what a quantized KV cache
(``kv_cache_type`` q8_0, q4_0: llama-server's ``-ctk/-ctv``) saves and what it changes, on every
test model, through modeld's own runtime (``LlamaRuntime``, as the engine worker uses it).

Per model, four settings are loaded one after the other in this process: f16 without flash
attention (modeld's default), f16 with it (the baseline of the quantized rows: llama.cpp needs
flash attention for a quantized V, so the comparison isolates the precision), q8_0 and q4_0.
Printed per setting:

* memory: llama.cpp's own KV and compute buffer sizes at the window (its log lines) and the KV
  bytes per token; byte counts, so one run is the figure;
* agreement with the baseline over the same prompts: greedy tokens equal before the first
  difference (of :data:`GREEDY`; per prompt, and the median), the first token's argmax, and its
  largest logit difference relative to the logits' range. f16 with flash attention against f16
  without it is the same comparison for a change everybody accepts (the noise floor of "another
  kernel");
* on COPYING (constructed weights that copy earlier context, ``modeld/testmodels/_copying.py``)
  what the output is for: the free-running copy rate on a rewritten file (the fraction of greedy
  tokens that continue the original correctly, ``modeld.testmodels.measure``), per setting;
* the prefill's time against the baseline's (medians over the prompts; a direction: other work
  shares the machine).

Random-weight models (TINY, REALISTIC) flip greedy tokens on near-ties, so their agreement is a
lower bound of what a trained model shows; COPYING's copy rate is the task-level figure.
Blueprint 0016 ("KV precision") quotes this output.
"""

from __future__ import annotations

import argparse
import logging
import random
import statistics
import sys
import time
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from bench.kv_layout import GREEDY, Layout, _BufferLog, _greedy, _load, _logits, _sync, _tokens
from modeld.testmodels import COPYING, REALISTIC, TINY, ModelSpec
from modeld.testmodels.measure import free_running_cuts, rewrite_case

SETTINGS: tuple[tuple[str, bool, str], ...] = (
    ("f16", False, "f16"),
    ("f16 fa", True, "f16"),
    ("q8_0", True, "q8_0"),
    ("q4_0", True, "q4_0"),
)
BASELINE = "f16 fa"
_SPECS = {"tiny": TINY, "realistic": REALISTIC, "copying": COPYING}
COPY_LINES = 36  # held-out lines in COPYING's rewrite: ~1400 tokens


@dataclass
class Run:
    """One setting's outputs over the prompts."""

    name: str
    kv_mib: float = 0.0
    compute_mib: float = 0.0
    kv_bytes_per_token: int = 0
    greedy: list[list[int]] = field(default_factory=list)
    logits: list[np.ndarray[Any, np.dtype[np.float32]]] = field(default_factory=list)
    prefill_s: list[float] = field(default_factory=list)


def _prompts(spec: ModelSpec, window: int, count: int) -> tuple[list[list[int]], list[list[int]]]:
    """The prompts, and for COPYING the tokens a perfect copy continues each with (else empty)."""
    if spec.weights == "copying":
        runtime = _load(spec, Layout(1, window))
        try:
            bos = runtime.tokenize("", add_bos=True)
            case = rewrite_case(lambda text: runtime.tokenize(text, add_bos=False), bos[0], COPY_LINES)
        finally:
            runtime.close()
        cuts = free_running_cuts(case, GREEDY, count)
        return [case.ids[:cut] for cut in cuts], [case.ids[cut : cut + GREEDY] for cut in cuts]
    rng = random.Random(9)
    top = min(1500, window - GREEDY - 8)
    return [_tokens(rng, spec, rng.randrange(200, top)) for _ in range(count)], []


def _run(spec: ModelSpec, window: int, name: str, fa: bool, kv: str, prompts: list[list[int]]) -> Run:
    buffers = _BufferLog()
    logger = logging.getLogger("modeld.llama")
    logger.addHandler(buffers)
    logger.setLevel(logging.DEBUG)
    try:
        runtime = _load(spec, Layout(1, window, flash_attn=fa, kv=kv))
    finally:
        logger.removeHandler(buffers)
    run = Run(name, buffers.kv_mib, buffers.compute_mib, runtime.layout.kv_bytes_per_token)
    try:
        for tokens in prompts:
            runtime.drop(0)
            started = time.perf_counter()
            _sync(runtime, 0, 0, tokens)
            run.prefill_s.append(time.perf_counter() - started)
            run.logits.append(_logits(runtime))
            run.greedy.append(_greedy(runtime, 0))
    finally:
        runtime.close()
    return run


def _equal_before_difference(a: list[int], b: list[int]) -> int:
    return next((i for i, (x, y) in enumerate(zip(a, b, strict=False)) if x != y), min(len(a), len(b)))


def measure(model: str, window: int, count: int) -> list[dict[str, Any]]:
    spec = _SPECS[model]
    prompts, expected = _prompts(spec, window, count)
    runs = {name: _run(spec, window, name, fa, kv, prompts) for name, fa, kv in SETTINGS}
    base = runs[BASELINE]
    rows = []
    print(
        f"{model}: {len(prompts)} prompts of {min(map(len, prompts))}-{max(map(len, prompts))} tokens, "
        f"window {window}, {GREEDY} greedy tokens each; against {BASELINE!r}",
        flush=True,
    )
    for name, run in runs.items():
        against = runs["f16"] if name == BASELINE else base
        equal = [_equal_before_difference(a, b) for a, b in zip(run.greedy, against.greedy, strict=True)]
        argmax = sum(
            int(np.argmax(a)) == int(np.argmax(b)) for a, b in zip(run.logits, against.logits, strict=True)
        )
        relative = [
            float(np.max(np.abs(a.astype(np.float64) - b)) / max(1e-9, float(np.ptp(b))))
            for a, b in zip(run.logits, against.logits, strict=True)
        ]
        copy = (
            [_equal_before_difference(out, want) for out, want in zip(run.greedy, expected, strict=True)]
            if expected
            else []
        )
        prefill = statistics.median(run.prefill_s) / statistics.median(base.prefill_s)
        row = {
            "model": model,
            "setting": name,
            "against": against.name,
            "kv_bytes_per_token": run.kv_bytes_per_token,
            "kv_mib": run.kv_mib,
            "compute_mib": run.compute_mib,
            "greedy_equal": equal,
            "argmax_equal": argmax,
            "relative_logit_diff": relative,
            "copy_runs": copy,
            "prefill_ratio": prefill,
        }
        rows.append(row)
        copied = f"; copy rate {sum(copy) / (GREEDY * len(copy)):.3f} (runs {copy})" if copy else ""
        print(
            f"  {name:7s} KV {run.kv_bytes_per_token:6d} B/token, {run.kv_mib:7.2f} MiB at {window} cells, "
            f"compute {run.compute_mib:6.1f} MiB; vs {against.name:7s}: greedy equal {equal} "
            f"(median {statistics.median(equal)} of {GREEDY}), first argmax equal {argmax}/{len(prompts)}, "
            f"logit diff / range median {statistics.median(relative):.4f} (max {max(relative):.4f}){copied}; "
            f"prefill {prefill:.2f}x {BASELINE} (median {statistics.median(run.prefill_s) * 1000:.0f} ms)",
            flush=True,
        )
    return rows


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m bench.kv_precision", description=__doc__.split("\n\n")[0]
    )
    parser.add_argument(
        "--models", default="tiny,copying,realistic", help="comma-separated: tiny, realistic, copying"
    )
    parser.add_argument("--window", type=int, default=2048, help="cells of the one sequence (default 2048)")
    parser.add_argument("--prompts", type=int, default=6, help="prompts per model (default 6)")
    args = parser.parse_args(argv)
    for model in args.models.split(","):
        if model not in _SPECS:
            parser.error(f"unknown model {model!r}; one of {', '.join(sorted(_SPECS))}")
        measure(model, args.window, args.prompts)
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
