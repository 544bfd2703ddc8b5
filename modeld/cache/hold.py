"""The hold one operation of a turn takes on its session's warm context (:class:`Hold`), the
sequences a decode's further choices borrow (:class:`Forks`), and the wait on a sync job.

:meth:`~modeld.cache.warm.ModelCache.hold` chooses, places and makes room, then hands the
operation a :class:`Hold`: :meth:`Hold.sync` runs one sync job to the target (progress at most
every :data:`PROGRESS_INTERVAL` seconds, cancel at the deadline), :meth:`Hold.commit` marks the
prefix and writes it behind, :meth:`Hold.decoded` records a generate job, :meth:`Hold.fork` lends
sequences for ``n`` > 1, and leaving the ``with`` block releases it (a prefix or a suffix leaves
the context inside its turn until the decode ends: ``WarmContext.turn_until``). Split from
``warm.py``: the cache's choice and placement there, what an operation does with its
hold here; a hold reaches its cache only through the public state they share
(:class:`~modeld.cache.state.CacheState`). Design record: ``blueprints/0016-warm-state.md``.
"""

from __future__ import annotations

import contextlib
import functools
import logging
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from types import TracebackType

from modeld.backends.base import SyncStep
from modeld.cache import eviction
from modeld.cache.pool import TURN_SECONDS, WarmContext
from modeld.cache.reuse import Candidate, went_back
from modeld.cache.runtime import SyncEnd, SyncJob
from modeld.cache.state import CacheState
from modeld.contract import PrefillProgress, ProgressCallback, ReuseDecision
from modeld.errors import (
    BusyError,
    EngineRestartedError,
    ModeldError,
    OperationTimeoutError,
    StallTimeoutError,
)
from modeld.manifest import ContextManifest

__all__ = ["DECODE_CELLS", "PROGRESS_INTERVAL", "Forks", "Hold", "Synced", "segment_starts"]

log = logging.getLogger("modeld.cache")

PROGRESS_INTERVAL = 0.5
"""Seconds between two progress reports of a long prefill."""

DECODE_CELLS = 512
"""The KV cells a decode on a shared pool takes at a time (:meth:`Hold.grow`): it never reserves
``max_tokens`` up front (Claude Code asks for 32000), which moved every other idle context out
of a one-window pool at each decode and made concurrent turns wait for cells it never used."""

_DEAD = (EngineRestartedError, StallTimeoutError)
"""Errors after which the engine's state is gone (the supervisor resets the cache)."""


@dataclass(frozen=True, slots=True)
class Synced:
    """What :meth:`Hold.sync` did: ``evaluated`` tokens in ``ms`` milliseconds; ``complete``
    is False when the job was canceled before the target was resident (the caller says why)."""

    evaluated: int
    ms: float
    complete: bool = True


def segment_starts(manifest: ContextManifest, n: int) -> tuple[int, ...]:
    """Where the manifest's segments start among the first ``n`` tokens (its messages, over the
    chat APIs): memory that cannot be cut at any token begins batches and takes checkpoints
    there (blueprint 0016, "Checkpoints")."""
    return tuple(
        sorted(
            {s.token_start for s in manifest.segments if s.token_start is not None and 0 < s.token_start < n}
        )
    )


