"""Credentials for TCP listeners: the gRPC token and the HTTP API key check.

A unix socket is protected by its permissions (0600). A TCP port is not: any local user can
connect to ``127.0.0.1``. So a TCP gRPC listener requires a token by default: 32 random bytes,
generated once into the data directory (``grpc.token``, mode 0600, so only the daemon's user
can read it) and sent by clients as ``authorization: Bearer <token>`` metadata
(``runtime_client`` reads the file like it reads the address). Health checks and reflection
stay open: they reveal liveness and the public schema, nothing else.

The interceptor is ``grpc.aio``'s (the daemon's server is asyncio: ``modeld/daemon.py``).

What not: TLS. Off loopback (``--allow-remote``) the token travels in clear text; put a TLS
terminator or an SSH tunnel in front.
"""

from __future__ import annotations

import contextlib
import hmac
import os
import secrets
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

import grpc

from modeld.errors import UnauthenticatedError
from modeld.paths import token_path
from modeld.wire.status import to_grpc_status

__all__ = ["TokenInterceptor", "bearer_matches", "ensure_token"]

_OPEN_SERVICES = frozenset(
    {
        "grpc.health.v1.Health",
        "grpc.reflection.v1alpha.ServerReflection",
        "grpc.reflection.v1.ServerReflection",
    }
)


def ensure_token(data_dir: Path) -> str:
    """The daemon's gRPC token, generated (0600) on first use and kept across restarts."""
    path = token_path(data_dir)
    with contextlib.suppress(FileNotFoundError):
        st = path.stat()
        if st.st_mode & 0o077:
            os.chmod(path, 0o600)  # never leave a readable credential behind
        token = path.read_text().strip()
        if len(token) >= 32:
            return token
    token = secrets.token_urlsafe(32)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "w") as f:
        f.write(token + "\n")
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)
    return token


def bearer_matches(header: str, secret: str) -> bool:
    """Whether an ``Authorization`` value is ``Bearer <secret>`` (constant-time compare)."""
    scheme, _, value = header.strip().partition(" ")
    if scheme.lower() != "bearer":
        return False
    return hmac.compare_digest(value.strip().encode(), secret.encode())


class TokenInterceptor(grpc.aio.ServerInterceptor):
    """Refuses calls without the token (UNAUTHENTICATED, reason ``unauthenticated``)."""

    def __init__(self, token: str) -> None:
        self._token = token

    async def intercept_service(
        self,
        continuation: Callable[[grpc.HandlerCallDetails], Awaitable[grpc.RpcMethodHandler[Any, Any] | None]],
        handler_call_details: grpc.HandlerCallDetails,
    ) -> grpc.RpcMethodHandler[Any, Any] | None:
        details = handler_call_details
        service = details.method.lstrip("/").split("/", 1)[0]
        if service in _OPEN_SERVICES:
            return await continuation(details)
        header = ""
        for key, value in details.invocation_metadata or ():
            if key == "authorization" and isinstance(value, str):
                header = value
        handler = await continuation(details)
        if handler is None or (header and bearer_matches(header, self._token)):
            return handler
        return _refusal(handler, bool(header))


def _refusal(handler: grpc.RpcMethodHandler[Any, Any], had_header: bool) -> grpc.RpcMethodHandler[Any, Any]:
    error = UnauthenticatedError(
        "the token is wrong"
        if had_header
        else "this listener requires the daemon's token as 'authorization: Bearer <token>' metadata "
        "(the file grpc.token in the daemon's data directory; runtime_client sends it for you)"
    )
    status = to_grpc_status(error)

    async def refuse(_request: Any, context: grpc.aio.ServicerContext[Any, Any]) -> Any:
        await context.abort_with_status(status)

    if handler.response_streaming:
        make = (
            grpc.stream_stream_rpc_method_handler
            if handler.request_streaming
            else grpc.unary_stream_rpc_method_handler
        )
        return make(refuse)
    make = (
        grpc.stream_unary_rpc_method_handler
        if handler.request_streaming
        else grpc.unary_unary_rpc_method_handler
    )
    return make(refuse)
