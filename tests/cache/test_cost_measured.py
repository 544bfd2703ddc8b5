"""The attention's cost is measured by the first long prefill (issue 30, blueprint 0016: "Do not
evict what fits; measure what staying costs"), on the generated tiny llama model at the
daemon's default layout (one unified window shared by four sequences).

Before, a prefill job was one sample of the cost fit, which needs 6: in ``bench/chat_agents.py``
the main agent's first warm turn came before the 6th, so it attended over the idle sub-agents'
cells. Each batch of a prefill is a sample now (the worker times them one by one), so one cold
prefill of a few thousand tokens measures the cost, and the very next turn decides with it.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from typing import Any

import pytest

from modeld.contract import Config, DecodeConfig, OpenSessionRequest, PrefixInput, SuffixInput
from modeld.engine import Engine

pytestmark = pytest.mark.llama

testmodels = pytest.importorskip("modeld.testmodels")
pytest.importorskip("modeld.backends.llama")


CONFIG = Config(num_ctx=8192, num_batch=512)
"""Batches of 512 tokens (llama.cpp's default, and the tiny model's before the 64 it now gets on
the CPU): in a batch of 64 the tiny model's attention over a few thousand cells is below the
noise of the batch's fixed cost (a whole-suite run fitted 0 per cell), so no idle context would
be dear enough to move, which is the decision these tests follow."""


def _workspace(agent: str) -> str:
    """About 3.3k tokens of one agent's own context: 7 prefill batches of 512."""
    return f"You are agent {agent}.\n" + "".join(
        f"def {agent}_step_{i}(state):\n    return state.advance({i})\n\n" for i in range(165)
    )


def test_one_cold_prefill_measures_the_attention_and_the_next_turn_decides_with_it(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """One cold prefill of ~3.3k tokens: the cost is known from it alone. Its session's turn
    ends; another session's turn starts, in a pool with room for both (8192 cells): the idle
    context leaves whole for the RAM tier, because its measured attention would cost that turn
    more than moving it out and back (the eviction's log says both), and its session's next
    turn reuses every token it had."""
    path = str(testmodels.ensure_model(testmodels.TINY))
    request = OpenSessionRequest(type="llama", path=path, config=CONFIG)
    with Engine(backends=("llama",)) as engine:
        a = engine.open_session(request)
        first = a.ensure_prefix(PrefixInput(text=_workspace("a")))
        assert first.prefix_tokens > 3072 and first.reused_tokens == 0
        costs = engine.models()[0].cache.costs
        assert costs.known(), (costs.prefill.samples, costs.prefill.spread())
        assert costs.prefill.per_cell() > 0.0, costs.summary()
        a.prefill_suffix(SuffixInput(text="go on\n"))
        list(a.decode(DecodeConfig(max_tokens=4, temperature=0.0)))  # its turn ends: idle
        held = a.explain_context().kv_tokens  # its prompt and what it decoded

        b = engine.open_session(request)
        with caplog.at_level(logging.INFO, logger="modeld.cache"):
            b.ensure_prefix(PrefixInput(text=_workspace("b")))
        report = a.explain_context()
        assert report.kv_tokens == 0, report
        assert [c.tier for c in report.contexts if c.tokens == held] == ["ram"], report.contexts
        said = [r.getMessage() for r in caplog.records if "of attention (measured)" in r.getMessage()]
        assert len(said) == 1 and f"({held} tokens)" in said[0], said

        again = a.ensure_prefix(PrefixInput(text=_workspace("a") + "go on\n"))
        assert again.reused_tokens >= first.prefix_tokens, again


def _inside_a_long_prefill(engine: Engine, a: Any, other: Callable[[], None]) -> None:
    """Run ``other`` while session ``a`` prefills ~6.6k tokens cold (from after that prefill
    began to before it ends: the worker interleaves jobs step by step)."""
    pool = engine.models()[0].cache.state.pool
    failed: list[BaseException] = []

    def long_prefill() -> None:
        try:
            a.ensure_prefix(PrefixInput(text=_workspace("a") + _workspace("c")))
        except BaseException as exc:
            failed.append(exc)

    worker = threading.Thread(target=long_prefill)
    worker.start()
    deadline = time.monotonic() + 60.0
    while not any(c.busy for c in pool.contexts.values()) and time.monotonic() < deadline:
        time.sleep(0.005)
    other()
    assert worker.is_alive(), "the long prefill ended before the other operation: the premise failed"
    worker.join()
    assert not failed, failed


def test_an_operation_that_begins_and_ends_inside_a_long_prefill_keeps_it_from_being_a_sample() -> None:
    """A cold prefill of ~6.6k tokens runs; another session's short prefix begins after it
    and ends before it, its one batch run between the long prefill's batches. Neither is a
    sample of the cost: the short one began with the long one busy, and the long one's batches
    took the short one's time too. Both ends of the long prefill saw nothing else busy; before
    the pool's tally of operations, its batches were taken as samples of the attention's cost
    alone."""
    path = str(testmodels.ensure_model(testmodels.TINY))
    request = OpenSessionRequest(type="llama", path=path, config=CONFIG)
    with Engine(backends=("llama",)) as engine:
        a = engine.open_session(request)
        b = engine.open_session(request)
        cache = engine.models()[0].cache
        tally = cache.state.pool.tally
        counted: list[int] = []

        def short_prefix() -> None:
            began = tally.operations
            b.ensure_prefix(PrefixInput(text="You are agent b.\n"))
            counted.append(tally.operations - began)

        _inside_a_long_prefill(engine, a, short_prefix)
        assert counted[0] > 0
        assert cache.costs.prefill.samples == 0, cache.costs.summary()
        assert not cache.costs.known()


def test_a_turn_with_nothing_to_compute_inside_a_long_prefill_keeps_it_from_being_a_sample() -> None:
    """As above, but the other session's turn sends the engine no KV call: its prompt is
    resident already (the same request again, after a turn that did not decode), so it goes
    straight to a decode, interleaved with the long prefill's batches. The turn's hold counts
    as an operation of its own."""
    path = str(testmodels.ensure_model(testmodels.TINY))
    request = OpenSessionRequest(type="llama", path=path, config=CONFIG)
    with Engine(backends=("llama",)) as engine:
        a = engine.open_session(request)
        b = engine.open_session(request)
        b.ensure_prefix(PrefixInput(text="You are agent b.\n"))
        b.prefill_suffix(SuffixInput(text="go on\n"))
        cache = engine.models()[0].cache
        samples = cache.costs.prefill.samples

        def repeat() -> None:
            assert b.ensure_prefix(PrefixInput(text="You are agent b.\n")).prefilled_tokens == 0
            b.prefill_suffix(SuffixInput(text="go on\n"))
            list(b.decode(DecodeConfig(max_tokens=2, temperature=0.0)))

        _inside_a_long_prefill(engine, a, repeat)
        assert cache.costs.prefill.samples == samples, cache.costs.summary()
