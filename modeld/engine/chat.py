"""Rendering a segmented context with the model's own chat template (prompt_format ``chat``).

The client sends text plus a manifest whose segments carry roles. The engine turns the stable
segments into the conversation's first messages and the volatile ones into the rest, and
renders them with the model's Jinja template in the environment real templates are written for
(:mod:`modeld.engine.chat_env`). Design record: ``blueprints/0010-chat-format.md``.

Messages: a segment of kind ``message`` is one chat message given whole, as a JSON object (its
``role``, ``content`` as a string or a list of parts, ``tool_calls`` with their ``arguments``,
``tool_call_id``, ``name``, ``reasoning_content``, ...): the template sees it as sent. Any other
segment is text with a role (its ``role``, or by kind); consecutive such segments with the same
role form one message, except ``history`` segments, each of which is a message of its own.
Without segments, the whole prefix is one system message and the whole suffix one user
message. ``tools_json`` (a JSON array) is passed as ``tools``; ``template_args_json`` (a JSON
object: ``enable_thinking``, ``reasoning_effort``, a request's ``chat_template_kwargs``) as the
template's other variables.

How a conversation is rendered (llama-server's rule: the whole conversation, as the template
renders it):

* the prefix is what every rendering of the conversation shares once a message follows it:
  the common start of the prefix's messages followed by a probe message (of the first volatile
  segment's role, else ``user``) with two different contents; when the manifest says nothing
  follows but the generation prompt, what the messages rendered with and without it share. So a template that renders the
  last assistant turn otherwise once a user turn follows (Qwen3 drops its reasoning), or that
  refuses a system message alone (Llama 3.3 with tools, Qwen3.5), renders the prefix as it
  will render it in the whole conversation, and is never asked to render the prefix alone;
* the suffix is the whole conversation rendered with the generation prompt and tokenized whole
  (so the prompt's tokens are exactly the whole rendering's), minus the longest common token
  prefix with the resident prefix. Where the template still renders the prefix otherwise (the
  suffix's later messages change it: Mistral moves the tools before the last user message) or a
  token straddles the cut, the prefix is cut back to that common prefix and the rest
  recomputed: never refused.

Where each segment's text lands in a rendering is recorded (:func:`locate`), so token ranges
can still be reported and a divergence named by its message.
"""

from __future__ import annotations

import contextlib
import datetime
import functools
import json
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, replace
from typing import Any

from modeld.cache.reuse import common_prefix_len
from modeld.contract import ModelInfo, ToolCall
from modeld.decoding.reasoning import detect_reasoning
from modeld.decoding.tools import detect_format, format_calls
from modeld.engine.chat_env import TemplateRefusedError, compile_template, render_template
from modeld.errors import InvalidArgumentError, UnsupportedError
from modeld.manifest import ROLES, Segment, bytes_hash

__all__ = [
    "RESERVED_ARGS",
    "ChatRenderer",
    "Message",
    "locate",
    "messages_for",
    "parse_template_args",
    "parse_tools",
    "reasoning_name",
    "with_template",
]

RESERVED_ARGS = frozenset({"messages", "tools", "add_generation_prompt", "bos_token", "eos_token"})
"""Template variables modeld sets itself: template arguments may not name them (the HTTP layer
refuses the same names early, ``server/http/chat_template.RESERVED``)."""

_MESSAGE_ROLES = (*ROLES, "developer")
_THINKING = re.compile(
    r"""\.thinking\b|\[['"]thinking['"]\]|['"]thinking['"]\s+in\s|get\(\s*['"]thinking['"]"""
)
"""A template reading a message's ``thinking`` field (how gpt-oss and LFM2 name reasoning)."""
_PROBES = ("A", "Z")
"""Two contents of the probe message; the prefix is what both renderings share."""


