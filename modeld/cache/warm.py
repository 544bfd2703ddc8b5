"""The one owner of "what is warm where" for a loaded model, and the hold a turn takes on it.

:class:`ModelCache` knows, for one loaded runtime, every warm context in its KV pool
(``pool.py``) and reaches the daemon-wide RAM and disk tiers (``tiers.py``) for the model's
snapshots. Nothing else in modeld keeps a copy of that knowledge; sessions ask it.

A session's operation (``ensure_prefix``, ``prefill_suffix``, ``decode``) does all its KV work
through one :class:`Hold`::

    with cache.hold(slot, target, stage="prefix", manifest=m) as h:
        h.sync(progress, deadline)   # one sync job brings the sequence to the target
        h.commit(prefix=len(target))  # the target is the session's prefix now

1. **Choose** what to reuse (``choice.py``: the longest common token prefix among the session's
   own context, the pool's other contexts and the tier snapshots).
2. **Place**: the session keeps its own sequence (its operations never run on a sequence another
   session is using). Another session's prefix is copied into it (with llama.cpp's unified KV
   that only tags cells: the prefix is stored once); a detached context (its session closed) is
   adopted as is; a snapshot is restored into it.
3. **Make room** (``eviction.py``): a free sequence, and free cells for the new tokens, by
   evicting the least valuable contexts, their prefixes saved to a tier first.
4. **Classify** (``reuse.py``): why the turn is warm, partial or cold, for people.

The hold marks the context busy; its ``floor`` is how many tokens the running operation will not
touch, which other sessions may copy meanwhile. :meth:`Hold.sync` records what the engine
reports after each job (the truth after a cancel or a failure), :meth:`Hold.commit` marks the
prefix and writes it behind to the disk tier, :meth:`Hold.decoded` records a generate job, and
leaving the ``with`` block (or :meth:`Hold.release`) ends the hold. Design record:
``blueprints/0016-warm-state.md``.
"""

from __future__ import annotations

import contextlib
import logging
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from types import TracebackType

from modeld.backends.base import Layout, SyncStep
from modeld.cache import eviction
from modeld.cache.choice import Choice, choose
from modeld.cache.pool import TURN_SECONDS, CacheSettings, Pool, SessionSlot, WarmContext
from modeld.cache.reuse import Candidate, Loss, RuntimeHistory, classify
from modeld.cache.runtime import KVRuntime, SyncEnd, SyncJob
from modeld.cache.snapfile import SnapshotError
from modeld.cache.tiers import TierEntry, Tiers
from modeld.contract import PrefillProgress, ProgressCallback, ReuseDecision, WarmContextInfo
from modeld.errors import (
    BusyError,
    EngineRestartedError,
    ModeldError,
    OperationTimeoutError,
    StallTimeoutError,
    echo,
)
from modeld.manifest import ContextManifest

__all__ = ["PROGRESS_INTERVAL", "Forks", "Hold", "ModelCache", "Synced"]

log = logging.getLogger("modeld.cache")

PROGRESS_INTERVAL = 0.5
"""Seconds between two progress reports of a long prefill."""

_IDLE = (
    "it was idle while another session's turn ran, and a unified pool's attention spans every used "
    "cell; its prefix is on disk"
)
"""Why :func:`eviction.leave_idle` moved a context out of the pool (its next turn restores it)."""

_DEAD = (EngineRestartedError, StallTimeoutError)
"""Errors after which the engine's state is gone (the supervisor resets the cache)."""


@dataclass(frozen=True, slots=True)
class Synced:
    """What :meth:`Hold.sync` did: ``evaluated`` tokens in ``ms`` milliseconds; ``complete``
    is False when the job was canceled before the target was resident (the caller says why)."""

    evaluated: int
    ms: float
    complete: bool = True


