"""OpenAI chat completions and completions: the request as a Turn (the answers are shaped in
:mod:`modeld.server.http.openai_answers`).

Rules (``blueprints/0014-openai-http.md``; the field table is in ``blueprints/0019-agent-apis.md``):

* Every field is accounted for. Mapped fields are honoured; fields OpenAI defines that modeld
  cannot honour are refused by name with a 400 (audio, ``n`` above 8, ...); fields that
  describe the hosted service are accepted and have no effect (``store``, ``service_tier``,
  ``metadata``, ...). The SGLang gateway's injected fields are accepted at their defaults
  (:data:`SGLANG_FIELDS`).
* Unknown scalar fields are extensions: ``top_k``, ``min_p``, ``repeat_penalty`` are samplers;
  any other scalar goes to ``DecodeConfig.extra``, which the backend accepts or refuses by name.
* ``response_format`` ``json_object`` (with llama-server's ``schema`` key honoured) and
  ``json_schema`` become a constraint; ``tool_choice`` ``required`` or a named function forces a
  well-formed call. Calls are parsed out of the output into ``tool_calls``; a reasoning model's
  thinking is ``reasoning_content``.
* Omitted ``temperature`` means greedy (modeld's default, not OpenAI's 1); omitted
  ``max_tokens`` means up to the context window for chat and 16 for completions (OpenAI's).
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from typing import Any

from modeld.contract import Constraint, DecodeConfig, ToolCall
from modeld.decoding.speculation import SPECULATION_MODES
from modeld.errors import echo
from modeld.server.http.chat_template import template_args
from modeld.server.http.errors import HttpError, bad, unsupported
from modeld.server.http.fields import (
    MAX_TOOL_CALLS,
    boolean,
    choice,
    integer,
    logit_bias,
    model_name,
    number,
    stop_list,
)
from modeld.server.http.turn import Keys, Message, Turn, key_value
from modeld.settings import Limits

__all__ = [
    "SGLANG_FIELDS",
    "checked_call",
    "openai_error",
    "parse_chat",
    "parse_completion",
    "response_format",
    "tool_choice",
]

MAX_TOP_LOGPROBS = 20
ROLE_OF = {
    "system": "system",
    "developer": "system",
    "user": "user",
    "assistant": "assistant",
    "tool": "tool",
}

SGLANG_FIELDS: Mapping[str, object] = {
    "no_stop_trim": False,
    "ignore_eos": False,
    "continue_final_message": False,
    "skip_special_tokens": True,
    "separate_reasoning": True,
    "stream_reasoning": True,
    "return_hidden_states": False,
}
"""Fields SGLang's gateways (sglang-router, vllm-router) add to every chat request, at these
values. Accepted at these values (what modeld does anyway); any other value is refused by name."""

# Fields of OpenAI's API that describe its hosted service: accepted with these values, no effect.
_NO_EFFECT: dict[str, tuple[object, ...]] = {
    "store": (),  # any value: modeld stores no chat completions
    "service_tier": (None, "auto", "default", "flex"),
    "safety_identifier": (),
    "metadata": (),
    "cache_prompt": (None, True),  # llama-server's switch: reuse is always on here
}
# Fields OpenAI defines that modeld cannot honour unless they have these (neutral) values.
_NEUTRAL: dict[str, tuple[object, ...]] = {
    "modalities": (None, ["text"]),
    "audio": (None,),
    "prediction": (None,),
    "reasoning_effort": (None, "minimal", "low", "medium", "high", "none"),
    "verbosity": (None,),
    "web_search_options": (None,),
    "functions": (None,),
    "function_call": (None,),
    "best_of": (None, 1),
    "echo": (None, False),
    "suffix": (None, ""),
}
_CHAT_MAPPED = {
    "model",
    "chat_template_kwargs",
    "messages",
    "stream",
    "stream_options",
    "tools",
    "tool_choice",
    "parallel_tool_calls",
    "stop",
    "max_tokens",
    "max_completion_tokens",
    "temperature",
    "top_p",
    "seed",
    "response_format",
    "user",
    "prompt_cache_key",
    "logprobs",
    "top_logprobs",
    "logit_bias",
    "frequency_penalty",
    "presence_penalty",
    "n",
}
_COMPLETION_MAPPED = {
    "model",
    "prompt",
    "stream",
    "stream_options",
    "stop",
    "max_tokens",
    "temperature",
    "top_p",
    "seed",
    "user",
    "prompt_cache_key",
    "logprobs",
    "logit_bias",
    "frequency_penalty",
    "presence_penalty",
    "n",
}
_CHAT_ONLY_NEUTRAL = {"best_of", "echo", "suffix"}
_COMPLETION_ONLY_NEUTRAL = {
    "top_logprobs",
    "modalities",
    "audio",
    "prediction",
    "reasoning_effort",
    "verbosity",
    "web_search_options",
    "functions",
    "function_call",
}
SAMPLER_EXTENSIONS = ("top_k", "min_p", "repeat_penalty", "repeated_line_max", "repeated_line_min_chars")
DECODE_EXTENSIONS = ("speculation",)
"""modeld's own request fields beyond the samplers: ``speculation`` (``off`` or ``ngram``;
absent: the daemon's ``--speculation``; blueprint 0021)."""


