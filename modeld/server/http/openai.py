"""OpenAI request bodies to the session contract, and contract results to OpenAI responses.

No web framework here: plain dicts in, :class:`Turn` (what to run on a session) out, and
dicts back. Rules (``blueprints/0014-openai-http.md``):

* Every field is accounted for. Fields modeld honours are mapped; OpenAI fields it cannot
  honour are refused by name with a 400 (``n`` other than 1, audio, ...), never ignored.
  ``logit_bias``, the presence and
  frequency penalties and ``logprobs`` go to the backend, which refuses by name what it cannot
  honour. A few fields are accepted and documented as having no effect here because they
  describe the hosted service (``store`` false, ``service_tier``, ``safety_identifier``).
* Constrained output and tools (``blueprints/0018-constraints-and-tool-calls.md``):
  ``response_format`` ``json_object`` / ``json_schema`` become a constraint; ``tool_choice``
  ``required`` or a named function forces a well-formed call (a constraint too); calls are
  parsed out of the output into ``tool_calls`` (streamed as deltas), finish reason
  ``tool_calls``; a malformed call keeps its raw text as content (finish ``stop``);
  ``constraint_failed`` and ``repeated_line`` are passed through as finish reasons (the output
  is not valid, so never ``stop``). ``parallel_tool_calls: false`` returns the first call only.
  Assistant messages with ``tool_calls`` are written back into the history in the model's
  format (the exact generated text when this daemon produced those calls).
* Unknown fields are extensions: ``top_k``, ``min_p`` and ``repeat_penalty`` map to the
  DecodeConfig samplers; any other scalar goes to ``DecodeConfig.extra``, which the backend
  accepts or refuses by name (the memory backend's ``delay_ms``, for example).
* Chat messages become manifest segments, one per message, with their role: the stable prefix
  is the conversation up to and including the last assistant message (or the leading system
  messages on a first turn, at least the first message), the suffix is what follows (the new
  user turn, tool results). The
  engine renders them with the model's template and reuses the longest common token prefix.
* Omitted ``temperature`` means greedy (modeld's default, not OpenAI's 1); omitted
  ``max_tokens`` means up to the context window for chat and 16 for completions (OpenAI's).
"""

from __future__ import annotations

import json
import math
import time
import uuid
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field, replace
from typing import Any

import xxhash

from modeld.contract import (
    Constraint,
    DecodeConfig,
    PrefixInput,
    PrefixStatus,
    StreamChunk,
    SuffixInput,
    TokenLogprob,
    ToolCall,
    ToolCallDelta,
    Usage,
)
from modeld.decoding.tools import format_calls
from modeld.errors import ModeldError, echo
from modeld.manifest import ContextManifest, Segment

__all__ = [
    "ApiError",
    "ChatMessage",
    "Turn",
    "api_error",
    "chat_delta",
    "chat_logprobs",
    "completion_logprobs",
    "finish_reason",
    "chat_chunk",
    "chat_response",
    "completion_chunk",
    "completion_response",
    "models_response",
    "parse_chat",
    "parse_completion",
    "usage_dict",
    "with_tool_format",
]

MAX_KEY_CHARS = 256
"""Longest conversation key (header, prompt_cache_key or user) kept as given."""
MAX_MESSAGES = 4096
MAX_TOOL_CALLS = 256
"""Tool calls in one assistant message at most."""
MAX_LOGIT_BIAS = 1024
MAX_TOP_LOGPROBS = 20
ROLE_OF = {
    "system": "system",
    "developer": "system",
    "user": "user",
    "assistant": "assistant",
    "tool": "tool",
}


@dataclass
class ApiError(Exception):
    """An OpenAI-shaped error: ``{"error": {"message", "type", "param", "code"}}``."""

    status: int
    message: str
    type: str = "invalid_request_error"
    code: str | None = None
    param: str | None = None

    def body(self) -> dict[str, Any]:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}


def _bad(param: str, message: str, code: str = "invalid_value") -> ApiError:
    return ApiError(400, message, code=code, param=param)


def _unsupported(param: str, message: str) -> ApiError:
    return ApiError(400, message, code="unsupported_parameter", param=param)


# --- what a request asks for -----------------------------------------------------------------


@dataclass(frozen=True)
class ChatMessage:
    """One chat message: its role, text and (assistant) the tool calls it made."""

    role: str
    content: str
    calls: tuple[ToolCall, ...] = ()

    @property
    def has_calls(self) -> bool:
        return bool(self.calls)


