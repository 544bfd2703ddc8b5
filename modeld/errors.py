"""The typed errors of the modeld contract, each with a stable reason token.

Every failure a caller can act on is one of these classes. The reason token (``reason``) is
the stable, machine-readable name; the message is for people and may change. ``details``
holds string key/value pairs (they travel as ``google.rpc.ErrorInfo.metadata`` on the wire);
subclasses expose the ones that matter as typed properties.

The tree (HTTP: the status every HTTP API answers with; see below)::

    ModeldError                      reason                grpc status          HTTP
    ├── InvalidArgumentError         invalid_argument      INVALID_ARGUMENT     400
    │   └── UnsupportedError         unsupported           INVALID_ARGUMENT     400
    ├── LimitExceededError           limit_exceeded        RESOURCE_EXHAUSTED   429 capacity, 400 request
    ├── SessionNotFoundError         session_not_found     NOT_FOUND            404
    ├── ModelLoadError               model_load_failed     FAILED_PRECONDITION  500
    ├── ModelChangedError            model_changed         FAILED_PRECONDITION  503
    ├── NotOwnerError                not_owner             FAILED_PRECONDITION  503
    ├── StaleFenceError              stale_fence           FAILED_PRECONDITION  503
    ├── SessionClosedError           session_closed        FAILED_PRECONDITION  503
    ├── PrefixRequiredError          prefix_required       FAILED_PRECONDITION  400
    ├── BackendMismatchError         backend_mismatch      FAILED_PRECONDITION  400
    ├── BackendUnavailableError      backend_unavailable   FAILED_PRECONDITION  500
    ├── ManifestMismatchError        manifest_mismatch     FAILED_PRECONDITION  400
    ├── ContextOverflowError         context_overflow      OUT_OF_RANGE         400
    ├── BusyError                    busy                  UNAVAILABLE          503
    ├── NoSlotAvailableError         no_slot_available     RESOURCE_EXHAUSTED   429
    ├── EngineRestartedError         engine_restarted      UNAVAILABLE          503
    ├── StallTimeoutError            stall_timeout         UNAVAILABLE          503
    ├── OperationTimeoutError        timeout               DEADLINE_EXCEEDED    504
    ├── ShuttingDownError            shutting_down         UNAVAILABLE          503
    ├── DaemonUnavailableError       unavailable           UNAVAILABLE          503 (client side)
    ├── DeadlineExceededError        deadline_exceeded     DEADLINE_EXCEEDED    504 (client side)
    ├── UnauthenticatedError         unauthenticated       UNAUTHENTICATED      401
    ├── EngineError                  engine_error          INTERNAL             500
    └── InternalError                internal              INTERNAL             500

The mapping to gRPC lives in :mod:`modeld.wire.status`; this module imports nothing outside
the standard library so that every layer (backends, engine, client) can use it.

HTTP: every error's status is derived from its gRPC code by the standard ``google.rpc``
mapping (:data:`HTTP_STATUS_OF_CODE`: INVALID_ARGUMENT, FAILED_PRECONDITION and OUT_OF_RANGE
400, NOT_FOUND 404, RESOURCE_EXHAUSTED 429, UNAVAILABLE 503, DEADLINE_EXCEEDED 504, INTERNAL
500, ...), except where a class says otherwise (``http``) because the reason is about the
daemon, not the request: ``not_owner``, ``stale_fence``, ``session_closed`` and
``model_changed`` are 503 (ask another daemon, or this one again: a new session loads the model
file as it is now), ``model_load_failed`` and ``backend_unavailable`` 500,
and a request-size ``limit_exceeded`` 400 (only capacity limits are 429). A 429 or 503 carries
:attr:`ModeldError.retry_after`. Every HTTP API takes its status from here and keeps only its
own error type words.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import ClassVar, TypeVar

__all__ = [
    "ERRORS_BY_REASON",
    "BackendMismatchError",
    "BackendUnavailableError",
    "BusyError",
    "ContextOverflowError",
    "DaemonUnavailableError",
    "DeadlineExceededError",
    "EngineError",
    "EngineRestartedError",
    "InternalError",
    "InvalidArgumentError",
    "LimitExceededError",
    "ManifestMismatchError",
    "ModelChangedError",
    "ModelLoadError",
    "NoSlotAvailableError",
    "OperationTimeoutError",
    "ModeldError",
    "NotOwnerError",
    "PrefixRequiredError",
    "SessionClosedError",
    "SessionNotFoundError",
    "ShuttingDownError",
    "StaleFenceError",
    "StallTimeoutError",
    "UnauthenticatedError",
    "UnsupportedError",
    "CAPACITY_LIMITS",
    "HTTP_STATUS_OF_CODE",
    "echo",
    "error_from_reason",
]

DetailValue = str | int | bool

ECHO_CHARS = 64
"""How much of a client-supplied value an error message repeats (see :func:`echo`)."""


def echo(value: object, limit: int = ECHO_CHARS) -> str:
    """A client-supplied value as an error message may repeat it: ``repr`` (so control
    characters are escaped), cut to ``limit`` characters with the full length stated. An error
    must stay small (it travels in gRPC metadata) whatever the client sent."""
    if isinstance(value, str | bytes) and len(value) > limit:
        return f"{value[:limit]!r}... ({len(value)} {'characters' if isinstance(value, str) else 'bytes'})"
    text = repr(value)
    return text if len(text) <= limit + 2 else text[: limit + 2] + "..."


_E = TypeVar("_E", bound="ModeldError")


HTTP_STATUS_OF_CODE: Mapping[str, int] = {
    "CANCELLED": 499,
    "UNKNOWN": 500,
    "INVALID_ARGUMENT": 400,
    "DEADLINE_EXCEEDED": 504,
    "NOT_FOUND": 404,
    "ALREADY_EXISTS": 409,
    "PERMISSION_DENIED": 403,
    "UNAUTHENTICATED": 401,
    "RESOURCE_EXHAUSTED": 429,
    "FAILED_PRECONDITION": 400,
    "ABORTED": 409,
    "OUT_OF_RANGE": 400,
    "UNIMPLEMENTED": 501,
    "INTERNAL": 500,
    "UNAVAILABLE": 503,
    "DATA_LOSS": 500,
}
"""The standard ``google.rpc.Code`` -> HTTP status mapping (``google/rpc/code.proto``)."""

CAPACITY_LIMITS = frozenset(
    {"max_sessions", "max_loaded_models", "max_queue", "max_streams", "max_inflight_bytes"}
)
"""``LimitExceededError.limit`` values that are about the daemon's capacity, not the request:
retrying later may succeed (HTTP 429 with Retry-After). Every other limit is on the request
itself (HTTP 400: the same request fails again)."""

RETRY_AFTER_SECONDS = 1
"""What a 429 or 503 answer's ``Retry-After`` says."""


