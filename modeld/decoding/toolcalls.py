"""Parsing tool calls out of a model's output as it streams: the machinery every format shares.

What: a :class:`ToolCallParser` is fed the decoded text in deltas and returns, per delta, the
text that is ordinary content (safe to show) and the tool-call deltas parsed so far; the text
of a call never reaches the content. :meth:`ToolCallParser.finish` ends the output: a call
still open, or one that does not parse, is *malformed* and keeps its raw text (finish reason
``malformed_tool_call``); ``finish(cut=True)`` (the output hit ``max_tokens``) drops a
half-written start marker instead of showing it.

Streaming granularity: a call's first delta (``id`` and ``name``) is emitted as soon as its
name is known; its arguments arrive in one delta when the call is complete (so a delta is
never taken back).

The families (which markers, which body) are in :mod:`modeld.decoding.formats`; this module
has the base (content until a start marker, then a call body) and :class:`DelimitedParser`
(calls between markers, optionally grouped in a section: most families); the formats whose
calls have no close marker are in :mod:`modeld.decoding.jsoncalls`.

What not: no knowledge of which tools exist (the caller checks names against its tools and
tells exit tools apart); arguments are converted by the tools' schemas where a format writes
untyped values (XML parameters), never validated.
"""

from __future__ import annotations

import json
import re
import uuid
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

from modeld.contract import ToolCall, ToolCallDelta

__all__ = [
    "Body",
    "DelimitedParser",
    "Markup",
    "ParseStep",
    "RawCall",
    "Schemas",
    "ToolCallParser",
    "new_call_id",
]

MAX_CALL_CHARS = 1 << 20
"""A call longer than this is malformed (a model stuck inside a call)."""

Schemas = Mapping[str, Any]
"""Tool name -> its parameters' JSON schema (parsed), for formats whose values are untyped text."""


def new_call_id() -> str:
    return "call_" + uuid.uuid4().hex[:24]


@dataclass
class ParseStep:
    """What one feed (or finish) produced."""

    text: str = ""
    deltas: list[ToolCallDelta] = field(default_factory=list)
    completed: list[ToolCall] = field(default_factory=list)
    malformed: str = ""  # why a call did not parse (then ``raw`` on the parser has its text)


@dataclass(frozen=True, slots=True)
class RawCall:
    """One call as a body parser read it: arguments already a JSON object's value."""

    name: str
    arguments: dict[str, Any]
    id: str = ""


Body = Callable[[str, Schemas], "list[RawCall] | str"]
"""A family's body parser: the text between a call's markers -> its calls, or why it is malformed."""


_NAME_RE = re.compile(r'"(?:name|tool_name)"\s*:\s*"((?:[^"\\]|\\.)*)"')


def json_name(body: str) -> str | None:
    """The first ``"name"`` (or Command R's ``"tool_name"``) a partial JSON call names."""
    m = _NAME_RE.search(body)
    if m is None:
        return None
    try:
        name: str = json.loads(f'"{m.group(1)}"')
    except ValueError:
        return None
    return name


def call_from(obj: Any, args_keys: tuple[str, ...] = ("arguments", "parameters")) -> RawCall | str:
    """A call from a parsed JSON call object (``name`` + arguments under one of ``args_keys``;
    arguments may be a JSON string), or the reason it is malformed."""
    if not isinstance(obj, dict):
        return "a tool call must be a JSON object"
    name = obj.get("name", obj.get("tool_name"))
    if not isinstance(name, str) or not name:
        return "a tool call needs a string name"
    args: Any = None
    for key in args_keys:
        if key in obj:
            args = obj[key]
            break
    else:
        args = {}
    return checked_call(name, args, obj.get("id", obj.get("tool_call_id")))


def checked_call(name: str, args: Any, call_id: Any = None) -> RawCall | str:
    """A call of ``name`` with ``args`` (an object, or JSON text of one), or why not."""
    if isinstance(args, str):
        try:
            args = json.loads(args) if args.strip() else {}
        except ValueError:
            return f"the arguments of {name!r} are not JSON"
    if not isinstance(args, dict):
        return f"the arguments of {name!r} must be a JSON object"
    return RawCall(name, args, call_id if isinstance(call_id, str) else "")


