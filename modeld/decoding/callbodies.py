"""The bodies of tool calls, family by family: the text between a call's markers -> its calls.

What: one function per way of writing a call's name and arguments (each a
:data:`~modeld.decoding.toolcalls.Body`), and the ``name`` readers that find a call's name in
its first characters (so the stream can announce it early). The markers around the bodies and
which family uses which body are in :mod:`modeld.decoding.formats`.

Kinds of body:

* JSON: a call object (Hermes, Granite 4), a list of them (Nemotron v2, Command R), or a name
  then JSON arguments (Kimi K2, DeepSeek V3.1 and R1).
* XML-like parameters (Qwen3-Coder and Qwen3.5/3.6, Seed-OSS, GLM 4.5+, MiniMax M2): values are
  raw text, converted by the tool's schema (:func:`typed`): a string parameter keeps its text,
  any other type is read as JSON (and stays text when it is not JSON).
* Literals: Gemma 4's ``call:NAME{key:<|"|>text<|"|>,n:1}`` and LFM2's Python call list
  ``[name(key="v", n=1)]`` (Python's ``True``/``None`` and JSON's ``true``/``null`` both read).

What not: no markers, no streaming (the parser hands whole bodies), no validation against the
schema beyond choosing a value's type.
"""

from __future__ import annotations

import ast
import json
import re
from typing import Any

from modeld.decoding.toolcalls import RawCall, Schemas, call_from, checked_call

__all__ = [
    "command_r_body",
    "gemma_literal",
    "python_literal",
    "deepseek_r1_body",
    "deepseek_v31_body",
    "gemma4_body",
    "glm_body",
    "hermes_body",
    "json_list_body",
    "kimi_body",
    "lfm2_body",
    "minimax_body",
    "qwen3_coder_body",
    "seed_body",
    "typed",
]


# --- values by schema -------------------------------------------------------------------------


def _types(schema: Any) -> set[str]:
    if not isinstance(schema, dict):
        return set()
    kind = schema.get("type")
    out = (
        {kind}
        if isinstance(kind, str)
        else {k for k in kind if isinstance(k, str)}
        if isinstance(kind, list)
        else set()
    )
    for key in ("anyOf", "oneOf"):
        for alt in schema.get(key) or ():
            out |= _types(alt)
    if not out and "enum" in schema:
        out = {"string" if isinstance(v, str) else "json" for v in schema["enum"]}
    return out


def typed(text: str, schema: Any) -> Any:
    """A raw parameter value as its schema types it: text for a string parameter, else JSON (a
    value that is not JSON stays text). Without a schema, JSON when it reads as JSON."""
    types = _types(schema)
    if "string" in types:
        if "null" in types and text.strip() == "null":
            return None
        return text
    try:
        return json.loads(text)
    except ValueError:
        return text


def _param_schema(schemas: Schemas, name: str, key: str) -> Any:
    props = schemas.get(name, {}).get("properties") if isinstance(schemas.get(name), dict) else None
    return props.get(key) if isinstance(props, dict) else None


# --- JSON bodies -------------------------------------------------------------------------------


def hermes_body(body: str, schemas: Schemas) -> list[RawCall] | str:
    """``{"name": ..., "arguments": {...}}`` (``<tool_call>`` families)."""
    try:
        obj = json.loads(body)
    except ValueError:
        return "the tool call is not valid JSON"
    return _one(call_from(obj))


def json_list_body(body: str, schemas: Schemas) -> list[RawCall] | str:
    """``[{"name": ..., "arguments": {...}}, ...]`` (Nemotron v2's ``<TOOLCALL>``, Granite 3)."""
    try:
        items = json.loads(body)
    except ValueError:
        return "the tool calls are not valid JSON"
    if isinstance(items, dict):
        items = [items]
    if not isinstance(items, list) or not items:
        return "the tool calls must be a non-empty JSON array"
    out: list[RawCall] = []
    for item in items:
        got = call_from(item)
        if isinstance(got, str):
            return got
        out.append(got)
    return out


def command_r_body(body: str, schemas: Schemas) -> list[RawCall] | str:
    """``[{"tool_call_id": "0", "tool_name": ..., "parameters": {...}}]`` (Command R7B); the
    ids are indexes, so calls get ids of their own."""
    got = json_list_body(body, schemas)
    return got if isinstance(got, str) else [RawCall(c.name, c.arguments) for c in got]


def _one(got: RawCall | str) -> list[RawCall] | str:
    return got if isinstance(got, str) else [got]


