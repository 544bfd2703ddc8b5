"""The window: a turn's prompt checked against it before anything is computed.

A prompt that does not fit (with the one token the answer needs: llama-server's rule; a turn
that only warms the prompt, ``max_tokens`` 0, may fill it) is refused with
:func:`~modeld.server.http.errors.overflow`, which each API words as its clients recover from it
(Anthropic's ``prompt is too long: N tokens > M maximum``, Claude Code's cue to compact; the
Responses API's in-stream ``context_length_exceeded``, Codex's cue). Where the API truncates
instead (``Turn.truncate``: Ollama), the oldest messages are left out until it fits.

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
from modeld.server.http.turn import Turn, turn_bytes

__all__ = ["MARGIN", "REMEMBERED", "Window"]

log = logging.getLogger("modeld.http")

MARGIN = 1.25
"""How much more than its conversation's last measure a turn's tokens per byte may be before its
prompt is counted against the window (code, prose and JSON differ by about this much)."""
REMEMBERED = 256
"""Conversations whose tokens per byte are kept (least recently measured dropped first)."""

Count = Callable[[Turn], Awaitable[int]]
"""A turn's prompt in tokens (rendered and tokenized on its model; nothing computed)."""


class Window:
    """The window check of every turn, and what it learned of each conversation (thread-safe)."""

    def __init__(self) -> None:
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
