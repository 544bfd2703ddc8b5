"""Ollama's API on the same port, for editor integrations that speak it (Continue's and Zed's
Ollama providers, Open WebUI, JetBrains): ``GET /api/version``, ``GET /api/tags``, ``POST
/api/show``, ``GET /api/ps``, ``POST /api/chat``, ``POST /api/generate``.

The request as a Turn (here), the answers (``answer.py``: NDJSON by default, ``stream`` true, one
JSON object per line, the last with ``done: true``, ``done_reason`` and the counts and durations
(nanoseconds) Ollama reports), the routes (``routes.py``). Field by field
(``blueprints/0019-agent-apis.md``):

* ``model``: a name ``GET /api/tags`` lists; ``NAME:latest`` is the same model (Ollama's tag).
* ``messages`` (roles system, user, assistant, tool; an assistant's ``tool_calls`` with object
  arguments; a tool message's ``tool_call_id``; ``thinking`` accepted in history; ``images`` a
  named placeholder in an earlier message, refused by name in the newest), ``tools`` (OpenAI
  function definitions, as Ollama takes them), ``format`` (``"json"`` or a JSON schema: a
  constraint), ``think`` (a reasoning model's thinking is returned as ``message.thinking``;
  false drops it), ``options`` (``num_ctx``, ``num_predict``, ``temperature``, ``top_p``,
  ``top_k``, ``min_p``, ``seed``, ``stop``, ``repeat_penalty``, ``presence_penalty``,
  ``frequency_penalty``; any other option or field is ignored with a warning in the daemon's
  log, as Ollama does), ``keep_alive`` (a duration: the conversation's warm context moves out of
  the KV, to the RAM tier, after that long idle; the model stays loaded under the memory budget;
  ``0`` unloads the model once the answer is sent), ``truncate`` (default true: a prompt beyond
  the window loses its oldest messages, as Ollama does; false: an error).
* ``/api/generate``: ``prompt`` (with ``system``) is one user turn rendered with the model's
  template; ``raw: true`` evaluates it as given. An empty prompt only loads the model.
  ``context`` (the deprecated token array) and ``template`` are refused by name.
* ``/api/ps`` lists the loaded models with their warm contexts (``modeld.contexts``) and their
  size in memory: the weights, the KV the engine allocated (smaller with a ring of
  sliding-window cells, ``--no-swa-full``), checkpoints and compute, each in
  ``modeld.memory_bytes`` (``kv_used`` too: the cells warm contexts hold, part of the KV); and
  ``/api/show`` the model's window: ``model_info["<arch>.context_length"]`` as loaded here,
  and ``parameters`` with ``num_ctx``.
"""

from __future__ import annotations

import json
import logging
import re
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from modeld.contract import DecodeConfig, ToolCall
from modeld.errors import echo
from modeld.server.http.chat_template import template_args
from modeld.server.http.dialect import Asked
from modeld.server.http.errors import HttpError, bad, unsupported
from modeld.server.http.fields import MAX_KEY_CHARS, boolean, integer, obj, refuse_unknown, stop_list
from modeld.server.http.requests import (
    Media,
    SamplerField,
    SamplerMap,
    conversation_keys,
    ident_field,
    response_format,
    samplers,
)
from modeld.server.http.turn import Message, Turn
from modeld.settings import Limits

__all__ = [
    "SAMPLERS",
    "UNLOAD",
    "OllamaAsked",
    "ignored",
    "keep_alive",
    "model_of",
    "parse_chat",
    "parse_generate",
]

log = logging.getLogger("modeld.http")


@dataclass(frozen=True, kw_only=True)
class OllamaAsked(Asked):
    """An ``/api/chat`` or ``/api/generate`` request: its turn (and ``keep_alive``), whether
    thinking is shown, when the request began (Ollama's durations), and which of the two."""

    think: bool = True
    began: float = 0.0
    chat: bool = True


