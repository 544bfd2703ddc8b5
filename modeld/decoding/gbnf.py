"""GBNF grammars: a parser that reports where an error is, and an exact byte-level matcher.

What: :func:`parse_gbnf` reads llama.cpp's GBNF syntax (``grammars/README.md`` in llama.cpp)
into a :class:`Grammar`; :meth:`Grammar.byte_matcher` returns a :class:`ByteMatcher` that says,
byte by byte, which next bytes keep the output a prefix of a sentence of the grammar.

Why: every constraint kind (JSON schema, regex, grammar) is turned into GBNF text, so one
grammar is what the backends enforce (llama.cpp's grammar sampler, llguidance, OpenVINO's
EBNF) and what the reference backend's matcher checks. llama.cpp only prints a parse error to
its log; this parser gives ``invalid_argument`` with the line and column.

The syntax accepted (the same as llama.cpp's): ``name ::= alternatives`` rules (names of
letters, digits, ``-`` and ``_``), ``|``, sequences, ``( ... )`` groups, ``"literal"`` and
``[class]`` / ``[^class]`` terminals with ranges, ``.`` (any character), escapes ``\\x..``,
``\\u....``, ``\\U........``, ``\\t \\n \\r \\\\ \\" \\[ \\] \\-``, postfix ``* + ?`` and ``{m}``,
``{m,}``, ``{m,n}``, ``#`` comments. A rule ends at a line break unless inside parentheses or
after ``|``. The start rule is ``root``.

What not: token references (``<[id]>``, ``<|name|>``) are ``unsupported`` (they name tokens of
one vocabulary); left recursion (a rule that can reach itself before consuming a character) is
``invalid_argument``, as in llama.cpp.

The matcher works like llama.cpp's: a set of stacks of positions in rules, advanced one code
point at a time. Bytes are handled exactly: a byte is allowed if and only if some code point
the grammar accepts next starts with the pending bytes plus that byte (UTF-8 preserves code
point order, so the code points sharing a byte prefix form an interval). Surrogates are never
produced. State transitions are cached on the grammar, so repeated decodes get faster.
"""

from __future__ import annotations

import bisect
from collections.abc import Iterator
from dataclasses import dataclass

from modeld.errors import InvalidArgumentError, LimitExceededError, UnsupportedError

__all__ = [
    "MAX_CODEPOINT",
    "MAX_REPETITION",
    "ByteMatcher",
    "Chars",
    "Grammar",
    "gbnf_literal",
    "parse_gbnf",
]

MAX_CODEPOINT = 0x10FFFF
MAX_REPETITION = 1000
"""Largest ``{m,n}`` bound (llama.cpp allows 2000; both keep grammars small)."""
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


def _merge(ranges: list[tuple[int, int]]) -> tuple[tuple[int, int], ...]:
    out: list[tuple[int, int]] = []
    for lo, hi in sorted(ranges):
        if out and lo <= out[-1][1] + 1:
            out[-1] = (out[-1][0], max(out[-1][1], hi))
        else:
            out.append((lo, hi))
    return tuple(out)


def _negate(ranges: tuple[tuple[int, int], ...]) -> tuple[tuple[int, int], ...]:
    out: list[tuple[int, int]] = []
    nxt = 0
    for lo, hi in ranges:
        if lo > nxt:
            out.append((nxt, lo - 1))
        nxt = hi + 1
    if nxt <= MAX_CODEPOINT:
        out.append((nxt, MAX_CODEPOINT))
    return tuple(out)


def gbnf_literal(text: str) -> str:
    """``text`` as a GBNF string literal (escaping quotes, backslashes and control characters)."""
    out = ['"']
    for ch in text:
        cp = ord(ch)
        if ch == '"':
            out.append('\\"')
        elif ch == "\\":
            out.append("\\\\")
        elif ch == "\n":
            out.append("\\n")
        elif ch == "\r":
            out.append("\\r")
        elif ch == "\t":
            out.append("\\t")
        elif cp < 0x20 or cp == 0x7F:
            out.append(f"\\x{cp:02X}")
        else:
            out.append(ch)
    out.append('"')
    return "".join(out)


