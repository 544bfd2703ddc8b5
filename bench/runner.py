"""Plays the workloads on every system, turn by turn, and collects what each turn cost.

Workloads run in groups: a workload that ``continues`` another runs on the systems (and warm
state) the other left behind; every other workload starts every system afresh with that
workload's settings (slots, pool, context size) and stops it after. Within a workload each
step (one turn, or a wave of concurrent turns) runs on every system back to back, one system at
a time, each waiting until the previous one is idle (its processes stop using CPU), and the
starting system rotates every step so no system always follows the same one: per-turn ratios
compare measurements taken seconds apart on a shared machine.

A system that keeps a count of tokens computed twice (modeld: its daemon's ``recomputed``
counter, prompt tokens a session had computed before and computed again) is read before and
after every step: per turn (``TurnResult.recomputed``) and per workload (``RunData.recomputed``,
a wave's turns counted together), so every workload reports issue 30's "0 tokens recomputed".

A system that fails a turn is recorded with the error and dropped for the rest of its group;
the run goes on and ends non-zero. Timing never fails a run.
"""

from __future__ import annotations

import contextlib
import dataclasses
import time
import traceback
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from typing import Any

from bench.systems import DirectSystem, TurnResult, Unsupported
from bench.systems.base import reset_peak, settle, tree_peak_rss_parts
from bench.workloads import Workload

__all__ = ["RunData", "groups", "run"]

Log = Callable[[str], None]


@dataclass
class RunData:
    results: list[TurnResult] = field(default_factory=list)
    rss: dict[str, dict[str, int]] = field(default_factory=dict)  # system -> workload -> bytes
    rss_parts: dict[str, dict[str, dict[str, int]]] = field(default_factory=dict)  # ... -> process -> bytes
    settings: dict[str, dict[str, dict[str, Any]]] = field(
        default_factory=dict
    )  # workload -> system -> settings
    notes: dict[str, list[str]] = field(default_factory=dict)  # workload -> notes
    restarts: dict[str, dict[str, float]] = field(default_factory=dict)  # workload -> system -> seconds
    durations: dict[str, float] = field(default_factory=dict)  # workload -> wall seconds (starts included)
    # system -> workload -> tokens the daemon computed again (its ``recomputed`` counter)
    recomputed: dict[str, dict[str, int]] = field(default_factory=dict)
    errors: int = 0


def groups(workloads: list[Workload]) -> list[list[Workload]]:
    out: list[list[Workload]] = []
    for load in workloads:
        if load.continues and out and out[-1][-1].name == load.continues:
            out[-1].append(load)
        else:
            out.append([load])
    return out


def _line(load: str, index: int | str, r: TurnResult) -> str:
    pre = "-" if r.prefilled is None else r.prefilled
    extra = f" restore {r.restore_s * 1000:.0f} ms" if r.restore_s else ""
    extra += f" RECOMPUTED {r.recomputed}" if r.recomputed else ""
    return (
        f"  {load:<20} turn {index!s:<3} {r.system:<12} TTFT {r.ttft_s * 1000:9.1f} ms  "
        f"prefilled {pre!s:>5} / {r.prompt_tokens or '-'!s:>5}  {r.decode_tps:5.1f} tok/s{extra}  {r.outcome}"
    )


def _start(
    names: list[str],
    factories: dict[str, Callable[[Workload, bool], Any]],
    group: list[Workload],
    data: RunData,
    log: Log,
) -> list[Any]:
    first = group[0]
    spec = dataclasses.replace(
        first,
        n_ctx=max(w.n_ctx for w in group),
        workspaces=max(w.workspaces for w in group),
    )
    restart = any(t.restart_before for w in group for t in w.turns)
    systems = []
    for name in names:
        try:
            system = factories[name](spec, restart)
        except Unsupported as e:
            for w in group:
                data.notes.setdefault(w.name, []).append(f"{name} skipped: {e}")
            log(f"bench: {name} skipped: {e}")
            continue
        except Exception as e:
            data.errors += 1
            for w in group:
                data.notes.setdefault(w.name, []).append(f"{name} failed to start: {e}")
            log(f"bench: {name} failed to start: {e}\n{traceback.format_exc()}")
            continue
        for w in group:
            data.settings.setdefault(w.name, {})[name] = system.settings
            data.notes.setdefault(w.name, []).extend(f"{name}: {n}" for n in getattr(system, "notes", []))
        systems.append(system)
    return systems