_KIMI = re.compile(r"\s*(?:functions\.)?([^\s:<]+)(?::(\d+))?\s*<\|tool_call_argument_begin\|>(.*)\Z", re.S)
_KIMI_NAME = re.compile(r"\s*(?:functions\.)?([^\s:<]+):(\d+)\s*<")


def kimi_name(body: str) -> str | None:
    m = _KIMI_NAME.match(body)
    return m.group(1) if m else None


def kimi_id(body: str) -> str:
    m = _KIMI_NAME.match(body)
    return f"functions.{m.group(1)}:{m.group(2)}" if m else ""


def kimi_body(body: str, schemas: Schemas) -> list[RawCall] | str:
    """``functions.NAME:IDX<|tool_call_argument_begin|>{...}``; the id is ``functions.NAME:IDX``
    (Kimi's own, which its template writes back)."""
    m = _KIMI.match(body)
    if m is None:
        return "the tool call is not functions.NAME:INDEX<|tool_call_argument_begin|>{...}"
    name, index, args = m.groups()
    call_id = f"functions.{name}:{index}" if index is not None else ""
    return _one(checked_call(name, args.strip(), call_id))


DS_SEP = "<\uff5ctool\u2581sep\uff5c>"
"""DeepSeek's separator (its markers use U+FF5C FULLWIDTH VERTICAL LINE and U+2581 LOWER ONE EIGHTH BLOCK)."""


def deepseek_v31_name(body: str) -> str | None:
    at = body.find(DS_SEP)
    if at < 0:
        return None
    return body[:at].strip() or None


def deepseek_v31_body(body: str, schemas: Schemas) -> list[RawCall] | str:
    """``NAME<|tool_sep|>{...}`` (DeepSeek V3.1; its markers' bars and underscores are fullwidth)."""
    name, sep, args = body.partition(DS_SEP)
    if not sep or not name.strip():
        return f"the tool call is not NAME{DS_SEP}{{...}}"
    return _one(checked_call(name.strip(), args.strip()))


_R1 = re.compile(r"\s*function" + re.escape(DS_SEP) + r"([^\n]+)\n```(?:json)?\n(.*?)\n?```\s*\Z", re.S)
_R1_NAME = re.compile(r"\s*function" + re.escape(DS_SEP) + r"([^\n]+)\n")


def deepseek_r1_name(body: str) -> str | None:
    m = _R1_NAME.match(body)
    return m.group(1).strip() if m else None


def deepseek_r1_body(body: str, schemas: Schemas) -> list[RawCall] | str:
    """``function<|tool_sep|>NAME\\n```json\\n{...}\\n``` `` (DeepSeek R1)."""
    m = _R1.match(body)
    if m is None:
        return f"the tool call is not function{DS_SEP}NAME and a ```json block"
    return _one(checked_call(m.group(1).strip(), m.group(2).strip()))


# --- XML-like parameters -----------------------------------------------------------------------

_FUNCTION = re.compile(r"\s*<function=([^>\n]+)>(.*?)(?:</function>\s*)?\Z", re.S)
_FUNCTION_NAME = re.compile(r"\s*<function=([^>\n]+)>")
_PARAMETER = re.compile(r"<parameter=([^>\n]+)>(.*?)</parameter>", re.S)


def function_name(body: str) -> str | None:
    m = _FUNCTION_NAME.match(body)
    return m.group(1).strip() if m else None


def _function(body: str, schemas: Schemas, trim: bool) -> list[RawCall] | str:
    if body.lstrip().startswith("{"):  # a Hermes JSON call inside <tool_call>: read it too
        return hermes_body(body, schemas)
    m = _FUNCTION.match(body)
    if m is None:
        return "the tool call is not <function=NAME> with <parameter=KEY> values"
    name, inner = m.group(1).strip(), m.group(2)
    args: dict[str, Any] = {}
    for key, value in _PARAMETER.findall(inner):
        if trim:
            value = value.removeprefix("\n").removesuffix("\n")
        key = key.strip()
        args[key] = typed(value, _param_schema(schemas, name, key))
    if _PARAMETER.sub("", inner).strip():
        return f"the call of {name!r} has text outside its parameters"
    return [RawCall(name, args)]


def qwen3_coder_body(body: str, schemas: Schemas) -> list[RawCall] | str:
    """``<function=NAME>\\n<parameter=KEY>\\nVALUE\\n</parameter>\\n</function>`` (the newline
    after the opening tag and before the closing one belong to the markup)."""
    return _function(body, schemas, True)


