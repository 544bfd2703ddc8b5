"""gpt-oss's harmony format: messages on channels, calls addressed to ``functions.NAME``.

What: the model's output (after the generation prompt ``<|start|>assistant``) is a sequence of
messages, each ``HEADER<|message|>BODY`` ended by ``<|end|>`` (the next one opens with
``<|start|>assistant``) or by ``<|call|>`` / ``<|return|>`` (both end generation, so they are
rarely in the text). The header names a channel (``<|channel|>analysis``, ``final``,
``commentary``) and, for a call, a recipient (`` to=functions.NAME``, in the channel header
or after the role) with an optional ``<|constrain|>json``::

    <|channel|>analysis<|message|>thinking<|end|><|start|>assistant<|channel|>final<|message|>answer
    <|channel|>commentary to=functions.read_file <|constrain|>json<|message|>{"path": "a.py"}

:class:`HarmonyParser` (the decode's tool-call parser) takes the messages addressed to
``functions.NAME`` out of the text as calls and passes every other message through unchanged;
:class:`HarmonySplitter` (where an API shows reasoning) turns what passes through into
reasoning (the analysis channel) and the answer (final, and commentary without a recipient:
preambles), dropping the markup and messages to other recipients (built-in tools).

What not: no rendering (the template renders history); no ``<|constrain|>`` types but JSON.
"""

from __future__ import annotations

import re

from modeld.contract import ToolCall
from modeld.decoding.toolcalls import ParseStep, ToolCallParser, checked_call

__all__ = ["HarmonyParser", "HarmonySplitter", "harmony_calls"]

MESSAGE = "<|message|>"
START = "<|start|>"
ENDS = ("<|end|>", "<|call|>", "<|return|>")
MAX_HEADER = 512
MAX_MARKER = max(len(m) for m in (*ENDS, START))
_RECIPIENT = re.compile(r"to=functions\.([^\s<]+)")
_CHANNEL = re.compile(r"<\|channel\|>(\w+)")


def _tail(text: str, markers: tuple[str, ...]) -> int:
    best = 0
    for marker in markers:
        for n in range(min(len(marker) - 1, len(text)), best, -1):
            if marker.startswith(text[-n:]):
                best = n
                break
    return best


class HarmonyParser(ToolCallParser):
    """Calls out of harmony messages; every other message passes through as it was written."""

    def __init__(self) -> None:
        super().__init__()
        self._state = "header"  # header | body (passing through) | args (a call's JSON)
        self._name = ""
        self._seen = 0  # how far a call's end was searched for

    def _name_of(self, body: str) -> str | None:
        return self._name or None

    def _partial_arguments(self, body: str) -> str:
        return body.strip()

    def open_call(self) -> str:
        return self._buf if self._state == "args" else ""

    def _held(self) -> int:
        return 0

    def finish(self, *, cut: bool = False) -> ParseStep:
        step = ParseStep()
        if cut and self._state == "header" and MESSAGE not in self._buf:
            self.raw += self._buf  # a header cut short is markup
            self._buf = ""
        elif cut and self._state == "body" and (held := _tail(self._buf, (START,))):
            self.raw += self._buf[len(self._buf) - held :]
            self._buf = self._buf[: len(self._buf) - held]
        self._run(step, final=True)
        if not step.malformed and self._buf:
            step.text += self._buf
            self._buf = ""
        return step

    def _run(self, step: ParseStep, *, final: bool) -> None:
        while not step.malformed:
            if self._state == "header":
                at = self._buf.find(MESSAGE)
                if at < 0:
                    if final or len(self._buf) > MAX_HEADER:  # not a header: plain text
                        step.text += self._buf
                        self._buf = ""
                        self._state = "body"
                    return
                header = self._buf[: at + len(MESSAGE)]
                self._buf = self._buf[at + len(MESSAGE) :]
                m = _RECIPIENT.search(header)
                if m is None:
                    step.text += header
                    self._state = "body"
                    continue
                self.raw += header
                self._state, self._name, self._in_call, self._named = "args", m.group(1), True, False
                self._seen = 0
                self._announce(step, "")
                continue
            if self._state == "body":
                at = self._buf.find(START)
                if at < 0:
                    keep = 0 if final else _tail(self._buf, (START,))
                    step.text += self._buf[: len(self._buf) - keep]
                    self._buf = self._buf[len(self._buf) - keep :]
                    return
                step.text += self._buf[:at]
                self._buf = self._buf[at:]
                self._state = "header"
                continue
            since = max(0, self._seen - MAX_MARKER)  # searched already up to there
            ends = [(at, e) for e in (*ENDS, START) if (at := self._buf.find(e, since)) >= 0]
            self._seen = len(self._buf)
            if not ends and not final:
                return
            at, end = min(ends) if ends else (len(self._buf), "")
            body = self._buf[:at]
            used = at + (len(end) if end in ENDS else 0)
            self.raw += self._buf[:used]
            self._buf = self._buf[used:]
            self._in_call, self._state = False, "header" if end == START else "body"
            parsed = checked_call(self._name, body.strip())
            if isinstance(parsed, str):
                step.malformed = parsed
                return
            self._emit(step, parsed)
            self._name = ""


def harmony_calls(calls: list[ToolCall]) -> str:
    """Calls as gpt-oss writes them (the text :class:`HarmonyParser` reads back)."""
    return "<|end|><|start|>assistant".join(
        f"<|channel|>commentary to=functions.{c.name} <|constrain|>json{MESSAGE}{c.arguments}" for c in calls
    )


class HarmonySplitter:
    """Per decode: harmony text (calls already taken out) -> ``(reasoning, answer)`` pieces."""

    def __init__(self) -> None:
        self._buf = ""
        self._state = "header"
        self._channel = ""

    @property
    def thinking(self) -> bool:
        return self._state != "body" or self._channel == "analysis"

    def feed(self, text: str) -> tuple[str, str]:
        return self._run(text, final=False)

    def finish(self) -> tuple[str, str]:
        return self._run("", final=True)

    def _run(self, text: str, *, final: bool) -> tuple[str, str]:
        self._buf += text
        reasoning = answer = ""
        while self._buf:
            if self._state == "header":
                at = self._buf.find(MESSAGE)
                if at < 0:
                    if final or len(self._buf) > MAX_HEADER:
                        answer += self._buf  # not harmony at all: show it
                        self._buf = ""
                    break
                header = self._buf[:at]
                self._buf = self._buf[at + len(MESSAGE) :]
                channels = _CHANNEL.findall(
                    header
                )  # the last one (a stray "commentary to=assistant" may precede)
                channel = channels[-1] if channels else "final"
                self._channel = "drop" if "to=" in header.replace("to=assistant", "") else channel
                self._state = "body"
                continue
            found = [(at, e) for e in (*ENDS, START) if (at := self._buf.find(e)) >= 0]
            if found:
                at, end = min(found)
                piece, self._buf = self._buf[:at], self._buf[at + len(end) :]
                self._state = "header"  # after <|start|>, the role ("assistant") is part of the header
            else:
                keep = 0 if final else _tail(self._buf, (*ENDS, START))
                piece, self._buf = self._buf[: len(self._buf) - keep], self._buf[len(self._buf) - keep :]
            if self._channel == "analysis":
                reasoning += piece
            elif self._channel != "drop":
                answer += piece
            if not found:
                break
        return reasoning, answer
