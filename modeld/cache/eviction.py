"""Room in the KV pool: which warm context goes, and its prefix saved to a tier before it does.

* **Victim**: the least valuable context that is not busy and not pinned: the highest idle
  seconds per 1k tokens it would cost to recompute (:func:`score`), a detached context (its
  session closed) four times sooner.
* **Save before evict**: an evicted context is snapshotted whole (every token it holds: its
  prefix, its last suffix and decode) into the RAM tier (from there it moves to disk), or written
  to disk when the RAM tier has no room; nothing when a tier holds all of its tokens already. Its
  session's next turn says where it went (``evicted`` with the tier). A session's own context
  about to be overwritten by something that keeps less than half of its prefix is saved too
  (llama-server's ``f_keep < 0.5`` rule).
* **Room**: a free sequence for a session that has none, and (unified pool) free cells for the
  tokens a turn will add beside what running operations reserved (``Pool.reserved``); when only
  busy or pinned contexts could give way, :class:`NeedRoom` says whether waiting helps.
* **Idle contexts leave a unified pool when they cost more than moving them**
  (:func:`leave_idle`): where a sequence's attention spans every used cell of the pool, a turn
  that starts evicts the idle contexts whose attention cost, measured (``cost.py``), exceeds a
  snapshot and a restore, as llama-server moves its idle slots to its RAM cache.
* **Write-behind** (:class:`WriteBehind`, :func:`to_disk`): a long prefix just computed is
  written to the disk tier by the engine itself and sealed in the background, so it survives a
  crash of the worker or the daemon; the context stays in the KV pool and the RAM tier holds no
  copy of it (a byte is held once). Memory that cannot be cut keeps its state at the prefix
  boundary in the RAM tier when it is not written to disk.

Every function takes the model's :class:`~modeld.cache.pool.Pool`, whose lock the caller holds,
and reaches the engine through :class:`~modeld.cache.runtime.KVRuntime`. Design record:
``blueprints/0016-warm-state.md``.
"""

from __future__ import annotations

import contextlib
import logging
import threading
import time
from collections.abc import Callable, Sequence
from concurrent.futures import Future, ThreadPoolExecutor

from modeld.cache.pool import Pool, SessionSlot, WarmContext
from modeld.cache.reuse import Loss, common_prefix_len
from modeld.cache.runtime import KVRuntime
from modeld.cache.tiers import TierEntry
from modeld.errors import ModeldError

__all__ = [
    "NeedRoom",
    "ahead",
    "NoRoom",
    "WriteBehind",
    "covered",
    "evict",
    "evictable",
    "kind",
    "leave_idle",
    "make_room",
    "new_context",
    "save",
    "save_before_overwrite",
    "saved_entry",
    "score",
    "share_start",
    "store",
    "to_disk",
    "victim",
]

log = logging.getLogger("modeld.cache")

DETACHED_WEIGHT = 4.0
"""A detached context (its session closed) serves nobody right now: it goes this much sooner."""

KIND_WEIGHT = {"tool_calls": 0.25, "one-off": 4.0}
"""How much sooner a context goes by what it is (:func:`kind`): an agent whose turn ended in a
tool call comes back when the tool returns (its history stays: 4x later); a one-off (one
request, answered: a title, a quota check) is not coming back (4x sooner); a finished agent
(a sub-agent's final answer, a turn waiting for a person) between the two."""


class NoRoom(Exception):  # noqa: N818 - internal control flow
    """No sequence can be freed except the one holding the chosen source."""


class NeedRoom(Exception):  # noqa: N818 - internal control flow
    """The turn needs cells (or a sequence) that busy contexts hold now: they free up when their
    operations end (``waitable``), and the cache waits for that; or only pinned contexts hold
    them, or the turn needs more than the pool has beside them, and no wait helps (``why``)."""

    def __init__(self, why: str, *, waitable: bool, needed: int = 0) -> None:
        super().__init__(why)
        self.why = why
        self.waitable = waitable
        self.needed = needed


def kind(context: WarmContext) -> str:
    """What a context is, from how its decodes ended: ``tool_calls`` (an agent running a tool),
    ``one-off`` (one request, answered), ``finished`` (an agent's answer after several turns: a
    sub-agent that ended, or a turn waiting for a person), or ``""`` (no decode ended on it)."""
    if context.ended == "tool_calls":
        return "tool_calls"
    if context.ended and context.turns <= 1:
        return "one-off"
    return "finished" if context.ended else ""