SAMPLERS: SamplerMap = {
    "temperature": SamplerField("temperature", high=2.0),
    "top_p": SamplerField("top_p", unset=0.0),
    "min_p": SamplerField("min_p"),
    "repeat_penalty": SamplerField("repeat_penalty"),
    "presence_penalty": SamplerField("presence_penalty"),
    "frequency_penalty": SamplerField("frequency_penalty"),
    "top_k": SamplerField("top_k"),
    "seed": SamplerField("seed", unset=-1),
}
"""Ollama's sampler ``options`` (a ``top_p`` of 0 and a seed of -1 are unset)."""

_OPTIONS = frozenset(
    {
        "num_ctx",
        "num_predict",
        "temperature",
        "top_p",
        "top_k",
        "min_p",
        "seed",
        "stop",
        "repeat_penalty",
        "presence_penalty",
        "frequency_penalty",
        # accepted, no effect here: how Ollama's runner schedules, not what it computes
        "num_thread",
        "num_batch",
        "num_gpu",
        "main_gpu",
        "use_mmap",
        "num_keep",
    }
)
_CHAT_FIELDS = frozenset(
    {"model", "messages", "tools", "format", "options", "stream", "keep_alive", "think", "truncate", "shift"}
)
_GENERATE_FIELDS = frozenset(
    {
        "model",
        "prompt",
        "system",
        "raw",
        "format",
        "options",
        "stream",
        "keep_alive",
        "think",
        "suffix",
        "images",
        "context",
        "template",
        "truncate",
        "shift",
    }
)
_DURATION = re.compile(r"^(-?\d+(?:\.\d+)?)(ns|us|µs|ms|s|m|h)?$")
_UNIT = {"ns": 1e-9, "us": 1e-6, "µs": 1e-6, "ms": 1e-3, "s": 1.0, "m": 60.0, "h": 3600.0, None: 1.0}


def model_of(body: Mapping[str, Any]) -> str:
    model = body.get("model")
    if not isinstance(model, str) or not model:
        raise bad("model", "model is required")
    if len(model) > MAX_KEY_CHARS:
        raise HttpError(404, f"model {echo(model)} not found", code="model_not_found")
    return model.removesuffix(":latest")


UNLOAD = -1.0
"""``keep_alive: 0``: unload the model once the request is answered (Ollama's way)."""


def keep_alive(value: Any) -> float | None:
    """Ollama's ``keep_alive`` (seconds, or a duration such as ``5m``) in seconds; None: unset.
    A negative value means "keep it" (0 to modeld: no idle limit); 0 is :data:`UNLOAD`."""
    if value is None:
        return None
    if isinstance(value, bool):
        raise bad("keep_alive", "keep_alive must be a number of seconds or a duration such as '5m'")
    if isinstance(value, int | float):
        seconds = float(value)
    elif isinstance(value, str) and (m := _DURATION.match(value.strip())):
        seconds = float(m.group(1)) * _UNIT[m.group(2)]
    else:
        raise bad(
            "keep_alive",
            f"keep_alive must be a number of seconds or a duration such as '5m', got {echo(value)}",
        )
    if seconds == 0:
        return UNLOAD
    return 0.0 if seconds < 0 else min(seconds, 365 * 24 * 3600.0)


def ignored(fields: Mapping[str, Any], known: frozenset[str], where: str) -> list[str]:
    """The fields of ``fields`` this endpoint does not know: ignored with a warning in the
    daemon's log, as Ollama does ("invalid option provided"), never a 400."""
    unknown = sorted(k for k in fields if k not in known)
    if unknown:
        log.warning("ollama: ignored unknown %s: %s", where, ", ".join(echo(k) for k in unknown[:16]))
    return unknown