class Hold:
    """One operation's hold on its session's warm context (see the module docstring)."""

    def __init__(
        self,
        state: CacheState,
        context: WarmContext,
        target: list[int],
        stage: str,
        manifest: ContextManifest,
        *,
        ahead: bool = False,
    ) -> None:
        self._state = state
        self.context = context
        self.target = target
        self.stage = stage
        self._manifest = manifest
        self._turn = not ahead
        """Its prefix or suffix begins a turn whose decode comes next; not a prefill ahead of a
        turn (``ModelCache.hold(ahead=True)``), which no decode follows: its context is idle once
        released, as after a decode."""
        self.keep = 0
        """Tokens reused from the chosen candidate (the rest is evaluated by :meth:`sync`)."""
        self.decision = _PENDING
        self.restore_ms = 0.0
        self.tier = "kv"
        self.source: Candidate | None = None
        self.evaluated = 0
        """Tokens the engine evaluated for this hold (:meth:`sync`)."""
        self._job: SyncJob | None = None
        self._canceled = False
        self._released = False
        self._finish = ""
        self.grow_error: ModeldError | None = None
        """Why :meth:`grow` granted no cells."""
        self._decoding: tuple[float, int, int] | None = None
        """When the sync ended, the cells in use then and the pool's tally, while this hold ran
        alone: a decode that follows is a sample of the attention's cost (``cost.py``)."""

    @property
    def seq(self) -> int:
        return self.context.seq

    def sync(self, progress: ProgressCallback | None, deadline: float | None) -> Synced:
        """Bring the sequence to the target with one sync job, reporting ``progress`` at most
        every :data:`PROGRESS_INTERVAL` seconds; past ``deadline`` (monotonic) the job is
        canceled and ``timeout`` raised. A failed job empties the sequence (its content is
        unknown) and its error is raised."""
        target = self.target
        tokens = self.context.tokens
        if (
            self.keep >= len(target)
            and tokens[: len(target)] == target
            and (len(tokens) == len(target) or self.stage == "prefix")
        ):
            # Resident already. A prefix leaves whatever follows it in place until the next
            # operation: when that is a suffix the last turn already computed (the same request
            # again, a retry), it is reused instead of recomputed.
            self._synced(0, 0.0, alone=self._alone())
            return Synced(0, 0.0)
        keep = self.keep
        mark = self._operations()  # read first: whatever is sent after it is seen
        alone = self._alone()
        started = time.monotonic()
        reporter = _Progress(self.stage, started, progress)
        batches: list[tuple[int, int, float]] = []
        try:
            runtime = self._state.runtime()
            segments = segment_starts(self._manifest, len(target))
            for _attempt in range(2):
                job = runtime.sync(self.context.seq, keep, target[keep:], segments)
                mark += 1  # this job; any other operation from here on: not alone
                self._job = job
                if self._canceled:
                    job.cancel()
                end = _wait(job, reporter, deadline)
                with self._state.lock:
                    pool = self._state.pool
                    batches += reporter.batches(self._span)
                    pool.record_sync(self.context, end.kept, end.resident, target)
                    pool.counters["prefilled"] += max(0, end.resident - end.kept)
                if not end.canceled and end.kept < keep:  # the memory could not be cut there
                    keep = end.kept
                    if end.resident < len(target):
                        continue  # it stopped where it went back to: ask again from there
                break
        except OperationTimeoutError:
            raise
        except ModeldError as exc:
            self.fail(exc)
            raise
        finally:
            self._job = None
        complete = not end.canceled and end.resident >= len(target)
        if not complete and deadline is not None and time.monotonic() >= deadline:
            raise OperationTimeoutError(
                f"the {self.stage} prefill ran past the operation timeout (operation_seconds): it was "
                f"stopped after {end.resident} of {len(target)} tokens",
                timeout="operation_seconds",
            )
        if keep < self.keep and self.stage == "prefix":
            # The memory went back to a checkpoint before the divergence: say which.
            self.decision = went_back(self.decision, self.keep, keep, len(target))
        self.keep = keep  # what was really kept (less when the memory could not be cut)
        self.evaluated = len(target) - keep
        ms = (time.monotonic() - started) * 1000.0
        if batches and alone and self._alone(since=mark):
            # Each batch is a sample (``cost.py``): a long prefill alone measures the attention
            # over the spans it grew through, before any later turn has to decide with it.
            with self._state.lock:
                for n, span, batch_ms in batches:
                    self._state.pool.costs.prefilled(n, span, batch_ms)
                self._announce()
        self._synced(self.evaluated, ms, alone=alone)
        return Synced(self.evaluated, ms, complete)

    def _span(self, kept: int) -> int:
        """The pool's cells in use once this hold's sequence is cut to ``kept`` (the lock held)."""
        return self._state.pool.ledger.used(cut=(self.context.seq, kept))

    def _announce(self) -> None:
        """Log the measured costs once they are known (the lock held)."""
        pool = self._state.pool
        if pool.costs.newly_known():
            figures = ", ".join(f"{k} {v:.3g}" for k, v in pool.costs.summary().items())
            log.info("%s: the attention's cost is measured: %s", pool.name, figures)

    def _alone(self, since: int | None = None) -> bool:
        """No other operation runs on this model now (its jobs' steps would interleave with
        this one's, and their time would count as this one's), and none was sent to the runtime
        after the tally read ``since`` (one that began and ended in between)."""
        with self._state.lock:
            pool = self._state.pool
            if since is not None and pool.tally.operations != since:
                return False
            return not any(c.busy for c in pool.contexts.values() if c is not self.context)

    def _operations(self) -> int:
        """The pool's tally of operations sent to the runtime (``runtime.Tally``)."""
        with self._state.lock:
            return self._state.pool.tally.operations

    def _synced(self, evaluated: int, ms: float, *, alone: bool) -> None:
        """What a turn's suffix evaluates (the turn's work after its prefix), and where a decode
        that follows starts."""
        with self._state.lock:
            pool = self._state.pool
            if self.stage == "suffix":
                pool.costs.turn_prefill.add(float(evaluated))
            self._decoding = (time.monotonic(), pool.ledger.used(), pool.tally.operations) if alone else None

    def commit(self, *, prefix: int) -> None:
        """The target's first ``prefix`` tokens are the session's prefix now: others may copy
        them, a long one is written behind to the disk tier, and the model file is warm under
        this runtime (:class:`~modeld.cache.reuse.RuntimeHistory`)."""
        state = self._state
        with state.lock:
            self.context.prefix_tokens = prefix
            self.context.floor = 0
            # Counted here, once per prefix that is in place: what the metrics count from the
            # same PrefixStatus (``modeld_prefix_cache_queries`` / ``_hits{source}``).
            counters = state.pool.counters
            counters["queries"] += len(self.target)
            counters[f"reused_{self.tier}"] += self.keep
        state.saver.write_behind(self.context, self.evaluated, state.runtime())
        state.history.record(state.file_key, self._manifest)

    def ended(self, finish_reason: str) -> None:
        """How the decode of this hold ended (before :meth:`decoded`): what the context's next
        use will be (``eviction.score``, ``ModelCache.prefetch``)."""
        self._finish = finish_reason

    def decoded(self, sampled: Sequence[int], resident: int | None, error: ModeldError | None) -> None:
        """A generate job ended: ``sampled`` tokens, of which the sequence holds ``resident``
        in all (None: unknown after ``error``). Ends the hold."""
        try:
            if resident is not None:
                with self._state.lock:
                    pool = self._state.pool
                    pool.record_generate(self.context, sampled, resident)
                    if self._finish and pool.holds(self.context):
                        context = self.context
                        context.turns += 1
                        context.ended = self._finish
                        if context.owner is not None:
                            context.owner.ended, context.owner.ended_at = self._finish, time.time()
                    started = self._decoding
                    if error is None and started is not None and sampled and self._alone(since=started[2]):
                        ms = (time.monotonic() - started[0]) * 1000.0
                        pool.costs.decoded(len(sampled), started[1], ms)
                        self._announce()
            elif error is not None:
                self.fail(error)
        finally:
            self.release()

    def grower(self, end: int) -> Callable[[int], int]:
        """The decode's way to more cells (``DecodeRun.room``): :meth:`grow`, up to ``end`` tokens."""
        return functools.partial(self.grow, end=end)

    def grow(self, resident: int, end: int) -> int:
        """The decode of this hold filled the cells it took (its sequence holds ``resident``
        tokens, and may hold ``end`` at most): room for :data:`DECODE_CELLS` more, made as a
        turn's room is (idle contexts leave, whole), waiting as a turn waits for cells running
        operations hold (``--queue-wait``). Returns the cells granted, -1 when they are all it
        may still take (no limit any more); 0 when no wait helps (pinned contexts, or every
        operation holding cells waits to grow as this one does: the later one gives way) or the
        wait ran out, with the reason in :attr:`grow_error`."""
        state = self._state
        pool = state.pool
        dst = self.context
        rest = max(1, end - resident)
        cells = min(DECODE_CELLS, rest)
        wait = pool.settings.room_wait_seconds
        started = time.monotonic()
        runtime = state.runtime()
        with state.lock:
            state.growing.add(dst)
            try:
                while pool.holds(dst) and not state.closed:
                    held = pool.ledger.length(dst.seq)
                    more = max(0, resident - held) + cells
                    try:
                        eviction.make_room(pool, dst, held, more, runtime, in_line=False)
                    except eviction.NeedRoom as need:
                        others = [c for c in pool.contexts.values() if c.busy and c is not dst]
                        if not need.waitable or all(c in state.growing for c in others):
                            self.grow_error = BusyError(
                                f"the decode needs KV cells past {resident} tokens: {need.why}; every "
                                "operation holding them waits to grow too"
                                if need.waitable
                                else need.why,
                                needed_cells=need.needed,
                            )
                            return 0
                        left = started + wait - time.monotonic()
                        if left <= 0:
                            self.grow_error = BusyError(
                                f"the decode needs KV cells past {resident} tokens: {need.why}; waited "
                                f"{wait:.0f}s (--queue-wait) for them to free up",
                                needed_cells=need.needed,
                                wait_seconds=int(wait),
                            )
                            return 0
                        state.room.wait(min(left, 1.0))
                        continue
                    pool.reserved[dst.seq] = more
                    return cells if cells < rest else -1
                return 0
            finally:
                state.growing.discard(dst)

    def fork(self, count: int, cells: int) -> Forks | str:
        """Sequences for ``count`` more choices of a decode of this hold's target (resident: call
        after :meth:`sync`), each holding a copy of it (a unified pool shares the cells) and room
        for ``cells`` more tokens; or why not, as a sentence. Forks take free sequences and free
        cells, else they make room as a new session does (the least valuable idle contexts are
        evicted, saved to a tier first); when even that cannot make room (busy or pinned
        contexts, a pool too small for the choices' tokens) nothing is evicted and the choices
        are decoded one after another instead. Give them back with :meth:`Forks.release` when
        the decode ended."""
        state = self._state
        pool = state.pool
        layout = pool.layout
        own = self.context
        n = len(self.target)
        runtime = state.runtime()
        with state.lock:
            if not layout.forks:
                return "this backend decodes one choice at a time"
            if not pool.holds(own) or own.tokens != self.target:
                return "the prompt is not resident"
            free = pool.free_seqs()
            idle = [c for c in eviction.evictable(pool) if c is not own]
            if len(free) + len(idle) < count:
                return (
                    f"{count} more choices need {count} more KV sequences; of {layout.n_seq} "
                    f"(--sequences), {len(free)} are free and {len(idle)} hold idle contexts, the "
                    "others busy or pinned ones"
                )
            if layout.shared_cells and n + (count + 1) * cells > layout.pool_tokens:
                return (
                    f"{count + 1} choices of up to {cells} tokens after a {n}-token prompt need "
                    f"{n + (count + 1) * cells} KV cells; the pool has {layout.pool_tokens} "
                    "(--kv-pool-tokens, or a smaller max_tokens)"
                )
            taken: list[WarmContext] = []
            try:
                for _ in range(count):
                    free = pool.free_seqs()
                    if not free:
                        chosen = eviction.victim(pool, exclude={own})
                        assert chosen is not None  # counted above, under the lock
                        eviction.evict(
                            pool, chosen, runtime, "its sequence was needed by a choice of a decode"
                        )
                        free = [chosen.seq]
                    fork = WarmContext(id=f"{own.id}.fork", seq=free[0], identity="", tokens=[], busy=True)
                    pool.contexts[fork.seq] = fork
                    taken.append(fork)
                    runtime.copy(own.seq, fork.seq, n)
                    pool.ledger.copy(own.seq, fork.seq, n)
                if layout.shared_cells:
                    # Every choice's tokens (the first's too: not in the ledger yet).
                    eviction.make_room(pool, own, n, (count + 1) * cells, runtime)
                for fork in taken:
                    pool.ledger.extend(fork.seq, cells)  # its choice's tokens: reserved until released
            except eviction.NeedRoom as exc:
                Forks(state, taken).release()
                return exc.why
            except ModeldError:
                Forks(state, taken).release()
                raise
            return Forks(state, taken)

    def fail(self, error: ModeldError) -> None:
        """A job failed: what the sequence holds is unknown, so it is emptied (when the engine
        died, its restart empties everything anyway: nothing is sent to it)."""
        self._state.failed(self.context, error, engine_alive=not isinstance(error, _DEAD))

    def cancel(self) -> None:
        """Stop the running sync job before its next step (and any this hold starts later)."""
        self._canceled = True
        job = self._job
        if job is not None:
            job.cancel()

    def release(self) -> None:
        """End the hold: the context is idle again (idempotent)."""
        if self._released:
            return
        self._released = True
        with self._state.lock:
            now = time.time()
            context = self.context
            context.busy = context.ahead = False
            context.floor = 0
            if self._state.pool.holds(context):
                self._state.pool.reserved.pop(context.seq, None)
            context.last_used = now
            # A prefix or a suffix is the start of a turn whose decode comes next: the context
            # is not idle in between (another session's turn does not evict it, see leave_idle).
            turn = self._turn and self.stage in ("prefix", "suffix")
            context.turn_until = now + TURN_SECONDS if turn else 0.0
            owner = context.owner
            if owner is not None and self._state.pool.holds(context):
                # Shared, not copied (an 8k-token copy per operation of every turn): a context's
                # token list is replaced whenever it changes, never changed in place.
                owner.computed = context.tokens
        self._state.room_freed()

    def __enter__(self) -> Hold:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.release()


