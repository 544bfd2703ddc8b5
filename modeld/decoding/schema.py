"""JSON schema -> GBNF, for a documented subset, so that every accepted output validates.

What: :func:`schema_to_gbnf` turns a JSON schema (text) into GBNF text whose sentences are
compact JSON documents (no whitespace) that are all valid under the schema. The grammar is
*sound* (what it accepts validates) but not complete (it emits properties in the schema's
order, only declared properties, canonical numbers). :func:`json_object_gbnf` is the grammar of
the plain ``json`` mode (any JSON object).

Why our own converter, not llama-cpp-python's ``json_schema_to_gbnf``: importing it loads the
native library (never in the daemon's parent process), and it silently ignores keywords it
does not implement (``minimum``/``maximum`` among them), so its outputs do not always
validate. Here a keyword that cannot be honoured is ``unsupported`` with its JSON pointer, and
a schema that is not valid JSON or has a keyword of the wrong shape is ``invalid_argument``
with its position (line and column) or pointer.

The subset (``blueprints/0018-constraints-and-tool-calls.md``): ``type`` (one or a list),
``enum``, ``const``, ``anyOf``, ``oneOf`` (as their union, as llama.cpp compiles it: exact when
the alternatives exclude each other), ``allOf`` of one schema, local ``$ref`` (``#``, ``#/$defs/..``,
``#/definitions/..``, recursion allowed); strings with ``minLength``/``maxLength`` or a
``pattern`` (the regex subset of :mod:`modeld.decoding.regex`, full matches, no characters that
JSON escapes); integers with
``minimum``/``maximum``/``exclusiveMinimum``/``exclusiveMaximum`` (a bound beyond 10^15, such as
Zod's +-(2^53 - 1), means "any integer of up to 15 digits"); numbers without bounds;
booleans; null; arrays with ``items``, ``minItems``, ``maxItems``; objects with
``properties``, ``required``, ``additionalProperties`` (false, true, absent, or a schema when
there are no properties). Annotations (``title``, ``description``, ``default``, ``examples``,
``format``, ``$schema``, ``$id``, ``$comment``, ``deprecated``, ``readOnly``, ``writeOnly``) are
ignored; ``format`` is an annotation in JSON Schema 2020-12. Everything else (
``not``, ``if``, ``patternProperties``, ``multipleOf``, number bounds, ``uniqueItems``, ...) is
``unsupported``.
"""

from __future__ import annotations

import json
import math
import re
from typing import Any

from modeld.decoding.gbnf import MAX_REPETITION, gbnf_literal
from modeld.decoding.regex import regex_to_gbnf_expr
from modeld.errors import InvalidArgumentError, UnsupportedError

_BIG = 10**15
"""Integer bounds this far out are "any safe integer" (Zod writes +-(2^53 - 1))."""
_INT_BOUNDS = ("minimum", "exclusiveMinimum", "maximum", "exclusiveMaximum")

__all__ = ["JSON_PRIMITIVES", "json_object_gbnf", "load_schema", "schema_to_gbnf"]

JSON_PRIMITIVES = r"""json-value ::= json-object | json-array | json-string | json-number | "true" | "false" | "null"
json-object ::= "{" ( json-string ":" json-value ( "," json-string ":" json-value )* )? "}"
json-array ::= "[" ( json-value ( "," json-value )* )? "]"
json-string ::= "\"" json-char* "\""
json-char ::= [^"\\\x00-\x1F] | "\\" ( ["\\/bfnrt] | "u" json-hex4 )
json-hex4 ::= [0-9a-cA-CefEF] json-hex json-hex json-hex | [dD] [0-7] json-hex json-hex
json-hex ::= [0-9a-fA-F]
json-integer ::= "-"? ( "0" | [1-9] [0-9]{0,15} )
json-number ::= json-integer ( "." [0-9]{1,16} )? ( [eE] [-+]? [0-9]{1,3} )?
"""
"""Compact JSON. Escapes of UTF-16 surrogates are excluded (a pair would count as one character
for ``minLength``); numbers have at most 16 integer and 16 fraction digits."""

_ANNOTATIONS = frozenset(
    {
        "title",
        "description",
        "default",
        "examples",
        "format",
        "$schema",
        "$id",
        "$comment",
        "deprecated",
        "readOnly",
        "writeOnly",
        "$defs",
        "definitions",
    }
)
_TYPES = ("object", "array", "string", "integer", "number", "boolean", "null")
_FIELD = "constraint.value"


def json_object_gbnf() -> str:
    """The grammar of the ``json`` mode: any JSON object (compact)."""
    return "root ::= json-object\n" + JSON_PRIMITIVES


