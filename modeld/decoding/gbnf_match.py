"""The exact byte-level matcher of a parsed GBNF grammar (:mod:`modeld.decoding.gbnf` parses it).

A :class:`Grammar` is rules of alternatives of symbols (:class:`Chars` terminals and rule
names); :meth:`Grammar.byte_matcher` returns a :class:`ByteMatcher` that says, byte by byte,
which next bytes keep the output a prefix of a sentence of the grammar.

The matcher works like llama.cpp's: a set of stacks of positions in rules, advanced one code
point at a time. Bytes are handled exactly: a byte is allowed if and only if some code point
the grammar accepts next starts with the pending bytes plus that byte (UTF-8 preserves code
point order, so the code points sharing a byte prefix form an interval). Surrogates are never
produced. State transitions are cached on the grammar, so repeated decodes get faster. Design
record: ``blueprints/0018-constraints-and-tool-calls.md``.
"""

from __future__ import annotations

import bisect
from collections.abc import Iterator
from dataclasses import dataclass

from modeld.errors import UnsupportedError

__all__ = ["MAX_CODEPOINT", "Alternative", "ByteMatcher", "Chars", "Grammar", "Symbol", "merge_ranges"]

MAX_CODEPOINT = 0x10FFFF
MAX_STACKS = 4096
"""A grammar so ambiguous that more stacks than this are alive is refused while matching."""
_CACHE_ENTRIES = 200_000


@dataclass(frozen=True, slots=True)
class Chars:
    """A terminal: a set of code points as sorted, disjoint, inclusive ranges."""

    ranges: tuple[tuple[int, int], ...]

    def __contains__(self, cp: object) -> bool:
        if not isinstance(cp, int):
            return False
        i = bisect.bisect_right(self.ranges, (cp, MAX_CODEPOINT + 1)) - 1
        return i >= 0 and self.ranges[i][0] <= cp <= self.ranges[i][1]


Symbol = Chars | str  # a terminal, or the name of a rule
Alternative = tuple[Symbol, ...]
Frame = tuple[str, int, int]  # (rule, alternative, position of the next symbol)
Stack = tuple[Frame, ...]  # top last
State = frozenset[Stack]


def merge_ranges(ranges: list[tuple[int, int]]) -> tuple[tuple[int, int], ...]:
    out: list[tuple[int, int]] = []
    for lo, hi in sorted(ranges):
        if out and lo <= out[-1][1] + 1:
            out[-1] = (out[-1][0], max(out[-1][1], hi))
        else:
            out.append((lo, hi))
    return tuple(out)


@dataclass(frozen=True, slots=True)
class _Bounds:
    lo: int
    hi: int
    length: int
    lead_mask: int
    lead_marker: int


_CLASSES = (
    _Bounds(0x0, 0x7F, 1, 0x7F, 0x00),
    _Bounds(0x80, 0x7FF, 2, 0x1F, 0xC0),
    _Bounds(0x800, 0xD7FF, 3, 0x0F, 0xE0),
    _Bounds(0xE000, 0xFFFF, 3, 0x0F, 0xE0),
    _Bounds(0x10000, MAX_CODEPOINT, 4, 0x07, 0xF0),
)
_LEAD_MARKER_MASK = {1: 0x80, 2: 0xE0, 3: 0xF0, 4: 0xF8}


def _byte_at(cp: int, length: int, k: int) -> int:
    if k == 0:
        return cp if length == 1 else ((0xF00 >> length) & 0xFF) | (cp >> (6 * (length - 1)))
    return 0x80 | ((cp >> (6 * (length - 1 - k))) & 0x3F)


def _prefix_interval(pending: bytes, cls: _Bounds) -> tuple[int, int] | None:
    """The code points of ``cls`` whose UTF-8 starts with ``pending`` (an interval), or None."""
    if not pending:
        return cls.lo, cls.hi
    if len(pending) >= cls.length or pending[0] & _LEAD_MARKER_MASK[cls.length] != cls.lead_marker:
        return None
    lo = hi = pending[0] & cls.lead_mask
    for b in pending[1:]:
        lo = (lo << 6) | (b & 0x3F)
        hi = (hi << 6) | (b & 0x3F)
    rest = cls.length - len(pending)
    lo, hi = lo << (6 * rest), (hi << (6 * rest)) | ((1 << (6 * rest)) - 1)
    lo, hi = max(lo, cls.lo), min(hi, cls.hi)
    return (lo, hi) if lo <= hi else None


def _next_bytes(ranges: tuple[tuple[int, int], ...], pending: bytes) -> set[int]:
    """Every byte b such that pending + b starts the UTF-8 of a code point in ``ranges``."""
    out: set[int] = set()
    k = len(pending)
    for cls in _CLASSES:
        window = _prefix_interval(pending, cls)
        if window is None:
            continue
        for lo, hi in ranges:
            a, b = max(lo, window[0]), min(hi, window[1])
            if a <= b:
                out.update(range(_byte_at(a, cls.length, k), _byte_at(b, cls.length, k) + 1))
    return out


