"""The window: a turn's prompt checked against it before anything is computed.

A prompt that does not fit (with the one token the answer needs: llama-server's rule; a turn
that only warms the prompt, ``max_tokens`` 0, may fill it) is refused with
:func:`~modeld.server.http.errors.overflow`, which each API words as its clients recover from it
(Anthropic's ``prompt is too long: N tokens > M maximum``, Claude Code's cue to compact; the
Responses API's in-stream ``context_length_exceeded``, Codex's cue). Where the API truncates
instead (``Turn.truncate``: Ollama), the oldest messages are left out until it fits. With
``--fit-tool-results`` (on by default; Anthropic Messages: Claude Code's compaction request carries its tools
and every tool result, so a tool result near the window makes the session unrecoverable), the
tool results are cut instead, oldest first, until it fits (:func:`cut_tool_results`).

Counting renders and tokenizes the whole prompt, about as long as a warm turn's own preparation
(measured: 64-198 ms against 144-193 ms for a whole warm turn of Claude Code's 20.8k-token
prompt, ``blueprints/0019-agent-apis.md``), so a turn far from the window is not counted: its
size is estimated from its bytes and the tokens per byte its conversation's last turn measured
(:meth:`Window.measured`; 1 per byte for a conversation not seen yet, above what byte-level
vocabularies give), with a margin. A turn the estimate lets through that does not fit is still
refused before its suffix is computed (the engine checks every stage), in the same words.
"""

from __future__ import annotations

import logging
import threading
from collections import OrderedDict
from collections.abc import Awaitable, Callable
from dataclasses import replace

from modeld.server.http.errors import overflow
from modeld.server.http.turn import Message, Turn, turn_bytes

__all__ = ["CUT_SHARE", "MARGIN", "REMEMBERED", "Window", "cut_tool_results"]

log = logging.getLogger("modeld.http")

MARGIN = 1.25
"""How much more than its conversation's last measure a turn's tokens per byte may be before its
prompt is counted against the window (code, prose and JSON differ by about this much)."""
REMEMBERED = 256
"""Conversations whose tokens per byte are kept (least recently measured dropped first)."""

CUT_SHARE = 4
"""A tool result cut to fit keeps its first ``window // CUT_SHARE`` characters (a W-token window:
W/4 characters, about W/16 to W/8 tokens): a size of its own and the window's only, so the same
result is cut the same way on every later turn and the prompt stays warm through it."""
ANSWER_SHARE = 4
"""A prompt whose tool results are cut leaves the answer ``min(max_tokens, window // ANSWER_SHARE)``
tokens."""
FIT_APIS = frozenset({"anthropic.messages"})
"""The APIs whose tool results ``--fit-tool-results`` cuts (the Responses API's client, Codex,
compacts on its own; Ollama truncates whole messages)."""

Count = Callable[[Turn], Awaitable[int]]
"""A turn's prompt in tokens (rendered and tokenized on its model; nothing computed)."""


