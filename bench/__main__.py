"""``make bench`` / ``make bench-quick``: every system on the same prompts, in one run.

Generates its model with the project's generator (the realistic 0.5B-shaped model; the tiny one
with ``--quick``), builds the workloads (``bench/workloads.py``), plays them on every system
(``bench/runner.py``), measures the daemon's own overhead on the memory backend, and writes the
run to ``<out>/runs/<id>/run.json``. A full run then rewrites ``<out>/report.md``,
``results.json`` and the plots from the two newest compatible runs (same machine, model and
workloads), so two ``make bench`` in a row give a report with the run-to-run spread. A run of
selected workloads (``--workload``, ``make bench WORKLOAD=name``) writes its report into its run
directory and leaves the main report alone. Timing is never asserted: only errors fail a run.
"""

from __future__ import annotations

import argparse
import contextlib
import hashlib
import json
import os
import platform
import signal
import sys
import time
from dataclasses import asdict
from pathlib import Path
from typing import Any

from bench import analysis
from bench.report import write_report
from bench.runner import run
from bench.systems import ALL_SYSTEMS, factories
from bench.workloads import Workload, make_workloads, workload_names
from modeld.settings import Timeouts

ROOT = Path(__file__).resolve().parent
MAX_TOKENS = 32  # a greedy decode per turn; 8 with --quick (the tiny model's smoke run)
# Measurements outside the workload runner that ``--workload`` selects by name like a workload.
EXTRAS = [
    "agent_apis",
    "families",
    "claude_code",
    "chat_agents",
    "speculation",
    "fleet",
    "hybrid",
    "overhead",
]


def _machine(threads: int, llama_server: str) -> dict[str, Any]:
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
    server = ""
    if llama_server:
        with contextlib.suppress(OSError):
            info = (Path(llama_server).parent / "BUILD-INFO").read_text().splitlines()
            server = "; ".join(line for line in info if not line.startswith("llama-server --version: built"))
    return {
        "cpu": cpu,
        "cores": len(os.sched_getaffinity(0)),
        "threads": threads,
        "memory_gib": round(psutil.virtual_memory().total / (1 << 30), 1),
        "platform": platform.platform(),
        "versions": versions,
        "engine_system_info": llama_cpp.llama_print_system_info().decode().strip(),
        "llama_server": server,
        "load_average_start": os.getloadavg(),
    }


def _select(loads: list[Workload], wanted: list[str]) -> list[Workload]:
    """The named workloads and every workload they continue (run first, in run order)."""
    by_name = {w.name: w for w in loads}
    need = set()
    for name in wanted:
        while name:
            need.add(name)
            name = by_name[name].continues
    return [w for w in loads if w.name in need]


def fingerprint(doc: dict[str, Any]) -> str:
    """Runs merge only with runs of the same machine, model, versions and workloads."""
    key = {
        "quick": doc["quick"],
        "model": doc["model"]["file"],
        "cpu": doc["machine"]["cpu"],
        "cores": doc["machine"]["cores"],
        "versions": doc["machine"]["versions"],
        "workloads": [(w["name"], w["prompt_tokens"]) for w in doc["workloads"]],
    }
    return hashlib.sha256(json.dumps(key, sort_keys=True).encode()).hexdigest()[:16]


def compatible_runs(runs_dir: Path, doc: dict[str, Any], limit: int = 2) -> list[dict[str, Any]]:
    """``doc`` and the newest earlier full runs with its fingerprint, newest first."""
    out = [doc]
    for path in sorted(runs_dir.glob("*/run.json"), reverse=True):
        if len(out) >= limit:
            break
        with contextlib.suppress(OSError, ValueError, KeyError):
            other = json.loads(path.read_text())
            if (
                other["id"] != doc["id"]
                and not other.get("partial")
                and other.get("fingerprint") == doc["fingerprint"]
            ):
                out.append(other)
    return out


