"""Speculation from the context: prompt-lookup drafts, how long they are, and what they count.

What (``blueprints/0021-speculation.md``): a coding agent's output is mostly text already in
its context (the file it rewrites, identifiers, JSON keys). :class:`Drafter` proposes the
tokens that followed the latest earlier occurrence of the text's end (prompt lookup, no draft
model); the backend evaluates the last chosen token and the draft in one batch, with logits at
every position, and keeps the draft while each position's own choice equals the drafted token.
:class:`DraftLength` adapts the draft length to what was accepted and falls to zero when drafts
keep failing, so fresh text pays nothing. :class:`DecodeStats` counts drafted, accepted and
forced tokens for the timings, ``explain-context`` and ``/metrics``.

The verification rule (the backends apply it, position by position): the token at a position
is chosen exactly as plain decoding chooses it (the same mask, the same adjustments, the same
sampler and random draw); the drafted token is accepted when the choice equals it, and the
first choice that differs ends the step. Under greedy decoding that is "the longest draft
prefix that equals the argmax, then the target's own token". Under sampling it is standard
speculative sampling (Leviathan et al. 2023; Chen et al. 2023) for a deterministic draft
(q = 1 on the drafted token x): x is accepted with probability p(x), and a rejected position's
token is a draw from p with x removed and renormalised, so the output distribution is p's.

What not: no model evaluation and no sampling here (the backends own both), no native imports:
pure Python, because the reference backend runs on a base install without NumPy.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from modeld.contract import SPECULATION_MODES

__all__ = [
    "DRAFT_MAX",
    "MATCH_MAX",
    "MATCH_MIN",
    "SPECULATION_MODES",
    "DecodeStats",
    "DraftLength",
    "Drafter",
]

MATCH_MIN = 2
"""(The index keys pairs of tokens: changing this needs another key.) A draft needs the text's last ``MATCH_MIN`` tokens to have occurred before (COPYING, like a
real model, needs two tokens of shared context to resume copying after an edit)."""
MATCH_MAX = 32
"""Matches are compared up to this many tokens: the longest picks the occurrence to copy."""
CANDIDATES = 16
"""The most recent occurrences of the last ``MATCH_MIN`` tokens that are compared (bounds the
work per draft when a short n-gram, such as an indented newline, occurs thousands of times)."""
DRAFT_MAX = 48
"""The longest draft (a verify batch is at most this plus one token). On a CPU a batch's cost
per token keeps falling up to ~50 tokens (COPYING, one thread: 17 tokens cost 3.9 single steps,
33 cost 6.3, 49 cost 9.0, 65 cost 11.7), so a copy that keeps being accepted is best verified in
long batches; llama-server's ngram-simple drafts 48 too. The length only gets there by doubling
on full acceptance."""
DRAFT_START = 4
MATCH_LONG = 8
"""A match this long (or longer) lets the draft be as long as the match at once: after an edit,
a long copy that resumes need not ramp up again from a short draft."""
WAIT_MAX = 64
"""After drafts keep failing, drafting pauses for 1, 2, 4 ... up to this many steps."""
RECALL_MAX = 4096
"""A sequence's drafter recalls the tail that its next decode cut off (the answer a retry or a
rerun replaces) up to this many tokens."""


@dataclass(slots=True)
class DecodeStats:
    """What speculation and forced tokens did in one decode.

    ``drafted``: draft tokens evaluated in verify batches; ``accepted``: those the model's own
    choice confirmed (they cost no step of their own); ``verifies``: batches that carried a
    draft; ``forced``: tokens a constraint forced (the only continuation the grammar allows),
    appended without a decode step of their own.
    """

    drafted: int = 0
    accepted: int = 0
    verifies: int = 0
    forced: int = 0

    @property
    def acceptance(self) -> float:
        return self.accepted / self.drafted if self.drafted else 0.0

    @property
    def mean_draft(self) -> float:
        return self.drafted / self.verifies if self.verifies else 0.0


class Drafter:
    """Prompt lookup over a token history that only grows during one decode.

    The index maps every ``MATCH_MIN``-gram to the positions where it ended (only n-grams whose
    next token is known: a continuation exists to copy). :meth:`draft` looks up the history's
    last ``MATCH_MIN`` tokens, extends each of the ``CANDIDATES`` most recent occurrences
    backwards (up to ``MATCH_MAX`` tokens), and copies what followed the longest match (the most
    recent of equals). Where the occurrence runs into the end of the history (repeated text) the
    copy continues with the same period. Building costs one dict update per token (once per
    decode; a millisecond per few thousand tokens), a draft a few dozen comparisons. The index is
    built at the first :meth:`draft`, which comes after the first token is chosen: an 8k-token
    prompt's 1.5 ms used to be paid before the first token (the daemon's overhead rows).

    Across decodes of one sequence (:meth:`rebase`) the tail that the next history cut off (the
    answer a retry, a rerun or a regenerated turn replaces: the sequence held it, the new request
    dropped it) is kept as a *recall*, up to ``RECALL_MAX`` tokens: a draft copies from it when
    its match there is longer than in the history. llama-server's ngram-mod keeps one table
    across all requests for the same reason.
    """

    def __init__(self, history: Sequence[int]) -> None:
        self._h = list(history)
        self._index: dict[int, list[int]] | None = None
        self._recall: _Recall | None = None

    def _built(self) -> dict[int, list[int]]:
        if self._index is not None:
            return self._index
        h = self._h
        index: dict[int, list[int]] = {}
        get = index.get
        # The pair of tokens ending at ``end`` (ids are below 2**31), for every end but the last.
        for end, key in enumerate(map(_pair, h[:-2], h[1:-1]), start=MATCH_MIN - 1):
            ends = get(key)
            if ends is None:
                index[key] = [end]
            else:
                ends.append(end)
        self._index = index
        return index

    def _key(self, end: int) -> int:
        return _pair(self._h[end - 1], self._h[end])

    def rebase(self, history: Sequence[int]) -> None:
        """The history of the next decode of the same sequence. The index keeps what the common
        prefix indexed (a warm prefix is indexed once, not at every decode: 1.5 ms for 8k tokens)
        and drops or adds the rest; the result is the index of ``history`` built afresh."""
        h, new = self._h, list(history)
        common = min(len(h), len(new))
        old_end = len(h)
        if new[:common] != h[:common]:
            lo, hi = 0, common  # h[:lo] == new[:lo], and they differ before hi
            while hi - lo > 64:
                mid = (lo + hi) // 2
                if new[lo:mid] == h[lo:mid]:
                    lo = mid
                else:
                    hi = mid
            common = lo
            while common < hi and h[common] == new[common]:
                common += 1
        index = self._index
        if index is not None:
            # The n-gram ending at ``end`` is indexed while ``end + 1`` is in the history: it stays
            # where ``h[end - 1 : end + 2]`` is unchanged, i.e. ``end <= common - 2``.
            for end in range(len(h) - 2, max(MATCH_MIN - 1, common - 1) - 1, -1):
                ends = index[self._key(end)]
                ends.pop()
                if not ends:
                    del index[self._key(end)]
        if 0 < common < old_end:  # the same text's tail is cut off: recall it, with its lead-in
            self._recall = _Recall(h[max(0, common - MATCH_MAX) : old_end], min(common, MATCH_MAX))
        self._h = new
        if index is not None:
            for end in range(max(MATCH_MIN - 1, common - 1), len(new) - 1):
                index.setdefault(self._key(end), []).append(end)

    matched = 0
    """How many tokens the last :meth:`draft` matched (0: none)."""

    def __len__(self) -> int:
        return len(self._h)

    def append(self, token: int) -> None:
        """The history's next token (chosen, forced or accepted)."""
        self._h.append(token)
        end = len(self._h) - 2  # the n-gram ending just before it now has a continuation
        if self._index is not None and end >= MATCH_MIN - 1:  # else the build covers it
            self._index.setdefault(self._key(end), []).append(end)

    def draft(self, limit: int) -> list[int]:
        """Up to ``limit`` tokens that are likely to follow the history (``[]``: no match)."""
        h = self._h
        n = len(h)
        self.matched = 0
        if limit <= 0 or n < MATCH_MIN + 1:
            return []
        key = self._key(n - 1)
        best, best_len = _longest(h, self._built().get(key), h, n)
        recall = self._recall
        if recall is not None and best_len < MATCH_MAX:
            at, length = _longest(recall.tokens, recall.ends(key), h, n)
            if length > best_len:
                self.matched = length
                return recall.tokens[at + 1 : at + 1 + limit]
        if best_len == 0:
            return []
        self.matched = best_len
        out = h[best + 1 : best + 1 + limit]
        period = n - 1 - best
        while len(out) < limit:  # the occurrence overlaps the end: the text repeats
            out.append(out[len(out) - period])
        return out