def score(context: WarmContext, now: float) -> float:
    """How little a context is worth keeping: idle seconds per 1k tokens it holds (the larger,
    the costlier to move and to lose), a detached one :data:`DETACHED_WEIGHT` times sooner, and
    by its :func:`kind` (:data:`KIND_WEIGHT`)."""
    value = (now - context.last_used + 1.0) / (1.0 + len(context.tokens) / 1024.0)
    value *= KIND_WEIGHT.get(kind(context), 1.0)
    return value * DETACHED_WEIGHT if context.owner is None else value


def evictable(pool: Pool) -> list[WarmContext]:
    """The contexts that may be evicted: neither busy nor pinned."""
    return [c for c in pool.contexts.values() if not c.busy and not (c.owner is not None and c.owner.pinned)]


def ahead(context: WarmContext, of: WarmContext | None, now: float) -> bool:
    """``context`` is inside a turn that began before ``of``'s (which then waits for it, never
    takes its cells in the middle of it: ``WarmContext.turn_started``)."""
    if of is None or context.turn_until <= now:
        return False
    return context.turn_started < (of.turn_started or now)


def victim(pool: Pool, exclude: set[WarmContext], *, turn: WarmContext | None = None) -> WarmContext | None:
    """The evictable context with the highest :func:`score` (never busy, pinned or excluded); a
    context inside its own turn (its decode to come: ``WarmContext.turn_until``) only when no
    other is left (it would come back at once), and never one whose turn began before ``turn``'s
    (:func:`ahead`: the later turn waits for it)."""
    now = time.time()
    best: WarmContext | None = None
    best_score = -1.0
    for context in evictable(pool):
        if context in exclude or ahead(context, turn, now):
            continue
        value = score(context, now) + (0.0 if context.turn_until > now else 1e12)
        if value > best_score:
            best, best_score = context, value
    return best


def new_context(
    pool: Pool, slot: SessionSlot, runtime: KVRuntime, keep_away: WarmContext | None
) -> WarmContext:
    """A fresh context for a session that has none, on a free sequence or on an evicted one's.

    Raises :class:`NoRoom` when the only sequence that could be freed is ``keep_away`` (the
    source the turn wants to copy from), and :class:`NeedRoom` when every sequence is busy or
    pinned (waiting helps when some are busy)."""
    free = pool.free_seqs()
    if not free:
        chosen = victim(pool, exclude={keep_away} if keep_away is not None else set())
        if chosen is None and keep_away is not None and victim(pool, exclude=set()) is keep_away:
            raise NoRoom
        if chosen is None:
            busy = sum(1 for c in pool.contexts.values() if c.busy)
            raise NeedRoom(
                f"all {pool.layout.n_seq} sequences of {pool.name} (--sequences) hold busy or "
                f"pinned contexts ({busy} busy)",
                waitable=busy > 0,
            )
        evict(pool, chosen, runtime, "its sequence was needed by another session")
        free = [chosen.seq]
    return pool.add(slot, free[0])


def make_room(
    pool: Pool, dst: WarmContext, keep: int, new_cells: int, runtime: KVRuntime, *, in_line: bool = True
) -> None:
    """Free cells for ``new_cells`` more tokens in ``dst`` after its first ``keep`` (only a
    unified pool is shared). What ``dst`` holds beyond ``keep`` (the last turn's suffix and
    decode) is freed by the turn's own cut, so it is not counted as in use; what running
    operations reserved (``Pool.reserved``) is. ``in_line``: a turn that began before ``dst``'s
    keeps its cells (:func:`ahead`; a decode growing in the middle of its turn takes them).
    Raises :class:`NeedRoom` when only busy or pinned contexts are left to give way."""
    layout = pool.layout
    if not layout.shared_cells or not layout.explicit:
        return
    while (
        pool.ledger.used(cut=(dst.seq, keep)) + pool.reserved_beside(dst.seq) + max(0, new_cells)
        > layout.pool_tokens
    ):
        chosen = victim(pool, exclude={dst}, turn=dst if in_line else None)
        if chosen is None:
            raise _no_room(pool, dst, keep, new_cells, in_line)
        evict(pool, chosen, runtime, "its cells were needed by another session")