def openai_error(error: HttpError) -> dict[str, Any]:
    """OpenAI's error body: ``{"error": {"message", "type", "param", "code"}}``."""
    kind = "invalid_request_error" if error.status < 500 else "server_error"
    if error.status == 429:
        kind = "rate_limit_error"
    if error.status == 401:
        kind = "authentication_error"
    return {"error": {"message": error.message, "type": kind, "param": error.param, "code": error.code}}


def check_sglang(body: Mapping[str, Any]) -> None:
    """The SGLang gateway's injected fields, at their defaults only."""
    for name, default in SGLANG_FIELDS.items():
        value = body.get(name)
        if value is not None and value != default:
            raise unsupported(
                name,
                f"{name}={echo(value)} is not supported by modeld (only its default, {json.dumps(default)})",
            )


def _check_neutral(body: Mapping[str, Any], skip: set[str]) -> None:
    for name, allowed in _NEUTRAL.items():
        if name in skip or name not in body:
            continue
        value = body[name]
        if value not in allowed:
            raise unsupported(name, f"{name}={echo(value)} is not supported by modeld (leave it unset)")
    for name, allowed in _NO_EFFECT.items():
        if name in body and allowed and body[name] not in allowed:
            raise unsupported(name, f"{name}={echo(body[name])} is not supported by modeld")


def decode_config(
    body: Mapping[str, Any],
    mapped: set[str] | frozenset[str],
    limits: Limits,
    *,
    temperature_max: float = 2.0,
    extensions: bool = True,
    **given: Any,
) -> DecodeConfig:
    """Samplers, stop strings and extension fields (OpenAI's names; max_tokens set later)."""
    values: dict[str, Any] = dict(given)
    temperature = number(body, "temperature", 0, temperature_max)
    if temperature is not None:
        values["temperature"] = temperature
    top_p = number(body, "top_p", 0, 1)
    if top_p is not None:
        if top_p == 0:
            raise bad("top_p", "top_p must be in (0, 1], got 0")
        values["top_p"] = top_p
    seed = integer(body, "seed", -1, (1 << 64) - 1)
    if seed is not None and seed >= 0:  # -1 (llama.cpp's "random") is no seed
        values["seed"] = seed
    top_k = integer(body, "top_k", 0, 1 << 30)
    if top_k is not None:
        values["top_k"] = top_k
    for name in ("repeated_line_max", "repeated_line_min_chars"):
        value = integer(body, name, 0, 1 << 20)
        if value is not None:
            values[name] = value
    min_p = number(body, "min_p", 0, 1)
    if min_p is not None:
        values["min_p"] = min_p
    repeat = number(body, "repeat_penalty", 0, 10)
    if repeat is not None:
        values["repeat_penalty"] = repeat
    for name in ("presence_penalty", "frequency_penalty"):
        penalty = number(body, name, -2, 2)
        if penalty is not None:
            values[name] = penalty
    bias = logit_bias(body)
    if bias:
        values["logit_bias"] = bias
    speculation = choice(body, "speculation", SPECULATION_MODES)
    if speculation is not None:
        values["speculation"] = speculation
    extra: dict[str, str] = {}
    if extensions:
        known = (
            set(mapped)
            | set(_NEUTRAL)
            | set(_NO_EFFECT)
            | set(SAMPLER_EXTENSIONS)
            | set(DECODE_EXTENSIONS)
            | set(SGLANG_FIELDS)
        )
        for name, value in body.items():
            if name in known or value is None:
                continue
            if isinstance(value, bool):
                extra[name] = "true" if value else "false"
            elif isinstance(value, str | int | float):
                extra[name] = str(value)
            else:
                raise unsupported(
                    name, f"unknown field {echo(name)} with a non-scalar value is not supported"
                )
    return DecodeConfig(max_tokens=1, stop=stop_list(body, limits), extra=extra, **values)