class Window:
    """The window check of every turn, and what it learned of each conversation (thread-safe)."""

    def __init__(self, fit_tool_results: bool = False) -> None:
        self.fit_tool_results = fit_tool_results
        self._ratios: OrderedDict[str, float] = OrderedDict()
        self._lock = threading.Lock()

    def may_overflow(self, turn: Turn, window: int) -> bool:
        """Whether the turn's prompt may not fit ``window`` (then it is counted)."""
        with self._lock:
            ratio = self._ratios.get(turn.conversation(), 1.0)
        estimate = turn_bytes(turn) * ratio * MARGIN + 16 * len(turn.messages) + 256
        return estimate >= window

    def measured(self, turn: Turn, prompt_tokens: int) -> None:
        """The turn's prompt took ``prompt_tokens``: remember its conversation's tokens per byte."""
        size = turn_bytes(turn)
        if size <= 0 or prompt_tokens <= 0:
            return
        key = turn.conversation()
        with self._lock:
            self._ratios[key] = prompt_tokens / size
            self._ratios.move_to_end(key)
            while len(self._ratios) > REMEMBERED:
                self._ratios.popitem(last=False)

    async def fitted(self, turn: Turn, window: int, count: Count) -> Turn:
        """The turn, checked against a ``window``-token window before anything is computed: one
        that does not fit is ``context_length_exceeded``, or, where the API truncates, loses its
        oldest messages until it fits (the system messages and the newest message stay)."""
        if not self.may_overflow(turn, window):
            return turn
        need = 0 if turn.max_tokens == 0 else 1
        tokens = await count(turn)
        if tokens + need <= window:
            return turn
        if self.fit_tool_results and turn.api in FIT_APIS and turn.chat:
            return await self._cut(turn, tokens, window, count)
        if not (turn.truncate and turn.chat):
            log.info(
                "%s: the prompt (%d tokens) exceeds the %d-token window: refused before any prefill",
                turn.conversation(),
                tokens,
                window,
            )
            raise overflow(tokens, window)
        droppable = [i for i, m in enumerate(turn.messages[:-1]) if m.role != "system"]
        low, high = 1, len(droppable)  # leaving out the first `mid` droppable messages: does it fit?
        best: Turn | None = None
        while low <= high:
            mid = (low + high) // 2
            gone = set(droppable[:mid])
            trial = replace(turn, messages=tuple(m for i, m in enumerate(turn.messages) if i not in gone))
            if await count(trial) + need <= window:
                best, high = trial, mid - 1
            else:
                low = mid + 1
        if best is None:
            raise overflow(tokens, window)
        log.warning(
            "%s: the prompt (%d tokens) exceeds the %d-token window: its %d oldest messages were left out",
            turn.conversation(),
            tokens,
            window,
            len(turn.messages) - len(best.messages),
        )
        return best

    async def _cut(self, turn: Turn, tokens: int, window: int, count: Count) -> Turn:
        """The turn with its tool results cut until it fits with room for the answer: the cuts
        of :func:`cut_tool_results` in order, as few as fit (a binary search, each probe a
        count); none fits: refused as any prompt beyond the window."""
        room = min(turn.max_tokens if turn.max_tokens is not None else window, window // ANSWER_SHARE)
        cuts = cut_steps(turn.messages, window)
        low, high = 1, len(cuts)
        best: Turn | None = None
        while low <= high:
            mid = (low + high) // 2
            trial = cut_tool_results(turn, cuts[:mid], window)
            if await count(trial) + room <= window:
                best, high = trial, mid - 1
            else:
                low = mid + 1
        if best is None:
            log.info(
                "%s: the prompt (%d tokens) exceeds the %d-token window even with every tool result "
                "left out: refused before any prefill",
                turn.conversation(),
                tokens,
                window,
            )
            raise overflow(tokens, window)
        log.warning(
            "%s: the prompt (%d tokens) exceeds the %d-token window: tool results cut (%s)",
            turn.conversation(),
            tokens,
            window,
            "; ".join(best.omitted_content[len(turn.omitted_content) :]),
        )
        return best


Cut = tuple[int, bool]
"""One step of fitting tool results: the message's index, and whether it is left out whole
(else cut to its first ``window // CUT_SHARE`` characters)."""


def cut_steps(messages: tuple[Message, ...], window: int) -> list[Cut]:
    """The cuts that fit a prompt, in the order they are made: every tool result longer than
    twice the cut size (shorter ones gain little once the mark is added) is cut to it, oldest
    first; then every tool result is left out, oldest first (the newest last of all: what the
    model is asked to answer now)."""
    keep = window // CUT_SHARE
    tools = [i for i, m in enumerate(messages) if m.role == "tool"]
    return [(i, False) for i in tools if len(messages[i].content) > 2 * keep] + [(i, True) for i in tools]


def cut_tool_results(turn: Turn, cuts: list[Cut], window: int) -> Turn:
    """The turn with ``cuts`` made (a later cut of a message supersedes an earlier one), each
    marked in the text the model reads and listed in ``omitted_content``
    (``tool_result CALL_ID: cut to N of M characters`` or ``... left out (M characters)``)."""
    keep = window // CUT_SHARE
    whole = {i for i, out in cuts if out}
    touched = sorted({i for i, _ in cuts})
    messages = list(turn.messages)
    listed: list[str] = []
    for i in touched:
        m = messages[i]
        size = len(m.content)
        name = f"tool_result {m.tool_call_id or i}"
        if i in whole:
            text = f"[tool result left out by modeld: {size} characters, beyond the {window}-token context window]"
            listed.append(f"{name}: left out ({size} characters)")
        else:
            text = (
                f"{m.content[:keep]}\n[modeld cut this tool result here: {size - keep} of its {size} "
                f"characters are left out, beyond the {window}-token context window]"
            )
            listed.append(f"{name}: cut to {keep} of {size} characters")
        messages[i] = replace(m, content=text, parts=())
    return replace(turn, messages=tuple(messages), omitted_content=(*turn.omitted_content, *listed))