@dataclass(frozen=True)
class Turn:
    """One request mapped onto the session contract."""

    kind: str  # "chat" | "completion"
    model: str
    prompt_format: str  # "chat" | "raw"
    prefix: PrefixInput
    suffix: SuffixInput | None
    decode: DecodeConfig
    max_tokens_given: bool
    stream: bool
    include_usage: bool
    conversation: str  # the affinity key; "" = none given
    roles: tuple[str, ...] = ()  # per prefix segment, for naming where a prefix diverged
    messages: tuple[ChatMessage, ...] = ()  # chat: what the prefix and suffix were built from
    split: int = 0  # chat: how many messages form the prefix
    parallel_tool_calls: bool = True  # False: the first call only
    logprobs: bool = False
    id: str = field(default_factory=lambda: uuid.uuid4().hex[:24])
    created: int = field(default_factory=lambda: int(time.time()))


# Fields of OpenAI's API that describe its hosted service: accepted with these values, no effect.
_NO_EFFECT: dict[str, tuple[object, ...]] = {
    "store": (None, False),
    "service_tier": (None, "auto", "default"),
    "safety_identifier": (),  # any string
    "metadata": (None,),
    "cache_prompt": (None, True),  # llama-server's switch: reuse is always on here
}
# Fields OpenAI defines that modeld cannot honour unless they have these (neutral) values.
_NEUTRAL: dict[str, tuple[object, ...]] = {
    "n": (None, 1),
    "modalities": (None, ["text"]),
    "audio": (None,),
    "prediction": (None,),
    "reasoning_effort": (None,),
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
_SAMPLER_EXTENSIONS = ("top_k", "min_p", "repeat_penalty", "repeated_line_max", "repeated_line_min_chars")


def _check_neutral(body: Mapping[str, Any], skip: set[str]) -> None:
    for name, allowed in _NEUTRAL.items():
        if name in skip or name not in body:
            continue
        value = body[name]
        if value not in allowed:
            if name == "n":
                raise _unsupported(
                    "n", f"n must be 1: modeld generates one choice per request (got {echo(value)})"
                )
            raise _unsupported(name, f"{name}={echo(value)} is not supported by modeld (leave it unset)")
    for name, allowed in _NO_EFFECT.items():
        if name in body and allowed and body[name] not in allowed:
            raise _unsupported(name, f"{name}={echo(body[name])} is not supported by modeld")


def _int(body: Mapping[str, Any], name: str, lo: int, hi: int) -> int | None:
    value = body.get(name)
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int):
        raise _bad(name, f"{name} must be an integer, got {echo(value)}")
    if not lo <= value <= hi:
        raise _bad(name, f"{name} must be between {lo} and {hi}, got {value}")
    return value


def _number(body: Mapping[str, Any], name: str) -> float | None:
    value = body.get(name)
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int | float) or not math.isfinite(value):
        raise _bad(name, f"{name} must be a number, got {echo(value)}")
    return float(value)


def _stop(body: Mapping[str, Any]) -> tuple[str, ...]:
    value = body.get("stop")
    if value is None:
        return ()
    if isinstance(value, str):
        return (value,)
    if isinstance(value, list) and all(isinstance(s, str) for s in value):
        return tuple(value)
    raise _bad("stop", "stop must be a string or an array of strings")


def _decode(body: Mapping[str, Any], mapped: set[str], max_tokens: int | None, **given: Any) -> DecodeConfig:
    """Samplers, stop strings and extension fields; max_tokens 0 stands for "the window"."""
    values: dict[str, Any] = dict(given)
    temperature = _number(body, "temperature")
    if temperature is not None:
        if not 0 <= temperature <= 2:
            raise _bad("temperature", f"temperature must be between 0 and 2, got {temperature:g}")
        values["temperature"] = temperature
    top_p = _number(body, "top_p")
    if top_p is not None:
        if not 0 < top_p <= 1:
            raise _bad("top_p", f"top_p must be in (0, 1], got {top_p:g}")
        values["top_p"] = top_p
    seed = _int(body, "seed", 0, (1 << 64) - 1)
    if seed is not None:
        values["seed"] = seed
    if "top_k" in body and body["top_k"] is not None:
        values["top_k"] = _int(body, "top_k", 0, 1 << 30)
    for name in ("repeated_line_max", "repeated_line_min_chars"):
        if body.get(name) is not None:
            values[name] = _int(body, name, 0, 1 << 20)
    for name in ("min_p", "repeat_penalty"):
        number = _number(body, name)
        if number is not None:
            values[name] = number
    for name in ("presence_penalty", "frequency_penalty"):
        number = _number(body, name)
        if number is not None:
            if not -2 <= number <= 2:
                raise _bad(name, f"{name} must be between -2 and 2, got {number:g}")
            values[name] = number
    bias = _logit_bias(body)
    if bias:
        values["logit_bias"] = bias
    extra: dict[str, str] = {}
    known = mapped | set(_NEUTRAL) | set(_NO_EFFECT) | set(_SAMPLER_EXTENSIONS)
    for name, value in body.items():
        if name in known or value is None:
            continue
        if isinstance(value, bool):
            extra[name] = "true" if value else "false"
        elif isinstance(value, str | int | float):
            extra[name] = str(value)
        else:
            raise _unsupported(name, f"unknown field {echo(name)} with a non-scalar value is not supported")
    return DecodeConfig(max_tokens=max_tokens or 1, stop=_stop(body), extra=extra, **values)


