"""``make bench-compare``: did any ratio get worse than the committed results allow?

Compares a run (by default the newest full run under ``bench/results/runs/``) with the committed
``bench/results/results.json`` (read from git's HEAD, since ``make bench`` rewrites the working
copy). A ratio is a regression when it moved in its bad direction (up for a TTFT ratio, down for
decode speed) by more than the tolerance: the run-to-run spread measured for that ratio (in
the baseline, or in the current document when it merges several runs), and never less than
``--min-tolerance`` (default 5%: a ratio measured once has no spread of its own). A figure in
milliseconds (``http_overhead_ms``) is compared absolutely: its spread in ms, at least
``--min-ms`` (default 2 ms); a count of tokens (``recomputed_tokens``, the daemon's count of
prompt tokens computed again) is exact: any increase is a regression. Ratios only one side
measured are listed, never failed.

Then the overhead rows and the extras' headline figures (:func:`extra_figures`): ``ensure_prefix``
on an unchanged 8k prefix (in process, over the wire, engine in a worker process), the worker's
IPC per turn and per generated token (worker row minus daemon row), decode through the worker
paired (``decode_pairs``), speculation's speed-ups, the fleet's moved-over-cold TTFT and per
model family (``bench/families.py``) the warm TTFT ratio (the servers' prefill ratio where no
TTFT compares: gpt-oss, Command R) and the tokens computed, modeld over llama-server at its default (a families run file, ``bench/results/families/run-*.json``, is
read as well as a whole run's ``run.json``; several of them merge by ``--current``). A
figure's spread is how far the runs a document merges lie apart (a run's own range for the
paired decode); relative figures get at least ``--min-tolerance``, the IPC differences (which
may be near 0) at least ``--min-ipc-ms`` (default 0.5 ms per turn; a fortieth of it per token).
Exit 1 on any regression.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from bench.families_report import family_summary
from bench.workloads import GOALS

__all__ = ["Figure", "Finding", "compare", "compare_extras", "extra_figures", "ratios"]

ROOT = Path(__file__).resolve().parent
RESULTS = ROOT / "results" / "results.json"


@dataclass(frozen=True)
class Finding:
    workload: str
    ratio: str
    baseline: float | None
    current: float | None
    tolerance: float
    verdict: str  # "worse", "ok", "better", "not measured"
    absolute: bool | None = None  # the tolerance is in ms (None: a name ending in _ms says so)

    def line(self) -> str:
        b = "-" if self.baseline is None else f"{self.baseline:.3f}"
        c = "-" if self.current is None else f"{self.current:.3f}"
        absolute = self.ratio.endswith(("_ms", "_tokens")) if self.absolute is None else self.absolute
        if self.ratio.endswith("_tokens"):
            tol = f"{self.tolerance:.0f} tokens"
        elif absolute:
            tol = f"{self.tolerance:.1f} ms" if self.tolerance >= 0.1 else f"{self.tolerance * 1000:.0f} µs"
        else:
            tol = f"{self.tolerance:.0%}"
        return f"{self.verdict:<12} {self.workload:<22} {self.ratio:<32} {b:>9} -> {c:<9} (tolerance {tol})"


def ratios(doc: dict[str, Any]) -> dict[tuple[str, str], tuple[float | None, float | None]]:
    """(workload, ratio) -> (value, spread) from a merged results.json or a single run.json."""
    out: dict[tuple[str, str], tuple[float | None, float | None]] = {}
    for workload, row in (doc.get("headline") or {}).items():
        for key, cell in row.items():
            if isinstance(cell, dict):
                out[(workload, key)] = (cell.get("value"), cell.get("spread"))
            else:
                out[(workload, key)] = (cell, None)
    return out


def compare(
    baseline: dict[str, Any], current: dict[str, Any], min_tolerance: float = 0.05, min_ms: float = 2.0
) -> list[Finding]:
    base, cur = ratios(baseline), ratios(current)
    findings = []
    for key in sorted(set(base) | set(cur)):
        workload, name = key
        if name not in GOALS:
            continue
        direction = GOALS[name][0]
        b, b_spread = base.get(key, (None, None))
        c, c_spread = cur.get(key, (None, None))
        exact = name.endswith("_tokens")  # a count: exact, no tolerance
        absolute = exact or name.endswith("_ms")
        floor = min_ms if absolute else min_tolerance
        tolerance = 0.0 if exact else max(floor, b_spread or 0.0, c_spread or 0.0)
        if b is None and c is None:
            continue
        findings.append(
            Finding(workload, name, b, c, tolerance, _verdict(b, c, tolerance, direction, absolute))
        )
    return findings


def _verdict(b: float | None, c: float | None, tolerance: float, direction: str, absolute: bool) -> str:
    """``c`` against ``b``: beyond the tolerance in the bad direction, the good one, or inside it
    (absolute: in the figure's unit; else relative)."""
    if b is None or c is None:
        return "not measured"
    if absolute:
        up, down = c > b + tolerance, c < b - tolerance
    else:
        up, down = c > b * (1 + tolerance), c < b / (1 + tolerance)
    worse, better = (up, down) if direction == "lower" else (down, up)
    return "worse" if worse else "better" if better else "ok"


@dataclass(frozen=True)
class Figure:
    """One overhead or extra figure: its value, the spread measured for it, which way is worse
    and whether it compares relatively (a ratio, a time that is never near 0) or absolutely."""

    value: float
    spread: float | None
    direction: str  # "lower" or "higher": the good direction
    absolute: bool = False


def _run_figures(run: dict[str, Any]) -> dict[tuple[str, str], tuple[float, float | None, str, bool]]:
    """One run's figures: (section, name) -> (value, its own spread or None, direction, absolute)."""
    out: dict[tuple[str, str], tuple[float, float | None, str, bool]] = {}
    overhead = run.get("overhead") or {}
    for row in ("in_process", "over_the_wire", "worker_process"):
        cell = overhead.get(row) or {}
        if cell.get("ensure_prefix_ms") is not None:
            out[("overhead", f"ensure_prefix_{row}_ms")] = (cell["ensure_prefix_ms"], None, "lower", False)
    wire, worker = overhead.get("over_the_wire") or {}, overhead.get("worker_process") or {}
    if wire and worker:
        out[("overhead", "worker_ipc_turn_ms")] = (worker["ttft_ms"] - wire["ttft_ms"], None, "lower", True)
        per_token = worker["per_token_ms"] - wire["per_token_ms"]
        out[("overhead", "worker_ipc_token_ms")] = (per_token, None, "lower", True)
    pairs = overhead.get("decode_pairs") or {}
    if pairs.get("ratio_median"):
        median = pairs["ratio_median"]
        own = (pairs["ratio_max"] - pairs["ratio_min"]) / median if "ratio_min" in pairs else None
        out[("overhead", "decode_pairs_over_limit")] = (median, own, "higher", False)
    summary = (run.get("speculation") or {}).get("summary") or {}
    for name, value in summary.items():
        if "_over_" in name and isinstance(value, int | float):
            out[("speculation", name)] = (float(value), None, "higher", False)
    for name, loop in ((run.get("families") or {}).get("families") or {}).items():
        if not loop.get("records"):
            continue
        fam = family_summary(loop)  # against llama-server at its default: issue 31's baseline
        if fam["ttft_ratio_median"] is not None:
            out[("families", f"{name}_ttft_ratio")] = (fam["ttft_ratio_median"], None, "lower", False)
        elif fam["prefill_ratio_median"] is not None:  # no TTFT compares: the servers' own prefill
            out[("families", f"{name}_prefill_ratio")] = (fam["prefill_ratio_median"], None, "lower", False)
        mine, theirs = fam["modeld_computed_total"], fam["llama-server_computed_total"]
        if mine and theirs:
            out[("families", f"{name}_computed_ratio")] = (mine / theirs, None, "lower", False)
    for system in (run.get("fleet") or {}).get("systems") or []:
        moved = (system.get("moved_over_cold") or {}).get("median")
        if system.get("system") == "modeld" and moved is not None:
            out[("fleet", "moved_over_cold")] = (moved, None, "lower", False)
    return out


def extra_figures(doc: dict[str, Any]) -> dict[tuple[str, str], Figure]:
    """The overhead and extras' figures of a run (``run.json``) or of every run a merged
    ``results.json`` holds (``run_docs``): the median of the runs, spread by how far apart
    they lie (relative, or in the figure's unit when absolute), or the run's own range."""
    runs = doc.get("run_docs") or [doc]
    seen: dict[tuple[str, str], list[tuple[float, float | None, str, bool]]] = {}
    for run in runs:
        for key, cell in _run_figures(run).items():
            seen.setdefault(key, []).append(cell)
    out: dict[tuple[str, str], Figure] = {}
    for key, cells in seen.items():
        values = sorted(c[0] for c in cells)
        direction, absolute = cells[0][2], cells[0][3]
        value = statistics.median(values)
        if len(values) > 1:
            spread: float | None = values[-1] - values[0] if absolute else values[-1] / values[0] - 1
        else:
            spread = cells[0][1]
        out[key] = Figure(value, spread, direction, absolute)
    return out


def compare_extras(
    baseline: dict[str, Any], current: dict[str, Any], min_tolerance: float = 0.05, min_ipc_ms: float = 0.5
) -> list[Finding]:
    """The overhead rows and the extras' figures of two documents, as :func:`compare` does ratios."""
    base, cur = extra_figures(baseline), extra_figures(current)
    findings = []
    for key in sorted(set(base) | set(cur)):
        section, name = key
        b, c = base.get(key), cur.get(key)
        either = b or c
        assert either is not None
        floor = (
            (min_ipc_ms / 40 if name.endswith("token_ms") else min_ipc_ms)
            if either.absolute
            else min_tolerance
        )
        tolerance = max(floor, (b.spread if b else None) or 0.0, (c.spread if c else None) or 0.0)
        before, after = (b.value if b else None), (c.value if c else None)
        verdict = _verdict(before, after, tolerance, either.direction, either.absolute)
        findings.append(Finding(section, name, before, after, tolerance, verdict, either.absolute))
    return findings


def _committed(path: Path) -> dict[str, Any]:
    rel = path.resolve().relative_to(ROOT.parent)
    shown = subprocess.run(
        ["git", "-C", str(ROOT.parent), "show", f"HEAD:{rel.as_posix()}"], capture_output=True, text=True
    )
    doc: dict[str, Any] = json.loads(shown.stdout if shown.returncode == 0 else path.read_text())
    return doc


def _load(paths: list[Path]) -> dict[str, Any]:
    """One document, or several runs as one (``run_docs``: their figures' median and spread)."""
    docs: list[dict[str, Any]] = [json.loads(path.read_text()) for path in paths]
    return docs[0] if len(docs) == 1 else {"run_docs": docs}


def _newest_run(runs: Path) -> Path:
    for path in sorted(runs.glob("*/run.json"), reverse=True):
        if not json.loads(path.read_text()).get("partial"):
            return path
    raise SystemExit(f"bench-compare: no full run under {runs}; run `make bench` first")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.compare", description=__doc__)
    parser.add_argument(
        "--current",
        type=Path,
        nargs="+",
        help="a run.json or results.json, or families run files (default: the newest full run)",
    )
    parser.add_argument(
        "--baseline", type=Path, nargs="+", help="default: bench/results/results.json as committed"
    )
    parser.add_argument("--min-tolerance", type=float, default=0.05, help="smallest relative tolerance")
    parser.add_argument("--min-ms", type=float, default=2.0, help="smallest tolerance of a figure in ms")
    parser.add_argument(
        "--min-ipc-ms", type=float, default=0.5, help="smallest tolerance of the worker's IPC per turn, in ms"
    )
    args = parser.parse_args(argv)
    baseline = _load(args.baseline) if args.baseline else _committed(RESULTS)
    current_paths = args.current or [_newest_run(RESULTS.parent / "runs")]
    current = _load(current_paths)
    current_path = " + ".join(map(str, current_paths))
    findings = compare(baseline, current, args.min_tolerance, args.min_ms)
    against = " + ".join(map(str, args.baseline)) if args.baseline else "the committed results.json"
    print(f"bench-compare: {current_path} against {against}")
    for f in findings:
        print("  " + f.line())
    extras = compare_extras(baseline, current, args.min_tolerance, args.min_ipc_ms)
    if extras:
        print("bench-compare: the overhead rows and the extras' figures")
        for f in extras:
            print("  " + f.line())
    findings += extras
    worse = [f for f in findings if f.verdict == "worse"]
    if worse:
        print(f"bench-compare: {len(worse)} ratio(s) got worse beyond the run-to-run spread", file=sys.stderr)
        return 1
    print("bench-compare: no ratio got worse beyond the run-to-run spread")
    return 0


if __name__ == "__main__":
    sys.exit(main())
