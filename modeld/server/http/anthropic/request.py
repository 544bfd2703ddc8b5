"""Anthropic's Messages API (``POST /v1/messages``, ``POST /v1/messages/count_tokens``): what
Claude Code speaks.

The request becomes a Turn (here), the turn's events a ``message`` or its SSE stream
(:mod:`modeld.server.http.anthropic.answer`); the routes are ``routes.py``.
Field by field (``blueprints/0019-agent-apis.md``):

* ``system`` (a string or text blocks) is the first system message; a ``system`` message inside
  ``messages`` (Claude Code sends its environment so, after the first user message) is a system
  message where it stands; messages' content blocks:
  ``text``; an assistant's ``tool_use`` (a call, written back in the model's tool-call
  format) and ``thinking``/``redacted_thinking`` (accepted in history; the template decides
  what the model sees again); a user's ``tool_result`` (a string or text blocks; ``is_error``
  prefixes ``Error:``; its ``tool_reference`` blocks, Claude Code's ToolSearch, read ``Tool
  loaded: NAME``), which becomes a ``tool`` message. A message's text blocks are joined by a
  newline. ``image`` and ``document`` (also in a tool result) are named placeholders in an
  earlier message and refused by name in the newest (``requests.Media``): the models modeld
  serves read text, and a session must not die of a screenshot. Claude Code's billing header block (the first
  system block, ``x-anthropic-billing-header: ...``) changes on every request and means
  nothing to a model: it is left out of the prompt, so the system prompt stays warm.
* ``tools`` (``input_schema``; ``defer_loading``, ``strict``, ``cache_control`` accepted)
  become function tools; Anthropic's server tools (a ``type`` such as ``web_search_...``) cannot
  run here and are left out of the prompt. ``tool_choice`` ``auto``, ``any`` (a call is
  forced), ``tool`` (that call is forced), ``none`` (the tools stay in the prompt, its warm
  prefix, and no call is parsed); ``disable_parallel_tool_use`` keeps the
  first call. ``output_config.format`` (``json_schema``) is a constraint.
* ``stop_sequences``, ``temperature`` (0-1), ``top_p``, ``top_k``, ``max_tokens`` (0: only
  prefill, the documented way to warm the prompt cache). ``thinking``: with a reasoning model
  the thinking is shown as ``thinking`` blocks (``display: omitted`` sends them empty); without
  one it is accepted and yields none. Accepted with no effect (they describe the hosted
  service): ``metadata`` (its ``user_id`` names the conversation: Claude Code puts a
  ``session_id`` in it), ``context_management``, ``output_config.effort``, ``service_tier``,
  ``cache_control``, ``container``, ``inference_geo``, ``speed``, ``diagnostics``, and the
  ``anthropic-beta`` / ``anthropic-version`` headers.
* Stop reasons: ``end_turn``, ``max_tokens``, ``stop_sequence``, ``tool_use``. Usage is
  truthful about the cache: ``cache_read_input_tokens`` = prompt tokens reused from warm state,
  ``cache_creation_input_tokens`` = stable-prefix tokens computed this turn (now reusable),
  ``input_tokens`` = the rest of the prompt computed this turn; the three add up to the prompt.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from modeld.contract import DecodeConfig, ToolCall
from modeld.errors import echo
from modeld.server.http.chat_template import template_args
from modeld.server.http.dialect import Asked
from modeld.server.http.errors import bad
from modeld.server.http.fields import MAX_KEY_CHARS, integer, model_name, obj, refuse_unknown, stop_list
from modeld.server.http.requests import (
    SamplerField,
    SamplerMap,
    conversation_keys,
    function_tool,
    ident,
    key_value,
    media_omitted,
    response_format,
    samplers,
    text_part,
    text_parts,
    tools_json_of,
)
from modeld.server.http.turn import Message, Turn
from modeld.settings import Limits

__all__ = ["SAMPLERS", "MessagesAsked", "count_tokens_body", "parse_messages"]


@dataclass(frozen=True, kw_only=True)
class MessagesAsked(Asked):
    """A Messages request: its turn, and what to do with a reasoning model's thinking (``show``,
    ``omit``: empty blocks, ``drop``)."""

    thinking: str = "drop"


SAMPLERS: SamplerMap = {
    "temperature": SamplerField("temperature", high=1.0),
    "top_p": SamplerField("top_p", unset=0.0),
    "top_k": SamplerField("top_k"),
}
"""Anthropic's sampler fields (its temperature is 0-1; a ``top_p`` of 0 is unset)."""