def _logit_bias(body: Mapping[str, Any]) -> dict[int, float]:
    """OpenAI's ``{"token id": bias}`` (string keys, -100..100) as token id -> bias."""
    value = body.get("logit_bias")
    if value is None:
        return {}
    if not isinstance(value, dict):
        raise _bad("logit_bias", "logit_bias must be an object mapping token ids to numbers")
    if len(value) > MAX_LOGIT_BIAS:
        raise _bad("logit_bias", f"logit_bias has {len(value)} entries; the limit is {MAX_LOGIT_BIAS}")
    out: dict[int, float] = {}
    for key, bias in value.items():
        if not (isinstance(key, str) and key.isdigit() and len(key) <= 10):
            raise _bad("logit_bias", f"logit_bias keys must be token ids, got {echo(key)}")
        if isinstance(bias, bool) or not isinstance(bias, int | float) or not -100 <= bias <= 100:
            raise _bad("logit_bias", f"logit_bias[{key}] must be a number from -100 to 100, got {echo(bias)}")
        out[int(key)] = float(bias)
    return out


def _chat_logprobs(body: Mapping[str, Any]) -> dict[str, Any]:
    logprobs = body.get("logprobs")
    if logprobs is not None and not isinstance(logprobs, bool):
        raise _bad("logprobs", "logprobs must be a boolean")
    top = _int(body, "top_logprobs", 0, MAX_TOP_LOGPROBS)
    if top and not logprobs:
        raise _bad("top_logprobs", "top_logprobs needs logprobs: true")
    return {"logprobs": True, "top_logprobs": top or 0} if logprobs else {}


def _completion_logprobs(body: Mapping[str, Any]) -> dict[str, Any]:
    """Completions' ``logprobs`` is how many alternatives to list per token (0-5)."""
    value = body.get("logprobs")
    if value is None or value is False:
        return {}
    top = _int(body, "logprobs", 0, 5)
    return {"logprobs": True, "top_logprobs": top or 0}


def _response_format(body: Mapping[str, Any]) -> Constraint | None:
    fmt = body.get("response_format")
    if fmt is None:
        return None
    if not isinstance(fmt, dict):
        raise _bad("response_format", 'response_format must be an object such as {"type": "json_object"}')
    kind = fmt.get("type")
    if kind == "text":
        return None
    if kind == "json_object":
        return Constraint("json")
    if kind == "json_schema":
        spec = fmt.get("json_schema")
        if not isinstance(spec, dict):
            raise _bad("response_format.json_schema", "response_format.json_schema must be an object")
        strict = spec.get("strict")
        if strict is not None and not isinstance(strict, bool):
            raise _bad("response_format.json_schema.strict", "strict must be a boolean")
        schema = spec.get("schema")
        if schema is None:
            return Constraint("json")  # no schema: any JSON object
        if not isinstance(schema, dict):
            raise _bad("response_format.json_schema.schema", "the schema must be a JSON object")
        return Constraint("json_schema", json.dumps(schema, ensure_ascii=False))  # always strict
    raise _bad(
        "response_format",
        f"response_format type must be text, json_object or json_schema, got {echo(kind)}",
    )


def _stream_options(body: Mapping[str, Any]) -> tuple[bool, bool]:
    stream = body.get("stream")
    if stream is not None and not isinstance(stream, bool):
        raise _bad("stream", "stream must be a boolean")
    options = body.get("stream_options")
    include_usage = False
    if options is not None:
        if not isinstance(options, dict):
            raise _bad("stream_options", "stream_options must be an object")
        for key, value in options.items():
            if key == "include_usage":
                if value is not None and not isinstance(value, bool):
                    raise _bad("stream_options.include_usage", "include_usage must be a boolean")
                include_usage = bool(value)
            elif value not in (None, False):
                raise _unsupported(f"stream_options.{key}", f"stream_options.{echo(key)} is not supported")
    return bool(stream), include_usage


