"""The tool-call formats whose calls have no close marker: the JSON ends the call.

What: :class:`Llama3Parser` (a JSON call, or several ``;``-separated, at the very start of the
answer, optionally after ``<|python_tag|>``), :class:`MistralParser` (``[TOOL_CALLS]`` then a
JSON array, or ``NAME[CALL_ID]ID[ARGS]{...}`` repeated) and :class:`GraniteParser`
(``<|tool_call|>`` then a JSON array). :class:`JsonEnd` finds where the JSON ends
incrementally: a long call (a file's text) streamed in small deltas is scanned once, not again
on every delta (12-16 s for a 24k-character call before, about 10 ms now).

What not: the families' table (:mod:`modeld.decoding.formats`); the shared machinery
(:mod:`modeld.decoding.toolcalls`).
"""

from __future__ import annotations

import json
import re

from modeld.decoding.toolcalls import ParseStep, ToolCallParser

__all__ = ["GraniteParser", "JsonEnd", "Llama3Parser", "MistralParser"]

_IN_STRING = re.compile(r'["\\]')
_OUTSIDE = re.compile(r'["{}\[\]]')


class JsonEnd:
    """Where the JSON object or array at the start of a growing text ends, found incrementally:
    each call scans only what arrived since the last (a long call streamed in small deltas
    would otherwise be scanned again on every delta). :meth:`reset` before another value."""

    def __init__(self) -> None:
        self.reset()

    def reset(self) -> None:
        self._pos = 0
        self._depth = 0
        self._in_string = False
        self._escape = False

    def find(self, text: str) -> int | None:
        """Index just past the value that ``text`` (the same text as before, grown) starts
        with, or None while it is incomplete."""
        i, n = self._pos, len(text)
        while i < n:
            if self._escape:
                self._escape = False
                i += 1
                continue
            if self._in_string:
                m = _IN_STRING.search(text, i)
                if m is None:
                    i = n
                    break
                i = m.start()
                if text[i] == "\\":
                    self._escape = True
                else:
                    self._in_string = False
                i += 1
                continue
            m = _OUTSIDE.search(text, i)
            if m is None:
                i = n
                break
            i = m.start()
            c = text[i]
            i += 1
            if c == '"':
                self._in_string = True
            elif c in "{[":
                self._depth += 1
            else:
                self._depth -= 1
                if self._depth == 0:
                    self.reset()
                    return i
        self._pos = i
        return None


class _JsonCalls(ToolCallParser):
    def __init__(self) -> None:
        super().__init__()
        self._json = JsonEnd()  # the open call's JSON


class Llama3Parser(_JsonCalls):
    """A JSON call (or several, ``;``-separated) at the very start, optionally after
    ``<|python_tag|>``."""

    start_marker = "<|python_tag|>"
    start_markers = (start_marker,)
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
        end = self._json.find(buf)
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

    def finish(self, *, cut: bool = False) -> ParseStep:
        step = ParseStep()
        if cut and not self._decided and self.start_marker.startswith(self._buf.lstrip()):
            self.raw += self._buf  # a cut-off <|python_tag|>
            self._buf = ""
        self._run(step, final=True)
        rest = self._buf
        if not step.malformed and self._in_call and rest.strip():
            step.malformed = "the output ended inside a tool call"
            self.raw += rest
            self._buf = ""
        elif not step.malformed and self._in_call and not self.calls:
            step.malformed = "the output ended inside a tool call"
        elif not step.malformed and self._in_call:
            self.raw += rest  # whitespace after the calls: markup
            self._buf = ""
        return step


class MistralParser(_JsonCalls):
    """``[TOOL_CALLS][{...}, ...]`` (v3) or ``[TOOL_CALLS]name[ARGS]{...}`` (v11+, repeated)."""

    start_markers = ("[TOOL_CALLS]",)

    def _body(self, step: ParseStep, *, final: bool) -> bool:
        buf = self._buf.lstrip()
        if not buf:
            return False
        if buf[0] == "[":
            end = self._json.find(buf)
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
        end = self._json.find(rest) if rest[0] in "{[" else None
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


class GraniteParser(MistralParser):
    """``<|tool_call|>[{...}, ...]`` to the end of the output (Granite 3.x)."""

    start_markers = ("<|tool_call|>",)
