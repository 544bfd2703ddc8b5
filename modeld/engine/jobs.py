"""A generate job as the decode stream reads it: the engine's own job and event types.

A decode stream (``engine/decode.py``) reads a running generate job through
:class:`GenerateJob`, a protocol this package owns, and its typed events: :class:`Sampled`
tokens, a pause for :class:`RoomAsked` (the job reached its cell limit) and its
:class:`GenerateEnd` (what its sequence holds: the truth after a cancel or an early stop). This
is what the cache's ``KVRuntime`` (``modeld/cache/runtime.py``) is for a sync job: the stream
never reads a worker message. ``engine/model.py``, where a loaded model is composed with its
worker host, turns the host's replies into these events (``GenerateCall``). Design record:
``blueprints/0017-workers.md``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

from modeld.backends.base import DecodeStats
from modeld.contract import TokenLogprob

__all__ = ["GenerateEnd", "GenerateEvent", "GenerateJob", "RoomAsked", "Sampled"]


@dataclass(frozen=True, slots=True)
class Sampled:
    """Tokens the job sampled, in order (each choice's in its own order); ``logprobs`` one per
    token when the decode asked for them, else empty; ``choices`` one per token, the choice it
    belongs to (a job of several choices), empty when all are choice 0."""

    tokens: tuple[int, ...]
    logprobs: tuple[TokenLogprob, ...] = ()
    choices: tuple[int, ...] = ()


@dataclass(frozen=True, slots=True)
class RoomAsked:
    """The job filled the cells it may fill: its sequence holds ``resident`` tokens once the
    tokens it sent are evaluated, and it waits for :meth:`GenerateJob.grant`."""

    resident: int


@dataclass(frozen=True, slots=True)
class GenerateEnd:
    """The job ended: its sequence holds ``resident`` tokens; ``canceled`` when a cancel stopped
    it; ``stats`` what speculation did (when the engine reported it)."""

    resident: int
    canceled: bool = False
    stats: DecodeStats | None = None


GenerateEvent = Sampled | RoomAsked | GenerateEnd


class GenerateJob(Protocol):
    """A generate job in flight."""

    def next_event(self, timeout: float | None = None) -> GenerateEvent | None:
        """The job's next event, or None when none came within ``timeout`` seconds; the error
        that ended the job is raised."""
        ...

    def cancel(self) -> None:
        """Stop the job before its next step (idempotent, never blocks)."""
        ...

    def cancel_choice(self, choice: int) -> None:
        """Stop one choice of the job; its other choices go on (idempotent, never blocks)."""
        ...

    def grant(self, cells: int) -> None:
        """Let a job paused at its cell limit (:class:`RoomAsked`) fill ``cells`` more; 0: it
        ends there; negative: no limit any more (never blocks)."""
        ...
