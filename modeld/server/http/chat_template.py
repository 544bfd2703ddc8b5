"""The model's chat template as the HTTP APIs see it: what a request asks of it (thinking on or
off, a reasoning effort, any template variables: :func:`template_args`), the same way for every
API, and what every API says about it (:func:`template_meta`).

Each API names these in its own words; all become ``Turn.template_args`` (the variables the
template is rendered with, blueprint 0010):

* OpenAI chat: ``chat_template_kwargs`` (an object, as vLLM and llama-server take it) and
  ``reasoning_effort`` (``"none"`` turns thinking off: ``enable_thinking`` false, as
  llama-server does; another value is passed as ``reasoning_effort``);
* OpenAI Responses: ``reasoning.effort`` (the same words);
* Anthropic Messages: ``thinking.type`` ``disabled`` -> ``enable_thinking`` false; ``enabled``
  or ``adaptive`` -> true;
* Ollama: ``think`` false/true -> ``enable_thinking``; ``"low"``/``"medium"``/``"high"``
  (gpt-oss) -> ``reasoning_effort``.

Without any of these the template renders with the variables llama-server gives every template
(``enable_thinking`` true, today's ``date_string``: ``modeld/engine/chat.py``), so a prompt is
the one llama-server would evaluate. Thinking off reaches the template, so a template that
supports it opens no thinking block and the turn spends no tokens on it.

Limits (blueprint 0006): at most :data:`MAX_TEMPLATE_ARGS` variables, names of at most
:data:`MAX_NAME_CHARS` characters, the whole at most :data:`MAX_TEMPLATE_ARGS_BYTES` of JSON;
the variables modeld sets itself (``messages``, ``tools``, ``add_generation_prompt``,
``bos_token``, ``eos_token``) cannot be given.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from typing import Any

from modeld.contract import ModelInfo
from modeld.errors import echo
from modeld.server.http.errors import bad

__all__ = [
    "EFFORTS",
    "MAX_NAME_CHARS",
    "MAX_TEMPLATE_ARGS",
    "MAX_TEMPLATE_ARGS_BYTES",
    "RESERVED",
    "template_args",
    "template_meta",
]

MAX_TEMPLATE_ARGS = 64
MAX_NAME_CHARS = 128
MAX_TEMPLATE_ARGS_BYTES = 65536
RESERVED = frozenset({"messages", "tools", "add_generation_prompt", "bos_token", "eos_token"})
EFFORTS = ("none", "minimal", "low", "medium", "high")

Args = tuple[tuple[str, object], ...]


def template_args(
    kwargs: object = None,
    *,
    where: str = "chat_template_kwargs",
    enable_thinking: bool | None = None,
    reasoning_effort: str | None = None,
    effort_field: str = "reasoning_effort",
) -> Args:
    """The template variables of a request: ``kwargs`` (checked), then ``enable_thinking`` and
    ``reasoning_effort`` over them ("none" is thinking off)."""
    out: dict[str, Any] = {}
    if kwargs is not None:
        if not isinstance(kwargs, Mapping):
            raise bad(where, f"{where} must be an object of template variables")
        if len(kwargs) > MAX_TEMPLATE_ARGS:
            raise bad(where, f"{where} has {len(kwargs)} variables; the limit is {MAX_TEMPLATE_ARGS}")
        for name, value in kwargs.items():
            if not isinstance(name, str) or not name or len(name) > MAX_NAME_CHARS:
                raise bad(where, f"{where} names must be strings of 1 to {MAX_NAME_CHARS} characters")
            if name in RESERVED:
                raise bad(f"{where}.{name}", f"{where}.{name} is set by modeld and cannot be given")
            out[name] = value
        size = len(json.dumps(out, ensure_ascii=False).encode("utf-8"))
        if size > MAX_TEMPLATE_ARGS_BYTES:
            raise bad(where, f"{where} is {size} bytes of JSON; the limit is {MAX_TEMPLATE_ARGS_BYTES}")
        thinking = out.get("enable_thinking")
        if thinking is not None and not isinstance(thinking, bool):
            raise bad(
                f"{where}.enable_thinking", f"{where}.enable_thinking must be a boolean, got {echo(thinking)}"
            )
    if reasoning_effort is not None:
        if reasoning_effort not in EFFORTS:
            raise bad(
                effort_field,
                f"{effort_field} must be one of {', '.join(EFFORTS)}, got {echo(reasoning_effort)}",
            )
        if reasoning_effort == "none":
            out["enable_thinking"] = False
            out.pop("reasoning_effort", None)
        else:
            out["reasoning_effort"] = reasoning_effort
    if enable_thinking is not None:
        out["enable_thinking"] = enable_thinking
    return tuple(sorted(out.items()))


def template_meta(info: ModelInfo) -> dict[str, str]:
    """Which chat template a model renders with (``GET /v1/models``, ``/api/show``): ``source``
    (``model``: its file's; ``override``: ``--chat-template-file`` or the session's), its
    digest, and the tool-call and reasoning formats read from it ("" when none is recognised)."""
    return {
        "source": info.template_source,
        "digest": info.template_digest,
        "tool_format": info.tool_format,
        "reasoning_format": info.reasoning_format,
    }
