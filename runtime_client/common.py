"""What the synchronous and the asyncio clients share: everything that does no I/O.

:mod:`runtime_client.client` and :mod:`runtime_client.aio` speak the same protocol, one blocking
and one awaiting; the decisions between their calls are written once here. A client's settings,
its fence and the rule for following a restarted daemon (:class:`ClientBase`); a session's
names, how its stream ended, and the bookkeeping of a resume (:class:`SessionBase`); what a
decode's chunk means for its session (:class:`DecodeStreamBase`). The rule itself and the record
are :mod:`runtime_client.resume`'s.
"""

from __future__ import annotations

import time
from dataclasses import replace

from modeld.contract import (
    Fence,
    ModelInfo,
    OpenSessionRequest,
    PrefixInput,
    PrefixStatus,
    StreamChunk,
    SuffixInput,
    SuffixStatus,
)
from modeld.errors import (
    DaemonUnavailableError,
    InvalidArgumentError,
    ModeldError,
    SessionClosedError,
    error_from_reason,
)
from modeld.lease import LeaseRecord
from modeld.manifest import ContextManifest
from runtime_client.discovery import Discovery, Endpoint
from runtime_client.resume import LOST_REASONS, Resume, check_follow, continuation_lost, decode_lost

__all__ = ["ClientBase", "DecodeStreamBase", "SessionBase"]


class ClientBase:
    """A client's settings and the decisions of following a restarted daemon."""

    def __init__(
        self,
        endpoint: Endpoint,
        max_message_bytes: int,
        resume: bool,
        resume_timeout: float,
        discovery: Discovery | None,
    ) -> None:
        if not resume_timeout >= 0:
            raise InvalidArgumentError("resume_timeout must be >= 0 seconds", field="resume_timeout")
        self.endpoint = endpoint
        self.max_message_bytes = max_message_bytes
        self.resume = resume
        self.resume_timeout = resume_timeout
        self._discovery = discovery or Discovery(address=endpoint.target, token=endpoint.token)
        self._auto_fence = bool(endpoint.instance_id)  # found through the lease: fence sessions to it

    @property
    def target(self) -> str:
        return self.endpoint.target

    def _fenced(self, request: OpenSessionRequest) -> tuple[OpenSessionRequest, bool]:
        """The request as sent: fenced to the owner found through the lease, unless it names one."""
        if not request.fence.owner_instance_id and self._auto_fence and self.endpoint.instance_id:
            return replace(request, fence=Fence(self.endpoint.instance_id)), True
        return request, False

    def _still_lost(self, exc: ModeldError, deadline: float) -> None:
        """A look for the daemon failed with ``exc``: raise it unless no daemon serves yet, and
        raise :class:`DaemonUnavailableError` once ``deadline`` (monotonic) has passed."""
        if exc.reason not in (*LOST_REASONS, "deadline_exceeded"):
            raise exc
        if time.monotonic() >= deadline:
            raise DaemonUnavailableError(
                f"the daemon went away and none served again within "
                f"{self.resume_timeout:g}s (resume_timeout): {exc.message}",
                resume_timeout=f"{self.resume_timeout:g}",
            ) from None

    @staticmethod
    def _may_follow(
        endpoint: Endpoint,
        record: LeaseRecord | None,
        instance_id: str,
        old_instance: str,
        old_epoch: int,
        *,
        fenced: bool,
    ) -> None:
        """Whether a session of ``old_instance`` at ``old_epoch`` may follow the daemon found at
        ``endpoint`` that says it is ``instance_id`` (raises if not: :func:`check_follow`)."""
        if endpoint.source == "lease" and record is not None and record.instance_id != instance_id:
            raise DaemonUnavailableError("the owner changed while it was being looked up")
        check_follow(old_instance, old_epoch, instance_id, record, fenced=fenced)

    def _is_current(self, endpoint: Endpoint, instance_id: str) -> bool:
        """Already talking to the daemon found (another session followed first)."""
        return instance_id == self.endpoint.instance_id and endpoint.target == self.endpoint.target

    def _adopt(self, endpoint: Endpoint, instance_id: str, epoch: int) -> None:
        self.endpoint = replace(endpoint, instance_id=instance_id, epoch=epoch)


