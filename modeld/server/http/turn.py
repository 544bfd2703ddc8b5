"""One turn, whatever API it came from: what every HTTP adapter parses its request into.

An adapter (OpenAI chat and completions, OpenAI Responses, Anthropic Messages, Ollama) turns
its wire format into a :class:`Turn`: the conversation as :class:`Message` values (role, text,
the tool calls an assistant made, its reasoning), the tools (OpenAI function definitions, the
form every chat template takes), the decode configuration (samplers, stop strings, the
constraint, ``tool_choice``), the output budget, and the conversation's :class:`Keys`. The
conversation layer (:mod:`modeld.server.http.conversations`) runs it; the adapter shapes the
events back. Nothing here knows an API's wire format.

The conversation key (``Keys.resolve``): the explicit ``X-Modeld-Conversation`` header, else
``X-SMG-Routing-Key`` (what the SGLang gateway forwards and routes on), else the request's
``prompt_cache_key``, else the agent's session (Claude Code's ``metadata.user_id`` holds a
``session_id``), else ``user``, else a digest of the model and the conversation's first system
and user messages. The same order for every API.

Splitting into the contract's prefix and suffix (:func:`chat_inputs`): the stable prefix is
the conversation through its last assistant message (a first turn: the leading system
messages, at least one message); the suffix is what follows (the new user turn, tool results).
One manifest segment of kind ``message`` per message: the message whole, as JSON (role,
content as a string or as text parts, tool calls with their arguments as sent (the renderer
gives a template objects where it formats them itself), the id and
name a tool result answers, the reasoning), so the model's template renders it as it was sent
(blueprint 0010). The template's arguments (``Turn.template_args``: ``enable_thinking``,
``reasoning_effort``, ``chat_template_kwargs``) go with the prefix.
"""

from __future__ import annotations

import json
import time
import uuid
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, replace

import xxhash

from modeld.contract import DecodeConfig, PrefixInput, SuffixInput, ToolCall
from modeld.decoding.sampling import choice_seed
from modeld.manifest import ContextManifest, Segment

__all__ = [
    "Keys",
    "Message",
    "Recall",
    "Turn",
    "chat_inputs",
    "split_point",
    "template_args_json",
    "turn_bytes",
]

ROLES = ("system", "user", "assistant", "tool")


@dataclass(frozen=True, slots=True)
class Message:
    """One message of the conversation. ``calls``: the tool calls an assistant message made;
    ``reasoning``: what an assistant thought (history only: templates decide whether it is
    shown to the model again); ``tool_call_id`` and ``name``: the call a tool result answers
    and its function; ``parts``: the content's text parts when the client sent it as parts
    (``content`` is then their text joined)."""

    role: str
    content: str
    calls: tuple[ToolCall, ...] = ()
    reasoning: str = ""
    tool_call_id: str = ""
    name: str = ""
    parts: tuple[str, ...] = ()


@dataclass(frozen=True, slots=True)
class Keys:
    """Where the request names its conversation (each "" when absent)."""

    header: str = ""  # X-Modeld-Conversation
    routing: str = ""  # X-SMG-Routing-Key
    prompt_cache_key: str = ""
    session: str = ""  # an agent's own session id (Claude Code's metadata.user_id)
    user: str = ""

    def resolve(self) -> str:
        """The conversation key in the documented order, tagged with its source ("" = none)."""
        for source, value in (
            ("conversation", self.header),
            ("routing", self.routing),
            ("prompt_cache_key", self.prompt_cache_key),
            ("session", self.session),
            ("user", self.user),
        ):
            if value:
                return f"{source}:{value}"
        return ""


@dataclass(frozen=True)
class Turn:
    """One request as the conversation layer runs it.

    ``prompt`` set: a raw prompt, evaluated as given (``/v1/completions``, Ollama's raw
    generate); else ``messages`` rendered with the model's template. ``max_tokens`` None: up
    to the window. ``omitted_tools``: hosted tool types left out of the prompt (Responses).
    """

    api: str
    model: str
    decode: DecodeConfig
    keys: Keys
    stream: bool = False
    messages: tuple[Message, ...] = ()
    prompt: str | None = None
    tools_json: str = ""
    max_tokens: int | None = None
    parallel_tool_calls: bool = True
    num_ctx: int = 0  # a context window the request asks for (Ollama's options.num_ctx); 0: default
    omitted_tools: tuple[str, ...] = ()
    template_args: tuple[tuple[str, object], ...] = ()  # chat-template variables (``template_args``)
    n: int = 1  # choices (OpenAI's n): decoded together from the same prompt (else one after another)
    truncate: bool = False  # a prompt beyond the window loses its oldest messages (Ollama's way)
    omitted_content: tuple[str, ...] = ()  # images, documents of earlier turns left out ("where: kind")
    id: str = field(default_factory=lambda: uuid.uuid4().hex[:24])
    created: int = field(default_factory=lambda: int(time.time()))

    @property
    def chat(self) -> bool:
        return self.prompt is None

    def choice(self, index: int) -> Turn:
        """The one-choice turn that decodes choice ``index`` alone: a set seed moves by the
        index (``choice_seed``: the rule the engine's batched choices follow too), so choices
        differ yet each is reproducible; without a seed each draws its own."""
        return replace(self, n=1, decode=replace(self.decode, seed=choice_seed(self.decode.seed, index)))

    def conversation(self) -> str:
        """The conversation key (``Keys.resolve``), else a digest of how the conversation began."""
        return self.keys.resolve() or (
            f"completions:{self.model}" if not self.chat else auto_key(self.model, self.messages)
        )