def _longest(tokens: list[int], ends: list[int] | None, h: list[int], n: int) -> tuple[int, int]:
    """Of the ``CANDIDATES`` most recent ``ends`` (positions in ``tokens`` where the history's
    last ``MATCH_MIN`` tokens end), the one whose match with the end of ``h[:n]`` is longest
    (compared up to ``MATCH_MAX``; the most recent of equals), and its length (0: none)."""
    best, best_len = -1, 0
    for end in reversed((ends or ())[-CANDIDATES:]):
        length = MATCH_MIN
        while length < MATCH_MAX and end - length >= 0 and tokens[end - length] == h[n - 1 - length]:
            length += 1
        if length > best_len:  # strictly longer: the most recent of equals stays
            best, best_len = end, length
    return best, best_len


class _Recall:
    """A cut-off tail (``tokens[lead:]``) and the ``lead`` tokens before it, with its own index of
    the pairs whose continuation lies in the tail (built at the first look-up)."""

    __slots__ = ("_index", "lead", "tokens")

    def __init__(self, tokens: list[int], lead: int) -> None:
        if len(tokens) - lead > RECALL_MAX:
            tokens = tokens[: lead + RECALL_MAX]
        self.tokens, self.lead = tokens, lead
        self._index: dict[int, list[int]] | None = None

    def ends(self, key: int) -> list[int] | None:
        if self._index is None:
            t = self.tokens
            self._index = {}
            for end in range(max(MATCH_MIN - 1, self.lead - 1), len(t) - 1):
                self._index.setdefault(_pair(t[end - 1], t[end]), []).append(end)
        return self._index.get(key)


