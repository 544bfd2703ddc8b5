"""An extra run alone (``python -m bench.claude_code``, ``python -m bench.chat_agents``): its
``run.json`` and ``report.md`` under ``bench/results/runs/<id>-<name>/`` (or ``out``), the report
printed."""

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
) -> Path:
    """Write the run of extra ``name`` (``model``: its spec's name and file) begun at ``started``
    (wall clock) and print its report; the folder written."""
    doc = {
        "id": time.strftime("%Y%m%d-%H%M%S", time.localtime(started)),
        "model": {"name": model[0], "file": model[1]},
        "load_average_end": os.getloadavg(),
        "duration_s": round(time.time() - started, 1),
        name: result,
    }
    out = out or ROOT / "bench" / "results" / "runs" / f"{doc['id']}-{name}"
    out.mkdir(parents=True, exist_ok=True)
    (out / "run.json").write_text(json.dumps(doc, indent=1))
    report = "\n".join(report_lines(result))
    (out / "report.md").write_text(report)
    print(report)
    return out
