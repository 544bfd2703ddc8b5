"""GBNF grammars: a parser that reports where an error is (the matcher: :mod:`modeld.decoding.gbnf_match`).

What: :func:`parse_gbnf` reads llama.cpp's GBNF syntax (``grammars/README.md`` in llama.cpp)
into a :class:`~modeld.decoding.gbnf_match.Grammar`; its ``byte_matcher()`` returns a
:class:`~modeld.decoding.gbnf_match.ByteMatcher` that says, byte by byte, which next bytes keep
the output a prefix of a sentence of the grammar.

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
"""

from __future__ import annotations

from modeld.decoding.gbnf_match import MAX_CODEPOINT, Alternative, Chars, Grammar, Symbol, merge_ranges
from modeld.errors import InvalidArgumentError, LimitExceededError, UnsupportedError

__all__ = ["MAX_REPETITION", "gbnf_literal", "parse_gbnf"]

MAX_REPETITION = 1000
"""Largest ``{m,n}`` bound (llama.cpp allows 2000; both keep grammars small)."""


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
                merged = merge_ranges(ranges)
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
