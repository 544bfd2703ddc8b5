"""``make bench`` / ``make bench-quick``: every system on the same prompts, in one run.

Generates its model with the project's generator (the realistic 0.5B-shaped model; the tiny one
with ``--quick``), builds the workloads (``bench/workloads.py``), runs each system in turn in
its own process over every workload, then the daemon-overhead workload on the memory backend,
and writes ``report.md``, ``results.json`` and ``ttft.png`` (to ``bench/results/`` by default,
``bench/results/quick/`` with ``--quick``). Timing is never asserted: only errors fail a run.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import platform
import sys
import time
from collections.abc import Callable
from dataclasses import asdict
from pathlib import Path
from typing import Any

from bench.overhead import run_overhead
from bench.report import write_report
from bench.systems import DirectSystem, ModeldSystem, PeerSystem, TurnResult
from bench.workloads import Workload, make_workloads

ROOT = Path(__file__).resolve().parent
MAX_TOKENS = 32


def _reset_peak(pid: int) -> None:
    """Reset a process's VmHWM so the next reading is this workload's peak (Linux)."""
    with contextlib.suppress(OSError):
        Path(f"/proc/{pid}/clear_refs").write_text("5")


def _machine() -> dict[str, Any]:
    import grpc
    import llama_cpp
    import psutil

    cpu = "unknown"
    with contextlib.suppress(OSError):
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    versions = {
        "python": platform.python_version(),
        "llama-cpp-python": llama_cpp.__version__,
        "grpcio": grpc.__version__,
    }
    with contextlib.suppress(ImportError):
        import openvino_genai

        versions["openvino-genai"] = openvino_genai.__version__.split("-")[0]
    return {
        "cpu": cpu,
        "cores": len(os.sched_getaffinity(0)),
        "memory_gib": round(psutil.virtual_memory().total / (1 << 30), 1),
        "platform": platform.platform(),
        "versions": versions,
        "load_average_start": os.getloadavg(),
    }


def _token_counter(model: str) -> Any:
    """Count tokens with the model's own tokenizer (llama.cpp, vocabulary only: no weights)."""
    import ctypes

    import llama_cpp as lc

    from bench.direct import _LOG, tokenize

    lc.llama_log_set(_LOG, ctypes.c_void_p(0))
    params = lc.llama_model_default_params()
    params.vocab_only = True
    vocab = lc.llama_model_get_vocab(lc.llama_model_load_from_file(model.encode(), params))

    def count(text: str) -> int:
        return len(tokenize(vocab, text))

    return count


def _settle(pid: int, timeout: float = 10.0) -> None:
    """Wait until a process stops using CPU (background work after a reply, spinning threads)."""
    import psutil

    proc = psutil.Process(pid)
    deadline = time.monotonic() + timeout
    previous = sum(proc.cpu_times()[:2])
    while time.monotonic() < deadline:
        time.sleep(0.1)
        now = sum(proc.cpu_times()[:2])
        if now - previous < 0.005:  # under 5% of a core over the last 100 ms
            return
        previous = now


