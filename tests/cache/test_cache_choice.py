"""The cache's choice of what a turn reuses, alone: a pure function of token lists and flags
(``modeld/cache/choice.py``). Each test narrates one rule of blueprint 0016 with exact counts."""

from __future__ import annotations

from modeld.cache.choice import Choice, SessionSaved, choose
from modeld.cache.pool import SessionSlot, WarmContext
from modeld.cache.tiers import TierEntry

TARGET = list(range(100))


def context(
    tokens: list[int], *, prefix: int = 0, busy: bool = False, floor: int = 0, seq: int = 0
) -> WarmContext:
    return WarmContext(
        id=f"c{seq}", seq=seq, identity="id", tokens=tokens, prefix_tokens=prefix, busy=busy, floor=floor
    )


def entry(tokens: list[int]) -> TierEntry:
    return TierEntry(
        key=f"k{len(tokens)}",
        model_digest="m",
        identity="id",
        snapshot_format="f",
        tokens=tokens,
        prefix_tokens=len(tokens),
        nbytes=1,
        blob=b"x",
    )


def pick(
    *,
    own: WarmContext | None = None,
    untouched: bool = False,
    others: tuple[WarmContext, ...] = (),
    entries: tuple[TierEntry, ...] = (),
    can_truncate: bool = True,
    target: list[int] = TARGET,
    head: int = 0,
) -> Choice:
    return choose(
        target,
        own=own,
        untouched=untouched,
        others=others,
        entries=entries,
        can_truncate=can_truncate,
        restore_min_gain=16,
        head=head,
    )


def test_the_sessions_own_untouched_context_is_taken_without_comparing() -> None:
    own = context(TARGET[:60], prefix=60)
    longer = context(TARGET[:90], seq=1)
    longer.last_used = own.last_used - 1  # warm before the session's own context was last used
    chosen = pick(own=own, untouched=True, others=(longer,))
    assert (chosen.context, chosen.keep, chosen.seen) == (own, 60, True)


def test_what_became_warm_after_the_untouched_own_context_and_holds_more_is_compared() -> None:
    # The conversation's next turn ran on a session of its own (this one was still finishing
    # the turn before): its context, or its snapshot, holds the conversation further.
    own = context(TARGET[:60], prefix=60)
    later = context([*TARGET[:90], -1], seq=1)
    later.last_used = own.last_used + 1
    chosen = pick(own=own, untouched=True, others=(later,))
    assert (chosen.context, chosen.keep) == (later, 90)
    saved = entry(TARGET[:95])
    saved.created = own.last_used + 1
    chosen = pick(own=own, untouched=True, entries=(saved,))
    assert (chosen.entry, chosen.keep) == (saved, 95)
    # Newer but holding no more than the own context keeps: nothing to compare.
    short = context(TARGET[:60], seq=2)
    short.last_used = own.last_used + 1
    assert pick(own=own, untouched=True, others=(short,)).context is own
    # Newer, longer, but another conversation (diverges early): the own context still wins.
    other = context([*TARGET[:10], *(-t for t in TARGET[10:])], seq=3)
    other.last_used = own.last_used + 1
    assert pick(own=own, untouched=True, others=(other,)).context is own


def test_a_touched_own_context_competes_and_the_longest_common_prefix_wins() -> None:
    own = context(TARGET[:60], prefix=60)
    longer = context([*TARGET[:90], -1, -2], seq=1)
    chosen = pick(own=own, untouched=False, others=(longer,))
    assert (chosen.context, chosen.keep) == (longer, 90)
    # Untouched but keeping less than its prefix (the target diverged inside it): compared too.
    diverged = [*TARGET[:40], -5, *TARGET[41:]]
    chosen = pick(own=own, untouched=True, others=(longer,), target=diverged)
    assert (chosen.context, chosen.keep) == (own, 40)


def test_a_busy_context_is_offered_only_up_to_its_floor() -> None:
    busy = context(TARGET[:90], busy=True, floor=30, seq=1)
    assert (pick(others=(busy,)).context, pick(others=(busy,)).keep) == (busy, 30)
    running = context(TARGET[:90], busy=True, floor=0, seq=2)
    chosen = pick(others=(running,))
    assert (chosen.context, chosen.keep, chosen.seen) == (None, 0, False)
    # The session's own context is never offered while busy (its operation is running).
    assert pick(own=context(TARGET[:90], prefix=90, busy=True, floor=50), untouched=True).keep == 0


def test_a_snapshot_must_beat_the_kv_by_the_restore_gain() -> None:
    kv = context(TARGET[:50], seq=1)
    assert pick(others=(kv,), entries=(entry(TARGET[:65]),)).context is kv  # 15 more: not worth it
    chosen = pick(others=(kv,), entries=(entry(TARGET[:66]),))  # 16 more: restored
    assert (chosen.context, chosen.entry is not None, chosen.keep) == (None, True, 66)
    assert pick(others=(kv,), entries=(entry(TARGET[:50]),)).context is kv  # a tie: the KV


