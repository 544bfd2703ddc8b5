"""What a warm context costs where it is (``modeld/cache/cost.py``): the attention's cost per
resident cell, fitted from the engine's jobs, and the decision it drives (an idle context leaves
a unified pool only when its cells cost the running turn more than moving it out and back)."""

from __future__ import annotations

import random

import pytest

from modeld.cache.cost import MIN_SAMPLES, Costs, Fit


def _job(a: float, b: float, c_us: float, n: int, span: int) -> float:
    """A job's milliseconds: ``a`` per job, ``b`` per token, ``c_us`` microseconds per token
    and resident cell."""
    return a + b * n + c_us / 1000.0 * n * (span + n / 2)


def test_the_fit_recovers_the_attention_cost_from_noisy_jobs() -> None:
    """Prefill jobs of every size over spans of 0-6k cells, 10% noise: the fitted cost per cell
    is within 15% of the true one (1.9 us per token and cell, the realistic model's order)."""
    rng = random.Random(7)
    fit = Fit()
    for _ in range(60):
        n, span = rng.choice([1, 16, 64, 300, 2000]), rng.randint(0, 6000)
        fit.add(n, span, _job(3.0, 5.0, 1.9, n, span) * rng.uniform(0.9, 1.1))
    assert fit.known()
    assert fit.per_cell() * 1000.0 == pytest.approx(1.9, rel=0.15)


def test_a_fit_is_not_trusted_before_it_saw_enough_jobs_over_different_spans() -> None:
    same_span, few = Fit(), Fit()
    for i in range(20):
        same_span.add(64 + i, 1000, _job(1.0, 1.0, 5.0, 64 + i, 1000))
    for i in range(MIN_SAMPLES - 1):
        few.add(64, i * 1000, _job(1.0, 1.0, 5.0, 64, i * 1000))
    assert not same_span.known() and same_span.per_cell() == 0.0
    assert not few.known() and few.per_cell() == 0.0


def test_a_cost_is_never_negative() -> None:
    """Jobs that got faster as the span grew (the machine's load fell): no negative attention
    cost, which would keep every idle context forever for a wrong reason."""
    fit = Fit()
    for i in range(20):
        span = i * 400
        fit.add(32, span, 100.0 - span / 100.0)
    a, b, c = fit.coefficients()
    assert a >= 0 and b >= 0 and c >= 0


def _costs(per_cell_us: float) -> Costs:
    costs = Costs(bytes_per_token=12288)  # the realistic model's KV per token
    for i in range(40):
        span = (i % 8) * 800
        costs.prefilled(64, span, _job(2.0, 5.0, per_cell_us, 64, span))
        costs.decoded(32, span, _job(2.0, 18.0 * 32 / 32, per_cell_us / 2, 32, span))
        costs.turn_prefill.add(64.0)
    return costs


def test_an_idle_context_leaves_when_its_cells_cost_the_turn_more_than_moving_it() -> None:
    """2k idle cells against a turn of 64 prefilled and 32 decoded tokens: at 1.9 us per token
    and cell they cost the turn ~390 ms, moving 2k tokens of 12 KiB out and back (RAM) ~40 ms:
    it leaves; at 0.01 us they cost ~2 ms: it stays; already whole in a tier, only the restore
    counts; unmeasured, nothing leaves for its attention's sake."""
    expensive, cheap = _costs(1.9), _costs(0.01)
    assert expensive.stay_ms(2048, 0) > 300 > 50 > expensive.leave_ms(2048, "")
    assert expensive.worth_leaving(2048, 2048, "", prefill=0)
    assert not cheap.worth_leaving(2048, 2048, "", prefill=0)
    assert cheap.leave_ms(2048, "disk") < cheap.leave_ms(2048, "")
    assert not Costs(bytes_per_token=12288).worth_leaving(2048, 2048, "", prefill=0)