def seed_body(body: str, schemas: Schemas) -> list[RawCall] | str:
    """``<function=NAME>\\n<parameter=KEY>VALUE</parameter>\\n</function>`` (values verbatim)."""
    return _function(body, schemas, False)


_ARG = re.compile(r"<arg_key>(.*?)</arg_key>\s*<arg_value>(.*?)</arg_value>", re.S)


def glm_name(body: str) -> str | None:
    for stop in ("<arg_key>", "\n"):
        at = body.find(stop)
        if at >= 0:
            return body[:at].strip() or None
    return None


def glm_body(body: str, schemas: Schemas) -> list[RawCall] | str:
    """``NAME\\n<arg_key>KEY</arg_key>\\n<arg_value>VALUE</arg_value>\\n`` (GLM 4.5-4.7)."""
    at = body.find("<arg_key>")
    name = (body if at < 0 else body[:at]).strip()
    if not name or "<" in name:
        return "the tool call does not start with the function's name"
    inner = "" if at < 0 else body[at:]
    args = {k.strip(): typed(v, _param_schema(schemas, name, k.strip())) for k, v in _ARG.findall(inner)}
    if _ARG.sub("", inner).strip():
        return f"the call of {name!r} has text outside its <arg_key>/<arg_value> pairs"
    return [RawCall(name, args)]


_INVOKE = re.compile(r'([^"]+)">(.*)\Z', re.S)
_MM_PARAM = re.compile(r'<parameter name="([^"]+)">(.*?)</parameter>', re.S)


def minimax_name(body: str) -> str | None:
    at = body.find('">')
    if at < 0:
        return None
    return body[:at].strip() or None


def minimax_body(body: str, schemas: Schemas) -> list[RawCall] | str:
    """``NAME">\\n<parameter name="KEY">VALUE</parameter>\\n`` (after ``<invoke name="``)."""
    m = _INVOKE.match(body)
    if m is None:
        return 'the tool call is not <invoke name="NAME"> with <parameter name="KEY"> values'
    name, inner = m.group(1).strip(), m.group(2)
    args = {k: typed(v, _param_schema(schemas, name, k)) for k, v in _MM_PARAM.findall(inner)}
    if _MM_PARAM.sub("", inner).strip():
        return f"the call of {name!r} has text outside its parameters"
    return [RawCall(name, args)]


# --- literals ----------------------------------------------------------------------------------

GEMMA_QUOTE = '<|"|>'
_NUMBER = re.compile(r"-?(?:0|[1-9]\d*)(?:\.\d+)?(?:[eE][-+]?\d+)?")


class _Gemma:
    """Gemma 4's value syntax: ``<|"|>text<|"|>``, bare keys, JSON numbers and words."""

    def __init__(self, text: str) -> None:
        self.s = text
        self.i = 0

    def fail(self, what: str) -> ValueError:
        return ValueError(f"{what} at offset {self.i}")

    def space(self) -> None:
        while self.i < len(self.s) and self.s[self.i] in " \t\n\r":
            self.i += 1

    def value(self, depth: int = 0) -> Any:
        if depth > 64:
            raise self.fail("values nested too deep")
        self.space()
        s, i = self.s, self.i
        if s.startswith(GEMMA_QUOTE, i):
            end = s.find(GEMMA_QUOTE, i + len(GEMMA_QUOTE))
            if end < 0:
                raise self.fail("an unterminated string")
            self.i = end + len(GEMMA_QUOTE)
            return s[i + len(GEMMA_QUOTE) : end]
        if s.startswith("{", i):
            self.i += 1
            out: dict[str, Any] = {}
            self.space()
            if self.s.startswith("}", self.i):
                self.i += 1
                return out
            while True:
                self.space()
                if self.s.startswith(GEMMA_QUOTE, self.i):
                    key = self.value(depth + 1)
                else:
                    end = self.s.find(":", self.i)
                    if end < 0:
                        raise self.fail("a key without a value")
                    key = self.s[self.i : end].strip()
                    self.i = end
                self.space()
                if not self.s.startswith(":", self.i):
                    raise self.fail("':' expected")
                self.i += 1
                out[str(key)] = self.value(depth + 1)
                self.space()
                if self.s.startswith(",", self.i):
                    self.i += 1
                    continue
                if self.s.startswith("}", self.i):
                    self.i += 1
                    return out
                raise self.fail("',' or '}' expected")
        if s.startswith("[", i):
            self.i += 1
            items: list[Any] = []
            self.space()
            if self.s.startswith("]", self.i):
                self.i += 1
                return items
            while True:
                items.append(self.value(depth + 1))
                self.space()
                if self.s.startswith(",", self.i):
                    self.i += 1
                    continue
                if self.s.startswith("]", self.i):
                    self.i += 1
                    return items
                raise self.fail("',' or ']' expected")
        for word, val in (("true", True), ("false", False), ("null", None)):
            if s.startswith(word, i):
                self.i += len(word)
                return val
        m = _NUMBER.match(s, i)
        if m is None:
            raise self.fail("a value expected")
        self.i = m.end()
        return json.loads(m.group(0))


