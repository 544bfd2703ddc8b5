"""Reasoning models' thinking, split from the answer as the output streams.

What: a model whose chat template has a reasoning format writes ``<think>...</think>`` before
its answer (Qwen3, DeepSeek-R1 and their kin); some templates open the block themselves in the
generation prompt, so the output starts inside it and only ``</think>`` appears.
:func:`detect_reasoning` reads the template for that; :class:`ReasoningSplitter` is fed the
decoded text deltas and returns, per delta, the reasoning and the answer text, never splitting
a marker across the two. Each HTTP API shows the reasoning its own way (Anthropic ``thinking``
blocks, Responses ``reasoning`` items, chat's ``reasoning_content``, Ollama's ``thinking``).

What not: no tokens and no engine state; a model without a reasoning format is never split
(its text passes through untouched, so nothing is held back).
"""

from __future__ import annotations

import re
from dataclasses import dataclass

__all__ = ["ReasoningFormat", "ReasoningSplitter", "detect_reasoning"]

OPEN = "<think>"
CLOSE = "</think>"

_GENERATION_BLOCK = re.compile(r"if\s+add_generation_prompt\s*%\}(.*?)\{%-?\s*(?:endif|else|elif)", re.S)


@dataclass(frozen=True, slots=True)
class ReasoningFormat:
    """How a template marks thinking: the markers, and whether the generation prompt already
    opened the block (the output starts inside it)."""

    open: str = OPEN
    close: str = CLOSE
    starts_inside: bool = False


def detect_reasoning(chat_template: str) -> ReasoningFormat | None:
    """The template's reasoning format, or None (no ``<think>`` in it)."""
    if OPEN not in chat_template or CLOSE not in chat_template:
        return None
    starts_inside = any(OPEN in block for block in _GENERATION_BLOCK.findall(chat_template))
    return ReasoningFormat(starts_inside=starts_inside)


def _tail(text: str, marker: str) -> int:
    """How many characters at the end of ``text`` could begin ``marker``."""
    for n in range(min(len(marker) - 1, len(text)), 0, -1):
        if marker.startswith(text[-n:]):
            return n
    return 0


class ReasoningSplitter:
    """Per decode: feed text deltas, get ``(reasoning, answer)`` pieces back."""

    def __init__(self, fmt: ReasoningFormat) -> None:
        self._fmt = fmt
        self._state = "thinking" if fmt.starts_inside else "start"
        self._buf = ""

    @property
    def thinking(self) -> bool:
        return self._state in ("thinking", "start")

    def feed(self, text: str) -> tuple[str, str]:
        self._buf += text
        reasoning = answer = ""
        while self._buf:
            if self._state == "start":  # the answer may open with <think> (leading space allowed)
                stripped = self._buf.lstrip()
                if stripped.startswith(self._fmt.open):
                    self._buf = stripped[len(self._fmt.open) :]
                    self._state = "thinking"
                    continue
                if self._fmt.open.startswith(stripped):
                    return reasoning, answer  # could still become <think>: wait
                self._state = "answer"
                continue
            if self._state == "thinking":
                at = self._buf.find(self._fmt.close)
                if at >= 0:
                    reasoning += self._buf[:at]
                    self._buf = self._buf[at + len(self._fmt.close) :].lstrip("\n")
                    self._state = "answer"
                    continue
                keep = _tail(self._buf, self._fmt.close)
                reasoning += self._buf[: len(self._buf) - keep]
                self._buf = self._buf[len(self._buf) - keep :]
                return reasoning, answer
            answer += self._buf
            self._buf = ""
        return reasoning, answer

    def finish(self) -> tuple[str, str]:
        """What is still held back when the output ends."""
        rest, self._buf = self._buf, ""
        if self._state == "thinking":
            return rest, ""
        return "", rest
