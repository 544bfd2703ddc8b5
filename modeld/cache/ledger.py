"""Which KV cells each sequence uses, so bytes are counted once and the pool never overflows.

llama.cpp's unified KV lets sequences share cells: copying the first ``n`` tokens of a sequence
only adds the destination to those cells' sequence sets (blueprints/0016-warm-state.md, "KV layout"), and a
cell is freed only when no sequence holds it any more. The ledger mirrors that exactly and
cheaply: every run of cells created by one evaluation (or one restore) is a *group*; a sequence
is a list of references to group prefixes; a group uses as many cells as its longest reference.
Copying with shared cells copies references; copying without (separate KV streams) creates a
new group. Truncating cuts references; emptying drops them.

Positions map to groups in order, and every reference to a group starts at the group's first
position (a copy always takes a prefix), so "longest reference" is exact.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass

__all__ = ["Ledger"]


@dataclass(slots=True)
class _Ref:
    group: int
    start: int  # position of the group's first cell
    length: int  # cells of the group this sequence holds


class Ledger:
    """Cell accounting for one runtime's sequences."""

    def __init__(self, shared_cells: bool) -> None:
        self.shared_cells = shared_cells
        self._ids = itertools.count(1)
        self._seqs: dict[int, list[_Ref]] = {}

    def length(self, seq: int) -> int:
        refs = self._seqs.get(seq, [])
        return refs[-1].start + refs[-1].length if refs else 0

    def truncate(self, seq: int, keep: int) -> None:
        refs = self._seqs.get(seq, [])
        out: list[_Ref] = []
        for ref in refs:
            if ref.start >= keep:
                break
            out.append(_Ref(ref.group, ref.start, min(ref.length, keep - ref.start)))
        self._seqs[seq] = out

    def extend(self, seq: int, n: int) -> None:
        """``n`` new cells after what ``seq`` holds (evaluated, or restored)."""
        if n <= 0:
            return
        refs = self._seqs.setdefault(seq, [])
        last = refs[-1] if refs else None
        if last is not None and not self._referenced_elsewhere(last.group, seq):
            last.length += n  # the sequence's own tail grows (one decoded token at a time)
            return
        refs.append(_Ref(next(self._ids), self.length(seq), n))

    def _referenced_elsewhere(self, group: int, seq: int) -> bool:
        return any(ref.group == group for other, refs in self._seqs.items() if other != seq for ref in refs)

    def drop(self, seq: int) -> None:
        self._seqs.pop(seq, None)

    def copy(self, src: int, dst: int, n: int) -> None:
        """``dst`` := the first ``n`` tokens of ``src`` (shared cells, or a fresh copy)."""
        self.drop(dst)
        if self.shared_cells:
            self._seqs[dst] = [_Ref(r.group, r.start, r.length) for r in self._seqs.get(src, [])]
            self.truncate(dst, n)
        else:
            self.extend(dst, min(n, self.length(src)))

    def share(self, src: int, dst: int, n: int) -> None:
        """``dst``'s first ``n`` cells are ``src``'s from now on (the same tokens, its own
        freed): ``src``'s references up to ``n``, then what ``dst`` holds past ``n`` (a run of
        its own that started before ``n`` becomes a new group from ``n``: its earlier cells are
        gone)."""
        head = [_Ref(r.group, r.start, r.length) for r in self._seqs.get(src, [])]
        tail: list[_Ref] = []
        for ref in self._seqs.get(dst, []):
            end = ref.start + ref.length
            if end <= n:
                continue
            if ref.start >= n:
                tail.append(_Ref(ref.group, ref.start, ref.length))
            else:
                tail.append(_Ref(next(self._ids), n, end - n))
        self._seqs[dst] = head
        self.truncate(dst, n)
        self._seqs[dst] += tail

    def set(self, seq: int, n: int) -> None:
        """``seq`` holds exactly ``n`` cells of its own (after a restore, or to resynchronize)."""
        self.drop(seq)
        self.extend(seq, n)

    def used(self, cut: tuple[int, int] | None = None) -> int:
        """Cells in use in the whole pool (a shared prefix counts once); ``cut`` = (seq, keep):
        as they will be once ``seq`` is cut to its first ``keep`` tokens (a turn's sync cuts
        its sequence before it evaluates)."""
        longest: dict[int, int] = {}
        for seq, refs in self._seqs.items():
            for ref in refs:
                length = ref.length
                if cut is not None and seq == cut[0]:
                    length = max(0, min(length, cut[1] - ref.start))
                if length > longest.get(ref.group, 0):
                    longest[ref.group] = length
        return sum(longest.values())

    def unique(self, seq: int) -> int:
        """Cells that only ``seq`` holds (what emptying it would free)."""
        others: dict[int, int] = {}
        for other, refs in self._seqs.items():
            if other == seq:
                continue
            for ref in refs:
                others[ref.group] = max(others.get(ref.group, 0), ref.length)
        return sum(max(0, ref.length - others.get(ref.group, 0)) for ref in self._seqs.get(seq, []))

    def shared_with(self, seq: int) -> int:
        """Cells of ``seq`` that another sequence also holds."""
        refs = self._seqs.get(seq, [])
        return sum(ref.length for ref in refs) - self.unique(seq)