def _chat_logprobs(body: Mapping[str, Any]) -> dict[str, Any]:
    logprobs = boolean(body, "logprobs")
    top = integer(body, "top_logprobs", 0, MAX_TOP_LOGPROBS)
    if top and not logprobs:
        raise bad("top_logprobs", "top_logprobs needs logprobs: true")
    return {"logprobs": True, "top_logprobs": top or 0} if logprobs else {}


def _completion_logprobs(body: Mapping[str, Any]) -> dict[str, Any]:
    """Completions' ``logprobs`` is how many alternatives to list per token (0-5)."""
    value = body.get("logprobs")
    if value is None or value is False:
        return {}
    top = integer(body, "logprobs", 0, 5)
    return {"logprobs": True, "top_logprobs": top or 0}


def response_format(fmt: object, param: str = "response_format") -> Constraint | None:
    """OpenAI's ``response_format`` (also the Responses API's ``text.format``) as a constraint."""
    if fmt is None:
        return None
    if not isinstance(fmt, dict):
        raise bad(param, f'{param} must be an object such as {{"type": "json_object"}}')
    kind = fmt.get("type")
    if kind == "text":
        _only(fmt, {"type"}, param)
        return None
    if kind == "json_object":
        _only(fmt, {"type", "schema"}, param)
        schema = fmt.get("schema")  # llama-server's extension: a schema for json_object
        if schema is None:
            return Constraint("json")
        if not isinstance(schema, dict):
            raise bad(f"{param}.schema", "the schema must be a JSON object")
        return Constraint("json_schema", json.dumps(schema, ensure_ascii=False))
    if kind == "json_schema":
        # Chat nests the schema under json_schema; the Responses API puts its fields inline.
        spec = fmt.get("json_schema", fmt)
        where = f"{param}.json_schema" if "json_schema" in fmt else param
        if "json_schema" in fmt:
            _only(fmt, {"type", "json_schema"}, param)
        if not isinstance(spec, dict):
            raise bad(where, f"{where} must be an object")
        _only(spec, {"type", "name", "description", "schema", "strict"}, where)
        strict = spec.get("strict")
        if strict is not None and not isinstance(strict, bool):
            raise bad(f"{where}.strict", "strict must be a boolean")
        schema = spec.get("schema")
        if schema is None:
            return Constraint("json")  # no schema: any JSON object
        if not isinstance(schema, dict):
            raise bad(f"{where}.schema", "the schema must be a JSON object")
        return Constraint("json_schema", json.dumps(schema, ensure_ascii=False))  # always strict
    raise bad(param, f"{param} type must be text, json_object or json_schema, got {echo(kind)}")


def _only(fields: Mapping[str, Any], allowed: set[str], where: str) -> None:
    for key, value in fields.items():
        if key not in allowed and value is not None:
            raise unsupported(f"{where}.{key}", f"{where}.{echo(key)} is not supported by modeld")


def _stream_options(body: Mapping[str, Any]) -> tuple[bool, bool]:
    stream = boolean(body, "stream") or False
    options = body.get("stream_options")
    include_usage = False
    if options is not None:
        if not isinstance(options, dict):
            raise bad("stream_options", "stream_options must be an object")
        for key, value in options.items():
            if key == "include_usage":
                include_usage = boolean(options, key, param="stream_options.include_usage") or False
            elif key == "include_obfuscation":
                continue  # OpenAI's padding of stream events: nothing to hide on loopback
            elif value not in (None, False):
                raise unsupported(f"stream_options.{key}", f"stream_options.{echo(key)} is not supported")
    return stream, include_usage


def _content(message: Mapping[str, Any], where: str) -> str:
    content = message.get("content")
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise bad(f"{where}.content", f"{where}.content must be a string or an array of content parts")
    parts: list[str] = []
    for j, part in enumerate(content):
        if not isinstance(part, dict):
            raise bad(f"{where}.content[{j}]", f"{where}.content[{j}] must be an object")
        kind = part.get("type")
        if kind in ("text", "input_text", "output_text") and isinstance(part.get("text"), str):
            parts.append(part["text"])
        else:
            raise unsupported(
                f"{where}.content[{j}].type",
                f"{where}.content[{j}] of type {echo(kind)} is not supported (text parts only)",
            )
    return "".join(parts)


