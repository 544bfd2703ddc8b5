"""What every API's request parsing shares, owned by no API: the one way each thing is read.

An API's ``request.py`` turns its wire format into a :class:`~modeld.server.http.turn.Turn`
with these pieces, so a rule is written once and every API follows it:

* :func:`samplers`: the sampler fields of a request, read from the API's **sampler map**
  (:data:`SamplerMap`, declared as data in each ``request.py``: which wire field sets which
  sampler, where the API narrows the range and which value means "unset"). Ranges come from
  the one sampler table, ``modeld/decoding/samplers.py``; an API only narrows them (OpenAI's
  temperature is 0-2, Anthropic's 0-1).
* :func:`ident`: an id or a name a client sends back (call ids, tool names: a string of at most
  :data:`~modeld.server.http.fields.MAX_KEY_CHARS` characters).
* :func:`text_parts` / :func:`text_part`: content given as a string or as typed parts, of which
  only text is read (an image or a file is refused by name: the models modeld serves read text;
  within :func:`media_omitted`, one in an earlier turn becomes a named placeholder, :class:`Media`).
* :func:`checked_call`: a tool call given back in the history (a JSON object as arguments);
  :func:`function_tool`: a tool definition in OpenAI's function form (every chat template
  takes it), :func:`tools_json_of` the JSON of several.
* :func:`response_format`: a JSON output format as a constraint (OpenAI's ``response_format``,
  the Responses API's ``text.format``, Anthropic's ``output_config.format``, Ollama's
  ``format``); :func:`tool_choice`: OpenAI's ``tool_choice`` as the decode's.
* :func:`conversation_keys`: the conversation's keys (the headers every API honours, and what
  the body names).

What not: an API's own fields and words (the neutral fields OpenAI defines, Anthropic's content
blocks, Ollama's options); they stay in its folder.
"""

from __future__ import annotations

import contextlib
import json
import re
from collections.abc import Collection, Iterator, Mapping
from contextvars import ContextVar
from dataclasses import dataclass
from typing import Any

from modeld.contract import Constraint, ToolCall
from modeld.decoding.samplers import sampler
from modeld.errors import echo
from modeld.server.http.errors import bad, unsupported
from modeld.server.http.fields import MAX_KEY_CHARS, integer, logit_bias, number
from modeld.server.http.turn import Keys

__all__ = [
    "MEDIA",
    "Media",
    "SamplerField",
    "SamplerMap",
    "checked_call",
    "conversation_keys",
    "function_tool",
    "ident",
    "ident_field",
    "key_value",
    "media_omitted",
    "placeholder",
    "response_format",
    "samplers",
    "text_part",
    "text_parts",
    "tool_choice",
    "tools_json_of",
]


@dataclass(frozen=True, slots=True)
class SamplerField:
    """One sampler field of an API's request: the sampler it sets (a row of
    ``modeld/decoding/samplers.py``, whose range it takes), the API's own narrower top where it
    has one, and the value that means "unset" where the API has one (llama.cpp's seed -1; a
    ``top_p`` of 0 from APIs that send it for "the default")."""

    sampler: str
    high: float | None = None
    unset: float | None = None


SamplerMap = Mapping[str, SamplerField]
"""An API's sampler fields: wire name -> :class:`SamplerField` (data, in each API's ``request.py``)."""


def samplers(body: Mapping[str, Any], fields: SamplerMap, *, where: str = "") -> dict[str, Any]:
    """The sampler values ``body`` sets, as ``DecodeConfig`` keyword arguments. A value out of
    its range is a 400 naming the field (``where.name``); an unset value is left out."""
    values: dict[str, Any] = {}
    for name, field in fields.items():
        if body.get(name) is None:
            continue
        row = sampler(field.sampler)
        param = f"{where}.{name}" if where else name
        low = row.low if field.unset is None else min(row.low, field.unset)
        high = row.high if field.high is None else min(row.high, field.high)
        value: Any
        if row.kind == "token_map":
            value = logit_bias(body, name, param=param) or None
        elif row.kind == "int":
            value = integer(body, name, int(low), int(high), param=param)
        elif row.kind == "float":
            value = number(body, name, low, high, param=param)
        else:
            raise TypeError(f"sampler {row.name} ({row.kind}) is not read from a request by value")
        if value is None or (field.unset is not None and value == field.unset):
            continue
        if row.low_open and value == row.low:
            raise bad(param, f"{param} must be in ({row.low:g}, {high:g}], got {value:g}")
        values[row.name] = value
    return values


def ident(value: object, where: str, *, required: bool = True) -> str:
    """An id or a name a client sends (a call id, a tool's name): a string of at most
    :data:`MAX_KEY_CHARS` characters, non-empty when ``required``."""
    if not isinstance(value, str) or len(value) > MAX_KEY_CHARS or (required and not value):
        what = "a non-empty string" if required else "a string"
        raise bad(where, f"{where} must be {what} of at most {MAX_KEY_CHARS} characters")
    return value


def ident_field(obj: Mapping[str, Any], key: str, where: str) -> str:
    """An optional id or name field of a message (``tool_call_id``, ``name``): "" when absent,
    else as :func:`ident` checks it."""
    value = obj.get(key)
    return "" if value is None else ident(value, f"{where}.{key}", required=False)