def _no_room(pool: Pool, dst: WarmContext, keep: int, new_cells: int, in_line: bool) -> NeedRoom:
    """Why ``new_cells`` more cells for ``dst`` cannot be had now, and whether waiting helps:
    cells held by busy contexts free up when their operations end; pinned ones do not."""
    layout = pool.layout
    ledger = pool.ledger
    now = time.time()
    turn = dst if in_line else None
    evict_ok = set(evictable(pool))  # a pinned context's turn ending frees nothing
    running = {
        c
        for c in pool.contexts.values()
        if c is not dst and (c.busy or (c in evict_ok and ahead(c, turn, now)))
    }
    pinned = sum(ledger.unique(c.seq) for c in pool.contexts.values() if c is not dst and c not in running)
    busy = sum(ledger.unique(c.seq) for c in running)
    busy += pool.reserved_beside(dst.seq)
    need = min(keep, ledger.length(dst.seq)) + max(0, new_cells)
    if need > layout.pool_tokens:
        return NeedRoom(
            f"the turn needs {need} KV cells; the pool has {layout.pool_tokens} (--kv-pool-tokens)",
            waitable=False,
            needed=need,
        )
    if need + pinned > layout.pool_tokens:
        return NeedRoom(
            f"the turn needs {need} KV cells and pinned contexts hold {pinned} of the pool's "
            f"{layout.pool_tokens} (--kv-pool-tokens); they stay until their sessions close",
            waitable=False,
            needed=need,
        )
    return NeedRoom(
        f"the turn needs {need} KV cells of the pool's {layout.pool_tokens}; running operations "
        f"and turns that began first hold {busy}" + (f" and pinned contexts {pinned}" if pinned else ""),
        waitable=busy > 0,
        needed=need,
    )


def evict(pool: Pool, context: WarmContext, runtime: KVRuntime, why: str) -> None:
    """Save all of a context's tokens to a tier (nothing when a tier holds them already), free
    its cells, and tell its session where it went. A context leaves the KV whole: its prefix,
    its last suffix and what it decoded (the next turn of a chat resends them), so nothing it
    computed is computed again."""
    tokens = len(context.tokens)
    whole = pool.layout.whole_snapshots
    tier = save(pool, context, runtime, whole=whole)
    runtime.drop(context.seq)
    pool.remove(context)
    pool.counters[f"evicted_to_{tier}" if tier else "evicted_dropped"] += 1
    owner = context.owner
    if tier and whole:
        where = f"all {tokens} of its tokens are in the {tier} tier"
    elif tier:
        where = (
            f"its state at its {context.prefix_tokens}-token prefix is in the {tier} tier (memory "
            "that cannot be cut is kept at the prefix)"
        )
    else:
        where = "not saved: " + _no_save_reason(pool, context)
    if owner is not None:
        owner.loss = Loss("evicted", f"{why}; {where}", tier or "none")
        owner.context = None
    log.info("evicted warm context %s (%d tokens) from %s: %s; %s", context.id, tokens, pool.name, why, where)


def _no_save_reason(pool: Pool, context: WarmContext) -> str:
    if pool.tiers is None:
        return "this backend has no snapshots" if not pool.layout.snapshots else "the tiers are off"
    if len(context.tokens) < pool.settings.snapshot_min_tokens:
        return f"shorter than {pool.settings.snapshot_min_tokens} tokens"
    return "the tiers are full or off"


