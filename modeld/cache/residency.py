"""The one owner of "what is warm where" for a loaded model.

:class:`ModelCache` knows, for one loaded runtime, every *warm context* in its KV pool (which
sequence holds which tokens, computed under which runtime identity, for which session) and
reaches the daemon-wide RAM and disk tiers (``modeld/cache/tiers.py``) for the model's
snapshots. Nothing else in modeld keeps a copy of that knowledge; sessions ask it.

A session's operation (``ensure_prefix``, ``prefill_suffix``, ``decode``) takes a :class:`Lease`:

1. **Choose.** The session's own context, untouched since its last operation (its generation
   counter is unchanged) and still sharing the whole old prefix with the new target, is taken
   without looking further. Otherwise every compatible candidate (same runtime identity) is
   compared: the session's own context, other warm contexts in the pool, and tier snapshots;
   the longest common token prefix wins (as SGLang's radix match and llama-server's slot
   similarity do); ties prefer the KV pool over RAM over disk, and a snapshot must beat the KV
   by ``restore_min_gain`` tokens to be worth a restore.
2. **Place.** The session keeps its own sequence (a session's operations never run on a
   sequence another session is using). Another session's prefix is copied into it (with
   llama.cpp's unified KV that only tags cells: the prefix is stored once); a detached context
   (its session closed) is adopted as is; a snapshot is restored into it. Before a session's
   own context is overwritten by a very different one, its prefix is saved to the RAM tier.
3. **Make room.** A free sequence, and free cells for the new tokens, are found by evicting the
   least valuable contexts first (not pinned, not busy; least recently used, weighted by how
   many tokens it would cost to recompute). An evicted context's prefix goes to the RAM tier
   (and from there to disk) before its cells are freed; its session's next turn is told where
   it went.

The lease marks the context busy; ``floor`` is how many of its tokens the running operation
will not touch, which other sessions may copy meanwhile. :meth:`ModelCache.synced` records what
the engine reports after each job (the truth after a cancel or a failure), and
:meth:`ModelCache.release` ends the lease. Design record: ``blueprints/0014``.
"""

from __future__ import annotations

import contextlib
import itertools
import logging
import threading
import time
from collections.abc import Callable, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field

from modeld.backends.base import Layout
from modeld.cache.ledger import Ledger
from modeld.cache.snapfile import SnapshotError
from modeld.cache.tiers import TierEntry, Tiers
from modeld.contract import ReuseDecision
from modeld.engine.reuse import Candidate, Loss, classify, common_prefix_len
from modeld.errors import BusyError, ModeldError
from modeld.manifest import ContextManifest
from modeld.workers.host import Host
from modeld.workers.protocol import REFUSED, Result

__all__ = ["CacheSettings", "ContextView", "Lease", "ModelCache", "SessionSlot", "WarmContext"]

log = logging.getLogger("modeld.cache")


@dataclass(frozen=True, slots=True)
class CacheSettings:
    snapshot_min_tokens: int = 64
    """A context shorter than this is not worth a snapshot (recomputing it is cheap)."""
    persist_min_tokens: int = 512
    """A prefix at least this long, just computed, is snapshotted and written to disk at once
    (so it survives a crash of the daemon, not only an orderly stop)."""
    restore_min_gain: int = 16
    """A snapshot is restored only if it reuses this many tokens more than the best context in
    the KV pool."""


@dataclass(eq=False)
class WarmContext:
    """One sequence of the KV pool and what it holds."""

    id: str
    seq: int
    identity: str
    tokens: list[int]
    prefix_tokens: int = 0
    generation: int = 0
    owner: SessionSlot | None = None
    busy: bool = False
    floor: int = 0
    last_used: float = field(default_factory=time.time)
    created: float = field(default_factory=time.time)
    saved_key: str = ""  # the tier entry that already holds this context's prefix


@dataclass(eq=False)
class SessionSlot:
    """The cache's memory of one session: its warm context and what became of it."""

    session_id: str
    identity: str
    pinned: bool = False
    keep_alive: float | None = None
    context: WarmContext | None = None
    seen_generation: int = -1
    loss: Loss | None = None