def _key(body: Mapping[str, Any], header: str) -> str:
    """The conversation affinity key: the header, else prompt_cache_key, else user."""
    for name, value in (
        ("X-Modeld-Conversation", header),
        ("prompt_cache_key", body.get("prompt_cache_key")),
        ("user", body.get("user")),
    ):
        if value is None or value == "":
            continue
        if not isinstance(value, str):
            raise _bad(name, f"{name} must be a string")
        if len(value) > MAX_KEY_CHARS:
            raise _bad(name, f"{name} is {len(value)} characters; the limit is {MAX_KEY_CHARS}")
        return f"{name}:{value}"
    return ""


def _model(body: Mapping[str, Any]) -> str:
    model = body.get("model")
    if not isinstance(model, str) or not model:
        raise _bad(
            "model",
            "model is required (one of the names GET /v1/models lists)",
            code="missing_required_parameter",
        )
    if len(model) > MAX_KEY_CHARS:
        raise ApiError(404, f"the model {echo(model)} does not exist", code="model_not_found", param="model")
    return model


def _content(message: Mapping[str, Any], where: str) -> str:
    content = message.get("content")
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise _bad(f"{where}.content", f"{where}.content must be a string or an array of content parts")
    parts: list[str] = []
    for j, part in enumerate(content):
        if not isinstance(part, dict):
            raise _bad(f"{where}.content[{j}]", f"{where}.content[{j}] must be an object")
        kind = part.get("type")
        if kind == "text" and isinstance(part.get("text"), str):
            parts.append(part["text"])
        else:
            raise _unsupported(
                f"{where}.content[{j}].type",
                f"{where}.content[{j}] of type {echo(kind)} is not supported (text parts only)",
            )
    return "".join(parts)


def _messages(body: Mapping[str, Any]) -> list[ChatMessage]:
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages:
        raise _bad("messages", "messages must be a non-empty array", code="missing_required_parameter")
    if len(messages) > MAX_MESSAGES:
        raise _bad("messages", f"{len(messages)} messages; the limit is {MAX_MESSAGES}")
    out: list[ChatMessage] = []
    for i, message in enumerate(messages):
        where = f"messages[{i}]"
        if not isinstance(message, dict):
            raise _bad(where, f"{where} must be an object")
        given = message.get("role")
        role = ROLE_OF.get(given) if isinstance(given, str) else None
        if role is None:
            raise _bad(
                f"{where}.role",
                f"{where}.role must be system, developer, user, assistant or tool, got {echo(message.get('role'))}",
            )
        for key, value in message.items():
            if key in ("role", "content", "name", "tool_call_id", "tool_calls") or value is None:
                continue
            if key == "refusal" and role == "assistant":
                continue
            raise _unsupported(f"{where}.{key}", f"{where}.{echo(key)} is not supported")
        calls = _message_calls(message.get("tool_calls"), f"{where}.tool_calls", role)
        out.append(ChatMessage(role, _content(message, where), calls))
    return out


def _message_calls(value: Any, where: str, role: str) -> tuple[ToolCall, ...]:
    """An assistant message's ``tool_calls`` (what an earlier turn returned)."""
    if value is None or value == []:
        return ()
    if role != "assistant":
        raise _bad(where, f"{where} is only allowed on assistant messages")
    if not isinstance(value, list) or len(value) > MAX_TOOL_CALLS:
        raise _bad(where, f"{where} must be an array of at most {MAX_TOOL_CALLS} tool calls")
    calls: list[ToolCall] = []
    for j, call in enumerate(value):
        at = f"{where}[{j}]"
        function = call.get("function") if isinstance(call, dict) else None
        if (
            not isinstance(call, dict)
            or call.get("type", "function") != "function"
            or not isinstance(function, dict)
        ):
            raise _bad(at, f'{at} must be {{"id", "type": "function", "function": {{"name", "arguments"}}}}')
        call_id, name, arguments = call.get("id", ""), function.get("name"), function.get("arguments", "{}")
        if not isinstance(call_id, str) or len(call_id) > MAX_KEY_CHARS:
            raise _bad(f"{at}.id", f"{at}.id must be a string of at most {MAX_KEY_CHARS} characters")
        if not isinstance(name, str) or not name or len(name) > MAX_KEY_CHARS:
            raise _bad(f"{at}.function.name", f"{at}.function.name must be a non-empty string")
        try:
            parsed = json.loads(arguments) if isinstance(arguments, str) else None
        except (ValueError, RecursionError):
            parsed = None
        if not isinstance(parsed, dict):
            raise _bad(
                f"{at}.function.arguments", f"{at}.function.arguments must be a JSON object as a string"
            )
        calls.append(ToolCall(call_id, name, arguments))
    return tuple(calls)