def test_a_snapshot_must_reuse_the_restore_gain_beyond_the_formats_head() -> None:
    """A new conversation shares its chat template's head (here 28 tokens) with every snapshot
    of its format: restoring one for that head alone is no reuse worth a restore."""
    head_only = entry([*TARGET[:28], -1])
    assert pick(entries=(head_only,)).entry is head_only  # without a head: 28 >= 16
    assert pick(entries=(head_only,), head=28).entry is None
    more = entry(TARGET[:44])
    assert pick(entries=(more,), head=28).entry is more  # 16 past the head


def test_memory_that_cannot_be_cut_reuses_a_candidate_only_whole() -> None:
    partial = context([*TARGET[:70], -1], seq=1)
    chosen = pick(others=(partial,), can_truncate=False)
    assert (chosen.keep, chosen.blocked, chosen.seen) == (0, True, True)
    whole = context(TARGET[:40], seq=2)
    chosen = pick(others=(partial, whole), can_truncate=False)
    assert (chosen.context, chosen.keep, chosen.blocked) == (whole, 40, True)
    assert pick(entries=(entry([*TARGET[:70], -1]),), can_truncate=False).entry is None


def test_nothing_compatible_is_not_seen() -> None:
    chosen = pick()
    assert (chosen.keep, chosen.context, chosen.entry, chosen.seen, chosen.blocked) == (
        0,
        None,
        None,
        False,
        False,
    )
    assert pick(entries=(entry([-1, -2]),)).seen  # a snapshot that shares nothing was still seen


def test_the_choice_changes_nothing() -> None:
    own = context(TARGET[:60], prefix=60)
    own.owner = SessionSlot("s", "id", context=own)
    before = (list(own.tokens), own.prefix_tokens, own.generation, own.busy, own.floor)
    pick(own=own, untouched=False, others=(context(TARGET[:90], seq=1),))
    assert (list(own.tokens), own.prefix_tokens, own.generation, own.busy, own.floor) == before


def test_what_the_session_itself_left_the_kv_with_comes_back_for_any_gain() -> None:
    """Another session's context in the KV shares 96 tokens; this session's own context, saved
    whole when it left, holds 100 and more (its suffix and decode). Four tokens are below the
    restore threshold for a snapshot of anyone's, but not for the session's own: restoring it
    computes none of what it computed before, and its tail serves the turn's next operations."""
    other = context([*TARGET[:96], 500, 501], seq=1)
    saved = entry([*TARGET, 7, 8, 9])
    assert pick(others=(other,), entries=(saved,)).context is other
    mine = choose(
        TARGET,
        own=None,
        untouched=False,
        others=(other,),
        entries=(saved,),
        can_truncate=True,
        restore_min_gain=16,
        mine={saved.key},
    )
    assert (mine.entry, mine.keep) == (saved, 100)
    # The warm-state cache names them by what the session computed last: the entry whose tokens
    # begin it (the session's own saved context), not one that parts from it or runs past it.
    computed = [*TARGET, 7, 8, 9, 10]
    found = SessionSaved(computed, [saved, entry([*TARGET, 7, 9]), entry([*computed, 11])])
    assert (set(found), len(found), saved.key in found) == ({saved.key}, 1, True)


def test_of_snapshots_reusing_as_much_the_fuller_one_wins_then_ram() -> None:
    """A context saved whole holds its suffix and decode past the turn's prefix; its older copy
    holds the prefix alone. Both reuse the whole target: the fuller one is restored."""
    prefix_only, whole = entry(TARGET[:]), entry([*TARGET, 1, 2, 3])
    assert pick(entries=(prefix_only, whole)).entry is whole
    assert pick(entries=(whole, prefix_only)).entry is whole


def test_on_memory_that_cannot_be_cut_the_later_of_two_contexts_sharing_as_much_wins() -> None:
    """Both go back to a checkpoint before the divergence: the one used later holds the
    checkpoints of the latest cut near it (an agent's repo-map line that changes every turn: the
    context it was copied from holds only those of its first evaluation). Attention memory, cut
    anywhere, keeps the first found."""
    edited = [*TARGET[:60], -1, *TARGET[61:]]
    first, later = context(TARGET, seq=1), context(edited, seq=2)
    later.last_used = first.last_used + 1
    for others in ((first, later), (later, first)):
        chosen = choose(
            TARGET[:60] + [-2] * 40,
            own=None,
            untouched=False,
            others=others,
            entries=(),
            can_truncate=False,
            restore_min_gain=16,
            checkpoints=True,
        )
        assert (chosen.keep, chosen.context) == (60, later)
    assert pick(others=(first, later), target=TARGET[:60] + [-2] * 40).context is first


def test_of_snapshots_reusing_as_much_on_memory_that_cannot_be_cut_the_later_one_wins() -> None:
    """As for contexts: restored whole, each goes back to a checkpoint before the divergence, and
    the one written later holds those of the latest cut (the same length, the same tier)."""
    first = entry(TARGET)
    later = TierEntry(**{**first.__dict__, "key": "later", "tokens": [*TARGET[:60], -1, *TARGET[61:]]})
    later.created = first.created + 1
    target = TARGET[:60] + [-2] * 40
    for entries in ((first, later), (later, first)):
        chosen = choose(
            target,
            own=None,
            untouched=False,
            others=(),
            entries=entries,
            can_truncate=False,
            restore_min_gain=16,
            checkpoints=True,
            snapshot_cuts=True,
        )
        assert (chosen.keep, chosen.entry) == (60, later)
