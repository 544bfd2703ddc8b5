"""Prepare a turn's input: text + manifest -> tokens, token ranges and hashes (no engine state).

This is the pure part of ``ensure_prefix`` and ``prefill_suffix``: validation of sizes,
completion and checks of the manifest against the session's identity (blueprint 0002), chat
rendering with the model's template (blueprint 0010), tokenization (the only call that reaches
the engine, through the ``tokenize`` argument), the window check, and the token range of every
segment. It changes nothing resident, so bad input can never disturb a warm context.
"""

from __future__ import annotations

import bisect
import itertools
import json
import threading
from array import array
from collections import OrderedDict
from collections.abc import Callable, Hashable, Sequence
from dataclasses import dataclass, replace
from typing import Any, Generic, TypeVar

from modeld.backends.base import Vocab
from modeld.cache.reuse import common_prefix_len
from modeld.contract import Config, ModelInfo, PrefixInput, SuffixInput
from modeld.engine.chat import ChatRenderer, Message, locate, messages_for, parse_template_args, parse_tools
from modeld.engine.validate import encode_text, validate_manifest_size
from modeld.errors import ContextOverflowError, InvalidArgumentError, ManifestMismatchError
from modeld.manifest import (
    DEFAULT_CACHE_CLASS,
    RUNTIME_FIELDS,
    ContextManifest,
    Segment,
    bytes_hash,
    check_text,
    config_runtime_digest,
    token_hash,
)
from modeld.settings import Limits

__all__ = [
    "BoundedMemo",
    "ChatState",
    "PrefixMemo",
    "PreparedPrefix",
    "PreparedSuffix",
    "Preparer",
    "byte_ends",
    "identity_of",
    "part_at",
    "prepare_prefix",
    "prepare_suffix",
    "same_text",
    "segment_at",
    "template_note",
]

Tokenize = Callable[[str, bool], list[int]]
V = TypeVar("V")


def identity_of(info: ModelInfo, config: Config) -> ContextManifest:
    """The runtime fields every manifest of a session must carry (its reuse identity)."""
    if config.prompt_template_digest:
        template = config.prompt_template_digest
    else:
        template = info.template_digest if config.prompt_format == "chat" else ""
    return ContextManifest(
        backend=info.backend,
        backend_version=info.backend_version,
        model_digest=info.model_digest,
        tokenizer_digest=info.tokenizer_digest,
        prompt_format=config.prompt_format,
        prompt_template_digest=template,
        runtime_digest=config_runtime_digest(config),
        add_bos=info.add_bos and not config.disable_bos,
    )


def byte_ends(vocab: Vocab, tokens: Sequence[int], *, added_bos: bool) -> list[int]:
    """Cumulative byte end offset of each token in the text it was tokenized from.

    A BOS token that tokenize added (``added_bos``) is not in the text: it takes no bytes.
    Control tokens parsed *from* the text (``<|im_start|>`` in a rendered template) do.
    """
    ends = list(itertools.accumulate(vocab.byte_lengths(tokens)))
    if added_bos and ends:
        first = ends[0]
        ends = [e - first for e in ends]
    return ends


@dataclass(frozen=True)
class ChatState:
    """What a chat-format prefix was rendered from (the suffix continues the conversation):
    its messages, tools and template arguments, the prefix's bytes (to locate its segments in
    the whole rendering), whether tokenizing added a BOS, the rendered prefix and the byte end
    of each of its tokens (to tokenize only what follows its last control token)."""

    messages: list[Message]
    tools: list[Any] | None
    args: dict[str, Any]
    data: bytes
    added_bos: bool
    text: str = ""
    ends: tuple[int, ...] = ()


@dataclass(frozen=True)
class PreparedPrefix:
    tokens: list[int]
    manifest: ContextManifest
    chat: ChatState | None
    ends: list[int]
    tools: tuple[int, int] | None = None  # the tool definitions' token range, when located


@dataclass(frozen=True)
class PreparedSuffix:
    """``tokens`` follow the first ``keep`` tokens of the resident prefix (all of it, unless the
    chat template renders the prefix otherwise once the suffix follows it: then the prefix is
    cut back to ``keep``)."""

    tokens: list[int]
    manifest: ContextManifest
    keep: int