def _tools(body: Mapping[str, Any]) -> tuple[str, str]:
    """(tools JSON for the template, DecodeConfig.tool_choice)."""
    tools = body.get("tools")
    choice = body.get("tool_choice")
    parallel = body.get("parallel_tool_calls")
    if parallel is not None and not isinstance(parallel, bool):
        raise _bad("parallel_tool_calls", "parallel_tool_calls must be a boolean")
    if choice is None or choice in ("auto", "none", "required"):
        mode = choice or "auto"
    elif isinstance(choice, dict):
        function = choice.get("function")
        name = function.get("name") if isinstance(function, dict) else None
        if choice.get("type") != "function" or not isinstance(name, str) or not name:
            raise _bad(
                "tool_choice",
                'tool_choice as an object must be {"type": "function", "function": {"name": ...}}',
            )
        if len(name) > MAX_KEY_CHARS:
            raise _bad("tool_choice", f"tool_choice names a function of {len(name)} characters")
        mode = name
    else:
        raise _bad(
            "tool_choice", f"tool_choice must be 'auto', 'none', 'required' or an object, got {echo(choice)}"
        )
    if tools is None or tools == []:
        if mode not in ("auto", "none"):
            raise _bad("tool_choice", f"tool_choice {echo(choice)} needs tools, and none were given")
        return "", "auto"
    if not isinstance(tools, list) or not all(isinstance(t, dict) for t in tools):
        raise _bad("tools", "tools must be an array of tool objects")
    if mode == "none":
        return "", "none"  # the model is not shown tools it may not call
    return json.dumps(tools, ensure_ascii=False), mode


def _split(messages: list[ChatMessage]) -> int:
    """How many messages form the stable prefix: through the last assistant message, else the
    leading system messages, and at least the first message (templates index messages[0])."""
    last_assistant = max((i for i, m in enumerate(messages) if m.role == "assistant"), default=-1)
    if last_assistant >= 0:
        return last_assistant + 1
    k = 0
    while k < len(messages) and messages[k].role == "system":
        k += 1
    return max(k, 1)


def _auto_key(model: str, messages: list[ChatMessage]) -> str:
    """A conversation's identity when the client names none: its first system and user message."""
    h = xxhash.xxh3_64(model.encode())
    seen: set[str] = set()
    for m in messages:
        if m.role in ("system", "user") and m.role not in seen:
            seen.add(m.role)
            h.update(f"\0{m.role}\0".encode())
            h.update(m.content.encode("utf-8", errors="surrogatepass"))
        if seen == {"system", "user"}:
            break
    return f"auto:{h.hexdigest()}"


Recall = Callable[[tuple[str, ...]], str | None]
"""The exact generated text of calls this daemon returned, by their ids (None: not known)."""


def _chat_inputs(
    messages: tuple[ChatMessage, ...], k: int, tools_json: str, fmt: str, recall: Recall | None
) -> tuple[PrefixInput, SuffixInput]:
    """The prefix (messages before ``k``) and suffix, one manifest segment per message; an
    assistant message's tool calls follow its content, written in the model's format ``fmt``."""
    prefix_parts: list[bytes] = []
    suffix_parts: list[bytes] = []
    segments: list[Segment] = []
    offset = 0
    for i, m in enumerate(messages):
        text = m.content
        if m.calls:
            known = recall(tuple(c.id for c in m.calls)) if recall is not None else None
            text += known if known is not None else (("\n" if text else "") + format_calls(fmt, m.calls))
        data = text.encode("utf-8", errors="surrogatepass")
        stable = i < k
        kind = "system" if i == 0 and m.role == "system" and stable else "history"
        segments.append(
            Segment(kind=kind, byte_start=offset, byte_end=offset + len(data), stable=stable, role=m.role)
        )
        (prefix_parts if stable else suffix_parts).append(data)
        offset += len(data)
    try:
        prefix_text = b"".join(prefix_parts).decode("utf-8")
        suffix_text = b"".join(suffix_parts).decode("utf-8")
    except UnicodeDecodeError:
        raise _bad("messages", "messages contain text that is not valid Unicode (a lone surrogate)") from None
    manifest = ContextManifest(
        profile_id="openai.chat",
        stable_bytes=len(prefix_text.encode()),
        total_bytes=offset,
        segments=tuple(segments),
    )
    return (
        PrefixInput(text=prefix_text, manifest=manifest, tools_json=tools_json),
        SuffixInput(text=suffix_text, manifest=manifest),
    )