_GEMMA_CALL = re.compile(r"\s*call:([^{\s]+)\s*(\{.*)\Z", re.S)
_GEMMA_NAME = re.compile(r"\s*call:([^{\s]+)\s*\{")


def gemma4_name(body: str) -> str | None:
    m = _GEMMA_NAME.match(body)
    return m.group(1) if m else None


def gemma4_body(body: str, schemas: Schemas) -> list[RawCall] | str:
    """``call:NAME{key:<|"|>text<|"|>,n:1}`` (Gemma 4)."""
    m = _GEMMA_CALL.match(body)
    if m is None:
        return "the tool call is not call:NAME{...}"
    reader = _Gemma(m.group(2))
    try:
        args = reader.value()
        reader.space()
        if reader.i != len(reader.s):
            raise reader.fail("text after the arguments")
    except ValueError as exc:
        return f"the arguments of {m.group(1)!r} do not parse: {exc}"
    return _one(checked_call(m.group(1), args))


_LFM2_NAME = re.compile(r"\s*\[?\s*([A-Za-z_][\w.]*)\s*\(")
_WORDS = {"true": True, "false": False, "null": None, "True": True, "False": False, "None": None}


def lfm2_name(body: str) -> str | None:
    m = _LFM2_NAME.match(body)
    return m.group(1) if m else None


def _literal(node: ast.expr) -> Any:
    if isinstance(node, ast.Name) and node.id in _WORDS:
        return _WORDS[node.id]
    if isinstance(node, ast.List | ast.Tuple):
        return [_literal(e) for e in node.elts]
    if isinstance(node, ast.Dict):
        out: dict[str, Any] = {}
        for k, v in zip(node.keys, node.values, strict=True):
            if k is None:
                raise ValueError("** in a literal")
            out[str(_literal(k))] = _literal(v)
        return out
    return ast.literal_eval(node)


def _dotted(node: ast.expr) -> str:
    if isinstance(node, ast.Name):
        return node.id
    if isinstance(node, ast.Attribute):
        return f"{_dotted(node.value)}.{node.attr}"
    raise ValueError("a call of something that is not a name")


def lfm2_body(body: str, schemas: Schemas) -> list[RawCall] | str:
    """``[name(key="v", n=1), other()]`` (LFM2: Python call syntax, literals as values)."""
    text = body.strip()
    try:
        tree = ast.parse(text if text.startswith("[") else f"[{text}]", mode="eval")
        if not isinstance(tree.body, ast.List):
            raise ValueError("not a list of calls")
        out: list[RawCall] = []
        for node in tree.body.elts:
            if not isinstance(node, ast.Call) or node.args:
                raise ValueError("each item must be name(key=value, ...)")
            args = {k.arg: _literal(k.value) for k in node.keywords if k.arg is not None}
            out.append(RawCall(_dotted(node.func), args))
    except (SyntaxError, ValueError, TypeError, RecursionError, MemoryError) as exc:
        return f"the tool calls are not a Python list of calls: {exc}"
    return out


def gemma_literal(value: Any) -> str:
    """``value`` as Gemma 4 writes it (strings between ``<|\"|>``, bare keys in sorted order,
    as its template's ``dictsort`` writes them)."""
    if isinstance(value, str):
        return f"{GEMMA_QUOTE}{value}{GEMMA_QUOTE}"
    if isinstance(value, dict):
        return "{" + ",".join(f"{k}:{gemma_literal(v)}" for k, v in sorted(value.items())) + "}"
    if isinstance(value, list):
        return "[" + ",".join(gemma_literal(v) for v in value) + "]"
    return json.dumps(value)


def python_literal(value: Any) -> str:
    """``value`` as a Python literal (LFM2's calls)."""
    if value is True:
        return "True"
    if value is False:
        return "False"
    if value is None:
        return "None"
    if isinstance(value, dict):
        return "{" + ", ".join(f"{json.dumps(k)}: {python_literal(v)}" for k, v in value.items()) + "}"
    if isinstance(value, list):
        return "[" + ", ".join(python_literal(v) for v in value) + "]"
    return json.dumps(value, ensure_ascii=False)
