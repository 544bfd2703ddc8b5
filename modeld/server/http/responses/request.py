"""OpenAI's Responses API (``POST /v1/responses``, ``GET|DELETE /v1/responses/{id}``): what
Codex CLI speaks. The request as a Turn (here), the answers (``answer.py``), the routes
(``routes.py``), stored responses (``store.py``).

Field by field (``blueprints/0019-agent-apis.md``):

* ``input`` (a string, or items: ``message`` with ``input_text``/``output_text`` parts and roles
  user, assistant, system, developer; ``function_call`` (with its ``namespace``) and
  ``function_call_output``; ``reasoning``, accepted in history: with the assistant ``message``
  after it, one assistant turn; ``input_image``/``input_file`` parts a named placeholder in an
  earlier item, refused by name in the newest) and ``instructions`` (the first system message; not
  carried over by ``previous_response_id``, as OpenAI defines it).
* ``tools``: ``function`` tools are flat (``name``/``parameters`` at the top level);
  ``namespace`` tools (Codex's sub-agents) are flattened into their functions, which the model
  sees as ``NAMESPACE.NAME`` (their calls come back with ``namespace`` and ``name``); hosted tools that cannot run here
  (``web_search``, ``file_search``, ``computer_use``, image generation, ...) are left out of the
  prompt and listed in the response's ``modeld.omitted_tools``, never a 400. ``tool_choice``,
  ``parallel_tool_calls`` (every call parsed), ``text.format`` (``json_schema``,
  ``json_object``), ``max_output_tokens``, ``temperature``, ``top_p``, ``top_logprobs``.
* ``previous_response_id`` continues a stored conversation on its warm session, so a client
  may send only the new input; ``store`` (default true) keeps the response (retrievable, and
  continuable) in the data directory; with ``store: false`` the client resends everything and
  the longest common prefix still makes it warm. ``prompt_cache_key`` names the conversation.
* Accepted, no effect here (the hosted service's features): ``reasoning``, ``include``,
  ``metadata``, ``client_metadata``, ``safety_identifier``, ``service_tier``, ``truncation``,
  ``prompt_cache_retention``, ``stream_options``, ``user`` (a conversation key), ``background``
  false. Refused by name: ``prompt`` (stored prompt templates), ``conversation`` (the
  Conversations API), ``background`` true, ``max_tool_calls``.
* Events, each with a ``sequence_number``: ``response.created``, ``response.in_progress``,
  ``response.output_item.added``, ``response.content_part.added``,
  ``response.output_text.delta`` / ``.done``, ``response.content_part.done``,
  ``response.function_call_arguments.delta`` / ``.done``, ``response.reasoning_text.delta`` /
  ``.done``, ``response.output_item.done``, and ``response.completed`` (``response.incomplete``
  when cut off at ``max_output_tokens``, ``response.failed`` and ``error`` on failure).
* Usage: ``input_tokens`` the prompt, ``input_tokens_details.cached_tokens`` reused from warm
  state, ``input_tokens_details.cache_write_tokens`` the stable prefix computed this turn,
  ``output_tokens`` and ``output_tokens_details.reasoning_tokens``.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import replace
from typing import Any

from modeld.contract import DecodeConfig
from modeld.errors import echo
from modeld.server.http.chat_template import template_args
from modeld.server.http.errors import bad, unsupported
from modeld.server.http.fields import MAX_KEY_CHARS, boolean, integer, model_name, obj, refuse_unknown, string
from modeld.server.http.requests import (
    SamplerField,
    SamplerMap,
    checked_call,
    conversation_keys,
    function_tool,
    ident,
    key_value,
    media_omitted,
    response_format,
    samplers,
    text_parts,
    tool_choice,
    tools_json_of,
)
from modeld.server.http.responses.store import Stored
from modeld.server.http.turn import Message, Turn
from modeld.settings import Limits

__all__ = ["SAMPLERS", "input_messages", "parse_response_request"]

SAMPLERS: SamplerMap = {
    "temperature": SamplerField("temperature", high=2.0),
    "top_p": SamplerField("top_p", unset=0.0),
    "top_logprobs": SamplerField("top_logprobs"),
}
"""The Responses API's sampler fields (a ``top_p`` of 0 is the default's, unset)."""
TEXT_PARTS = {
    "input_text": "text",
    "output_text": "text",
    "text": "text",
    "summary_text": "text",
    "reasoning_text": "text",
    "refusal": "refusal",
}

_TOP_LEVEL = frozenset(
    {
        "model",
        "input",
        "instructions",
        "tools",
        "tool_choice",
        "parallel_tool_calls",
        "text",
        "max_output_tokens",
        "temperature",
        "top_p",
        "top_logprobs",
        "stream",
        "store",
        "previous_response_id",
        "prompt_cache_key",
        "user",
        # accepted, no effect here
        "reasoning",
        "include",
        "metadata",
        "client_metadata",
        "safety_identifier",
        "service_tier",
        "truncation",
        "prompt_cache_retention",
        "stream_options",
        "background",
    }
)
_REFUSED = {
    "prompt": "stored prompt templates are a hosted feature modeld does not have",
    "conversation": "the Conversations API is a hosted feature; continue with previous_response_id instead",
    "max_tool_calls": "modeld cannot cap the number of tool calls across a response",
}
_HOSTED = frozenset(
    {
        "web_search",
        "web_search_preview",
        "web_search_2025_08_26",
        "file_search",
        "computer_use",
        "computer_use_preview",
        "computer",
        "image_generation",
        "code_interpreter",
        "mcp",
        "local_shell",
        "tool_search",
    }
)
ROLES = {"user": "user", "assistant": "assistant", "system": "system", "developer": "system"}


# --- the request ----------------------------------------------------------------------------------


def _parts(content: Any, where: str) -> str:
    return "\n".join(_texts(content, where))


def _texts(content: Any, where: str) -> list[str]:
    """A string, or the texts of an array of content parts (text parts only)."""
    return text_parts(content, where, TEXT_PARTS)


def input_messages(value: Any, limits: Limits, where: str = "input") -> list[Message]:
    """The ``input`` items as the conversation's messages (calls join their assistant turn)."""
    if isinstance(value, str):
        return [Message("user", value)]
    if not isinstance(value, list):
        raise bad(where, f"{where} must be a string or an array of items")
    limits.check("max_messages", len(value), f"items in {where}")
    out: list[Message] = []
    for i, item in enumerate(value):
        at = f"{where}[{i}]"
        if not isinstance(item, dict):
            raise bad(at, f"{at} must be an object")
        kind = item.get("type", "message")
        if kind == "message":
            role = ROLES.get(item.get("role"))  # type: ignore[arg-type]
            if role is None:
                raise bad(f"{at}.role", f"{at}.role must be user, assistant, system or developer")
            texts = _texts(item.get("content"), f"{at}.content")
            # Several parts stay parts (Codex sends its environment and the prompt so), as
            # llama-server hands them to the template; joined, they are one per line.
            text, parts = "\n".join(texts), tuple(texts) if len(texts) > 1 else ()
            last = out[-1] if out else None
            if role == "assistant" and last is not None and _thought_only(last):
                out[-1] = replace(
                    last, content=text, parts=parts
                )  # a reasoning item and its message: one turn
            else:
                out.append(Message(role, text, parts=parts))
        elif kind == "function_call":
            call = checked_call(item.get("call_id"), _qualified(item, at), item.get("arguments", "{}"), at)
            if out and out[-1].role == "assistant":  # parallel calls: one assistant turn
                last = out[-1]
                out[-1] = replace(last, calls=(*last.calls, call))
            else:
                out.append(Message("assistant", "", (call,)))
        elif kind == "function_call_output":
            call_id = ident(item.get("call_id"), f"{at}.call_id")
            output = item.get("output")
            text = output if isinstance(output, str) else _parts(output, f"{at}.output")
            out.append(Message("tool", text, tool_call_id=call_id))
        elif kind == "reasoning":
            thought = _parts(item.get("content") or item.get("summary") or [], f"{at}.content")
            if out and out[-1].role == "assistant" and not out[-1].content:
                out[-1] = replace(out[-1], reasoning=out[-1].reasoning + thought)
            else:
                out.append(Message("assistant", "", (), thought))
        elif kind == "item_reference":
            raise unsupported(f"{at}.type", f"{at}: item references are not supported; send the item itself")
        else:
            raise unsupported(f"{at}.type", f"{at} of type {echo(kind)} is not supported")
    return [m for m in out if m.role != "assistant" or m.content or m.calls or m.reasoning]