def _complete(manifest: ContextManifest, identity: ContextManifest) -> ContextManifest:
    """Fill unstated runtime fields from the session; refuse ones that contradict it."""
    filled: dict[str, object] = {}
    for name in RUNTIME_FIELDS:
        ours = getattr(identity, name)
        theirs = getattr(manifest, name)
        if theirs is None or theirs == "":
            filled[name] = ours
        elif theirs != ours:
            raise ManifestMismatchError(
                f"the manifest's {name} is {theirs!r} but this session's is {ours!r}; "
                f"build the manifest for this session's model and config",
                field=name,
                expected=str(ours),
                got=str(theirs),
            )
    return replace(manifest, **filled)  # type: ignore[arg-type]


def _fill_segments(segments: Sequence[Segment], data: bytes, base: int, stable: bool) -> list[Segment]:
    out: list[Segment] = []
    for seg in segments:
        if seg.stable != stable:
            out.append(seg)
            continue
        out.append(
            replace(
                seg,
                hash=seg.hash or bytes_hash(data[seg.byte_start - base : seg.byte_end - base]),
                cache_class=seg.cache_class or DEFAULT_CACHE_CLASS.get(seg.kind, "turn"),
            )
        )
    return out


def _identity_spans(segments: Sequence[Segment], base: int, *, stable: bool) -> dict[int, tuple[int, int]]:
    """Raw format: the evaluated text is the input text, so spans are the byte ranges."""
    return {i: (s.byte_start - base, s.byte_end - base) for i, s in enumerate(segments) if s.stable == stable}


def _with_token_ranges(
    manifest: ContextManifest, ends: Sequence[int], spans: dict[int, tuple[int, int]], token_base: int
) -> ContextManifest:
    """Fill token ranges for segments whose bytes are located in the evaluated text.

    ``spans`` maps a segment index to its byte range in the text that was tokenized, ``ends``
    gives each token's end byte in it. A token belongs to the segment its last byte falls in;
    zero-length tokens (BOS) to none.
    """
    out = list(manifest.segments)
    for index, (start, end) in spans.items():
        out[index] = replace(
            out[index],
            token_start=token_base + bisect.bisect_right(ends, start),
            token_end=token_base + bisect.bisect_right(ends, end),
        )
    return replace(manifest, segments=tuple(out))


def prepare_prefix(
    prefix: PrefixInput,
    *,
    identity: ContextManifest,
    config: Config,
    info: ModelInfo,
    limits: Limits,
    window: int,
    vocab: Vocab,
    renderer: Callable[[], ChatRenderer],
    tokenize: Tokenize,
    memo: PrefixMemo | None = None,
) -> PreparedPrefix:
    """Validate, render and tokenize a prefix (raises before anything resident changes); a chat
    prefix ``memo`` holds is not rendered and tokenized again."""
    if not isinstance(prefix, PrefixInput):
        raise InvalidArgumentError("expected a PrefixInput", field="prefix")
    tools = encode_text(prefix.tools_json, "tools_json", limits)
    args_bytes = encode_text(prefix.template_args_json, "template_args_json", limits, extra_bytes=len(tools))
    data = encode_text(prefix.text, "text", limits, extra_bytes=len(tools) + len(args_bytes))
    for name, given in (("tools_json", tools), ("template_args_json", args_bytes)):
        if given and config.prompt_format == "raw":
            raise InvalidArgumentError(
                f"{name} needs prompt_format 'chat' (the model's template renders it); "
                "with prompt_format 'raw' render the prompt yourself",
                field=name,
            )
    validate_manifest_size(prefix.manifest, limits)
    manifest = _complete(
        prefix.manifest or ContextManifest(stable_bytes=len(data), total_bytes=len(data)), identity
    )
    check_text(manifest, data, start=0, stable=True)
    manifest = replace(
        manifest,
        stable_byte_hash=manifest.stable_byte_hash or bytes_hash(data),
        total_bytes=max(manifest.total_bytes, len(data)),
        segments=tuple(_fill_segments(manifest.segments, data, 0, stable=True)),
    )
    chat: ChatState | None = None
    bos = info.bos_token
    known: tuple[str, list[int], list[int]] | None = None
    key: Hashable = None
    if config.prompt_format == "chat":
        tool_list = parse_tools(prefix.tools_json)
        args = parse_template_args(prefix.template_args_json)
        messages = messages_for(manifest.segments, data, 0, stable=True, default_role="system")
        following = _following(manifest)
        if memo is not None:
            key = _memo_key(identity, bos, data, manifest, following, prefix)
            known = memo.get(key)
        text = (
            known[0] if known is not None else renderer().render_prefix(messages, following, tool_list, args)
        )
        spans = locate(text, manifest.segments, messages, data, 0)
        added_bos = bool(identity.add_bos) and not (bos and text.startswith(bos))
        chat = ChatState(messages, tool_list, args, data, added_bos, text)
    else:
        text, spans = prefix.text, _identity_spans(manifest.segments, 0, stable=True)
        added_bos = bool(identity.add_bos)
    tokens = known[1] if known is not None else tokenize(text, added_bos)
    if len(tokens) > window:
        raise ContextOverflowError(stage="prefix", resident=0, additional=len(tokens), window=window)
    ends = known[2] if known is not None else byte_ends(vocab, tokens, added_bos=added_bos)
    if memo is not None and key is not None and known is None:
        memo.put(key, text, tokens, ends)
    if chat is not None:
        chat = replace(chat, ends=tuple(ends))
    if spans:
        manifest = _with_token_ranges(manifest, ends, spans, 0)
    manifest = replace(manifest, stable_token_hash=token_hash(tokens))
    tools_span = _tools_tokens(text, chat.tools if chat is not None else None, ends)
    return PreparedPrefix(tokens=tokens, manifest=manifest, chat=chat, ends=ends, tools=tools_span)