def _messages(body: Mapping[str, Any], limits: Limits) -> list[Message]:
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages:
        raise bad("messages", "messages must be a non-empty array", code="missing_required_parameter")
    limits.check("max_messages", len(messages), "messages")
    out: list[Message] = []
    for i, message in enumerate(messages):
        where = f"messages[{i}]"
        if not isinstance(message, dict):
            raise bad(where, f"{where} must be an object")
        given = message.get("role")
        role = ROLE_OF.get(given) if isinstance(given, str) else None
        if role is None:
            raise bad(
                f"{where}.role",
                f"{where}.role must be system, developer, user, assistant or tool, got {echo(message.get('role'))}",
            )
        for key, value in message.items():
            if key in ("role", "content", "name", "tool_call_id", "tool_calls") or value is None:
                continue
            if key in ("refusal", "reasoning_content", "reasoning") and role == "assistant":
                continue
            raise unsupported(f"{where}.{key}", f"{where}.{echo(key)} is not supported")
        calls = message_calls(message.get("tool_calls"), f"{where}.tool_calls", role)
        reasoning = message.get("reasoning_content") or message.get("reasoning") or ""
        if not isinstance(reasoning, str):
            raise bad(f"{where}.reasoning_content", f"{where}.reasoning_content must be a string")
        text = _content(message, where)  # checks the parts: text parts only
        content = message.get("content")
        parts = tuple(p["text"] for p in content) if isinstance(content, list) else ()
        out.append(
            Message(
                role,
                text,
                calls,
                reasoning,
                tool_call_id=_short(message, "tool_call_id", where) if role == "tool" else "",
                name=_short(message, "name", where),
                parts=parts,
            )
        )
    return out


def _short(message: Mapping[str, Any], key: str, where: str) -> str:
    """A message's id or name field: a string of at most 256 characters ("" when absent)."""
    value = message.get(key)
    if value is None:
        return ""
    if not isinstance(value, str) or len(value) > 256:
        raise bad(f"{where}.{key}", f"{where}.{key} must be a string of at most 256 characters")
    return value


def message_calls(value: Any, where: str, role: str) -> tuple[ToolCall, ...]:
    """An assistant message's ``tool_calls`` (what an earlier turn returned)."""
    if value is None or value == []:
        return ()
    if role != "assistant":
        raise bad(where, f"{where} is only allowed on assistant messages")
    if not isinstance(value, list) or len(value) > MAX_TOOL_CALLS:
        raise bad(where, f"{where} must be an array of at most {MAX_TOOL_CALLS} tool calls")
    calls: list[ToolCall] = []
    for j, call in enumerate(value):
        at = f"{where}[{j}]"
        function = call.get("function") if isinstance(call, dict) else None
        if (
            not isinstance(call, dict)
            or call.get("type", "function") != "function"
            or not isinstance(function, dict)
        ):
            raise bad(at, f'{at} must be {{"id", "type": "function", "function": {{"name", "arguments"}}}}')
        calls.append(
            checked_call(
                call.get("id", ""),
                function.get("name"),
                function.get("arguments", "{}"),
                at,
                f"{at}.function",
            )
        )
    return tuple(calls)


def checked_call(call_id: object, name: object, arguments: object, at: str, fields: str = "") -> ToolCall:
    """A tool call given back in the history, checked (arguments: a JSON object as text).
    ``at`` names the call, ``fields`` where its name and arguments are (default ``at``)."""
    fields = fields or at
    if not isinstance(call_id, str) or len(call_id) > 256:
        raise bad(f"{at}.id", f"{at}.id must be a string of at most 256 characters")
    if not isinstance(name, str) or not name or len(name) > 256:
        raise bad(f"{fields}.name", f"{fields}.name must be a non-empty string of at most 256 characters")
    try:
        parsed = json.loads(arguments) if isinstance(arguments, str) else None
    except (ValueError, RecursionError):
        parsed = None
    if not isinstance(parsed, dict):
        raise bad(f"{fields}.arguments", f"{fields}.arguments must be a JSON object as a string")
    return ToolCall(call_id, name, arguments)  # type: ignore[arg-type]


def tool_choice(choice: object, param: str = "tool_choice") -> str:
    """OpenAI's ``tool_choice`` as ``DecodeConfig.tool_choice`` (auto, none, required, a name)."""
    if choice is None or choice in ("auto", "none", "required"):
        return str(choice or "auto")
    if isinstance(choice, dict):
        function = choice.get("function")
        name = function.get("name") if isinstance(function, dict) else choice.get("name")
        if choice.get("type") != "function" or not isinstance(name, str) or not name:
            raise bad(
                param, f'{param} as an object must be {{"type": "function", "function": {{"name": ...}}}}'
            )
        if len(name) > 256:
            raise bad(param, f"{param} names a function of {len(name)} characters")
        return name
    raise bad(param, f"{param} must be 'auto', 'none', 'required' or an object, got {echo(choice)}")


