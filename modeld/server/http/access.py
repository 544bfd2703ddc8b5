"""Who may call the HTTP APIs, and how much of their requests the daemon holds at once.

:class:`Access` (``blueprints/0014-openai-http.md``): with an API key every route but
``/health`` needs ``Authorization: Bearer <key>`` or ``x-api-key: <key>`` (Anthropic's header);
off loopback a key is mandatory (``serve`` refuses to start without one). What a web page in a
browser could send is refused everywhere: a ``Host`` that is not a loopback name or the bound
address (DNS rebinding); any ``Origin`` that is not a loopback ``http(s)`` origin or on the
allow-list (``--allow-origin``), so ``Origin: null`` (sandboxed frames, ``file://`` pages) and
extension origins are refused. The live page (``/ui``, read-only) may also be let in by a cookie
that ``/ui?token=KEY`` sets (a browser cannot send a header when it opens a page): it holds an
HMAC of the key, never the key, and is ``HttpOnly`` and ``SameSite=Strict``.

:class:`Bodies`: a POST body is read as JSON; one that carries an ``Origin`` (a browser's) must
say so in its ``Content-Type`` (a page cannot send a "simple" cross-site request that needs no
preflight; a request without ``Origin``, curl's ``-d`` for one, is not a page's); a body is at most ``max_body_bytes``; the bodies of requests in flight
together at most ``max_inflight_bytes`` (beyond it 503 with ``Retry-After``,
``limit_exceeded``); every string a client sends is checked at the edge (a lone surrogate is a
400).
"""

from __future__ import annotations

import contextlib
import hashlib
import hmac
import ipaddress
import json
import threading
from collections.abc import AsyncIterator
from typing import Any
from urllib.parse import urlsplit

from starlette.requests import HTTPConnection, Request

from modeld.errors import echo
from modeld.server.auth import bearer_matches
from modeld.server.http.errors import HttpError
from modeld.server.http.fields import check_body

__all__ = ["UI_COOKIE", "Access", "Bodies", "is_loopback_host"]

UI_COOKIE = "modeld_ui"
"""The cookie that lets a browser read the live page and the records with an API key set."""


def is_loopback_host(host: str) -> bool:
    name = host.strip()
    if name.startswith("["):
        name = name[1 : name.find("]")] if "]" in name else name[1:]
    elif name.count(":") == 1:
        name = name.split(":", 1)[0]
    if name.lower() == "localhost" or name.lower().endswith(".localhost"):
        return True
    try:
        return ipaddress.ip_address(name).is_loopback
    except ValueError:
        return False


class Access:
    """The access checks: the API key, the ``Host`` and the ``Origin``."""

    def __init__(self, api_key: str, allowed_origins: tuple[str, ...], bound_host: str) -> None:
        self.api_key = api_key
        self.allowed_origins = allowed_origins
        self.bound_host = bound_host

    def ui_cookie(self) -> str:
        """The live page's cookie value for this key (an HMAC of it, never the key itself)."""
        return hmac.new(self.api_key.encode(), b"modeld live page", hashlib.sha256).hexdigest()

    def denied(self, request: HTTPConnection, *, cookie: bool = False) -> HttpError | None:
        """Why this request (or WebSocket upgrade) may not be served (None: it may). ``cookie``: a read-only route of
        the live page, which the page's cookie also opens."""
        origin = request.headers.get("origin")
        if origin is not None and not self._origin_allowed(origin):
            return HttpError(
                403,
                f"requests from the web page at Origin {echo(origin)} are refused (only loopback http(s) "
                "origins, or those given to modeld serve --allow-origin)",
                code="forbidden_origin",
            )
        if self.api_key:
            given = request.headers.get("x-api-key")
            if given is not None and given == self.api_key:
                return None
            if bearer_matches(request.headers.get("authorization", ""), self.api_key):
                return None
            given = request.cookies.get(UI_COOKIE) if cookie else None
            if given is not None and hmac.compare_digest(given, self.ui_cookie()):
                return None
            return HttpError(
                401,
                "a valid API key is required: send 'Authorization: Bearer <key>' or 'x-api-key: <key>' (the key "
                "given to modeld serve with --api-key or MODELD_API_KEY)",
                code="invalid_api_key",
            )
        host = request.headers.get("host", "")
        if not (is_loopback_host(host) or host.split(":")[0] == self.bound_host):
            return HttpError(403, f"Host {echo(host)} is not a loopback name", code="forbidden_host")
        return None

    def _origin_allowed(self, origin: str) -> bool:
        if origin in self.allowed_origins:
            return True
        parts = urlsplit(origin)
        return parts.scheme in ("http", "https") and bool(parts.netloc) and is_loopback_host(parts.netloc)


class Bodies:
    """Request bodies read whole, bounded one by one and together (thread-safe)."""

    def __init__(self, max_body_bytes: int, max_inflight_bytes: int) -> None:
        self.max_body_bytes = max_body_bytes
        self.max_inflight_bytes = max_inflight_bytes
        self._inflight = 0
        self._lock = threading.Lock()

    @contextlib.asynccontextmanager
    async def read(self, request: Request) -> AsyncIterator[dict[str, Any]]:
        """The request's JSON object, its bytes counted against the in-flight budget while the
        request is handled."""
        if request.method == "POST" and "origin" in request.headers:
            # Only a browser sends Origin, and it always does on a cross-site POST: there a JSON
            # content type is what keeps a page from sending a "simple" request with no
            # preflight. Without Origin (curl -d, Ollama's own examples) the body is read as JSON.
            kind = request.headers.get("content-type", "").split(";", 1)[0].strip().lower()
            if kind != "application/json" and not kind.endswith("+json"):
                raise HttpError(
                    415,
                    f"the request body must be JSON: send 'Content-Type: application/json' (got {echo(kind or 'none')})",
                    code="unsupported_media_type",
                )
        limit = self.max_body_bytes
        length = request.headers.get("content-length", "")
        if length.isdigit() and int(length) > limit:
            raise HttpError(
                413, f"the request body is {length} bytes; the limit is {limit}", code="limit_exceeded"
            )
        held = 0
        try:
            parts: list[bytes] = []
            async for part in request.stream():
                held += len(part)
                self._hold(len(part))
                if held > limit:
                    raise HttpError(413, f"the request body exceeds {limit} bytes", code="limit_exceeded")
                parts.append(part)
            data = b"".join(parts)
            try:
                body = json.loads(data) if data else {}
            except (ValueError, RecursionError) as exc:
                raise HttpError(
                    400, f"the request body is not valid JSON ({str(exc)[:120]})", code="invalid_json"
                ) from None
            if not isinstance(body, dict):
                raise HttpError(400, "the request body must be a JSON object", code="invalid_json")
            check_body(body, data)
            yield body
        finally:
            with self._lock:
                self._inflight -= held

    def _hold(self, size: int) -> None:
        with self._lock:
            if self._inflight + size > self.max_inflight_bytes:
                raise HttpError(
                    503,
                    f"the daemon is reading {self._inflight} bytes of requests; the limit is "
                    f"{self.max_inflight_bytes} (modeld serve --max-inflight-bytes): retry shortly",
                    code="limit_exceeded",
                    param="max_inflight_bytes",
                    retry_after=1,
                )
            self._inflight += size