def _speculation(llama_server: str, threads: int, quick: bool) -> dict[str, Any]:
    """Speculation from the context (``bench/speculation.py``, issue 19): the COPYING model, 5
    rounds of 192 tokens, then REALISTIC (random weights, nothing copied), 3 rounds; ``quick``: its SMALL construction, 1 round of 32 tokens (the smoke run's
    budget: 2 rounds of 64, ``python -m bench.speculation --quick``, take a minute more). A
    failure is the run's error, recorded; the other measurements go on."""
    from bench.speculation import run_speculation

    print("bench: speculation from the context (bench/speculation.py)", flush=True)
    binary = llama_server if llama_server and Path(llama_server).is_file() else ""
    try:
        doc = run_speculation(
            binary,
            threads=threads,
            quick=quick,
            runs=1 if quick else 5,
            max_tokens=32 if quick else 192,
            log=lambda s: print(f"  {s}", flush=True),
        )
        if not quick:  # REALISTIC copies nothing: every draft fails, and that must cost nothing
            print("bench: speculation on the realistic model (nothing to copy)", flush=True)
            doc["realistic"] = run_speculation(
                binary,
                threads=threads,
                runs=3,
                max_tokens=192,
                model_name="realistic",
                log=lambda s: print(f"  {s}", flush=True),
            )
        return doc
    except Exception as exc:  # recorded as the run's error; the run goes on
        print(f"bench: speculation failed: {exc}", file=sys.stderr, flush=True)
        return {"error": f"{type(exc).__name__}: {exc}"[:2000]}


def _hybrid(llama_server: str, threads: int, quick: bool) -> dict[str, Any]:
    """Hybrid, sliding-window and recurrent models (``bench/hybrid.py``): per class, an agent loop
    whose turns edit inside the prefix, against llama-server's default checkpoints, on the
    classes' copies :data:`~bench.hybrid.BENCH_WIDTH` wide (the quick run: as generated). A
    failure is the run's error, recorded; the other measurements go on."""
    from bench.hybrid import BENCH_WIDTH, run_hybrid

    print("bench: hybrid, sliding-window and recurrent models (bench/hybrid.py)", flush=True)
    try:
        return run_hybrid(
            llama_server,
            threads=threads,
            quick=quick,
            width=0 if quick else BENCH_WIDTH,
            log=lambda s: print(f"  {s}", flush=True),
        )
    except Exception as exc:  # recorded as the run's error; the run goes on
        print(f"bench: hybrid failed: {exc}", file=sys.stderr, flush=True)
        return {"error": f"{type(exc).__name__}: {exc}"[:2000]}


