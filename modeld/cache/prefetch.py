"""Restore before asked: a context whose agent runs a tool comes back into the KV pool before the
agent's next turn asks for it.

A turn that ends in a tool call (``WarmContext.ended``) is followed, seconds later, by the same
agent's next turn; if its context left the pool meanwhile (another agent's turn needed the cells),
that turn would start with a restore. :func:`bring_back`, run by the engine's janitor through
:meth:`~modeld.cache.warm.ModelCache.prefetch` (which holds the cache's lock and checks that no
operation runs or waits: a context brought back would make them attend over its cells), restores
it into a free sequence from the tier entry holding what its session computed, when the pool has
the cells without evicting anything. Never a context whose keep-alive ran out (its client said how
long to keep it), never after :data:`PREFETCH_SECONDS`. Design record:
``blueprints/0016-warm-state.md`` ("Where a context goes").
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable

from modeld.cache.eviction import share_start
from modeld.cache.pool import Pool, SessionSlot
from modeld.cache.runtime import KVRuntime
from modeld.cache.snapfile import SnapshotError
from modeld.cache.tiers import TierEntry
from modeld.errors import ModeldError

__all__ = ["PREFETCH_SECONDS", "bring_back"]

log = logging.getLogger("modeld.cache")

PREFETCH_SECONDS = 600.0
"""How long after a turn ended in a tool call its context is brought back before it asks: tools
that run longer are rare, and the session may be gone."""


def bring_back(pool: Pool, runtime: Callable[[], KVRuntime], now: float) -> int:
    """Restore every such context that has a free sequence and the cells (the lock held);
    returns how many came back."""
    tiers = pool.tiers
    assert tiers is not None
    back = 0
    fmt = pool.layout.snapshot_format
    for slot in list(pool.slots.values()):
        if pool.own(slot) is not None or slot.ended != "tool_calls" or not slot.computed:
            continue
        if now - slot.ended_at > PREFETCH_SECONDS:
            continue
        computed = slot.computed
        entries = [
            e
            for e in tiers.candidates(pool.model_digest, slot.identity, fmt)
            if len(e.tokens) <= len(computed) and computed[: len(e.tokens)] == e.tokens
        ]
        free = pool.free_seqs()
        if not entries or not free:
            continue
        entry = max(entries, key=lambda e: (len(e.tokens), e.tier == "ram"))
        used = pool.ledger.used() + sum(pool.reserved.values())
        if pool.layout.shared_cells and used + len(entry.tokens) > pool.layout.pool_tokens:
            continue
        if _restore(pool, runtime, slot, entry, free[0]):
            back += 1
    return back


def _restore(
    pool: Pool, runtime: Callable[[], KVRuntime], slot: SessionSlot, entry: TierEntry, seq: int
) -> bool:
    """Restore ``entry`` into the free sequence ``seq`` as ``slot``'s context."""
    assert pool.tiers is not None
    tier = entry.tier
    started = time.perf_counter()
    context = pool.add(slot, seq)
    try:
        blob = pool.tiers.load(entry)
        restored = runtime().restore(seq, entry.tokens, blob)
    except (SnapshotError, ModeldError) as exc:
        log.info("could not bring back session %s's context: %s", slot.session_id, exc)
        pool.remove(context)
        slot.context = None
        return False
    if not restored.ok:  # the next turn tries it again, and rejects it with its reason
        pool.remove(context)
        slot.context = None
        return False
    ms = (time.perf_counter() - started) * 1000.0
    pool.costs.moved(f"restore_{tier}", len(entry.tokens), ms)
    context.tokens = list(entry.tokens)
    context.prefix_tokens = entry.prefix_tokens
    context.saved_key = entry.key
    context.ended, context.turns = slot.ended, 1
    pool.ledger.set(seq, len(entry.tokens))
    share_start(pool, context, runtime())
    pool.tiers.take(entry)
    slot.seen_generation = context.generation
    slot.loss = None
    slot.note = (
        f"its context was brought back from the {tier} tier ({len(entry.tokens)} tokens, {ms:.0f} ms) "
        "while its tool ran"
    )
    pool.counters["prefetched"] += 1
    log.info(
        "%s: session %s's context (%d tokens) brought back from the %s tier while its tool ran",
        pool.name,
        slot.session_id,
        len(entry.tokens),
        tier,
    )
    return True