@dataclass(frozen=True, slots=True)
class Message:
    """One message: ``role`` and ``content`` (text), or the whole message as JSON (``whole``,
    a ``message`` segment's bytes) when it carries more than text."""

    role: str
    content: str
    segments: tuple[int, ...]  # indexes into the manifest's segments
    whole: str = ""

    def value(
        self, string_arguments: bool, reads_parts: bool, reads_thinking: str = "", calls_format: str = ""
    ) -> dict[str, Any]:
        """What the template sees: a fresh dict (a template may change what it is given).
        ``string_arguments``: tool-call arguments as JSON text (for templates that print them
        as they are), else as objects. ``reads_parts``: content sent as a list of parts stays
        one, else its text parts are joined with newlines (as llama-server joins them).
        ``reads_thinking``: the template reads an assistant's reasoning as ``thinking``
        (gpt-oss, LFM2), which gets ``reasoning_content`` (as llama-server copies it); for a
        harmony template (``harmony``: gpt-oss), a call's content then goes, as llama-server
        drops it (the template refuses a call with both). ``calls_format``: the template does
        not render ``tool_calls``, so they are written into the content in that family's markup
        (:attr:`ChatRenderer.calls_format`)."""
        if not self.whole:
            return {"role": self.role, "content": self.content}
        value: dict[str, Any] = json.loads(self.whole)
        if reads_thinking and isinstance(value.get("reasoning_content"), str) and "thinking" not in value:
            value["thinking"] = value["reasoning_content"]
            if reads_thinking == "harmony" and value.get("tool_calls"):
                value.pop("content", None)  # harmony shows a call's analysis once: the thinking
        if calls_format and value.get("tool_calls"):
            _calls_into_content(value, calls_format)
        content = value.get("content")
        if isinstance(content, list) and not reads_parts:
            texts = [p.get("text") for p in content if isinstance(p, dict) and p.get("type") == "text"]
            value["content"] = "\n".join(t for t in texts if isinstance(t, str))
        for call in value.get("tool_calls") or ():
            function = call.get("function") if isinstance(call, dict) else None
            if not isinstance(function, dict) or "arguments" not in function:
                continue
            arguments = function["arguments"]
            if string_arguments and not isinstance(arguments, str):
                function["arguments"] = json.dumps(arguments, ensure_ascii=False)
            elif not string_arguments and isinstance(arguments, str):
                with contextlib.suppress(ValueError):  # not JSON: the template gets the text as sent
                    function["arguments"] = json.loads(arguments)
        return value

    def needles(self) -> list[str]:
        """Texts of this message a rendering shows as they are (to locate it)."""
        if not self.whole:
            return [self.content]
        value = json.loads(self.whole)
        found: list[str] = []
        content = value.get("content")
        if isinstance(content, str):
            found.append(content)
        elif isinstance(content, list):
            found += [p["text"] for p in content if isinstance(p, dict) and isinstance(p.get("text"), str)]
        for call in value.get("tool_calls") or ():
            function = call.get("function") if isinstance(call, dict) else None
            if isinstance(function, dict) and isinstance(function.get("name"), str):
                found.append(function["name"])
        return [t for t in found if t]


def _calls_into_content(value: dict[str, Any], fmt: str) -> None:
    """A message's ``tool_calls`` written after its content in family ``fmt``'s markup (what the
    model writes for them), for a template that shows no ``tool_calls`` (llama.cpp's templates
    get the same polyfill)."""
    calls: list[ToolCall] = []
    for call in value.pop("tool_calls"):
        function = call.get("function") if isinstance(call, dict) else None
        if not isinstance(function, dict) or not isinstance(function.get("name"), str):
            continue
        arguments = function.get("arguments", "{}")
        text = arguments if isinstance(arguments, str) else json.dumps(arguments, ensure_ascii=False)
        calls.append(ToolCall(str(call.get("id", "")), function["name"], text))
    written = format_calls(fmt, calls)
    content = value.get("content")
    if isinstance(content, list):
        value["content"] = [*content, {"type": "text", "text": written}]
    else:
        value["content"] = (content or "") + ("\n" if content else "") + written


def _whole_message(raw: bytes, where: str, role: str) -> tuple[str, str, str]:
    """A ``message`` segment's JSON, checked: (role, its text content, the JSON)."""
    try:
        value = json.loads(raw.decode("utf-8"))
    except (ValueError, RecursionError) as exc:  # too deep a nesting is as bad
        raise InvalidArgumentError(f"{where} is a message segment but not JSON: {exc}", field=where) from None
    if not isinstance(value, dict):
        raise InvalidArgumentError(f"{where} is a message segment but not a JSON object", field=where)
    got = value.get("role")
    if not isinstance(got, str) or got not in _MESSAGE_ROLES:
        raise InvalidArgumentError(
            f"{where}.role must be one of {', '.join(_MESSAGE_ROLES)}, got {got!r}", field=where
        )
    if role and role != got and not (got == "developer" and role == "system"):
        raise InvalidArgumentError(f"{where} says role {role!r} but its message is {got!r}", field=where)
    content = value.get("content")
    if content is not None and not isinstance(content, str | list):
        raise InvalidArgumentError(f"{where}.content must be a string, a list of parts or null", field=where)
    calls = value.get("tool_calls")
    if calls is not None and not isinstance(calls, list):
        raise InvalidArgumentError(f"{where}.tool_calls must be a list", field=where)
    return got, content if isinstance(content, str) else "", json.dumps(value, ensure_ascii=False)


