"""Parsing tool calls out of a model's output as it streams (Hermes/Qwen, Llama 3, Mistral).

What: a :class:`ToolCallParser` is fed the decoded text in deltas and returns, per delta, the
text that is ordinary content (safe to show) and the tool-call deltas parsed so far; the text
of a call never reaches the content. :meth:`ToolCallParser.finish` ends the output: a call
still open, or one that does not parse (not JSON, no name, arguments not an object), is
*malformed* and keeps its raw text (finish reason ``malformed_tool_call``).

Streaming granularity: a call's first delta (``id`` and ``name``) is emitted as soon as its
name is known; its arguments arrive in one delta when the call is complete (so a delta is
never taken back).

The formats and their markers are in :mod:`modeld.decoding.tools`. Content before a call is
kept; content after calls (Hermes) is kept too. Llama 3 calls count only at the start of the
answer (the model's convention): an answer that starts with other text is plain content.

What not: no knowledge of which tools exist (the caller checks names against its tools and
tells exit tools apart), no schema validation.
"""

from __future__ import annotations

import json
import re
import uuid
from dataclasses import dataclass, field
from typing import Any

from modeld.contract import ToolCall, ToolCallDelta

__all__ = ["ParseStep", "ToolCallParser", "make_parser", "new_call_id"]

MAX_CALL_CHARS = 1 << 20
"""A call longer than this is malformed (a model stuck inside a call)."""


def new_call_id() -> str:
    return "call_" + uuid.uuid4().hex[:24]


@dataclass
class ParseStep:
    """What one feed (or finish) produced."""

    text: str = ""
    deltas: list[ToolCallDelta] = field(default_factory=list)
    completed: list[ToolCall] = field(default_factory=list)
    malformed: str = ""  # why a call did not parse (then ``raw`` on the parser has its text)


def _json_end(text: str, start: int) -> int | None:
    """Index just past the JSON object/array starting at ``start`` (None while incomplete)."""
    depth = 0
    in_string = escape = False
    for i in range(start, len(text)):
        c = text[i]
        if in_string:
            if escape:
                escape = False
            elif c == "\\":
                escape = True
            elif c == '"':
                in_string = False
        elif c == '"':
            in_string = True
        elif c in "{[":
            depth += 1
        elif c in "}]":
            depth -= 1
            if depth == 0:
                return i + 1
    return None


_NAME_RE = re.compile(r'"name"\s*:\s*"((?:[^"\\]|\\.)*)"')


def _call_from(obj: Any, args_keys: tuple[str, ...]) -> tuple[str, str, str] | str:
    """(id, name, arguments JSON) from a parsed call object, or the reason it is malformed."""
    if not isinstance(obj, dict):
        return "a tool call must be a JSON object"
    name = obj.get("name")
    if not isinstance(name, str) or not name:
        return "a tool call needs a string name"
    args: Any = None
    for key in args_keys:
        if key in obj:
            args = obj[key]
            break
    else:
        args = {}
    if isinstance(args, str):
        try:
            args = json.loads(args)
        except ValueError:
            return f"the arguments of {name!r} are not JSON"
    if not isinstance(args, dict):
        return f"the arguments of {name!r} must be a JSON object"
    given = obj.get("id")
    call_id = given if isinstance(given, str) and given else new_call_id()
    return call_id, name, json.dumps(args, ensure_ascii=False)


