"""Log lines a client cannot forge.

Client strings (a model path, a session id, a conversation key) reach log messages. A newline
in one would start a new, fake log line. :class:`SafeFormatter` escapes control characters in
the formatted message (``\\n`` becomes the two characters ``\\`` ``n``), while a traceback
attached to the record keeps its lines. The daemon installs it on its log handler, so every
module's messages are covered without each call site escaping its arguments.
"""

from __future__ import annotations

import logging
import re

__all__ = ["SafeFormatter", "escape_controls"]

_CONTROLS = re.compile(r"[\x00-\x1f\x7f\u0085\u2028\u2029]")


_NAMED = {"\n": "\\n", "\r": "\\r", "\t": "\\t"}


def _escape(match: re.Match[str]) -> str:
    char = match.group()
    if char in _NAMED:
        return _NAMED[char]
    return f"\\x{ord(char):02x}" if ord(char) < 0x100 else f"\\u{ord(char):04x}"


def escape_controls(text: str) -> str:
    """``text`` with every control character (and Unicode line separator) escaped."""
    return _CONTROLS.sub(_escape, text)


class SafeFormatter(logging.Formatter):
    """A Formatter whose message part never spans lines; exception text is left as is."""

    def formatMessage(self, record: logging.LogRecord) -> str:  # noqa: N802 - logging's name
        record.message = escape_controls(record.message)
        return super().formatMessage(record)
