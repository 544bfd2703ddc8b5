"""Rendering a segmented context with the model's own chat template (prompt_format ``chat``).

The client sends plain text plus a manifest whose segments carry roles (by kind, or stated).
The engine turns the stable segments into the conversation's first messages and the volatile
ones into the rest, and renders them with the model's Jinja template (sandboxed, as
Hugging Face and llama-cpp-python do):

* prefix = ``render(prefix_messages, tools, add_generation_prompt=False)``
* suffix = ``render(prefix_messages + suffix_messages, tools, add_generation_prompt=True)``
  minus the prefix, which must be a prefix of it (true for ChatML-like templates; a template
  that rewrites earlier turns when more follow is refused with ``unsupported``, because the
  prefix's KV would not be reusable anyway).

Grouping: consecutive segments with the same role form one message, except ``history``
segments, each of which is a message of its own. Without segments, the whole prefix is one
system message and the whole suffix one user message. ``tools_json`` (a JSON array) is passed
as ``tools``. Where each segment's text lands in the rendered text is recorded, so token
ranges can still be reported (a segment the template altered gets none).

``tojson`` behaves like Hugging Face's (no key sorting, no HTML escaping), not Jinja's.

Jinja2 is imported on first use: the base package (no extras) serves prompt_format ``raw``
without it, and a chat session there fails with ``unsupported`` naming the extra to install.
"""

from __future__ import annotations

import functools
import importlib
import json
from collections.abc import Sequence
from dataclasses import dataclass
from types import ModuleType
from typing import TYPE_CHECKING, Any

from modeld.errors import InvalidArgumentError, UnsupportedError
from modeld.manifest import Segment

if TYPE_CHECKING:
    import jinja2

__all__ = ["ChatRenderer", "Message", "Rendered", "messages_for"]


@dataclass(frozen=True, slots=True)
class Message:
    role: str
    content: str
    segments: tuple[int, ...]  # indexes into the manifest's segments


@dataclass(frozen=True, slots=True)
class Rendered:
    text: str
    spans: dict[int, tuple[int, int]]  # segment index -> byte range in ``text`` (when found)


def messages_for(
    segments: Sequence[Segment], data: bytes, base: int, *, stable: bool, default_role: str
) -> list[Message]:
    """The messages the stable (or volatile) segments make; ``data`` starts at byte ``base``."""
    chosen = [(i, s) for i, s in enumerate(segments) if s.stable == stable]
    if not chosen:
        text = data.decode("utf-8")
        return [Message(default_role, text, ())] if text else []
    out: list[Message] = []
    previous_history = True
    for index, seg in chosen:
        content = data[seg.byte_start - base : seg.byte_end - base].decode("utf-8", errors="replace")
        role = seg.chat_role
        is_history = seg.kind == "history"
        if out and out[-1].role == role and not is_history and not previous_history:
            last = out[-1]
            out[-1] = Message(role, last.content + content, (*last.segments, index))
        else:
            out.append(Message(role, content, (index,)))
        previous_history = is_history
    return out


def parse_tools(tools_json: str) -> list[Any] | None:
    if not tools_json:
        return None
    try:
        tools = json.loads(tools_json)
    except ValueError as exc:
        raise InvalidArgumentError(f"tools_json is not valid JSON: {exc}", field="tools_json") from exc
    if not isinstance(tools, list):
        raise InvalidArgumentError("tools_json must be a JSON array of tool definitions", field="tools_json")
    return tools


def _tojson(value: Any, indent: int | None = None, separators: Any = None, sort_keys: bool = False) -> str:
    return json.dumps(value, ensure_ascii=False, indent=indent, separators=separators, sort_keys=sort_keys)


def _jinja2() -> ModuleType:
    """The jinja2 module (with its sandbox), or ``unsupported`` naming the extra to install."""
    try:
        module = importlib.import_module("jinja2")
        importlib.import_module("jinja2.sandbox")
    except ImportError as exc:
        raise UnsupportedError(
            "prompt_format 'chat' renders the model's template with jinja2, which is not installed "
            f"({exc.name}); install modeld[http] (or the llama/openvino extra), or use prompt_format 'raw'",
            field="config.prompt_format",
        ) from None
    return module


def _raise(message: str) -> None:
    raise _jinja2().TemplateError(message)


@functools.lru_cache(maxsize=16)
def _compile(template: str) -> jinja2.Template:
    jinja = _jinja2()
    env = jinja.sandbox.ImmutableSandboxedEnvironment(
        loader=jinja.BaseLoader(), trim_blocks=True, lstrip_blocks=True
    )
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise
    compiled: jinja2.Template = env.from_string(template)
    return compiled


class ChatRenderer:
    """Renders messages with one model's chat template."""

    def __init__(self, template: str, *, bos_token: str = "", eos_token: str = "") -> None:
        if not template:
            raise UnsupportedError(
                "this model has no chat template; use prompt_format 'raw'", field="prompt_format"
            )
        self._jinja = _jinja2()
        try:
            self._template = _compile(template)
        except self._jinja.TemplateError as exc:
            raise UnsupportedError(
                f"the model's chat template does not compile: {exc}", field="prompt_format"
            ) from exc
        self.bos_token = bos_token
        self.eos_token = eos_token

    def render(
        self, messages: Sequence[Message], tools: list[Any] | None, *, add_generation_prompt: bool
    ) -> Rendered:
        try:
            text = self._template.render(
                messages=[{"role": m.role, "content": m.content} for m in messages],
                tools=tools,
                add_generation_prompt=add_generation_prompt,
                bos_token=self.bos_token,
                eos_token=self.eos_token,
            )
        except self._jinja.TemplateError as exc:
            raise UnsupportedError(
                f"the model's chat template refused this context: {exc}", field="prompt_format"
            ) from exc
        return Rendered(text, {})

    def render_prefix(
        self,
        messages: Sequence[Message],
        segments: Sequence[Segment],
        data: bytes,
        base: int,
        tools: list[Any] | None,
    ) -> Rendered:
        rendered = self.render(messages, tools, add_generation_prompt=False)
        return Rendered(rendered.text, _locate(rendered.text, 0, segments, data, base, messages))

    def render_suffix(
        self,
        prefix_messages: Sequence[Message],
        suffix_messages: Sequence[Message],
        segments: Sequence[Segment],
        data: bytes,
        base: int,
        tools: list[Any] | None,
    ) -> Rendered:
        prefix = self.render(prefix_messages, tools, add_generation_prompt=False).text
        full = self.render([*prefix_messages, *suffix_messages], tools, add_generation_prompt=True).text
        if not full.startswith(prefix):
            raise UnsupportedError(
                "the model's chat template renders earlier turns differently once more follow, so the "
                "prefix cannot be kept warm; use prompt_format 'raw' and render the prompt yourself",
                field="prompt_format",
            )
        text = full[len(prefix) :]
        return Rendered(text, _locate(text, 0, segments, data, base, suffix_messages))


def _locate(
    text: str, start: int, segments: Sequence[Segment], data: bytes, base: int, messages: Sequence[Message]
) -> dict[int, tuple[int, int]]:
    """Byte ranges of each segment's text inside the rendered text, searched in order."""
    encoded = text.encode("utf-8")
    spans: dict[int, tuple[int, int]] = {}
    pos = start
    for message in messages:
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
