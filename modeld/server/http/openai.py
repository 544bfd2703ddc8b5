"""OpenAI request bodies to the session contract, and contract results to OpenAI responses.

No web framework here: plain dicts in, :class:`Turn` (what to run on a session) out, and
dicts back. Rules (``blueprints/0014-openai-http.md``):

* Every field is accounted for. Fields modeld honours are mapped; OpenAI fields it cannot
  honour are refused by name with a 400 (``n`` other than 1, ``logprobs``, penalties other
  than 0, audio, ...), never ignored; what waits for another issue is refused in
  ``features.py``. A few fields are accepted and documented as having no effect here because
  they describe the hosted service (``store`` false, ``service_tier``, ``safety_identifier``).
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
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

import xxhash

from modeld.contract import DecodeConfig, PrefixInput, PrefixStatus, StreamChunk, SuffixInput, Usage
from modeld.errors import ModeldError, echo
from modeld.manifest import ContextManifest, Segment
from modeld.server.http.features import not_yet_supported

__all__ = [
    "ApiError",
    "Turn",
    "api_error",
    "chat_chunk",
    "chat_response",
    "completion_chunk",
    "completion_response",
    "models_response",
    "parse_chat",
    "parse_completion",
    "usage_dict",
]

MAX_KEY_CHARS = 256
"""Longest conversation key (header, prompt_cache_key or user) kept as given."""
MAX_MESSAGES = 4096
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
    "logprobs": (None, False),
    "top_logprobs": (None, 0),
    "logit_bias": (None, {}),
    "frequency_penalty": (None, 0, 0.0),
    "presence_penalty": (None, 0, 0.0),
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
_SAMPLER_EXTENSIONS = ("top_k", "min_p", "repeat_penalty")


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


def _decode(body: Mapping[str, Any], mapped: set[str], max_tokens: int | None) -> DecodeConfig:
    """Samplers, stop strings and extension fields; max_tokens 0 stands for "the window"."""
    values: dict[str, Any] = {}
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
    for name in ("min_p", "repeat_penalty"):
        number = _number(body, name)
        if number is not None:
            values[name] = number
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


def _messages(body: Mapping[str, Any]) -> list[tuple[str, str]]:
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages:
        raise _bad("messages", "messages must be a non-empty array", code="missing_required_parameter")
    if len(messages) > MAX_MESSAGES:
        raise _bad("messages", f"{len(messages)} messages; the limit is {MAX_MESSAGES}")
    out: list[tuple[str, str]] = []
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
        out.append((role, _content(message, where)))
    return out


def _tools(body: Mapping[str, Any]) -> str:
    tools = body.get("tools")
    choice = body.get("tool_choice")
    if choice not in (None, "auto", "none", "required") and not isinstance(choice, dict):
        raise _bad(
            "tool_choice", f"tool_choice must be 'auto', 'none', 'required' or an object, got {echo(choice)}"
        )
    parallel = body.get("parallel_tool_calls")
    if parallel is not None and not isinstance(parallel, bool):
        raise _bad("parallel_tool_calls", "parallel_tool_calls must be a boolean")
    if tools is None or tools == []:
        return ""
    if not isinstance(tools, list) or not all(isinstance(t, dict) for t in tools):
        raise _bad("tools", "tools must be an array of tool objects")
    if choice == "none":
        return ""  # the model is not shown tools it may not call
    return json.dumps(tools, ensure_ascii=False)


def _split(messages: list[tuple[str, str]]) -> int:
    """How many messages form the stable prefix: through the last assistant message, else the
    leading system messages, and at least the first message (templates index messages[0])."""
    last_assistant = max((i for i, (role, _) in enumerate(messages) if role == "assistant"), default=-1)
    if last_assistant >= 0:
        return last_assistant + 1
    k = 0
    while k < len(messages) and messages[k][0] == "system":
        k += 1
    return max(k, 1)


def _auto_key(model: str, messages: list[tuple[str, str]]) -> str:
    """A conversation's identity when the client names none: its first system and user message."""
    h = xxhash.xxh3_64(model.encode())
    seen: set[str] = set()
    for role, content in messages:
        if role in ("system", "user") and role not in seen:
            seen.add(role)
            h.update(f"\0{role}\0".encode())
            h.update(content.encode("utf-8", errors="surrogatepass"))
        if seen == {"system", "user"}:
            break
    return f"auto:{h.hexdigest()}"


