"""The ContextManifest: what a context was computed under, and whether KV may be reused.

A manifest names everything that decides the contents of a KV cache besides the tokens
themselves (model, backend, tokenizer, prompt template, BOS policy, runtime config) and
describes the context's text (stable prefix, volatile suffix, typed segments, hashes).

Two questions are answered here and nowhere else:

* :meth:`ContextManifest.digest` -- a canonical identity, the same bytes in every process, on
  every platform and Python version (pinned by golden vectors in the tests). The encoding is
  documented byte for byte in ``blueprints/0002-context-manifest.md``.
* :meth:`ContextManifest.compatible_runtime` -- whether KV computed under one manifest may be
  reused under another, and if not, the first field (in a fixed order) that differs.
  Compatibility never looks at the text: equal text under a different runtime is a cold miss,
  and different text under the same runtime still reuses the longest common token prefix.

What this module does not do: tokenize, talk to a backend, or decide reuse lengths (that is the
engine's job). It imports only the standard library and ``xxhash``.
"""

from __future__ import annotations

import struct
from collections.abc import Sequence
from dataclasses import dataclass, field, replace
from typing import Literal, NewType, get_args

import xxhash

from modeld.errors import InvalidArgumentError, ManifestMismatchError

__all__ = [
    "CACHE_CLASSES",
    "DEFAULT_CACHE_CLASS",
    "DEFAULT_ROLE",
    "MANIFEST_MAGIC",
    "ROLES",
    "RUNTIME_FIELDS",
    "SEGMENT_KINDS",
    "STABLE_KINDS",
    "CacheClass",
    "Compatibility",
    "ContextManifest",
    "Digest",
    "Segment",
    "SegmentKind",
    "bytes_hash",
    "canonical_encoding",
    "check_text",
    "KV_CONFIG_FIELDS",
    "config_runtime_digest",
    "runtime_digest",
    "token_hash",
]

Digest = NewType("Digest", str)
"""A 32-character lowercase hex xxh3-128 digest."""

SegmentKind = Literal[
    "system",
    "tools",
    "repo_rules",
    "repo_map",
    "pinned",
    "history",
    "diff",
    "terminal",
    "user_turn",
    "runtime",
    "message",
]
SEGMENT_KINDS: tuple[str, ...] = get_args(SegmentKind)
STABLE_KINDS: frozenset[str] = frozenset({"system", "tools", "repo_rules", "repo_map", "pinned", "history"})
"""Kinds that belong in the stable prefix by default; the others are volatile (the suffix)."""

CacheClass = Literal["static", "workspace", "conversation", "turn"]
CACHE_CLASSES: tuple[str, ...] = get_args(CacheClass)
DEFAULT_CACHE_CLASS: dict[str, str] = {
    "system": "static",
    "tools": "static",
    "repo_rules": "static",
    "repo_map": "workspace",
    "pinned": "workspace",
    "history": "conversation",
    "diff": "turn",
    "terminal": "turn",
    "user_turn": "turn",
    "runtime": "turn",
    "message": "conversation",
}
"""How long a segment of each kind is expected to stay unchanged (informational)."""

ROLES: tuple[str, ...] = ("system", "user", "assistant", "tool")
DEFAULT_ROLE: dict[str, str] = {
    "system": "system",
    "tools": "system",
    "repo_rules": "system",
    "repo_map": "system",
    "pinned": "system",
    "history": "user",
    "diff": "user",
    "terminal": "user",
    "user_turn": "user",
    "runtime": "user",
    "message": "user",
}
"""The chat role of a segment whose ``role`` is empty (prompt_format ``chat``)."""

RUNTIME_FIELDS: tuple[str, ...] = (
    "backend",
    "backend_version",
    "model_digest",
    "tokenizer_digest",
    "prompt_format",
    "prompt_template_digest",
    "runtime_digest",
    "add_bos",
)
"""The fields that must be equal for resident KV to be reusable, in the order they are checked."""

MANIFEST_MAGIC = b"modeld.manifest\x00"
_RUNTIME_MAGIC = b"modeld.runtime\x00\x00"
_ENCODING_VERSION = 1

_T_NULL = 0x00
_T_STR = 0x01
_T_INT = 0x02
_T_BOOL = 0x03
_T_LIST = 0x04
_T_FLOAT = 0x05