def _fleet(llama_server: str, quick: bool) -> dict[str, Any]:
    """The fleet behind smg (``bench/fleet.py``, issue 18): the realistic model, 6 conversations
    of ~8k tokens, against a llama-server fleet when a binary is given; ``quick``: the tiny
    model, 3 conversations of ~1k tokens. Skipped with the reason when smg cannot be installed
    (the package index unreachable); any other failure is the run's error, recorded."""
    from bench.fleet import QUICK, SmgUnavailable, run_fleet

    print("bench: a fleet behind the gateway (bench/fleet.py)", flush=True)
    model_name, prefix_tokens, conversations = QUICK if quick else ("realistic", 8192, 6)
    try:
        return run_fleet(
            llama_server if llama_server and Path(llama_server).is_file() else "",
            model_name=model_name,
            prefix_tokens=prefix_tokens,
            conversations=conversations,
            log=lambda s: print(f"  {s}", flush=True),
        )
    except SmgUnavailable as exc:
        print(f"bench: fleet skipped: {exc}", flush=True)
        return {"skipped": f"smg could not be installed: {exc}"}
    except Exception as exc:  # recorded as the run's error; the run goes on
        print(f"bench: fleet failed: {exc}", file=sys.stderr, flush=True)
        return {"error": f"{type(exc).__name__}: {exc}"[:2000]}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench", description=__doc__)
    parser.add_argument(
        "--quick", action="store_true", help="tiny model, smaller sizes, fewer turns (CI smoke)"
    )
    parser.add_argument("--out", type=Path, help="output directory")
    parser.add_argument("--systems", default=",".join(ALL_SYSTEMS), help="comma-separated subset")
    parser.add_argument(
        "--workload",
        default="",
        help=f"comma-separated subset of: {', '.join([*workload_names(), *EXTRAS])}",
    )
    parser.add_argument(
        "--llama-server", default="", help="the llama-server binary (scripts/build_llama_server.sh)"
    )
    args = parser.parse_args(argv)
    # Stop cleanly (every system closed by the runner's finally) on SIGTERM, and on SIGINT even
    # when started in the background (where a shell leaves SIGINT ignored).
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    signal.signal(signal.SIGINT, signal.default_int_handler)

    from modeld import testmodels

    started = time.time()
    spec = testmodels.TINY if args.quick else testmodels.REALISTIC
    model = str(testmodels.ensure_model(spec))
    out: Path = args.out or (ROOT / "results" / ("quick" if args.quick else ""))
    threads = len(os.sched_getaffinity(0))
    machine = _machine(threads, args.llama_server)

    max_tokens = 8 if args.quick else MAX_TOKENS
    from bench.direct import vocab_tokenizer

    tokenize = vocab_tokenizer(model)
    loads = make_workloads(tokenize, quick=args.quick, max_tokens=max_tokens)
    wanted = [w for w in args.workload.split(",") if w]
    choices = [*workload_names(), *EXTRAS]
    unknown = [w for w in wanted if w not in choices]
    if unknown:
        parser.error(f"unknown workload {', '.join(unknown)}; choose from {', '.join(choices)}")
    if wanted:
        loads = _select(loads, [w for w in wanted if w not in EXTRAS])
    names = [s for s in args.systems.split(",") if s]
    if bad := [s for s in names if s not in ALL_SYSTEMS]:
        parser.error(f"unknown system {', '.join(bad)}; choose from {', '.join(ALL_SYSTEMS)}")
    print(
        f"bench: model {spec.name} ({Path(model).name}), {threads} threads, systems {', '.join(names)}",
        flush=True,
    )
    for w in loads:
        print(f"  {w.name}: {w.title} (n_ctx {w.n_ctx})", flush=True)

    data = run(
        loads, names, factories(model, threads, args.llama_server), max_tokens, lambda s: print(s, flush=True)
    )

    agent_apis = None
    if not wanted or "agent_apis" in wanted:  # the agent APIs against llama-server's own endpoints
        from bench.agent_apis import SYSTEMS, run_agent_apis

        agent_apis = run_agent_apis(
            model,
            args.llama_server,
            threads,
            lambda text: len(tokenize(text)),
            quick=args.quick,
            max_tokens=max_tokens,
            systems=[s for s in SYSTEMS if s in names or (s == "modeld" and "modeld-http" in names)],
            log=lambda s: print(s, flush=True),
        )

    families = None
    if not wanted or "families" in wanted:  # issue 31: an agent loop per family's template
        from bench.families import run_families

        families = run_families(
            args.llama_server if args.llama_server and Path(args.llama_server).is_file() else "",
            threads,
            quick=args.quick,
            systems=[  # llama-server: both its configurations (its default; --cache-reuse 256)
                s
                for s in ("modeld", "llama-server", "llama-server-reuse")
                if s.removesuffix("-reuse") in names or (s == "modeld" and "modeld-http" in names)
            ],
            log=lambda s: print(s, flush=True),
        )
        print(f"bench: families done, {families['duration_s']:.0f} s", flush=True)

    claude_code = None
    if not wanted or "claude_code" in wanted:  # the real Claude Code, three runs (issue 30)
        from bench.claude_code import run_claude_code
        from modeld import testmodels

        claude_code = run_claude_code(
            str(testmodels.ensure_model(testmodels.REPLY)),
            args.llama_server,
            threads,
            runs=2 if args.quick else 3,
            cached_only=args.quick,  # the smoke run never installs from npm
            systems=[  # llama-server: both its configurations (its default; --cache-reuse 256)
                s
                for s in ("modeld", "llama-server", "llama-server-reuse")
                if s.removesuffix("-reuse") in names or (s == "modeld" and "modeld-http" in names)
            ],
            log=lambda s: print(s, flush=True),
        )

    chat_agents = None
    if not wanted or "chat_agents" in wanted:  # a main agent and two sub-agents over the chat API
        from bench.chat_agents import QUICK_ROUNDS, ROUNDS, run_chat_agents

        chat_agents = run_chat_agents(
            model,
            args.llama_server,
            threads,
            rounds=QUICK_ROUNDS if args.quick else ROUNDS,
            max_tokens=max_tokens,
            systems=[  # llama-server: both its configurations (its default; --cache-reuse 256)
                s
                for s in ("modeld", "llama-server", "llama-server-reuse")
                if s.removesuffix("-reuse") in names or (s == "modeld" and "modeld-http" in names)
            ],
            log=lambda s: print(s, flush=True),
        )

    speculation = None
    if not wanted or "speculation" in wanted:
        began = time.monotonic()
        speculation = _speculation(args.llama_server, threads, args.quick)
        speculation["duration_s"] = round(time.monotonic() - began, 1)
        print(f"bench: speculation done, {speculation['duration_s']:.0f} s", flush=True)
    fleet = None
    if not wanted or "fleet" in wanted:
        began = time.monotonic()
        fleet = _fleet(args.llama_server, args.quick)
        fleet["duration_s"] = round(time.monotonic() - began, 1)
        print(f"bench: fleet done, {fleet['duration_s']:.0f} s", flush=True)

    hybrid = None
    if not wanted or "hybrid" in wanted:
        began = time.monotonic()
        hybrid = _hybrid(args.llama_server, threads, args.quick)
        hybrid["duration_s"] = round(time.monotonic() - began, 1)
        print(f"bench: hybrid done, {hybrid['duration_s']:.0f} s", flush=True)

    overhead = None
    if not wanted or "overhead" in wanted:  # the daemon's own cost (``bench-compare``'s overhead rows)
        from bench.overhead import run_overhead

        print("bench: daemon overhead (memory backend)", flush=True)
        overhead = run_overhead(turns=5 if args.quick else 20)
        from bench.openai_overhead import run_openai_overhead

        print("bench: OpenAI endpoint overhead through the openai SDK (memory backend)", flush=True)
        overhead["openai"] = run_openai_overhead(turns=5 if args.quick else 20)
        from bench.page_overhead import run_page_overhead

        print("bench: the live page's and the request records' cost (memory backend)", flush=True)
        overhead["page"] = run_page_overhead(turns=10 if args.quick else 30, rounds=2 if args.quick else 6)
        if not args.quick:  # the realistic model: issue 9's decode goal, measured paired
            from bench.decode_pairs import describe, run_decode_pairs

            print("bench: decode through the worker against the limit, paired", flush=True)
            overhead["decode_pairs"] = run_decode_pairs(log=lambda s: print(s, flush=True))
            print(f"  {describe(overhead['decode_pairs'])}", flush=True)

    machine["load_average_end"] = os.getloadavg()
    machine["duration_s"] = round(time.time() - started, 1)
    doc: dict[str, Any] = {
        "schema": 2,
        "id": time.strftime("%Y%m%d-%H%M%S", time.localtime(started)),
        "quick": args.quick,
        "partial": bool(wanted),
        "model": {
            "name": spec.name,
            "file": Path(model).name,
            "max_tokens": max_tokens,
            "stream_interval_s": Timeouts().stream_interval_seconds,  # modeld's default, in force
        },
        "machine": machine,
        "systems": names,
        "workloads": [w.describe() for w in loads],
        "settings": data.settings,
        "notes": data.notes,
        "restarts": data.restarts,
        "durations": data.durations,
        "turns": [asdict(r) for r in data.results],
        "rss": data.rss,
        "rss_parts": data.rss_parts,
        "recomputed": data.recomputed,
        "overhead": overhead,
        "agent_apis": agent_apis,
        "claude_code": claude_code,
        "chat_agents": chat_agents,
        "families": families,
        "speculation": speculation,
        "fleet": fleet,
        "hybrid": hybrid,
        "errors": data.errors,
    }
    doc["fingerprint"] = fingerprint(doc)
    doc["headline"] = analysis.headline(doc)
    run_dir = out / "runs" / doc["id"]
    run_dir.mkdir(parents=True, exist_ok=True)
    (run_dir / "run.json").write_text(json.dumps(doc, indent=1))
    if wanted:
        write_report(run_dir, [doc])
        print(f"bench: wrote {run_dir} in {machine['duration_s']} s", flush=True)
    else:
        docs = compatible_runs(out / "runs", doc)
        write_report(out, docs)
        print(
            f"bench: wrote {out} from {len(docs)} run(s) ({', '.join(d['id'] for d in docs)}) in {machine['duration_s']} s",
            flush=True,
        )
    errors = (
        data.errors
        + (agent_apis["errors"] if agent_apis else 0)
        + (families["errors"] if families else 0)
        + (claude_code["errors"] if claude_code else 0)
        + (chat_agents["errors"] if chat_agents else 0)
    )
    errors += sum(1 for extra in (speculation, fleet, hybrid) if extra and "error" in extra)
    errors += fleet["errors"] if fleet and "errors" in fleet else 0
    if errors:
        # The end of the log is what a CI summary shows: each failure once, where and why.
        for line in failures(doc)[:FAILURES_SHOWN]:
            print(f"bench: failed: {line}", file=sys.stderr)
        print(f"bench: {errors} error(s); see the log above and the report's notes", file=sys.stderr)
        return 1
    return 0


