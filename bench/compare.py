"""``make bench-compare``: did any ratio get worse than the committed results allow?

Compares a run (by default the newest full run under ``bench/results/runs/``) with the committed
``bench/results/results.json`` (read from git's HEAD, since ``make bench`` rewrites the working
copy). A ratio is a regression when it moved in its bad direction (up for a TTFT ratio, down for
decode speed) by more than the tolerance: the run-to-run spread measured for that ratio (in
the baseline, or in the current document when it merges several runs), and never less than
``--min-tolerance`` (default 5%: a ratio measured once has no spread of its own). A figure in
milliseconds (``http_overhead_ms``) is compared absolutely: its spread in ms, at least
``--min-ms`` (default 2 ms). Ratios only one side measured are listed, never failed.
Exit 1 on any regression.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from bench.workloads import GOALS

__all__ = ["Finding", "compare", "ratios"]

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

    def line(self) -> str:
        b = "-" if self.baseline is None else f"{self.baseline:.3f}"
        c = "-" if self.current is None else f"{self.current:.3f}"
        tol = f"{self.tolerance:.1f} ms" if self.ratio.endswith("_ms") else f"{self.tolerance:.0%}"
        return f"{self.verdict:<12} {self.workload:<22} {self.ratio:<26} {b:>9} -> {c:<9} (tolerance {tol})"


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
        absolute = name.endswith("_ms")
        tolerance = max(min_ms if absolute else min_tolerance, b_spread or 0.0, c_spread or 0.0)
        if b is None and c is None:
            continue
        if b is None or c is None:
            verdict = "not measured"
        elif absolute:
            worse, better = c > b + tolerance, c < b - tolerance
            verdict = "worse" if worse else "better" if better else "ok"
        else:
            worse = c > b * (1 + tolerance) if direction == "lower" else c < b / (1 + tolerance)
            better = c < b / (1 + tolerance) if direction == "lower" else c > b * (1 + tolerance)
            verdict = "worse" if worse else "better" if better else "ok"
        findings.append(Finding(workload, name, b, c, tolerance, verdict))
    return findings


def _committed(path: Path) -> dict[str, Any]:
    rel = path.resolve().relative_to(ROOT.parent)
    shown = subprocess.run(
        ["git", "-C", str(ROOT.parent), "show", f"HEAD:{rel.as_posix()}"], capture_output=True, text=True
    )
    doc: dict[str, Any] = json.loads(shown.stdout if shown.returncode == 0 else path.read_text())
    return doc


def _newest_run(runs: Path) -> Path:
    for path in sorted(runs.glob("*/run.json"), reverse=True):
        if not json.loads(path.read_text()).get("partial"):
            return path
    raise SystemExit(f"bench-compare: no full run under {runs}; run `make bench` first")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.compare", description=__doc__)
    parser.add_argument(
        "--current", type=Path, help="a run.json or results.json (default: the newest full run)"
    )
    parser.add_argument("--baseline", type=Path, help="default: bench/results/results.json as committed")
    parser.add_argument("--min-tolerance", type=float, default=0.05, help="smallest relative tolerance")
    parser.add_argument("--min-ms", type=float, default=2.0, help="smallest tolerance of a figure in ms")
    args = parser.parse_args(argv)
    baseline = json.loads(args.baseline.read_text()) if args.baseline else _committed(RESULTS)
    current_path = args.current or _newest_run(RESULTS.parent / "runs")
    findings = compare(baseline, json.loads(current_path.read_text()), args.min_tolerance, args.min_ms)
    print(f"bench-compare: {current_path} against {args.baseline or 'the committed results.json'}")
    for f in findings:
        print("  " + f.line())
    worse = [f for f in findings if f.verdict == "worse"]
    if worse:
        print(f"bench-compare: {len(worse)} ratio(s) got worse beyond the run-to-run spread", file=sys.stderr)
        return 1
    print("bench-compare: no ratio got worse beyond the run-to-run spread")
    return 0


if __name__ == "__main__":
    sys.exit(main())
