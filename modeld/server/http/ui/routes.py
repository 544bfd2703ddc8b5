"""The live page and the request records over HTTP (read-only; blueprint 0022).

* ``GET /ui``: the page (plain HTML, a small script and a style sheet served beside it, no
  build step, nothing fetched from elsewhere); ``GET /ui/state``: what it draws, as JSON
  (:func:`~modeld.server.http.ui.answer.page_state`); ``GET /ui/events``: the same state as
  Server-Sent Events, sent when a record changes (at most every :data:`MIN_PUSH_SECONDS`) and at
  least every :data:`STATUS_SECONDS`; at most :data:`MAX_PAGE_STREAMS` at once (429 beyond).
* ``GET /v1/requests?job=&conversation=&since=&limit=&running=``: records, oldest first (the
  newest ``limit``; ``since`` a Unix time or a duration back from now: ``15m``); ``GET
  /v1/requests/{id}``: one record, running or done (poll it for a running request's status).

Access is the APIs' (an API key, loopback ``Host``, no foreign ``Origin``: ``Origin: null`` is
refused); with a key, ``/ui?token=KEY`` sets a cookie that opens these read-only routes to the
browser, then sends it to ``/ui`` without the key in its address. The page is sent with a
content security policy that lets it load only its own script and style and talk only to its
own origin.
"""

from __future__ import annotations

import asyncio
import hmac
import json
import math
import threading
import time
from collections.abc import AsyncIterator
from importlib import resources
from typing import Any

from starlette.requests import Request
from starlette.responses import JSONResponse, RedirectResponse, Response, StreamingResponse
from starlette.routing import Route

from modeld.observe.records import MAX_LABEL_CHARS, MAX_QUERY_RECORDS, RecordQuery
from modeld.observe.status import DaemonStatus
from modeld.server.http.access import UI_COOKIE
from modeld.server.http.app import HttpService
from modeld.server.http.errors import HttpError, openai_error
from modeld.server.http.runner import error_response
from modeld.server.http.ui.answer import (
    RECENT_RECORDS,
    page_state,
    page_text,
    records_part,
    status_part,
    waiting_turns,
)

__all__ = ["MAX_PAGE_STREAMS", "routes"]

MAX_PAGE_STREAMS = 16
"""Live pages open at once (each an SSE stream)."""
MIN_PUSH_SECONDS = 0.5
"""The most often a page is sent the state (a busy daemon changes records many times a second)."""
STATUS_SECONDS = 2.0
"""The least often: the models, tiers and memory move without a record changing."""
_QUERY_FIELDS = frozenset({"job", "conversation", "since", "limit", "running"})
_ASSETS = {"page.js": "text/javascript", "page.css": "text/css"}
_PAGE_HEADERS = {
    "Content-Security-Policy": "default-src 'none'; script-src 'self'; style-src 'self'; img-src 'self'; "
    "connect-src 'self'; base-uri 'none'; form-action 'none'; frame-ancestors 'none'",
    "X-Frame-Options": "DENY",
    "X-Content-Type-Options": "nosniff",
    "Referrer-Policy": "no-referrer",
    "Cache-Control": "no-store",
}
_DURATION_UNITS = {"s": 1.0, "m": 60.0, "h": 3600.0, "d": 86400.0}


def _asset(name: str) -> bytes:
    return resources.files(__package__).joinpath(name).read_bytes()


def _since(text: str, now: float) -> float:
    """``since``: a Unix time, or a duration back from now (``90s``, ``15m``, ``2h``, ``7d``)."""
    raw = text.strip()
    unit = raw[-1:].lower()
    try:
        value = now - float(raw[:-1]) * _DURATION_UNITS[unit] if unit in _DURATION_UNITS else float(raw)
    except ValueError:
        value = math.nan
    if not math.isfinite(value) or len(raw) > 32:
        raise HttpError(
            400,
            "since must be a Unix time or a duration back from now (90s, 15m, 2h, 7d)",
            code="invalid_value",
            param="since",
        )
    return value


def _label(params: dict[str, str], name: str) -> str:
    value = params.get(name, "")
    if len(value) > MAX_LABEL_CHARS or any(not ch.isprintable() for ch in value):
        raise HttpError(
            400, f"{name} is at most {MAX_LABEL_CHARS} printable characters", code="invalid_value", param=name
        )
    return value


def parse_query(params: dict[str, str], now: float) -> RecordQuery:
    """The listing's query parameters (an unknown one is refused by name)."""
    unknown = sorted(set(params) - _QUERY_FIELDS)
    if unknown:
        raise HttpError(
            400,
            f"unknown query parameter {unknown[0][:64]!r} (known: {', '.join(sorted(_QUERY_FIELDS))})",
            code="unsupported_parameter",
            param=unknown[0][:64],
        )
    limit_text = params.get("limit", "100")
    if not limit_text.isdigit() or not 1 <= int(limit_text) <= MAX_QUERY_RECORDS:
        raise HttpError(400, f"limit is 1 to {MAX_QUERY_RECORDS}", code="invalid_value", param="limit")
    running = params.get("running", "")
    if running not in ("", "0", "1", "true", "false"):
        raise HttpError(400, "running is 1 or 0", code="invalid_value", param="running")
    return RecordQuery(
        job=_label(params, "job"),
        conversation=_label(params, "conversation"),
        since=_since(params["since"], now) if params.get("since") else 0.0,
        limit=int(limit_text),
        running=running in ("1", "true"),
    )