class ToolCallParser:
    """Base: content until a start marker, then calls. Subclasses parse call bodies."""

    start_marker = ""
    args_keys: tuple[str, ...] = ("arguments", "parameters")

    def __init__(self) -> None:
        self._buf = ""  # text not yet decided (a possible marker, or an open call)
        self._in_call = False
        self.raw = ""  # the raw text of all calls (kept for malformed_tool_call)
        self.calls: list[ToolCall] = []
        self._named = False  # the current call's name delta went out

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
        m = _NAME_RE.search(body)
        if m is None:
            return None
        try:
            name = json.loads(f'"{m.group(1)}"')
        except ValueError:
            return None
        arguments = ""
        keys = re.search(r'"(?:' + "|".join(self.args_keys) + r')"\s*:\s*', body)
        if keys is not None:
            arguments = body[keys.end() :].rstrip()
        index = len(self.calls)
        if self._named:
            call_id = self._pending_id
            deltas = [ToolCallDelta(index=index, arguments=arguments)]
        else:
            call_id = new_call_id()
            deltas = [ToolCallDelta(index=index, id=call_id, name=name, arguments=arguments)]
        return ToolCall(call_id, name, arguments), deltas

    def finish(self) -> ParseStep:
        step = ParseStep()
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

    def _run(self, step: ParseStep, *, final: bool) -> None:
        while not step.malformed:
            if not self._in_call:
                at = self._buf.find(self.start_marker)
                if at < 0:
                    keep = 0 if final else _marker_tail(self._buf, self.start_marker)
                    cut = len(self._buf) - keep
                    step.text += self._buf[:cut]
                    self._buf = self._buf[cut:]
                    return
                step.text += self._buf[:at]
                self.raw += self.start_marker
                self._buf = self._buf[at + len(self.start_marker) :]
                self._in_call, self._named = True, False
            if len(self._buf) > MAX_CALL_CHARS:
                step.malformed = "a tool call is longer than the limit"
                return
            if not self._body(step, final=final):
                return

    def _announce(self, step: ParseStep, body: str) -> None:
        """Emit the call's id/name delta as soon as the name is readable."""
        if self._named:
            return
        m = _NAME_RE.search(body)
        if m:
            try:
                name = json.loads(f'"{m.group(1)}"')
            except ValueError:
                return
            self._named = True
            self._pending_id = new_call_id()
            step.deltas.append(ToolCallDelta(index=len(self.calls), id=self._pending_id, name=name))

    def _complete(self, step: ParseStep, obj: Any, raw: str) -> bool:
        parsed = _call_from(obj, self.args_keys)
        self.raw += raw
        if isinstance(parsed, str):
            step.malformed = parsed
            return False
        call_id, name, arguments = parsed
        index = len(self.calls)
        if self._named:
            call_id = self._pending_id if "id" not in (obj or {}) else call_id
            step.deltas.append(ToolCallDelta(index=index, arguments=arguments))
        else:
            step.deltas.append(ToolCallDelta(index=index, id=call_id, name=name, arguments=arguments))
        call = ToolCall(id=call_id, name=name, arguments=arguments)
        self.calls.append(call)
        step.completed.append(call)
        self._named = False
        return True

    def _body(self, step: ParseStep, *, final: bool) -> bool:
        """Consume what can be consumed of an open call; True to go on scanning."""
        raise NotImplementedError


def _marker_tail(text: str, marker: str) -> int:
    """Length of the longest suffix of ``text`` that is a proper prefix of ``marker``."""
    for n in range(min(len(marker) - 1, len(text)), 0, -1):
        if marker.startswith(text[-n:]):
            return n
    return 0


class HermesParser(ToolCallParser):
    """``<tool_call>{json}</tool_call>``, any number, content around them kept."""

    start_marker = "<tool_call>"
    end_marker = "</tool_call>"

    def _body(self, step: ParseStep, *, final: bool) -> bool:
        end = self._buf.find(self.end_marker)
        self._announce(step, self._buf if end < 0 else self._buf[:end])
        if end < 0:
            return False
        body = self._buf[:end]
        self._buf = self._buf[end + len(self.end_marker) :]
        self._in_call = False
        try:
            obj = json.loads(body)
        except ValueError:
            self.raw += body + self.end_marker
            step.malformed = "the tool call is not valid JSON"
            return False
        return self._complete(step, obj, body + self.end_marker)


