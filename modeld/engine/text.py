"""Turning generated token bytes into text deltas: whole UTF-8 characters, stop strings cut.

Tokens carry bytes, and a character may be split across tokens (byte-level BPE does this for
accents, CJK and emoji). :class:`TextAssembler` decodes incrementally, holds back an incomplete
character, and holds back the longest tail that could still become a stop string, so that a
delta is never taken back. When a stop string appears, the text before it is released and the
rest is dropped (the stop string is not part of the output, as in OpenAI-style APIs). If
generation ends inside a character (max_tokens hit between its bytes), the incomplete
character is dropped rather than shown as U+FFFD; invalid bytes elsewhere become U+FFFD.
"""

from __future__ import annotations

import codecs
from collections.abc import Sequence

__all__ = ["TextAssembler"]


class TextAssembler:
    """Feed token bytes in, get safe text deltas out."""

    def __init__(self, stop: Sequence[str] = ()) -> None:
        self._decoder = codecs.getincrementaldecoder("utf-8")(errors="replace")
        self._stop = tuple(s for s in stop if s)
        self._hold = max((len(s) for s in self._stop), default=1) - 1
        self._pending = ""
        self.stopped = False
        self.matched = ""  # the stop string that ended the text (the earliest; the first complete there)

    def feed(self, data: bytes) -> str:
        """Add a token's bytes; return the text that is now safe to emit."""
        if self.stopped:
            return ""
        self._pending += self._decoder.decode(data)
        if not self._stop:
            out, self._pending = self._pending, ""
            return out
        cut = self._first_stop()
        if cut is not None:
            self.stopped = True
            out, self._pending = self._pending[:cut], ""
            return out
        keep = self._unsafe_tail()
        out = self._pending[: len(self._pending) - keep]
        self._pending = self._pending[len(self._pending) - keep :]
        return out

    def flush(self) -> str:
        """The text still held back, at the end of generation (never contains a stop string)."""
        if self.stopped:
            return ""
        self._decoder.reset()  # an incomplete last character (generation stopped inside it) is dropped
        out, self._pending = self._pending, ""
        if self._stop:
            cut = self._find_stop(out)
            if cut is not None:
                self.stopped = True
                return out[:cut]
        return out

    def _find_stop(self, text: str) -> int | None:
        hits = [(i, len(s), s) for s in self._stop if (i := text.find(s)) >= 0]
        if not hits:
            return None
        at, _, self.matched = min(hits)
        return at

    def _first_stop(self) -> int | None:
        return self._find_stop(self._pending)

    def _unsafe_tail(self) -> int:
        """Length of the longest suffix of pending text that is a proper prefix of a stop string."""
        text = self._pending
        for n in range(min(self._hold, len(text)), 0, -1):
            tail = text[-n:]
            if any(s.startswith(tail) for s in self._stop):
                return n
        return 0