def load_schema(text: str, field: str = _FIELD) -> Any:
    """Parse schema text; ``invalid_argument`` with line and column if it is not JSON."""
    try:
        schema = json.loads(text)
    except json.JSONDecodeError as exc:
        raise InvalidArgumentError(
            f"the JSON schema is not valid JSON at line {exc.lineno}, column {exc.colno}: {exc.msg}",
            field=field,
            offset=exc.pos,
            line=exc.lineno,
            column=exc.colno,
        ) from exc
    except RecursionError as exc:
        raise InvalidArgumentError("the JSON schema nests too deeply", field=field) from exc
    if not isinstance(schema, dict | bool):
        raise InvalidArgumentError("a JSON schema must be an object or a boolean", field=field, pointer="")
    return schema


def schema_to_gbnf(schema: Any, *, root: str = "root", prefix: str = "", field: str = _FIELD) -> str:
    """GBNF text whose ``root`` rule matches compact JSON valid under ``schema`` (a parsed schema).

    ``prefix`` namespaces the generated rule names, so several schemas can share one grammar
    (:func:`modeld.decoding.tools.forced_call_gbnf`); the primitives are not included when a
    prefix is given (add :data:`JSON_PRIMITIVES` once).
    """
    conv = _Converter(schema, prefix, field)
    body = conv.visit(schema, "")
    lines = [f"{root} ::= {body}"]
    lines.extend(f"{name} ::= {rule}" for name, rule in conv.rules.items())
    text = "\n".join(lines) + "\n"
    return text if prefix else text + JSON_PRIMITIVES


def _pointer(path: str, *parts: object) -> str:
    return path + "".join("/" + str(p).replace("~", "~0").replace("/", "~1") for p in parts)