def with_tool_format(turn: Turn, fmt: str, recall: Recall | None) -> Turn:
    """The turn with its history's tool calls written in the model's format (``ModelInfo.
    tool_format``; hermes when the template's is not known), the exact text where recalled."""
    if not any(m.has_calls for m in turn.messages):
        return turn
    prefix, suffix = _chat_inputs(turn.messages, turn.split, turn.prefix.tools_json, fmt or "hermes", recall)
    return replace(turn, prefix=prefix, suffix=suffix)


def parse_chat(body: Mapping[str, Any], *, conversation_header: str = "") -> Turn:
    """A ``/v1/chat/completions`` body as a Turn (raises :class:`ApiError`)."""
    model = _model(body)
    _check_neutral(body, _CHAT_ONLY_NEUTRAL)
    for name in _CHAT_ONLY_NEUTRAL:
        if body.get(name) is not None:
            raise _unsupported(name, f"{name} is a /v1/completions field")
    stream, include_usage = _stream_options(body)
    constraint = _response_format(body)
    max_tokens = _int(body, "max_completion_tokens", 1, 1 << 30)
    if max_tokens is None:
        max_tokens = _int(body, "max_tokens", 1, 1 << 30)
    messages = tuple(_messages(body))
    tools_json, tool_choice = _tools(body)
    k = _split(list(messages))
    prefix, suffix = _chat_inputs(messages, k, tools_json, "hermes", None)
    key = _key(body, conversation_header) or _auto_key(model, list(messages))
    logprobs = _chat_logprobs(body)
    return Turn(
        kind="chat",
        model=model,
        prompt_format="chat",
        prefix=prefix,
        suffix=suffix,
        decode=_decode(
            body, _CHAT_MAPPED, max_tokens, constraint=constraint, tool_choice=tool_choice, **logprobs
        ),
        max_tokens_given=max_tokens is not None,
        stream=stream,
        include_usage=include_usage,
        conversation=key,
        roles=tuple(m.role for m in messages[:k]),
        messages=messages,
        split=k,
        parallel_tool_calls=body.get("parallel_tool_calls") is not False,
        logprobs=bool(logprobs),
    )


def parse_completion(body: Mapping[str, Any], *, conversation_header: str = "") -> Turn:
    """A ``/v1/completions`` body as a Turn: the prompt is evaluated as given (raw)."""
    model = _model(body)
    _check_neutral(body, _COMPLETION_ONLY_NEUTRAL)
    for name in _COMPLETION_ONLY_NEUTRAL:
        if body.get(name) is not None:
            raise _unsupported(name, f"{name} is a /v1/chat/completions field")
    stream, include_usage = _stream_options(body)
    prompt = body.get("prompt")
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], str):
        prompt = prompt[0]
    if isinstance(prompt, list):
        raise _unsupported("prompt", "prompt must be one string (token arrays and batches are not supported)")
    if not isinstance(prompt, str):
        raise _bad("prompt", "prompt is required and must be a string", code="missing_required_parameter")
    max_tokens = _int(body, "max_tokens", 1, 1 << 30)
    key = _key(body, conversation_header) or "completions"
    logprobs = _completion_logprobs(body)
    return Turn(
        kind="completion",
        model=model,
        prompt_format="raw",
        prefix=PrefixInput(text=prompt),
        suffix=None,
        decode=_decode(body, _COMPLETION_MAPPED, 16 if max_tokens is None else max_tokens, **logprobs),
        max_tokens_given=True,
        stream=stream,
        include_usage=include_usage,
        conversation=key,
        logprobs=bool(logprobs),
    )


# --- errors ------------------------------------------------------------------------------------

_STATUS: dict[str, tuple[int, str]] = {
    "invalid_argument": (400, "invalid_request_error"),
    "unsupported": (400, "invalid_request_error"),
    "limit_exceeded": (400, "invalid_request_error"),
    "context_overflow": (400, "invalid_request_error"),
    "busy": (503, "server_error"),
    "shutting_down": (503, "server_error"),
    "not_owner": (503, "server_error"),
    "stale_fence": (503, "server_error"),
    "unauthenticated": (401, "invalid_request_error"),
}
_CODES = {
    "context_overflow": "context_length_exceeded",
    "unsupported": "unsupported_parameter",
    "invalid_argument": "invalid_value",
}


def api_error(exc: ModeldError, incident: str) -> ApiError:
    """The OpenAI-shaped error for a contract error. Client mistakes (4xx) keep their message
    (it names the field); server-side failures say only what and the incident id, because
    their messages may name paths the HTTP endpoint never shows."""
    status, kind = _STATUS.get(exc.reason, (500, "server_error"))
    if status >= 500 and exc.reason not in ("busy", "shutting_down"):
        message = (
            f"modeld could not serve this request ({exc.reason}; incident {incident}, see the daemon's log)"
        )
    else:
        message = exc.message
    field = exc.details.get("field")
    param = _PARAMS.get(field, field) if field else exc.details.get("limit") or None
    if status < 500:
        message += _position(exc.details, message)
    return ApiError(status, message, type=kind, code=_CODES.get(exc.reason, exc.reason), param=param)


