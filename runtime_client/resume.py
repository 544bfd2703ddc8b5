"""Resuming a session across a daemon restart: the rule, the record, the errors.

When the daemon a session runs on dies (SIGKILL, a crash) or stops (SIGTERM), the session's
stream ends with ``unavailable`` or ``shutting_down``. With ``resume`` on (``connect``'s
default), the session's next call finds the daemon serving now (the same discovery as
``connect``), decides whether it may follow it (:func:`check_follow`), reopens the session with
the same :class:`~modeld.contract.OpenSessionRequest`, replays what the call needs (the last
prefix; the last suffix too before a decode), which restores from the disk tier, and then runs
the call. A takeover is never followed: it ends the session with ``stale_fence``.

The rule (``blueprints/0005-owner-lease.md``, "Resuming across a restart"): a session opened on
owner instance I at epoch E follows the owner J serving now iff J is I, or the owner record
names J and shows no takeover after E (``LeaseRecord.takeover_epoch <= E``). A session fenced
to its owner (found through the lease) needs that record; a session opened by address alone
(no fence: "whoever owns now") follows J unless a record naming J shows a takeover.

A decode in flight when the daemon goes away cannot be resumed (its tokens are gone): it raises
:class:`~modeld.errors.EngineRestartedError` (``engine_restarted``: the operation was lost, the
next call restores; ``details["daemon"] == "lost"``), and the next call resumes.
"""

from __future__ import annotations

from dataclasses import dataclass

from modeld.contract import PrefixStatus, SuffixStatus
from modeld.errors import EngineRestartedError, ModeldError, StaleFenceError
from modeld.lease import LeaseRecord

__all__ = [
    "LOST_REASONS",
    "RESUME_TIMEOUT",
    "RETRY_REASONS",
    "Resume",
    "check_follow",
    "continuation_lost",
    "decode_lost",
]

LOST_REASONS = frozenset({"unavailable", "shutting_down"})
"""How a session's stream ends when its daemon goes away (dies, or stops): resumable."""

RETRY_REASONS = frozenset({"engine_restarted", "stall_timeout"})
"""Failures that lost an operation but not the session (a worker or the daemon restarted):
the tool loop runs such a turn once more."""

RESUME_TIMEOUT = 30.0
"""How long a resuming call waits for a daemon to serve again (``connect(resume_timeout=)``)."""

POLL_SECONDS = 0.1
"""How often a resuming call looks for the daemon while none serves."""

PROBE_TIMEOUT = 2.0
"""The deadline of the Status call that asks a found daemon who it is."""


@dataclass(frozen=True, slots=True)
class Resume:
    """One resume of a session: which daemon it lost, which it reopened on, what was replayed.

    ``prefix`` / ``suffix``: the statuses of the replayed prefix and suffix (``prefix.reuse``
    says how the new daemon got the context back: ``restored_from_disk``, ...); None when the
    call did not need them (an ``ensure_prefix`` reports its own status)."""

    cause: str  # the reason the old stream ended: unavailable or shutting_down
    old_session_id: str
    session_id: str
    old_instance_id: str
    instance_id: str
    old_epoch: int
    epoch: int
    prefix: PrefixStatus | None = None
    suffix: SuffixStatus | None = None
    seconds: float = 0.0  # from noticing the loss to the replayed state


def check_follow(
    old_instance: str, old_epoch: int, new_instance: str, record: LeaseRecord | None, *, fenced: bool
) -> None:
    """Raise :class:`StaleFenceError` unless a session of ``old_instance`` at ``old_epoch`` may
    follow the daemon ``new_instance`` serving now (the module's rule). ``record``: the owner
    record naming the endpoint, if one could be read; ``fenced``: the session was bound to its
    owner (it needs the record to prove a restart)."""
    if old_instance and new_instance == old_instance:
        return  # the same daemon: the stream broke, the daemon did not change
    if record is not None and record.instance_id == new_instance:
        if record.takeover_epoch > old_epoch:
            raise StaleFenceError(
                f"the daemon was taken over (instance {new_instance} holds the lease since a takeover "
                f"at epoch {record.takeover_epoch}; this session was opened at epoch {old_epoch} on "
                f"instance {old_instance or '(unknown)'}): a session is not resumed across a "
                f"takeover; open a new one",
                instance_id=new_instance,
                epoch=record.epoch,
                takeover_epoch=record.takeover_epoch,
                session_epoch=old_epoch,
            )
        return
    if fenced:
        raise StaleFenceError(
            f"the daemon this session was opened on (instance {old_instance}, epoch {old_epoch}) is "
            f"gone and no owner record shows that instance {new_instance} restarted it rather than "
            f"took over: not resumed; open a new session",
            instance_id=new_instance,
            session_epoch=old_epoch,
        )


def decode_lost(cause: ModeldError, session_id: str) -> EngineRestartedError:
    """The typed, retryable error of a decode whose daemon went away mid-stream."""
    return EngineRestartedError(
        f"the daemon went away during the decode ({cause.reason}: {cause.message}); its output "
        f"is lost. The session resumes on the next call (restoring its context), so run the "
        f"turn again",
        why="the daemon restarted",
        daemon="lost",
        cause=cause.reason,
        session_id=session_id,
    )


def continuation_lost(session_id: str, cause: str) -> EngineRestartedError:
    """A decode that would continue the previous one's output, after a resume that could not
    replay that output (only text is replayed; generated tokens are not)."""
    return EngineRestartedError(
        "the daemon restarted after the previous decode; the session was resumed with its prefix "
        "and suffix, but the tokens that decode generated cannot be replayed: send them as part "
        "of the suffix (prefill_suffix) to continue from them, or decode again to answer anew",
        why="the daemon restarted",
        daemon="lost",
        cause=cause,
        session_id=session_id,
    )