MEDIA = frozenset({"image", "image_url", "input_image", "document", "file", "input_file", "input_audio"})
"""Content part types that carry images, documents or sound (the models modeld serves read text
only): in an earlier message a named placeholder (:class:`Media`), in the newest refused by name."""
_KIND = {"image_url": "image", "input_image": "image", "input_file": "file", "input_audio": "audio"}
_ITEM = re.compile(r"^(?:messages|input)[.\[](\d+)")


def placeholder(kind: str) -> str:
    """What the model reads where an image (a document, ...) was: it is told something was there."""
    return f"[{kind} omitted: this model reads text only]"


class Media:
    """The images, documents and files of one request's content, as it is parsed (the models
    modeld serves read text only). A session must not die of one: Claude Code's screenshots and
    Reads of a PNG, Codex's ``view_image`` stay in the history of every later request. So in an
    earlier message each becomes a named placeholder (:func:`placeholder`) and is listed in the
    answer's ``modeld.omitted_content``; in the newest message (the last: what the model is asked
    to look at now) it is refused by name. Collected while
    :func:`media_omitted` is open; :meth:`settle` decides."""

    def __init__(self) -> None:
        self.omitted: list[tuple[str, str]] = []

    def omit(self, at: str, kind: str) -> str:
        kind = _KIND.get(kind, kind)
        self.omitted.append((at, kind))
        return placeholder(kind)

    def settle(self, items: int, *, refuse: bool = True) -> tuple[str, ...]:
        """Refuse what is in the newest message (the last of the request's ``items``); the rest as
        ``"<where>: <kind>"`` for the answer. Only the last message is the question: a turn that
        failed on an image (refused) stays in the agent's history without an answer, and the next
        request, a new message after it, must go on."""
        newest = items - 1 if refuse else items  # (a count of tokens answers for any message)
        for at, kind in self.omitted:
            found = _ITEM.match(at)
            if found is None or int(found.group(1)) >= newest:
                raise unsupported(
                    f"{at}.type",
                    f"{at} is {kind} content in the newest message: the models modeld serves read text only "
                    f"(in an earlier message it is left out and named)",
                )
        return tuple(f"{at}: {kind}" for at, kind in self.omitted)


_MEDIA: ContextVar[Media | None] = ContextVar("modeld_media", default=None)


@contextlib.contextmanager
def media_omitted() -> Iterator[Media]:
    """Parse a request's content with images and documents left out (:class:`Media`) instead of
    refused at once: the parser settles them when it knows which turn is the newest."""
    media = Media()
    token = _MEDIA.set(media)
    try:
        yield media
    finally:
        _MEDIA.reset(token)


TEXT_KEYS: Mapping[str, str] = {"text": "text"}
"""Part type -> the key holding its text (an API adds its own: ``input_text``, ``refusal``)."""


def text_part(
    part: object, at: str, kinds: Mapping[str, str] = TEXT_KEYS, *, skip: Collection[str] = ()
) -> str | None:
    """The text of one content part ``at`` (None: a part of a type in ``skip``, or a kind the
    caller reads itself). A part of any other type is refused by name."""
    if not isinstance(part, dict):
        raise bad(at, f"{at} must be an object")
    kind = part.get("type")
    if isinstance(kind, str) and kind in kinds:
        key = kinds[kind]
        text = part.get(key)
        if not isinstance(text, str):
            raise bad(f"{at}.{key}", f"{at}.{key} must be a string")
        return text
    if isinstance(kind, str) and kind in skip:
        return None
    if kind in MEDIA:
        media = _MEDIA.get()
        if media is not None:
            return media.omit(at, str(kind))
        raise unsupported(f"{at}.type", f"{at} is {kind} content: the models modeld serves read text only")
    raise unsupported(f"{at}.type", f"{at} of type {echo(kind)} is not supported (text parts only)")


def text_parts(
    value: object,
    where: str,
    kinds: Mapping[str, str] = TEXT_KEYS,
    *,
    skip: Collection[str] = (),
    noun: str = "content parts",
) -> list[str]:
    """Content given as a string, or as an array of parts whose text is read (:func:`text_part`)."""
    if isinstance(value, str):
        return [value]
    if not isinstance(value, list):
        raise bad(where, f"{where} must be a string or an array of {noun}")
    texts = (text_part(part, f"{where}[{j}]", kinds, skip=skip) for j, part in enumerate(value))
    return [text for text in texts if text is not None]


def checked_call(call_id: object, name: object, arguments: object, at: str, fields: str = "") -> ToolCall:
    """A tool call given back in the history, checked (arguments: a JSON object as text).
    ``at`` names the call, ``fields`` where its name and arguments are (default ``at``)."""
    fields = fields or at
    ident(call_id, f"{at}.id", required=False)
    ident(name, f"{fields}.name")
    try:
        parsed = json.loads(arguments) if isinstance(arguments, str) else None
    except (ValueError, RecursionError):
        parsed = None
    if not isinstance(parsed, dict):
        raise bad(f"{fields}.arguments", f"{fields}.arguments must be a JSON object as a string")
    return ToolCall(str(call_id), str(name), str(arguments))


