"""The one table between contract errors and gRPC statuses, both ways.

Server side, :func:`to_status` turns a :class:`~modeld.errors.ModeldError` into a
``google.rpc.Status``: the code from the error class, the message, and a
``google.rpc.ErrorInfo`` detail (``domain = "modeld"``, ``reason`` = the stable token,
``metadata`` = the error's details). Client side, :func:`from_status` reads the ErrorInfo back
into the same typed exception. A status without a modeld ErrorInfo comes from gRPC itself
(the daemon is gone, a deadline passed, a message was too large); :data:`TRANSPORT_ERRORS` maps
its code to a typed error -- by code only, never by parsing the message.

A status travels in gRPC metadata (``grpc-message`` and ``grpc-status-details-bin``), which a
client refuses beyond 8 KiB by default: :func:`to_status` cuts the message to
:data:`MAX_MESSAGE_CHARS` and every detail value to :data:`MAX_DETAIL_CHARS`, so an error
caused by a huge client string still arrives as that error.
"""

from __future__ import annotations

from typing import Any

import grpc
from google.protobuf import any_pb2
from google.rpc import error_details_pb2, status_pb2
from grpc_status import rpc_status

from modeld.errors import (
    DaemonUnavailableError,
    DeadlineExceededError,
    InternalError,
    InvalidArgumentError,
    LimitExceededError,
    ModeldError,
    SessionNotFoundError,
    UnauthenticatedError,
    error_from_reason,
)

__all__ = [
    "DOMAIN",
    "MAX_DETAIL_CHARS",
    "MAX_MESSAGE_CHARS",
    "TRANSPORT_ERRORS",
    "from_rpc_error",
    "from_status",
    "grpc_code",
    "to_grpc_status",
    "to_status",
]

DOMAIN = "modeld"

TRANSPORT_ERRORS: dict[grpc.StatusCode, type[ModeldError]] = {
    grpc.StatusCode.UNAVAILABLE: DaemonUnavailableError,
    grpc.StatusCode.CANCELLED: DaemonUnavailableError,
    grpc.StatusCode.DEADLINE_EXCEEDED: DeadlineExceededError,
    grpc.StatusCode.RESOURCE_EXHAUSTED: LimitExceededError,
    grpc.StatusCode.INVALID_ARGUMENT: InvalidArgumentError,
    grpc.StatusCode.NOT_FOUND: SessionNotFoundError,
    grpc.StatusCode.UNAUTHENTICATED: UnauthenticatedError,
}
"""Statuses that gRPC produces by itself (no ErrorInfo), by code. Anything else is internal."""

_CODE_BY_NAME: dict[str, grpc.StatusCode] = {code.name: code for code in grpc.StatusCode}


def grpc_code(err: ModeldError) -> grpc.StatusCode:
    return _CODE_BY_NAME.get(err.status, grpc.StatusCode.INTERNAL)


MAX_MESSAGE_CHARS = 1024
MAX_DETAIL_CHARS = 256
_MAX_DETAILS = 16


def _cut(text: str, limit: int) -> str:
    return text if len(text) <= limit else text[: limit - 3] + "..."


def to_status(err: ModeldError) -> status_pb2.Status:
    """A ``google.rpc.Status`` carrying the error's code, message and ErrorInfo (size-bounded)."""
    metadata = {_cut(k, 64): _cut(v, MAX_DETAIL_CHARS) for k, v in list(err.details.items())[:_MAX_DETAILS]}
    info = error_details_pb2.ErrorInfo(reason=err.reason, domain=DOMAIN, metadata=metadata)
    detail = any_pb2.Any()
    detail.Pack(info)
    code = grpc_code(err).value[0]
    return status_pb2.Status(code=code, message=_cut(err.message, MAX_MESSAGE_CHARS), details=[detail])


def to_grpc_status(err: ModeldError) -> grpc.Status:
    """The status for ``context.abort_with_status``."""
    status: grpc.Status = rpc_status.to_status(to_status(err))
    return status


def from_status(status: status_pb2.Status) -> ModeldError:
    """The typed error a ``google.rpc.Status`` stands for."""
    for detail in status.details:
        if detail.Is(error_details_pb2.ErrorInfo.DESCRIPTOR):
            info = error_details_pb2.ErrorInfo()
            detail.Unpack(info)
            if info.domain == DOMAIN:
                return error_from_reason(info.reason, status.message, dict(info.metadata))
    code = next((c for c in grpc.StatusCode if c.value[0] == status.code), grpc.StatusCode.UNKNOWN)
    return _transport_error(code, status.message)


def _transport_error(code: grpc.StatusCode, message: str, target: str = "") -> ModeldError:
    cls = TRANSPORT_ERRORS.get(code) or InternalError
    text = f"gRPC {code.name}: {message}" if message else f"gRPC {code.name}"
    if cls is DaemonUnavailableError and target:
        text = f"could not reach modeld at {target} ({text})"
    return cls.from_wire(text, {"grpc_code": code.name})


_STATUS_TRAILER = "grpc-status-details-bin"


def from_rpc_error(exc: grpc.RpcError, target: str = "") -> ModeldError:
    """The typed error for a failed call, sync or asyncio (reads the status trailer if any).

    ``target`` names the daemon's address in the message when it could not be reached.
    """
    call: Any = exc
    if not callable(getattr(call, "code", None)):
        return DaemonUnavailableError(f"gRPC call failed: {exc}")
    trailers = call.trailing_metadata() if callable(getattr(call, "trailing_metadata", None)) else None
    for key, value in trailers or ():
        if key == _STATUS_TRAILER and isinstance(value, bytes):
            try:
                return from_status(status_pb2.Status.FromString(value))
            except Exception:  # a corrupt trailer: report the status code instead
                break
    details = call.details() if callable(getattr(call, "details", None)) else ""
    return _transport_error(call.code(), details or "", target)