_PARAMS = {
    "constraint": "response_format",
    "constraint.kind": "response_format",
    "constraint.value": "response_format",
    "tools_json": "tools",
}
"""Contract fields as the OpenAI request names them (a schema error is the response_format's)."""


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


# --- responses -----------------------------------------------------------------------------------


def usage_dict(usage: Usage | None) -> dict[str, Any]:
    """OpenAI's usage, with the cached tokens where OpenAI clients read them.

    ``prompt_cache_hit_tokens``/``prompt_cache_miss_tokens`` (DeepSeek's names) are there too:
    aider and Cline read those.
    """
    if usage is None:
        usage = Usage(0, 0, 0)
    return {
        "prompt_tokens": usage.prompt_tokens,
        "completion_tokens": usage.completion_tokens,
        "total_tokens": usage.prompt_tokens + usage.completion_tokens,
        "prompt_tokens_details": {"cached_tokens": usage.cached_tokens},
        "prompt_cache_hit_tokens": usage.cached_tokens,
        "prompt_cache_miss_tokens": usage.prompt_tokens - usage.cached_tokens,
    }


_FINISH = {
    "length": "length",
    "tool_calls": "tool_calls",
    "signal": "tool_calls",  # to an OpenAI client an exit tool is a tool
    "constraint_failed": "constraint_failed",  # not "stop": the output is not valid
    "repeated_line": "repeated_line",
}


def finish_reason(chunk: StreamChunk) -> str:
    """OpenAI's finish reason: stop, length, tool_calls, or modeld's constraint_failed and
    repeated_line (the output is not what was asked for, so never "stop"). A malformed call is
    "stop" with its raw text as the content."""
    return _FINISH.get(chunk.finish_reason or "", "stop")


def _calls(turn: Turn, final: StreamChunk) -> tuple[ToolCall, ...]:
    calls = final.tool_calls + ((final.signal,) if final.signal is not None else ())
    return calls if turn.parallel_tool_calls else calls[:1]


def tool_calls_dicts(turn: Turn, final: StreamChunk) -> list[dict[str, Any]]:
    """``message.tool_calls`` of a complete response."""
    return [
        {"id": c.id, "type": "function", "function": {"name": c.name, "arguments": c.arguments}}
        for c in _calls(turn, final)
    ]


def chat_delta(turn: Turn, chunk: StreamChunk) -> dict[str, Any] | None:
    """The streamed ``delta`` for a chunk's content and tool-call deltas (None: nothing to send).

    A call's first delta has its id, type and name (arguments ""), its arguments follow in one
    delta when the call is complete; with ``parallel_tool_calls`` false only call 0 is sent.
    """
    delta: dict[str, Any] = {}
    if chunk.text:
        delta["content"] = chunk.text
    calls = [d for d in chunk.tool_call_deltas if turn.parallel_tool_calls or d.index == 0]
    if calls:
        delta["tool_calls"] = [_tool_delta(d) for d in calls]
    return delta or None


def _tool_delta(d: ToolCallDelta) -> dict[str, Any]:
    out: dict[str, Any] = {"index": d.index}
    if d.id or d.name:
        out["id"] = d.id
        out["type"] = "function"
        out["function"] = {"name": d.name, "arguments": d.arguments}
    else:
        out["function"] = {"arguments": d.arguments}
    return out


def _token_bytes(text: str) -> list[int]:
    """The bytes of a token's text (``bytes:\\xNN...`` spells out a partial UTF-8 token)."""
    if text.startswith("bytes:\\x"):
        try:
            return list(bytes.fromhex(text[6:].replace("\\x", "")))
        except ValueError:
            pass
    return list(text.encode("utf-8"))


def chat_logprobs(logprobs: tuple[TokenLogprob, ...]) -> dict[str, Any] | None:
    """``choices[].logprobs`` of a chat response or chunk (``{"content": [...]}``)."""
    if not logprobs:
        return None
    content = []
    for lp in logprobs:
        content.append(
            {
                "token": lp.text,
                "logprob": lp.logprob,
                "bytes": _token_bytes(lp.text),
                "top_logprobs": [
                    {"token": t.text, "logprob": t.logprob, "bytes": _token_bytes(t.text)} for t in lp.top
                ],
            }
        )
    return {"content": content, "refusal": None}