def test_the_prefills_measured_cost_decides_before_the_decodes_is_known() -> None:
    """An agent's decodes run after prompts of much the same length, so the decode's fit stays
    unknown for a while (its spans differ too little): the prefill's fit alone decides then, its
    decode term counted 0 (less than staying costs, never more). 2k idle cells against a turn of
    64 prefilled tokens at 1.9 us per token and cell: ~250 ms, more than moving them (~40 ms)."""
    costs = Costs(bytes_per_token=12288)
    for i in range(40):
        span = (i % 8) * 800
        costs.prefilled(64, span, _job(2.0, 5.0, 1.9, 64, span))
        costs.decoded(32, 4000, _job(2.0, 18.0, 0.9, 32, 4000))  # one span: no decode fit
        costs.turn_prefill.add(64.0)
    assert costs.prefill.known() and not costs.decode.known()
    assert costs.stay_ms(2048, 0) == pytest.approx(2048 * costs.prefill.per_cell() * 64)
    assert costs.worth_leaving(2048, 2048, "", prefill=0)
    assert costs.newly_known() and not costs.newly_known()  # the figures are logged once


def test_moving_costs_are_measured_once_moves_happened() -> None:
    costs = Costs(bytes_per_token=12288)
    prior = costs.move_ms("restore_ram", 1000)
    costs.moved("restore_ram", 1000, 50.0)
    assert prior != 50.0 and costs.move_ms("restore_ram", 2000) == pytest.approx(100.0)


def test_prefill_measured_alone_is_enough_when_turns_decode_nothing() -> None:
    """Turns that decode a token or none (a client timing its first token) never measure the
    decode: the prefill's fit alone decides, the decode counted as nothing. Before, both fits
    had to be known, so no idle context ever left such a pool (bench.hybrid: every earlier
    turn's context stayed, and each turn attended over all of them)."""
    expensive, cheap = Costs(bytes_per_token=256), Costs(bytes_per_token=256)
    for i in range(40):
        span = (i % 8) * 800
        expensive.prefilled(1300, span, _job(2.0, 0.03, 0.021, 1300, span))
        cheap.prefilled(1300, span, _job(2.0, 0.03, 0.0001, 1300, span))
        for costs in (expensive, cheap):
            costs.turn_prefill.add(60.0)
    assert not expensive.decode.known() and expensive.prefill.known()
    assert expensive.worth_leaving(1218, 2242, "", prefill=1311)
    assert not cheap.worth_leaving(1218, 2242, "", prefill=1311)


def _prefill(fit: Fit, tokens: int, rng: random.Random, slower: float = 1.0) -> None:
    """One prefill of ``tokens`` into an empty pool, a sample per batch of 512 (as the engine
    times them: ``SyncStep.seconds``), 5% noise, ``slower`` times the realistic model's costs."""
    done = 0
    while done < tokens:
        n = min(512, tokens - done)
        fit.add(n, done, _job(12.0, 0.12, 1.9, n, done) * slower * rng.uniform(0.95, 1.05))
        done += n


def test_one_long_prefills_batches_are_enough_for_a_fit() -> None:
    """A 3.5k-token cold prefill is 7 batches over spans 0-3k: the attention's cost is known
    from it alone, within 15%. Before, the whole prefill was one sample, and 6 were needed."""
    fit = Fit()
    _prefill(fit, 3500, random.Random(3))
    assert fit.samples == 7 and fit.known()
    assert fit.per_cell() * 1000.0 == pytest.approx(1.9, rel=0.15)


def test_a_batch_another_process_stalled_moves_a_known_fit_little() -> None:
    """The machine is shared: one batch five times slower than the fit predicts (another
    process had the cores) weighs less, so the fitted cost moves by under 10% (unweighted, it
    moved by about half). A lasting change (every batch twice as slow from now on) is followed:
    within 6 prefills the fit is within 15% of the new cost."""
    rng = random.Random(5)
    fit = Fit()
    for _ in range(5):
        _prefill(fit, 3500, rng)
    before = fit.per_cell()
    fit.add(512, 3000, 5 * _job(12.0, 0.12, 1.9, 512, 3000))
    assert fit.per_cell() == pytest.approx(before, rel=0.1)
    for _ in range(6):
        _prefill(fit, 3500, rng, slower=2.0)
    assert fit.per_cell() * 1000.0 == pytest.approx(3.8, rel=0.15)