def messages_for(
    segments: Sequence[Segment], data: bytes, base: int, *, stable: bool, default_role: str
) -> list[Message]:
    """The messages the stable (or volatile) segments make; ``data`` starts at byte ``base``."""
    chosen = [(i, s) for i, s in enumerate(segments) if s.stable == stable]
    if not chosen:
        text = data.decode("utf-8")
        return [Message(default_role, text, ())] if text else []
    out: list[Message] = []
    mergeable = False
    for index, seg in chosen:
        raw = data[seg.byte_start - base : seg.byte_end - base]
        if seg.kind == "message":
            role, content, whole = _whole_message(raw, f"segments[{index}]", seg.role)
            out.append(Message(role, content, (index,), whole))
            mergeable = False
            continue
        content = raw.decode("utf-8", errors="replace")
        role = seg.chat_role
        if out and mergeable and out[-1].role == role and seg.kind != "history":
            last = out[-1]
            out[-1] = Message(role, last.content + content, (*last.segments, index))
        else:
            out.append(Message(role, content, (index,)))
        mergeable = seg.kind != "history"
    return out


def parse_tools(tools_json: str) -> list[Any] | None:
    if not tools_json:
        return None
    try:
        tools = json.loads(tools_json)
    except (ValueError, RecursionError) as exc:  # too deep a nesting is as bad
        raise InvalidArgumentError(f"tools_json is not valid JSON: {exc}", field="tools_json") from exc
    if not isinstance(tools, list):
        raise InvalidArgumentError("tools_json must be a JSON array of tool definitions", field="tools_json")
    return tools or None


def parse_template_args(args_json: str) -> dict[str, Any]:
    """``template_args_json``: a JSON object of template variables (not the reserved ones)."""
    if not args_json:
        return {}
    try:
        args = json.loads(args_json)
    except (ValueError, RecursionError) as exc:  # too deep a nesting is as bad
        raise InvalidArgumentError(
            f"template_args_json is not valid JSON: {exc}", field="template_args_json"
        ) from exc
    if not isinstance(args, dict):
        raise InvalidArgumentError("template_args_json must be a JSON object", field="template_args_json")
    reserved = sorted(RESERVED_ARGS.intersection(args))
    if reserved:
        raise InvalidArgumentError(
            f"template_args_json may not set {', '.join(reserved)} (modeld sets them)",
            field="template_args_json",
        )
    return args