def completion_logprobs(logprobs: tuple[TokenLogprob, ...], offset: int) -> dict[str, Any] | None:
    """The legacy ``choices[].logprobs`` of /v1/completions (``offset``: text before these)."""
    if not logprobs:
        return None
    offsets: list[int] = []
    at = offset
    for lp in logprobs:
        offsets.append(at)
        at += len(lp.text)
    return {
        "tokens": [lp.text for lp in logprobs],
        "token_logprobs": [lp.logprob for lp in logprobs],
        "top_logprobs": [{t.text: t.logprob for t in lp.top} for lp in logprobs],
        "text_offset": offsets,
    }


def modeld_info(session_id: str, status: PrefixStatus, message: int | None) -> dict[str, Any]:
    """The ``modeld`` extension object: which session served the turn and why it was warm."""
    reuse = status.reuse
    info: dict[str, Any] = {
        "session_id": session_id,
        "reuse": reuse.outcome,
        "reason": reuse.reason,
        "reused_tokens": status.reused_tokens,
        "prefilled_tokens": status.prefilled_tokens,
    }
    if reuse.diverged_at_token is not None:
        info["diverged_at_token"] = reuse.diverged_at_token
        if message is not None:
            info["diverged_at_message"] = message
    return info


def chat_response(
    turn: Turn,
    text: str,
    final: StreamChunk,
    extension: dict[str, Any],
    logprobs: tuple[TokenLogprob, ...] = (),
) -> dict[str, Any]:
    calls = tool_calls_dicts(turn, final)
    message: dict[str, Any] = {
        "role": "assistant",
        "content": text or (None if calls else ""),
        "refusal": None,
    }
    if calls:
        message["tool_calls"] = calls
    return {
        "id": f"chatcmpl-{turn.id}",
        "object": "chat.completion",
        "created": turn.created,
        "model": turn.model,
        "choices": [
            {
                "index": 0,
                "message": message,
                "logprobs": chat_logprobs(logprobs),
                "finish_reason": finish_reason(final),
            }
        ],
        "usage": usage_dict(final.usage),
        "system_fingerprint": None,
        "modeld": extension,
    }


def chat_chunk(
    turn: Turn,
    delta: dict[str, Any] | None,
    finish: str | None = None,
    usage: Usage | None = None,
    extension: dict[str, Any] | None = None,
    logprobs: dict[str, Any] | None = None,
) -> dict[str, Any]:
    """One ``chat.completion.chunk``; with ``delta`` None, the usage-only last chunk."""
    chunk: dict[str, Any] = {
        "id": f"chatcmpl-{turn.id}",
        "object": "chat.completion.chunk",
        "created": turn.created,
        "model": turn.model,
        "system_fingerprint": None,
        "choices": []
        if delta is None
        else [{"index": 0, "delta": delta, "logprobs": logprobs, "finish_reason": finish}],
    }
    if turn.include_usage:
        chunk["usage"] = usage_dict(usage) if delta is None else None
    if extension is not None:
        chunk["modeld"] = extension
    return chunk


def completion_response(
    turn: Turn,
    text: str,
    final: StreamChunk,
    extension: dict[str, Any],
    logprobs: tuple[TokenLogprob, ...] = (),
) -> dict[str, Any]:
    return {
        "id": f"cmpl-{turn.id}",
        "object": "text_completion",
        "created": turn.created,
        "model": turn.model,
        "choices": [
            {
                "index": 0,
                "text": text,
                "logprobs": completion_logprobs(logprobs, 0),
                "finish_reason": finish_reason(final),
            }
        ],
        "usage": usage_dict(final.usage),
        "system_fingerprint": None,
        "modeld": extension,
    }


def completion_chunk(
    turn: Turn,
    text: str | None,
    finish: str | None = None,
    usage: Usage | None = None,
    extension: dict[str, Any] | None = None,
    logprobs: dict[str, Any] | None = None,
) -> dict[str, Any]:
    chunk: dict[str, Any] = {
        "id": f"cmpl-{turn.id}",
        "object": "text_completion",
        "created": turn.created,
        "model": turn.model,
        "system_fingerprint": None,
        "choices": []
        if text is None
        else [{"index": 0, "text": text, "logprobs": logprobs, "finish_reason": finish}],
    }
    if turn.include_usage:
        chunk["usage"] = usage_dict(usage) if text is None else None
    if extension is not None:
        chunk["modeld"] = extension
    return chunk


def models_response(entries: list[tuple[str, int]]) -> dict[str, Any]:
    return {
        "object": "list",
        "data": [
            {"id": name, "object": "model", "created": created, "owned_by": "modeld"}
            for name, created in entries
        ],
    }
