"""Stable segments that change on every turn: the likely cause of a prefix that is always cold.

What: a :class:`SegmentChurn` per session remembers, for each stable segment of the last
prefix (by kind and position among the stable segments of that kind), its byte hash and for
how many consecutive ``ensure_prefix`` calls it has changed. A segment that changed on each of
the last :data:`CHURN_TURNS` prefixes is reported in ``ContextReport.changing_segments``:
a timestamp or a request id in the system prompt makes every turn diverge there, and moving
it into the volatile suffix (``ContextBuilder.runtime``) keeps the prefix warm.

The client-side builder warns about the same thing when it builds the context
(``BuiltContext.warnings``); this is the daemon's view, for clients that build their own
manifests (or none: the OpenAI endpoint). ``history`` segments are not tracked (a
conversation's history moves as it grows). Costs one dict lookup per stable segment per prefix.

What not: no reuse decision (``modeld/cache``) and no tokens: only the manifest's hashes.
"""

from __future__ import annotations

from modeld.contract import ChangingSegment
from modeld.manifest import ContextManifest

__all__ = ["CHURN_TURNS", "SegmentChurn"]

CHURN_TURNS = 3
"""A stable segment that changed on this many consecutive prefixes is reported."""


class SegmentChurn:
    """The stable segments of a session's prefixes, and how long each has kept changing."""

    def __init__(self, turns: int = CHURN_TURNS) -> None:
        self._turns = turns
        self._seen: dict[tuple[str, int], tuple[str, int]] = {}  # (kind, position) -> (hash, streak)
        self._changing: tuple[ChangingSegment, ...] = ()

    def observe(self, manifest: ContextManifest) -> None:
        """Record the stable segments of a prefix just made resident."""
        counts: dict[str, int] = {}
        seen: dict[tuple[str, int], tuple[str, int]] = {}
        changing: list[ChangingSegment] = []
        for index, seg in enumerate(manifest.segments):
            if not seg.stable or seg.kind == "history" or not seg.hash:
                continue
            position = counts.get(seg.kind, 0)
            counts[seg.kind] = position + 1
            key = (seg.kind, position)
            before = self._seen.get(key)
            streak = 0 if before is None or before[0] == seg.hash else before[1] + 1
            seen[key] = (seg.hash, streak)
            if streak >= self._turns:
                changing.append(ChangingSegment(seg.kind, position, index, streak))
        self._seen = seen
        self._changing = tuple(changing)

    def changing(self) -> tuple[ChangingSegment, ...]:
        """The segments of the last prefix that changed on each of the last prefixes."""
        return self._changing