SEPARATOR = "\n"
"""Between the text blocks of one message (llama.cpp joins a message's text parts so)."""
BILLING_HEADER = "x-anthropic-billing-header:"
"""Claude Code's first system block: a per-request attribution line, not an instruction."""

_TOP_LEVEL = frozenset(
    {
        "model",
        "messages",
        "system",
        "max_tokens",
        "stop_sequences",
        "stream",
        "temperature",
        "top_p",
        "top_k",
        "tools",
        "tool_choice",
        "metadata",
        "thinking",
        "output_config",
        # accepted, no effect here (the hosted service's features)
        "context_management",
        "service_tier",
        "cache_control",
        "container",
        "inference_geo",
        "speed",
        "diagnostics",
        "mcp_servers",
        "betas",
    }
)
_TOOL_FIELDS = frozenset(
    {
        "name",
        "description",
        "input_schema",
        "type",
        "cache_control",
        "defer_loading",
        "strict",
        "eager_input_streaming",
        "input_examples",
        "allowed_callers",
    }
)

# --- the request ----------------------------------------------------------------------------------


def _text_blocks(value: Any, where: str) -> list[str]:
    """A string, or an array of blocks of which only ``text`` carries text (images and documents
    are refused by name)."""
    return text_parts(value, where, noun="content blocks")


def _system(value: Any) -> str:
    if value is None:
        return ""
    if isinstance(value, list):
        kept = [
            b
            for b in value
            if not (
                isinstance(b, dict)
                and isinstance(b.get("text"), str)
                and b["text"].startswith(BILLING_HEADER)
            )
        ]
        return "\n\n".join(_text_blocks(kept, "system"))
    return "\n\n".join(_text_blocks(value, "system"))


def _referenced(block: object, at: str) -> object:
    """A ``tool_reference`` block (Claude Code's ToolSearch names the tools it found so; the next
    request carries their schemas) as the text Claude Code itself writes for one: ``Tool loaded``
    with the tool's name."""
    if isinstance(block, dict) and block.get("type") == "tool_reference":
        return {"type": "text", "text": f"Tool loaded: {ident(block.get('tool_name'), f'{at}.tool_name')}"}
    return block


def _tool_result(block: Mapping[str, Any], at: str) -> Message:
    call_id = ident(block.get("tool_use_id"), f"{at}.tool_use_id")
    content = block.get("content")
    if isinstance(content, list):
        content = [_referenced(b, f"{at}.content.{j}") for j, b in enumerate(content)]
    text = "" if content is None else "\n".join(_text_blocks(content, f"{at}.content"))
    is_error = block.get("is_error")
    if is_error is not None and not isinstance(is_error, bool):
        raise bad(f"{at}.is_error", f"{at}.is_error must be a boolean")
    return Message("tool", f"Error: {text}" if is_error else text, tool_call_id=call_id)


def _messages(body: Mapping[str, Any], limits: Limits) -> list[Message]:
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages:
        raise bad("messages", "messages must be a non-empty array")
    limits.check("max_messages", len(messages), "messages")
    out: list[Message] = []
    for i, message in enumerate(messages):
        where = f"messages.{i}"
        if not isinstance(message, dict):
            raise bad(where, f"{where} must be an object")
        role = message.get("role")
        if role not in ("user", "assistant", "system"):
            raise bad(f"{where}.role", f"{where}.role must be user, assistant or system, got {echo(role)}")
        refuse_unknown(message, frozenset({"role", "content"}), where)
        content = message.get("content")
        if isinstance(content, str):
            out.append(Message(role, content))
            continue
        if role == "system":  # Claude Code sends its environment as a system message (text blocks)
            out.append(Message("system", SEPARATOR.join(_text_blocks(content, f"{where}.content"))))
            continue
        if not isinstance(content, list):
            raise bad(f"{where}.content", f"{where}.content must be a string or an array of content blocks")
        limits.check("max_messages", len(content), f"content blocks in {where}")
        if role == "assistant":
            out.append(_assistant(content, where))
        else:
            out.extend(_user(content, where))
    return out


