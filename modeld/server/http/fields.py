"""Reading request fields, the same way for every API: typed, bounded, refused by name.

Every reader takes the body (a JSON object), a field name and its bounds, and returns the value
or None when the field is absent (or null); a wrong type or a value out of range is a 400 that
names the field (``param``). :func:`check_strings` refuses a lone surrogate anywhere in a body
(``json.loads`` accepts ``"\\ud800"``, which no UTF-8 encoder does), so nothing downstream ever
meets one. Bounds of a request's shape are explicit here (:data:`MAX_KEY_CHARS`, ...); the
operating limits a daemon is started with (messages, tools, stop strings, choices: the
:class:`~modeld.settings.Limits`, each a ``modeld serve`` flag) are checked with
:meth:`~modeld.settings.Limits.check` (``limit_exceeded`` naming the limit), and the engine's own
(text bytes, segments) apply after.
"""

from __future__ import annotations

import json
import math
import re
from collections.abc import Mapping
from typing import Any

from modeld.decoding.samplers import MAX_LOGIT_BIAS_ENTRIES
from modeld.errors import echo
from modeld.server.http.errors import HttpError, bad, unsupported
from modeld.settings import Limits

__all__ = [
    "MAX_KEY_CHARS",
    "MAX_TOOL_CALLS",
    "boolean",
    "check_body",
    "check_strings",
    "choice",
    "integer",
    "logit_bias",
    "model_name",
    "number",
    "obj",
    "refuse_unknown",
    "stop_list",
    "string",
]

MAX_KEY_CHARS = 256
"""Longest id-like string kept as given: conversation keys, call ids, tool and model names."""
MAX_TOOL_CALLS = 256
"""Tool calls in one assistant message."""
MAX_STOP_CHARS = 1024
MAX_DEPTH = 128
"""Nesting of a request body (JSON) at most."""


def model_name(body: Mapping[str, Any], *, code: str = "missing_required_parameter") -> str:
    """The ``model`` a request names (one of the names ``GET /v1/models`` lists): required; a
    name longer than any served one is a model that does not exist (404). ``code``: the error
    code of a missing name."""
    model = body.get("model")
    if not isinstance(model, str) or not model:
        raise bad("model", "model is required (one of the names GET /v1/models lists)", code=code)
    if len(model) > MAX_KEY_CHARS:
        raise HttpError(404, f"the model {echo(model)} does not exist", code="model_not_found", param="model")
    return model


_MAYBE_SURROGATE = re.compile(rb"\\u[dD][89a-fA-F]|\xed[\xa0-\xbf]")
"""Where a UTF-8 JSON text can hold a surrogate: an escape ``\\uD800``-``\\uDFFF`` (alone or in a
pair), or its three bytes written raw (``json.loads`` decodes bytes with ``surrogatepass``)."""


def check_body(body: Any, data: bytes) -> None:
    """:func:`check_strings` for a body parsed from ``data``. A UTF-8 text with no surrogate
    anywhere (no such escape, no such bytes: one scan at C speed) cannot hold a lone one, so
    only its nesting is walked: a coding agent's 80 KB body has thousands of strings, and
    checking each cost about 2 ms a request."""
    strings = json.detect_encoding(data) != "utf-8" or _MAYBE_SURROGATE.search(data) is not None
    check_strings(body, strings=strings)


def check_strings(value: Any, depth: int = 0, *, strings: bool = True) -> None:
    """Refuse a body that holds a lone surrogate (in a key or a value; checked when
    ``strings``) or nests too deep (a string counts as a level, checked or not)."""
    if depth > MAX_DEPTH:
        raise HttpError(400, f"the request body nests deeper than {MAX_DEPTH} levels", code="invalid_json")
    if isinstance(value, str):
        if strings:
            _encodable(value)
    elif isinstance(value, dict):
        for key, item in value.items():
            if strings:
                _encodable(key)
            if isinstance(item, dict | list) or (isinstance(item, str) and (strings or depth >= MAX_DEPTH)):
                check_strings(item, depth + 1, strings=strings)
    elif isinstance(value, list):
        for item in value:
            if isinstance(item, dict | list) or (isinstance(item, str) and (strings or depth >= MAX_DEPTH)):
                check_strings(item, depth + 1, strings=strings)


def _encodable(text: str) -> None:
    if text.isascii():
        return
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        raise HttpError(
            400,
            "the request body holds a lone surrogate (text that is not valid Unicode)",
            code="invalid_json",
        ) from None


