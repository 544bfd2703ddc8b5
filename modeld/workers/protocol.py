"""The daemon <-> engine-worker protocol: coarse messages, one unit of work each.

Every request carries an operation id chosen by the daemon; every reply names the operation it
answers. Most requests get exactly one reply; ``Sync`` and ``Generate`` are jobs that stream
``Progress`` / ``Tokens`` events and end with ``Finished``; ``Cancel`` gets no reply of its own
(the job it names ends with ``Finished(canceled=True)``). A ``Generate`` with a cell limit sends
``Room`` when it reaches it and waits for a ``Grant`` (no reply of its own either). A failed request ends with
``Failed`` (a contract error by its stable reason token), never with silence.

Wire format (a stream socket): each frame is ``u32le header_len || u32le payload_len || header ||
payload``. The header is UTF-8 JSON: ``{"op": id, "kind": name, ...fields}``; the payload is
raw bytes (a KV snapshot, the vocabulary's pieces), so megabyte blobs are never escaped or
pickled. Nothing is unpickled: a corrupted or hostile frame can only fail to parse
(:class:`ProtocolError`). The same message objects pass unencoded between threads when the
runtime runs in-process (the memory backend in tests), so both paths share every other line.

Design record: ``blueprints/0017-workers.md``.
"""

from __future__ import annotations

import dataclasses
import json
import struct
import types
import typing
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, ClassVar, TypeVar

from modeld.backends.base import DecodeStats, Layout, LoadOptions, SyncStep, Vocab
from modeld.cache.snapfile import SnapshotHeader
from modeld.contract import DecodeConfig, ModelInfo, OpenSessionRequest, TokenLogprob

__all__ = [
    "MAX_FRAME",
    "REFUSED",
    "Cancel",
    "Close",
    "Copy",
    "Drop",
    "Failed",
    "Finished",
    "Generate",
    "Grant",
    "Load",
    "Loaded",
    "Message",
    "Progress",
    "ProtocolError",
    "Restore",
    "Result",
    "Room",
    "Save",
    "Share",
    "Snapshot",
    "Sync",
    "Tokenize",
    "Tokens",
    "decode_frame",
    "encode_frame",
    "from_jsonable",
    "to_jsonable",
]

MAX_FRAME = 1 << 34
"""The largest frame either side accepts (16 GiB: a KV snapshot of a long context)."""

_HEAD = struct.Struct("<II")


class ProtocolError(Exception):
    """A frame that is not a valid message (the peer is broken: the link is torn down)."""


@dataclass(frozen=True)
class Message:
    """Base of every message. ``payload`` (when a class has one) travels as raw bytes."""

    kind: ClassVar[str] = ""


# --- requests (daemon -> worker) -------------------------------------------------------------


@dataclass(frozen=True)
class Load(Message):
    kind: ClassVar[str] = "load"
    backend: str
    request: OpenSessionRequest
    info: ModelInfo
    options: LoadOptions


@dataclass(frozen=True)
class Tokenize(Message):
    kind: ClassVar[str] = "tokenize"
    text: str
    add_bos: bool


@dataclass(frozen=True)
class Sync(Message):
    """Job: make ``seq`` hold its first ``keep`` tokens then ``tokens``; ``segments``: where the
    manifest's segments start in that target (None: not known)."""

    kind: ClassVar[str] = "sync"
    seq: int
    keep: int
    tokens: tuple[int, ...]
    segments: tuple[int, ...] | None = None


@dataclass(frozen=True)
class Generate(Message):
    """Job: sample up to ``max_tokens`` tokens after what ``seq`` holds.

    A constraint travels compiled: ``config.constraint`` is ``Constraint("grammar", gbnf)``
    (the daemon turned a schema, regex or forced tool call into GBNF once); the worker parses
    it once per digest (``modeld.decoding.constraints``, an LRU in the worker). A job whose
    constraint can no longer be met ends early and cleanly: ``Finished`` before ``max_tokens``
    with no end-of-generation token, which the daemon reports as ``constraint_failed``.
    """

    kind: ClassVar[str] = "generate"
    seq: int
    config: DecodeConfig
    max_tokens: int
    interval: float = 0.0
    """Seconds: tokens that come faster than this are sent together in one ``Tokens`` (each
    held only until the next, so at most this long; the first and the last are sent at once,
    and nothing is held while another job waits its turn). 0: every token on its own."""
    forks: tuple[int, ...] = ()
    """Further sequences holding a copy of ``seq``'s tokens: choice ``i`` is decoded on
    ``forks[i - 1]`` with the seed ``choice_seed(config.seed, i)``, all choices in one batch per
    step (``ModelRuntime.generate``); ``Tokens.choices`` says whose each token is."""
    cells: int = 0
    """KV cells the job may fill beyond what ``seq`` holds before it pauses and asks for more
    (``Room``, answered by ``Grant``): a decode takes cells as it grows (blueprint 0016). 0: no
    limit (the daemon made room for ``max_tokens``)."""

    def __post_init__(self) -> None:
        if not 0.0 <= self.interval <= 10.0:  # also refuses NaN
            raise ProtocolError(f"Generate.interval {self.interval!r} is not 0-10 seconds")
        bias = self.config.logit_bias
        if any(not isinstance(k, int) for k in bias):  # a JSON object's keys are strings
            try:
                fixed = {int(k): float(v) for k, v in bias.items()}
            except (TypeError, ValueError) as exc:
                raise ProtocolError(f"Generate.config.logit_bias: {exc}") from exc
            object.__setattr__(self, "config", dataclasses.replace(self.config, logit_bias=fixed))