def _memo_key(
    identity: ContextManifest,
    bos: str,
    data: bytes,
    manifest: ContextManifest,
    following: str | None,
    prefix: PrefixInput,
) -> Hashable:
    """What rendering and tokenizing a chat prefix reads (:class:`PrefixMemo`): the template,
    whether a BOS is added (and its text), the messages (their bytes, and their bounds and roles:
    the stable segments), the role that follows, the tools and the template's arguments."""
    stable = tuple(seg for seg in manifest.segments if seg.stable)
    return (
        identity.prompt_template_digest,
        identity.add_bos,
        bos,
        data,
        stable,
        following,
        prefix.tools_json,
        prefix.template_args_json,
    )


def _following(manifest: ContextManifest) -> str | None:
    """The role of the message after the prefix (its first volatile segment's); None when the
    manifest says the suffix is empty (only the generation prompt follows); ``user`` when it
    does not say."""
    for seg in manifest.segments:
        if not seg.stable:
            return seg.chat_role
    if manifest.segments and manifest.total_bytes == manifest.stable_bytes:
        return None
    return "user"


def _tools_tokens(text: str, tools: list[Any] | None, ends: Sequence[int]) -> tuple[int, int] | None:
    """The token range of the tool definitions in a rendered prefix: from the first tool's JSON
    to the last's, as the template wrote them (``tojson``); None when they are not found so."""
    if not tools:
        return None
    data = text.encode("utf-8")
    first = json.dumps(tools[0], ensure_ascii=False).encode()
    last = json.dumps(tools[-1], ensure_ascii=False).encode()
    start = data.find(first)
    if start < 0:
        return None
    end_at = data.find(last, start)
    if end_at < 0:
        return None
    end = end_at + len(last)
    return bisect.bisect_right(ends, start), bisect.bisect_left(ends, end) + 1


def suffix_manifest(
    given: ContextManifest | None, data: bytes, current: ContextManifest, identity: ContextManifest
) -> ContextManifest:
    """The manifest of prefix + suffix: the resident prefix's, with the suffix's segments."""
    if given is None:
        return replace(
            current,
            total_bytes=current.stable_bytes + len(data),
            volatile_token_hash="",
            segments=current.stable_segments,
        )
    manifest = _complete(given, identity)
    if manifest.stable_bytes != current.stable_bytes or (
        manifest.stable_byte_hash and manifest.stable_byte_hash != current.stable_byte_hash
    ):
        raise ManifestMismatchError(
            "this suffix's manifest was built for a different prefix than the resident one "
            "(stable_byte_hash differs); call ensure_prefix with its prefix first",
            field="stable_byte_hash",
            expected=current.stable_byte_hash,
            got=manifest.stable_byte_hash,
        )

    def bare(segments: Sequence[Segment]) -> list[Segment]:
        return [replace(s, hash="", cache_class="", token_start=None, token_end=None) for s in segments]

    if bare(current.stable_segments) != bare(manifest.stable_segments):
        raise ManifestMismatchError(
            "this suffix's manifest describes different stable segments than the resident prefix",
            field="segments",
        )
    check_text(manifest, data, start=current.stable_bytes, stable=False)
    volatile = _fill_segments(manifest.volatile_segments, data, current.stable_bytes, stable=False)
    return replace(
        current,
        profile_id=manifest.profile_id or current.profile_id,
        total_bytes=current.stable_bytes + len(data),
        segments=current.stable_segments + tuple(volatile),
    )