def save(
    pool: Pool, context: WarmContext, runtime: KVRuntime, *, persist: bool = False, whole: bool = False
) -> str:
    """Snapshot a context into the tiers before its cells go; the tier, or "".

    ``whole`` keeps every resident token (an eviction; a drain: the conversation's next turn
    extends what was generated too), else its prefix (the context is cut to it first).
    ``persist`` also writes it to the disk tier now (an orderly stop). A tier entry that holds
    those tokens already is used as is (nothing is copied); else the snapshot goes to the RAM
    tier when it has room (the cheaper move, as llama-server's host-memory cache), or is written
    to disk by the engine itself. Each move is timed for :class:`~modeld.cache.cost.Costs`."""
    tiers = pool.tiers
    if tiers is None or not context.tokens:
        return ""
    n = (
        len(context.tokens)
        if whole
        else min(context.prefix_tokens or len(context.tokens), len(context.tokens))
    )
    if n < pool.settings.snapshot_min_tokens:
        return ""
    held = saved_entry(pool, context, n)
    if held is not None:
        if persist:
            tiers.persist(held)
        return held.tier
    if n < len(context.tokens):
        if not pool.layout.can_truncate:
            return ""
        runtime.sync(context.seq, n, ()).wait()
        pool.ledger.truncate(context.seq, n)
        context.tokens = context.tokens[:n]
        context.generation += 1
    # Room in RAM before the blob comes (the tier within its limit with it): its cells, and a
    # recurrent state with the checkpoints that travel with it (157 MiB each on a 27B hybrid).
    # A blob the RAM tier cannot hold at all is written to disk by the engine, never passing
    # through here.
    to_ram = not persist and tiers.make_ram_room(pool.layout.snapshot_bytes(n))
    started = time.perf_counter()
    if not to_ram and tiers.disk_on:
        finish = to_disk(pool, context, runtime, through=persist)
        if finish is None:
            return "disk" if context.saved_key else ""
        if not finish():
            return ""
        pool.costs.moved("save_disk", n, (time.perf_counter() - started) * 1000.0)
        pool.counters["snapshots_taken"] += 1
        return "disk"
    try:
        blob = runtime.snapshot(context.seq).result()
    except ModeldError as exc:
        log.warning("could not snapshot warm context %s: %s", context.id, exc.message)
        return ""
    pool.costs.moved("save_ram", n, (time.perf_counter() - started) * 1000.0)
    prefix = min(context.prefix_tokens, n) if whole and context.prefix_tokens else n
    saved = store(pool, context, context.tokens, prefix, blob, remote=persist)
    return saved.tier if saved is not None else ""


def _entry_of(pool: Pool, context: WarmContext) -> TierEntry | None:
    """The tier entry last written from ``context`` (or restored into it), if still there."""
    if pool.tiers is None or not context.saved_key or not context.tokens:
        return None
    entry = pool.tiers.get(context.saved_key)
    return entry if entry is not None and entry.model_digest == pool.model_digest else None


def saved_entry(pool: Pool, context: WarmContext, n: int = 0) -> TierEntry | None:
    """The tier entry that holds ``context``'s first ``n`` tokens already (default: its prefix),
    or None: evicting the context then costs no copy."""
    entry = _entry_of(pool, context)
    n = n or min(context.prefix_tokens or len(context.tokens), len(context.tokens))
    if entry is None or len(entry.tokens) < n:
        return None
    return entry if entry.tokens == context.tokens[: len(entry.tokens)] else None


def covered(pool: Pool, context: WarmContext) -> tuple[TierEntry | None, int]:
    """The tier entry holding the start of ``context``'s prefix, and how many prefix tokens it
    lacks (0: all of them; with no entry, the whole prefix). An entry the context diverged from
    counts where the engine can cut a restored sequence (a restore then reuses what the two
    share): a chat's prefix takes the turn's new messages, so its disk copy, written when a turn
    computed at least ``persist_min_tokens``, differs from the context after the last such turn."""
    entry = _entry_of(pool, context)
    n = min(context.prefix_tokens or len(context.tokens), len(context.tokens))
    if entry is None:
        return None, n
    shared = common_prefix_len(entry.tokens, context.tokens)
    if shared < len(entry.tokens) and not pool.layout.whole_snapshots:
        return None, n
    return entry, max(0, n - shared)


def leave_idle(
    pool: Pool,
    runtime: KVRuntime,
    keep: set[WarmContext],
    why: str,
    prefill: int,
    *,
    suffix_known: bool = False,
) -> int:
    """Evict the idle contexts whose cells cost the turn that starts more than moving them out
    and back (:meth:`~modeld.cache.cost.Costs.worth_leaving`: the attention over their cells,
    measured on this engine, against a snapshot, none when a tier holds all of their tokens
    already, and a restore), except ``keep``, on a layout whose attention spans the pool
    (``Layout.attention_spans_pool``); the turn prefills ``prefill`` tokens now (its suffix, when
    ``suffix_known``: no suffix measured over earlier turns is added). A context that
    leaves keeps all of its tokens (:func:`evict`). Not idle: busy, pinned, or inside its own
    turn (``WarmContext.turn_until``). Returns how many went."""
    if not pool.layout.attention_spans_pool:
        return 0
    now = time.time()
    costs = pool.costs
    gone = 0
    for context in evictable(pool):
        if context in keep or context.turn_until > now:
            continue
        cells = pool.ledger.unique(context.seq)
        held = saved_entry(pool, context, len(context.tokens))
        saved = held.tier if held is not None else ""
        returning = 1.0 / DETACHED_WEIGHT if context.owner is None else 1.0
        if not costs.worth_leaving(
            cells, len(context.tokens), saved, prefill, returning, suffix_known=suffix_known
        ):
            continue
        stay = costs.stay_ms(cells, prefill, suffix_known=suffix_known)
        leave = costs.leave_ms(len(context.tokens), saved, returning)
        evict(
            pool,
            context,
            runtime,
            f"{why}: its {cells} cells would cost the turn that started about {stay:.0f} ms of "
            f"attention (measured), moving it out and back about {leave:.0f} ms",
        )
        gone += 1
    return gone


