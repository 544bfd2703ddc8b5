"""Regular expression -> GBNF, for the subset that has the same meaning everywhere.

What: :func:`regex_to_gbnf_expr` turns a pattern into one GBNF expression that matches a
subset of the strings the pattern matches *in full* (``re.fullmatch``): every string the
grammar accepts is matched by Python's ``re`` (sound), which is what "the output matches the
regex" needs. :func:`regex_gbnf` wraps it as a grammar with a ``root`` rule.

The subset: literals, ``.`` (any character but a line break), classes ``[...]``/``[^...]``
with ranges, escapes ``\\d \\w \\s \\D \\W \\S \\n \\t \\r \\f \\v \\0 \\xhh \\uhhhh`` and escaped
metacharacters, groups ``(...)``, ``(?:...)``, ``(?P<name>...)``, ``(?<name>...)``, ``|``,
quantifiers ``* + ? {m} {m,} {m,n}`` (lazy ``?`` variants allowed: same language), ``^`` at the
start and ``$`` at the end (matching is always of the whole output). ``\\d``, ``\\w``, ``\\s`` mean
their ASCII sets (a subset of Python's Unicode ones), and their negations the ASCII complement.

What not: backreferences, lookaround, word boundaries, inline flags, possessive quantifiers and
anchors in the middle are ``unsupported`` with their position; a malformed pattern is
``invalid_argument`` with its position.

``json_string=True`` (for a JSON schema ``pattern``) removes ``"``, ``\\`` and control
characters from every set, so the raw characters are also the JSON-encoded ones.
"""

from __future__ import annotations

from modeld.decoding.gbnf import MAX_REPETITION, gbnf_literal
from modeld.decoding.gbnf_match import MAX_CODEPOINT
from modeld.errors import InvalidArgumentError, UnsupportedError

__all__ = ["regex_gbnf", "regex_to_gbnf_expr"]

Ranges = list[tuple[int, int]]

_DIGIT: Ranges = [(0x30, 0x39)]
_WORD: Ranges = [(0x30, 0x39), (0x41, 0x5A), (0x5F, 0x5F), (0x61, 0x7A)]
_SPACE: Ranges = [(0x09, 0x0D), (0x20, 0x20)]
_ASCII: Ranges = [(0, 0x7F)]
_JSON_UNSAFE: Ranges = [(0, 0x1F), (0x22, 0x22), (0x5C, 0x5C)]
_SIMPLE = {"n": 10, "t": 9, "r": 13, "f": 12, "v": 11, "0": 0, "a": 7}


def _norm(ranges: Ranges) -> Ranges:
    out: Ranges = []
    for lo, hi in sorted(ranges):
        if out and lo <= out[-1][1] + 1:
            out[-1] = (out[-1][0], max(out[-1][1], hi))
        else:
            out.append((lo, hi))
    return out


def _complement(ranges: Ranges, within: Ranges | None = None) -> Ranges:
    out: Ranges = []
    nxt = 0
    for lo, hi in _norm(ranges):
        if lo > nxt:
            out.append((nxt, lo - 1))
        nxt = hi + 1
    if nxt <= MAX_CODEPOINT:
        out.append((nxt, MAX_CODEPOINT))
    return _intersect(out, within) if within is not None else out


def _intersect(a: Ranges, b: Ranges) -> Ranges:
    out: Ranges = []
    for lo1, hi1 in _norm(a):
        for lo2, hi2 in _norm(b):
            lo, hi = max(lo1, lo2), min(hi1, hi2)
            if lo <= hi:
                out.append((lo, hi))
    return _norm(out)


def _subtract(a: Ranges, b: Ranges) -> Ranges:
    return _intersect(a, _complement(b))


def _class_gbnf(ranges: Ranges) -> str:
    parts: list[str] = []
    for lo, hi in _norm(ranges):
        parts.append(_class_char(lo) if lo == hi else f"{_class_char(lo)}-{_class_char(hi)}")
    return "[" + "".join(parts) + "]"


def _class_char(cp: int) -> str:
    if cp < 0x20 or cp in (0x22, 0x5C, 0x5D, 0x5B, 0x2D, 0x5E, 0x7F) or 0xD800 <= cp <= 0xDFFF:
        return f"\\x{cp:02X}" if cp <= 0xFF else (f"\\u{cp:04X}" if cp <= 0xFFFF else f"\\U{cp:08X}")
    return chr(cp)


