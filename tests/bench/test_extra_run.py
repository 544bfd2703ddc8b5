"""An extra run alone writes its run document and report through one helper (``bench/extra_run.py``):
``python -m bench.claude_code``, ``bench.chat_agents`` and ``bench.agent_apis`` (whose quick runs
go under ``bench/results/quick/runs/`` and whose document keeps the load average it began with)."""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Any

import pytest

from bench import extra_run


def lines(result: dict[str, Any]) -> list[str]:
    return ["# a run", f"turns {result['turns']}"]


def test_the_run_document_and_report_are_written_where_asked(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    started = time.time() - 2.0
    out = extra_run.write_extra_run(
        "agent_apis", ("tiny", "tiny.gguf"), started, {"turns": 3}, lines, tmp_path / "run"
    )
    assert out == tmp_path / "run"
    doc = json.loads((out / "run.json").read_text())
    assert list(doc) == ["id", "model", "load_average_end", "duration_s", "agent_apis"]
    assert doc["model"] == {"name": "tiny", "file": "tiny.gguf"} and doc["agent_apis"] == {"turns": 3}
    assert doc["duration_s"] >= 2.0
    assert (out / "report.md").read_text() == "# a run\nturns 3"
    assert "turns 3" in capsys.readouterr().out


def test_a_quick_run_goes_under_quick_and_keeps_the_load_it_began_with(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(extra_run, "ROOT", tmp_path)  # the repository's results stay untouched
    started = time.time()
    out = extra_run.write_extra_run(
        "agent_apis",
        ("tiny", "tiny.gguf"),
        started,
        {"turns": 1},
        lines,
        quick=True,
        load_start=(1.5, 1.0, 0.5),
    )
    doc = json.loads((out / "run.json").read_text())
    assert out == tmp_path / "bench" / "results" / "quick" / "runs" / f"{doc['id']}-agent_apis"
    assert list(doc)[:4] == ["id", "model", "load_average_start", "load_average_end"]
    assert doc["load_average_start"] == [1.5, 1.0, 0.5]
    full = extra_run.write_extra_run("chat_agents", ("tiny", "tiny.gguf"), started, {"turns": 1}, lines)
    assert full.parent == tmp_path / "bench" / "results" / "runs"