def _assistant(content: list[Any], where: str) -> Message:
    text: list[str] = []
    reasoning: list[str] = []
    calls: list[ToolCall] = []
    for j, block in enumerate(content):
        at = f"{where}.content.{j}"
        if not isinstance(block, dict):
            raise bad(at, f"{at} must be an object")
        kind = block.get("type")
        if kind == "text":
            text.append(text_part(block, at) or "")
        elif kind == "tool_use":
            call_id, name = ident(block.get("id"), f"{at}.id"), ident(block.get("name"), f"{at}.name")
            arguments = block.get("input", {})
            if not isinstance(arguments, dict):
                raise bad(f"{at}.input", f"{at}.input must be an object")
            calls.append(ToolCall(call_id, name, json.dumps(arguments, ensure_ascii=False)))
        elif kind == "thinking":
            thought = block.get("thinking", "")
            if not isinstance(thought, str):
                raise bad(f"{at}.thinking", f"{at}.thinking must be a string")
            reasoning.append(thought)
        elif kind == "redacted_thinking":
            continue  # opaque to modeld: nothing to show the model
        else:
            text_part(block, at)  # refuses images, documents and unknown blocks by name
    parts = tuple(text) if len(text) > 1 else ()  # several text blocks: parts, as llama-server reads them
    return Message("assistant", SEPARATOR.join(text), tuple(calls), "".join(reasoning), parts=parts)


def _user(content: list[Any], where: str) -> list[Message]:
    """A user turn: its tool results as ``tool`` messages, its text as one user message."""
    out: list[Message] = []
    text: list[str] = []
    for j, block in enumerate(content):
        at = f"{where}.content.{j}"
        if not isinstance(block, dict):
            raise bad(at, f"{at} must be an object")
        if block.get("type") == "tool_result":
            if text:
                out.append(_user_text(text))
                text = []
            out.append(_tool_result(block, at))
        else:
            text.append(text_part(block, at) or "")
    if text or not out:
        out.append(_user_text(text))
    return out


def _user_text(text: list[str]) -> Message:
    """A user message of text blocks; several are its content's parts (a template that reads
    parts sees each, another their text joined by newlines: what llama-server does)."""
    return Message("user", SEPARATOR.join(text), parts=tuple(text) if len(text) > 1 else ())


def _tools(body: Mapping[str, Any], limits: Limits) -> tuple[str, tuple[str, ...], list[str]]:
    """(tools JSON, hosted tool types left out, tool names)."""
    tools = body.get("tools")
    if tools is None:
        return "", (), []
    if not isinstance(tools, list):
        raise bad("tools", "tools must be an array")
    limits.check("max_tools", len(tools), "tools")
    functions: list[dict[str, object]] = []
    hosted: list[str] = []
    for i, tool in enumerate(tools):
        where = f"tools.{i}"
        if not isinstance(tool, dict):
            raise bad(where, f"{where} must be an object")
        kind = tool.get("type")
        if kind not in (None, "custom"):
            if not isinstance(kind, str) or len(kind) > MAX_KEY_CHARS:
                raise bad(f"{where}.type", f"{where}.type must be a string")
            hosted.append(kind)  # a server tool (web search, code execution...): not runnable here
            continue
        refuse_unknown(tool, _TOOL_FIELDS, where)
        functions.append(
            function_tool(tool.get("name"), tool.get("description"), tool.get("input_schema"), where)
        )
    names = [str(f["function"]["name"]) for f in functions]  # type: ignore[index]
    return tools_json_of(functions), tuple(hosted), names


def _tool_choice(body: Mapping[str, Any], names: list[str]) -> tuple[str, bool]:
    """(DecodeConfig.tool_choice, parallel calls allowed)."""
    choice = body.get("tool_choice")
    if choice is None:
        return "auto", True
    if not isinstance(choice, dict):
        raise bad("tool_choice", 'tool_choice must be an object such as {"type": "auto"}')
    refuse_unknown(choice, frozenset({"type", "name", "disable_parallel_tool_use"}), "tool_choice")
    kind = choice.get("type")
    parallel = choice.get("disable_parallel_tool_use")
    if parallel is not None and not isinstance(parallel, bool):
        raise bad("tool_choice.disable_parallel_tool_use", "disable_parallel_tool_use must be a boolean")
    if kind == "none":
        return "none", not parallel
    if kind in ("auto", "any") or kind == "tool":
        if kind != "auto" and not names:
            raise bad("tool_choice", f"tool_choice {kind} needs tools, and none were given")
        if kind == "tool":
            name = choice.get("name")
            if not isinstance(name, str) or name not in names:
                raise bad(
                    "tool_choice.name", f"tool_choice.name must name one of the tools, got {echo(name)}"
                )
            return name, not parallel
        return ("required" if kind == "any" else "auto"), not parallel
    raise bad("tool_choice.type", f"tool_choice.type must be auto, any, tool or none, got {echo(kind)}")