def prepare_suffix(
    suffix: SuffixInput,
    *,
    current: ContextManifest,
    chat: ChatState | None,
    prefix_tokens: Sequence[int],
    identity: ContextManifest,
    limits: Limits,
    window: int,
    vocab: Vocab,
    renderer: Callable[[], ChatRenderer],
    tokenize: Tokenize,
    specials: frozenset[int] = frozenset(),
) -> PreparedSuffix:
    """Validate, render and tokenize a suffix for the resident prefix ``current``.

    Chat format: the whole conversation is rendered and tokenized whole; the suffix is what
    follows its longest common token prefix with ``prefix_tokens`` (``keep``)."""
    if not isinstance(suffix, SuffixInput):
        raise InvalidArgumentError("expected a SuffixInput", field="suffix")
    data = encode_text(suffix.text, "text", limits)
    validate_manifest_size(suffix.manifest, limits)
    manifest = suffix_manifest(suffix.manifest, data, current, identity)
    base = manifest.stable_bytes
    n_prefix = len(prefix_tokens)
    if chat is None:
        tokens = tokenize(suffix.text, False)
        if n_prefix + len(tokens) > window:
            raise ContextOverflowError(
                stage="suffix", resident=n_prefix, additional=len(tokens), window=window
            )
        spans = _identity_spans(manifest.segments, base, stable=False)
        if spans:
            manifest = _with_token_ranges(
                manifest, byte_ends(vocab, tokens, added_bos=False), spans, n_prefix
            )
        return PreparedSuffix(tokens, replace(manifest, volatile_token_hash=token_hash(tokens)), n_prefix)
    messages = messages_for(manifest.segments, data, base, stable=False, default_role="user")
    conversation = [*chat.messages, *messages]
    whole = renderer().render(conversation, chat.tools, add_generation_prompt=True, args=chat.args)
    everything, same = _tokenize_whole(whole, chat, prefix_tokens, specials, tokenize)
    keep = common_prefix_len(
        everything, prefix_tokens if isinstance(prefix_tokens, list) else list(prefix_tokens)
    )
    tokens = everything[keep:]
    if len(everything) > window:
        raise ContextOverflowError(stage="suffix", resident=keep, additional=len(tokens), window=window)
    spans = locate(whole, manifest.segments, conversation, chat.data + data, 0)
    if spans:
        if same:  # the prefix's first ``same`` tokens begin the whole: so do their byte ends
            base_end = chat.ends[same - 1]
            rest = itertools.accumulate(vocab.byte_lengths(everything[same:]), initial=base_end)
            ends = [*chat.ends[:same], *itertools.islice(rest, 1, None)]
        else:
            ends = byte_ends(vocab, everything, added_bos=chat.added_bos)
        manifest = _with_token_ranges(manifest, ends, spans, 0)
    if keep < n_prefix:
        manifest = replace(manifest, stable_token_hash=token_hash(everything[:keep]))
    return PreparedSuffix(tokens, replace(manifest, volatile_token_hash=token_hash(tokens)), keep)


def _tokenize_whole(
    whole: str, chat: ChatState, prefix_tokens: Sequence[int], specials: frozenset[int], tokenize: Tokenize
) -> tuple[list[int], int]:
    """The tokens of the whole rendering, as tokenizing it whole gives them, and how many of the
    prefix's first tokens they start with by construction (0: tokenized whole). The engines
    split text at control tokens before anything else and tokenize what lies between alone, so
    when the whole rendering starts with the rendered prefix, the prefix's tokens through its
    last control token parsed from the text are the whole's too, and only the rest is tokenized
    (once per turn, the long part of a prompt is then tokenized once, not twice)."""
    if specials and chat.ends and len(chat.ends) == len(prefix_tokens) and whole.startswith(chat.text):
        first = 1 if chat.added_bos else 0  # a BOS tokenizing added is not in the text
        for j in range(len(prefix_tokens) - 1, first - 1, -1):
            if prefix_tokens[j] in specials:
                cut = chat.ends[j]
                rest = whole.encode("utf-8")[cut:].decode("utf-8")
                return [*prefix_tokens[: j + 1], *tokenize(rest, False)], j + 1
    return tokenize(whole, chat.added_bos), 0