@dataclass(eq=False)
class Lease:
    """One operation's hold on a warm context."""

    context: WarmContext
    keep: int
    decision: ReuseDecision
    restored: int = 0
    restore_ms: float = 0.0
    tier: str = "kv"
    source: Candidate | None = None


@dataclass(frozen=True, slots=True)
class ContextView:
    """A warm context as ``modeld status`` and ``explain-context`` show it."""

    id: str
    tier: str
    tokens: int
    prefix_tokens: int
    bytes: int
    shared_bytes: int
    last_used: float
    pinned: bool
    session: str
    seq: int = -1


@dataclass
class _Choice:
    keep: int = 0
    context: WarmContext | None = None
    entry: TierEntry | None = None
    blocked: bool = False  # a compatible context shared a prefix the memory cannot be cut to
    seen: bool = False  # some compatible warm context or snapshot existed


class ModelCache:
    """Warm contexts of one loaded runtime (see the module docstring). Thread-safe."""

    def __init__(
        self,
        *,
        name: str,
        model_digest: str,
        layout: Layout,
        host: Callable[[], Host],
        tiers: Tiers | None,
        settings: CacheSettings | None = None,
    ) -> None:
        self.name = name
        self.model_digest = model_digest
        self.layout = layout
        self._host = host
        self.tiers = tiers if layout.snapshots else None
        self.settings = settings or CacheSettings()
        self._lock = threading.RLock()
        self._ids = itertools.count(1)
        self._contexts: dict[int, WarmContext] = {}  # by sequence
        self._slots: dict[str, SessionSlot] = {}
        self._ledger = Ledger(layout.shared_cells)
        self._background = ThreadPoolExecutor(max_workers=1, thread_name_prefix=f"kv-save-{name[:8]}")
        self._saving: list[Future[None]] = []
        self.counters: dict[str, int] = {
            "reused_kv": 0,
            "reused_ram": 0,
            "reused_disk": 0,
            "prefilled": 0,
            "queries": 0,
            "evicted_to_ram": 0,
            "evicted_to_disk": 0,
            "evicted_dropped": 0,
            "snapshots_taken": 0,
            "snapshots_rejected": 0,
            "restore_failures": 0,
            "copies": 0,
        }

    # --- sessions -------------------------------------------------------------------------------

    def slot(
        self, session_id: str, identity: str, *, pinned: bool = False, keep_alive: float | None = None
    ) -> SessionSlot:
        with self._lock:
            slot = self._slots.get(session_id)
            if slot is None:
                slot = self._slots[session_id] = SessionSlot(session_id, identity, pinned, keep_alive)
            return slot

    def forget_session(self, slot: SessionSlot) -> None:
        """The session closed: its context stays warm, detached, for whoever needs it next."""
        with self._lock:
            if slot.context is not None and slot.context.owner is slot:
                slot.context.owner = None
            slot.context = None
            self._slots.pop(slot.session_id, None)

    # --- an operation's lease -------------------------------------------------------------------

    def begin(
        self,
        slot: SessionSlot,
        target: list[int],
        *,
        manifest: ContextManifest,
        floor: int,
        extra_cells: int = 0,
        changed: tuple[str, str, str] | None = None,
    ) -> Lease:
        """Choose, place and make room for ``target`` (see the module docstring).

        ``floor`` is how many leading tokens this operation will not change once they are in
        place (others may copy them meanwhile); ``extra_cells`` the room needed beyond
        ``target`` (tokens a decode may generate); ``changed`` the runtime field that differs
        from the last warm state of this model file, for the cold reason.
        """
        host = self._host()
        self._settle()
        with self._lock:
            self.counters["queries"] += len(target)
            choice = self._choose(slot, target)
            try:
                dst = self._place(slot, choice, host)
            except _NoRoom:
                # The only sequence that could be freed holds the best candidate: copying from
                # it is impossible, so it is saved and freed, and this turn starts from nothing
                # (or from its snapshot, found by choosing again).
                victim = choice.context
                assert victim is not None
                self._evict(victim, host, "its sequence was needed by another session")
                choice = self._choose(slot, target)
                dst = self._place(slot, choice, host)
            lease = self._fill(slot, dst, choice, host)
            self._make_room(dst, len(target) - lease.keep + extra_cells, host)
            dst.busy = True
            dst.floor = max(0, min(floor, lease.keep - 2))
            lease.decision = classify(
                wanted=len(target),
                keep=lease.keep,
                candidate=lease.source if (lease.keep > 0 or choice.seen) else None,
                manifest=manifest,
                loss=slot.loss if lease.keep == 0 else None,
                changed=changed if lease.keep == 0 and not choice.seen else None,
                truncation_blocked=choice.blocked and lease.keep == 0,
            )
            slot.loss = None
            self.counters[f"reused_{lease.tier}"] += lease.keep
            self.counters["prefilled"] += len(target) - lease.keep
            return lease

    def _own(self, slot: SessionSlot) -> WarmContext | None:
        context = slot.context
        if context is not None and self._contexts.get(context.seq) is context:
            return context
        return None

    def _usable(self, context: WarmContext, target: list[int], *, own: bool) -> tuple[int, bool]:
        """Tokens of ``context`` a lease may keep for ``target``, and whether the memory's
        inability to be cut kept a shared prefix from being used."""
        n = common_prefix_len(context.tokens, target)
        if context.busy and not own:
            n = min(n, context.floor)
        if n < len(context.tokens) and not self.layout.can_truncate:
            return 0, n > 0
        return n, False

    def _choose(self, slot: SessionSlot, target: list[int]) -> _Choice:
        own = self._own(slot)
        best = _Choice()
        if own is not None and not own.busy:
            keep, blocked = self._usable(own, target, own=True)
            best = _Choice(keep, own, blocked=blocked, seen=True)
            untouched = own.generation == slot.seen_generation
            if untouched and keep > 0 and keep >= min(own.prefix_tokens, len(target)):
                return best  # the session's own context, as it left it: nothing to compare
        for context in self._contexts.values():
            if context is own or context.identity != slot.identity:
                continue
            if context.busy and context.floor <= 0:
                continue
            keep, blocked = self._usable(context, target, own=False)
            best.blocked = best.blocked or blocked
            best.seen = True
            if keep > best.keep:
                best = _Choice(keep, context, blocked=best.blocked, seen=True)
        if self.tiers is not None:
            for entry in self.tiers.candidates(self.model_digest, slot.identity, self.layout.snapshot_format):
                best.seen = True
                n = common_prefix_len(entry.tokens, target)
                if n < len(entry.tokens) and not self.layout.can_truncate:
                    continue
                if n > 0 and n - best.keep >= self.settings.restore_min_gain:
                    best = _Choice(n, None, entry, blocked=best.blocked, seen=True)
        return best

    def _place(self, slot: SessionSlot, choice: _Choice, host: Host) -> WarmContext:
        """The context this session's operation runs on (the session's own sequence)."""
        own = self._own(slot)
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
            return self._new_context(slot, host, keep_away=source)
        if source is not own:
            self._save_before_overwrite(own, choice.keep, host)
        return own

    def _fill(self, slot: SessionSlot, dst: WarmContext, choice: _Choice, host: Host) -> Lease:
        """Bring the reused part into ``dst``: nothing to do, a copy, or a restore."""
        source = choice.context
        if source is dst:
            own = source.owner is slot and slot.seen_generation == source.generation
            candidate = Candidate("kv", dst.id, dst.prefix_tokens, own=own or choice.keep == 0)
            return Lease(dst, choice.keep, _PENDING, source=candidate)
        if source is not None:
            n = choice.keep
            host.copy(source.seq, dst.seq, n)
            self._ledger.copy(source.seq, dst.seq, n)
            dst.tokens = source.tokens[:n]
            dst.prefix_tokens = min(source.prefix_tokens, n)
            dst.generation += 1
            dst.saved_key = ""
            source.last_used = time.time()
            self.counters["copies"] += 1
            return Lease(dst, n, _PENDING, source=Candidate("kv", source.id, source.prefix_tokens, own=False))
        if choice.entry is not None:
            restored = self._restore(slot, dst, choice.entry, choice.keep, host)
            if restored is not None:
                return restored
        return Lease(dst, 0, _PENDING)

    def _restore(
        self, slot: SessionSlot, dst: WarmContext, entry: TierEntry, keep: int, host: Host
    ) -> Lease | None:
        assert self.tiers is not None
        tier = entry.tier
        started = time.perf_counter()
        try:
            blob = self.tiers.load(entry)
        except SnapshotError as exc:
            self.counters["snapshots_rejected"] += 1
            slot.loss = Loss("snapshot_rejected", str(exc))
            return None
        refused = host.restore(dst.seq, entry.tokens, blob)
        dst.generation += 1
        if refused:
            if refused == REFUSED:
                self.counters["restore_failures"] += 1
            self.counters["snapshots_rejected"] += 1
            self.tiers.reject(entry, refused)
            slot.loss = Loss("snapshot_rejected", refused)
            dst.tokens = []
            self._ledger.drop(dst.seq)
            return None
        dst.tokens = list(entry.tokens)
        dst.prefix_tokens = entry.prefix_tokens
        dst.saved_key = entry.key
        self._ledger.set(dst.seq, len(entry.tokens))
        self.tiers.touch(entry)
        candidate = Candidate(tier, entry.key[-8:], entry.prefix_tokens, own=False)
        lease = Lease(dst, keep, _PENDING, restored=len(entry.tokens), tier=tier, source=candidate)
        lease.restore_ms = (time.perf_counter() - started) * 1000.0
        return lease

    # --- room -------------------------------------------------------------------------------

    def _new_context(self, slot: SessionSlot, host: Host, keep_away: WarmContext | None) -> WarmContext:
        free = [s for s in range(self.layout.n_seq) if s not in self._contexts]
        if not free:
            victim = self._victim(exclude={keep_away} if keep_away is not None else set())
            if victim is None and keep_away is not None and self._victim(exclude=set()) is keep_away:
                raise _NoRoom
            if victim is None:
                raise BusyError(
                    f"all {self.layout.n_seq} sequences of {self.name} hold busy or pinned contexts; "
                    "try again when an operation ends",
                    sequences=self.layout.n_seq,
                )
            self._evict(victim, host, "its sequence was needed by another session")
            free = [victim.seq]
        context = WarmContext(
            id=f"c{next(self._ids)}", seq=free[0], identity=slot.identity, tokens=[], owner=slot
        )
        self._contexts[context.seq] = context
        slot.context = context
        return context

    def _make_room(self, dst: WarmContext, new_cells: int, host: Host) -> None:
        """Free cells for ``new_cells`` more tokens in ``dst`` (a unified pool is shared)."""
        if not self.layout.shared_cells or not self.layout.explicit:
            return
        while self._ledger.used() + max(0, new_cells) > self.layout.pool_tokens:
            victim = self._victim(exclude={dst})
            if victim is None:
                raise BusyError(
                    f"the KV pool of {self.name} ({self.layout.pool_tokens} tokens) is full of busy or "
                    "pinned contexts; try again when an operation ends",
                    pool_tokens=self.layout.pool_tokens,
                )
            self._evict(victim, host, "its cells were needed by another session")

    def _victim(self, exclude: set[WarmContext]) -> WarmContext | None:
        """The least valuable evictable context: idle time per token it would cost to recompute."""
        now = time.time()
        best: WarmContext | None = None
        best_score = -1.0
        for context in self._contexts.values():
            if context in exclude or context.busy:
                continue
            if context.owner is not None and context.owner.pinned:
                continue
            score = (now - context.last_used + 1.0) / (1.0 + len(context.tokens) / 1024.0)
            if context.owner is None:
                score *= 4.0  # a detached context serves nobody right now
            if score > best_score:
                best, best_score = context, score
        return best

    def _evict(self, context: WarmContext, host: Host, why: str) -> None:
        tier = self._save(context, host)
        host.drop(context.seq)
        self._ledger.drop(context.seq)
        self._contexts.pop(context.seq, None)
        if tier:
            self.counters[f"evicted_to_{tier}"] += 1
        else:
            self.counters["evicted_dropped"] += 1
        owner = context.owner
        if owner is not None:
            where = f"saved to the {tier} tier" if tier else "not saved: " + self._no_save_reason(context)
            owner.loss = Loss("evicted", f"{why}; {where}", tier or "none")
            owner.context = None
        log.info(
            "evicted warm context %s (%d tokens) from %s: %s", context.id, len(context.tokens), self.name, why
        )

    def _no_save_reason(self, context: WarmContext) -> str:
        if self.tiers is None:
            return "this backend has no snapshots" if not self.layout.snapshots else "the tiers are off"
        if len(context.tokens) < self.settings.snapshot_min_tokens:
            return f"shorter than {self.settings.snapshot_min_tokens} tokens"
        return "the tiers are full or off"

    def _save(self, context: WarmContext, host: Host, *, persist: bool = False) -> str:
        """Snapshot a context's prefix into the tiers before its cells go; the tier, or "".

        ``persist`` also writes it to the disk tier now (an orderly stop)."""
        if self.tiers is None or not context.tokens:
            return ""
        n = context.prefix_tokens or len(context.tokens)
        if n < self.settings.snapshot_min_tokens:
            return ""
        if context.saved_key:
            for entry in self.tiers.entries(self.model_digest):
                covers = entry.tokens == context.tokens[: len(entry.tokens)] and len(entry.tokens) >= n
                if entry.key == context.saved_key and covers:
                    if persist:
                        self.tiers.persist(entry)
                    return entry.tier
        if n < len(context.tokens):
            if not self.layout.can_truncate:
                return ""
            host.sync(context.seq, n, ())
            self._ledger.truncate(context.seq, n)
            context.tokens = context.tokens[:n]
            context.generation += 1
        try:
            blob = host.snapshot(context.seq)
        except ModeldError as exc:
            log.warning("could not snapshot warm context %s: %s", context.id, exc.message)
            return ""
        saved = self.tiers.put(
            model_digest=self.model_digest,
            identity=context.identity,
            snapshot_format=self.layout.snapshot_format,
            tokens=context.tokens,
            prefix_tokens=n,
            blob=blob,
            truncatable=self.layout.can_truncate,
            persist=persist,
        )
        if saved is None:
            return ""
        entry = saved
        self.counters["snapshots_taken"] += 1
        context.saved_key = entry.key
        return entry.tier

    def _save_before_overwrite(self, own: WarmContext, keep: int, host: Host) -> None:
        """llama-server's rule: a context about to lose more than half its prefix is saved first."""
        prefix = own.prefix_tokens or len(own.tokens)
        if prefix >= self.settings.snapshot_min_tokens and keep < prefix // 2 and not own.busy:
            self._save(own, host)

    # --- after the engine worked ---------------------------------------------------------------

    def synced(self, lease: Lease, *, kept: int, resident: int, target: Sequence[int]) -> None:
        """Record what a sync job left in the lease's sequence (the engine's own counts)."""
        with self._lock:
            context = lease.context
            if self._contexts.get(context.seq) is not context:
                return  # the engine was reset meanwhile
            self._ledger.truncate(context.seq, kept)
            self._ledger.extend(context.seq, resident - kept)
            context.tokens = list(target[:resident])
            context.generation += 1
            if lease.context.owner is not None:
                lease.context.owner.seen_generation = context.generation

    def generated(self, lease: Lease, tokens: Sequence[int], resident: int) -> None:
        """Record a generate job: ``tokens`` were sampled; the sequence holds ``resident``."""
        with self._lock:
            context = lease.context
            if self._contexts.get(context.seq) is not context:
                return
            full = context.tokens + list(tokens)
            before = len(context.tokens)
            context.tokens = full[:resident]
            self._ledger.truncate(context.seq, min(before, resident))
            self._ledger.extend(context.seq, resident - min(before, resident))
            context.generation += 1
            if context.owner is not None:
                context.owner.seen_generation = context.generation

    def set_prefix(self, lease: Lease, prefix_tokens: int) -> None:
        with self._lock:
            lease.context.prefix_tokens = prefix_tokens
            lease.context.floor = 0

    def release(self, lease: Lease) -> None:
        with self._lock:
            lease.context.busy = False
            lease.context.floor = 0
            lease.context.last_used = time.time()

    def fail(self, lease: Lease, error: ModeldError, *, engine_alive: bool) -> None:
        """A job failed: what the sequence holds is unknown, so it is emptied (when the engine
        died, its restart empties everything anyway: nothing is sent to it)."""
        with self._lock:
            context = lease.context
            context.busy = False
            if self._contexts.get(context.seq) is not context:
                return
            if engine_alive:
                with contextlib.suppress(ModeldError):
                    self._host().drop(context.seq)
            self._ledger.drop(context.seq)
            context.tokens = []
            context.prefix_tokens = 0
            context.generation += 1
            if context.owner is not None:
                context.owner.loss = Loss("engine_reset", error.message)

    def persist_prefix(self, lease: Lease, computed: int) -> None:
        """After an ensure_prefix that computed ``computed`` tokens: snapshot the prefix and
        write it to disk in the background, so it survives a crash of the daemon.

        The snapshot request reaches the engine before this returns, so the engine takes it
        before any later job on the sequence: the blob is exactly the prefix."""
        if self.tiers is None or computed <= 0:
            return
        persist = self.tiers.disk_on and computed >= self.settings.persist_min_tokens
        # Memory that cannot be cut has no other way back to the prefix once a suffix or a
        # decode extended it: its state at the prefix boundary is kept in the RAM tier.
        boundary = not self.layout.can_truncate
        if not (persist or boundary):
            return
        context = lease.context
        tokens = list(context.tokens)
        if len(tokens) < self.settings.snapshot_min_tokens:
            return
        call = self._host().start_snapshot(context.seq)
        prefix = context.prefix_tokens

        def finish() -> None:
            try:
                blob = call.result(Result).payload
            except ModeldError as exc:
                log.warning(
                    "could not snapshot warm context %s for the disk tier: %s", context.id, exc.message
                )
                return
            assert self.tiers is not None
            entry = self.tiers.put(
                model_digest=self.model_digest,
                identity=context.identity,
                snapshot_format=self.layout.snapshot_format,
                tokens=tokens,
                prefix_tokens=prefix,
                blob=blob,
                truncatable=self.layout.can_truncate,
                persist=persist,
            )
            if entry is not None:
                with self._lock:
                    self.counters["snapshots_taken"] += 1
                    if context.tokens[: len(tokens)] == tokens:
                        context.saved_key = entry.key

        with self._lock:
            self._saving = [f for f in self._saving if not f.done()]
            self._saving.append(self._background.submit(finish))

    def _settle(self) -> None:
        """Wait for snapshots taken in the background (a choice must see every tier entry)."""
        with self._lock:
            pending = [f for f in self._saving if not f.done()]
        for future in pending:
            with contextlib.suppress(Exception):
                future.result(timeout=60)

    # --- whole-pool events ------------------------------------------------------------------------

    def reset(self, error: ModeldError) -> None:
        """The engine lost every sequence (its worker died or the model was unloaded)."""
        with self._lock:
            for context in self._contexts.values():
                if context.owner is not None:
                    context.owner.loss = Loss("engine_reset", error.message)
                    context.owner.context = None
            self._contexts.clear()
            self._ledger = Ledger(self.layout.shared_cells)

    def retire(self, why: str, kind: str = "evicted") -> None:
        """Save every warm context to the tiers (as far as the budgets allow) and forget them:
        the model is being unloaded or the daemon is stopping."""
        host = self._host()
        with self._lock:
            for context in list(self._contexts.values()):
                if context.busy:
                    continue
                tier = ""
                with contextlib.suppress(ModeldError):
                    tier = self._save(context, host)
                if context.owner is not None:
                    where = f"saved to the {tier} tier" if tier else "not saved"
                    context.owner.loss = Loss(kind, f"{why}; {where}", tier or "none")
                    context.owner.context = None
            self._contexts.clear()
            self._ledger = Ledger(self.layout.shared_cells)

    def persist_all(self) -> None:
        """Write every warm context's prefix to the disk tier (an orderly daemon stop)."""
        if self.tiers is None or not self.tiers.disk_on:
            return
        self._background.shutdown(wait=True)  # earlier write-behind snapshots first
        host = self._host()
        with self._lock:
            for context in list(self._contexts.values()):
                if not context.busy:
                    with contextlib.suppress(ModeldError):
                        self._save(context, host, persist=True)

    def expire(self, now: float) -> None:
        """Evict contexts idle past their session's keep-alive (to the tiers)."""
        host: Host | None = None
        with self._lock:
            for context in list(self._contexts.values()):
                owner = context.owner
                if owner is None or owner.keep_alive is None or context.busy or owner.pinned:
                    continue
                if now - context.last_used > owner.keep_alive:
                    host = host or self._host()
                    self._evict(context, host, f"idle for more than its keep-alive of {owner.keep_alive:g}s")

    def close(self) -> None:
        self._background.shutdown(wait=True)

    # --- observers ----------------------------------------------------------------------------

    def kv_tokens(self, slot: SessionSlot, tokens: Sequence[int]) -> int:
        """How many of a session's tokens its warm context holds in the KV pool now."""
        context = slot.context
        if context is None or self._contexts.get(context.seq) is not context:
            return 0
        return common_prefix_len(list(context.tokens), list(tokens))

    def views(self) -> list[ContextView]:
        """Every warm context, for status and explain-context. Never waits long: an operation
        holds the lock across engine calls, and a hung engine must not hang ``modeld status``
        (past 0.2 s the view is read without the lock, a moment's state)."""
        per_token = self.layout.kv_bytes_per_token
        locked = self._lock.acquire(timeout=0.2)
        try:
            out = [
                ContextView(
                    id=c.id,
                    tier="kv",
                    tokens=len(c.tokens),
                    prefix_tokens=c.prefix_tokens,
                    bytes=self._ledger.unique(c.seq) * per_token,
                    shared_bytes=self._ledger.shared_with(c.seq) * per_token,
                    last_used=c.last_used,
                    pinned=bool(c.owner is not None and c.owner.pinned),
                    session=c.owner.session_id if c.owner is not None else "",
                    seq=c.seq,
                )
                for c in sorted(list(self._contexts.values()), key=lambda c: c.seq)
            ]
        finally:
            if locked:
                self._lock.release()
        if self.tiers is not None:
            for e in self.tiers.entries(self.model_digest):
                out.append(
                    ContextView(
                        id=e.key[-8:],
                        tier=e.tier,
                        tokens=len(e.tokens),
                        prefix_tokens=e.prefix_tokens,
                        bytes=e.nbytes,
                        shared_bytes=0,
                        last_used=e.last_used,
                        pinned=False,
                        session="",
                    )
                )
        return out

    def used_cells(self) -> int:
        locked = self._lock.acquire(timeout=0.2)  # as views(): never hang an observer
        try:
            return self._ledger.used()
        finally:
            if locked:
                self._lock.release()


class _NoRoom(Exception):  # noqa: N818 - internal control flow
    """No sequence can be freed except the one holding the chosen source."""


_PENDING = ReuseDecision(outcome="cold", reason="empty_cache", message="")
"""Placeholder until :meth:`ModelCache.begin` classifies the lease."""
