"""Every limit the daemon enforces, in one place, with its default.

Beyond a limit the caller gets :class:`~modeld.errors.LimitExceededError` (or
``InvalidArgumentError`` for a malformed value) and the daemon keeps serving. The same values
are shown by ``modeld status`` and documented in ``blueprints/0006-limits.md``.
"""

from __future__ import annotations

from dataclasses import dataclass

__all__ = ["Limits"]

MiB = 1 << 20


@dataclass(frozen=True, slots=True)
class Limits:
    """Explicit limits. Text limits count UTF-8 bytes."""

    max_sessions: int = 64
    """Open sessions at once (attached or not)."""
    max_text_bytes: int = 8 * MiB
    """Text of one call: prefix text + tools JSON, or suffix text."""
    max_message_bytes: int = 16 * MiB
    """One gRPC message, either direction (must exceed max_text_bytes plus the manifest)."""
    max_segments: int = 4096
    """Segments in one manifest."""
    max_string_bytes: int = 4096
    """Any name, path, digest, stop string or extra value."""
    max_stop_strings: int = 16
    max_extra_entries: int = 32
    max_context_tokens: int = 1 << 20
    """Largest num_ctx a session may ask for (the model and memory may allow less)."""
    max_loaded_models: int = 2
    """Models kept loaded; the least recently used idle one is unloaded beyond this."""
    model_wait_seconds: float = 300.0
    """How long an operation waits for a model busy with other sessions before ``busy``."""
    attach_timeout_seconds: float = 30.0
    """How long an opened session may stay without a Session stream before it is closed."""
    closed_reports_kept: int = 64
    """Closed sessions whose last report stays visible to explain-context."""

    def as_dict(self) -> dict[str, int | float]:
        return {name: getattr(self, name) for name in self.__dataclass_fields__}
