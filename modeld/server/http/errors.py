"""HTTP errors, API-neutral: one status table for every API, each API its own error words.

:class:`HttpError` is what a request handler raises or answers with: the HTTP status, a message
for people, the parameter at fault and a stable code. Contract errors become one through
:func:`from_modeld`, whose status comes from the one error table
(:attr:`modeld.errors.ModeldError.http_status`, the ``google.rpc`` mapping): so
``no_slot_available`` is 429 with ``Retry-After``, ``engine_restarted`` 503, ``timeout`` 504,
on every API alike. An API only decides how the error is written (:class:`ErrorStyle`: OpenAI's
``{"error": {"message", "type", "param", "code"}}``, Anthropic's ``{"type": "error", "error":
{"type", "message"}}``, Ollama's ``{"error": "..."}``). OpenAI's (:func:`openai_error`) is here,
not in an API's folder: it is every OpenAI-compatible server's (llama-server, vLLM, SGLang), so
chat completions, the Responses API, the SGLang gateway's worker routes, ``/metrics`` and a route
that does not exist all write it.

Server-side failures (5xx) keep their reason and an incident id, never the message: it may name
paths the HTTP endpoint never shows. The daemon logs the message under the incident id.
"""

from __future__ import annotations

import logging
import uuid
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Protocol

from modeld.errors import ContextOverflowError, ModeldError

__all__ = [
    "WindowExceededError",
    "ErrorStyle",
    "HttpError",
    "bad",
    "from_modeld",
    "incident_id",
    "openai_error",
    "overflow",
    "unsupported",
]

log = logging.getLogger("modeld.http")


def incident_id() -> str:
    return uuid.uuid4().hex[:12]


@dataclass
class HttpError(Exception):
    """An error answer. ``code``: a stable token (a contract reason, or the API's own such as
    ``model_not_found``); ``param``: the request field at fault, when one is."""

    status: int
    message: str
    code: str = "invalid_value"
    param: str | None = None
    retry_after: int | None = None

    def __str__(self) -> str:
        return self.message

    def headers(self) -> dict[str, str]:
        out: dict[str, str] = {}
        if self.retry_after is not None:
            out["Retry-After"] = str(self.retry_after)
        if self.status == 401:
            out["WWW-Authenticate"] = "Bearer"
        return out


@dataclass
class WindowExceededError(HttpError):
    """The prompt does not fit the window (``prompt_tokens`` of a ``window``-token window, with
    the one token the answer needs). Every API words it as its clients recover from it
    (Anthropic's ``prompt is too long: N tokens > M maximum``, which Claude Code parses to
    compact; OpenAI's ``context_length_exceeded``; Ollama's own words); the Responses API sends
    it inside the stream, where Codex looks for it."""

    prompt_tokens: int = 0
    window: int = 0


def overflow(prompt_tokens: int, window: int) -> WindowExceededError:
    """The 400 for a prompt of ``prompt_tokens`` that does not fit a ``window``-token window."""
    return WindowExceededError(
        400,
        f"the prompt is {prompt_tokens} tokens and the model's window is {window} tokens "
        "(one is needed for the answer): shorten the conversation",
        code="context_length_exceeded",
        param="messages",
        prompt_tokens=prompt_tokens,
        window=window,
    )


def bad(param: str, message: str, code: str = "invalid_value") -> HttpError:
    """A 400 naming the field at fault."""
    return HttpError(400, message, code=code, param=param)


def unsupported(param: str, message: str) -> HttpError:
    """A 400 for a field modeld cannot honour (refused by name, never ignored)."""
    return HttpError(400, message, code="unsupported_parameter", param=param)


_CODES = {
    "context_overflow": "context_length_exceeded",
    "unsupported": "unsupported_parameter",
    "invalid_argument": "invalid_value",
}
_PARAMS = {
    "constraint": "response_format",
    "constraint.kind": "response_format",
    "constraint.value": "response_format",
    "tools_json": "tools",
}
"""Contract fields as the requests name them (a schema error is the response format's)."""


def from_modeld(exc: ModeldError, incident: str) -> HttpError:
    """The HTTP error for a contract error (status and Retry-After from the one table)."""
    status = exc.http_status
    if status >= 500 and exc.reason not in ("busy", "shutting_down", "no_slot_available"):
        message = (
            f"modeld could not serve this request ({exc.reason}; incident {incident}, see the daemon's log)"
        )
        log.error("request failed (incident %s): %s [%s]", incident, exc.message, exc.reason)
    else:
        message = exc.message
    if isinstance(exc, ContextOverflowError):
        return overflow(exc.resident + exc.additional, exc.window)
    field = exc.details.get("field")
    param = _PARAMS.get(field, field) if field else exc.details.get("limit") or None
    if status < 500:
        message += _position(exc.details, message)
    return HttpError(
        status, message, code=_CODES.get(exc.reason, exc.reason), param=param, retry_after=exc.retry_after
    )


def _position(details: Mapping[str, str], message: str) -> str:
    """Where a schema, regex or grammar error is (the error's details), if the message does not
    say it already."""
    if "line" in details and f"line {details['line']}" in message:
        return ""
    for key in ("pointer", "offset"):
        value = details.get(key)
        if value and value not in message:
            return f" ({key} {value})"
    return ""


class ErrorStyle(Protocol):
    """How one API writes an error body."""

    def __call__(self, error: HttpError) -> dict[str, Any]: ...


def openai_error(error: HttpError) -> dict[str, Any]:
    """OpenAI's error body: ``{"error": {"message", "type", "param", "code"}}``."""
    kind = "invalid_request_error" if error.status < 500 else "server_error"
    if error.status == 429:
        kind = "rate_limit_error"
    if error.status == 401:
        kind = "authentication_error"
    message = error.message
    if isinstance(error, WindowExceededError):  # OpenAI's own words for it
        message = (
            f"This model's maximum context length is {error.window} tokens. However, your messages "
            f"resulted in {error.prompt_tokens} tokens. Please reduce the length of the messages."
        )
    return {"error": {"message": message, "type": kind, "param": error.param, "code": error.code}}