def _tools(body: Mapping[str, Any], limits: Limits) -> tuple[str, str]:
    """(tools JSON for the template, DecodeConfig.tool_choice)."""
    tools = body.get("tools")
    mode = tool_choice(body.get("tool_choice"))
    boolean(body, "parallel_tool_calls")
    if tools is None or tools == []:
        if mode not in ("auto", "none"):
            raise bad(
                "tool_choice", f"tool_choice {echo(body.get('tool_choice'))} needs tools, and none were given"
            )
        return "", "auto"
    if not isinstance(tools, list) or not all(isinstance(t, dict) for t in tools):
        raise bad("tools", "tools must be an array of tool objects")
    limits.check("max_tools", len(tools), "tools")
    if mode == "none":
        return "", "none"  # the model is not shown tools it may not call
    return json.dumps(tools, ensure_ascii=False), mode


def _keys(body: Mapping[str, Any], headers: Mapping[str, str]) -> Keys:
    return Keys(
        header=key_value("X-Modeld-Conversation", headers.get("x-modeld-conversation")),
        routing=key_value("X-SMG-Routing-Key", headers.get("x-smg-routing-key")),
        prompt_cache_key=key_value("prompt_cache_key", body.get("prompt_cache_key")),
        user=key_value("user", body.get("user")),
    )


def _choices(body: Mapping[str, Any], stream: bool, limits: Limits) -> int:
    """``n``: how many choices (at most ``limits.max_choices``), each decoded from the same prompt."""
    n = integer(body, "n", 1, 1 << 30) or 1
    limits.check("max_choices", n, "choices (n)")
    if n > 1 and stream:
        raise unsupported("n", f"n={n} is answered without stream (a stream carries one choice)")
    return n


def parse_chat(body: Mapping[str, Any], headers: Mapping[str, str], limits: Limits) -> tuple[Turn, bool]:
    """A ``/v1/chat/completions`` body as a Turn, and whether usage is streamed."""
    model = model_name(body)
    _check_neutral(body, _CHAT_ONLY_NEUTRAL)
    check_sglang(body)
    for name in _CHAT_ONLY_NEUTRAL:
        if body.get(name) is not None:
            raise unsupported(name, f"{name} is a /v1/completions field")
    stream, include_usage = _stream_options(body)
    constraint = response_format(body.get("response_format"))
    max_tokens = integer(body, "max_completion_tokens", 1, 1 << 30)
    if max_tokens is None:
        max_tokens = integer(body, "max_tokens", 1, 1 << 30)
    messages = tuple(_messages(body, limits))
    tools_json, choice = _tools(body, limits)
    decode = decode_config(
        body, _CHAT_MAPPED, limits, constraint=constraint, tool_choice=choice, **_chat_logprobs(body)
    )
    turn = Turn(
        api="openai.chat",
        model=model,
        decode=decode,
        keys=_keys(body, headers),
        stream=stream,
        messages=messages,
        tools_json=tools_json,
        max_tokens=max_tokens,
        parallel_tool_calls=body.get("parallel_tool_calls") is not False,
        n=_choices(body, stream, limits),
        template_args=template_args(
            body.get("chat_template_kwargs"),
            reasoning_effort=body.get("reasoning_effort"),
        ),
    )
    return turn, include_usage


def parse_completion(
    body: Mapping[str, Any], headers: Mapping[str, str], limits: Limits
) -> tuple[Turn, bool]:
    """A ``/v1/completions`` body as a Turn: the prompt is evaluated as given (raw)."""
    model = model_name(body)
    _check_neutral(body, _COMPLETION_ONLY_NEUTRAL)
    check_sglang(body)
    for name in _COMPLETION_ONLY_NEUTRAL:
        if body.get(name) is not None:
            raise unsupported(name, f"{name} is a /v1/chat/completions field")
    stream, include_usage = _stream_options(body)
    prompt = body.get("prompt")
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], str):
        prompt = prompt[0]
    if isinstance(prompt, list):
        raise unsupported("prompt", "prompt must be one string (token arrays and batches are not supported)")
    if not isinstance(prompt, str):
        raise bad("prompt", "prompt is required and must be a string", code="missing_required_parameter")
    max_tokens = integer(body, "max_tokens", 1, 1 << 30)
    turn = Turn(
        api="openai.completions",
        model=model,
        decode=decode_config(body, _COMPLETION_MAPPED, limits, **_completion_logprobs(body)),
        keys=_keys(body, headers),
        stream=stream,
        prompt=prompt,
        max_tokens=16 if max_tokens is None else max_tokens,
        n=_choices(body, stream, limits),
    )
    return turn, include_usage