FAILURES_SHOWN = 12
"""The most failures the run's last lines list (the report's notes keep them all)."""

_WHO = ("system", "loop", "workload", "family", "run", "round", "turn")


def failures(doc: dict[str, Any]) -> list[str]:
    """Each failure a run recorded, once: every record with an ``error`` (a turn, a loop, an
    extra that did not run), named by where it was and whom it concerned, then every note that
    says something failed and repeats no such error (a system that did not start, a family that
    did not run), then each Claude Code run that did not complete."""
    errors: dict[str, str] = {}
    notes: dict[str, str] = {}

    def walk(value: Any, where: str) -> None:
        if isinstance(value, dict):
            error = value.get("error")
            if isinstance(error, str) and error:
                who = " ".join(f"{k} {value[k]}" for k in _WHO if value.get(k) not in (None, ""))
                errors.setdefault(error[:160], f"{where}{f' ({who})' if who else ''}: {error[:300]}")
            for key, item in value.items():
                if key == "notes":
                    groups = item.values() if isinstance(item, dict) else [item]
                    for group in groups:
                        for said in group if isinstance(group, list) else [group]:
                            if isinstance(said, str) and "failed" in said:
                                notes.setdefault(said[:160], f"{where}: {said[:300]}")
                elif key != "error":
                    walk(item, where)
        elif isinstance(value, list):
            for item in value:
                walk(item, where)

    walk({"notes": doc.get("notes"), "turns": doc.get("turns")}, "workloads")
    for section in ("agent_apis", "claude_code", "chat_agents", "families", "speculation", "fleet", "hybrid"):
        walk(doc.get(section), section)
    said = [line for line in notes.values() if not any(error[:80] in line for error in errors)]
    runs = [
        f"claude_code ({system} run {run}): {why[:300]}"
        for system, whys in ((doc.get("claude_code") or {}).get("outcome") or {}).items()
        for run, why in enumerate(whys)
        if why
    ]
    return [*errors.values(), *said, *runs]


if __name__ == "__main__":
    sys.exit(main())
