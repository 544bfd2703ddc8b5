"""What a warm context costs where it is, measured on the running engine.

Where a sequence's attention spans every used cell of a pool (llama.cpp's unified KV: it attends
up to the highest used cell, other sequences' cells masked), an idle context left resident makes
every token of the turn that runs slower; moved out, it costs a snapshot (nothing when a tier
holds all of it already) and a restore when its session comes back. :class:`Costs` learns both
from what the engine did, per loaded model, and :meth:`Costs.worth_leaving` compares them: an
idle context leaves the pool only when its cells measurably cost the running turn more than
taking it out and bringing it back. Until the engine has been measured over enough spans to tell
(:meth:`Fit.known`), nothing leaves for its attention's sake (it still leaves when the pool needs
its cells).

* **Attention**: every batch of a prefill and every decode (:meth:`Costs.prefilled`,
  :meth:`Costs.decoded`) is a sample of ``ms = overhead + dense x n + attention x pairs``, where
  ``pairs`` counts (token, cell) pairs the job attended over: ``n x (span + n / 2)`` for ``n``
  tokens evaluated after ``span`` cells in use. A least-squares fit with forgetting (:class:`Fit`,
  one for prefill batches and one for decode steps, whose kernels differ) gives ``attention``, the
  milliseconds one more resident cell adds per token evaluated. A prefill's batches are timed by
  the engine's thread, one by one (``SyncStep.seconds``): a long cold prefill alone spans 0 to
  its length, enough for a fit. Only operations that ran alone are samples (another job's cells
  would grow the span, and its decode steps count as this one's time). A sample far from a
  known fit weighs less (:data:`HUBER`: the machine is shared, and a batch another process
  stalled must not move the fit much).
* **Moving**: snapshots and restores (:meth:`Costs.moved`), milliseconds per token by tier, an
  average with forgetting.
* **A turn's work**: the tokens a turn evaluates after its prefix is in place (its suffix and its
  decode), an average with forgetting: what an idle context's cells will slow next.

Pure bookkeeping: no engine calls, no clock of its own (the callers time the jobs). Design
record: ``blueprints/0016-warm-state.md`` ("Where a context goes").
"""

from __future__ import annotations

from dataclasses import dataclass, field

__all__ = ["Costs", "Fit", "Mean"]

FORGET = 0.97
"""Each new sample weighs this much less than the one after it (about the last 30 count)."""

MIN_SAMPLES = 6
"""Samples a fit needs before it is trusted."""

MIN_SPREAD = 256.0
"""The spans a fit saw must differ by this many cells (a standard deviation) before it can tell
the attention's share from the rest of a job's time."""

HUBER = 3.0
"""Once a fit is known, a sample whose time is off its prediction by more than this many times
the usual relative error (:attr:`Fit.error`) weighs ``HUBER x usual / its error`` instead of 1
(Huber's weights): a batch stalled by another process on a shared machine moves the fit little,
while a lasting change (the machine got slower) raises the usual error with it and is followed
within a few dozen samples."""

MIN_ERROR = 0.05
"""The usual relative error is taken as at least this (timer and scheduling jitter), so that a
fit that happened to be exact does not discount every later sample."""


@dataclass
class Mean:
    """An average with forgetting."""

    _sum: float = 0.0
    _w: float = 0.0

    def add(self, value: float, weight: float = 1.0) -> None:
        self._sum = self._sum * FORGET + value * weight
        self._w = self._w * FORGET + weight

    def value(self, default: float = 0.0) -> float:
        return self._sum / self._w if self._w > 0 else default

    @property
    def seen(self) -> bool:
        return self._w > 0