class _Pushed:
    """The state last sent to the live pages, and its status part's age."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.status: DaemonStatus | None = None
        self.status_text = ""
        self.status_at = 0.0
        self.version = -1
        self.text = ""
        self.waiting: dict[str, int] = {}


def routes(service: HttpService) -> list[Route]:
    records = service.gateway.records
    streams = 0

    def keyed(request: Request) -> bool:
        token = request.query_params.get("token")
        key = service.access.api_key
        return bool(key) and token is not None and hmac.compare_digest(token.encode(), key.encode())

    def guard(handler: Any, *, token: bool = False) -> Any:
        """``handler`` behind the access checks (``token``: the key in ``?token=`` opens it too)."""

        async def run(request: Request) -> Response:
            denied = service.access.denied(request, cookie=True)
            if denied is not None and denied.status == 401 and token and keyed(request):
                denied = None
            if denied is not None:
                return error_response(denied, openai_error)
            try:
                response: Response = await handler(request)
                return response
            except HttpError as exc:
                return error_response(exc, openai_error)

        return run

    pushed = _Pushed()

    def pushed_text() -> str:
        """The state the live pages are sent: the status part rebuilt every STATUS_SECONDS, the
        records part when a record changed; one build for every page open."""
        with pushed.lock:
            now = time.monotonic()
            if pushed.status is None or now - pushed.status_at >= STATUS_SECONDS:
                pushed.status = service.gateway.status()
                pushed.status_text = json.dumps(
                    status_part(pushed.status, records, service.gateway.metrics), separators=(",", ":")
                )
                pushed.status_at, pushed.version = now, -1
            # Turns that may wait for a slot are asked about at every push (none in a quiet
            # daemon: a turn is a candidate only after half a second without progress).
            waiting = waiting_turns(records.running(), service.gateway.explain_context)
            if pushed.version != records.version or waiting != pushed.waiting:
                pushed.version, pushed.waiting = records.version, waiting
                pushed.text = page_text(
                    pushed.status_text,
                    records_part(pushed.status, records, waiting),
                    records.newest_json(RECENT_RECORDS),
                )
            return pushed.text

    async def page(request: Request) -> Response:
        if (
            "token" in request.query_params and service.access.api_key
        ):  # the key for the page's cookie, and out of the address
            if not keyed(request):
                raise HttpError(401, "the token is not the daemon's API key", code="invalid_api_key")
            response = RedirectResponse("/ui", status_code=303, headers=_PAGE_HEADERS)
            response.set_cookie(
                UI_COOKIE, service.access.ui_cookie(), httponly=True, samesite="strict", path="/"
            )
            return response
        return Response(_asset("page.html"), media_type="text/html; charset=utf-8", headers=_PAGE_HEADERS)

    async def asset(request: Request) -> Response:
        name = request.path_params["name"]
        if name not in _ASSETS:
            raise HttpError(404, "no such file", code="not_found")
        return Response(_asset(name), media_type=_ASSETS[name], headers=_PAGE_HEADERS)

    async def state_json(_request: Request) -> Response:
        def fresh() -> dict[str, Any]:
            gateway = service.gateway
            return page_state(gateway.status(), records, gateway.metrics, gateway.explain_context)

        return JSONResponse(
            await service.bridge.observe(fresh, "the live page"), headers={"Cache-Control": "no-store"}
        )

    async def events(_request: Request) -> Response:
        nonlocal streams
        if streams >= MAX_PAGE_STREAMS:
            raise HttpError(
                429,
                f"{MAX_PAGE_STREAMS} live pages are open already; close one",
                code="limit_exceeded",
                retry_after=5,
            )
        streams += 1

        async def push() -> AsyncIterator[bytes]:
            nonlocal streams
            loop = asyncio.get_running_loop()
            sent_version, sent_at, sent = -1, 0.0, ""
            try:
                while not service.drain.draining and not service.gateway.stopping:
                    now = loop.time()
                    # While turns run the page hears at every push whether one waits for a slot.
                    every = MIN_PUSH_SECONDS if records.running_count else STATUS_SECONDS
                    if records.version != sent_version or now - sent_at >= every:
                        sent_version, sent_at = records.version, now
                        data = await service.bridge.observe(pushed_text, "the live page")
                        if data is not sent:  # the same state is not sent twice
                            sent = data
                            yield f"event: state\ndata: {data}\n\n".encode()
                    await asyncio.sleep(MIN_PUSH_SECONDS)
            finally:
                streams -= 1

        return StreamingResponse(
            push(),
            media_type="text/event-stream",
            headers={"Cache-Control": "no-store", "X-Accel-Buffering": "no"},
        )

    async def listing(request: Request) -> Response:
        query = parse_query(dict(request.query_params), time.time())
        found = await service.bridge.observe(lambda: records.query(query), "request records")
        return JSONResponse(
            {"object": "list", "data": [r.to_json() for r in found], "file": records.stats()},
            headers={"Cache-Control": "no-store"},
        )

    async def one(request: Request) -> Response:
        rid = request.path_params["id"]
        if len(rid) > MAX_LABEL_CHARS:
            raise HttpError(400, "a request id is at most 256 characters", code="invalid_value", param="id")
        found = await service.bridge.observe(lambda: records.get(rid), "request records")
        if found is None:
            raise HttpError(404, "no request record with that id", code="not_found", param="id")
        return JSONResponse(found.to_json(), headers={"Cache-Control": "no-store"})

    return [
        Route("/ui", guard(page, token=True), methods=["GET"]),
        Route("/ui/state", guard(state_json), methods=["GET"]),
        Route("/ui/events", guard(events), methods=["GET"]),
        Route("/ui/{name:path}", guard(asset), methods=["GET"]),
        Route("/v1/requests", guard(listing), methods=["GET"]),
        Route("/v1/requests/{id}", guard(one), methods=["GET"]),
    ]