class Hold:
    """One operation's hold on its session's warm context (see the module docstring)."""

    def __init__(
        self,
        cache: ModelCache,
        context: WarmContext,
        target: list[int],
        stage: str,
        manifest: ContextManifest,
    ) -> None:
        self._cache = cache
        self.context = context
        self.target = target
        self.stage = stage
        self._manifest = manifest
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
            return Synced(0, 0.0)
        keep = self.keep
        started = time.monotonic()
        reporter = _Progress(self.stage, started, progress)
        try:
            runtime = self._cache.runtime()
            for _attempt in range(2):
                job = runtime.sync(self.context.seq, keep, target[keep:])
                self._job = job
                if self._canceled:
                    job.cancel()
                end = _wait(job, reporter, deadline)
                with self._cache._lock:
                    pool = self._cache._pool
                    pool.record_sync(self.context, end.kept, end.resident, target)
                    pool.counters["prefilled"] += max(0, end.resident - end.kept)
                if not end.canceled and end.kept < keep:  # the memory could not be cut there
                    keep = end.kept
                    continue
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
        self.keep = keep  # what was really kept (less when the memory could not be cut)
        self.evaluated = len(target) - keep
        return Synced(self.evaluated, (time.monotonic() - started) * 1000.0, complete)

    def commit(self, *, prefix: int) -> None:
        """The target's first ``prefix`` tokens are the session's prefix now: others may copy
        them, a long one is written behind to the disk tier, and the model file is warm under
        this runtime (:class:`~modeld.cache.reuse.RuntimeHistory`)."""
        cache = self._cache
        with cache._lock:
            self.context.prefix_tokens = prefix
            self.context.floor = 0
            # Counted here, once per prefix that is in place: what the metrics count from the
            # same PrefixStatus (``modeld_prefix_cache_queries`` / ``_hits{source}``).
            counters = cache._pool.counters
            counters["queries"] += len(self.target)
            counters[f"reused_{self.tier}"] += self.keep
        cache._saver.write_behind(self.context, self.evaluated, cache.runtime())
        cache._history.record(cache._file_key, self._manifest)

    def decoded(self, sampled: Sequence[int], resident: int | None, error: ModeldError | None) -> None:
        """A generate job ended: ``sampled`` tokens, of which the sequence holds ``resident``
        in all (None: unknown after ``error``). Ends the hold."""
        try:
            if resident is not None:
                with self._cache._lock:
                    self._cache._pool.record_generate(self.context, sampled, resident)
            elif error is not None:
                self.fail(error)
        finally:
            self.release()

    def fork(self, count: int, cells: int) -> Forks | str:
        """Sequences for ``count`` more choices of a decode of this hold's target (resident: call
        after :meth:`sync`), each holding a copy of it (a unified pool shares the cells) and room
        for ``cells`` more tokens; or why not, as a sentence. Forks take free sequences and free
        cells, else they make room as a new session does (the least valuable idle contexts are
        evicted, saved to a tier first); when even that cannot make room (busy or pinned
        contexts, a pool too small for the choices' tokens) nothing is evicted and the choices
        are decoded one after another instead. Give them back with :meth:`Forks.release` when
        the decode ended."""
        cache = self._cache
        pool = cache._pool
        layout = pool.layout
        own = self.context
        n = len(self.target)
        runtime = cache.runtime()
        with cache._lock:
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
            except BusyError as exc:
                Forks(cache, taken).release()
                return exc.message
            except ModeldError:
                Forks(cache, taken).release()
                raise
            return Forks(cache, taken)

    def fail(self, error: ModeldError) -> None:
        """A job failed: what the sequence holds is unknown, so it is emptied (when the engine
        died, its restart empties everything anyway: nothing is sent to it)."""
        self._cache._failed(self.context, error, engine_alive=not isinstance(error, _DEAD))

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
        with self._cache._lock:
            now = time.time()
            context = self.context
            context.busy = False
            context.floor = 0
            context.last_used = now
            # A prefix or a suffix is the start of a turn whose decode comes next: the context
            # is not idle in between (another session's turn does not evict it, see leave_idle).
            context.turn_until = now + TURN_SECONDS if self.stage in ("prefix", "suffix") else 0.0

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

    def __init__(self, cache: ModelCache, contexts: list[WarmContext]) -> None:
        self._cache = cache
        self._contexts = contexts

    @property
    def seqs(self) -> tuple[int, ...]:
        return tuple(c.seq for c in self._contexts)

    def release(self) -> None:
        """Empty the forks and give their sequences back (idempotent)."""
        cache = self._cache
        contexts, self._contexts = self._contexts, []
        if not contexts:
            return
        with cache._lock:
            pool = cache._pool
            for fork in contexts:
                if not pool.holds(fork):
                    continue  # the engine was reset meanwhile
                with contextlib.suppress(ModeldError):
                    cache.runtime().drop(fork.seq)
                pool.remove(fork)