@dataclass
class Fit:
    """``ms = a + b x n + c x pairs`` by weighted least squares with forgetting (three unknowns:
    a job's fixed overhead, the per-token cost that does not depend on the span, and the
    attention's cost per (token, cell) pair)."""

    _xx: list[list[float]] = field(default_factory=lambda: [[0.0] * 3 for _ in range(3)])
    _xy: list[float] = field(default_factory=lambda: [0.0] * 3)
    _w: float = 0.0
    _span: list[float] = field(default_factory=lambda: [0.0, 0.0])  # weighted sum, sum of squares
    samples: int = 0
    error: Mean = field(default_factory=Mean)
    """The relative error of the samples against the known fit before each came (``|ms -
    predicted| / predicted``, an average with forgetting): what :data:`HUBER` counts in."""
    _solved: tuple[float, float, float] | None = None

    def add(self, n: int, span: int, ms: float) -> None:
        """A job evaluated ``n`` tokens after ``span`` cells in use, in ``ms`` milliseconds."""
        if n <= 0 or ms <= 0.0:
            return
        pairs = n * (span + n / 2.0)
        x = (1.0, float(n), pairs / 1000.0)  # pairs in thousands: a better conditioned system
        weight = self._weight(x, ms)
        for i in range(3):
            for j in range(3):
                self._xx[i][j] = self._xx[i][j] * FORGET + weight * x[i] * x[j]
            self._xy[i] = self._xy[i] * FORGET + weight * x[i] * ms
        self._w = self._w * FORGET + weight
        mid = span + n / 2.0
        self._span = [self._span[0] * FORGET + weight * mid, self._span[1] * FORGET + weight * mid * mid]
        self.samples += 1
        self._solved = None

    def _weight(self, x: tuple[float, float, float], ms: float) -> float:
        """1, or less for a sample far from the known fit (:data:`HUBER`); the sample's
        relative error joins the usual one."""
        if not self.known():
            return 1.0
        predicted = sum(k * v for k, v in zip(self.coefficients(), x, strict=True))
        if predicted <= 0.0:
            return 1.0
        off = abs(ms - predicted) / predicted
        limit = HUBER * max(MIN_ERROR, self.error.value(off))
        self.error.add(off)
        return 1.0 if off <= limit else limit / off

    def spread(self) -> float:
        """The standard deviation of the spans sampled (cells)."""
        if self._w <= 0:
            return 0.0
        mean = self._span[0] / self._w
        return float(max(0.0, self._span[1] / self._w - mean * mean) ** 0.5)

    def known(self) -> bool:
        """Enough samples over spans different enough to tell the attention's share."""
        return self.samples >= MIN_SAMPLES and self.spread() >= MIN_SPREAD

    def coefficients(self) -> tuple[float, float, float]:
        """``(a, b, c)``: ms per job, ms per token, ms per (token, cell) pair (never negative)."""
        if self._solved is None:
            self._solved = _solve(self._xx, self._xy)
        return self._solved

    def per_cell(self) -> float:
        """Milliseconds one more resident cell adds to each token evaluated (0 until known)."""
        return self.coefficients()[2] / 1000.0 if self.known() else 0.0


def _solve(xx: list[list[float]], xy: list[float]) -> tuple[float, float, float]:
    """The normal equations by Gaussian elimination, with a small ridge; negative terms are
    dropped and the rest solved again (a cost is never negative)."""
    active = [0, 1, 2]
    while active:
        k = len(active)
        m = [[xx[i][j] for j in active] + [xy[i]] for i in active]
        for i in range(k):
            m[i][i] += 1e-9 * (1.0 + abs(m[i][i]))
        ok = True
        for col in range(k):
            pivot = max(range(col, k), key=lambda r: abs(m[r][col]))
            if abs(m[pivot][col]) < 1e-12:
                ok = False
                break
            m[col], m[pivot] = m[pivot], m[col]
            for r in range(k):
                if r != col:
                    f = m[r][col] / m[col][col]
                    for c in range(col, k + 1):
                        m[r][c] -= f * m[col][c]
        if not ok:
            active.pop()
            continue
        values = {active[i]: m[i][k] / m[i][i] for i in range(k)}
        negative = [i for i in active if values[i] < 0]
        if not negative:
            return (values.get(0, 0.0), values.get(1, 0.0), values.get(2, 0.0))
        active.remove(negative[-1])
    return (0.0, 0.0, 0.0)


PRIOR_MS_PER_MIB = {"save_ram": 1.0, "save_disk": 1.2, "restore_ram": 0.6, "restore_disk": 1.5}
"""Moving costs before one was measured here, from the bytes moved (blueprint 0016: a 33 MB blob
taken in 10-22 ms and restored in 13-17 ms through the worker; an 8.5k-token, 99.7 MiB context
written by llama.cpp in 70-107 ms and read back in 62-169 ms), plus :data:`PRIOR_FIXED_MS`."""

PRIOR_FIXED_MS = 2.0
"""A move's round trip to the worker, before one was measured."""