def bytes_hash(data: bytes | str) -> Digest:
    """xxh3-128 of the UTF-8 bytes, as 32 lowercase hex characters."""
    if isinstance(data, str):
        data = data.encode("utf-8")
    return Digest(xxhash.xxh3_128_hexdigest(data))


def token_hash(tokens: Sequence[int]) -> Digest:
    """xxh3-128 of the token ids, each encoded as an unsigned 32-bit little-endian integer."""
    return Digest(xxhash.xxh3_128_hexdigest(struct.pack(f"<{len(tokens)}I", *tokens)))


@dataclass(frozen=True, slots=True)
class Segment:
    """A typed span of the context. Byte ranges index the UTF-8 of prefix + suffix.

    ``token_start``/``token_end`` are filled in by the daemon once the text is tokenized (a
    token that straddles a segment boundary belongs to the segment it ends in).
    """

    kind: str
    byte_start: int
    byte_end: int
    hash: str = ""
    stable: bool = True
    cache_class: str = ""
    role: str = ""
    token_start: int | None = None
    token_end: int | None = None

    @property
    def chat_role(self) -> str:
        """The role this segment speaks with in a chat-format prompt."""
        return self.role or DEFAULT_ROLE[self.kind]

    @property
    def label(self) -> str:
        """What people read it as: its kind, or a whole message's role (``system``, ``user``, ...)."""
        return self.chat_role if self.kind == "message" else self.kind

    @property
    def byte_len(self) -> int:
        return self.byte_end - self.byte_start


@dataclass(frozen=True, slots=True)
class Compatibility:
    """The answer of :meth:`ContextManifest.compatible_runtime`: ok, or the first differing field."""

    ok: bool
    field: str = ""
    ours: str = ""
    theirs: str = ""

    def __bool__(self) -> bool:
        return self.ok


@dataclass(frozen=True, slots=True)
class ContextManifest:
    """What a context was computed under, and what its text is made of.

    Empty identity fields (and ``add_bos=None``) mean "not stated by the client"; the daemon
    fills them in from the session before anything is reused. Token hashes and segment token
    ranges are always filled in by the daemon.
    """

    profile_id: str = ""
    backend: str = ""
    backend_version: str = ""
    model_digest: str = ""
    tokenizer_digest: str = ""
    prompt_format: str = ""
    prompt_template_digest: str = ""
    runtime_digest: str = ""
    add_bos: bool | None = None
    stable_bytes: int = 0
    total_bytes: int = 0
    stable_byte_hash: str = ""
    stable_token_hash: str = ""
    volatile_token_hash: str = ""
    segments: tuple[Segment, ...] = field(default_factory=tuple)

    def digest(self) -> Digest:
        """xxh3-128 (hex) of :func:`canonical_encoding`: identical everywhere, pinned by tests."""
        return Digest(xxhash.xxh3_128_hexdigest(canonical_encoding(self)))

    def compatible_runtime(self, other: ContextManifest) -> Compatibility:
        """May KV computed under ``self`` be reused under ``other``? If not, which field differs.

        Only :data:`RUNTIME_FIELDS` are compared, in that order. Text, hashes, segments and
        ``profile_id`` never make two manifests incompatible: reuse of equal tokens under an
        equal runtime is always sound, and text equality alone never makes a warm hit.
        """
        for name in RUNTIME_FIELDS:
            ours, theirs = getattr(self, name), getattr(other, name)
            if ours != theirs:
                return Compatibility(False, name, _show(ours), _show(theirs))
        return Compatibility(True)

    def runtime_identity(self) -> dict[str, str | bool | None]:
        return {name: getattr(self, name) for name in RUNTIME_FIELDS}

    @property
    def stable_segments(self) -> tuple[Segment, ...]:
        return tuple(s for s in self.segments if s.stable)

    @property
    def volatile_segments(self) -> tuple[Segment, ...]:
        return tuple(s for s in self.segments if not s.stable)

    def with_segments(self, segments: Sequence[Segment]) -> ContextManifest:
        return replace(self, segments=tuple(segments))


def _show(value: object) -> str:
    if value is None:
        return "unset"
    if isinstance(value, bool):
        return "true" if value else "false"
    return str(value)


# --- canonical encoding -------------------------------------------------------------------


def _enc_name(out: bytearray, name: str) -> None:
    raw = name.encode("ascii")
    out.append(len(raw))
    out += raw