class _Regex:
    def __init__(self, pattern: str, field: str, pointer: str, json_string: bool) -> None:
        self.src = pattern
        self.pos = 0
        self.field = field
        self.pointer = pointer
        self.json_string = json_string

    def error(self, message: str, pos: int | None = None, *, unsupported: bool = False) -> Exception:
        at = self.pos if pos is None else pos
        where = f" ({self.pointer})" if self.pointer else ""
        text = f"regular expression error at offset {at}{where}: {message}"
        details: dict[str, str | int] = {"offset": at}
        if self.pointer:
            details["pointer"] = self.pointer
        cls = UnsupportedError if unsupported else InvalidArgumentError
        return cls(text, field=self.field, **details)

    def peek(self, n: int = 0) -> str:
        i = self.pos + n
        return self.src[i] if i < len(self.src) else ""

    def parse(self) -> str:
        if self.peek() == "^":
            self.pos += 1
        expr = self.alternation(top=True)
        if self.pos < len(self.src):
            raise self.error("unbalanced ')'")
        return expr

    def alternation(self, *, top: bool = False) -> str:
        alts = [self.sequence(top=top)]
        while self.peek() == "|":
            self.pos += 1
            alts.append(self.sequence(top=top))
        if len(alts) == 1:
            return alts[0]
        return "( " + " | ".join(a or '""' for a in alts) + " )"

    def sequence(self, *, top: bool) -> str:
        items: list[str] = []
        while self.pos < len(self.src) and self.peek() not in "|)":
            start = self.pos
            c = self.peek()
            if c == "$":
                self.pos += 1
                if top and (self.pos == len(self.src) or self.peek() in "|"):
                    continue
                raise self.error("'$' is only supported at the end", start, unsupported=True)
            if c == "^":
                raise self.error("'^' is only supported at the start", start, unsupported=True)
            atom = self.atom()
            atom = self.quantified(atom, start)
            items.append(atom)
        return " ".join(items)

    def atom(self) -> str:
        c = self.peek()
        start = self.pos
        if c == "(":
            self.pos += 1
            if self.peek() == "?":
                kind = self.src[self.pos : self.pos + 3]
                if kind.startswith("?:"):
                    self.pos += 2
                elif kind.startswith("?P<") or (kind.startswith("?<") and kind[2:3] not in ("=", "!")):
                    end = self.src.find(">", self.pos)
                    if end < 0:
                        raise self.error("unterminated group name", start)
                    self.pos = end + 1
                elif kind.startswith(("?=", "?!", "?<")):
                    raise self.error("lookaround", start, unsupported=True)
                else:
                    raise self.error("inline flags and extensions", start, unsupported=True)
            inner = self.alternation()
            if self.peek() != ")":
                raise self.error("missing ')'", start)
            self.pos += 1
            return f"( {inner or chr(34) * 2} )"
        if c == "[":
            return self.chars(self.klass())
        if c == ".":
            self.pos += 1
            return self.chars(_complement([(10, 10)]))
        if c in "*+?":
            raise self.error(f"nothing to repeat before {c!r}", start)
        if c == "{" and self._quantifier_ahead():
            raise self.error("nothing to repeat before '{'", start)
        if c == "\\":
            ranges = self.escape(in_class=False)
            return self.chars(ranges)
        self.pos += 1
        return self.chars([(ord(c), ord(c))])

    def chars(self, ranges: Ranges) -> str:
        if self.json_string:
            ranges = _subtract(ranges, _JSON_UNSAFE)
        ranges = _subtract(ranges, [(0xD800, 0xDFFF)])
        if not ranges:
            raise self.error(
                "this part can only match characters that a JSON string must escape"
                if self.json_string
                else "this part matches no character",
                unsupported=True,
            )
        if len(ranges) == 1 and ranges[0][0] == ranges[0][1]:
            return gbnf_literal(chr(ranges[0][0]))
        return _class_gbnf(ranges)

    def escape(self, *, in_class: bool) -> Ranges:
        start = self.pos
        self.pos += 1
        c = self.peek()
        if not c:
            raise self.error("a pattern cannot end with a backslash", start)
        self.pos += 1
        if c == "d":
            return list(_DIGIT)
        if c == "w":
            return list(_WORD)
        if c == "s":
            return list(_SPACE)
        if c in "DWS":
            base = {"D": _DIGIT, "W": _WORD, "S": _SPACE}[c]
            return _complement(base, _ASCII)
        if c in _SIMPLE:
            return [(_SIMPLE[c], _SIMPLE[c])]
        if c in "xu":
            width = 2 if c == "x" else 4
            digits = self.src[self.pos : self.pos + width]
            if len(digits) != width or any(d not in "0123456789abcdefABCDEF" for d in digits):
                raise self.error(f"\\{c} needs {width} hex digits", start)
            self.pos += width
            cp = int(digits, 16)
            return [(cp, cp)]
        if c == "b" and in_class:
            return [(8, 8)]
        if c.isalnum():
            raise self.error(f"the escape \\{c}", start, unsupported=True)
        return [(ord(c), ord(c))]

    def klass(self) -> Ranges:
        start = self.pos
        self.pos += 1
        negated = self.peek() == "^"
        if negated:
            self.pos += 1
        ranges: Ranges = []
        unicode_shorthand = False
        first = True
        while True:
            c = self.peek()
            if not c:
                raise self.error("unterminated character class", start)
            if c == "]" and not first:
                self.pos += 1
                break
            first = False
            if c == "\\":
                shorthand = self.peek(1) in "dwsDWS"
                unicode_shorthand |= shorthand
                lo_set = self.escape(in_class=True)
                if shorthand:
                    ranges.extend(lo_set)
                    continue
                lo = lo_set[0][0]
            else:
                self.pos += 1
                lo = ord(c)
            if self.peek() == "-" and self.peek(1) not in ("]", ""):
                self.pos += 1
                if self.peek() == "\\":
                    if self.peek(1) in "dwsDWS":
                        raise self.error("a range cannot end with a class shorthand", start)
                    hi = self.escape(in_class=True)[0][0]
                else:
                    hi = ord(self.peek())
                    self.pos += 1
                if hi < lo:
                    raise self.error("character range is out of order", start)
                ranges.append((lo, hi))
            else:
                ranges.append((lo, lo))
        if negated:
            # Python's \d, \w, \s are Unicode-wide: their complement is only exact within ASCII.
            return _complement(ranges, _ASCII if unicode_shorthand else None)
        return _norm(ranges)

    def _quantifier_ahead(self) -> bool:
        end = self.src.find("}", self.pos)
        if end < 0:
            return False
        body = self.src[self.pos + 1 : end]
        lo, _, hi = body.partition(",")
        return lo.isdigit() and (hi == "" or hi.isdigit())

    def quantified(self, atom: str, start: int) -> str:
        c = self.peek()
        if c in "*+?":
            self.pos += 1
            op = c
        elif c == "{" and self._quantifier_ahead():
            end = self.src.find("}", self.pos)
            body = self.src[self.pos + 1 : end]
            self.pos = end + 1
            lo_s, comma, hi_s = body.partition(",")
            lo = int(lo_s)
            hi = int(hi_s) if hi_s else (None if comma else lo)
            if (hi is not None and hi < lo) or lo > MAX_REPETITION or (hi or 0) > MAX_REPETITION:
                raise self.error(f"repetition bounds must satisfy m <= n <= {MAX_REPETITION}", start)
            op = f"{{{lo}}}" if hi == lo else f"{{{lo},{'' if hi is None else hi}}}"
        else:
            return atom
        if self.peek() == "?":
            self.pos += 1  # lazy: the same set of full matches
        elif self.peek() == "+":
            raise self.error("possessive quantifiers", self.pos, unsupported=True)
        if self.peek() in ("*", "+", "?") or (self.peek() == "{" and self._quantifier_ahead()):
            raise self.error("multiple repeat", self.pos)
        return f"( {atom} ){op}"


def regex_to_gbnf_expr(
    pattern: str, *, field: str = "constraint.value", pointer: str = "", json_string: bool = False
) -> str:
    """One GBNF expression for (a sound subset of) the full matches of ``pattern``."""
    if not isinstance(pattern, str):
        raise InvalidArgumentError("a regular expression must be a string", field=field)
    expr = _Regex(pattern, field, pointer, json_string).parse()
    return expr or '""'


def regex_gbnf(pattern: str, *, field: str = "constraint.value") -> str:
    """A grammar whose ``root`` matches what ``pattern`` matches in full (the sound subset)."""
    return f"root ::= {regex_to_gbnf_expr(pattern, field=field)}\n"