def _thought_only(message: Message) -> bool:
    """An assistant turn that so far holds only its reasoning (a ``reasoning`` item)."""
    return (
        message.role == "assistant" and not message.content and not message.calls and bool(message.reasoning)
    )


def _qualified(item: Mapping[str, Any], at: str) -> object:
    """A call's name as the model saw its tool: ``NAMESPACE.NAME`` for a namespaced tool's call
    (Codex's sub-agent tools), else the name."""
    namespace = item.get("namespace")
    if namespace is None or namespace == "":
        return item.get("name")
    name = item.get("name")
    ident(namespace, f"{at}.namespace")
    return f"{namespace}.{name}" if isinstance(name, str) else name


def _functions(tools: Any, where: str, namespace: str = "") -> tuple[list[dict[str, object]], list[str]]:
    if not isinstance(tools, list):
        raise bad(where, f"{where} must be an array")
    functions: list[dict[str, object]] = []
    hosted: list[str] = []
    for i, tool in enumerate(tools):
        at = f"{where}[{i}]"
        if not isinstance(tool, dict):
            raise bad(at, f"{at} must be an object")
        kind = tool.get("type")
        if kind == "function":
            refuse_unknown(
                tool, frozenset({"type", "name", "description", "parameters", "strict", "defer_loading"}), at
            )
            name = tool.get("name")
            if namespace and isinstance(name, str):
                name = f"{namespace}.{name}"  # unique across namespaces; the call carries both back
            functions.append(function_tool(name, tool.get("description"), tool.get("parameters"), at))
        elif kind == "namespace" and not namespace:
            space = ident(tool.get("name"), f"{at}.name")
            inner, inner_hosted = _functions(tool.get("tools", []), f"{at}.tools", space)
            functions += inner
            hosted += inner_hosted
        elif isinstance(kind, str) and len(kind) <= MAX_KEY_CHARS:
            hosted.append(kind)  # a hosted or custom tool modeld cannot run: left out of the prompt
        else:
            raise bad(f"{at}.type", f"{at}.type must be a string")
    return functions, hosted


