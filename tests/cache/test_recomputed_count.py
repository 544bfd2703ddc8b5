"""The daemon's count of tokens computed twice is right (issue 30): the bench reads ``recomputed``
(``modeld status``, ``modeld_recomputed_tokens_total``) around every turn as its "0 tokens
recomputed" figure, so the count itself is held here, on the real llama backend (the generated
tiny model) with two sessions that do not fit the pool together.

- Contexts that leave the pool and come back (the RAM tier), and a daemon restart (the disk tier),
  count 0: nothing was computed again.
- With both tiers off, a context that leaves is lost: the count is exactly the tokens its session
  computed again, the engine's own prefill of those turns.
"""

from __future__ import annotations

import tempfile
from pathlib import Path
from typing import Any

import pytest

pytestmark = [pytest.mark.llama]

WINDOW = 1024
"""One window for four sequences (the default layout): two ~600-token contexts do not fit."""


def _text(name: str) -> str:
    return f"Workspace {name}.\n" + "".join(
        f"def {name}_step_{i}(state):\n    return state + {i}\n\n" for i in range(40)
    )


def _engine(data_dir: Path, **residency: Any) -> Any:
    from modeld.engine import Engine
    from modeld.settings import Residency

    return Engine(backends=("llama",), data_dir=data_dir, residency=Residency(**residency))


def _session(engine: Any) -> Any:
    from modeld.contract import Config, OpenSessionRequest
    from modeld.testmodels import TINY, ensure_model

    return engine.open_session(
        OpenSessionRequest(type="llama", path=str(ensure_model(TINY)), config=Config(num_ctx=WINDOW))
    )


def _turn(session: Any, prefix: str, k: int) -> Any:
    """A turn: the same prefix, a new suffix, a short greedy decode; the prefix's status."""
    from modeld.contract import DecodeConfig, PrefixInput, SuffixInput

    status = session.ensure_prefix(PrefixInput(text=prefix))
    session.prefill_suffix(SuffixInput(text=f"turn {k}: go on\n"))
    list(session.decode(DecodeConfig(max_tokens=4, temperature=0.0)))
    return status


def _round_robin(engine: Any, rounds: int = 3) -> list[Any]:
    """Two sessions taking turns; the prefix statuses of every turn after each one's first."""
    a, b = _session(engine), _session(engine)
    warm = []
    for k in range(rounds):
        for session, name in ((a, "alpha"), (b, "beta")):
            status = _turn(session, _text(name), k)
            if k:
                warm.append(status)
    return warm


def test_contexts_that_leave_and_come_back_count_nothing_computed_again() -> None:
    with tempfile.TemporaryDirectory(prefix="mdrc") as tmp, _engine(Path(tmp)) as engine:
        warm = _round_robin(engine)
        counters = engine.status().models[0].counters
    assert counters["evicted_to_ram"] + counters["evicted_to_disk"] >= 2, counters  # they did leave
    assert all(s.prefilled_tokens == 0 and s.reused_tokens == s.prefix_tokens for s in warm), warm
    assert counters["recomputed"] == 0, counters


def test_a_restart_counts_nothing_computed_again() -> None:
    with tempfile.TemporaryDirectory(prefix="mdrc") as tmp:
        with _engine(Path(tmp)) as engine:
            first = _turn(_session(engine), _text("alpha"), 0)
        with _engine(Path(tmp)) as engine:  # an orderly stop wrote the context to disk
            again = _turn(_session(engine), _text("alpha"), 1)
            counters = engine.status().models[0].counters
    assert again.reuse.outcome == "warm" and again.reuse.reason == "restored_from_disk", again.reuse
    assert again.reused_tokens == first.prefix_tokens and again.prefilled_tokens == 0, again
    assert counters["recomputed"] == 0, counters


def test_contexts_lost_with_the_tiers_off_count_exactly_the_tokens_computed_again() -> None:
    """Both tiers off: a context that leaves the pool is dropped, and its session's next turn
    computes its prefix again, all but the BOS another context still holds. The count is those
    turns' prefill, token for token."""
    with (
        tempfile.TemporaryDirectory(prefix="mdrc") as tmp,
        _engine(Path(tmp), ram_tier_bytes=0, disk_tier_bytes=0) as engine,
    ):
        warm = _round_robin(engine)
        counters = engine.status().models[0].counters
    lost = [s.prefilled_tokens for s in warm]
    assert counters["evicted_dropped"] >= 2 and all(n > 500 for n in lost), (counters, lost)
    assert counters["recomputed"] == sum(lost), (counters, lost)
