"""GBNF pieces for forcing a tool call in a family's own format.

What: :class:`Rules` collects the rules of one forcing grammar; :func:`json_arguments` gives
each tool's arguments as compact JSON valid under its schema (the existing schema converter);
:func:`parameters` gives a tool's arguments one parameter at a time, for the families that
write parameters as markup (XML tags, Gemma 4's ``key:value``, LFM2's ``key=value``): a string
parameter is free text up to the markup that ends it (:meth:`Rules.until`), any other type is
JSON valid under the parameter's schema. Parameters come in the schema's order, the required
ones always, the optional ones optionally.

Soundness: a sentence of these grammars is one call that the family's parser reads back, with
a tool's name and, for JSON arguments, arguments that validate against its schema; for
parameter families, every parameter that is not a string validates against its own schema and
a string one is text (Gemma 4 nests objects and arrays in its own literal syntax, which is
not held to the schema below the first level).

What not: no parsing (:mod:`modeld.decoding.callbodies`), no choice of family
(:mod:`modeld.decoding.formats`).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from modeld.decoding.callbodies import GEMMA_QUOTE
from modeld.decoding.gbnf import gbnf_literal
from modeld.decoding.regex import regex_to_gbnf_expr
from modeld.decoding.schema import schema_to_gbnf
from modeld.errors import InvalidArgumentError, UnsupportedError

__all__ = ["Rules", "Tool", "gemma_call", "json_arguments", "lit", "parameters", "raw_text"]


def lit(text: str) -> str:
    """A GBNF literal for ``text``."""
    return gbnf_literal(text)


def _cls_char(c: str) -> str:
    return f"\\x{ord(c):02X}" if ord(c) < 0x100 else f"\\u{ord(c):04X}"


class Rules:
    """The rules of one grammar, each name unique."""

    def __init__(self) -> None:
        self.lines: list[str] = []
        self._until: dict[str, str] = {}

    def add(self, name: str, body: str) -> str:
        self.lines.append(f"{name} ::= {body}")
        return name

    def extend(self, text: str) -> None:
        self.lines.extend(line for line in text.splitlines() if line.strip())

    def until(self, literal: str) -> str:
        """A rule matching any text that does not contain ``literal`` (which must have no
        border: no proper prefix that is also a suffix, so that text + literal contains it
        only at the end). Built from the literal's matching automaton, right-recursive."""
        if literal in self._until:
            return self._until[literal]
        n = len(literal)
        for k in range(1, n):
            if literal[:k] == literal[n - k :]:  # pragma: no cover - the families' markers have none
                raise ValueError(f"{literal!r} has a border; until() needs a border-free literal")
        base = f"until{len(self._until)}"
        first = literal[0]
        for i in range(n):
            alts = ['""']
            specials = sorted({literal[i], first})
            alts.append(f"[^{''.join(_cls_char(c) for c in specials)}] {base}-0")
            for c in specials:
                target = i + 1 if c == literal[i] else 1
                if target < n:
                    alts.append(f"{lit(c)} {base}-{target}")
            self.add(f"{base}-{i}", " | ".join(alts))
        self._until[literal] = f"{base}-0"
        return f"{base}-0"


def _tool_error(name: str, exc: InvalidArgumentError | UnsupportedError) -> Exception:
    return type(exc)(f"tool {name!r}: {exc.message}", **exc.details)


def json_arguments(rules: Rules, prefix: str, name: str, schema: Any) -> str:
    """The rule of ``name``'s arguments as compact JSON valid under ``schema``."""
    try:
        rules.extend(schema_to_gbnf(schema, root=f"{prefix}args", prefix=prefix, field="tools_json"))
    except (InvalidArgumentError, UnsupportedError) as exc:
        raise _tool_error(name, exc) from exc
    return f"{prefix}args"


def _is_string(schema: Any) -> bool:
    """A parameter whose value a markup family writes as raw text (a string, or an enum or
    const of strings)."""
    if not isinstance(schema, dict):
        return False
    if schema.get("type") == "string":
        return True
    values = schema.get("enum", [schema["const"]] if "const" in schema else None)
    return isinstance(values, list) and bool(values) and all(isinstance(v, str) for v in values)


def raw_text(rules: Rules, schema: dict[str, Any], closing: str, field: str) -> str:
    """The GBNF of a string parameter's raw text, ended by ``closing`` (not included): an
    enum/const as its literals, a ``pattern`` as its full matches, lengths as bounded text
    without ``<`` (so it cannot run into markup), else any text not containing ``closing``."""
    values = schema.get("enum", [schema["const"]] if "const" in schema else None)
    if isinstance(values, list) and values:
        return "( " + " | ".join(lit(str(v)) for v in values) + " )"
    pattern = schema.get("pattern")
    if isinstance(pattern, str):
        return "( " + regex_to_gbnf_expr(pattern, field=field) + " )"
    lo, hi = schema.get("minLength"), schema.get("maxLength")
    if isinstance(lo, int) or isinstance(hi, int):
        lo = lo if isinstance(lo, int) else 0
        return f"[^<]{{{lo},{hi if isinstance(hi, int) else ''}}}"
    return rules.until(closing)


