"""The one owner of "what is warm where" for a loaded model, and the hold a turn takes on it.

:class:`ModelCache` knows, for one loaded runtime, every warm context in its KV pool
(``pool.py``) and reaches the daemon-wide RAM and disk tiers (``tiers.py``) for the model's
snapshots. Nothing else in modeld keeps a copy of that knowledge; sessions ask it.

A session's operation (``ensure_prefix``, ``prefill_suffix``, ``decode``) does all its KV work
through one :class:`~modeld.cache.hold.Hold` (``hold.py``)::

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
   evicting the least valuable contexts, every token of each saved to a tier first; when only
   running operations hold the room, the turn waits for them (in the order turns came, at most
   ``room_wait_seconds``); where the pool's attention spans every used cell, an idle context
   leaves it when a turn starts and its cells cost that turn more than moving it out and back,
   both measured (``eviction.leave_idle``, ``cost.py``).
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
import time
from collections.abc import Callable, Sequence
from dataclasses import replace

from modeld.backends.base import Layout
from modeld.cache import eviction, fill, prefetch
from modeld.cache.choice import Choice, SessionSaved, choose
from modeld.cache.cost import Costs
from modeld.cache.hold import Hold
from modeld.cache.pool import CacheSettings, Pool, SessionSlot, WarmContext
from modeld.cache.reuse import Candidate, Loss, RuntimeHistory, classify
from modeld.cache.runtime import Counted, KVRuntime
from modeld.cache.state import CacheState
from modeld.cache.tiers import TierEntry, Tiers
from modeld.contract import WarmContextInfo
from modeld.errors import (
    BusyError,
    ModeldError,
    echo,
)
from modeld.manifest import ContextManifest

__all__ = ["ModelCache"]

log = logging.getLogger("modeld.cache")

_IDLE = "it was idle while another session's turn ran, and a unified pool's attention spans every used cell"
"""Why :func:`eviction.leave_idle` moved a context out of the pool (its next turn restores it;
the eviction adds the measured costs that decided it)."""


AHEAD_WAIT = 10.0
"""Seconds at most a turn waits for a prefill ahead of a turn running on the context it would copy
from (``ModelCache.hold``): such a prefill computes one answer's tokens after what it keeps."""


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
        checkpoints: Callable[[], Sequence[int]] = tuple,
    ) -> None:
        pool = Pool(
            name=name,
            model_digest=model_digest,
            layout=layout,
            tiers=tiers,
            settings=settings or CacheSettings(),
        )
        self.runtime: Callable[[], KVRuntime] = lambda: Counted(runtime(), pool.tally)
        """The live runtime (waits while its worker restarts; raises when it cannot); every
        call the cache makes counts in the pool's tally."""
        self._checkpoints = checkpoints
        """What each sequence's checkpoints hold in the runtime, by sequence, as it last said
        (never waits: an observer reads it)."""
        self.state = CacheState(
            pool=pool,
            runtime=self.runtime,
            history=history or RuntimeHistory(),
            file_key=file_key,
        )
        """What this cache shares with the holds it hands out (``state.py``)."""
        self._waiting: list[object] = []
        """Turns waiting for room, in the order they came (the first one tries first)."""
        self._waited_for: WarmContext | None = None
        """The last context running a prefill ahead that a turn waited for (logged once)."""

    @property
    def counters(self) -> dict[str, int]:
        return self.state.pool.counters

    @property
    def costs(self) -> Costs:
        """What this model's warm contexts cost where they are, as measured (``cost.py``)."""
        return self.state.pool.costs

    # --- sessions -------------------------------------------------------------------------------

    def slot(
        self, session_id: str, identity: str, *, pinned: bool = False, keep_alive: float | None = None
    ) -> SessionSlot:
        with self.state.lock:
            slots = self.state.pool.slots
            slot = slots.get(session_id)
            if slot is None:
                slot = slots[session_id] = SessionSlot(session_id, identity, pinned, keep_alive)
                self.state.pool.identities.add(identity)
            return slot

    def forget_session(self, slot: SessionSlot) -> None:
        """The session closed: its context stays warm, detached, for whoever needs it next."""
        with self.state.lock:
            if slot.context is not None and slot.context.owner is slot:
                slot.context.owner = None
            slot.context = None
            self.state.pool.slots.pop(slot.session_id, None)

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
        ahead: bool = False,
    ) -> Hold:
        """Choose, place and make room for ``target`` (see the module docstring).

        ``stage`` (prefix, suffix, decode) names the operation in progress and timeouts;
        ``floor`` is how many leading tokens it will not change once they are in place (others
        may copy them meanwhile); ``extra_cells`` the room needed beyond ``target`` (tokens a
        decode may generate); ``head`` how many of ``target``'s first tokens any prefix of its
        format starts with (the chat template's head, BOS): reusing no more is a cold turn;
        ``ahead`` a prefix computed ahead of a turn (``PrefixInput.ahead``). A turn whose best
        source runs such a prefill waits for it (:data:`AHEAD_WAIT` at most): it only appends to
        what the turn would copy, and going to another source recomputes more."""
        runtime = self.runtime()
        changed = self.state.history.changed(self.state.file_key, manifest)
        self.state.saver.settle()  # a choice must see every tier entry
        wait = self.state.pool.settings.room_wait_seconds
        waiter: object | None = None
        logged = False
        started = time.monotonic()
        with self.state.lock:
            try:
                while True:
                    # A turn that starts queues behind the turns waiting for room (in the order
                    # they came); a turn's later operations never do (those waited for end them).
                    if stage == "prefix" and self._waiting and waiter is None:
                        waiter = object()
                        self._waiting.append(waiter)
                    if (
                        stage == "prefix"
                        and not ahead
                        and waiter is None
                        and time.monotonic() < started + AHEAD_WAIT
                        and self._behind_ahead(slot, target, head)
                    ):
                        self.state.room.wait(min(started + AHEAD_WAIT - time.monotonic(), 1.0))
                        continue
                    if waiter is None or self._waiting[0] is waiter:
                        try:
                            return self._hold(
                                slot,
                                target,
                                stage,
                                manifest,
                                floor,
                                extra_cells,
                                head,
                                runtime,
                                changed,
                                ahead,
                            )
                        except eviction.NeedRoom as need:
                            if not need.waitable or self.state.closed:
                                raise BusyError(
                                    f"{need.why}; no wait frees them", needed_cells=need.needed
                                ) from None
                            if waiter is None:
                                waiter = object()
                                self._waiting.append(waiter)
                            left = started + wait - time.monotonic()
                            if left <= 0:
                                raise BusyError(
                                    f"{need.why}; waited {wait:.0f}s (--queue-wait) for them to free up",
                                    needed_cells=need.needed,
                                    wait_seconds=int(wait),
                                ) from None
                            if not logged:
                                logged = True
                                log.info(
                                    "%s: a turn's %s waits for KV room: %s",
                                    self.state.pool.name,
                                    stage,
                                    need.why,
                                )
                    left = started + wait - time.monotonic()
                    if left <= 0:
                        raise BusyError(
                            f"{self.state.pool.name}: turns that came first still wait for KV cells after "
                            f"{wait:.0f}s (--queue-wait)",
                            wait_seconds=int(wait),
                        )
                    self.state.room.wait(min(left, 1.0))
            finally:
                if waiter is not None:
                    self._waiting.remove(waiter)
                    self.state.room.notify_all()

    def _hold(
        self,
        slot: SessionSlot,
        target: list[int],
        stage: str,
        manifest: ContextManifest,
        floor: int,
        extra_cells: int,
        head: int,
        runtime: KVRuntime,
        changed: tuple[str, str, str] | None,
        ahead: bool = False,
    ) -> Hold:
        """:meth:`hold`'s choice, placement and room, under the lock (raises
        :class:`~modeld.cache.eviction.NeedRoom` when busy contexts hold the room it needs)."""
        pool = self.state.pool
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
        hold = Hold(self.state, dst, target, stage, manifest, ahead=ahead)
        if stage == "prefix" or not slot.turn_started:
            slot.turn_started = time.time()  # a turn begins: its place in line for cells
        dst.turn_started = slot.turn_started
        prefill = max(0, len(target) - choice.keep)
        if stage == "prefix":
            # Before the fill, so a restore lands in the cells they free (low in the pool).
            eviction.leave_idle(
                pool, runtime, {dst, *([choice.context] if choice.context else [])}, _IDLE, prefill
            )
        self._fill(slot, hold, choice, runtime, head)
        if stage == "prefix" and (pool.layout.can_truncate or hold.keep >= len(dst.tokens)):
            # The prefill keeps its first tokens where they are (memory cut exactly, or nothing
            # cut: a prefill ahead of the next turn appends): others may copy them meanwhile, as
            # from a suffix's or a decode's. Memory that goes back to a checkpoint before the
            # cut re-evaluates tokens before it, and offers none.
            floor = len(target)
        source = choice.context if choice.context is not None and choice.context is not dst else None
        if stage == "prefix" and source is not None:
            # The copy's source is idle too, but when it held the whole prefix and more (the same
            # conversation's last prompt, another run of the same agent) the suffix that follows
            # may continue from it: it stays for the suffix stage, which weighs it then.
            more = hold.keep >= len(target) and len(source.tokens) > hold.keep
            eviction.leave_idle(pool, runtime, {dst, source} if more else {dst}, _IDLE, prefill)
        elif source is not None:
            # The suffix copied from another context: that context, idle, is weighed against what
            # this turn computes now (the suffix known; its own cells are mostly shared now).
            eviction.leave_idle(pool, runtime, {dst}, _IDLE, prefill, suffix_known=True)
        # The cells of dst past what is kept are cut by this turn: they count as room (the
        # 8k coding loop's third turn, and a session editing the middle of a prefix longer
        # than half the pool, used to be busy).
        eviction.make_room(pool, dst, hold.keep, len(target) - hold.keep + extra_cells, runtime)
        if pool.layout.shared_cells:
            pool.reserved[dst.seq] = len(target) - hold.keep + extra_cells  # until the hold ends
        dst.busy, dst.ahead = True, ahead
        pool.tally.count()  # an operation began: a turn whose prompt is resident sends no KV call
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
            model_file=echo(self.state.file_key[1], 200) if self.state.file_key[1] else "",
            head=head,
        )
        fill.recomputed(self.state.pool, slot, hold, target, choice)
        if slot.note and hold.keep > 0 and pool.own(slot) is dst:
            hold.decision = replace(hold.decision, message=f"{hold.decision.message}; {slot.note}")
        slot.note = ""
        slot.loss = None
        return hold

    def _behind_ahead(self, slot: SessionSlot, target: list[int], head: int) -> bool:
        """Another context runs a prefill ahead of a turn (``WarmContext.ahead``), and this turn
        would copy from it once it ends: more tokens than from anything idle now, or, on memory
        that goes back to a checkpoint before the divergence, as many from it (the context used
        last: :func:`~modeld.cache.choice.choose`). Logged once per context it waits for."""
        pool = self.state.pool
        running = {c.seq: c for c in pool.contexts.values() if c.busy and c.ahead and c.owner is not slot}
        if not running:
            return False
        now = self._choose(slot, target, head)
        then = self._choose(slot, target, head, settled=True)
        busy = running.get(then.context.seq) if then.context is not None else None
        if busy is None:
            return False
        if then.keep > now.keep or (now.context is not busy and not pool.layout.can_truncate):
            if self._waited_for is not busy:
                self._waited_for = busy
                log.info(
                    "%s: a turn waits for the prefill ahead of a turn running on context %s, the best "
                    "to copy its first %d tokens from (the best idle one: %d, from further back)",
                    pool.name,
                    busy.id,
                    then.keep,
                    now.keep,
                )
            return True
        return False

    def _choose(
        self, slot: SessionSlot, target: list[int], head: int, *, remote: bool = False, settled: bool = False
    ) -> Choice:
        """The choice among the KV and the local tiers; a prefix they do not cover whole is
        looked up in the remote tier too (``remote``: the shared store, blueprint 0020), whose
        snapshots come after the local ones (the local one wins at equal length). ``settled``:
        as it will be once the prefills ahead of a turn end (their contexts offered whole)."""
        pool = self.state.pool
        own = pool.own(slot)
        tiers = pool.tiers
        fmt = pool.layout.snapshot_format
        entries = tiers.candidates(pool.model_digest, slot.identity, fmt) if tiers is not None else []

        # What this session left the KV with (saved whole): restored for any gain, since its
        # suffix and decode serve the turn's next operations too (never computed again).
        mine = SessionSaved(slot.computed, entries)

        def pick(candidates: list[TierEntry]) -> Choice:
            return choose(
                target,
                own=own,
                untouched=own is not None and own.generation == slot.seen_generation,
                others=[
                    replace(c, busy=False) if settled and c.busy and c.ahead else c
                    for c in pool.contexts.values()
                    if c is not own and c.identity == slot.identity
                ],
                entries=candidates,
                can_truncate=pool.layout.can_truncate,
                restore_min_gain=pool.settings.restore_min_gain,
                head=head,
                checkpoints=pool.layout.checkpoints,
                snapshot_cuts=pool.layout.snapshot_cuts,
                mine=mine,
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
        own = self.state.pool.own(slot)
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
            return eviction.new_context(self.state.pool, slot, runtime, keep_away=keep_away)
        if source is not own:
            eviction.save_before_overwrite(self.state.pool, own, choice.keep, runtime)
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
            layout = self.state.pool.layout
            # Memory cut back through checkpoints is copied whole: the turn's sync then goes back
            # to the checkpoint before n and says so (a copy cannot report where it landed).
            whole = len(source.tokens) if layout.checkpoints and not layout.can_truncate else n
            runtime.copy(source.seq, dst.seq, whole)
            self.state.pool.ledger.copy(source.seq, dst.seq, whole)
            dst.tokens = source.tokens[:whole]
            dst.prefix_tokens = min(source.prefix_tokens, n)
            dst.generation += 1
            dst.saved_key = ""
            if n > head:
                source.last_used = time.time()
            self.state.pool.counters["copies"] += 1
            hold.keep = n
            hold.source = Candidate("kv", source.id, source.prefix_tokens, own=False)
        elif choice.entry is not None:
            fill.restore(self.state.pool, slot, hold, choice.entry, choice.keep, runtime)

    # --- whole-pool events ------------------------------------------------------------------------

    def reset(self, error: ModeldError) -> None:
        """The engine lost every sequence (its worker died or the model was unloaded)."""
        with self.state.lock:
            self.state.room.notify_all()
            for context in self.state.pool.contexts.values():
                if context.owner is not None:
                    context.owner.loss = Loss("engine_reset", error.message)
                    context.owner.context = None
            self.state.pool.clear()

    def retire(self, why: str, kind: str = "evicted") -> None:
        """Save every warm context to the tiers (as far as the budgets allow) and forget them:
        the model is being unloaded or the daemon is stopping."""
        runtime = self.runtime()
        with self.state.lock:
            for context in list(self.state.pool.contexts.values()):
                if context.busy:
                    continue
                tier = ""
                with contextlib.suppress(ModeldError):
                    tier = eviction.save(
                        self.state.pool, context, runtime, whole=self.state.pool.layout.whole_snapshots
                    )
                if context.owner is not None:
                    where = f"saved to the {tier} tier" if tier else "not saved"
                    context.owner.loss = Loss(kind, f"{why}; {where}", tier or "none")
                    context.owner.context = None
            self.state.pool.clear()

    def persist_all(self, *, whole: bool | None = None) -> None:
        """Write every warm context, every resident token (``whole`` False: its prefix), to the
        disk tier and through to the shared store (an orderly daemon stop, a drain): what leaves
        the KV keeps every token (blueprint 0016, "Where a context goes"). By default whole where
        a restored snapshot can be cut (``Layout.whole_snapshots``: memory that can be cut, or
        checkpoints inside the snapshot); other memory keeps its state at the prefix, as evicted."""
        tiers = self.state.pool.tiers
        if tiers is None or not tiers.persistent:
            return
        self.state.saver.settle()  # earlier write-behind snapshots first
        runtime = self.runtime()
        with self.state.lock:
            for context in list(self.state.pool.contexts.values()):
                if not context.busy:
                    with contextlib.suppress(ModeldError):
                        every = self.state.pool.layout.whole_snapshots if whole is None else whole
                        eviction.save(self.state.pool, context, runtime, persist=True, whole=every)

    def prefetch(self, now: float) -> int:
        """Bring back into the KV pool, before they ask, the contexts of open sessions whose last
        turn ended in a tool call and which left the pool meanwhile (``prefetch.py``), when the
        pool is idle. Returns how many came back."""
        pool = self.state.pool
        if pool.tiers is None or not pool.layout.explicit:
            return 0
        if not self.state.lock.acquire(timeout=0.2):
            return 0
        try:
            if self.state.closed or self._waiting or any(c.busy for c in pool.contexts.values()):
                return 0
            return prefetch.bring_back(pool, self.runtime, now)
        finally:
            self.state.lock.release()

    def expire(self, now: float) -> None:
        """Evict contexts idle past their session's keep-alive (to the tiers)."""
        runtime: KVRuntime | None = None
        with self.state.lock:
            for context in list(self.state.pool.contexts.values()):
                owner = context.owner
                if owner is None or owner.keep_alive is None or context.busy or owner.pinned:
                    continue
                if now - context.last_used > owner.keep_alive:
                    runtime = runtime or self.runtime()
                    why = f"idle for more than its keep-alive of {owner.keep_alive:g}s"
                    eviction.evict(self.state.pool, context, runtime, why)
                    owner.ended = ""  # its client said how long to keep it: never brought back early

    def close(self) -> None:
        with self.state.lock:
            self.state.closed = True
            self.state.room.notify_all()
        self.state.saver.close()

    # --- observers ----------------------------------------------------------------------------

    def kv_tokens(self, slot: SessionSlot, tokens: list[int]) -> int:
        """How many of a session's tokens its warm context holds in the KV pool now."""
        return self.state.pool.kv_tokens(slot, tokens)

    def views(self, listed: set[str] | None = None) -> tuple[WarmContextInfo, ...]:
        """Every warm context, for status and explain-context: the pool's, and the tier snapshots
        this model can restore (its file's digest, its engine's snapshot format, the runtime
        identity of one of its sessions); a snapshot whose key is in ``listed`` is left out, and
        the keys listed here are added (so a daemon's status lists each snapshot under one model,
        never under every model of the same file). Never waits long: an operation holds the lock
        across engine calls, and a hung engine must not hang ``modeld status`` (past 0.2 s the
        view is read without the lock, a moment's state)."""
        locked = self.state.lock.acquire(timeout=0.2)
        try:
            out = self.state.pool.views(self._checkpoints())
            identities = set(self.state.pool.identities)
        finally:
            if locked:
                self.state.lock.release()
        tiers = self.state.pool.tiers
        if tiers is not None:
            fmt = self.state.pool.layout.snapshot_format
            for e in tiers.entries(self.state.pool.model_digest):
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
        locked = self.state.lock.acquire(timeout=0.2)  # as views(): never hang an observer
        try:
            return self.state.pool.ledger.used()
        finally:
            if locked:
                self.state.lock.release()

    def busy_cells(self) -> int:
        """KV cells held by the contexts of running operations (at most :meth:`used_cells`):
        what cannot give way now. The rest of the pool is idle warm contexts, a cache that is
        evicted to the tiers when a turn needs its cells (the load a gateway should see:
        SGLang's load likewise leaves out its evictable radix cache)."""
        locked = self.state.lock.acquire(timeout=0.2)  # as views(): never hang an observer
        try:
            ledger = self.state.pool.ledger
            busy = sum(ledger.length(c.seq) for c in list(self.state.pool.contexts.values()) if c.busy)
            return min(busy, ledger.used())
        finally:
            if locked:
                self.state.lock.release()