class Llama3Parser(ToolCallParser):
    """A JSON call (or several, ``;``-separated) at the very start, optionally after
    ``<|python_tag|>``."""

    start_marker = "<|python_tag|>"
    args_keys = ("parameters", "arguments")

    def __init__(self) -> None:
        super().__init__()
        self._decided = False

    def _run(self, step: ParseStep, *, final: bool) -> None:
        if not self._decided:
            head = self._buf.lstrip()
            if not head:
                if final:
                    step.text += self._buf
                    self._buf = ""
                return
            if head.startswith("{") or head.startswith(self.start_marker):
                self._decided, self._in_call = True, True
                lead = len(self._buf) - len(head)
                self.raw += self._buf[:lead]
                self._buf = head
                if head.startswith(self.start_marker):
                    self.raw += self.start_marker
                    self._buf = head[len(self.start_marker) :]
            elif self.start_marker.startswith(head) and not final:
                return
            else:
                self._decided = True
                step.text += self._buf
                self._buf = ""
                return
        if not self._in_call:
            step.text += self._buf
            self._buf = ""
            return
        while not step.malformed and self._body(step, final=final):
            pass

    def _body(self, step: ParseStep, *, final: bool) -> bool:
        buf = self._buf.lstrip()
        skipped = len(self._buf) - len(buf)
        if not buf:
            return False
        if buf[0] == ";":
            self.raw += self._buf[: skipped + 1]
            self._buf = buf[1:]
            return True
        if buf[0] != "{":
            if self.calls:  # text after the calls: not a call
                self.raw += self._buf
                self._buf = ""
                step.malformed = "text follows the tool calls"
                return False
            step.malformed = "the tool call is not a JSON object"
            self.raw += self._buf
            self._buf = ""
            return False
        end = _json_end(buf, 0)
        self._announce(step, buf if end is None else buf[:end])
        if end is None:
            return False
        body = buf[:end]
        self.raw += self._buf[:skipped]
        self._buf = buf[end:]
        try:
            obj = json.loads(body)
        except ValueError:
            self.raw += body
            step.malformed = "the tool call is not valid JSON"
            return False
        return self._complete(step, obj, body)

    def finish(self) -> ParseStep:
        step = ParseStep()
        self._run(step, final=True)
        rest = self._buf
        if not step.malformed and self._in_call and rest.strip():
            step.malformed = "the output ended inside a tool call"
            self.raw += rest
            self._buf = ""
        elif not step.malformed and self._in_call and not self.calls:
            step.malformed = "the output ended inside a tool call"
        return step


class MistralParser(ToolCallParser):
    """``[TOOL_CALLS][{...}, ...]`` (v3) or ``[TOOL_CALLS]name[ARGS]{...}`` (v11+, repeated)."""

    start_marker = "[TOOL_CALLS]"

    def _body(self, step: ParseStep, *, final: bool) -> bool:
        buf = self._buf.lstrip()
        if not buf:
            return False
        if buf[0] == "[":
            end = _json_end(buf, 0)
            self._announce(step, buf if end is None else buf[:end])
            if end is None:
                return False
            body = buf[:end]
            self._buf = buf[end:]
            self._in_call = False
            try:
                items = json.loads(body)
            except ValueError:
                self.raw += body
                step.malformed = "the tool calls are not valid JSON"
                return False
            if not isinstance(items, list) or not items:
                self.raw += body
                step.malformed = "[TOOL_CALLS] must be followed by a non-empty JSON array"
                return False
            self.raw += body
            return all(self._complete(step, item, "") for item in items)
        at = buf.find("[ARGS]")
        if at < 0:
            if final or len(buf) > 256:
                self.raw += buf
                self._buf = ""
                step.malformed = "[TOOL_CALLS] is followed by neither a JSON array nor name[ARGS]"
            return False
        head = buf[:at]
        name, _, call_id = head.partition("[CALL_ID]")
        rest = buf[at + len("[ARGS]") :].lstrip()
        if not rest:
            return False
        end = _json_end(rest, 0) if rest[0] in "{[" else None
        if end is None:
            if rest[0] not in "{[":
                self.raw += buf
                self._buf = ""
                step.malformed = "the arguments after [ARGS] are not a JSON object"
            return False
        body = rest[:end]
        self._buf = rest[end:]
        self._in_call = False
        try:
            args = json.loads(body)
        except ValueError:
            self.raw += buf[: at + 6] + body
            step.malformed = "the tool call's arguments are not valid JSON"
            return False
        obj = {"name": name.strip(), "arguments": args}
        if call_id.strip():
            obj["id"] = call_id.strip()
        return self._complete(step, obj, head + "[ARGS]" + body)


_PARSERS: dict[str, type[ToolCallParser]] = {
    "hermes": HermesParser,
    "llama3": Llama3Parser,
    "mistral": MistralParser,
}


def make_parser(fmt: str) -> ToolCallParser | None:
    """A fresh parser for one decode's output, or None for ``none``/unknown formats."""
    cls = _PARSERS.get(fmt)
    return cls() if cls is not None else None