def _enc_value(out: bytearray, value: object) -> None:
    if value is None:
        out.append(_T_NULL)
    elif isinstance(value, bool):  # before int: bool is an int subclass
        out.append(_T_BOOL)
        out.append(1 if value else 0)
    elif isinstance(value, int):
        out.append(_T_INT)
        out += struct.pack("<q", value)
    elif isinstance(value, float):
        out.append(_T_FLOAT)
        out += struct.pack("<d", value)
    elif isinstance(value, str):
        raw = value.encode("utf-8")
        out.append(_T_STR)
        out += struct.pack("<I", len(raw))
        out += raw
    else:  # pragma: no cover - guarded by the callers' static types
        raise TypeError(f"cannot encode {type(value).__name__}")


_MANIFEST_SCALARS: tuple[str, ...] = (
    "profile_id",
    *RUNTIME_FIELDS,  # the digest's layout: a change here changes every digest (the tests pin it)
    "stable_bytes",
    "total_bytes",
    "stable_byte_hash",
    "stable_token_hash",
    "volatile_token_hash",
)
_SEGMENT_FIELDS: tuple[str, ...] = (
    "kind",
    "byte_start",
    "byte_end",
    "hash",
    "stable",
    "cache_class",
    "role",
    "token_start",
    "token_end",
)


def canonical_encoding(manifest: ContextManifest) -> bytes:
    """The manifest as canonical bytes (see ``blueprints/0002-context-manifest.md``).

    ``MAGIC(16) || u16le(version) || field*`` where each field is ``u8 name_len || name`` then a
    tagged value: ``00`` null, ``01 u32le len utf8`` string, ``02 i64le`` integer,
    ``03 00|01`` boolean, ``05 f64le`` float, ``04 u32le count element*`` list. Fields appear in
    the fixed order of ``_MANIFEST_SCALARS`` then ``segments``; each segment is its own field
    sequence (``_SEGMENT_FIELDS``) inside the list. The order is spelled out rather than taken
    from the dataclass so that reordering the class can never change a digest.
    """
    try:
        out = bytearray(MANIFEST_MAGIC)
        out += struct.pack("<H", _ENCODING_VERSION)
        for name in _MANIFEST_SCALARS:
            _enc_name(out, name)
            _enc_value(out, getattr(manifest, name))
        _enc_name(out, "segments")
        out.append(_T_LIST)
        out += struct.pack("<I", len(manifest.segments))
        for seg in manifest.segments:
            for name in _SEGMENT_FIELDS:
                _enc_name(out, name)
                _enc_value(out, getattr(seg, name))
        return bytes(out)
    except (struct.error, UnicodeEncodeError) as exc:
        raise InvalidArgumentError(f"manifest cannot be encoded: {exc}", field="manifest") from exc


KV_CONFIG_FIELDS: tuple[str, ...] = (
    "num_ctx",
    "num_batch",
    "num_gpu_layers",
    "tensor_split",
    "flash_attn",
    "kv_cache_type",
)
"""The session ``Config`` fields that decide what the KV cache holds or how it is computed: the
one list every "must this be a different context?" check uses (the runtime digest, and so the
loaded model's key). ``num_threads`` is not one: it changes speed, never values, so a session
with another thread count shares the warm contexts (blueprint 0002)."""


def config_runtime_digest(config: object) -> Digest:
    """The manifest's ``runtime_digest`` for a session ``Config`` (its :data:`KV_CONFIG_FIELDS`)."""
    values = {name: getattr(config, name) for name in KV_CONFIG_FIELDS}
    return runtime_digest(**values)


def runtime_digest(
    *,
    num_ctx: int,
    num_batch: int,
    num_gpu_layers: int,
    tensor_split: Sequence[float],
    flash_attn: bool,
    kv_cache_type: str,
) -> Digest:
    """Digest of the runtime settings that change what the KV cache holds or how it is computed.

    ``num_threads`` is deliberately absent: it changes speed, not values. Prompt format,
    template and BOS policy are manifest fields of their own.
    """
    out = bytearray(_RUNTIME_MAGIC)
    out += struct.pack("<H", _ENCODING_VERSION)
    fields: tuple[tuple[str, object], ...] = (
        ("num_ctx", num_ctx),
        ("num_batch", num_batch),
        ("num_gpu_layers", num_gpu_layers),
        ("flash_attn", flash_attn),
        ("kv_cache_type", kv_cache_type),
    )
    for name, value in fields:
        _enc_name(out, name)
        _enc_value(out, value)
    _enc_name(out, "tensor_split")
    out.append(_T_LIST)
    out += struct.pack("<I", len(tensor_split))
    for share in tensor_split:
        _enc_value(out, float(share))
    return Digest(xxhash.xxh3_128_hexdigest(bytes(out)))