def _thinking(body: Mapping[str, Any]) -> str:
    """What to do with a reasoning model's thinking: ``show``, ``omit`` (empty blocks), ``drop``."""
    thinking = obj(body, "thinking")
    if thinking is None:
        return "drop"
    kind = thinking.get("type")
    if kind not in ("enabled", "adaptive", "disabled", "between_tools"):
        raise bad("thinking.type", f"thinking.type must be enabled, adaptive or disabled, got {echo(kind)}")
    refuse_unknown(thinking, frozenset({"type", "budget_tokens", "display"}), "thinking")
    integer(thinking, "budget_tokens", 0, 1 << 30, param="thinking.budget_tokens")
    display = thinking.get("display")
    if display not in (None, "summarized", "omitted"):
        raise bad("thinking.display", f"thinking.display must be summarized or omitted, got {echo(display)}")
    if kind == "disabled":
        return "drop"
    return "omit" if display == "omitted" else "show"


def _thinking_args(body: Mapping[str, Any]) -> tuple[tuple[str, object], ...]:
    """``thinking.type`` as the template's ``enable_thinking`` (checked by :func:`_thinking`):
    disabled turns it off, enabled and adaptive on; absent leaves the template's default."""
    thinking = obj(body, "thinking")
    if thinking is None:
        return ()
    return template_args(enable_thinking=thinking.get("type") != "disabled")


MAX_USER_ID_CHARS = 4096


def _session(metadata: Mapping[str, Any] | None) -> str:
    """The conversation named by ``metadata.user_id``: Claude Code's JSON there holds a
    ``session_id``; any other string is the user's own id."""
    if metadata is None:
        return ""
    refuse_unknown(metadata, frozenset({"user_id"}), "metadata")
    user = metadata.get("user_id")
    if user is None or user == "":
        return ""
    if not isinstance(user, str) or len(user) > MAX_USER_ID_CHARS:
        raise bad(
            "metadata.user_id", f"metadata.user_id must be a string of at most {MAX_USER_ID_CHARS} characters"
        )
    if user.startswith("{"):
        try:
            parsed = json.loads(user)
        except (ValueError, RecursionError):
            parsed = None
        if isinstance(parsed, dict) and isinstance(parsed.get("session_id"), str) and parsed["session_id"]:
            return key_value("metadata.user_id.session_id", parsed["session_id"])
    return key_value("metadata.user_id", user)


def parse_messages(
    body: Mapping[str, Any], headers: Mapping[str, str], limits: Limits, *, count_only: bool = False
) -> MessagesAsked:
    """A Messages request as a Turn, and what to do with thinking (``show``, ``omit``, ``drop``)."""
    model = model_name(body, code="invalid_value")
    refuse_unknown(body, _TOP_LEVEL)
    max_tokens = 1 if count_only else integer(body, "max_tokens", 0, 1 << 30)
    if max_tokens is None:
        raise bad("max_tokens", "max_tokens is required")
    with media_omitted() as media:  # images, documents: placeholders in earlier turns
        system = _system(body.get("system"))
        messages = ([Message("system", system)] if system else []) + _messages(body, limits)
    omitted = media.settle(len(body["messages"]), refuse=not count_only)
    tools_json, hosted, names = _tools(body, limits)
    choice, parallel = _tool_choice(body, names)  # "none" keeps the tools in the prompt (its warm prefix)
    output = obj(body, "output_config") or {}
    refuse_unknown(output, frozenset({"effort", "format"}), "output_config")
    constraint = response_format(output.get("format"), "output_config.format")
    values: dict[str, Any] = {"tool_choice": choice, "constraint": constraint, **samplers(body, SAMPLERS)}
    stream = body.get("stream")
    if stream is not None and not isinstance(stream, bool):
        raise bad("stream", "stream must be a boolean")
    metadata = obj(body, "metadata")
    turn = Turn(
        api="anthropic.messages",
        model=model,
        decode=DecodeConfig(stop=stop_list(body, limits, "stop_sequences"), **values),
        keys=conversation_keys(headers, session=_session(metadata)),
        stream=bool(stream),
        messages=tuple(messages),
        tools_json=tools_json,
        max_tokens=max_tokens,
        parallel_tool_calls=parallel,
        omitted_tools=hosted,
        template_args=_thinking_args(body),
        omitted_content=omitted,
    )
    return MessagesAsked(turn, thinking=_thinking(body))


def count_tokens_body(body: Mapping[str, Any]) -> dict[str, Any]:
    """A count_tokens request is a Messages request without max_tokens (it is ignored)."""
    return {k: v for k, v in body.items() if k not in ("max_tokens", "stream")}