def parse_chat(body: Mapping[str, Any], *, conversation_header: str = "") -> Turn:
    """A ``/v1/chat/completions`` body as a Turn (raises :class:`ApiError`)."""
    model = _model(body)
    refusal = not_yet_supported(dict(body))
    if refusal is not None:
        raise _unsupported(*refusal)
    _check_neutral(body, _CHAT_ONLY_NEUTRAL)
    for name in _CHAT_ONLY_NEUTRAL:
        if body.get(name) is not None:
            raise _unsupported(name, f"{name} is a /v1/completions field")
    stream, include_usage = _stream_options(body)
    fmt = body.get("response_format")
    if fmt is not None and not (isinstance(fmt, dict) and fmt.get("type") == "text"):
        raise _bad("response_format", 'response_format must be an object such as {"type": "text"}')
    max_tokens = _int(body, "max_completion_tokens", 1, 1 << 30)
    if max_tokens is None:
        max_tokens = _int(body, "max_tokens", 1, 1 << 30)
    messages = _messages(body)
    tools_json = _tools(body)
    k = _split(messages)
    prefix_parts: list[bytes] = []
    suffix_parts: list[bytes] = []
    segments: list[Segment] = []
    offset = 0
    for i, (role, content) in enumerate(messages):
        data = content.encode("utf-8", errors="surrogatepass")
        stable = i < k
        kind = "system" if i == 0 and role == "system" and stable else "history"
        segments.append(
            Segment(kind=kind, byte_start=offset, byte_end=offset + len(data), stable=stable, role=role)
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
    key = _key(body, conversation_header) or _auto_key(model, messages)
    return Turn(
        kind="chat",
        model=model,
        prompt_format="chat",
        prefix=PrefixInput(text=prefix_text, manifest=manifest, tools_json=tools_json),
        suffix=SuffixInput(text=suffix_text, manifest=manifest),
        decode=_decode(body, _CHAT_MAPPED, max_tokens),
        max_tokens_given=max_tokens is not None,
        stream=stream,
        include_usage=include_usage,
        conversation=key,
        roles=tuple(role for role, _ in messages[:k]),
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
    return Turn(
        kind="completion",
        model=model,
        prompt_format="raw",
        prefix=PrefixInput(text=prompt),
        suffix=None,
        decode=_decode(body, _COMPLETION_MAPPED, 16 if max_tokens is None else max_tokens),
        max_tokens_given=True,
        stream=stream,
        include_usage=include_usage,
        conversation=key,
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
    param = exc.details.get("field") or exc.details.get("limit") or None
    return ApiError(status, message, type=kind, code=_CODES.get(exc.reason, exc.reason), param=param)


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


def finish_reason(chunk: StreamChunk) -> str:
    return "length" if chunk.finish_reason == "length" else "stop"


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


def chat_response(turn: Turn, text: str, final: StreamChunk, extension: dict[str, Any]) -> dict[str, Any]:
    return {
        "id": f"chatcmpl-{turn.id}",
        "object": "chat.completion",
        "created": turn.created,
        "model": turn.model,
        "choices": [
            {
                "index": 0,
                "message": {"role": "assistant", "content": text, "refusal": None},
                "logprobs": None,
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
        else [{"index": 0, "delta": delta, "logprobs": None, "finish_reason": finish}],
    }
    if turn.include_usage:
        chunk["usage"] = usage_dict(usage) if delta is None else None
    if extension is not None:
        chunk["modeld"] = extension
    return chunk


def completion_response(
    turn: Turn, text: str, final: StreamChunk, extension: dict[str, Any]
) -> dict[str, Any]:
    return {
        "id": f"cmpl-{turn.id}",
        "object": "text_completion",
        "created": turn.created,
        "model": turn.model,
        "choices": [{"index": 0, "text": text, "logprobs": None, "finish_reason": finish_reason(final)}],
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
) -> dict[str, Any]:
    chunk: dict[str, Any] = {
        "id": f"cmpl-{turn.id}",
        "object": "text_completion",
        "created": turn.created,
        "model": turn.model,
        "system_fingerprint": None,
        "choices": []
        if text is None
        else [{"index": 0, "text": text, "logprobs": None, "finish_reason": finish}],
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