def template_note(
    previous: ContextManifest | None, current: ContextManifest, token: int, generated: bytes, data: bytes
) -> str:
    """Why a chat prefix diverged at ``token``, when every message before the one holding it
    (the first whose token range ends past it) is unchanged: that message is the same as last
    turn's, so the template renders it otherwise once later messages follow; or it is last
    turn's reply, whose text (``data``: the prefix's bytes) is in what the model ``generated``,
    so the template renders the reply otherwise than the model wrote it; or it is a reply the
    client changed. "" when a message before it changed (the client's doing, named by the
    segment already)."""
    if previous is None:
        return ""
    index = next(
        (i for i, s in enumerate(current.segments) if s.token_end is not None and s.token_end > token), None
    )
    if index is None:
        return ""
    before = previous.segments
    for i in range(min(index, len(before))):
        if before[i].hash != current.segments[i].hash:
            return ""
    role = current.segments[index].chat_role
    if index < len(before) and before[index].hash == current.segments[index].hash:
        return (
            f"message {index} ({role}) is the same as last turn's: the chat template renders it otherwise "
            "once later messages follow it (the template did it, not the client)"
        )
    if index >= len(before):
        seg = current.segments[index]
        text = _message_text(data[seg.byte_start : seg.byte_end]) if seg.stable else b""
        if text and text.strip() in generated:
            return (
                f"message {index} ({role}) is last turn's reply sent back: the chat template renders it "
                "otherwise than the model wrote it (e.g. without its reasoning; the template did it, not the client)"
            )
        return f"message {index} ({role}) is not the reply the model generated last turn (the client sent another)"
    return ""


def _message_text(raw: bytes) -> bytes:
    """A segment's text: a ``message`` segment's content (its JSON), else the bytes."""
    try:
        value = json.loads(raw)
    except ValueError:
        return raw
    content = value.get("content") if isinstance(value, dict) else None
    return content.encode("utf-8") if isinstance(content, str) else b""


class PrefixMemo:
    """Chat prefixes rendered and tokenized recently on one model: their text, tokens and byte
    ends, keyed by everything those read.

    Rendering a conversation with the model's template, tokenizing it and adding up its tokens'
    lengths is a pure function of the template, the messages (the prefix's bytes), the role that
    follows them, the tools and the template's arguments. Every agent run in one repository
    opens a new session with the same system prompt and tools, a sub-agent with its parent's, a
    repeated or retried request with all of it: the memo answers them without that work (about
    4.5 ms of a 16k-token Claude Code prefix's 6 ms preparation, of a warm repeat's 40-60 ms).
    The manifest's ranges, hashes and checks are made for each request as before. Bounded by
    ``MAX_TOKENS`` over its entries (least recently used dropped first); a prefix shorter than
    ``MIN_TOKENS`` is cheaper to prepare again. A hit hands out copies, never what it keeps."""

    MAX_TOKENS = 1 << 17
    MIN_TOKENS = 512

    def __init__(self) -> None:
        self._memo: BoundedMemo[tuple[str, array[int], tuple[int, ...]]] = BoundedMemo(
            lambda: self.MAX_TOKENS, lambda entry: len(entry[1])
        )

    def get(self, key: Hashable) -> tuple[str, list[int], list[int]] | None:
        found = self._memo.get(key)
        if found is None:
            return None
        text, tokens, ends = found
        return text, tokens.tolist(), list(ends)

    def put(self, key: Hashable, text: str, tokens: Sequence[int], ends: Sequence[int]) -> None:
        if len(tokens) >= self.MIN_TOKENS:
            self._memo.put(key, (text, array("I", tokens), tuple(ends)))

    def clear(self) -> None:
        self._memo.clear()