def _utf8_length(lead: int) -> int:
    if lead < 0x80:
        return 1
    if lead >> 5 == 0b110:
        return 2
    if lead >> 4 == 0b1110:
        return 3
    return 4


class Grammar:
    """A parsed grammar: rules of alternatives of symbols, and cached matcher transitions."""

    def __init__(self, rules: dict[str, tuple[Alternative, ...]], root: str, source: str) -> None:
        self.rules = rules
        self.root = root
        self.source = source
        self._expand_cache: dict[Stack, frozenset[Stack]] = {}
        self._step_cache: dict[tuple[State, int], State] = {}
        self._mask_cache: dict[tuple[State, bytes], frozenset[int]] = {}
        self.start: State = self._expand(((root, i, 0),) for i in range(len(rules[root])))

    def byte_matcher(self) -> ByteMatcher:
        return ByteMatcher(self)

    def _expand_one(self, stack: Stack) -> frozenset[Stack]:
        cached = self._expand_cache.get(stack)
        if cached is not None:
            return cached
        out: set[Stack] = set()
        todo = [stack]
        while todo:
            st = todo.pop()
            if not st:
                out.add(st)
                continue
            rule, alt, pos = st[-1]
            seq = self.rules[rule][alt]
            if pos >= len(seq):
                todo.append(st[:-1])
                continue
            sym = seq[pos]
            if isinstance(sym, Chars):
                out.add(st)
                continue
            base = st[:-1] if pos + 1 >= len(seq) else (*st[:-1], (rule, alt, pos + 1))
            for j in range(len(self.rules[sym])):
                todo.append((*base, (sym, j, 0)))
        result = frozenset(out)
        if len(self._expand_cache) < _CACHE_ENTRIES:
            self._expand_cache[stack] = result
        return result

    def _expand(self, stacks: Iterator[Stack] | list[Stack]) -> State:
        out: set[Stack] = set()
        for st in stacks:
            out |= self._expand_one(st)
        if len(out) > MAX_STACKS:
            raise UnsupportedError(
                f"the grammar is too ambiguous to match ({len(out)} parses alive at once)",
                field="constraint",
            )
        return frozenset(out)

    def step(self, state: State, cp: int) -> State:
        key = (state, cp)
        cached = self._step_cache.get(key)
        if cached is not None:
            return cached
        moved: list[Stack] = []
        for st in state:
            if not st:
                continue
            rule, alt, pos = st[-1]
            sym = self.rules[rule][alt][pos]
            assert isinstance(sym, Chars)
            if cp in sym:
                seq_len = len(self.rules[rule][alt])
                moved.append(st[:-1] if pos + 1 >= seq_len else (*st[:-1], (rule, alt, pos + 1)))
        result = self._expand(moved)
        if len(self._step_cache) < _CACHE_ENTRIES:
            self._step_cache[key] = result
        return result

    def allowed_bytes(self, state: State, pending: bytes) -> frozenset[int]:
        key = (state, pending)
        cached = self._mask_cache.get(key)
        if cached is not None:
            return cached
        ranges: list[tuple[int, int]] = []
        for st in state:
            if st:
                rule, alt, pos = st[-1]
                sym = self.rules[rule][alt][pos]
                assert isinstance(sym, Chars)
                ranges.extend(sym.ranges)
        result = frozenset(_next_bytes(merge_ranges(ranges), pending))
        if len(self._mask_cache) < _CACHE_ENTRIES:
            self._mask_cache[key] = result
        return result


class ByteMatcher:
    """Walks a grammar one output byte at a time (the reference backend's tokens are bytes).

    ``allowed(b)``: whether byte ``b`` may come next. ``advance(b)``: take it (a byte that is
    not allowed makes the matcher dead). ``accepting()``: the bytes so far are a complete
    sentence (so the model may end here). ``dead()``: nothing can follow any more.
    """

    __slots__ = ("_grammar", "_pending", "_state")

    def __init__(self, grammar: Grammar) -> None:
        self._grammar = grammar
        self._state: State = grammar.start
        self._pending = b""

    def allowed_bytes(self) -> frozenset[int]:
        return self._grammar.allowed_bytes(self._state, self._pending)

    def copy(self) -> ByteMatcher:
        """An independent matcher in the same place (to probe ahead: a draft)."""
        other = ByteMatcher(self._grammar)
        other._state, other._pending = self._state, self._pending
        return other

    def allowed(self, byte: int) -> bool:
        return byte in self.allowed_bytes()

    def advance(self, byte: int) -> None:
        if not self.allowed(byte):
            self._state, self._pending = frozenset(), b""
            return
        pending = self._pending + bytes((byte,))
        if len(pending) < _utf8_length(pending[0]):
            self._pending = pending
            return
        self._pending = b""
        self._state = self._grammar.step(self._state, ord(pending.decode("utf-8")))

    def advance_bytes(self, data: bytes) -> None:
        for b in data:
            self.advance(b)

    def accepting(self) -> bool:
        return not self._pending and () in self._state

    def dead(self) -> bool:
        return not self._state or (not self.allowed_bytes() and not self.accepting())