class SessionBase:
    """A session's names and the bookkeeping of its stream and its resumes. The subclass sets
    every attribute below when it attaches."""

    _client: ClientBase
    _made: OpenSessionRequest | None  # as the caller asked (its fence as given): reopened the same way
    _auto_fenced: bool
    _closed: bool
    _id: str
    _info: ModelInfo
    _identity: ContextManifest
    _instance: str
    epoch: int
    _failure: ModeldError | None
    _prefix: PrefixInput | None  # the inputs a resume replays
    _suffix: SuffixInput | None
    _continued: bool  # a decode's tokens follow the suffix
    _generated_lost: bool  # ... and a resume could not bring them back
    _lost: str  # why the stream's daemon went away (a resumable end), else ""
    _resumes: list[Resume]

    def __init__(self, client: ClientBase, request: OpenSessionRequest | None, auto_fenced: bool) -> None:
        """A session not yet attached (the subclass attaches it to its stream)."""
        self._made = request
        self._auto_fenced = auto_fenced
        self._closed = False
        self._prefix = self._suffix = None
        self._continued = self._generated_lost = False
        self._lost = ""
        self._resumes = []
        self._failure = None

    @property
    def session_id(self) -> str:
        return self._id

    @property
    def info(self) -> ModelInfo:
        return self._info

    @property
    def identity(self) -> ContextManifest:
        return self._identity

    @property
    def resumes(self) -> tuple[Resume, ...]:
        """Every resume of this session across a daemon restart, oldest first."""
        return tuple(self._resumes)

    @property
    def last_resume(self) -> Resume | None:
        return self._resumes[-1] if self._resumes else None

    # --- the stream -------------------------------------------------------------------------

    def _note(self, failure: ModeldError) -> ModeldError:
        """Record how the stream ended (resumable when its daemon went away)."""
        self._failure = failure
        if self._client.resume and not self._closed and failure.reason in LOST_REASONS:
            self._lost = failure.reason
        return failure

    def _ended(self) -> ModeldError:
        """The daemon ended the stream."""
        self._failure = SessionClosedError(
            f"session {self._id}: the daemon ended the stream", session_id=self._id
        )
        return self._failure

    def _mark_lost(self, reason: str, message: str) -> None:
        """The daemon said it is going away (a decode ended ``shutting_down``): resume next time."""
        self._lost = reason
        if self._failure is None:
            self._failure = error_from_reason(reason, message, {"session_id": self._id})

    def _check_usable(self) -> None:
        """Before a request: the session is open and its stream has not failed."""
        if self._closed:
            raise SessionClosedError(f"session {self._id} is closed", session_id=self._id)
        if self._failure is not None:
            raise self._failure

    def _check_continuation(self) -> None:
        """Before a decode: its tokens were to follow a decode a resume could not bring back."""
        if self._generated_lost:
            self._generated_lost = False
            last = self.last_resume
            raise continuation_lost(self._id, last.cause if last else "")

    # --- resuming across a daemon restart ----------------------------------------------------

    def _reopen_request(self) -> OpenSessionRequest:
        """What reopens the session on the daemon serving now (fenced to it when the first
        request was fenced automatically)."""
        if self._made is None:  # attached by id: there is nothing to reopen it with
            self._lost = ""
            self._failure = self._failure or SessionClosedError(
                f"session {self._id}: its daemon went away", session_id=self._id
            )
            raise self._failure
        sent = self._made
        if self._auto_fenced:
            sent = replace(sent, fence=Fence(self._client.endpoint.instance_id))
        return sent

    def _taken_over(self, exc: ModeldError) -> None:
        """A takeover (``stale_fence``, ``not_owner``): the session ends here."""
        self._lost, self._failure = "", exc

    def _reopened(self) -> None:
        """The session is open again: what a decode had generated is gone."""
        self._lost = ""
        if self._continued:
            self._generated_lost = True
        self._continued = False

    def _replay_failed(self) -> None:
        if not self._lost:  # not lost again: the new session has nothing; the caller rebuilds
            self._prefix = self._suffix = None

    def _resumed(
        self,
        cause: str,
        old: tuple[str, str, int],
        started: float,
        replay: int,
        prefix: PrefixStatus | None,
        suffix: SuffixStatus | None,
    ) -> Resume:
        """Record a resume (``old``: session id, instance and epoch before it)."""
        if suffix is None:
            self._suffix = None
        if prefix is None and replay >= 1:
            self._prefix = None
        record = Resume(
            cause=cause,
            old_session_id=old[0],
            session_id=self._id,
            old_instance_id=old[1],
            instance_id=self._instance,
            old_epoch=old[2],
            epoch=self.epoch,
            prefix=prefix,
            suffix=suffix,
            seconds=round(time.monotonic() - started, 3),
        )
        self._resumes.append(record)
        return record

    @staticmethod
    def _with_replay(status: SuffixStatus, resumed: Resume | None) -> SuffixStatus:
        """A suffix's status after a resume: ``restored_tokens`` counts the prefix tokens the new
        daemon computed again."""
        if resumed is None or resumed.prefix is None:
            return status
        replayed = resumed.prefix
        return replace(
            status,
            restored_tokens=status.restored_tokens + replayed.prefilled_tokens,
            prefill_ms=round(status.prefill_ms + replayed.prefill_ms, 3),
            restore_ms=round(status.restore_ms + replayed.restore_ms, 3),
        )


class DecodeStreamBase:
    """A decode's chunks as its session reads them: what a failure or a final chunk means."""

    _session: SessionBase

    def __init__(self, session: SessionBase, request_id: int) -> None:
        self._session = session
        self._rid = request_id
        self._done = False
        self._cancel_sent = False

    def _failed(self, exc: ModeldError) -> ModeldError:
        """The stream failed: its daemon went away (the output is lost, the session is not) or
        ``exc`` stands."""
        self._done = True
        session = self._session
        return decode_lost(exc, session.session_id) if session._lost else exc

    def _took(self, chunk: StreamChunk) -> StreamChunk:
        """``chunk`` arrived: a final one ends the stream (its daemon going away is a lost
        decode; a normal end leaves the generated tokens resident)."""
        self._done = chunk.final
        session = self._session
        if chunk.final and chunk.finish_reason == "error":
            error = chunk.error
            if error is not None and error.reason in LOST_REASONS and session._client.resume:
                session._mark_lost(error.reason, error.message)
                raise decode_lost(error_from_reason(error.reason, error.message, {}), session.session_id)
        elif chunk.final:
            session._continued = True
        return chunk

    def _may_cancel(self) -> bool:
        """Whether a cancel is still to be sent (at most once, never after the end)."""
        if self._done or self._cancel_sent:
            return False
        self._cancel_sent = True
        return True