# --- consistency of a manifest with the text it describes ----------------------------------


def check_text(manifest: ContextManifest, data: bytes, *, start: int, stable: bool) -> None:
    """Check that ``manifest`` describes ``data``, the bytes at ``[start, start+len)``.

    For the prefix (``stable=True``, ``start=0``): ``stable_bytes`` and ``stable_byte_hash`` (when
    stated) must match, and every stable segment must lie inside it with a matching hash. For
    the suffix (``stable=False``, ``start=stable_bytes``): ``total_bytes`` must match and every
    volatile segment must lie inside it. Segments must be ordered, non-overlapping, of a known
    kind and cache class. Raises :class:`ManifestMismatchError` naming the offending field.
    """
    end = start + len(data)
    if stable:
        if manifest.stable_bytes != len(data):
            raise ManifestMismatchError(
                f"manifest says the stable prefix has {manifest.stable_bytes} bytes, "
                f"the text has {len(data)}",
                field="stable_bytes",
                expected=str(len(data)),
                got=str(manifest.stable_bytes),
            )
        if manifest.stable_byte_hash and manifest.stable_byte_hash != bytes_hash(data):
            raise ManifestMismatchError(
                "manifest stable_byte_hash does not match the prefix text",
                field="stable_byte_hash",
                expected=bytes_hash(data),
                got=manifest.stable_byte_hash,
            )
    elif manifest.total_bytes and manifest.total_bytes != end:
        raise ManifestMismatchError(
            f"manifest says the context has {manifest.total_bytes} bytes, prefix + suffix have {end}",
            field="total_bytes",
            expected=str(end),
            got=str(manifest.total_bytes),
        )
    last_end = 0
    for i, seg in enumerate(manifest.segments):
        where = f"segments[{i}]"
        if seg.kind not in SEGMENT_KINDS:
            raise ManifestMismatchError(
                f"{where}.kind {seg.kind!r} is not one of {', '.join(SEGMENT_KINDS)}",
                field=f"{where}.kind",
                got=seg.kind,
            )
        if seg.role and seg.role not in ROLES:
            raise ManifestMismatchError(
                f"{where}.role {seg.role!r} is not one of {', '.join(ROLES)}",
                field=f"{where}.role",
                got=seg.role,
            )
        if seg.cache_class and seg.cache_class not in CACHE_CLASSES:
            raise ManifestMismatchError(
                f"{where}.cache_class {seg.cache_class!r} is not one of {', '.join(CACHE_CLASSES)}",
                field=f"{where}.cache_class",
                got=seg.cache_class,
            )
        if seg.byte_start < last_end or seg.byte_end < seg.byte_start:
            raise ManifestMismatchError(
                f"{where} [{seg.byte_start}, {seg.byte_end}) overlaps or is out of order",
                field=f"{where}.byte_start",
            )
        last_end = seg.byte_end
        if seg.stable and seg.byte_end > manifest.stable_bytes:
            raise ManifestMismatchError(
                f"{where} is stable but ends at byte {seg.byte_end}, after the stable prefix "
                f"({manifest.stable_bytes} bytes): stable segments come first",
                field=f"{where}.stable",
            )
        if not seg.stable and seg.byte_start < manifest.stable_bytes:
            raise ManifestMismatchError(
                f"{where} is volatile but starts inside the stable prefix",
                field=f"{where}.stable",
            )
        if seg.stable != stable:
            continue
        if seg.byte_end > end:
            raise ManifestMismatchError(
                f"{where} ends at byte {seg.byte_end}, after the text ({end} bytes)",
                field=f"{where}.byte_end",
            )
        if seg.hash:
            actual = bytes_hash(data[seg.byte_start - start : seg.byte_end - start])
            if seg.hash != actual:
                raise ManifestMismatchError(
                    f"{where} ({seg.kind}) hash does not match its text",
                    field=f"{where}.hash",
                    expected=actual,
                    got=seg.hash,
                )