class _Parser:
    """Recursive descent over the GBNF text; errors carry the offset, line and column."""

    def __init__(self, src: str, field: str) -> None:
        self.src = src
        self.pos = 0
        self.field = field
        self.rules: dict[str, list[Alternative]] = {}
        self.defined_at: dict[str, int] = {}
        self.referenced_at: dict[str, int] = {}
        self._generated = 0

    # --- errors ---------------------------------------------------------------------------

    def _where(self, pos: int) -> tuple[int, int]:
        line = self.src.count("\n", 0, pos) + 1
        column = pos - (self.src.rfind("\n", 0, pos) + 1) + 1
        return line, column

    def error(self, message: str, pos: int | None = None, *, unsupported: bool = False) -> Exception:
        at = self.pos if pos is None else pos
        line, column = self._where(at)
        text = f"grammar error at line {line}, column {column}: {message}"
        cls = UnsupportedError if unsupported else InvalidArgumentError
        return cls(text, field=self.field, offset=at, line=line, column=column)

    # --- lexing ---------------------------------------------------------------------------

    def peek(self, n: int = 0) -> str:
        i = self.pos + n
        return self.src[i] if i < len(self.src) else ""

    def space(self, newlines: bool) -> None:
        src = self.src
        while self.pos < len(src):
            c = src[self.pos]
            if c in " \t" or (newlines and c in "\r\n"):
                self.pos += 1
            elif c == "#":
                while self.pos < len(src) and src[self.pos] not in "\r\n":
                    self.pos += 1
            else:
                return

    def name(self) -> str:
        start = self.pos
        while self.pos < len(self.src) and (
            self.src[self.pos].isascii() and (self.src[self.pos].isalnum() or self.src[self.pos] in "-_")
        ):
            self.pos += 1
        if self.pos == start:
            raise self.error("expected a rule name")
        return self.src[start : self.pos]

    def number(self) -> int:
        start = self.pos
        while self.peek().isascii() and self.peek().isdigit():
            self.pos += 1
        if self.pos == start:
            raise self.error("expected a number")
        return int(self.src[start : self.pos])

    def char(self) -> int:
        """One character of a literal or class, with escapes; returns its code point."""
        start = self.pos
        c = self.peek()
        if not c:
            raise self.error("unexpected end of the grammar")
        if c != "\\":
            self.pos += 1
            return ord(c)
        esc = self.peek(1)
        self.pos += 2
        simple = {"t": 9, "n": 10, "r": 13, "\\": 92, '"': 34, "[": 91, "]": 93, "-": 45, "/": 47}
        if esc in simple:
            return simple[esc]
        width = {"x": 2, "u": 4, "U": 8}.get(esc)
        if width is None:
            raise self.error(f"unknown escape \\{esc}", start)
        digits = self.src[self.pos : self.pos + width]
        if len(digits) != width or any(d not in "0123456789abcdefABCDEF" for d in digits):
            raise self.error(f"\\{esc} needs {width} hex digits", start)
        self.pos += width
        cp = int(digits, 16)
        if cp > MAX_CODEPOINT:
            raise self.error(f"code point {cp:#x} is beyond U+10FFFF", start)
        return cp

    # --- grammar --------------------------------------------------------------------------

    def fresh(self, base: str) -> str:
        self._generated += 1
        return f"{base}~{self._generated}"  # "~" never appears in a written name

    def parse(self) -> None:
        self.space(True)
        while self.pos < len(self.src):
            start = self.pos
            name = self.name()
            self.space(False)
            if not self.src.startswith("::=", self.pos):
                raise self.error("expected ::= after the rule name")
            self.pos += 3
            self.space(True)
            if name in self.defined_at:
                raise self.error(f"rule {name!r} is defined twice", start)
            self.defined_at[name] = start
            self.rules[name] = self.alternates(name, nested=False)
            if self.pos < len(self.src) and self.peek() not in "\r\n":
                raise self.error("expected a line break or the end of the grammar")
            self.space(True)

    def alternates(self, rule: str, *, nested: bool) -> list[Alternative]:
        alts = [self.sequence(rule, nested=nested)]
        while self.peek() == "|":
            self.pos += 1
            self.space(True)
            alts.append(self.sequence(rule, nested=nested))
        return alts

    def sequence(self, rule: str, *, nested: bool) -> Alternative:
        out: list[Symbol] = []
        last: list[Symbol] = []  # the symbols of the last element (for a postfix operator)
        while self.pos < len(self.src):
            c = self.peek()
            start = self.pos
            if c == '"':
                self.pos += 1
                last = []
                while self.peek() != '"':
                    if not self.peek() or self.peek() in "\r\n":
                        raise self.error("unterminated string literal", start)
                    cp = self.char()
                    last.append(Chars(((cp, cp),)))
                self.pos += 1
            elif c == "[":
                self.pos += 1
                negated = self.peek() == "^"
                if negated:
                    self.pos += 1
                ranges: list[tuple[int, int]] = []
                while self.peek() != "]":
                    if not self.peek():
                        raise self.error("unterminated character class", start)
                    lo = self.char()
                    hi = lo
                    if self.peek() == "-" and self.peek(1) not in ("]", ""):
                        self.pos += 1
                        hi = self.char()
                        if hi < lo:
                            raise self.error("character range is out of order", start)
                    ranges.append((lo, hi))
                self.pos += 1
                merged = _merge(ranges)
                chars = Chars(_negate(merged) if negated else merged)
                if not chars.ranges:
                    raise self.error("character class matches nothing", start)
                last = [chars]
            elif c == ".":
                self.pos += 1
                last = [Chars(((0, MAX_CODEPOINT),))]
            elif c == "(":
                self.pos += 1
                self.space(True)
                sub = self.fresh(rule)
                self.rules[sub] = self.alternates(sub, nested=True)
                if self.peek() != ")":
                    raise self.error("expected ')'", self.pos)
                self.pos += 1
                last = [sub]
            elif c == "<":
                raise self.error("token references are not supported", unsupported=True)
            elif c.isascii() and (c.isalnum() or c in "-_"):
                name = self.name()
                self.referenced_at.setdefault(name, start)
                last = [name]
            elif c in "*+?{":
                if not last:
                    raise self.error(f"{c!r} must follow an element")
                lo, hi_bound = self.repetition()
                body = self.fresh(rule)
                self.rules[body] = [tuple(last)]
                del out[len(out) - len(last) :]
                out.append(self.repeat(rule, body, lo, hi_bound))
                last = []
                self.space(nested)
                continue
            else:
                break
            out.extend(last)
            self.space(nested)
        return tuple(out)

    def repetition(self) -> tuple[int, int | None]:
        c = self.peek()
        self.pos += 1
        if c == "*":
            return 0, None
        if c == "+":
            return 1, None
        if c == "?":
            return 0, 1
        start = self.pos - 1
        self.space(False)
        lo = self.number()
        hi: int | None = lo
        self.space(False)
        if self.peek() == ",":
            self.pos += 1
            self.space(False)
            hi = self.number() if self.peek().isdigit() else None
            self.space(False)
        if self.peek() != "}":
            raise self.error("expected '}' to close the repetition", start)
        self.pos += 1
        if (hi is not None and hi < lo) or lo > MAX_REPETITION or (hi or 0) > MAX_REPETITION:
            raise self.error(f"repetition bounds must satisfy m <= n <= {MAX_REPETITION}", start)
        return lo, hi

    def repeat(self, rule: str, body: str, lo: int, hi: int | None) -> str:
        """A rule matching ``body`` lo..hi times (hi None: unbounded), right-recursive."""
        name = self.fresh(rule)
        tail: list[Symbol]
        if hi is None:
            star = self.fresh(rule)
            self.rules[star] = [(body, star), ()]
            tail = [star]
        else:
            tail = []
            for _ in range(hi - lo):  # nested optionals: (body (body ...)?)?
                opt = self.fresh(rule)
                self.rules[opt] = [(body, *tail), ()]
                tail = [opt]
        self.rules[name] = [tuple([body] * lo + tail)]
        return name


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
        result = frozenset(_next_bytes(_merge(ranges), pending))
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