@dataclass(frozen=True)
class Copy(Message):
    kind: ClassVar[str] = "copy"
    src: int
    dst: int
    n: int


@dataclass(frozen=True)
class Drop(Message):
    kind: ClassVar[str] = "drop"
    seq: int


@dataclass(frozen=True)
class Share(Message):
    """``dst``'s first ``n`` tokens are held in ``src``'s cells from now on (``ModelRuntime.share``);
    answered by ``Result(ok)``."""

    kind: ClassVar[str] = "share"
    src: int
    dst: int
    n: int


@dataclass(frozen=True)
class Snapshot(Message):
    kind: ClassVar[str] = "snapshot"
    seq: int


@dataclass(frozen=True)
class Save(Message):
    """Write ``seq``'s snapshot into a new file at ``path`` (the daemon's temporary name in
    its disk tier; it seals and indexes the file): the blob never crosses the socket."""

    kind: ClassVar[str] = "save"
    seq: int
    path: str


@dataclass(frozen=True)
class Restore(Message):
    """Load a snapshot into ``seq``: from ``payload`` (the RAM tier's blob), or, when ``path``
    is set, from that snapshot file, which the worker maps and verifies against ``header``
    itself (the daemon never reads the payload; a refused file is named in ``Result.detail``)."""

    kind: ClassVar[str] = "restore"
    seq: int
    tokens: tuple[int, ...]
    path: str = ""
    header: SnapshotHeader | None = None
    payload: bytes = b""

    def __post_init__(self) -> None:
        if self.path and (self.header is None or self.payload):
            raise ProtocolError("Restore from a file takes its header and no payload")


REFUSED = "the engine refused to restore it"
"""``Result.detail`` of a restore whose blob passed every check but the engine would not load."""


@dataclass(frozen=True)
class Cancel(Message):
    """Stop the job ``target`` at its next step (no reply of its own)."""

    kind: ClassVar[str] = "cancel"
    target: int
    choice: int = -1
    """A generate job's choice to stop (its other choices go on); -1: the whole job."""


@dataclass(frozen=True)
class Grant(Message):
    """The generate job ``target``, paused at its cell limit (``Room``), may fill ``cells`` more
    (no reply of its own); 0: no room, the job ends there (``Finished``); negative: no limit any
    more (the daemon made room for all it may still generate)."""

    kind: ClassVar[str] = "grant"
    target: int
    cells: int


@dataclass(frozen=True)
class Close(Message):
    """Free the model and exit (the worker answers ``Result`` first)."""

    kind: ClassVar[str] = "close"


# --- replies (worker -> daemon) --------------------------------------------------------------


@dataclass(frozen=True)
class Loaded(Message):
    """The answer to ``Load``: the runtime's layout and its vocabulary (``payload`` holds every
    token's bytes, concatenated; ``lengths`` splits it)."""

    kind: ClassVar[str] = "loaded"
    layout: Layout
    lengths: tuple[int, ...]
    eog: tuple[int, ...]
    bos: int
    pid: int
    payload: bytes = b""
    base_rss: int = 0
    """The worker's resident memory just before the model loaded (its runtime's own part)."""

    @staticmethod
    def of(layout: Layout, vocab: Vocab, pid: int, base_rss: int = 0) -> Loaded:
        return Loaded(
            layout=layout,
            lengths=vocab.lengths,
            eog=tuple(sorted(vocab.eog)),
            bos=vocab.bos,
            pid=pid,
            payload=b"".join(vocab.pieces),
            base_rss=base_rss,
        )

    def vocab(self) -> Vocab:
        pieces: list[bytes] = []
        at = 0
        for n in self.lengths:
            pieces.append(self.payload[at : at + n])
            at += n
        return Vocab(pieces=tuple(pieces), eog=frozenset(self.eog), bos=self.bos, lengths=self.lengths)


