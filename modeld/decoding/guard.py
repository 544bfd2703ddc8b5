"""The repeated-line guard: stop a model that writes the same long line over and over.

Part of text assembly (it sees exactly the text that is emitted, after stop strings). Cheap:
it only compares completed lines.
"""

from __future__ import annotations

__all__ = ["RepeatedLineGuard"]


class RepeatedLineGuard:
    """Stops a model that repeats one line: the same line of at least ``min_chars`` characters
    (whitespace stripped) completed ``max_repeats`` times in a row trips it.

    Cheap: it looks only at completed lines of the emitted text (one string comparison per
    line). ``min_chars == 0`` or ``max_repeats == 0`` turns it off. The defaults
    (:data:`DEFAULT_MIN_CHARS`, :data:`DEFAULT_MAX_REPEATS`) are conservative: code repeats short
    lines (``}``, ``end``, blank lines) legitimately, and longer ones rarely more than a few times
    in a row; 8 identical lines of 16+ characters is a loop.
    """

    DEFAULT_MIN_CHARS = 16
    DEFAULT_MAX_REPEATS = 8

    def __init__(self, min_chars: int = DEFAULT_MIN_CHARS, max_repeats: int = DEFAULT_MAX_REPEATS) -> None:
        self._on = min_chars > 0 and max_repeats > 0
        self._min = min_chars
        self._max = max_repeats
        self._partial = ""
        self._last: str | None = None
        self._count = 0
        self.tripped = False

    def feed(self, text: str) -> bool:
        """Add emitted text; True once the guard has tripped."""
        if not self._on or self.tripped or not text:
            return self.tripped
        lines = (self._partial + text).split("\n")
        self._partial = lines.pop()
        for raw in lines:
            line = raw.strip()
            if len(line) < self._min:
                self._last, self._count = None, 0
                continue
            if line == self._last:
                self._count += 1
            else:
                self._last, self._count = line, 1
            if self._count >= self._max:
                self.tripped = True
                break
        return self.tripped