@dataclass
class Costs:
    """The measured costs of one loaded model's warm contexts (see the module docstring)."""

    bytes_per_token: int = 0
    """The KV's bytes per token (the moving costs' prior scales with it)."""
    prefill: Fit = field(default_factory=Fit)
    decode: Fit = field(default_factory=Fit)
    move: dict[str, Mean] = field(default_factory=dict)
    """Milliseconds per token to snapshot a context (``save_ram``, ``save_disk``) or restore it
    (``restore_ram``, ``restore_disk``)."""
    turn_prefill: Mean = field(default_factory=Mean)
    """Tokens a turn evaluates after its prefix (its suffix, and what it recomputes)."""
    turn_decode: Mean = field(default_factory=Mean)
    """Tokens a turn decodes."""
    announced: bool = False
    """The figures were logged once they became known (:meth:`newly_known`)."""

    def newly_known(self) -> bool:
        """True once, when the attention's cost has just become known (to log the figures)."""
        if self.announced or not self.known():
            return False
        self.announced = True
        return True

    def prefilled(self, n: int, span: int, ms: float) -> None:
        """One batch of a prefill: ``n`` tokens evaluated after ``span`` cells, in ``ms``."""
        self.prefill.add(n, span, ms)

    def decoded(self, n: int, span: int, ms: float) -> None:
        self.decode.add(n, span, ms)
        self.turn_decode.add(float(n))

    def moved(self, kind: str, tokens: int, ms: float) -> None:
        """A snapshot (``save_ram``, ``save_disk``) or restore (``restore_<tier>``) of ``tokens``."""
        if tokens > 0 and ms >= 0.0:
            self.move.setdefault(kind, Mean()).add(ms / tokens, float(tokens))

    def move_ms(self, kind: str, tokens: int) -> float:
        """Milliseconds to move ``tokens`` (``kind`` as :meth:`moved`): measured, or the prior."""
        mean = self.move.get(kind)
        if mean is not None and mean.seen:
            return mean.value() * tokens
        return PRIOR_FIXED_MS + PRIOR_MS_PER_MIB[kind] * tokens * self.bytes_per_token / (1 << 20)

    def known(self) -> bool:
        """The attention's cost has been measured, in prefill or in decode: either fit is
        enough. An unmeasured one counts 0 (:meth:`Fit.per_cell`), so staying is underestimated,
        never overestimated. Requiring both kept idle contexts resident: a decode's fit comes
        late (an agent decodes after prompts of much the same length) or never (turns that
        decode a token or none: a client timing its first token, a benchmark), so each turn
        attended over every earlier turn's context (``bench/chat_agents.py``, ``bench.hybrid``:
        warm TTFT 1.1-2.4x llama-server's, growing; blueprint 0016)."""
        return self.prefill.known() or self.decode.known()

    def stay_ms(self, cells: int, prefill: int, *, suffix_known: bool = False) -> float:
        """What ``cells`` more resident cells would cost the turn that starts: it prefills
        ``prefill`` tokens now, then (measured over the last turns) a suffix, unless
        ``suffix_known`` (``prefill`` is the suffix), and a decode."""
        suffix = 0.0 if suffix_known else self.turn_prefill.value()
        decode = self.turn_decode.value()
        return cells * (self.prefill.per_cell() * (prefill + suffix) + self.decode.per_cell() * decode)

    def leave_ms(self, tokens: int, saved: str, returning: float = 1.0) -> float:
        """What moving a context of ``tokens`` out and back costs: its snapshot into RAM (none
        when a tier holds all of it: ``saved`` names that tier) and its restore from there,
        weighed by how likely it is to come back (``returning``: 1 for an open session's, less
        for a detached context's)."""
        if saved:
            return returning * self.move_ms(f"restore_{saved}", tokens)
        return self.move_ms("save_ram", tokens) + returning * self.move_ms("restore_ram", tokens)

    def worth_leaving(
        self,
        cells: int,
        tokens: int,
        saved: str,
        prefill: int,
        returning: float = 1.0,
        *,
        suffix_known: bool = False,
    ) -> bool:
        """An idle context holding ``cells`` cells only it holds (``tokens`` in all) leaves the
        pool: its cells cost the turn that starts more than moving it out and back (``saved``:
        the tier that holds all of it already, or ""; ``returning`` as :meth:`leave_ms`)."""
        if cells <= 0 or not self.known():
            return False
        return self.stay_ms(cells, prefill, suffix_known=suffix_known) > self.leave_ms(
            tokens, saved, returning
        )

    def summary(self) -> dict[str, float]:
        """The figures, for people (``modeld status``'s log line, the blueprint's tables)."""
        out = {
            "prefill_us_per_cell_token": self.prefill.per_cell() * 1000.0,
            "decode_us_per_cell_token": self.decode.per_cell() * 1000.0,
            "turn_prefill_tokens": self.turn_prefill.value(),
            "turn_decode_tokens": self.turn_decode.value(),
        }
        for kind, mean in sorted(self.move.items()):
            out[f"{kind}_us_per_token"] = mean.value() * 1000.0
        return out