def turn_bytes(turn: Turn) -> int:
    """The bytes of text the turn sends the model (its messages, calls and tools, or its raw
    prompt): what its prompt's size is estimated from before it is counted."""
    if not turn.chat:
        return len((turn.prompt or "").encode("utf-8", "surrogatepass"))
    size = len(turn.tools_json.encode("utf-8", "surrogatepass"))
    for m in turn.messages:
        size += len(m.content.encode("utf-8", "surrogatepass")) + len(
            m.reasoning.encode("utf-8", "surrogatepass")
        )
        size += sum(len(c.name) + len(c.arguments.encode("utf-8", "surrogatepass")) for c in m.calls)
    return size


def auto_key(model: str, messages: Sequence[Message]) -> str:
    """A conversation's identity when the client names none: its first system and user message."""
    h = xxhash.xxh3_64(model.encode())
    seen: set[str] = set()
    for m in messages:
        if m.role in ("system", "user") and m.role not in seen:
            seen.add(m.role)
            h.update(f"\0{m.role}\0".encode())
            h.update(m.content.encode("utf-8", errors="surrogatepass"))
        if seen == {"system", "user"}:
            break
    return f"auto:{h.hexdigest()}"


def split_point(messages: Sequence[Message]) -> int:
    """How many messages form the stable prefix: through the last assistant message, else the
    leading system messages, and at least the first message (templates index messages[0])."""
    last_assistant = max((i for i, m in enumerate(messages) if m.role == "assistant"), default=-1)
    if last_assistant >= 0:
        return last_assistant + 1
    k = 0
    while k < len(messages) and messages[k].role == "system":
        k += 1
    return max(k, 1)


Recall = Callable[[ToolCall], str]
"""A call's arguments text as the model wrote it, when the daemon knows it (else as sent)."""


def message_json(message: Message, recall: Recall | None = None) -> str:
    """One message whole, as the JSON a ``message`` segment carries (the same bytes for the same
    message on every turn): the fields the client sent, nothing made up (a tool result names
    its function only if the client did: templates that need it look it up by the call's id, as
    with llama-server); ``recall``: a call's arguments as the model wrote them."""
    value: dict[str, object] = {"role": message.role}
    if message.parts:
        value["content"] = [{"type": "text", "text": p} for p in message.parts]
    else:
        value["content"] = message.content
    if message.reasoning:
        value["reasoning_content"] = message.reasoning
    if message.calls:
        value["tool_calls"] = [
            {
                "id": c.id,
                "type": "function",
                "function": {"name": c.name, "arguments": recall(c) if recall is not None else c.arguments},
            }
            for c in message.calls
        ]
    if message.tool_call_id:
        value["tool_call_id"] = message.tool_call_id
    if message.name:
        value["name"] = message.name
    return json.dumps(value, ensure_ascii=False)


def chat_inputs(
    messages: Sequence[Message],
    k: int,
    tools_json: str,
    profile: str,
    args: str = "",
    recall: Recall | None = None,
) -> tuple[PrefixInput, SuffixInput]:
    """The prefix (messages before ``k``) and suffix, one ``message`` segment per message;
    ``args``: the template's arguments (a JSON object, or ""); ``recall``: calls' arguments as
    the model wrote them (:meth:`Conversations.recall`)."""
    prefix_parts: list[bytes] = []
    suffix_parts: list[bytes] = []
    segments: list[Segment] = []
    offset = 0
    for i, m in enumerate(messages):
        data = message_json(m, recall).encode("utf-8")
        stable = i < k
        segments.append(
            Segment(
                kind="message", byte_start=offset, byte_end=offset + len(data), stable=stable, role=m.role
            )
        )
        (prefix_parts if stable else suffix_parts).append(data)
        offset += len(data)
    prefix_text = b"".join(prefix_parts).decode("utf-8")
    manifest = ContextManifest(
        profile_id=profile,
        stable_bytes=len(prefix_text.encode()),
        total_bytes=offset,
        segments=tuple(segments),
    )
    return (
        PrefixInput(text=prefix_text, manifest=manifest, tools_json=tools_json, template_args_json=args),
        SuffixInput(text=b"".join(suffix_parts).decode("utf-8"), manifest=manifest),
    )


def template_args_json(turn: Turn) -> str:
    """The turn's chat-template arguments as the JSON object the prefix carries ("" for none)."""
    return (
        json.dumps(dict(turn.template_args), ensure_ascii=False, sort_keys=True) if turn.template_args else ""
    )