class ModeldError(Exception):
    """Base of every contract error. ``reason`` is the stable token, ``status`` the gRPC code
    name, ``http`` the HTTP status when it is not the standard mapping of ``status``."""

    reason: ClassVar[str] = "internal"
    status: ClassVar[str] = "INTERNAL"
    http: ClassVar[int] = 0

    def __init__(self, message: str, **details: DetailValue) -> None:
        super().__init__(message)
        self.message = message
        self.details: dict[str, str] = {k: _detail_str(v) for k, v in details.items()}

    def __str__(self) -> str:
        return self.message

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.message!r}, reason={self.reason!r}, details={self.details!r})"

    @classmethod
    def from_wire(cls: type[_E], message: str, details: Mapping[str, str]) -> _E:
        """Rebuild an error received from the wire without running the subclass constructor."""
        err = cls.__new__(cls)
        ModeldError.__init__(err, message)
        err.details = dict(details)
        return err

    @property
    def http_status(self) -> int:
        """The HTTP status every HTTP API answers this error with (one table, module docstring)."""
        return self.http or HTTP_STATUS_OF_CODE.get(self.status, 500)

    @property
    def retry_after(self) -> int | None:
        """Seconds an HTTP client should wait before retrying (429 and 503), else None."""
        return RETRY_AFTER_SECONDS if self.http_status in (429, 503) else None

    def _int(self, key: str) -> int:
        try:
            return int(self.details.get(key, "0"))
        except ValueError:
            return 0