class _Converter:
    def __init__(self, schema: Any, prefix: str, field: str) -> None:
        self.schema = schema
        self.prefix = prefix
        self.field = field
        self.rules: dict[str, str] = {}
        self.refs: dict[str, str] = {}
        self.depth = 0

    def invalid(self, path: str, message: str) -> InvalidArgumentError:
        return InvalidArgumentError(
            f"invalid JSON schema at {path or '/'}: {message}", field=self.field, pointer=path
        )

    def unsupported(self, path: str, message: str) -> UnsupportedError:
        return UnsupportedError(
            f"JSON schema at {path or '/'}: {message} is not supported in constrained decoding",
            field=self.field,
            pointer=path,
        )

    def name(self, path: str) -> str:
        base = self.prefix + (re.sub(r"[^a-zA-Z0-9]+", "-", path).strip("-") or "schema")
        name, n = base, 1
        while name in self.rules or name == "root":
            n += 1
            name = f"{base}-{n}"
        self.rules[name] = ""  # reserve
        return name

    def visit(self, schema: Any, path: str) -> str:
        self.depth += 1
        if self.depth > 64:
            raise self.unsupported(path, "nesting deeper than 64 schemas")
        try:
            return self._visit(schema, path)
        finally:
            self.depth -= 1

    def _visit(self, schema: Any, path: str) -> str:
        if schema is True:
            return "json-value"
        if schema is False:
            raise self.invalid(path, "the schema false accepts nothing")
        if not isinstance(schema, dict):
            raise self.invalid(path, "a schema must be an object or a boolean")
        for key in schema:
            if key not in _KNOWN and key not in _ANNOTATIONS:
                raise self.unsupported(_pointer(path, key), f"the keyword {key!r}")
        if "$ref" in schema:
            if len([k for k in schema if k not in _ANNOTATIONS]) > 1:
                raise self.unsupported(path, "$ref beside other keywords")
            return self.ref(schema["$ref"], _pointer(path, "$ref"))
        if "const" in schema:
            return gbnf_literal(_compact(schema["const"]))
        if "enum" in schema:
            values = schema["enum"]
            if not isinstance(values, list) or not values:
                raise self.invalid(_pointer(path, "enum"), "enum must be a non-empty array")
            return "( " + " | ".join(gbnf_literal(_compact(v)) for v in values) + " )"
        if "anyOf" in schema:
            alts = schema["anyOf"]
            if not isinstance(alts, list) or not alts:
                raise self.invalid(_pointer(path, "anyOf"), "anyOf must be a non-empty array")
            rest = {k: v for k, v in schema.items() if k != "anyOf" and k not in _ANNOTATIONS}
            if rest:
                raise self.unsupported(path, "anyOf beside other keywords")
            return (
                "( "
                + " | ".join(self.visit(a, _pointer(path, "anyOf", i)) for i, a in enumerate(alts))
                + " )"
            )
        if "oneOf" in schema:
            # As llama.cpp compiles it: the union of the alternatives. Exact when they exclude
            # each other (a discriminating const or enum, distinct types), which is how tool
            # schemas use it; otherwise an output may match more than one (blueprint 0018).
            alts = schema["oneOf"]
            if not isinstance(alts, list) or not alts:
                raise self.invalid(_pointer(path, "oneOf"), "oneOf must be a non-empty array")
            rest = {k: v for k, v in schema.items() if k != "oneOf" and k not in _ANNOTATIONS}
            if rest:
                raise self.unsupported(path, "oneOf beside other keywords")
            return (
                "( "
                + " | ".join(self.visit(a, _pointer(path, "oneOf", i)) for i, a in enumerate(alts))
                + " )"
            )
        if "allOf" in schema:
            alts = schema["allOf"]
            if not isinstance(alts, list) or len(alts) != 1:
                raise self.unsupported(_pointer(path, "allOf"), "allOf with other than one schema")
            return self.visit(alts[0], _pointer(path, "allOf", 0))
        kind = schema.get("type")
        if kind is None:
            kinds = _implied_types(schema)
        elif isinstance(kind, str):
            kinds = [kind]
        elif isinstance(kind, list) and kind and all(isinstance(k, str) for k in kind):
            kinds = list(dict.fromkeys(kind))
        else:
            raise self.invalid(_pointer(path, "type"), "type must be a string or an array of strings")
        for k in kinds:
            if k not in _TYPES:
                raise self.invalid(_pointer(path, "type"), f"unknown type {k!r}")
        if not kinds:
            return "json-value"
        alts = [self.typed(k, schema, path) for k in kinds]
        return alts[0] if len(alts) == 1 else "( " + " | ".join(alts) + " )"

    def ref(self, ref: Any, path: str) -> str:
        if not isinstance(ref, str):
            raise self.invalid(path, "$ref must be a string")
        if ref in self.refs:
            return self.refs[ref]
        if ref == "#":
            target: Any = self.schema
        else:
            m = re.fullmatch(r"#/(\$defs|definitions)/([^/]+)", ref)
            if m is None:
                raise self.unsupported(
                    path, f"the reference {ref!r} (only #, #/$defs/.. and #/definitions/..)"
                )
            defs = self.schema.get(m.group(1)) if isinstance(self.schema, dict) else None
            key = m.group(2).replace("~1", "/").replace("~0", "~")
            if not isinstance(defs, dict) or key not in defs:
                raise self.invalid(path, f"the reference {ref!r} names no definition")
            target = defs[key]
        name = self.name("ref-" + ref)
        self.refs[ref] = name
        self.rules[name] = self.visit(target, ref.lstrip("#"))
        return name

    def typed(self, kind: str, schema: dict[str, Any], path: str) -> str:
        if kind == "null":
            return '"null"'
        if kind == "boolean":
            return '( "true" | "false" )'
        if kind == "string":
            return self.string(schema, path)
        if kind == "integer":
            return self.integer(schema, path)
        if kind == "number":
            for key in ("minimum", "maximum", "exclusiveMinimum", "exclusiveMaximum", "multipleOf"):
                if key in schema:
                    raise self.unsupported(_pointer(path, key), f"{key} on a number (use integer)")
            return "json-number"
        if kind == "array":
            return self.array(schema, path)
        return self.object(schema, path)

    def count(self, schema: dict[str, Any], key: str, path: str) -> int | None:
        if key not in schema:
            return None
        value = schema[key]
        if isinstance(value, bool) or not isinstance(value, int) or value < 0:
            raise self.invalid(_pointer(path, key), f"{key} must be a non-negative integer")
        if value > MAX_REPETITION:
            raise self.unsupported(_pointer(path, key), f"{key} above {MAX_REPETITION}")
        return value

    def string(self, schema: dict[str, Any], path: str) -> str:
        lo = self.count(schema, "minLength", path) or 0
        hi = self.count(schema, "maxLength", path)
        if hi is not None and hi < lo:
            raise self.invalid(path, "maxLength is below minLength")
        if "pattern" in schema:
            pattern = schema["pattern"]
            if not isinstance(pattern, str):
                raise self.invalid(_pointer(path, "pattern"), "pattern must be a string")
            if lo or hi is not None:
                raise self.unsupported(path, "pattern together with minLength/maxLength")
            name = self.name(path + "-pattern")
            self.rules[name] = regex_to_gbnf_expr(
                pattern, field=self.field, pointer=_pointer(path, "pattern"), json_string=True
            )
            return f'"\\"" {name} "\\""'
        rep = f"{{{lo},}}" if hi is None else f"{{{lo},{hi}}}"
        if (lo, hi) == (0, None):
            return "json-string"
        return f'"\\"" json-char{rep} "\\""'

    def integer(self, schema: dict[str, Any], path: str) -> str:
        if "multipleOf" in schema:
            raise self.unsupported(_pointer(path, "multipleOf"), "multipleOf")
        lo: int | None = None
        hi: int | None = None
        for key in ("minimum", "exclusiveMinimum", "maximum", "exclusiveMaximum"):
            if key not in schema:
                continue
            v = schema[key]
            if isinstance(v, bool) or not isinstance(v, int | float) or not math.isfinite(v):
                raise self.invalid(_pointer(path, key), f"{key} must be a number")
            if abs(v) >= _BIG:
                # Zod and TypeScript write "any safe integer" as +-(2^53 - 1): a bound that far
                # out is no bound, and the grammar keeps integers to 15 digits (all safe, all
                # within it). A bound that far *in* (minimum 10^16) cannot be met that way.
                if (key in ("minimum", "exclusiveMinimum")) == (v < 0):
                    continue
                raise self.unsupported(_pointer(path, key), f"{key} beyond 10^15")
            if key == "minimum":
                bound = math.ceil(v)
                lo = bound if lo is None else max(lo, bound)
            elif key == "exclusiveMinimum":
                bound = math.floor(v) + 1
                lo = bound if lo is None else max(lo, bound)
            elif key == "maximum":
                bound = math.floor(v)
                hi = bound if hi is None else min(hi, bound)
            else:
                bound = math.ceil(v) - 1
                hi = bound if hi is None else min(hi, bound)
        wide = any(isinstance(schema.get(k), int | float) and abs(schema[k]) >= _BIG for k in _INT_BOUNDS)
        if wide:
            lo = -(_BIG - 1) if lo is None else lo
            hi = _BIG - 1 if hi is None else hi
        if lo is None and hi is None:
            return "json-integer"
        if lo is not None and hi is not None and hi < lo:
            raise self.invalid(path, "the integer range is empty")
        return "( " + int_range_gbnf(lo, hi) + " )"

    def array(self, schema: dict[str, Any], path: str) -> str:
        for key in (
            "prefixItems",
            "contains",
            "uniqueItems",
            "minContains",
            "maxContains",
            "unevaluatedItems",
        ):
            if key in schema and not (key == "uniqueItems" and schema[key] is False):
                raise self.unsupported(_pointer(path, key), key)
        item = self.visit(schema.get("items", True), _pointer(path, "items"))
        lo = self.count(schema, "minItems", path) or 0
        hi = self.count(schema, "maxItems", path)
        if hi is not None and hi < lo:
            raise self.invalid(path, "maxItems is below minItems")
        if hi == 0:
            return '"[" "]"'
        name = self.name(path + "-item")
        self.rules[name] = item
        more = f'( "," {name} )' + (
            "*" if hi is None and lo <= 1 else f"{{{max(lo - 1, 0)},{'' if hi is None else hi - 1}}}"
        )
        body = f"{name} {more}"
        return f'"[" {body} "]"' if lo >= 1 else f'"[" ( {body} )? "]"'

    def object(self, schema: dict[str, Any], path: str) -> str:
        for key in (
            "patternProperties",
            "minProperties",
            "maxProperties",
            "dependentRequired",
            "dependentSchemas",
            "propertyNames",
            "unevaluatedProperties",
        ):
            if key in schema:
                raise self.unsupported(_pointer(path, key), key)
        props = schema.get("properties", {})
        if not isinstance(props, dict):
            raise self.invalid(_pointer(path, "properties"), "properties must be an object")
        required = schema.get("required", [])
        if not isinstance(required, list) or not all(isinstance(r, str) for r in required):
            raise self.invalid(_pointer(path, "required"), "required must be an array of strings")
        additional = schema.get("additionalProperties", True)
        if not isinstance(additional, bool | dict):
            raise self.invalid(_pointer(path, "additionalProperties"), "must be a boolean or a schema")
        names = list(props) + [r for r in dict.fromkeys(required) if r not in props]
        if not names:
            if additional is False:
                return '"{" "}"'
            value = (
                "json-value"
                if additional is True
                else self.visit(additional, _pointer(path, "additionalProperties"))
            )
            member = f'json-string ":" {value}'
            return f'"{{" ( {member} ( "," {member} )* )? "}}"'
        members: list[tuple[str, bool]] = []
        for key in names:
            sub = props.get(key, True)
            value = self.visit(sub, _pointer(path, "properties", key))
            rule = self.name(f"{path}-{key}-kv")
            self.rules[rule] = f'{gbnf_literal(json.dumps(key, ensure_ascii=False))} ":" {value}'
            members.append((rule, key in required))
        # after[i]: members i.. each preceded by a comma; first[i]: members i.. when none came yet.
        after: list[str] = [""] * (len(members) + 1)
        for i in range(len(members) - 1, -1, -1):
            rule, req = members[i]
            piece = f'"," {rule}' if req else f'( "," {rule} )?'
            after[i] = f"{piece} {after[i + 1]}".strip()
        first_rules: list[str] = [""] * (len(members) + 1)
        for i in range(len(members) - 1, -1, -1):
            rule, req = members[i]
            tail = f"{rule} {after[i + 1]}".strip()
            if req:
                first_rules[i] = tail
            else:
                rest = first_rules[i + 1]
                name = self.name(f"{path}-from-{i}")
                self.rules[name] = f"{tail} | {rest}" if rest else f'{tail} | ""'
                first_rules[i] = name
        return f'"{{" {first_rules[0]} "}}"'


