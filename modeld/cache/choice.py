"""What a turn reuses: the longest common token prefix among the compatible candidates.

:func:`choose` is a pure function of its inputs (as vLLM's ``find_longest_cache_hit``): it reads
token lists and flags, changes nothing and calls no engine, so every rule is pinned by unit tests
(``tests/cache/test_cache_choice.py``):

1. The session's own context, untouched since its last operation (``untouched``: its generation
   counter is unchanged) and keeping its whole prefix, is taken without comparing anything older
   than it. A context or snapshot that became warm after it (``last_used``, ``created``) and
   holds more tokens than it keeps is compared still: the conversation's later turn, run on a
   session of its own because this one was still finishing the turn before, is worth more.
2. Otherwise every candidate is compared: the session's own context, the other warm contexts of
   the same identity (a busy one only up to its floor), and the tier snapshots. The longest
   common prefix wins (SGLang's radix match, llama-server's slot similarity); at equal length
   the KV beats a snapshot, and a snapshot must reuse ``restore_min_gain`` tokens more than the
   best context in the KV, and than ``head`` (the tokens every prefix of the format starts with:
   the chat template's head, BOS), to be worth a restore: restoring a snapshot for a new
   conversation's template head alone costs more than computing it.
3. Memory that cannot be cut (``can_truncate`` False: recurrent models) reuses a snapshot only
   whole, and a context in the KV pool only whole unless the engine keeps checkpoints inside it
   (``checkpoints``: recurrent and hybrid states at token positions, a sliding window still
   held): then any common prefix is a candidate, and the engine goes back to the last checkpoint
   at or before it and evaluates the rest (the turn says which it restored); a snapshot too when
   its checkpoints travel inside it (``snapshot_cuts``). A shared prefix it could not use is
   reported (``blocked``) for the cold reason.

Design record: ``blueprints/0016-warm-state.md``.
"""

from __future__ import annotations

from collections.abc import Collection, Iterable, Iterator
from dataclasses import dataclass
from functools import cached_property

from modeld.cache.pool import WarmContext
from modeld.cache.reuse import common_prefix_len
from modeld.cache.tiers import TierEntry

__all__ = ["Choice", "SessionSaved", "choose"]


@dataclass
class Choice:
    """The candidate to reuse: ``keep`` tokens of ``context`` (in the KV) or of ``entry`` (a
    snapshot), or nothing (``keep`` 0). ``blocked``: a compatible context shared a prefix the
    memory cannot be cut to; ``seen``: some compatible context or snapshot existed."""

    keep: int = 0
    context: WarmContext | None = None
    entry: TierEntry | None = None
    blocked: bool = False
    seen: bool = False


class SessionSaved:
    """``choose``'s ``mine``: the keys of the tier entries holding what a session computed last
    (``computed`` begins with their tokens), found when the choice first asks. A warm turn's
    choice (rule 1) never does: each of a turn's operations compared every entry's tokens with
    ``computed`` before (measured in blueprint 0017)."""

    def __init__(self, computed: list[int], entries: Iterable[TierEntry]) -> None:
        self._computed = computed
        self._entries = entries

    @cached_property
    def keys(self) -> frozenset[str]:
        computed = self._computed
        return frozenset(
            e.key
            for e in self._entries
            if len(e.tokens) <= len(computed) and computed[: len(e.tokens)] == e.tokens
        )

    def __contains__(self, key: object) -> bool:
        return key in self.keys

    def __iter__(self) -> Iterator[str]:
        return iter(self.keys)

    def __len__(self) -> int:
        return len(self.keys)


def usable(
    context: WarmContext, target: list[int], *, own: bool, can_truncate: bool, checkpoints: bool = False
) -> tuple[int, bool]:
    """Tokens of ``context`` a turn may keep for ``target``, and whether the memory's inability
    to be cut kept a shared prefix from being used."""
    n = common_prefix_len(context.tokens, target)
    if context.busy and not own:
        n = min(n, context.floor)
    if n < len(context.tokens) and not (can_truncate or checkpoints):
        return 0, n > 0
    return n, False


def choose(
    target: list[int],
    *,
    own: WarmContext | None,
    untouched: bool,
    others: Iterable[WarmContext],
    entries: Iterable[TierEntry],
    can_truncate: bool,
    restore_min_gain: int,
    head: int = 0,
    checkpoints: bool = False,
    snapshot_cuts: bool = False,
    mine: Collection[str] = (),
) -> Choice:
    """The candidate for ``target`` (see the module docstring). ``own`` is the session's context,
    ``others`` the pool's other contexts of the same identity, ``entries`` the tier snapshots of
    that identity and engine format; ``mine`` the keys of entries that hold what this session
    itself computed last (restored for any gain: its suffix and decode serve the turn's next
    operations too, and nothing it computed is computed again)."""
    best = Choice()
    if own is not None and not own.busy:
        keep, blocked = usable(own, target, own=True, can_truncate=can_truncate, checkpoints=checkpoints)
        best = Choice(keep, own, blocked=blocked, seen=True)
        if untouched and keep > 0 and keep >= min(own.prefix_tokens, len(target)):
            # The session's own context, as it left it: only what became warm since, and holds
            # more than it keeps, is compared (a later turn of its conversation, run on another
            # session while this one was still finishing the turn before).
            since = own.last_used
            others = [c for c in others if c.last_used > since and len(c.tokens) > keep]
            entries = [e for e in entries if e.created > since and len(e.tokens) > keep]
            if not others and not entries:
                return best
    for context in others:
        if context.busy and context.floor <= 0:
            continue
        keep, blocked = usable(context, target, own=False, can_truncate=can_truncate, checkpoints=checkpoints)
        best.blocked = best.blocked or blocked
        best.seen = True
        if keep > best.keep or (checkpoints and keep == best.keep > 0 and _later(context, best.context, own)):
            best = Choice(keep, context, blocked=best.blocked, seen=True)
    for entry in entries:
        best.seen = True
        n = common_prefix_len(entry.tokens, target)
        if n < len(entry.tokens) and not (can_truncate or snapshot_cuts):
            continue
        gain = restore_min_gain if entry.key not in mine else 1
        gains = n > 0 and n - max(best.keep, head) >= gain
        if gains or (best.entry is not None and n == best.keep and _fuller(entry, best.entry, snapshot_cuts)):
            best = Choice(n, None, entry, blocked=best.blocked, seen=True)
    return best


def _later(a: WarmContext, b: WarmContext | None, own: WarmContext | None) -> bool:
    """Of two other contexts sharing as much with a turn, on memory that cannot be cut (which goes
    back to a checkpoint before the divergence), ``a`` is the better one: used later. It holds
    the checkpoints of the latest cut near this divergence (an agent's prompt diverges where it
    did last turn: blueprint 0016, "Edits inside a segment"), the one it was copied from only
    those spread over its first evaluation."""
    return b is not None and b is not own and a.last_used > b.last_used


def _fuller(a: TierEntry, b: TierEntry, cuts: bool = False) -> bool:
    """Of two snapshots reusing as much, ``a`` is the better one: it holds more tokens (a
    context saved whole: its suffix and decode may serve the turn's suffix), or as many in RAM,
    or (``cuts``: a snapshot restored whole goes back to a checkpoint before the divergence) as
    many in the same tier, written later: its checkpoints are those of the latest cut (as
    :func:`_later` for contexts)."""
    if len(a.tokens) != len(b.tokens):
        return len(a.tokens) > len(b.tokens)
    if a.tier != b.tier:
        return a.tier == "ram"
    return cuts and a.created > b.created