def _decode(body: Mapping[str, Any], tools: bool, limits: Limits) -> tuple[DecodeConfig, int | None, int]:
    """(the decode config, num_predict, num_ctx) from ``options`` and ``format``."""
    options = obj(body, "options") or {}
    ignored(options, _OPTIONS, "options")
    values: dict[str, Any] = samplers(options, SAMPLERS, where="options")
    predict = integer(options, "num_predict", -2, 1 << 30, param="options.num_predict")
    num_ctx = integer(options, "num_ctx", 1, 1 << 24, param="options.num_ctx") or 0
    fmt = body.get("format")
    if fmt in (None, ""):
        constraint = None
    elif fmt == "json":
        constraint = response_format({"type": "json_object"}, "format")
    elif isinstance(fmt, dict):
        constraint = response_format({"type": "json_object", "schema": fmt}, "format")
    else:
        raise bad("format", f'format must be "json" or a JSON schema object, got {echo(fmt)}')
    if constraint is not None and tools:
        values["tool_choice"] = "none"  # a schema answers; tools would compete with it
    config = DecodeConfig(
        stop=stop_list(options, limits, "stop", param="options.stop"), constraint=constraint, **values
    )
    return config, (None if predict is None or predict < 0 else predict), num_ctx


def _images(message: Mapping[str, Any], where: str) -> None:
    if message.get("images"):
        raise unsupported(f"{where}.images", f"{where}.images: the models modeld serves read text only")


def _history_images(message: Mapping[str, Any], where: str, media: Media) -> str:
    """A message's ``images`` as named placeholders (refused in the newest turn: ``Media``)."""
    images = message.get("images")
    if not images:
        return ""
    if not isinstance(images, list):
        raise bad(f"{where}.images", f"{where}.images must be an array of images")
    return "".join("\n" + media.omit(f"{where}.images[{j}]", "image") for j in range(len(images)))


def _messages(body: Mapping[str, Any], limits: Limits, media: Media) -> list[Message]:
    messages = body.get("messages")
    if not isinstance(messages, list):
        raise bad("messages", "messages must be an array")
    limits.check("max_messages", len(messages), "messages")
    out: list[Message] = []
    pending: list[str] = []  # the last assistant's call ids its results have not named yet
    numbered = 0
    for i, message in enumerate(messages):
        where = f"messages[{i}]"
        if not isinstance(message, dict):
            raise bad(where, f"{where} must be an object")
        refuse_unknown(
            message,
            frozenset(
                {"role", "content", "images", "tool_calls", "thinking", "tool_name", "name", "tool_call_id"}
            ),
            where,
        )
        role = message.get("role")
        if role not in ("system", "user", "assistant", "tool"):
            raise bad(
                f"{where}.role", f"{where}.role must be system, user, assistant or tool, got {echo(role)}"
            )
        content = message.get("content") or ""
        thinking = message.get("thinking") or ""
        if not isinstance(content, str) or not isinstance(thinking, str):
            raise bad(f"{where}.content", f"{where}.content must be a string")
        content += _history_images(message, where, media)
        calls: list[ToolCall] = []
        for j, call in enumerate(message.get("tool_calls") or []):
            at = f"{where}.tool_calls[{j}]"
            function = call.get("function") if isinstance(call, dict) else None
            name = function.get("name") if isinstance(function, dict) else None
            arguments = function.get("arguments", {}) if isinstance(function, dict) else None
            if (
                role != "assistant"
                or not isinstance(name, str)
                or not name
                or len(name) > 256
                or not isinstance(arguments, dict)
            ):
                raise bad(
                    at,
                    f'{at} must be {{"function": {{"name": ..., "arguments": {{...}}}}}} on an assistant message',
                )
            call_id = call.get("id") if isinstance(call.get("id"), str) else ""
            numbered += 1
            # Ollama's calls carry no id: number them in order (9 characters: templates such as
            # Mistral's want that), so their results can name them and every turn renders alike.
            calls.append(
                ToolCall(
                    call_id[:MAX_KEY_CHARS] or f"call{numbered:05d}",
                    name,
                    json.dumps(arguments, ensure_ascii=False),
                )
            )
        ids = {k: ident_field(message, k, where) for k in ("tool_call_id", "tool_name", "name")}
        if calls:
            pending = [c.id for c in calls]
        answered = ""
        if role == "tool":  # a result answers the call it names, else the next one in order
            answered = ids["tool_call_id"] or (pending[0] if pending else "")
            if answered in pending:
                pending.remove(answered)
        out.append(
            Message(
                role,
                content,
                tuple(calls),
                thinking,
                tool_call_id=answered,
                name=ids["tool_name"] or ids["name"] or "",
            )
        )
    return out