class ToolCallParser:
    """Base: content until a start marker, then calls. Subclasses parse call bodies."""

    start_markers: tuple[str, ...] = ()
    args_keys: tuple[str, ...] = ("arguments", "parameters")

    def __init__(self) -> None:
        self._buf = ""  # text not yet decided (a possible marker, or an open call)
        self._in_call = False
        self._opener = ""  # the start marker of the open call
        self.raw = ""  # the raw text of all calls (kept for malformed_tool_call)
        self.calls: list[ToolCall] = []
        self._named = False  # the current call's name delta went out
        self._pending_id = ""
        self._after_call = False  # a call just ended: whitespace that follows may be markup

    # --- public -----------------------------------------------------------------------------

    def feed(self, text: str) -> ParseStep:
        step = ParseStep()
        self._buf += text
        self._run(step, final=False)
        return step

    def open_call(self) -> str:
        """The text of a call still open (the output may be cut off inside it), else ""."""
        return self._buf if self._in_call else ""

    def cut_off(self, body: str) -> tuple[ToolCall, list[ToolCallDelta]] | None:
        """The call that ``body`` (an open call's text, :meth:`open_call`) began, as far as it
        got: its name and the arguments text written so far (not always whole JSON), with the
        deltas that complete what the stream already sent. None when its name was not written."""
        name = self._name_of(body)
        if name is None:
            return None
        arguments = self._partial_arguments(body)
        index = len(self.calls)
        if self._named:
            call_id = self._pending_id
            deltas = [ToolCallDelta(index=index, arguments=arguments)]
        else:
            call_id = new_call_id()
            deltas = [ToolCallDelta(index=index, id=call_id, name=name, arguments=arguments)]
        return ToolCall(call_id, name, arguments), deltas

    def finish(self, *, cut: bool = False) -> ParseStep:
        """The end of the output. ``cut``: it hit ``max_tokens``, so text held back because it
        could begin a start marker is markup cut short, never content (it goes to ``raw``)."""
        step = ParseStep()
        if cut and not self._in_call:
            held = self._held()
            if held:
                self.raw += self._buf[len(self._buf) - held :]
                self._buf = self._buf[: len(self._buf) - held]
        self._run(step, final=True)
        if step.malformed:
            return step
        if self._in_call:
            step.malformed = "the output ended inside a tool call"
            self.raw += self._buf
            self._buf = ""
        elif self._buf:
            step.text += self._buf
            self._buf = ""
        return step

    # --- machinery --------------------------------------------------------------------------

    def _held(self) -> int:
        return max((_marker_tail(self._buf, m) for m in self.start_markers), default=0)

    def _between(self, *, final: bool) -> bool:
        """After a call: whitespace up to the next call (or the end) is markup, not content.
        False while it cannot be told yet."""
        rest = self._buf.lstrip()
        if not rest and not final:
            return False
        if not rest or any(rest.startswith(m) for m in self.start_markers):
            self.raw += self._buf[: len(self._buf) - len(rest)]
            self._buf = rest
        elif not final and any(m.startswith(rest) for m in self.start_markers):
            return False  # a marker may be beginning
        self._after_call = False
        return True

    def _run(self, step: ParseStep, *, final: bool) -> None:
        while not step.malformed:
            if not self._in_call:
                if self._after_call and not self._between(final=final):
                    return
                found = [(at, m) for m in self.start_markers if (at := self._buf.find(m)) >= 0]
                if not found:
                    keep = 0 if final else self._held()
                    cut = len(self._buf) - keep
                    step.text += self._buf[:cut]
                    self._buf = self._buf[cut:]
                    return
                at, marker = min(found, key=lambda f: (f[0], -len(f[1])))
                step.text += self._buf[:at]
                self.raw += marker
                self._buf = self._buf[at + len(marker) :]
                self._in_call, self._named, self._opener = True, False, marker
                self._opened()
            if len(self._buf) > MAX_CALL_CHARS:
                step.malformed = "a tool call is longer than the limit"
                return
            if not self._body(step, final=final):
                return

    def _opened(self) -> None:
        """A start marker was just consumed (``self._opener``)."""

    def _name_of(self, body: str) -> str | None:
        return json_name(body)

    def _id_of(self, body: str) -> str:
        """The model's own id for the call ``body`` begins, when the name is readable ("": none)."""
        return ""

    def _partial_arguments(self, body: str) -> str:
        keys = re.search(r'"(?:' + "|".join(self.args_keys) + r')"\s*:\s*', body)
        return body[keys.end() :].rstrip() if keys is not None else ""

    def _announce(self, step: ParseStep, body: str) -> None:
        """Emit the call's id/name delta as soon as the name is readable."""
        if self._named:
            return
        name = self._name_of(body)
        if name is not None:
            self._named = True
            self._pending_id = self._id_of(body) or new_call_id()
            step.deltas.append(ToolCallDelta(index=len(self.calls), id=self._pending_id, name=name))

    def _complete(self, step: ParseStep, obj: Any, raw: str) -> bool:
        parsed = call_from(obj, self.args_keys)
        self.raw += raw
        if isinstance(parsed, str):
            step.malformed = parsed
            return False
        self._emit(step, parsed)
        return True

    def _emit(self, step: ParseStep, call: RawCall) -> None:
        """A parsed call: its deltas (completing the announced one) and the call."""
        index = len(self.calls)
        arguments = json.dumps(call.arguments, ensure_ascii=False)
        # An announced call keeps the id its first delta carried (the model's own when it was
        # readable then, as Kimi's ``functions.NAME:0``).
        call_id = self._pending_id if self._named else (call.id or new_call_id())
        if self._named:
            step.deltas.append(ToolCallDelta(index=index, arguments=arguments))
        else:
            step.deltas.append(ToolCallDelta(index=index, id=call_id, name=call.name, arguments=arguments))
        done = ToolCall(id=call_id, name=call.name, arguments=arguments)
        self.calls.append(done)
        step.completed.append(done)
        self._named = False
        self._after_call = True

    def _body(self, step: ParseStep, *, final: bool) -> bool:
        """Consume what can be consumed of an open call; True to go on scanning."""
        raise NotImplementedError