def function_tool(name: object, description: object, parameters: object, where: str) -> dict[str, object]:
    """One function tool in OpenAI chat form, checked."""
    ident(name, f"{where}.name")
    if description is not None and not isinstance(description, str):
        raise bad(f"{where}.description", f"{where}.description must be a string")
    if parameters is not None and not isinstance(parameters, dict):
        raise bad(
            f"{where}.parameters", f"{where} parameters must be a JSON schema object, got {echo(parameters)}"
        )
    function: dict[str, object] = {"name": name}
    if description:
        function["description"] = description
    function["parameters"] = parameters if parameters is not None else {"type": "object", "properties": {}}
    return {"type": "function", "function": function}


def tools_json_of(functions: Collection[dict[str, object]]) -> str:
    """OpenAI chat-style tool definitions (``{"type": "function", "function": {...}}``) as the
    JSON every chat template takes."""
    return json.dumps(list(functions), ensure_ascii=False) if functions else ""


def response_format(fmt: object, param: str = "response_format") -> Constraint | None:
    """OpenAI's ``response_format`` (also the Responses API's ``text.format``) as a constraint."""
    if fmt is None:
        return None
    if not isinstance(fmt, dict):
        raise bad(param, f'{param} must be an object such as {{"type": "json_object"}}')
    kind = fmt.get("type")
    if kind == "text":
        _only(fmt, {"type"}, param)
        return None
    if kind == "json_object":
        _only(fmt, {"type", "schema"}, param)
        schema = fmt.get("schema")  # llama-server's extension: a schema for json_object
        if schema is None:
            return Constraint("json")
        if not isinstance(schema, dict):
            raise bad(f"{param}.schema", "the schema must be a JSON object")
        return Constraint("json_schema", json.dumps(schema, ensure_ascii=False))
    if kind == "json_schema":
        # Chat nests the schema under json_schema; the Responses API puts its fields inline.
        spec = fmt.get("json_schema", fmt)
        where = f"{param}.json_schema" if "json_schema" in fmt else param
        if "json_schema" in fmt:
            _only(fmt, {"type", "json_schema"}, param)
        if not isinstance(spec, dict):
            raise bad(where, f"{where} must be an object")
        _only(spec, {"type", "name", "description", "schema", "strict"}, where)
        strict = spec.get("strict")
        if strict is not None and not isinstance(strict, bool):
            raise bad(f"{where}.strict", "strict must be a boolean")
        schema = spec.get("schema")
        if schema is None:
            return Constraint("json")  # no schema: any JSON object
        if not isinstance(schema, dict):
            raise bad(f"{where}.schema", "the schema must be a JSON object")
        return Constraint("json_schema", json.dumps(schema, ensure_ascii=False))  # always strict
    raise bad(param, f"{param} type must be text, json_object or json_schema, got {echo(kind)}")


def _only(fields: Mapping[str, Any], allowed: set[str], where: str) -> None:
    for key, value in fields.items():
        if key not in allowed and value is not None:
            raise unsupported(f"{where}.{key}", f"{where}.{echo(key)} is not supported by modeld")


def tool_choice(choice: object, param: str = "tool_choice") -> str:
    """OpenAI's ``tool_choice`` as ``DecodeConfig.tool_choice`` (auto, none, required, a name)."""
    if choice is None or choice in ("auto", "none", "required"):
        return str(choice or "auto")
    if isinstance(choice, dict):
        function = choice.get("function")
        name = function.get("name") if isinstance(function, dict) else choice.get("name")
        if choice.get("type") != "function" or not isinstance(name, str) or not name:
            raise bad(
                param, f'{param} as an object must be {{"type": "function", "function": {{"name": ...}}}}'
            )
        if len(name) > MAX_KEY_CHARS:
            raise bad(param, f"{param} names a function of {len(name)} characters")
        return name
    raise bad(param, f"{param} must be 'auto', 'none', 'required' or an object, got {echo(choice)}")


def key_value(name: str, value: object) -> str:
    """A conversation key as given, checked (a string of at most 256 characters)."""
    if value is None or value == "":
        return ""
    if not isinstance(value, str):
        raise bad(name, f"{name} must be a string")
    if len(value) > MAX_KEY_CHARS:
        raise bad(name, f"{name} is {len(value)} characters; the limit is {MAX_KEY_CHARS}")
    return value


def conversation_keys(
    headers: Mapping[str, str], *, prompt_cache_key: str = "", session: str = "", user: str = ""
) -> Keys:
    """The conversation's keys: the headers every API honours (``X-Modeld-Conversation``, the
    SGLang gateway's ``X-SMG-Routing-Key``) and what the body names (checked by the caller with
    :func:`key_value`)."""
    return Keys(
        header=key_value("X-Modeld-Conversation", headers.get("x-modeld-conversation")),
        routing=key_value("X-SMG-Routing-Key", headers.get("x-smg-routing-key")),
        prompt_cache_key=prompt_cache_key,
        session=session,
        user=user,
    )