def _detail_str(value: DetailValue) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    return str(value)


class InvalidArgumentError(ModeldError):
    """The request is malformed: a field is missing, of the wrong shape or out of range."""

    reason = "invalid_argument"
    status = "INVALID_ARGUMENT"

    def __init__(self, message: str, *, field: str = "", **details: DetailValue) -> None:
        super().__init__(message, field=field, **details)

    @property
    def field(self) -> str:
        return self.details.get("field", "")


class UnsupportedError(InvalidArgumentError):
    """The request asks for something this backend cannot honour (never silently dropped)."""

    reason = "unsupported"


class LimitExceededError(ModeldError):
    """An explicit limit (message size, text bytes, sessions, ...) was exceeded."""

    reason = "limit_exceeded"
    status = "RESOURCE_EXHAUSTED"

    def __init__(self, message: str, *, limit: str, value: int, maximum: int) -> None:
        super().__init__(message, limit=limit, value=value, maximum=maximum)

    @property
    def limit(self) -> str:
        return self.details.get("limit", "")

    @property
    def http_status(self) -> int:
        return 429 if self.limit in CAPACITY_LIMITS else 400

    @property
    def value(self) -> int:
        return self._int("value")

    @property
    def maximum(self) -> int:
        return self._int("maximum")


class SessionNotFoundError(ModeldError):
    """No session with that id exists (it never did, or it was forgotten long ago)."""

    reason = "session_not_found"
    status = "NOT_FOUND"

    def __init__(self, session_id: str) -> None:
        super().__init__(f"no session with id {echo(session_id)}", session_id=session_id[:128])


class ModelLoadError(ModeldError):
    """The model file is missing, unreadable, truncated or not of the expected format."""

    reason = "model_load_failed"
    status = "FAILED_PRECONDITION"
    http = 500

    def __init__(self, message: str, *, path: str, **details: DetailValue) -> None:
        super().__init__(message, path=path, **details)

    @property
    def path(self) -> str:
        return self.details.get("path", "")


class ModelChangedError(ModeldError):
    """The model file changed on disk (rewritten in place, replaced, truncated or removed) since
    the session's model was loaded: KV computed under the old file is never reused for the new
    one, so the session ends and nothing of it is reused. Open a new session (it loads the file
    as it is now) and run the turn again. Details: ``path``, ``change`` (what happened:
    ``rewritten in place (...)``, ``replaced by another file``, ...), ``loaded_digest`` (the
    model the session ran on) and ``digest`` (the file now; "" when it no longer describes as a
    model, e.g. while it is still being written)."""

    reason = "model_changed"
    status = "FAILED_PRECONDITION"
    http = 503

    def __init__(self, message: str, *, path: str, **details: DetailValue) -> None:
        super().__init__(message, path=path, **details)

    @property
    def path(self) -> str:
        return self.details.get("path", "")


class NotOwnerError(ModeldError):
    """This daemon does not (or no longer) own the machine's warm state."""

    reason = "not_owner"
    status = "FAILED_PRECONDITION"
    http = 503


class StaleFenceError(ModeldError):
    """The session's owner epoch is no longer current, or the fence names another owner."""

    reason = "stale_fence"
    status = "FAILED_PRECONDITION"
    http = 503


class SessionClosedError(ModeldError):
    """The session was closed; open a new one."""

    reason = "session_closed"
    status = "FAILED_PRECONDITION"
    http = 503


class PrefixRequiredError(ModeldError):
    """The operation needs a resident prefix: call ensure_prefix first."""

    reason = "prefix_required"
    status = "FAILED_PRECONDITION"


class BackendMismatchError(ModeldError):
    """The model is typed for a backend this service does not run."""

    reason = "backend_mismatch"
    status = "FAILED_PRECONDITION"


class BackendUnavailableError(ModeldError):
    """The backend's native package is not installed or failed to import."""

    reason = "backend_unavailable"
    status = "FAILED_PRECONDITION"
    http = 500


class ManifestMismatchError(ModeldError):
    """A manifest contradicts the session or the text it describes; ``field`` says where."""

    reason = "manifest_mismatch"
    status = "FAILED_PRECONDITION"

    def __init__(self, message: str, *, field: str, expected: str = "", got: str = "") -> None:
        super().__init__(message, field=field, expected=expected, got=got)

    @property
    def field(self) -> str:
        return self.details.get("field", "")