def _marker_tail(text: str, marker: str) -> int:
    """Length of the longest suffix of ``text`` that is a proper prefix of ``marker``."""
    for n in range(min(len(marker) - 1, len(text)), 0, -1):
        if marker.startswith(text[-n:]):
            return n
    return 0


@dataclass(frozen=True)
class Markup:
    """A family whose calls sit between markers: ``call_open`` BODY ``call_close``, optionally
    grouped in a ``section`` (open, close) that holds one or more calls. ``aliases``: other
    text that opens a call and is part of its body (Qwen3-Coder models sometimes skip
    ``<tool_call>`` and start at ``<function=``). ``close_optional``: the output may end where
    ``call_close`` (or the section's close) would be, once a whole body is there."""

    call_open: str
    call_close: str
    body: Body
    name: Callable[[str], str | None] = json_name
    section: tuple[str, str] | None = None
    aliases: tuple[str, ...] = ()
    close_optional: bool = False
    ident: Callable[[str], str] | None = None  # the model's own call id, read with the name


class DelimitedParser(ToolCallParser):
    """The parser of a :class:`Markup` family; the tools' schemas convert untyped values."""

    def __init__(self, markup: Markup, schemas: Schemas) -> None:
        super().__init__()
        self._m = markup
        self._schemas = schemas
        self.start_markers = (markup.section[0],) if markup.section else (markup.call_open, *markup.aliases)
        self._inside = False  # inside a call (a section may be between calls)
        self._in_section = 0  # calls completed in the open section
        self._seen = 0  # how far the close marker was searched for
        self._skip = 0  # close markers before this index were inside a value

    def _opened(self) -> None:
        self._seen = self._skip = 0
        if self._m.section is None:
            self._inside = True
            if self._opener in self._m.aliases:  # part of the body: raw gets it with the body
                self.raw = self.raw[: len(self.raw) - len(self._opener)]
                self._buf = self._opener + self._buf
        else:
            self._inside, self._in_section = False, 0

    def _name_of(self, body: str) -> str | None:
        return self._m.name(body)

    def _id_of(self, body: str) -> str:
        return self._m.ident(body) if self._m.ident is not None else ""

    def _partial_arguments(self, body: str) -> str:
        return super()._partial_arguments(body) if self._m.name is json_name else ""

    def _body(self, step: ParseStep, *, final: bool) -> bool:
        m = self._m
        if not self._inside:  # in a section, between calls
            assert m.section is not None
            rest = self._buf.lstrip()
            space = len(self._buf) - len(rest)
            for marker, inside in ((m.call_open, True), (m.section[1], False)):
                if rest.startswith(marker):
                    self.raw += self._buf[: space + len(marker)]
                    self._buf = rest[len(marker) :]
                    if inside:
                        self._inside, self._named, self._seen, self._skip = True, False, 0, 0
                    else:
                        self._in_call = False
                    return True
            if final and not rest and self._in_section:
                self.raw += self._buf
                self._buf = ""
                self._in_call = False
                return False
            if not final and (m.call_open.startswith(rest) or m.section[1].startswith(rest)):
                return False
            self.raw += self._buf
            self._buf = ""
            step.malformed = "unexpected text inside the tool-call section"
            return False
        # The close marker may also occur inside a value (a JSON string, a parameter's text):
        # the call ends at the first one after which the body parses; at the end of the output
        # the first one decides (then the call is malformed).
        parsed: list[RawCall] | str = ""
        used = -1
        end = self._buf.find(m.call_close, max(self._skip, self._seen - len(m.call_close)))
        self._seen = len(self._buf)
        self._announce(step, self._buf if end < 0 else self._buf[:end])
        while end >= 0:
            parsed = m.body(self._buf[:end], self._schemas)
            if not isinstance(parsed, str):
                used = end + len(m.call_close)
                break
            self._skip = end + 1
            end = self._buf.find(m.call_close, end + 1)
        if used < 0:
            if not final:
                return False
            first = self._buf.find(m.call_close)
            if first >= 0:
                used, parsed = first + len(m.call_close), m.body(self._buf[:first], self._schemas)
            elif m.close_optional and self._buf.strip():
                used, parsed = len(self._buf), m.body(self._buf, self._schemas)
            else:
                return False
        self.raw += self._buf[:used]
        self._buf = self._buf[used:]
        self._skip = 0
        if isinstance(parsed, str):
            step.malformed = parsed
            return False
        if not parsed:
            step.malformed = "the tool call names no function"
            return False
        for call in parsed:
            self._emit(step, call)
        if m.section is None:
            self._in_call = False
        else:
            self._inside = False
            self._in_section += len(parsed)
        return True