class ModelCache:
    """Warm contexts of one loaded runtime (see the module docstring). Thread-safe."""

    def __init__(
        self,
        *,
        name: str,
        model_digest: str,
        layout: Layout,
        runtime: Callable[[], KVRuntime],
        tiers: Tiers | None,
        settings: CacheSettings | None = None,
        file_key: tuple[str, str] = ("", ""),
        history: RuntimeHistory | None = None,
    ) -> None:
        self.runtime = runtime
        """The live runtime (waits while its worker restarts; raises when it cannot)."""
        self._pool = Pool(
            name=name,
            model_digest=model_digest,
            layout=layout,
            tiers=tiers,
            settings=settings or CacheSettings(),
        )
        self._file_key = file_key
        self._history = history or RuntimeHistory()
        self._lock = threading.RLock()
        self._saver = eviction.WriteBehind(self._pool, self._lock)

    @property
    def counters(self) -> dict[str, int]:
        return self._pool.counters

    # --- sessions -------------------------------------------------------------------------------

    def slot(
        self, session_id: str, identity: str, *, pinned: bool = False, keep_alive: float | None = None
    ) -> SessionSlot:
        with self._lock:
            slots = self._pool.slots
            slot = slots.get(session_id)
            if slot is None:
                slot = slots[session_id] = SessionSlot(session_id, identity, pinned, keep_alive)
                self._pool.identities.add(identity)
            return slot

    def forget_session(self, slot: SessionSlot) -> None:
        """The session closed: its context stays warm, detached, for whoever needs it next."""
        with self._lock:
            if slot.context is not None and slot.context.owner is slot:
                slot.context.owner = None
            slot.context = None
            self._pool.slots.pop(slot.session_id, None)

    # --- a turn's hold --------------------------------------------------------------------------

    def hold(
        self,
        slot: SessionSlot,
        target: list[int],
        *,
        stage: str,
        manifest: ContextManifest,
        floor: int = 0,
        extra_cells: int = 0,
        head: int = 0,
    ) -> Hold:
        """Choose, place and make room for ``target`` (see the module docstring).

        ``stage`` (prefix, suffix, decode) names the operation in progress and timeouts;
        ``floor`` is how many leading tokens it will not change once they are in place (others
        may copy them meanwhile); ``extra_cells`` the room needed beyond ``target`` (tokens a
        decode may generate); ``head`` how many of ``target``'s first tokens any prefix of its
        format starts with (the chat template's head, BOS): reusing no more is a cold turn."""
        runtime = self.runtime()
        changed = self._history.changed(self._file_key, manifest)
        self._saver.settle()  # a choice must see every tier entry
        pool = self._pool
        with self._lock:
            choice = self._choose(slot, target, head, remote=stage == "prefix")
            try:
                dst = self._place(slot, choice, runtime, head)
            except eviction.NoRoom:
                # The only sequence that could be freed holds the best candidate: copying from
                # it is impossible, so it is saved and freed, and this turn starts from nothing
                # (or from its snapshot, found by choosing again).
                assert choice.context is not None
                eviction.evict(pool, choice.context, runtime, "its sequence was needed by another session")
                choice = self._choose(slot, target, head, remote=stage == "prefix")
                dst = self._place(slot, choice, runtime, head)
            if choice.context is not None and pool.contexts.get(choice.context.seq) is not choice.context:
                # The source shared only the format's head and was the least valuable context:
                # it went to a tier; the head comes from another context, or is computed.
                choice = self._choose(slot, target, head, remote=stage == "prefix")
            hold = Hold(self, dst, target, stage, manifest)
            if stage == "prefix":
                # Before the fill, so a restore lands in the cells they free (low in the pool).
                eviction.leave_idle(
                    pool, runtime, {dst, *([choice.context] if choice.context else [])}, _IDLE
                )
            self._fill(slot, hold, choice, runtime, head)
            if stage == "prefix" and choice.context is not None and choice.context is not dst:
                eviction.leave_idle(pool, runtime, {dst}, _IDLE)  # the copy's source, idle too
            # The cells of dst past what is kept are cut by this turn: they count as room (the
            # 8k coding loop's third turn, and a session editing the middle of a prefix longer
            # than half the pool, used to be busy).
            eviction.make_room(pool, dst, hold.keep, len(target) - hold.keep + extra_cells, runtime)
            dst.busy = True
            dst.floor = max(0, min(floor, hold.keep - 2))
            cold = hold.keep == 0 or (hold.keep <= head and hold.keep < len(target))
            if cold and stage == "prefix" and slot.loss is None and pool.tiers is not None:
                # A snapshot file refused when the disk tier was indexed would have served this
                # cold turn: say so, as for one refused when it was tried.
                refused = pool.tiers.claim_refused(
                    pool.model_digest,
                    slot.identity,
                    pool.layout.snapshot_format,
                    target,
                    pool.settings.restore_min_gain,
                )
                if refused is not None:
                    pool.counters["snapshots_rejected"] += 1
                    slot.loss = Loss("snapshot_rejected", f"{refused.reason}; at the daemon's start")
            hold.decision = classify(
                wanted=len(target),
                keep=hold.keep,
                candidate=hold.source if (hold.keep > 0 or choice.seen) else None,
                manifest=manifest,
                loss=slot.loss if cold else None,
                changed=changed if hold.keep == 0 and not choice.seen else None,
                truncation_blocked=choice.blocked and hold.keep == 0,
                model_file=echo(self._file_key[1], 200) if self._file_key[1] else "",
                head=head,
            )
            slot.loss = None
            return hold

    def _choose(self, slot: SessionSlot, target: list[int], head: int, *, remote: bool = False) -> Choice:
        """The choice among the KV and the local tiers; a prefix they do not cover whole is
        looked up in the remote tier too (``remote``: the shared store, blueprint 0020), whose
        snapshots come after the local ones (the local one wins at equal length)."""
        pool = self._pool
        own = pool.own(slot)
        tiers = pool.tiers
        fmt = pool.layout.snapshot_format
        entries = tiers.candidates(pool.model_digest, slot.identity, fmt) if tiers is not None else []

        def pick(candidates: list[TierEntry]) -> Choice:
            return choose(
                target,
                own=own,
                untouched=own is not None and own.generation == slot.seen_generation,
                others=[c for c in pool.contexts.values() if c is not own and c.identity == slot.identity],
                entries=candidates,
                can_truncate=pool.layout.can_truncate,
                restore_min_gain=pool.settings.restore_min_gain,
                head=head,
            )

        choice = pick(entries)
        if remote and tiers is not None and tiers.remote is not None and choice.keep < len(target):
            shared = tiers.remote_candidates(pool.model_digest, slot.identity, fmt)
            if shared:
                choice = pick([*entries, *shared])
        return choice

    def _place(self, slot: SessionSlot, choice: Choice, runtime: KVRuntime, head: int) -> WarmContext:
        """The context this session's operation runs on (the session's own sequence). A source
        that shares no more than the format's ``head`` (BOS, the chat template's head: any context
        has it) does not keep the least valuable context from going to a tier: it used to,
        whenever the least recently used context was the one the head would be copied from."""
        own = self._pool.own(slot)
        source = choice.context
        if source is not None and source is not own and source.owner is None and not source.busy:
            # A detached context (its session closed): adopt it; the session's previous
            # context stays warm, detached, for whoever needs it next.
            if own is not None:
                own.owner = None
            source.owner = slot
            slot.context = source
            return source
        if own is None:
            keep_away = source if choice.keep > head else None
            return eviction.new_context(self._pool, slot, runtime, keep_away=keep_away)
        if source is not own:
            eviction.save_before_overwrite(self._pool, own, choice.keep, runtime)
        return own

    def _fill(self, slot: SessionSlot, hold: Hold, choice: Choice, runtime: KVRuntime, head: int) -> None:
        """Bring the reused part into the hold's context: nothing to do, a copy, or a restore.
        A copy is a use of its source (it stays warm longer) unless it copied no more than the
        format's ``head``: every new conversation copies that from whichever context holds it,
        which made an idle context look recently used and another go to a tier before it."""
        dst = hold.context
        source = choice.context
        if source is dst:
            own = source.owner is slot and slot.seen_generation == source.generation
            hold.keep = choice.keep
            hold.source = Candidate("kv", dst.id, dst.prefix_tokens, own=own or choice.keep == 0)
        elif source is not None:
            n = choice.keep
            runtime.copy(source.seq, dst.seq, n)
            self._pool.ledger.copy(source.seq, dst.seq, n)
            dst.tokens = source.tokens[:n]
            dst.prefix_tokens = min(source.prefix_tokens, n)
            dst.generation += 1
            dst.saved_key = ""
            if n > head:
                source.last_used = time.time()
            self._pool.counters["copies"] += 1
            hold.keep = n
            hold.source = Candidate("kv", source.id, source.prefix_tokens, own=False)
        elif choice.entry is not None:
            self._restore(slot, hold, choice.entry, choice.keep, runtime)

    def _restore(
        self, slot: SessionSlot, hold: Hold, entry: TierEntry, keep: int, runtime: KVRuntime
    ) -> None:
        pool = self._pool
        assert pool.tiers is not None
        dst = hold.context
        started = time.perf_counter()
        tier = entry.tier  # where it comes from (a restore may move it out of RAM)
        try:
            blob = pool.tiers.load(entry)
        except SnapshotError as exc:
            pool.counters["snapshots_rejected"] += 1
            slot.loss = Loss("snapshot_rejected", str(exc))
            return
        # The snapshot replaces what dst holds: room for its cells first. A unified pool full of
        # other warm contexts makes the engine refuse it, and a good snapshot must not be
        # rejected (and removed: from the shared store, for every box) for want of room.
        eviction.make_room(pool, dst, 0, len(entry.tokens), runtime)
        restored = runtime.restore(dst.seq, entry.tokens, blob)
        dst.generation += 1
        if not restored.ok:
            if restored.refused:
                pool.counters["restore_failures"] += 1
            pool.counters["snapshots_rejected"] += 1
            pool.tiers.reject(entry, restored.detail)
            slot.loss = Loss("snapshot_rejected", restored.detail)
            dst.tokens = []
            pool.ledger.drop(dst.seq)
            return
        dst.tokens = list(entry.tokens)
        dst.prefix_tokens = entry.prefix_tokens
        dst.saved_key = entry.key
        pool.ledger.set(dst.seq, len(entry.tokens))
        pool.tiers.touch(entry)
        if keep >= len(entry.tokens):
            # The KV pool holds the whole entry again: its RAM copy goes (moved, not copied;
            # a disk copy stays, or is written first, for a worker crash).
            pool.tiers.take(entry)
        hold.keep = keep
        hold.tier = tier
        hold.source = Candidate(tier, entry.short_id, entry.prefix_tokens, own=False)
        hold.restore_ms = (time.perf_counter() - started) * 1000.0

    # --- what the engine reported -----------------------------------------------------------------

    def _failed(self, context: WarmContext, error: ModeldError, *, engine_alive: bool) -> None:
        with self._lock:
            context.busy = False
            if engine_alive and self._pool.holds(context):
                with contextlib.suppress(ModeldError):
                    self.runtime().drop(context.seq)
            self._pool.record_failure(context, error.message)

    # --- whole-pool events ------------------------------------------------------------------------

    def reset(self, error: ModeldError) -> None:
        """The engine lost every sequence (its worker died or the model was unloaded)."""
        with self._lock:
            for context in self._pool.contexts.values():
                if context.owner is not None:
                    context.owner.loss = Loss("engine_reset", error.message)
                    context.owner.context = None
            self._pool.clear()

    def retire(self, why: str, kind: str = "evicted") -> None:
        """Save every warm context to the tiers (as far as the budgets allow) and forget them:
        the model is being unloaded or the daemon is stopping."""
        runtime = self.runtime()
        with self._lock:
            for context in list(self._pool.contexts.values()):
                if context.busy:
                    continue
                tier = ""
                with contextlib.suppress(ModeldError):
                    tier = eviction.save(self._pool, context, runtime)
                if context.owner is not None:
                    where = f"saved to the {tier} tier" if tier else "not saved"
                    context.owner.loss = Loss(kind, f"{why}; {where}", tier or "none")
                    context.owner.context = None
            self._pool.clear()

    def persist_all(self, *, whole: bool = False) -> None:
        """Write every warm context's prefix (``whole``: every resident token) to the disk tier
        and through to the shared store (an orderly daemon stop; a drain saves them whole)."""
        tiers = self._pool.tiers
        if tiers is None or not tiers.persistent:
            return
        self._saver.settle()  # earlier write-behind snapshots first
        runtime = self.runtime()
        with self._lock:
            for context in list(self._pool.contexts.values()):
                if not context.busy:
                    with contextlib.suppress(ModeldError):
                        eviction.save(self._pool, context, runtime, persist=True, whole=whole)

    def expire(self, now: float) -> None:
        """Evict contexts idle past their session's keep-alive (to the tiers)."""
        runtime: KVRuntime | None = None
        with self._lock:
            for context in list(self._pool.contexts.values()):
                owner = context.owner
                if owner is None or owner.keep_alive is None or context.busy or owner.pinned:
                    continue
                if now - context.last_used > owner.keep_alive:
                    runtime = runtime or self.runtime()
                    why = f"idle for more than its keep-alive of {owner.keep_alive:g}s"
                    eviction.evict(self._pool, context, runtime, why)

    def close(self) -> None:
        self._saver.close()

    # --- observers ----------------------------------------------------------------------------

    def kv_tokens(self, slot: SessionSlot, tokens: list[int]) -> int:
        """How many of a session's tokens its warm context holds in the KV pool now."""
        return self._pool.kv_tokens(slot, tokens)

    def views(self, listed: set[str] | None = None) -> tuple[WarmContextInfo, ...]:
        """Every warm context, for status and explain-context: the pool's, and the tier snapshots
        this model can restore (its file's digest, its engine's snapshot format, the runtime
        identity of one of its sessions); a snapshot whose key is in ``listed`` is left out, and
        the keys listed here are added (so a daemon's status lists each snapshot under one model,
        never under every model of the same file). Never waits long: an operation holds the lock
        across engine calls, and a hung engine must not hang ``modeld status`` (past 0.2 s the
        view is read without the lock, a moment's state)."""
        locked = self._lock.acquire(timeout=0.2)
        try:
            out = self._pool.views()
            identities = set(self._pool.identities)
        finally:
            if locked:
                self._lock.release()
        tiers = self._pool.tiers
        if tiers is not None:
            fmt = self._pool.layout.snapshot_format
            for e in tiers.entries(self._pool.model_digest):
                if e.identity not in identities or e.snapshot_format != fmt:
                    continue
                if listed is not None:
                    if e.key in listed:
                        continue
                    listed.add(e.key)
                out.append(
                    WarmContextInfo(
                        id=e.short_id,
                        tier=e.tier,
                        tokens=len(e.tokens),
                        prefix_tokens=e.prefix_tokens,
                        bytes=e.nbytes,
                        shared_bytes=0,
                        last_used_at=e.last_used,
                        pinned=False,
                        session_id="",
                    )
                )
        return tuple(out)

    def used_cells(self) -> int:
        locked = self._lock.acquire(timeout=0.2)  # as views(): never hang an observer
        try:
            return self._pool.ledger.used()
        finally:
            if locked:
                self._lock.release()

    def busy_cells(self) -> int:
        """KV cells held by the contexts of running operations (at most :meth:`used_cells`):
        what cannot give way now. The rest of the pool is idle warm contexts, a cache that is
        evicted to the tiers when a turn needs its cells (the load a gateway should see:
        SGLang's load likewise leaves out its evictable radix cache)."""
        locked = self._lock.acquire(timeout=0.2)  # as views(): never hang an observer
        try:
            ledger = self._pool.ledger
            busy = sum(ledger.length(c.seq) for c in list(self._pool.contexts.values()) if c.busy)
            return min(busy, ledger.used())
        finally:
            if locked:
                self._lock.release()


class _Progress:
    """Reports a long prefill at most every :data:`PROGRESS_INTERVAL` seconds."""

    def __init__(self, stage: str, started: float, callback: ProgressCallback | None) -> None:
        self.stage = stage
        self.started = started
        self.callback = callback
        self.last = started

    def __call__(self, step: SyncStep) -> None:
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