class Forks:
    """Sequences lent to one decode's further choices (:meth:`Hold.fork`). They are busy
    contexts of no identity: never chosen, copied, evicted or saved; their cells are reserved in
    the ledger until :meth:`release` frees them (the warm state is then what a one-choice decode
    leaves)."""

    def __init__(self, state: CacheState, contexts: list[WarmContext]) -> None:
        self._state = state
        self._contexts = contexts

    @property
    def seqs(self) -> tuple[int, ...]:
        return tuple(c.seq for c in self._contexts)

    def release(self) -> None:
        """Empty the forks and give their sequences back (idempotent)."""
        state = self._state
        contexts, self._contexts = self._contexts, []
        if not contexts:
            return
        with state.lock:
            pool = state.pool
            for fork in contexts:
                if not pool.holds(fork):
                    continue  # the engine was reset meanwhile
                with contextlib.suppress(ModeldError):
                    state.runtime().drop(fork.seq)
                pool.remove(fork)
        state.room_freed()


class _Progress:
    """Reports a long prefill at most every :data:`PROGRESS_INTERVAL` seconds, and keeps what
    each of its batches took (:meth:`batches`)."""

    def __init__(self, stage: str, started: float, callback: ProgressCallback | None) -> None:
        self.stage = stage
        self.started = started
        self.callback = callback
        self.last = started
        self._done = 0
        self._timed: list[tuple[int, int, int, float]] = []
        """Per timed batch of the job read now: what its sequence kept, the tokens the job had
        evaluated before it, its tokens, its seconds (``SyncStep.seconds``)."""

    def batches(self, used: Callable[[int], int]) -> list[tuple[int, int, float]]:
        """The job's timed batches as cost samples ``(tokens, span, ms)``, and forgets them:
        the span is the cells in use when the batch ran, ``used(kept)`` (the pool's cells once
        the sequence was cut to ``kept``) plus what the job had evaluated before it."""
        bases = {kept: used(kept) for kept in {t[0] for t in self._timed}}
        out = [(n, bases[kept] + before, seconds * 1000.0) for kept, before, n, seconds in self._timed]
        self._timed = []
        return out

    def __call__(self, step: SyncStep) -> None:
        if step.evaluated <= 0:
            self._done = 0  # a job's first step: the cut
        else:
            n = step.evaluated - self._done
            if n > 0 and step.seconds > 0.0:
                self._timed.append((step.kept, self._done, n, step.seconds))
            self._done = step.evaluated
        if self.callback is None:
            return
        now = time.monotonic()
        if now - self.last < PROGRESS_INTERVAL:
            return  # at most one report per interval (and none for a short prefill)
        self.last = now
        try:
            self.callback(
                PrefillProgress(self.stage, step.evaluated, step.total, (now - self.started) * 1000.0)
            )
        except Exception:
            log.exception("a progress callback failed")


def _wait(job: SyncJob, progress: _Progress, deadline: float | None) -> SyncEnd:
    """Read a sync job's replies to its end, cancelling it at ``deadline``."""
    while True:
        timeout = None if deadline is None else max(0.0, deadline - time.monotonic())
        event = job.next_event(timeout=timeout if timeout is None else max(timeout, 0.01))
        if event is None:
            job.cancel()
            deadline = None
            continue
        if isinstance(event, SyncStep):
            progress(event)
        else:
            return event


_PENDING = ReuseDecision(outcome="cold", reason="empty_cache", message="")
"""Placeholder until :meth:`ModelCache.hold` classifies the hold."""
