"""An extra run alone (``python -m bench.claude_code``, ``python -m bench.chat_agents``,
``python -m bench.agent_apis``): its ``run.json`` and ``report.md`` under
``bench/results/runs/<id>-<name>/`` (a quick run's under ``bench/results/quick/runs/``, or
``out``), the report printed."""

from __future__ import annotations

import json
import os
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

__all__ = ["write_extra_run"]

ROOT = Path(__file__).resolve().parent.parent


def write_extra_run(
    name: str,
    model: tuple[str, str],
    started: float,
    result: dict[str, Any],
    report_lines: Callable[[dict[str, Any]], list[str]],
    out: Path | None = None,
    *,
    quick: bool = False,
    load_start: tuple[float, float, float] | None = None,
) -> Path:
    """Write the run of extra ``name`` (``model``: its spec's name and file) begun at ``started``
    (wall clock) and print its report; the folder written. ``quick``: a quick run's folder
    (``bench/results/quick/runs/``); ``load_start``: the load average when it began, kept."""
    doc: dict[str, Any] = {
        "id": time.strftime("%Y%m%d-%H%M%S", time.localtime(started)),
        "model": {"name": model[0], "file": model[1]},
    }
    if load_start is not None:
        doc["load_average_start"] = load_start
    doc |= {"load_average_end": os.getloadavg(), "duration_s": round(time.time() - started, 1), name: result}
    results = ROOT / "bench" / "results" / ("quick" if quick else "")
    out = out or results / "runs" / f"{doc['id']}-{name}"
    out.mkdir(parents=True, exist_ok=True)
    (out / "run.json").write_text(json.dumps(doc, indent=1))
    report = "\n".join(report_lines(result))
    (out / "report.md").write_text(report)
    print(report)
    return out
