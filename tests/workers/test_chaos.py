"""The chaos run in CI (issue 21 item 6): ``tests/helpers/chaos.py`` for 45 seconds of clients and faults.

Two tool-loop agents and an OpenAI SDK conversation on the tiny model while a real daemon's
workers are SIGKILLed and SIGSTOPped past the stall timeout, the daemon is SIGKILLed and started
again, the model file is rewritten in place and a snapshot file corrupted. Every turn completes
or fails with a typed retryable error; every completed greedy turn equals a fresh evaluation of
the file in force (or, for a turn whose prompt holds earlier output, the uninterrupted replay of
its task); no orphan processes, no half-written files, flat fds and memory at the end. The run
prints its tally (``pytest -s``); ``make chaos`` runs it for 30 minutes.
"""

from __future__ import annotations

from pathlib import Path

import pytest

pytestmark = [pytest.mark.wire, pytest.mark.llama, pytest.mark.slow]

pytest.importorskip("openai")
pytest.importorskip("modeld.testmodels")


@pytest.mark.timeout(600)  # ~2 minutes on an idle 2-core box (45 s of chaos, then the references)
def test_every_turn_completes_or_fails_typed_and_equals_a_fresh_evaluation(tmp_path: Path) -> None:
    from chaos import FAULTS, run

    tally = run(45.0, seed=21, work=tmp_path)  # raises with the tally when anything did not hold
    assert all(tally.faults[kind] >= 1 for kind in FAULTS), tally.faults
    assert tally.completed > 0 and not tally.violations
    assert sum(tally.retried.values()) > 0  # the faults reached the clients