def store(
    pool: Pool, context: WarmContext, tokens: Sequence[int], prefix: int, blob: bytes, *, remote: bool = False
) -> TierEntry | None:
    """Put a snapshot of ``context`` (holding ``tokens``) into the tiers and count it
    (``remote``: write it through to the remote tier too)."""
    assert pool.tiers is not None
    entry = pool.tiers.put(
        model_digest=pool.model_digest,
        identity=context.identity,
        snapshot_format=pool.layout.snapshot_format,
        tokens=tokens,
        prefix_tokens=prefix,
        blob=blob,
        truncatable=pool.layout.can_truncate,
        remote=remote,
    )
    if entry is not None:
        pool.counters["snapshots_taken"] += 1
        if context.tokens[: len(tokens)] == list(tokens):
            context.saved_key = entry.key
    return entry


def to_disk(
    pool: Pool, context: WarmContext, runtime: KVRuntime, *, through: bool = True
) -> Callable[[], bool] | None:
    """Have the engine write ``context`` (which stays in the KV pool) into a disk-tier file
    itself: its blob never reaches the daemon, and no RAM-tier copy is made (a byte is held
    once). The request is on its way when this returns (so the engine saves the sequence
    before any later job changes it); the function returned waits for the engine and hands the
    file to the tier's writer, which seals it in the background (True: written). None when
    nothing is to be written: an entry holds these tokens already (remembered as the
    context's), or the disk tier is off. Call with the cache's lock held."""
    tiers = pool.tiers
    assert tiers is not None
    tokens = list(context.tokens)
    reserved = tiers.reserve(
        model_digest=pool.model_digest,
        identity=context.identity,
        snapshot_format=pool.layout.snapshot_format,
        tokens=tokens,
        prefix_tokens=context.prefix_tokens,
        truncatable=pool.layout.can_truncate,
        through=through,
    )
    if reserved is None:
        return None
    entry, tmp = reserved
    context.saved_key = entry.key
    if tmp is None:
        return None
    try:
        pending = runtime.save(context.seq, str(tmp))
    except ModeldError:
        tiers.abandon(entry)
        raise

    def finish() -> bool:
        try:
            saved = pending.result()
        except ModeldError as exc:
            tiers.abandon(entry)
            log.warning("could not write warm context %s to the disk tier: %s", context.id, exc.message)
            return False
        tiers.seal(entry, saved)
        return saved.ok

    return finish


SHARE_MIN_TOKENS = 64
"""A restored context shares the start it has in common with a resident one from this many
tokens on (:func:`share_start`)."""

SHARE_BELOW = 0.25
"""... and only when the pool's free cells are fewer than this share of it after the restore."""


def share_start(pool: Pool, dst: WarmContext, runtime: KVRuntime) -> int:
    """A context just restored into cells of its own shares the start it has in common with a
    resident context of the same identity (a system prompt two sub-agents share): those cells
    are held once again, as a copy holds them (``KVRuntime.share``; a busy source only up to its
    floor). Returns the cells freed. Only where cells are shared (a unified pool), and only when
    the pool runs short (fewer than :data:`SHARE_BELOW` of its cells free): the shared cells were
    computed by the other context, so the restored one then attends over values summed in another
    order (the unified pool's numerics, blueprint 0016); with room to spare it keeps its own."""
    layout = pool.layout
    if not (layout.shared_cells and layout.can_truncate and layout.explicit) or not dst.tokens:
        return 0
    free = layout.pool_tokens - pool.ledger.used() - pool.reserved_beside(dst.seq)
    if free >= SHARE_BELOW * layout.pool_tokens:
        return 0
    best: WarmContext | None = None
    n = 0
    for context in pool.contexts.values():
        if context is dst or context.identity != dst.identity or not context.tokens:
            continue
        k = common_prefix_len(context.tokens, dst.tokens)
        if context.busy:
            k = min(k, context.floor)
        if k > n:
            best, n = context, k
    if best is None or n < SHARE_MIN_TOKENS:
        return 0
    before = pool.ledger.used()
    if not runtime.share(best.seq, dst.seq, n):
        return 0
    pool.ledger.share(best.seq, dst.seq, n)
    freed = before - pool.ledger.used()
    log.debug("%s: restored context %s shares its first %d tokens with %s", pool.name, dst.id, n, best.id)
    return freed