@dataclass(frozen=True)
class Result(Message):
    """The answer to an atomic request: ``tokens`` (tokenize), ``ok`` (restore, save; when
    False, ``detail`` says why, and for a save ``errno`` is the file system's error number),
    ``payload`` (snapshot), ``size`` (save: bytes written); ``checkpoint_bytes`` (after a
    request that changes what the sequences hold: copy, drop, share, restore) what each
    sequence's checkpoints hold now, by sequence (``ModelRuntime.checkpoint_bytes``; None: not
    said)."""

    kind: ClassVar[str] = "result"
    tokens: tuple[int, ...] = ()
    ok: bool = True
    detail: str = ""
    payload: bytes = b""
    size: int = 0
    errno: int = 0
    checkpoint_bytes: tuple[int, ...] | None = None


@dataclass(frozen=True)
class Progress(Message):
    """A sync job's step; ``seconds``: the engine's time for the batch it evaluated
    (``SyncStep.seconds``)."""

    kind: ClassVar[str] = "progress"
    kept: int
    evaluated: int
    total: int
    seconds: float = 0.0

    def step(self) -> SyncStep:
        return SyncStep(self.kept, self.evaluated, self.total, self.seconds)


@dataclass(frozen=True)
class Tokens(Message):
    """Tokens a generate job sampled (in order; each choice's in its own order); ``logprobs``
    one per token when the decode asked for them (``DecodeConfig.logprobs``), else empty."""

    kind: ClassVar[str] = "tokens"
    tokens: tuple[int, ...]
    logprobs: tuple[TokenLogprob, ...] = ()
    choices: tuple[int, ...] = ()
    """One per token: the choice it belongs to (a job with ``Generate.forks``); empty: all 0."""


@dataclass(frozen=True)
class Room(Message):
    """A generate job reached the cells it may fill (``Generate.cells``): its sequence holds
    ``resident`` tokens once the tokens it sent are evaluated, and it waits for a ``Grant``
    (tokens it sampled are sent first)."""

    kind: ClassVar[str] = "room"
    resident: int


@dataclass(frozen=True)
class Finished(Message):
    """A job ended. ``resident`` is how many tokens its sequence holds now (the truth after a
    cancel or an early stop); ``kept`` is what a sync kept before evaluating; ``stats`` what
    speculation did in a generate job (``blueprints/0021-speculation.md``);
    ``checkpoint_bytes`` what each sequence's checkpoints hold now, by sequence (None: not said)."""

    kind: ClassVar[str] = "finished"
    resident: int
    kept: int = 0
    canceled: bool = False
    stats: DecodeStats | None = None
    checkpoint_bytes: tuple[int, ...] | None = None


@dataclass(frozen=True)
class Failed(Message):
    """A request failed with a contract error (``reason`` is its stable token)."""

    kind: ClassVar[str] = "failed"
    reason: str
    message: str
    details: Mapping[str, str] = field(default_factory=dict)


_KINDS: dict[str, type[Message]] = {
    cls.kind: cls
    for cls in (
        Load,
        Tokenize,
        Sync,
        Generate,
        Copy,
        Drop,
        Share,
        Snapshot,
        Save,
        Restore,
        Cancel,
        Grant,
        Close,
        Loaded,
        Result,
        Progress,
        Tokens,
        Room,
        Finished,
        Failed,
    )
}


# --- JSON form of dataclasses ----------------------------------------------------------------


def to_jsonable(value: Any) -> Any:
    """Dataclasses, tuples and mappings as JSON values (bytes are not allowed here)."""
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return {f.name: to_jsonable(getattr(value, f.name)) for f in dataclasses.fields(value)}
    if isinstance(value, (list, tuple)):
        if all(type(v) is int for v in value):  # token lists: thousands of items, the hot path
            return list(value)
        return [to_jsonable(v) for v in value]
    if isinstance(value, Mapping):
        return {str(k): to_jsonable(v) for k, v in value.items()}
    if isinstance(value, (bytes, bytearray)):
        raise ProtocolError("bytes travel as the frame's payload, not in its header")
    return value


_T = TypeVar("_T")


def from_jsonable(cls: type[_T], data: Any) -> _T:
    """Rebuild a dataclass (recursively) from :func:`to_jsonable`'s output, checking types."""
    return typing.cast(_T, _build(cls, data, cls.__name__))


_FIELDS: dict[type, tuple[tuple[str, Any], ...]] = {}


def _fields(tp: type) -> tuple[tuple[str, Any], ...]:
    """A dataclass's fields with their resolved types (resolving costs ~40 us: once per class)."""
    known = _FIELDS.get(tp)
    if known is None:
        hints = typing.get_type_hints(tp)
        known = _FIELDS[tp] = tuple((f.name, hints[f.name]) for f in dataclasses.fields(tp))
    return known