class BoundedMemo(Generic[V]):
    """Values by key, least recently used dropped first while their ``size`` adds up to more
    than ``limit()`` (read at each put: its owner's bound; a value larger than it is not kept);
    safe from any thread. The model's memos of tokenized texts and of prepared prefixes."""

    def __init__(self, limit: Callable[[], int], size: Callable[[V], int]) -> None:
        self._limit = limit
        self._size = size
        self._lock = threading.Lock()
        self._entries: OrderedDict[Hashable, V] = OrderedDict()
        self._total = 0

    def get(self, key: Hashable) -> V | None:
        with self._lock:
            value = self._entries.get(key)
            if value is not None:
                self._entries.move_to_end(key)
            return value

    def put(self, key: Hashable, value: V) -> None:
        size, limit = self._size(value), self._limit()
        if size > limit:
            return
        with self._lock:
            old = self._entries.pop(key, None)
            self._total -= self._size(old) if old is not None else 0
            self._entries[key] = value
            self._total += size
            while self._total > limit:
                _, dropped = self._entries.popitem(last=False)
                self._total -= self._size(dropped)

    def clear(self) -> None:
        with self._lock:
            self._entries.clear()
            self._total = 0


@dataclass(frozen=True)
class Preparer:
    """One session's fixed inputs to :func:`prepare_prefix` and :func:`prepare_suffix`."""

    identity: ContextManifest
    config: Config
    info: ModelInfo
    limits: Limits
    window: int
    vocab: Vocab
    renderer: Callable[[], ChatRenderer]
    tokenize: Tokenize
    memo: PrefixMemo | None = None  # the model's: prefixes prepared recently by any session

    def prefix(self, prefix: PrefixInput) -> PreparedPrefix:
        return prepare_prefix(
            prefix,
            identity=self.identity,
            config=self.config,
            info=self.info,
            limits=self.limits,
            window=self.window,
            vocab=self.vocab,
            renderer=self.renderer,
            tokenize=self.tokenize,
            memo=self.memo,
        )

    def suffix(
        self,
        suffix: SuffixInput,
        *,
        current: ContextManifest,
        chat: ChatState | None,
        prefix_tokens: Sequence[int],
    ) -> PreparedSuffix:
        return prepare_suffix(
            suffix,
            current=current,
            chat=chat,
            prefix_tokens=prefix_tokens,
            identity=self.identity,
            limits=self.limits,
            window=self.window,
            vocab=self.vocab,
            renderer=self.renderer,
            tokenize=self.tokenize,
            specials=frozenset(t.id for t in self.info.special_tokens),
        )


def segment_at(manifest: ContextManifest, token: int) -> int | None:
    """The index of the manifest's segment holding ``token`` (None: past every segment's end)."""
    return next(
        (i for i, s in enumerate(manifest.segments) if s.token_end is not None and s.token_end > token),
        None,
    )


def part_at(token: int, segments: tuple[Segment, ...], tools: tuple[int, int] | None) -> str:
    """Which part of a chat prompt holds ``token``: ``tools`` (where the template put the tool
    definitions), ``system`` (the first message when it is a system message, or the template's
    head before any message), else ``messages``."""
    if tools is not None and tools[0] <= token < tools[1]:
        return "tools"
    starts = [s.token_start for s in segments if s.token_start is not None]
    if not starts or token < min(starts):
        return "system"
    first = segments[0]
    if first.label == "system" and first.token_end is not None and token < first.token_end:
        return "system"
    return "messages"


SAME_TEXT_TOKENS = 64
"""How far past a divergence :func:`same_text` compares the two token lists' bytes."""


def same_text(piece: Callable[[int], bytes], had: list[int], now: list[int], k: int) -> bool:
    """Whether the session's earlier tokens and the new ones, which first differ at ``k``, spell
    the same bytes there (one a prefix of the other): a re-tokenization, not an edit. Generated
    text comes back in the history as text, and random-weight models often sample a split the
    tokenizer does not make; the turn then recomputes from ``k`` on."""
    if k >= len(had) or k >= len(now) or had[:k] != now[:k]:
        return False
    a = b"".join(piece(t) for t in had[k : k + SAME_TEXT_TOKENS])
    b = b"".join(piece(t) for t in now[k : k + SAME_TEXT_TOKENS])
    n = min(len(a), len(b))
    return n > 0 and a[:n] == b[:n]
