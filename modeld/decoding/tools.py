"""Tool definitions, the formats models write calls in, and the constraint that forces a call.

What:

* :func:`parse_tools` reads OpenAI-style tool definitions (``[{"type": "function", "function":
  {"name", "description", "parameters"}}]`` or the flat ``{"name", "parameters"}``) into
  :class:`ToolSpec` values; exit tools are the same shape, marked ``exit=True``.
* :func:`detect_format` recognises the tool-call format from a chat template's text.
* :func:`forced_call_constraint` builds the GBNF constraint for ``tool_choice`` ``required``
  (a call of any tool) or a tool's name (a call of that tool): the call's markers in the
  model's format around ``{"name": ..., "arguments": <the tool's parameters schema>}``, so even
  a weak model writes a well-formed call with valid arguments.

Formats (``blueprints/0018-constraints-and-tool-calls.md``)::

    hermes   <tool_call>\\n{"name": "f", "arguments": {...}}\\n</tool_call>   (Hermes, Qwen 2/2.5/3)
    llama3   {"name": "f", "parameters": {...}}   at the start of the answer, optionally after
             <|python_tag|>, several separated by ";"                       (Llama 3.1-3.3)
    mistral  [TOOL_CALLS][{"name": "f", "arguments": {...}, "id": "..."}]    (Mistral v3)
             [TOOL_CALLS]f[ARGS]{...}                                       (Mistral v11+)

What not: no parsing of output (:mod:`modeld.decoding.toolcalls`), no schema validation of
arguments in ``auto`` mode (a forced call is valid by construction).
"""

from __future__ import annotations

import json
import re
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from modeld.contract import Constraint, ToolCall
from modeld.decoding.gbnf import gbnf_literal
from modeld.decoding.schema import JSON_PRIMITIVES, schema_to_gbnf
from modeld.errors import InvalidArgumentError, LimitExceededError, UnsupportedError

__all__ = [
    "FORMATS",
    "ToolSpec",
    "detect_format",
    "forced_call_constraint",
    "format_calls",
    "parse_tools",
]

FORMATS: tuple[str, ...] = ("hermes", "llama3", "mistral")
DEFAULT_FORMAT = "hermes"
"""Used to force a call when the template's format is not recognised (the most common one)."""
_NAME = re.compile(r"[A-Za-z0-9_.:-]{1,128}")


@dataclass(frozen=True, slots=True)
class ToolSpec:
    """One tool: its name, its parameters' JSON schema (parsed), and whether it is an exit tool."""

    name: str
    parameters: Any
    exit: bool = False
    description: str = ""


def parse_tools(
    tools_json: str, *, field: str, exit: bool = False, limit: int | None = None
) -> list[ToolSpec]:
    """Tool definitions from JSON text (empty text: none), at most ``limit`` of them (the
    daemon's ``Limits.max_tools``; None: unbounded)."""
    if not tools_json:
        return []
    try:
        raw = json.loads(tools_json)
    except ValueError as exc:
        raise InvalidArgumentError(f"{field} is not valid JSON: {exc}", field=field) from exc
    if not isinstance(raw, list):
        raise InvalidArgumentError(f"{field} must be a JSON array of tool definitions", field=field)
    if limit is not None and len(raw) > limit:
        raise LimitExceededError(
            f"{field} has {len(raw)} tools; the limit is {limit} (modeld serve --max-tools)",
            limit="max_tools",
            value=len(raw),
            maximum=limit,
        )
    out: list[ToolSpec] = []
    for i, item in enumerate(raw):
        fn = item.get("function", item) if isinstance(item, dict) else None
        if not isinstance(fn, dict):
            raise InvalidArgumentError(f"{field}[{i}] must be an object", field=field)
        name = fn.get("name")
        if not isinstance(name, str) or not _NAME.fullmatch(name):
            raise InvalidArgumentError(
                f"{field}[{i}].name must be 1-128 letters, digits or _.:- (got {name!r})", field=field
            )
        params = fn.get("parameters", {"type": "object"})
        if not isinstance(params, dict | bool):
            raise InvalidArgumentError(f"{field}[{i}].parameters must be a JSON schema", field=field)
        desc = fn.get("description", "")
        out.append(ToolSpec(name, params, exit, desc if isinstance(desc, str) else ""))
    names = [t.name for t in out]
    if len(set(names)) != len(names):
        raise InvalidArgumentError(f"{field} names a tool twice", field=field)
    return out


