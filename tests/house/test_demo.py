"""The demo (``make run``): its per-turn table says where each warm turn came from, and a long
prefill draws a progress bar from the daemon's progress reports."""

from __future__ import annotations

import io
import subprocess
import sys

import pytest

from modeld.contract import PrefillProgress
from modeld.demo import ProgressBar

pytestmark = pytest.mark.wire


def test_the_progress_bar_draws_each_report_as_a_line_into_a_pipe() -> None:
    out = io.StringIO()
    bar = ProgressBar(out, width=10)
    bar(PrefillProgress("prefix", 512, 2048, 1500.0))
    bar(PrefillProgress("prefix", 2048, 2048, 6000.0))
    bar.done()
    assert out.getvalue() == (
        "  prefix [##--------] 512/2048 tokens 1.5s\n  prefix [##########] 2048/2048 tokens 6.0s\n"
    )


def test_the_demo_runs_and_shows_where_each_turn_came_from() -> None:
    run = subprocess.run(
        [sys.executable, "-m", "modeld.demo", "--backend", "memory"],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert run.returncode == 0, run.stderr
    lines = run.stdout.splitlines()
    header = next(line for line in lines if line.startswith("turn "))
    assert header.split()[:5] == ["turn", "reuse", "from", "prefix", "reused"]
    rows = lines[lines.index(header) + 2 : lines.index(header) + 6]
    reuse = [(r[40:65].strip(), r[65:70].strip()) for r in rows]
    assert reuse == [
        ("cold (empty_cache)", "-"),
        ("warm (full_match)", "kv"),
        ("partial (diverged)", "kv"),
        ("warm (full_match)", "kv"),
    ]
    assert "demo: turn 1/4: cold: first turn" in lines
    assert "  last turn     warm: reused from the KV" in run.stdout  # explain-context at the end
