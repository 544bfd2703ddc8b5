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
messages, at least one message, because templates index ``messages[0]``); the suffix is what
follows (the new user turn, tool results). One manifest segment per message, with its role.
"""

from __future__ import annotations

import time
import uuid
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, replace

import xxhash

from modeld.contract import DecodeConfig, PrefixInput, SuffixInput, ToolCall
from modeld.decoding.sampling import choice_seed
from modeld.decoding.tools import format_calls
from modeld.manifest import ContextManifest, Segment

__all__ = ["Keys", "Message", "Recall", "Turn", "chat_inputs", "split_point"]

ROLES = ("system", "user", "assistant", "tool")


@dataclass(frozen=True, slots=True)
class Message:
    """One message of the conversation. ``calls``: the tool calls an assistant message made;
    ``reasoning``: what an assistant thought (history only: templates decide whether it is
    shown to the model again)."""

    role: str
    content: str
    calls: tuple[ToolCall, ...] = ()
    reasoning: str = ""


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
    n: int = 1  # choices (OpenAI's n): decoded together from the same prompt (else one after another)
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


Recall = Callable[[tuple[str, ...]], str | None]
"""The exact generated text of calls this daemon returned, by their ids (None: not known)."""


def chat_inputs(
    messages: Sequence[Message],
    k: int,
    tools_json: str,
    fmt: str,
    recall: Recall | None,
    profile: str,
) -> tuple[PrefixInput, SuffixInput]:
    """The prefix (messages before ``k``) and suffix, one manifest segment per message; an
    assistant message's tool calls follow its content, written in the model's format ``fmt``
    (the exact generated text where ``recall`` knows it)."""
    prefix_parts: list[bytes] = []
    suffix_parts: list[bytes] = []
    segments: list[Segment] = []
    offset = 0
    for i, m in enumerate(messages):
        text = m.content
        if m.calls:
            known = recall(tuple(c.id for c in m.calls)) if recall is not None else None
            text += known if known is not None else (("\n" if text else "") + format_calls(fmt, m.calls))
        data = text.encode("utf-8")
        stable = i < k
        kind = "system" if i == 0 and m.role == "system" and stable else "history"
        segments.append(
            Segment(kind=kind, byte_start=offset, byte_end=offset + len(data), stable=stable, role=m.role)
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
        PrefixInput(text=prefix_text, manifest=manifest, tools_json=tools_json),
        SuffixInput(text=b"".join(suffix_parts).decode("utf-8"), manifest=manifest),
    )
