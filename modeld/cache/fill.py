"""What a turn's context is filled with when it is not already there: a tier snapshot restored
into it (:func:`restore`), and the tokens its session computed before that it computes again,
said (:func:`recomputed`). Both run under the cache's lock, in ``ModelCache.hold``
(``warm.py``); design record: ``blueprints/0016-warm-state.md``."""

from __future__ import annotations

import logging
import time
from dataclasses import replace

from modeld.cache import eviction
from modeld.cache.choice import Choice
from modeld.cache.hold import Hold
from modeld.cache.pool import Pool, SessionSlot
from modeld.cache.reuse import Candidate, Loss, common_prefix_len
from modeld.cache.runtime import KVRuntime
from modeld.cache.snapfile import SnapshotError
from modeld.cache.tiers import TierEntry

__all__ = ["recomputed", "restore"]

log = logging.getLogger("modeld.cache")


def restore(
    pool: Pool, slot: SessionSlot, hold: Hold, entry: TierEntry, keep: int, runtime: KVRuntime
) -> None:
    """Restore ``entry`` (a tier snapshot) into the hold's context, keeping ``keep`` of its
    tokens for the turn; a snapshot the tier or the engine refuses is said (``slot.loss``), and
    the turn starts from nothing."""
    assert pool.tiers is not None
    dst = hold.context
    started = time.perf_counter()
    tier = entry.tier  # where it comes from (a restore may move it out of RAM)
    # The snapshot replaces what dst holds: room for its cells first. A unified pool full of
    # other warm contexts makes the engine refuse it, and a good snapshot must not be
    # rejected (and removed: from the shared store, for every box) for want of room.
    try:
        blob = pool.tiers.load(entry)
    except SnapshotError as exc:
        pool.counters["snapshots_rejected"] += 1
        slot.loss = Loss("snapshot_rejected", str(exc))
        return
    loaded = time.perf_counter()
    eviction.make_room(pool, dst, 0, len(entry.tokens), runtime)
    moving = time.perf_counter()
    restored = runtime.restore(dst.seq, entry.tokens, blob)
    if restored.ok and tier in ("ram", "disk"):
        ms = (loaded - started + time.perf_counter() - moving) * 1000.0  # not the room's evictions
        pool.costs.moved(f"restore_{tier}", len(entry.tokens), ms)
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
    eviction.share_start(pool, dst, runtime)  # a start another context holds: stored once
    pool.tiers.touch(entry)
    own = len(slot.computed) >= len(entry.tokens) and slot.computed[: len(entry.tokens)] == entry.tokens
    if keep >= len(entry.tokens) or own:
        # The KV pool holds the whole entry again (a prefix of it, or what this session
        # computed last, its suffix to follow): its RAM copy goes (moved, not copied; a
        # disk copy stays, or is written first, for a worker crash).
        pool.tiers.take(entry)
    hold.keep = keep
    hold.tier = tier
    hold.source = Candidate(tier, entry.short_id, entry.prefix_tokens, own=False)
    hold.restore_ms = (time.perf_counter() - started) * 1000.0


def recomputed(pool: Pool, slot: SessionSlot, hold: Hold, target: list[int], choice: Choice) -> None:
    """A turn that will compute tokens its session had in its warm context before says
    where they went, in its decision and in the log, and counts them (``recomputed``)."""
    if hold.keep >= min(len(slot.computed), len(target)):
        return  # nothing it computed before lies past what it keeps (a warm turn: no compare)
    before = common_prefix_len(slot.computed, target)
    again = before - hold.keep
    if again <= 0:
        return
    pool.counters["recomputed"] += again
    if slot.loss is not None:
        where = f"its warm context was {slot.loss.kind.replace('_', ' ')}: {slot.loss.message}"
    elif choice.entry is not None and hold.tier != "kv":
        where = f"the {hold.tier} tier's copy it came back from held {len(choice.entry.tokens)} tokens"
    else:
        where = "its warm context no longer held them"
    said = f"{again} tokens this session computed before are computed again: {where}"
    hold.decision = replace(hold.decision, message=f"{hold.decision.message}; {said}")
    log.warning("session %s on %s: %s", slot.session_id, pool.name, said)
