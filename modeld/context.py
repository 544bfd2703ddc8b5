"""A context as segments: how a prompt's parts are laid out, and which stable part keeps changing.

Shared by the client (``runtime_client``'s ``ContextBuilder``) and the daemon (a session's
``explain-context``; the HTTP APIs' conversations), so both lay out and judge a context the same
way:

* :func:`assemble`: the stable parts first, then the volatile ones, whatever order they came in
  (everything that changes each turn sits after everything that does not, which is what makes
  the prefix reusable), each a manifest :class:`~modeld.manifest.Segment` with its byte range
  and hash.
* :class:`SegmentChurn`: for each stable segment (by kind and position among the stable segments
  of that kind) its hash and for how many consecutive prefixes it has changed. One that changed
  on each of the last :data:`CHURN_TURNS` is the likely cause of a prefix that is always cold
  (a timestamp or a request id in the system prompt): the builder warns about it
  (``BuiltContext.warnings``) and ``explain-context`` names it
  (``ContextReport.changing_segments``), for clients that build no manifest of their own too.
  ``history`` segments are not tracked (a conversation's history moves as it grows). One dict
  lookup per stable segment per prefix.

What not: no tokens and no reuse decision (``modeld/cache``): bytes and hashes only.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass

from modeld.contract import ChangingSegment
from modeld.manifest import Segment, bytes_hash

__all__ = ["CHURN_TURNS", "Assembled", "Part", "SegmentChurn", "assemble"]

CHURN_TURNS = 3
"""A stable segment that changed on this many consecutive prefixes is reported."""


@dataclass(frozen=True, slots=True)
class Part:
    """One part of a context, as a tool adds it."""

    kind: str
    text: str
    stable: bool
    cache_class: str = ""
    role: str = ""


@dataclass(frozen=True, slots=True)
class Assembled:
    """The laid-out context: the prefix and suffix texts and one segment per part, stable first
    (byte ranges count from the prefix's first byte through the suffix's last)."""

    prefix_text: str
    suffix_text: str
    segments: tuple[Segment, ...]
    stable_bytes: int
    total_bytes: int


def assemble(parts: Iterable[Part]) -> Assembled:
    """Stable parts first, then volatile ones, each in the order given (see the module docstring)."""
    listed = list(parts)
    ordered = [p for p in listed if p.stable] + [p for p in listed if not p.stable]
    segments: list[Segment] = []
    prefix: list[str] = []
    suffix: list[str] = []
    offset = stable_bytes = 0
    for part in ordered:
        data = part.text.encode("utf-8")
        segments.append(
            Segment(
                kind=part.kind,
                byte_start=offset,
                byte_end=offset + len(data),
                hash=bytes_hash(data),
                stable=part.stable,
                cache_class=part.cache_class,
                role=part.role,
            )
        )
        offset += len(data)
        if part.stable:
            prefix.append(part.text)
            stable_bytes = offset
        else:
            suffix.append(part.text)
    return Assembled("".join(prefix), "".join(suffix), tuple(segments), stable_bytes, offset)


class SegmentChurn:
    """The stable segments of one context's successive prefixes, and how long each has kept
    changing (see the module docstring)."""

    def __init__(self, turns: int = CHURN_TURNS) -> None:
        self._turns = turns
        self._seen: dict[tuple[str, int], tuple[str, int]] = {}  # (kind, position) -> (hash, streak)
        self._changing: tuple[ChangingSegment, ...] = ()

    def observe(self, segments: Sequence[Segment]) -> tuple[ChangingSegment, ...]:
        """Record the stable segments of a prefix; those that changed on each of the last
        ``turns`` prefixes (``index`` is the segment's place in ``segments``)."""
        counts: dict[str, int] = {}
        seen: dict[tuple[str, int], tuple[str, int]] = {}
        changing: list[ChangingSegment] = []
        for index, seg in enumerate(segments):
            if not seg.stable or seg.kind == "history" or not seg.hash:
                continue
            kind = seg.kind
            if kind == "message":  # a chat message given whole: its system messages are watched
                if seg.role != "system":
                    continue
                kind = "system"
            position = counts.get(kind, 0)
            counts[kind] = position + 1
            key = (kind, position)
            before = self._seen.get(key)
            streak = 0 if before is None or before[0] == seg.hash else before[1] + 1
            seen[key] = (seg.hash, streak)
            if streak >= self._turns:
                changing.append(ChangingSegment(kind, position, index, streak))
        self._seen = seen
        self._changing = tuple(changing)
        return self._changing

    def changing(self) -> tuple[ChangingSegment, ...]:
        """The segments of the last prefix that changed on each of the last prefixes."""
        return self._changing

    def copy(self) -> SegmentChurn:
        twin = SegmentChurn(self._turns)
        twin._seen = dict(self._seen)
        twin._changing = self._changing
        return twin