class ChatRenderer:
    """Renders conversations with one model's chat template."""

    def __init__(self, template: str, *, bos_token: str = "", eos_token: str = "") -> None:
        if not template:
            raise UnsupportedError(
                "this model has no chat template; use prompt_format 'raw'", field="prompt_format"
            )
        self._template = compile_template(template)
        self.source = template
        self.bos_token = bos_token
        self.eos_token = eos_token

    @functools.cached_property
    def string_arguments(self) -> bool:
        """Whether tool-call arguments reach the template as the JSON text the client sent (the
        model's own text of its call, byte for byte: its tokens stay warm) rather than as
        objects. Objects where the template formats them key by key (Gemma 4's ``k:v``,
        Qwen3-Coder's ``<parameter=k>``: what it was trained on) or cannot show text (it
        refuses it, or prints it otherwise than sent); text where it shows text as it is (Qwen3's
        ``arguments is string`` branch) and would only serialize an object. Found by rendering a
        probe call both ways."""
        as_object = self._probe_call({"qQ": "wW7"})
        if as_object is not None and "wW7" in as_object:
            printed = ('{"qQ": "wW7"}', "{'qQ': 'wW7'}")  # serialized (tojson) or Python's repr
            if not any(p in as_object for p in printed):
                return False  # formatted key by key
            if printed[1] in as_object:
                return True  # an object is printed as Python's repr: it wants text
        text = '{"qQ":"wW7"}'
        as_text = self._probe_call(text)
        return as_text is not None and text in as_text

    @functools.cached_property
    def calls_format(self) -> str:
        """ "" when the template renders an assistant's ``tool_calls`` (its probe call's
        arguments show, as an object or as text); else the tool-call family its text names
        (hermes when none) in which they are written into the message's content instead, so a
        template that ignores them still shows the model its earlier calls as it wrote them."""
        rendered = [self._probe_call(arguments) for arguments in ({"qQ": "wW7"}, '{"qQ":"wW7"}')]
        shown = [text for text in rendered if text is not None]
        if not shown or any("wW7" in text for text in shown):
            return ""  # it renders calls, or refuses the probe (Mistral's ids): calls stay fields
        return detect_format(self.source) or "hermes"

    def _probe_call(self, arguments: object) -> str | None:
        call = {"id": "call_1", "type": "function", "function": {"name": "probe", "arguments": arguments}}
        messages: list[dict[str, Any]] = [
            {"role": "user", "content": "u"},
            {"role": "assistant", "content": "", "tool_calls": [call]},
            {"role": "tool", "content": "r", "tool_call_id": "call_1"},
        ]
        tool = {"type": "function", "function": {"name": "probe", "parameters": {"type": "object"}}}
        try:
            return self._render_values(messages, [tool], {}, add_generation_prompt=True)
        except TemplateRefusedError:
            return None

    @functools.cached_property
    def reads_thinking(self) -> str:
        """Whether the template reads a message's reasoning as ``thinking``: ``harmony`` for a
        harmony template (channels), ``yes`` for another, "" when it does not."""
        if _THINKING.search(self.source) is None:
            return ""
        return "harmony" if "<|channel|>" in self.source else "yes"

    @functools.cached_property
    def reads_parts(self) -> bool:
        """Whether the template reads content given as a list of parts (it shows a text part's
        text); else such content reaches it as one string."""
        messages: list[dict[str, Any]] = [{"role": "user", "content": [{"type": "text", "text": "pArT7"}]}]
        try:
            text = self._render_values(messages, None, {}, add_generation_prompt=True)
        except TemplateRefusedError:
            return False
        printed = ("'text': 'pArT7'", '"text": "pArT7"')  # the list itself, printed: not read
        return "pArT7" in text and not any(p in text for p in printed)

    def _render_values(
        self,
        messages: list[dict[str, Any]],
        tools: list[Any] | None,
        args: Mapping[str, Any],
        *,
        add_generation_prompt: bool,
    ) -> str:
        now = datetime.datetime.now()
        values: dict[str, Any] = {  # what llama-server gives every template, unless args say otherwise
            "enable_thinking": True,
            "date_string": now.strftime("%d %b %Y"),
            "datetime": now.strftime("%b %d %Y"),
        }
        values.update(args)
        values.update(
            messages=messages,
            add_generation_prompt=add_generation_prompt,
            bos_token=self.bos_token,
            eos_token=self.eos_token,
        )
        if tools:  # as llama-server: no tools, no variable (``tools is defined`` is false)
            values["tools"] = json.loads(json.dumps(tools))
        return render_template(self._template, values)

    def render(
        self,
        messages: Sequence[Message],
        tools: list[Any] | None,
        *,
        add_generation_prompt: bool,
        args: Mapping[str, Any] | None = None,
    ) -> str:
        """The template's text for ``messages`` (raises :class:`TemplateRefusedError`)."""
        whole = any(m.whole for m in messages)
        strings = self.string_arguments if whole else False
        parts = self.reads_parts if whole else False
        return self._render_values(
            [
                m.value(strings, parts, self.reads_thinking, self.calls_format if whole else "")
                for m in messages
            ],
            tools,
            json.loads(json.dumps(args or {})),
            add_generation_prompt=add_generation_prompt,
        )

    def render_prefix(
        self,
        messages: Sequence[Message],
        next_role: str | None,
        tools: list[Any] | None,
        args: Mapping[str, Any] | None = None,
    ) -> str:
        """The text every rendering of ``messages`` followed by a ``next_role`` message starts
        with (module docstring); ``next_role`` None: only the generation prompt follows, and the
        prefix is what the messages rendered with and without it share. A template that refuses
        that gets the probe of a user message; one that refuses everything an empty prefix (the
        whole conversation is then rendered with the suffix)."""
        if next_role is None:
            both = self._renderings([(messages, False), (messages, True)], tools, args)
            if both is not None:
                return _common_start(*both)
            next_role = "user"
        last_call = _last_call(messages)
        probes = [([*messages, _probe(next_role, c, last_call)], True) for c in _PROBES]
        found = self._renderings(probes, tools, args)
        if found is not None:
            return _common_start(*found)
        try:
            return self.render(messages, tools, add_generation_prompt=False, args=args)
        except TemplateRefusedError:
            return ""

    def _renderings(
        self,
        cases: Sequence[tuple[Sequence[Message], bool]],
        tools: list[Any] | None,
        args: Mapping[str, Any] | None,
    ) -> tuple[str, str] | None:
        """Two renderings (messages, with the generation prompt or not), or None if refused."""
        try:
            first, second = (self.render(m, tools, add_generation_prompt=g, args=args) for m, g in cases)
        except TemplateRefusedError:
            return None
        return first, second


