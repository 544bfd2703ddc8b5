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

Formats: one definition per family in :mod:`modeld.decoding.formats` (its table lists them:
Hermes/Qwen, Qwen3-Coder XML, harmony, Llama 3, Mistral, GLM, Kimi K2, DeepSeek, MiniMax,
Seed-OSS, Nemotron, Gemma 4, LFM2, Granite, Command R); this module is their front door.

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
from modeld.decoding.callgrammar import Rules, Tool
from modeld.decoding.formats import FORMATS as FAMILIES
from modeld.decoding.formats import detect_format
from modeld.decoding.gbnf import gbnf_literal
from modeld.decoding.schema import JSON_PRIMITIVES
from modeld.errors import InvalidArgumentError, LimitExceededError

__all__ = [
    "FORMATS",
    "CallKey",
    "ToolSpec",
    "call_key",
    "detect_format",
    "forced_call_constraint",
    "format_calls",
    "parse_tools",
]

FORMATS: tuple[str, ...] = tuple(FAMILIES)
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


def forced_call_constraint(tools: list[ToolSpec], choice: str, fmt: str, *, after: str = "") -> Constraint:
    """The ``grammar`` constraint whose sentences are exactly one call, in format ``fmt`` (the
    family's own markup, :mod:`modeld.decoding.formats`), of ``choice`` (a tool's name) or of any
    tool (``required``). ``after``: text the output must start with first (the marker that
    closes a thinking block the prompt opened: the call comes straight after it)."""
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
    family = FAMILIES.get(fmt) or FAMILIES[DEFAULT_FORMAT]
    rules = Rules()
    call = family.call(rules, [Tool(t.name, t.parameters) for t in chosen])
    head = f"{gbnf_literal(after)} " if after else ""
    return Constraint("grammar", "\n".join([f"root ::= {head}{call}", *rules.lines]) + "\n" + JSON_PRIMITIVES)


def format_calls(fmt: str, calls: Sequence[ToolCall]) -> str:
    """The text a model of format ``fmt`` writes for ``calls`` (``arguments`` is JSON text), as
    the parsers read it: for putting calls a client sends back into a history. The model's own
    text of a call may differ in spacing; the exact text is ``StreamChunk.tool_text``."""
    if not calls:
        return ""
    family = FAMILIES.get(fmt) or FAMILIES[DEFAULT_FORMAT]
    return family.write(calls)


CallKey = tuple[tuple[str, str, str], ...]


def call_key(calls: Sequence[ToolCall]) -> CallKey:
    """What identifies calls sent back in a history: each call's id, name and arguments (as
    canonical JSON, so a client's own spacing or key order does not matter). The id alone is
    not enough: families with ids of their own repeat them (Kimi's ``functions.NAME:0`` in every
    turn, Mistral's), and the text of another turn's call would be recalled."""
    out: list[tuple[str, str, str]] = []
    for c in calls:
        try:
            args = json.dumps(json.loads(c.arguments or "{}"), sort_keys=True, ensure_ascii=False)
        except ValueError:
            args = c.arguments
        out.append((c.id, c.name, args))
    return tuple(out)