def run(
    workloads: list[Workload],
    names: list[str],
    factories: dict[str, Callable[[Workload, bool], Any]],
    max_tokens: int,
    log: Log = print,
) -> RunData:
    data = RunData()
    for group in groups(workloads):
        log(f"bench: starting {', '.join(names)} for {', '.join(w.name for w in group)}")
        began = time.monotonic()
        systems = _start(names, factories, group, data, log)
        log(f"bench: started in {time.monotonic() - began:.1f} s")
        try:
            for load in group:
                systems = _workload(load, group[0].name, systems, data, max_tokens, log)
                data.durations[load.name] = round(time.monotonic() - began, 1)
                log(f"bench: {load.name} done, {data.durations[load.name]:.0f} s")
                began = time.monotonic()
        finally:
            for system in systems:
                with contextlib.suppress(Exception):
                    system.close()
    return data


def _workload(
    load: Workload, root: str, systems: list[Any], data: RunData, max_tokens: int, log: Log
) -> list[Any]:
    """One workload on the group's systems; ``root`` (the group's first workload) names the
    workspaces, so a continuing workload reaches the same sessions, slots and contexts."""
    for system in systems:
        reset_peak(system.pids())
    previous: Any = None
    failed: set[str] = set()
    for step_no, step in enumerate(load.steps()):
        turns = [load.turns[i] for i in step]
        if any(t.restart_before for t in turns):
            for system in systems:
                if system.name in failed:
                    continue
                if previous is not None:
                    settle(previous.pids())
                try:
                    seconds = system.restart()
                except Exception as e:
                    failed.add(system.name)
                    data.errors += 1
                    log(f"bench: {system.name} failed to restart: {e}\n{traceback.format_exc()}")
                    continue
                data.restarts.setdefault(load.name, {})[system.name] = seconds
                log(f"  {load.name:<20} {system.name} restarted in {seconds:.1f} s")
                previous = system
        order = systems[step_no % len(systems) :] + systems[: step_no % len(systems)] if systems else []
        for system in order:
            if system.name in failed:
                continue
            if previous is not None:
                settle(previous.pids())
            previous = system
            items = [(i, f"{root}/{load.turns[i].workspace}", load.turns[i]) for i in step]
            try:
                before = _recomputed(system)
                if len(items) == 1:
                    results = [system.turn(load.name, items[0][0], items[0][1], items[0][2], max_tokens)]
                else:
                    results = system.wave(load.name, items, max_tokens)
                if before is not None:
                    # A wave's turns share one count: the workload's total has it, no turn does.
                    again = (_recomputed(system) or 0) - before
                    counts = data.recomputed.setdefault(system.name, {})
                    counts[load.name] = counts.get(load.name, 0) + again
                    if len(results) == 1:
                        results[0].recomputed = again
            except Exception as e:
                failed.add(system.name)
                data.errors += 1
                log(f"bench: {system.name} failed on {load.name} turn {step}: {e}\n{traceback.format_exc()}")
                data.results.append(
                    TurnResult(system.name, load.name, step[0], 0.0, 0.0, 0, 0.0, None, error=str(e)[:500])
                )
                data.notes.setdefault(load.name, []).append(
                    f"{system.name} failed at turn {step[0]}: {str(e)[:300]}"
                )
                continue
            for r in sorted(results, key=lambda r: r.turn):
                data.results.append(r)
                log(_line(load.name, r.turn, r))
            if isinstance(system, DirectSystem):
                _cold(load, step, system, data, max_tokens, log)
    for system in systems:
        parts = tree_peak_rss_parts(system.pids())
        data.rss.setdefault(system.name, {})[load.name] = sum(parts.values())
        data.rss_parts.setdefault(system.name, {})[load.name] = parts
        if isinstance(system, DirectSystem):
            data.rss.setdefault("cold", {})[load.name] = data.rss[system.name][load.name]
    kept = [s for s in systems if s.name not in failed]
    for s in systems:
        if s.name in failed:
            with contextlib.suppress(Exception):
                s.close()
    return kept


def _recomputed(system: Any) -> int | None:
    """The daemon's count of prompt tokens its sessions had computed before and computed again
    (modeld's ``recomputed`` counter); None for a system that keeps no such count. Read after
    the system started or restarted and around every step, so a restart (a new daemon, its
    counter at 0) is counted from there."""
    read = getattr(system, "recomputed", None)
    return int(read()) if read is not None else None


def _cold(
    load: Workload, step: list[int], system: DirectSystem, data: RunData, max_tokens: int, log: Log
) -> None:
    """Cold samples: the chosen turns, or the limit's first turn on a fresh context."""
    for i in step:
        if i in load.cold_turns:
            settle(system.pids())
            c = system.turn(load.name, i, "cold", load.turns[i], max_tokens, cold=True)
            data.results.append(c)
            log(_line(load.name, i, c))
        elif i == 0 and not load.cold_turns and not load.continues:
            r = next(
                r
                for r in reversed(data.results)
                if r.system == "limit" and r.workload == load.name and r.turn == 0
            )
            data.results.append(TurnResult(**{**asdict(r), "system": "cold"}))
