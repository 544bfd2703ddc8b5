"""A prefix computed ahead of a turn (``PrefixInput.ahead``: the HTTP layer's prefill of the
next turn's prefix while the user reads, blueprint 0010) on the engine: it begins no turn, so
its context is idle once it is in place, and another session's turn takes its cells at once
instead of waiting for a decode that never comes; the session's report keeps its last turn's
reuse and shows the prefix ahead beside it."""

from __future__ import annotations

from pathlib import Path

import pytest

from modeld.contract import Config, DecodeConfig, OpenSessionRequest, PrefixInput, SuffixInput
from modeld.engine import Engine
from modeld.errors import BusyError
from modeld.settings import Limits

A = "a" * 50 + "\n"  # with BOS and the turn: ~60 of the pool's 600 cells
B = "b" * 560 + "\n"  # then needs ~565: a's cells too
REQUEST = OpenSessionRequest(path="repo", model_name="coder", config=Config(num_ctx=600))


def _engine(tmp_path: Path) -> Engine:
    # One pool of 600 cells (4 sequences); a turn waits 1 s for cells, then is refused busy.
    return Engine(backends=("memory",), data_dir=tmp_path, limits=Limits(model_wait_seconds=1.0))


def test_a_prefix_ahead_leaves_its_cells_to_the_next_turn_at_once(tmp_path: Path) -> None:
    with _engine(tmp_path) as engine:
        a, b = engine.open_session(REQUEST), engine.open_session(REQUEST)
        a.ensure_prefix(PrefixInput(text=A))
        a.prefill_suffix(SuffixInput(text="q1\n"))
        with a.decode(DecodeConfig(max_tokens=4)) as stream:
            list(stream)
        turn = a.explain_context().last_prefix
        ahead = a.ensure_prefix(PrefixInput(text=A + "q1\nanswer\n", ahead=True))
        # b's turn needs a's cells: they are no turn's, so a's context goes to a tier at once.
        b.ensure_prefix(PrefixInput(text=B))
        report = a.explain_context()
        assert report.last_prefix == turn and report.ahead == ahead
        assert ahead.reused_tokens > 0 and ahead.prefilled_tokens > 0
        a.close()
        b.close()


def test_a_turns_prefix_keeps_its_cells_until_its_decode(tmp_path: Path) -> None:
    """The control: a turn's prefix, its decode still to come, is not taken by a later turn (which
    waits for it, here past its 1 s)."""
    with _engine(tmp_path) as engine:
        a, b = engine.open_session(REQUEST), engine.open_session(REQUEST)
        a.ensure_prefix(PrefixInput(text=A))
        with pytest.raises(BusyError, match="waited"):
            b.ensure_prefix(PrefixInput(text=B))
        a.close()
        b.close()