def _run(
    systems: list[Any], workloads: list[Workload], results: list[TurnResult], rss: dict[str, dict[str, int]]
) -> None:
    """Turn-major: each turn runs on every system back to back, so per-turn ratios compare
    measurements taken seconds apart on a shared machine. Systems never run at the same time:
    before each turn the previous system must be idle, and the order rotates every turn so no
    system always follows the same one."""
    for load in workloads:
        active = [s for s in systems if s.name not in load.skip]
        for system in active:
            _reset_peak(system.proc.pid)
        previous: Any = None
        for i, turn in enumerate(load.turns):
            key = f"{load.name}/{turn.workspace}"
            order = active[i % len(active) :] + active[: i % len(active)]
            for system in order:
                if previous is not None:
                    _settle(previous.proc.pid)
                previous = system
                if isinstance(system, ModeldSystem):
                    r = system.turn(load.name, i, key, load.prefix_segments(i), turn.segments, MAX_TOKENS)
                else:
                    r = system.turn(load.name, i, key, load.prefix_for(i), turn.suffix, MAX_TOKENS)
                results.append(r)
                print(
                    f"  {load.name:<12} turn {i} {system.name:<11} TTFT {r.ttft_s * 1000:9.1f} ms  prefilled "
                    f"{r.prefilled if r.prefilled is not None else '-':>5}  {r.decode_tps:5.1f} tok/s  {r.outcome}",
                    flush=True,
                )
                if isinstance(system, DirectSystem) and (
                    i in load.cold_turns or (i == 0 and not load.cold_turns)
                ):
                    if i == 0:  # the limit's first turn on a fresh context is a cold prefill already
                        results.append(TurnResult(**{**asdict(r), "system": "cold"}))
                        continue
                    _settle(system.proc.pid)
                    c = system.turn(load.name, i, key, load.prefix_for(i), turn.suffix, MAX_TOKENS, cold=True)
                    results.append(c)
                    print(
                        f"  {load.name:<12} turn {i} {'cold':<11} TTFT {c.ttft_s * 1000:9.1f} ms  prefilled {c.prefilled:>5}",
                        flush=True,
                    )
        for system in active:
            rss.setdefault(system.name, {})[load.name] = system.peak_rss()
            if isinstance(system, DirectSystem):
                rss.setdefault("cold", {})[load.name] = rss[system.name][load.name]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench", description=__doc__)
    parser.add_argument(
        "--quick", action="store_true", help="tiny model, smaller sizes, fewer turns (CI smoke)"
    )
    parser.add_argument("--out", type=Path, help="output directory")
    parser.add_argument("--systems", default="modeld,limit,peer,peer+cache", help="comma-separated subset")
    args = parser.parse_args(argv)

    from modeld import testmodels

    started = time.time()
    spec = testmodels.TINY if args.quick else testmodels.REALISTIC
    model = str(testmodels.ensure_model(spec))
    out = args.out or (ROOT / "results" / ("quick" if args.quick else ""))
    out.mkdir(parents=True, exist_ok=True)
    threads = len(os.sched_getaffinity(0))
    machine = _machine()

    tokenize = _token_counter(model)

    workloads = make_workloads(tokenize, quick=args.quick)
    longest = max(w.workspaces[0].prefix_tokens + max(t.suffix_tokens for t in w.turns) for w in workloads)
    n_ctx = ((longest + MAX_TOKENS + 256) // 256 + 1) * 256
    print(f"bench: model {spec.name} ({Path(model).name}), n_ctx {n_ctx}, {threads} threads", flush=True)
    for w in workloads:
        print(f"  {w.name}: {w.title}", flush=True)

    wanted = args.systems.split(",")
    results: list[TurnResult] = []
    rss: dict[str, dict[str, int]] = {}
    factories: dict[str, Callable[[], Any]] = {
        "modeld": lambda: ModeldSystem(model, n_ctx),
        "limit": lambda: DirectSystem(model, n_ctx, threads),
        "peer": lambda: PeerSystem(model, n_ctx, threads, cache=False),
        "peer+cache": lambda: PeerSystem(model, n_ctx, threads, cache=True),
    }
    systems: list[Any] = []
    try:
        for name in wanted:
            print(f"bench: starting {name}", flush=True)
            systems.append(factories[name]())
        _run(systems, workloads, results, rss)
    finally:
        for system in systems:
            system.close()

    print("bench: daemon overhead (memory backend)", flush=True)
    overhead = run_overhead(turns=5 if args.quick else 20)

    machine["load_average_end"] = os.getloadavg()
    machine["duration_s"] = round(time.time() - started, 1)
    write_report(
        out,
        quick=args.quick,
        model={"name": spec.name, "file": Path(model).name, "n_ctx": n_ctx, "max_tokens": MAX_TOKENS},
        machine=machine,
        workloads=[
            {
                "name": w.name,
                "title": w.title,
                "turns": len(w.turns),
                "prefix_tokens": [s.prefix_tokens for s in w.workspaces],
                "suffix_tokens": [t.suffix_tokens for t in w.turns],
                "edit_token": w.edit_token,
            }
            for w in workloads
        ],
        results=[asdict(r) for r in results],
        rss=rss,
        overhead=overhead,
    )
    print(f"bench: wrote {out} in {machine['duration_s']} s", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