def detect_format(chat_template: str) -> str:
    """The tool-call format a chat template writes, or ``""`` if not recognised."""
    if "<tool_call>" in chat_template:
        return "hermes"
    if "[TOOL_CALLS]" in chat_template:
        return "mistral"
    if "<|python_tag|>" in chat_template or (
        "<|start_header_id|>" in chat_template and "parameters" in chat_template
    ):
        return "llama3"
    return ""


def forced_call_constraint(tools: list[ToolSpec], choice: str, fmt: str) -> Constraint:
    """The ``grammar`` constraint whose sentences are exactly one call, in format ``fmt``, of
    ``choice`` (a tool's name) or of any tool (``required``)."""
    if not tools:
        raise InvalidArgumentError(
            f"tool_choice {choice!r} needs tools, and none were given", field="tool_choice"
        )
    if choice == "required":
        chosen = tools
    else:
        chosen = [t for t in tools if t.name == choice]
        if not chosen:
            raise InvalidArgumentError(
                f"tool_choice names {choice!r}, which is not one of the tools ({', '.join(t.name for t in tools)})",
                field="tool_choice",
            )
    fmt = fmt if fmt in FORMATS else DEFAULT_FORMAT
    args_key = "parameters" if fmt == "llama3" else "arguments"
    lines: list[str] = []
    alts: list[str] = []
    for i, tool in enumerate(chosen):
        prefix = f"t{i}-"
        try:
            body = schema_to_gbnf(tool.parameters, root=f"{prefix}args", prefix=prefix, field="tools_json")
        except (InvalidArgumentError, UnsupportedError) as exc:
            raise type(exc)(f"tool {tool.name!r}: {exc.message}", **exc.details) from exc
        lines.append(body.rstrip("\n"))
        head = gbnf_literal(f'{{"name":{json.dumps(tool.name)},"{args_key}":')
        alts.append(f'{head} {prefix}args "}}"')
    call = "( " + " | ".join(alts) + " )"
    if fmt == "hermes":
        root = f'root ::= "<tool_call>\\n" {call} "\\n</tool_call>"'
    elif fmt == "mistral":
        root = f'root ::= "[TOOL_CALLS][" {call} "]"'
    else:
        root = f"root ::= {call}"
    return Constraint("grammar", "\n".join([root, *lines]) + "\n" + JSON_PRIMITIVES)


def format_calls(fmt: str, calls: Sequence[ToolCall]) -> str:
    """The text a model of format ``fmt`` writes for ``calls`` (``arguments`` is JSON text), as
    the parsers read it: for putting calls a client sends back into a history. The model's own
    text of a call may differ in spacing; the exact text is ``StreamChunk.tool_text``."""
    if not calls:
        return ""
    args_key = "parameters" if fmt == "llama3" else "arguments"
    bodies = [
        f'{{"name": {json.dumps(c.name, ensure_ascii=False)}, "{args_key}": {c.arguments}'
        + (f', "id": {json.dumps(c.id, ensure_ascii=False)}}}' if fmt == "mistral" and c.id else "}")
        for c in calls
    ]
    if fmt == "llama3":
        return "; ".join(bodies)
    if fmt == "mistral":
        return "[TOOL_CALLS][" + ", ".join(bodies) + "]"
    return "\n".join(f"<tool_call>\n{b}\n</tool_call>" for b in bodies)