def save_before_overwrite(pool: Pool, own: WarmContext, keep: int, runtime: KVRuntime) -> None:
    """llama-server's rule: a context about to lose more than half its prefix is saved first."""
    prefix = own.prefix_tokens or len(own.tokens)
    if prefix >= pool.settings.snapshot_min_tokens and keep < prefix // 2 and not own.busy:
        save(pool, own, runtime)


class WriteBehind:
    """Snapshots of just-computed prefixes, stored into the tiers on a background thread."""

    def __init__(self, pool: Pool, lock: threading.RLock) -> None:
        self._pool = pool
        self._lock = lock
        self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix=f"kv-save-{pool.name[:8]}")
        self._pending: list[Future[object]] = []

    def write_behind(self, context: WarmContext, computed: int, runtime: KVRuntime) -> None:
        """After a prefix that computed ``computed`` tokens: have the engine write it to the
        disk tier when long enough (crash safety; :func:`to_disk`: never a RAM copy of a
        context that is in the KV pool), and for memory that cannot be cut keep its state at
        the prefix boundary in the RAM tier when it is not written to disk.

        The request reaches the engine before this returns, so the engine takes the snapshot
        before any later job on the sequence: it is exactly the prefix."""
        pool = self._pool
        tiers = pool.tiers
        if tiers is None or computed <= 0 or len(context.tokens) < pool.settings.snapshot_min_tokens:
            return
        # A turn long enough, or short turns that together left that much of the prefix out of
        # its disk copy (a chat's prefix grows by a turn's messages): the copy is written anew.
        _entry, unsaved = covered(pool, context)
        if tiers.disk_on and max(computed, unsaved) >= pool.settings.persist_min_tokens:
            with self._lock:
                finish = to_disk(pool, context, runtime)
            if finish is not None:
                written = finish

                def count() -> None:
                    if written():
                        with self._lock:
                            pool.counters["snapshots_taken"] += 1

                self._submit(count)
            return
        # Without a disk tier, a long prefix goes to the remote tier only (the shared store,
        # blueprint 0020): the blob passes through the daemon, no RAM-tier copy is kept. Memory
        # that cannot be cut has no other way back to the prefix once a suffix or a decode
        # extended it: its state at the prefix boundary (not what the KV will hold) goes to RAM.
        remote = tiers.remote is not None and computed >= pool.settings.persist_min_tokens
        boundary = not pool.layout.can_truncate
        if not (remote or boundary):
            return
        tokens = list(context.tokens)
        pending = runtime.snapshot(context.seq)
        prefix = context.prefix_tokens

        def finish_boundary() -> None:
            try:
                blob = pending.result()
            except ModeldError as exc:
                log.warning("could not snapshot warm context %s: %s", context.id, exc.message)
                return
            with self._lock:
                if boundary:
                    store(pool, context, tokens, prefix, blob, remote=remote)
                else:
                    tiers.write_remote(
                        model_digest=pool.model_digest,
                        identity=context.identity,
                        snapshot_format=pool.layout.snapshot_format,
                        tokens=tokens,
                        prefix_tokens=prefix,
                        blob=blob,
                    )
                    pool.counters["snapshots_taken"] += 1

        self._submit(finish_boundary)

    def _submit(self, job: Callable[[], object]) -> None:
        with self._lock:
            self._pending = [f for f in self._pending if not f.done()]
            self._pending.append(self._executor.submit(job))

    def settle(self) -> None:
        """Wait for the snapshots on their way (a choice must see every tier entry)."""
        with self._lock:
            pending = [f for f in self._pending if not f.done()]
        for future in pending:
            with contextlib.suppress(Exception):
                future.result(timeout=60)

    def close(self) -> None:
        """Finish every snapshot on its way; take no more."""
        self._executor.shutdown(wait=True)