_KNOWN = frozenset(
    {
        "type",
        "enum",
        "const",
        "anyOf",
        "oneOf",
        "allOf",
        "$ref",
        "minLength",
        "maxLength",
        "pattern",
        "minimum",
        "maximum",
        "exclusiveMinimum",
        "exclusiveMaximum",
        "items",
        "minItems",
        "maxItems",
        "uniqueItems",
        "properties",
        "required",
        "additionalProperties",
    }
)


def _implied_types(schema: dict[str, Any]) -> list[str]:
    kinds: list[str] = []
    if any(k in schema for k in ("properties", "required", "additionalProperties")):
        kinds.append("object")
    if any(k in schema for k in ("items", "minItems", "maxItems")):
        kinds.append("array")
    if any(k in schema for k in ("minLength", "maxLength", "pattern")):
        kinds.append("string")
    if any(k in schema for k in ("minimum", "maximum", "exclusiveMinimum", "exclusiveMaximum")):
        kinds.append("integer")
    return kinds


def _compact(value: Any) -> str:
    return json.dumps(value, ensure_ascii=False, separators=(",", ":"))


def _digits_range(a: str, b: str) -> str:
    """GBNF for decimal strings of equal length from a to b (inclusive), digit by digit."""
    if not a:
        return ""
    if a == b:
        return gbnf_literal(a)
    k = len(a) - 1
    if a[0] == b[0]:
        return f"{gbnf_literal(a[0])} {_digits_range(a[1:], b[1:])}".strip()
    alts: list[str] = []
    any_k = f"[0-9]{{{k}}}" if k else ""
    if a[1:] == "0" * k and b[1:] == "9" * k:
        return f"[{a[0]}-{b[0]}] {any_k}".strip()
    alts.append(f"{gbnf_literal(a[0])} {_digits_range(a[1:], '9' * k)}".strip())
    if int(b[0]) - int(a[0]) > 1:
        alts.append(f"[{int(a[0]) + 1}-{int(b[0]) - 1}] {any_k}".strip())
    alts.append(f"{gbnf_literal(b[0])} {_digits_range('0' * k, b[1:])}".strip())
    return "( " + " | ".join(alts) + " )"


_MAX_DIGITS = 16


def _magnitude(lo: int, hi: int | None) -> str:
    """Canonical decimal numbers n with lo <= n <= hi (hi None: up to 16 digits); lo >= 0."""
    alts: list[str] = []
    top = hi if hi is not None else 10**_MAX_DIGITS - 1
    for length in range(len(str(lo)), len(str(top)) + 1):
        a = max(lo, 0 if length == 1 else 10 ** (length - 1))
        b = min(top, 10**length - 1)
        if a <= b:
            alts.append(_digits_range(str(a), str(b)))
    return " | ".join(alts)


def int_range_gbnf(lo: int | None, hi: int | None) -> str:
    """GBNF alternatives for the integers in [lo, hi] (None: unbounded), canonical form."""
    alts: list[str] = []
    if hi is None or hi >= 0:
        alts.append(_magnitude(max(lo, 0) if lo is not None else 0, hi))
    if lo is None or lo < 0:
        neg_lo = 1 if hi is None or hi >= 0 else -hi
        alts.append(f'"-" ( {_magnitude(neg_lo, None if lo is None else -lo)} )')
    return " | ".join(a for a in alts if a)