def drafter_for(drafters: dict[int, Drafter], seq: int, history: Sequence[int]) -> Drafter:
    """The sequence's drafter, rebased on ``history`` (its index of a warm prefix is kept)."""
    drafter = drafters.get(seq)
    if drafter is None:
        drafter = drafters[seq] = Drafter(history)
    else:
        drafter.rebase(history)
    return drafter


def _pair(a: int, b: int) -> int:
    return (a << 32) | b


class DraftLength:
    """How many tokens to draft next, from what the last drafts achieved.

    A fully accepted draft doubles the length (up to ``maximum``); a partly accepted one halves
    it, but not below what was accepted plus one; a draft whose first token fails halves it. A
    match of ``MATCH_LONG`` tokens or more allows a draft as long as the match, and the longest
    draft once a draft was fully accepted and none has failed since (the copy holds: ramping up
    4, 8, 16, 32 costs a 192-token rewrite a tenth of its time; a decode's first draft is not
    trusted that far, so where nothing is copied a match costs at most its own length). When it halves to
    zero, drafting pauses for ``wait`` steps (1, 2, 4 ... ``WAIT_MAX``: the length is zero, and
    fresh text costs a counter) and resumes with a one-token probe; any accepted token resets
    the pause. A verify batch of ``k`` draft tokens costs more than a plain step (measured in
    blueprint 0021), so a draft that keeps failing must stop being tried.
    """

    def __init__(self, maximum: int = DRAFT_MAX, start: int = DRAFT_START) -> None:
        self.maximum = max(0, maximum)
        self.length = min(start, self.maximum)
        self._wait = 0
        self._pause = 0
        self._holding = False  # a draft was fully accepted and none has failed since

    def budget(self, matched: int = 0) -> int:
        """The draft length for this step (0: do not draft now), given how many tokens the
        draft's match has (:attr:`Drafter.matched`)."""
        if self._wait > 0:
            self._wait -= 1
            return 0
        if matched >= MATCH_LONG:
            return self.maximum if self._holding else max(self.length, min(matched, self.maximum))
        return self.length

    def record(self, drafted: int, accepted: int) -> None:
        """A verify step evaluated ``drafted`` draft tokens, of which the first ``accepted``."""
        if drafted <= 0:
            return
        self._holding = accepted >= drafted
        if accepted >= drafted:
            if drafted >= self.length:
                self.length = min(self.maximum, max(1, self.length) * 2)
            self._pause = self._wait = 0
        elif accepted > 0:
            self.length = min(self.maximum, max(accepted + 1, self.length // 2))
            self._pause = self._wait = 0
        else:
            self.length //= 2
            if self.length == 0:
                self._pause = min(WAIT_MAX, self._pause * 2 or 1)
                self._wait = self._pause
                self.length = min(1, self.maximum)