Spell = Callable[[str, str], str]
"""(parameter name, its value's rule) -> the GBNF sequence of one parameter."""


def parameters(
    rules: Rules,
    prefix: str,
    name: str,
    schema: Any,
    spell: Spell,
    closing: str | None,
    sep: str = "",
    quote: str = "",
) -> str:
    """The GBNF sequence of a tool's parameters in a markup family: ``spell(key, value)`` per
    parameter, ``sep`` (a literal) between them. ``closing``: the markup that ends a string
    parameter's raw text (:func:`raw_text`), written between ``quote`` marks (Gemma 4's); None
    when strings are JSON strings too (LFM2). A parameter schema ``{"$rule": NAME}`` takes the
    rule NAME as it is. "" when the schema declares no parameters."""
    props = schema.get("properties") if isinstance(schema, dict) else None
    if not isinstance(props, dict) or not props:
        return ""
    required = set(schema.get("required") or ())
    items: list[tuple[str, bool]] = []
    for j, (key, sub) in enumerate(props.items()):
        if isinstance(sub, dict) and isinstance(sub.get("$rule"), str):
            value = sub["$rule"]
        elif closing is not None and _is_string(sub):
            value = raw_text(rules, sub, closing, "tools_json")
            if quote:
                value = f"{lit(quote)} {value} {lit(quote)}"
        else:
            try:
                rules.extend(
                    schema_to_gbnf(sub, root=f"{prefix}p{j}", prefix=f"{prefix}p{j}-", field="tools_json")
                )
            except (InvalidArgumentError, UnsupportedError) as exc:
                raise _tool_error(name, exc) from exc
            value = f"{prefix}p{j}"
        items.append((spell(key, value), key in required))
    if not sep:
        return " ".join(item if req else f"( {item} )?" for item, req in items)
    # With separators: the first parameter written has none before it.
    tails: list[str] = []
    for k in range(len(items)):
        tails.append(f"{prefix}tail{k}")
    for k, (item, req) in enumerate(items):
        nxt = f" {tails[k + 1]}" if k + 1 < len(items) else ""
        body = f"{lit(sep)} {item}{nxt}"
        rules.add(tails[k], body if req else f"( {lit(sep)} {item} )?{nxt}")
    starts: list[str] = []
    for k, (item, req) in enumerate(items):
        nxt = f" {tails[k + 1]}" if k + 1 < len(items) else ""
        starts.append(f"{item}{nxt}")
        if req:
            break
    else:
        starts.append('""')
    return rules.add(f"{prefix}params", " | ".join(starts))


@dataclass(frozen=True)
class Tool:
    """What a grammar needs of a tool (a :class:`~modeld.decoding.tools.ToolSpec`'s part)."""

    name: str
    parameters: Any


GEMMA_ANY = r"""gemma-value ::= gemma-string | json-number | "true" | "false" | "null" | gemma-object | gemma-array
gemma-object ::= "{" ( gemma-key ":" gemma-value ( "," gemma-key ":" gemma-value )* )? "}"
gemma-array ::= "[" ( gemma-value ( "," gemma-value )* )? "]"
gemma-key ::= [A-Za-z_] [A-Za-z0-9_]*
"""


def gemma_call(rules: Rules, tools: Sequence[Tool]) -> str:
    """One call of any of ``tools`` in Gemma 4's markup (``call:NAME{key:value,...}``)."""
    rules.extend(GEMMA_ANY)
    quote = rules.until(GEMMA_QUOTE)
    rules.add("gemma-string", f"{lit(GEMMA_QUOTE)} {quote} {lit(GEMMA_QUOTE)}")

    def spell(key: str, value: str) -> str:
        return f"{lit(key + ':')} {value}"

    alts = []
    for i, tool in enumerate(tools):
        props = tool.parameters.get("properties") if isinstance(tool.parameters, dict) else None
        gemma_schema = {
            "type": "object",
            # In sorted order: Gemma 4's template lists and writes keys with dictsort.
            "properties": {k: _gemma_typed(v) for k, v in sorted(props.items())}
            if isinstance(props, dict)
            else {},
            "required": tool.parameters.get("required", []) if isinstance(tool.parameters, dict) else [],
        }
        params = parameters(rules, f"t{i}-", tool.name, gemma_schema, spell, GEMMA_QUOTE, ",", GEMMA_QUOTE)
        alts.append(
            " ".join(p for p in (lit(f"<|tool_call>call:{tool.name}{{"), params, lit("}<tool_call|>")) if p)
        )
    return "( " + " | ".join(alts) + " )"


def _gemma_typed(schema: Any) -> Any:
    """A parameter's schema for Gemma 4's grammar: strings stay (raw text between quotes),
    scalars are JSON already, objects and arrays are any Gemma literal (not schema-checked)."""
    if isinstance(schema, dict) and schema.get("type") in ("object", "array"):
        return {"$rule": "gemma-value"}
    return schema