def _check(parser: _Parser, root: str) -> dict[str, tuple[Alternative, ...]]:
    rules = {name: tuple(alts) for name, alts in parser.rules.items()}
    for name, at in parser.referenced_at.items():
        if name not in rules:
            raise parser.error(f"rule {name!r} is used but never defined", at)
    if root not in rules:
        raise parser.error(f"the grammar has no {root!r} rule", 0)
    # Left recursion: a rule that reaches itself through symbols that can all be empty.
    nullable: set[str] = set()
    changed = True
    while changed:
        changed = False
        for name, alts in rules.items():
            if name not in nullable and any(
                all(isinstance(s, str) and s in nullable for s in a) for a in alts
            ):
                nullable.add(name)
                changed = True
    left: dict[str, set[str]] = {}
    for name, alts in rules.items():
        edges: set[str] = set()
        for alt in alts:
            for sym in alt:
                if isinstance(sym, Chars):
                    break
                edges.add(sym)
                if sym not in nullable:
                    break
        left[name] = edges
    state: dict[str, int] = {}

    def visit(name: str) -> None:
        state[name] = 1
        for nxt in left[name]:
            if state.get(nxt) == 1:
                written = nxt.split("~")[0]
                raise parser.error(
                    f"rule {written!r} is left-recursive (it can reach itself before consuming a character)",
                    parser.defined_at.get(written, 0),
                )
            if nxt not in state:
                visit(nxt)
        state[name] = 2

    for name in rules:
        if name not in state:
            visit(name)
    return rules


def parse_gbnf(source: str, *, root: str = "root", field: str = "constraint.value") -> Grammar:
    """Parse GBNF text; ``invalid_argument`` (with offset, line, column) if it is not valid."""
    if len(source) > 1 << 20:
        raise LimitExceededError(
            "the grammar is larger than 1 MiB",
            limit="max_constraint_bytes",
            value=len(source),
            maximum=1 << 20,
        )
    parser = _Parser(source, field)
    try:
        parser.parse()
    except RecursionError as exc:
        raise parser.error("the grammar nests too deeply") from exc
    rules = _check(parser, root)
    try:
        return Grammar(rules, root, source)
    except RecursionError as exc:  # pragma: no cover - expansion is iterative
        raise parser.error("the grammar nests too deeply") from exc
