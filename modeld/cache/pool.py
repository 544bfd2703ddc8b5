"""The state of one loaded model's KV pool: which warm context holds which tokens, for whom.

:class:`Pool` is that state and nothing else decides over it: the warm contexts by sequence,
the sessions' slots, the cell ledger (``ledger.py``) and the counters ``modeld status`` shows.
The cache (``warm.py``) mutates it under its lock; the pure choice (``choice.py``) and eviction
(``eviction.py``) read and change it through the functions they are given it with.

- a **warm context** is one sequence of the pool: runtime identity (the digest of the runtime
  fields of the manifest it was computed under, blueprint 0002), tokens, prefix length, a
  generation counter (bumped whenever its tokens change), the owning session (or none:
  detached), a busy flag and a *floor* (tokens the running operation will not change, which
  other sessions may copy meanwhile);
- a **slot** is the cache's memory of one session: its own context, the generation it last saw,
  and what became of its context (:class:`~modeld.cache.reuse.Loss`).

Design record: ``blueprints/0016-warm-state.md``.
"""

from __future__ import annotations

import itertools
import time
from collections.abc import Sequence
from dataclasses import dataclass, field

from modeld.backends.base import Layout
from modeld.cache.cost import Costs
from modeld.cache.ledger import Ledger
from modeld.cache.reuse import Loss, common_prefix_len
from modeld.cache.runtime import Tally
from modeld.cache.tiers import Tiers
from modeld.contract import WarmContextInfo
from modeld.settings import Residency

__all__ = ["COUNTERS", "TURN_SECONDS", "CacheSettings", "Pool", "SessionSlot", "WarmContext"]

COUNTERS = (
    "reused_kv",
    "reused_ram",
    "reused_disk",
    "reused_shared",
    "prefilled",
    "queries",
    "evicted_to_ram",
    "evicted_to_disk",
    "evicted_dropped",
    "snapshots_taken",
    "snapshots_rejected",
    "restore_failures",
    "copies",
    "recomputed",
    "prefetched",
)
"""What ``modeld status`` and the metrics count per loaded model (tokens, events), each meaning
what the metric of the same name counts: ``queries`` prompt-prefix tokens looked up and
``reused_<tier>`` the ones reused from that tier, once per prefix put in place (not again by the
suffix and decode of its turn); ``prefilled`` prompt tokens the engine computed (prefixes,
suffixes, and what a displaced context needed again); evictions by destination; snapshots taken,
rejected and refused by the engine; prefixes copied from another warm context; ``recomputed``
prompt tokens a session had in its warm context before and computed again (each such turn says
where they went); ``prefetched`` contexts brought back into the pool before their turn asked."""


@dataclass(frozen=True, slots=True)
class CacheSettings:
    """The cache's thresholds (the first two are ``modeld serve`` flags: their defaults are the
    settings', written once in ``modeld/settings.py``)."""

    snapshot_min_tokens: int = Residency().snapshot_min_tokens
    """A context shorter than this is not worth a snapshot (recomputing it is cheap)."""
    persist_min_tokens: int = Residency().persist_min_tokens
    """A prefix at least this long, just computed, is snapshotted and written to disk at once
    (so it survives a crash of the daemon, not only an orderly stop)."""
    restore_min_gain: int = 16
    """A snapshot is restored only if it reuses this many tokens more than the best context in
    the KV pool."""
    room_wait_seconds: float = 300.0
    """How long a turn waits for KV cells or a sequence that running operations hold (in the
    order turns came) before ``busy`` (``--queue-wait``, as a wait for a slot)."""


TURN_SECONDS = 30.0
"""How long after a prefix or suffix a context counts as inside its turn when no decode ends it
(a client that put a prefix in place and went away)."""


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
    ahead: bool = False
    """Busy with a prefill ahead of a turn (no turn of its own; ``PrefixInput.ahead``): a turn
    that would rather copy from it waits for it (``ModelCache.hold``, :data:`AHEAD_WAIT`)."""
    last_used: float = field(default_factory=time.time)
    created: float = field(default_factory=time.time)
    saved_key: str = ""  # the tier entry that already holds this context's prefix
    turn_until: float = 0.0
    """Until when (``time.time()``) its session is inside a turn: a prefix or suffix put in place
    whose decode has not ended yet (:data:`TURN_SECONDS` at most). Such a context is not idle."""
    turn_started: float = 0.0
    """When its session's current turn began (``time.time()``, while :attr:`turn_until` holds):
    a turn that began earlier goes first, and a later one waits for its cells rather than take
    them in the middle of it (two turns evicting each other at every step)."""
    turns: int = 0
    """Decodes that ended on it: one answered request (a one-off) or an agent's history."""
    ended: str = ""
    """How its last decode ended (``tool_calls``: its agent runs a tool and comes back soon;
    ``stop``: an answer, a finished sub-agent's or a turn waiting for a person)."""


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
    ended: str = ""
    """How the last decode of its context ended (``WarmContext.ended``)."""
    turn_started: float = 0.0
    """When its current (or last) turn began: its place in line for cells, kept when its
    context leaves and comes back within the turn (``WarmContext.turn_started``)."""
    ended_at: float = 0.0
    note: str = ""
    """Said in its next turn's decision (its context was brought back before it asked)."""
    computed: list[int] = field(default_factory=list)
    """The tokens its context held when its last operation ended: what this session computed
    (or reused) before, which a later turn must not compute again."""


