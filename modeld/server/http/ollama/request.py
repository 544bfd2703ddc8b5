"""Ollama's API on the same port, for editor integrations that speak it (Continue's and Zed's
Ollama providers, Open WebUI, JetBrains): ``GET /api/version``, ``GET /api/tags``, ``POST
/api/show``, ``GET /api/ps``, ``POST /api/chat``, ``POST /api/generate``.

The request as a Turn (here), the answers (``answer.py``: NDJSON by default, ``stream`` true, one
JSON object per line, the last with ``done: true``, ``done_reason`` and the counts and durations
(nanoseconds) Ollama reports), the routes (``routes.py``). Field by field
(``blueprints/0019-agent-apis.md``):

* ``model``: a name ``GET /api/tags`` lists; ``NAME:latest`` is the same model (Ollama's tag).
* ``messages`` (roles system, user, assistant, tool; an assistant's ``tool_calls`` with object
  arguments; ``thinking`` accepted in history; ``images`` refused by name), ``tools`` (OpenAI
  function definitions, as Ollama takes them), ``format`` (``"json"`` or a JSON schema: a
  constraint), ``think`` (a reasoning model's thinking is returned as ``message.thinking``;
  false drops it), ``options`` (``num_ctx``, ``num_predict``, ``temperature``, ``top_p``,
  ``top_k``, ``min_p``, ``seed``, ``stop``, ``repeat_penalty``, ``presence_penalty``,
  ``frequency_penalty``; others refused by name), ``keep_alive`` (a duration: the
  conversation's warm context moves out of the KV, to the RAM tier, after that long idle; the
  model stays loaded under the memory budget).
* ``/api/generate``: ``prompt`` (with ``system``) is one user turn rendered with the model's
  template; ``raw: true`` evaluates it as given. An empty prompt only loads the model.
  ``context`` (the deprecated token array) and ``template`` are refused by name.
* ``/api/ps`` lists the loaded models with their warm contexts (``modeld.contexts``), and
  ``/api/show`` the model's window: ``model_info["<arch>.context_length"]`` as loaded here,
  and ``parameters`` with ``num_ctx``.
"""

from __future__ import annotations

import json
import re
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from modeld.contract import DecodeConfig, ToolCall
from modeld.errors import echo
from modeld.server.http.dialect import Asked
from modeld.server.http.errors import HttpError, bad, unsupported
from modeld.server.http.fields import MAX_KEY_CHARS, boolean, integer, obj, refuse_unknown, stop_list
from modeld.server.http.requests import SamplerField, SamplerMap, conversation_keys, response_format, samplers
from modeld.server.http.turn import Message, Turn
from modeld.settings import Limits

__all__ = ["SAMPLERS", "OllamaAsked", "keep_alive", "model_of", "parse_chat", "parse_generate"]


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
_CHAT_FIELDS = frozenset({"model", "messages", "tools", "format", "options", "stream", "keep_alive", "think"})
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


def keep_alive(value: Any) -> float | None:
    """Ollama's ``keep_alive`` (seconds, or a duration such as ``5m``) in seconds; None: unset.
    A negative value means "keep it" (0 to modeld: no idle limit)."""
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
    return 0.0 if seconds < 0 else min(seconds, 365 * 24 * 3600.0)


def _decode(body: Mapping[str, Any], tools: bool, limits: Limits) -> tuple[DecodeConfig, int | None, int]:
    """(the decode config, num_predict, num_ctx) from ``options`` and ``format``."""
    options = obj(body, "options") or {}
    refuse_unknown(options, _OPTIONS, "options")
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


def _messages(body: Mapping[str, Any], limits: Limits) -> list[Message]:
    messages = body.get("messages")
    if not isinstance(messages, list):
        raise bad("messages", "messages must be an array")
    limits.check("max_messages", len(messages), "messages")
    out: list[Message] = []
    for i, message in enumerate(messages):
        where = f"messages[{i}]"
        if not isinstance(message, dict):
            raise bad(where, f"{where} must be an object")
        refuse_unknown(
            message,
            frozenset({"role", "content", "images", "tool_calls", "thinking", "tool_name", "name"}),
            where,
        )
        role = message.get("role")
        if role not in ("system", "user", "assistant", "tool"):
            raise bad(
                f"{where}.role", f"{where}.role must be system, user, assistant or tool, got {echo(role)}"
            )
        _images(message, where)
        content = message.get("content") or ""
        thinking = message.get("thinking") or ""
        if not isinstance(content, str) or not isinstance(thinking, str):
            raise bad(f"{where}.content", f"{where}.content must be a string")
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
            calls.append(ToolCall(call_id[:256], name, json.dumps(arguments, ensure_ascii=False)))
        out.append(Message(role, content, tuple(calls), thinking))
    return out


def _tools(body: Mapping[str, Any], limits: Limits) -> str:
    tools = body.get("tools")
    if tools is None or tools == []:
        return ""
    if not isinstance(tools, list) or not all(isinstance(t, dict) for t in tools):
        raise bad("tools", "tools must be an array of tool objects")
    limits.check("max_tools", len(tools), "tools")
    return json.dumps(tools, ensure_ascii=False)


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
    """An ``/api/chat`` body as a Turn, whether to show thinking, and keep_alive."""
    refuse_unknown(body, _CHAT_FIELDS)
    model = model_of(body)
    tools_json = _tools(body, limits)
    decode, predict, num_ctx = _decode(body, bool(tools_json), limits)
    messages = _messages(body, limits)
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
    )
    alive = keep_alive(body.get("keep_alive"))
    return OllamaAsked(turn, alive, think=_think(body), began=began, chat=True)


def parse_generate(
    body: Mapping[str, Any], headers: Mapping[str, str], limits: Limits, began: float
) -> OllamaAsked:
    """An ``/api/generate`` body as a Turn (``raw``: the prompt as given)."""
    refuse_unknown(body, _GENERATE_FIELDS)
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
    }
    if raw:
        turn = Turn(api="ollama.generate", prompt=system + prompt, **common)
    else:
        messages = ([Message("system", system)] if system else []) + [Message("user", prompt)]
        turn = Turn(api="ollama.generate", messages=tuple(messages), **common)
    alive = keep_alive(body.get("keep_alive"))
    return OllamaAsked(turn, alive, think=_think(body), began=began, chat=False)