class ContextOverflowError(ModeldError):
    """The tokens would not fit in the context window. Nothing resident was changed."""

    reason = "context_overflow"
    status = "OUT_OF_RANGE"

    def __init__(self, *, stage: str, resident: int, additional: int, window: int) -> None:
        super().__init__(
            f"context overflow at {stage}: {resident} resident + {additional} new tokens "
            f"exceed the {window}-token window",
            stage=stage,
            resident=resident,
            additional=additional,
            window=window,
        )

    @property
    def stage(self) -> str:
        return self.details.get("stage", "")

    @property
    def resident(self) -> int:
        return self._int("resident")

    @property
    def additional(self) -> int:
        return self._int("additional")

    @property
    def window(self) -> int:
        return self._int("window")


class BusyError(ModeldError):
    """The model stayed busy with other sessions for longer than the wait limit."""

    reason = "busy"
    status = "UNAVAILABLE"


class NoSlotAvailableError(ModeldError):
    """Every slot of the model is busy and the caller asked not to wait (``no_wait``)."""

    reason = "no_slot_available"
    status = "RESOURCE_EXHAUSTED"


class EngineRestartedError(ModeldError):
    """The engine worker died during the operation (a crash, a signal, a changed model file)
    and is being restarted; nothing was replayed. Details: ``signal`` or ``exit_code``, and
    ``why`` when modeld knows more (``model file changed``). ``runtime_client`` raises it too,
    with ``daemon="lost"`` and ``cause`` (unavailable, shutting_down), for a decode whose daemon
    went away: the session resumes at its next call (``runtime_client/resume.py``)."""

    reason = "engine_restarted"
    status = "UNAVAILABLE"


class StallTimeoutError(ModeldError):
    """The engine worker made no progress (no token, no CPU time) for ``seconds`` and was
    restarted; nothing was replayed."""

    reason = "stall_timeout"
    status = "UNAVAILABLE"


class OperationTimeoutError(ModeldError):
    """The operation ran longer than a configured timeout (``timeout`` names which) and was
    stopped; the daemon and the session keep working."""

    reason = "timeout"
    status = "DEADLINE_EXCEEDED"


class ShuttingDownError(ModeldError):
    """The daemon is shutting down and takes no new work."""

    reason = "shutting_down"
    status = "UNAVAILABLE"


class DaemonUnavailableError(ModeldError):
    """No daemon could be reached (client side: nothing listening, or the connection broke)."""

    reason = "unavailable"
    status = "UNAVAILABLE"


class DeadlineExceededError(ModeldError):
    """The call's deadline passed before the daemon answered (client side)."""

    reason = "deadline_exceeded"
    status = "DEADLINE_EXCEEDED"


class UnauthenticatedError(ModeldError):
    """A TCP listener's credential (token or API key) is missing or wrong."""

    reason = "unauthenticated"
    status = "UNAUTHENTICATED"


class EngineError(ModeldError):
    """The inference engine failed during an operation; the session's resident state was reset."""

    reason = "engine_error"
    status = "INTERNAL"


class InternalError(ModeldError):
    """An unexpected failure inside modeld (a bug). The daemon logged it with ``incident``."""

    reason = "internal"
    status = "INTERNAL"


def _all_subclasses(cls: type[ModeldError]) -> list[type[ModeldError]]:
    out: list[type[ModeldError]] = []
    for sub in cls.__subclasses__():
        out.append(sub)
        out.extend(_all_subclasses(sub))
    return out


ERRORS_BY_REASON: Mapping[str, type[ModeldError]] = {cls.reason: cls for cls in _all_subclasses(ModeldError)}


def error_from_reason(reason: str, message: str, details: Mapping[str, str]) -> ModeldError:
    """The typed error for a reason token; an unknown token becomes :class:`InternalError`."""
    cls = ERRORS_BY_REASON.get(reason, InternalError)
    err = cls.from_wire(message, details)
    if cls is InternalError and reason != InternalError.reason:
        err.details.setdefault("unknown_reason", reason)
    return err