def _tools(body: Mapping[str, Any], limits: Limits) -> str:
    tools = body.get("tools")
    if tools is None or tools == []:
        return ""
    if not isinstance(tools, list) or not all(isinstance(t, dict) for t in tools):
        raise bad("tools", "tools must be an array of tool objects")
    limits.check("max_tools", len(tools), "tools")
    return json.dumps(tools, ensure_ascii=False)


def _think_args(body: Mapping[str, Any]) -> tuple[tuple[str, object], ...]:
    """``think`` as the template's: a boolean is ``enable_thinking``, a level (gpt-oss) is
    ``reasoning_effort``; absent leaves the template's default (checked by :func:`_think`)."""
    think = body.get("think")
    if isinstance(think, bool):
        return template_args(enable_thinking=think)
    if think in ("low", "medium", "high"):
        return template_args(reasoning_effort=think, effort_field="think")
    return ()


def _think(body: Mapping[str, Any]) -> bool:
    think = body.get("think")
    if think is None or isinstance(think, bool):
        return think is not False
    if think in ("low", "medium", "high"):
        return True
    raise bad("think", f'think must be a boolean or "low", "medium", "high", got {echo(think)}')


def parse_chat(
    body: Mapping[str, Any], headers: Mapping[str, str], limits: Limits, began: float
) -> OllamaAsked:
    """An ``/api/chat`` body as its turn, whether to show thinking, and keep_alive (``began``:
    when the request began, for Ollama's durations)."""
    ignored(body, _CHAT_FIELDS, "fields")
    model = model_of(body)
    tools_json = _tools(body, limits)
    decode, predict, num_ctx = _decode(body, bool(tools_json), limits)
    media = Media()
    messages = _messages(body, limits, media)
    omitted = media.settle(len(body["messages"]))
    stream = boolean(body, "stream")
    turn = Turn(
        api="ollama.chat",
        model=model,
        decode=decode,
        keys=conversation_keys(headers),
        stream=stream is not False,
        messages=tuple(messages),
        tools_json=tools_json,
        max_tokens=predict,
        num_ctx=num_ctx,
        template_args=_think_args(body),
        truncate=boolean(body, "truncate") is not False,
        omitted_content=omitted,
    )
    alive = keep_alive(body.get("keep_alive"))
    return OllamaAsked(turn, alive, think=_think(body), began=began, chat=True, unload=alive == UNLOAD)


def parse_generate(
    body: Mapping[str, Any], headers: Mapping[str, str], limits: Limits, began: float
) -> OllamaAsked:
    """An ``/api/generate`` body as a Turn (``raw``: the prompt as given)."""
    ignored(body, _GENERATE_FIELDS, "fields")
    for name in ("context", "template", "suffix"):
        if body.get(name):
            raise unsupported(
                name,
                f"{name} is not supported by modeld (send the whole prompt; raw: true evaluates it as given)",
            )
    _images(body, "request")
    model = model_of(body)
    decode, predict, num_ctx = _decode(body, False, limits)
    prompt = body.get("prompt") or ""
    system = body.get("system") or ""
    if not isinstance(prompt, str) or not isinstance(system, str):
        raise bad("prompt", "prompt and system must be strings")
    raw = boolean(body, "raw") or False
    keys = conversation_keys(headers)
    common: dict[str, Any] = {
        "model": model,
        "decode": decode,
        "keys": keys,
        "stream": boolean(body, "stream") is not False,
        "max_tokens": predict,
        "num_ctx": num_ctx,
        "truncate": boolean(body, "truncate") is not False,
    }
    if raw:
        turn = Turn(api="ollama.generate", prompt=system + prompt, **common)
    else:
        messages = ([Message("system", system)] if system else []) + [Message("user", prompt)]
        turn = Turn(api="ollama.generate", messages=tuple(messages), **common)
    alive = keep_alive(body.get("keep_alive"))
    return OllamaAsked(turn, alive, think=_think(body), began=began, chat=False, unload=alive == UNLOAD)