class Pool:
    """The warm contexts of one loaded runtime (not thread-safe: the cache holds its lock)."""

    def __init__(
        self, *, name: str, model_digest: str, layout: Layout, tiers: Tiers | None, settings: CacheSettings
    ) -> None:
        self.name = name
        self.model_digest = model_digest
        self.layout = layout
        self.tiers = tiers if layout.snapshots else None
        self.settings = settings
        self.contexts: dict[int, WarmContext] = {}  # by sequence
        self.slots: dict[str, SessionSlot] = {}
        self.identities: set[str] = set()  # every runtime identity a session of this model had
        self.ledger = Ledger(layout.shared_cells)
        self.counters: dict[str, int] = dict.fromkeys(COUNTERS, 0)
        self.reserved: dict[int, int] = {}
        """Cells a running operation will fill beyond what the ledger holds for its sequence
        (its prefill's new tokens, a decode's room), by sequence, until its hold ends: so
        operations that run together never overfill a shared pool (llama.cpp fails a batch it
        has no cells for)."""
        self.costs = Costs(bytes_per_token=max(0, layout.kv_bytes_per_token))
        """What its contexts cost where they are, measured (``cost.py``)."""
        self.tally = Tally()
        """Operations the cache sent the runtime (``runtime.Counted``): a cost sample is taken
        only when nothing else ran while it was measured."""
        self._ids = itertools.count(1)

    def own(self, slot: SessionSlot) -> WarmContext | None:
        """The session's context, if it is still in the pool."""
        context = slot.context
        if context is not None and self.contexts.get(context.seq) is context:
            return context
        return None

    def holds(self, context: WarmContext) -> bool:
        """Is ``context`` still in the pool (not evicted, not lost to an engine reset)?"""
        return self.contexts.get(context.seq) is context

    def free_seqs(self) -> list[int]:
        return [s for s in range(self.layout.n_seq) if s not in self.contexts]

    def add(self, slot: SessionSlot, seq: int) -> WarmContext:
        """A new, empty context for ``slot`` on the free sequence ``seq``."""
        context = WarmContext(
            id=f"c{next(self._ids)}", seq=seq, identity=slot.identity, tokens=[], owner=slot
        )
        self.contexts[seq] = context
        slot.context = context
        return context

    def remove(self, context: WarmContext) -> None:
        """Forget a context whose cells are gone."""
        self.ledger.drop(context.seq)
        self.contexts.pop(context.seq, None)
        self.reserved.pop(context.seq, None)

    def reserved_beside(self, seq: int) -> int:
        """Cells the running operations of other sequences than ``seq`` have reserved."""
        return sum(n for s, n in self.reserved.items() if s != seq)

    def clear(self) -> None:
        """Every sequence is gone (the engine was reset, or the model is being unloaded)."""
        self.contexts.clear()
        self.reserved.clear()
        self.ledger = Ledger(self.layout.shared_cells)

    # --- what the engine reported (the engine's own counts are the truth) ------------------------

    def record_sync(self, context: WarmContext, kept: int, resident: int, target: list[int]) -> None:
        """A sync job kept ``kept`` tokens and left ``resident`` of ``target`` in the sequence."""
        if not self.holds(context):
            return  # the engine was reset meanwhile
        self.ledger.truncate(context.seq, kept)
        self.ledger.extend(context.seq, resident - kept)
        context.tokens = list(target[:resident])
        # The committed prefix survives only as far as it was kept: what follows is the new
        # target's, committed by the hold (if the operation gets that far; a failure, a cancel or
        # a changed model file leaves it uncommitted, and a snapshot never claims it).
        context.prefix_tokens = min(context.prefix_tokens, kept)
        self._changed(context)

    def record_generate(self, context: WarmContext, tokens: Sequence[int], resident: int) -> None:
        """A generate job sampled ``tokens``; the sequence holds ``resident`` tokens in all."""
        if not self.holds(context):
            return
        before = len(context.tokens)
        context.tokens = (context.tokens + list(tokens))[:resident]
        context.prefix_tokens = min(context.prefix_tokens, resident)
        self.ledger.truncate(context.seq, min(before, resident))
        self.ledger.extend(context.seq, resident - min(before, resident))
        self._changed(context)

    def record_failure(self, context: WarmContext, why: str) -> None:
        """A job failed: the sequence was emptied (its content was unknown)."""
        if not self.holds(context):
            return
        self.ledger.drop(context.seq)
        context.tokens = []
        context.prefix_tokens = 0
        context.generation += 1
        if context.owner is not None:
            context.owner.loss = Loss("engine_reset", why)

    def _changed(self, context: WarmContext) -> None:
        context.generation += 1
        if context.owner is not None:
            context.owner.seen_generation = context.generation

    # --- observers ---------------------------------------------------------------------------------

    def kv_tokens(self, slot: SessionSlot, tokens: list[int]) -> int:
        """How many of ``tokens`` the session's context holds in the pool now."""
        context = slot.context
        if context is None or not self.holds(context):
            return 0
        return common_prefix_len(list(context.tokens), tokens)

    def views(self, checkpoints: Sequence[int] = ()) -> list[WarmContextInfo]:
        """Every context in the pool, by sequence, as status and explain-context show it
        (``checkpoints``: what each sequence's checkpoints hold in the runtime, by sequence)."""
        per_token = self.layout.kv_bytes_per_token
        return [
            WarmContextInfo(
                id=c.id,
                tier="kv",
                tokens=len(c.tokens),
                prefix_tokens=c.prefix_tokens,
                bytes=self.ledger.unique(c.seq) * per_token,
                shared_bytes=self.ledger.shared_with(c.seq) * per_token,
                last_used_at=c.last_used,
                pinned=bool(c.owner is not None and c.owner.pinned),
                session_id=c.owner.session_id if c.owner is not None else "",
                checkpoint_bytes=checkpoints[c.seq] if c.seq < len(checkpoints) else 0,
            )
            for c in sorted(list(self.contexts.values()), key=lambda c: c.seq)
        ]