def _build(tp: Any, data: Any, where: str) -> Any:
    origin = typing.get_origin(tp)
    if tp is Any:
        return data
    if origin in (typing.Union, types.UnionType):
        args = typing.get_args(tp)
        if data is None and type(None) in args:
            return None
        for arg in args:
            if arg is type(None):
                continue
            try:
                return _build(arg, data, where)
            except ProtocolError:
                continue
        raise ProtocolError(f"{where}: {data!r} matches none of {tp}")
    if origin is tuple:
        args = typing.get_args(tp)
        if not isinstance(data, list):
            raise ProtocolError(f"{where}: expected a list")
        item = args[0] if args else Any
        if item is int and all(type(v) is int for v in data):  # token lists: the hot path
            return tuple(data)
        return tuple(_build(item, v, f"{where}[]") for v in data)
    if origin in (dict, Mapping, typing.Mapping) or tp in (dict, Mapping):
        if not isinstance(data, dict):
            raise ProtocolError(f"{where}: expected an object")
        args = typing.get_args(tp)
        value_type = args[1] if len(args) == 2 else Any
        return {str(k): _build(value_type, v, f"{where}.{k}") for k, v in data.items()}
    if dataclasses.is_dataclass(tp):
        if not isinstance(data, dict):
            raise ProtocolError(f"{where}: expected an object")
        kwargs = {}
        for name, hint in _fields(typing.cast(type, tp)):
            if name in data:
                kwargs[name] = _build(hint, data[name], f"{where}.{name}")
        try:
            return typing.cast(Any, tp)(**kwargs)
        except TypeError as exc:
            raise ProtocolError(f"{where}: {exc}") from exc
    if tp is float:
        if isinstance(data, bool) or not isinstance(data, (int, float)):
            raise ProtocolError(f"{where}: expected a number")
        return float(data)
    if tp is int:
        if isinstance(data, bool) or not isinstance(data, int):
            raise ProtocolError(f"{where}: expected an integer")
        return data
    if tp in (str, bool):
        if not isinstance(data, tp):
            raise ProtocolError(f"{where}: expected {tp.__name__}")
        return data
    raise ProtocolError(f"{where}: cannot rebuild {tp!r}")


# --- frames ------------------------------------------------------------------------------------


def encode_frame(op: int, message: Message) -> list[bytes | memoryview]:
    """The frame for ``message`` as buffers to send in order (the payload is not copied)."""
    fields: dict[str, Any] = {"op": op, "kind": message.kind}
    payload: bytes = b""
    for f in dataclasses.fields(message):
        value = getattr(message, f.name)
        if f.name == "payload":
            payload = value
        else:
            fields[f.name] = to_jsonable(value)
    header = json.dumps(fields, separators=(",", ":")).encode("utf-8")
    return [_HEAD.pack(len(header), len(payload)), header, memoryview(payload)]


def frame_sizes(head: bytes) -> tuple[int, int]:
    """The header and payload lengths announced by a frame's first 8 bytes."""
    header_len, payload_len = _HEAD.unpack(head)
    if header_len > (64 << 20) or header_len + payload_len > MAX_FRAME:
        raise ProtocolError(f"a frame of {header_len} + {payload_len} bytes is over the limit")
    return header_len, payload_len


HEAD_SIZE = _HEAD.size


def decode_frame(header: bytes, payload: bytes) -> tuple[int, Message]:
    """The operation id and message of a frame's header and payload."""
    try:
        fields = json.loads(header.decode("utf-8"))
    except (UnicodeDecodeError, ValueError) as exc:
        raise ProtocolError(f"a frame header is not JSON: {exc}") from exc
    if not isinstance(fields, dict):
        raise ProtocolError("a frame header is not an object")
    op = fields.pop("op", None)
    kind = fields.pop("kind", None)
    cls = _KINDS.get(kind) if isinstance(kind, str) else None
    if not isinstance(op, int) or cls is None:
        raise ProtocolError(f"a frame names no known message (kind {kind!r})")
    if any(f.name == "payload" for f in dataclasses.fields(cls)):
        fields["payload"] = payload
        hints = dict(_fields(cls))
        kwargs = {
            name: value if name == "payload" else _build(hints[name], value, f"{cls.__name__}.{name}")
            for name, value in fields.items()
            if name in hints
        }
        try:
            return op, cls(**kwargs)
        except TypeError as exc:
            raise ProtocolError(f"{cls.__name__}: {exc}") from exc
    return op, _build(cls, fields, cls.__name__)