def _tools(body: Mapping[str, Any], limits: Limits) -> tuple[str, tuple[str, ...], list[str]]:
    tools = body.get("tools")
    if tools is None:
        return "", (), []
    if isinstance(tools, list):
        limits.check("max_tools", len(tools), "tools")
    functions, hosted = _functions(tools, "tools")
    names = [str(f["function"]["name"]) for f in functions]  # type: ignore[index]
    return tools_json_of(functions), tuple(hosted), names


def _choice(body: Mapping[str, Any], names: list[str]) -> str:
    choice = body.get("tool_choice")
    if isinstance(choice, dict) and choice.get("type") in _HOSTED:
        raise unsupported(
            "tool_choice",
            f"tool_choice forces the hosted tool {echo(choice.get('type'))}, which modeld cannot run",
        )
    mode = tool_choice(choice)
    if mode not in ("auto", "none") and not names:
        raise bad("tool_choice", f"tool_choice {echo(choice)} needs function tools, and none were given")
    if mode not in ("auto", "none", "required") and mode not in names:
        raise bad("tool_choice", f"tool_choice names {echo(mode)}, which is not one of the tools")
    return mode


def parse_response_request(
    body: Mapping[str, Any], headers: Mapping[str, str], previous: Stored | None, limits: Limits
) -> tuple[Turn, bool, tuple[Message, ...]]:
    """A Responses request as a Turn, whether to store it, and its new input messages."""
    model = model_name(body)
    for name, why in _REFUSED.items():
        if body.get(name) is not None:
            raise unsupported(name, f"{name} is not supported: {why}")
    if body.get("background"):
        raise unsupported(
            "background", "background responses are not supported: modeld answers while you wait"
        )
    refuse_unknown(body, _TOP_LEVEL)
    if "input" not in body or body["input"] is None:
        raise bad("input", "input is required", code="missing_required_parameter")
    with media_omitted() as media:  # images (Codex's view_image): placeholders in earlier turns
        new = input_messages(body["input"], limits)
    given = body["input"]
    omitted = media.settle(len(given) if isinstance(given, list) else 1)
    instructions = string(body, "instructions", limit=1 << 24) or ""
    history = list(previous.history) if previous is not None else []
    system = [Message("system", instructions)] if instructions else []
    messages = tuple(system + history + new)
    if not messages:
        raise bad("input", "the conversation is empty")
    tools_json, hosted, names = _tools(body, limits)
    choice = _choice(body, names)  # "none" keeps the tools in the prompt (its warm prefix): no call is made
    text = obj(body, "text") or {}
    refuse_unknown(text, frozenset({"format", "verbosity"}), "text")
    values: dict[str, Any] = {
        "tool_choice": choice,
        "constraint": response_format(text.get("format"), "text.format"),
        **samplers(body, SAMPLERS),
    }
    top_logprobs = values.pop("top_logprobs", None)
    include = body.get("include") or []
    if not isinstance(include, list) or not all(isinstance(i, str) for i in include):
        raise bad("include", "include must be an array of strings")
    if "message.output_text.logprobs" in include or top_logprobs:
        values["logprobs"], values["top_logprobs"] = True, top_logprobs or 0
    stream = boolean(body, "stream") or False
    store = boolean(body, "store")
    parallel = boolean(body, "parallel_tool_calls")
    key = key_value("prompt_cache_key", body.get("prompt_cache_key"))
    turn = Turn(
        api="openai.responses",
        model=model,
        decode=DecodeConfig(**values),
        keys=conversation_keys(
            headers,
            prompt_cache_key=key or (previous.conversation if previous is not None else ""),
            user=key_value("user", body.get("user")),
        ),
        stream=stream,
        messages=messages,
        tools_json=tools_json,
        max_tokens=integer(body, "max_output_tokens", 1, 1 << 30),
        parallel_tool_calls=parallel is not False,
        omitted_tools=hosted,
        template_args=_reasoning(body),
        omitted_content=omitted,
    )
    return turn, store is not False, tuple(new)


def _reasoning(body: Mapping[str, Any]) -> tuple[tuple[str, object], ...]:
    """``reasoning.effort`` as the template's (``none``: thinking off); its summary settings are
    the hosted service's (no effect here)."""
    reasoning = obj(body, "reasoning")
    if reasoning is None:
        return ()
    refuse_unknown(reasoning, frozenset({"effort", "summary", "generate_summary"}), "reasoning")
    effort = reasoning.get("effort")
    return (
        template_args(reasoning_effort=effort, effort_field="reasoning.effort") if effort is not None else ()
    )