def obj(body: Mapping[str, Any], name: str) -> Mapping[str, Any] | None:
    value = body.get(name)
    if value is None:
        return None
    if not isinstance(value, dict):
        raise bad(name, f"{name} must be an object")
    return value


def string(body: Mapping[str, Any], name: str, *, limit: int = MAX_KEY_CHARS, param: str = "") -> str | None:
    value = body.get(name)
    if value is None:
        return None
    where = param or name
    if not isinstance(value, str):
        raise bad(where, f"{where} must be a string, got {echo(value)}")
    if len(value) > limit:
        raise bad(where, f"{where} is {len(value)} characters; the limit is {limit}")
    return value


def boolean(body: Mapping[str, Any], name: str, *, param: str = "") -> bool | None:
    value = body.get(name)
    if value is None:
        return None
    if not isinstance(value, bool):
        raise bad(param or name, f"{param or name} must be a boolean, got {echo(value)}")
    return value


def choice(body: Mapping[str, Any], name: str, choices: tuple[str, ...], *, param: str = "") -> str | None:
    """A string that must be one of ``choices`` (None when absent)."""
    value = body.get(name)
    if value is None:
        return None
    where = param or name
    if not isinstance(value, str) or value not in choices:
        raise bad(where, f"{where} must be one of {', '.join(choices)}, got {echo(value)}")
    return value


def integer(body: Mapping[str, Any], name: str, lo: int, hi: int, *, param: str = "") -> int | None:
    value = body.get(name)
    if value is None:
        return None
    where = param or name
    if isinstance(value, bool) or not isinstance(value, int):
        if isinstance(value, float) and value.is_integer():
            value = int(value)
        else:
            raise bad(where, f"{where} must be an integer, got {echo(value)}")
    if not lo <= value <= hi:
        raise bad(where, f"{where} must be between {lo} and {hi}, got {value}")
    return int(value)


def number(body: Mapping[str, Any], name: str, lo: float, hi: float, *, param: str = "") -> float | None:
    value = body.get(name)
    if value is None:
        return None
    where = param or name
    if isinstance(value, bool) or not isinstance(value, int | float) or not math.isfinite(value):
        raise bad(where, f"{where} must be a number, got {echo(value)}")
    if not lo <= value <= hi:
        raise bad(where, f"{where} must be between {lo:g} and {hi:g}, got {value:g}")
    return float(value)


def stop_list(
    body: Mapping[str, Any], limits: Limits, name: str = "stop", *, param: str = ""
) -> tuple[str, ...]:
    """Stop strings: one string or an array, at most ``limits.max_stop_strings``."""
    value = body.get(name)
    where = param or name
    if value is None:
        return ()
    if isinstance(value, str):
        value = [value]
    if not isinstance(value, list) or not all(isinstance(s, str) for s in value):
        raise bad(where, f"{where} must be a string or an array of strings")
    limits.check("max_stop_strings", len(value), f"strings in {where}")
    if any(len(s) > MAX_STOP_CHARS for s in value):
        raise bad(where, f"a stop string is longer than {MAX_STOP_CHARS} characters")
    return tuple(s for s in value if s)


def logit_bias(body: Mapping[str, Any], name: str = "logit_bias", *, param: str = "") -> dict[int, float]:
    """OpenAI's ``{"token id": bias}`` (string keys, -100..100) as token id -> bias."""
    value = body.get(name)
    where = param or name
    if value is None:
        return {}
    if not isinstance(value, dict):
        raise bad(where, f"{where} must be an object mapping token ids to numbers")
    if len(value) > MAX_LOGIT_BIAS_ENTRIES:
        raise bad(where, f"{where} has {len(value)} entries; the limit is {MAX_LOGIT_BIAS_ENTRIES}")
    out: dict[int, float] = {}
    for key, bias in value.items():
        if not (isinstance(key, str) and key.isdigit() and len(key) <= 10):
            raise bad(where, f"{where} keys must be token ids, got {echo(key)}")
        if isinstance(bias, bool) or not isinstance(bias, int | float) or not -100 <= bias <= 100:
            raise bad(where, f"{where}[{key}] must be a number from -100 to 100, got {echo(bias)}")
        out[int(key)] = float(bias)
    return out


def refuse_unknown(body: Mapping[str, Any], known: set[str] | frozenset[str], where: str = "") -> None:
    """A 400 naming the first field that is not in ``known`` (and not null)."""
    for name, value in body.items():
        if name not in known and value is not None:
            path = f"{where}.{name}" if where else name
            raise unsupported(path, f"{echo(path)} is not supported by modeld")