def reasoning_name(template: str) -> str:
    """The reasoning family ``template`` marks thinking with (``decoding.reasoning``: ``think``,
    ``harmony``, ``seed``, ...), or "" (none recognised). Whether a prompt opened the block is
    read from the rendered prompt at each decode, not from the template."""
    found = detect_reasoning(template) if template else None
    return "" if found is None else found.name


def with_template(info: ModelInfo, override: str) -> ModelInfo:
    """``info`` for sessions rendering with ``override`` instead of the file's template (a
    session's ``chat_template``; ``--chat-template-file``): its digest, source and formats.
    An override that does not compile is refused here (``unsupported``), before any session."""
    if not override:
        return (
            info
            if info.template_source or not info.chat_template
            else replace(info, template_source="model", reasoning_format=reasoning_name(info.chat_template))
        )
    compile_template(override)
    return replace(
        info,
        chat_template=override,
        template_digest=bytes_hash(override),
        template_source="override",
        tool_format=detect_format(override),
        reasoning_format=reasoning_name(override),
    )


def _common_start(a: str, b: str) -> str:
    """The longest text both start with (a character loop took milliseconds on a 20k-token
    agent prompt, every turn: the token lists' chunked comparison serves texts too)."""
    return a[: common_prefix_len(a, b)]


def _last_call(messages: Sequence[Message]) -> str:
    """The id of the last tool call in ``messages`` (a tool probe answers it)."""
    for m in reversed(messages):
        if not m.whole:
            continue
        for call in reversed(json.loads(m.whole).get("tool_calls") or []):
            return str(call.get("id") or "") if isinstance(call, dict) else ""
    return ""


def _probe(role: str, content: str, last_call: str) -> Message:
    """A probe message; a tool result answers the last call (by its id only, as clients send)."""
    if role == "tool":
        whole = json.dumps({"role": "tool", "content": content, "tool_call_id": last_call})
        return Message("tool", content, (), whole)
    return Message(role, content, ())


def locate(
    text: str,
    segments: Sequence[Segment],
    messages: Sequence[Message],
    data: bytes,
    base: int,
    start: int = 0,
) -> dict[int, tuple[int, int]]:
    """Byte ranges of each segment's text inside the rendered ``text``, searched in order from
    byte ``start``. A ``message`` segment's range runs from the first to the last of its texts
    (content, reasoning, call names) that the rendering shows as they are."""
    encoded = text.encode("utf-8")
    spans: dict[int, tuple[int, int]] = {}
    pos = start
    for message in messages:
        if message.whole:
            first = last = -1
            for piece in message.needles():
                wanted = piece.encode("utf-8")
                found = encoded.find(wanted, pos)
                if found < 0:
                    continue
                first = found if first < 0 else first
                last = pos = found + len(wanted)
            if first >= 0:
                spans[message.segments[0]] = (first, last)
            continue
        for index in message.segments:
            seg = segments[index]
            needle = data[seg.byte_start - base : seg.byte_end - base]
            if not needle:
                continue
            found = encoded.find(needle, pos)
            if found < 0:
                continue
            spans[index] = (found, found + len(needle))
            pos = found + len(needle)
    return spans
