"""OpenAI chat completions and completions: the request as a Turn (the answers are shaped in
:mod:`modeld.server.http.openai.answer`; what every API reads alike is
:mod:`modeld.server.http.requests`'s).

Rules (``blueprints/0014-openai-http.md``; the field table is in ``blueprints/0019-agent-apis.md``):

* Every field is accounted for. Mapped fields are honoured; fields OpenAI defines that modeld
  cannot honour are refused by name with a 400 (audio, ``n`` above 8, ...); fields that
  describe the hosted service are accepted and have no effect (``store``, ``service_tier``,
  ``metadata``, ...). The SGLang gateway's injected fields are accepted at their defaults
  (:data:`SGLANG_FIELDS`).
* The samplers are read from :data:`SAMPLERS` (the sampler map: wire name -> sampler, with the
  ranges of ``modeld/decoding/samplers.py``; OpenAI's temperature is 0-2, a seed of -1 is
  llama.cpp's "random"). Unknown scalar fields are extensions: ``top_k``, ``min_p``,
  ``repeat_penalty`` are samplers too; any other scalar goes to ``DecodeConfig.extra``, which
  the backend accepts or refuses by name.
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
from dataclasses import dataclass
from typing import Any

from modeld.contract import SPECULATION_MODES, DecodeConfig, ToolCall
from modeld.decoding.samplers import sampler
from modeld.errors import echo
from modeld.server.http.chat_template import template_args
from modeld.server.http.dialect import Asked
from modeld.server.http.errors import bad, unsupported
from modeld.server.http.fields import MAX_TOOL_CALLS, boolean, choice, integer, model_name, stop_list
from modeld.server.http.requests import (
    SamplerField,
    SamplerMap,
    checked_call,
    conversation_keys,
    ident_field,
    key_value,
    media_omitted,
    response_format,
    samplers,
    text_parts,
    tool_choice,
)
from modeld.server.http.turn import Keys, Message, Turn
from modeld.settings import Limits

__all__ = ["SAMPLERS", "SGLANG_FIELDS", "OpenAIAsked", "parse_chat", "parse_completion"]


@dataclass(frozen=True, kw_only=True)
class OpenAIAsked(Asked):
    """A chat completions or completions request: its turn, and whether a stream ends with a
    usage chunk (``stream_options.include_usage``)."""

    include_usage: bool = False


SAMPLERS: SamplerMap = {
    "temperature": SamplerField("temperature", high=2.0),
    "top_p": SamplerField("top_p"),
    "seed": SamplerField("seed", unset=-1),
    "top_k": SamplerField("top_k"),
    "min_p": SamplerField("min_p"),
    "repeat_penalty": SamplerField("repeat_penalty"),
    "presence_penalty": SamplerField("presence_penalty"),
    "frequency_penalty": SamplerField("frequency_penalty"),
    "logit_bias": SamplerField("logit_bias"),
}
"""OpenAI's sampler fields (``top_k``, ``min_p``, ``repeat_penalty``: llama-server's and vLLM's
extensions, under their names)."""
TEXT_PARTS = {"text": "text", "input_text": "text", "output_text": "text"}
MAX_TOP_LOGPROBS = int(sampler("top_logprobs").high)
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
GUARD_EXTENSIONS = ("repeated_line_max", "repeated_line_min_chars")
"""The repeated-line guard's fields (``modeld/decoding/guard.py``), under their names."""
DECODE_EXTENSIONS = ("speculation",)
"""modeld's own request fields beyond the samplers: ``speculation`` (``off`` or ``ngram``;
absent: the daemon's ``--speculation``; blueprint 0021)."""


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
    body: Mapping[str, Any], mapped: set[str] | frozenset[str], limits: Limits, **given: Any
) -> DecodeConfig:
    """Samplers, stop strings and extension fields (OpenAI's names; max_tokens set later)."""
    values: dict[str, Any] = {**given, **samplers(body, SAMPLERS)}
    for name in GUARD_EXTENSIONS:
        value = integer(body, name, 0, 1 << 20)
        if value is not None:
            values[name] = value
    speculation = choice(body, "speculation", SPECULATION_MODES)
    if speculation is not None:
        values["speculation"] = speculation
    extra: dict[str, str] = {}
    known = (
        set(mapped)
        | set(_NEUTRAL)
        | set(_NO_EFFECT)
        | set(SAMPLERS)
        | set(GUARD_EXTENSIONS)
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
            raise unsupported(name, f"unknown field {echo(name)} with a non-scalar value is not supported")
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
        content = message.get("content")
        texts = [] if content is None else text_parts(content, f"{where}.content", TEXT_PARTS)
        text = "\n".join(texts)  # parts of images or documents are placeholders here (Media)
        parts = tuple(texts) if isinstance(content, list) else ()
        out.append(
            Message(
                role,
                text,
                calls,
                reasoning,
                tool_call_id=ident_field(message, "tool_call_id", where) if role == "tool" else "",
                name=ident_field(message, "name", where),
                parts=parts,
            )
        )
    return out


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
    # "none" keeps the tools in the prompt (the warm prefix stays the same) and forbids calls.
    return json.dumps(tools, ensure_ascii=False), mode


def _keys(body: Mapping[str, Any], headers: Mapping[str, str]) -> Keys:
    return conversation_keys(
        headers,
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


def parse_chat(body: Mapping[str, Any], headers: Mapping[str, str], limits: Limits) -> OpenAIAsked:
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
    with media_omitted() as media:  # images: placeholders in earlier turns, refused in the newest
        messages = tuple(_messages(body, limits))
    omitted = media.settle(len(body["messages"]))
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
        omitted_content=omitted,
    )
    return OpenAIAsked(turn, include_usage=include_usage)


def parse_completion(body: Mapping[str, Any], headers: Mapping[str, str], limits: Limits) -> OpenAIAsked:
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
    return OpenAIAsked(turn, include_usage=include_usage)
