"""The on-disk form of a KV snapshot: one self-describing, verified file per snapshot.

Layout (``blueprints/0016-warm-state.md``)::

    "MODELDKV"                      8 bytes, magic
    u16le version                   FORMAT_VERSION
    u32le header length
    header                          UTF-8 JSON: model_digest, identity, snapshot_format,
                                    n_tokens, token_hash, prefix_tokens, payload_bytes,
                                    payload_hash, created
    tokens                          n_tokens x u32le
    payload                         the engine's opaque sequence state

``identity`` is the digest of the runtime fields of the manifest the KV was computed under
(what makes reuse valid, blueprint 0002); ``snapshot_format`` names the engine build and KV
layout the blob fits (a blob is never handed to an engine that reports another one);
``token_hash`` is xxh3-128 of the tokens and ``payload_hash`` xxh3-128 of the payload. A file is
used only if every one of these checks passes (:func:`open_verified`); otherwise the caller
removes it with the logged reason.

Writing is atomic: a hidden temporary file in the same directory, written, fsync'd, renamed
over the final name, then the directory fsync'd. A daemon killed mid-write leaves only a
``.tmp`` file, which the next start removes; a visible file is always whole.
"""

from __future__ import annotations

import contextlib
import json
import mmap
import os
import struct
import time
from array import array
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import BinaryIO

import xxhash

from modeld.manifest import token_hash

__all__ = [
    "FORMAT_VERSION",
    "SUFFIX",
    "SnapshotError",
    "SnapshotFile",
    "SnapshotHeader",
    "read_header",
    "read_header_from",
    "read_verified",
    "open_verified",
    "salvage",
    "write_atomic",
]

MAGIC = b"MODELDKV"
FORMAT_VERSION = 1
SUFFIX = ".kvs"
_FIXED = struct.Struct("<8sHI")
_MAX_HEADER = 1 << 16


class SnapshotError(Exception):
    """A snapshot file that must not be used; ``str(exc)`` is the reason (for the log)."""


@dataclass(frozen=True, slots=True)
class SnapshotHeader:
    model_digest: str
    identity: str
    snapshot_format: str
    n_tokens: int
    token_hash: str
    prefix_tokens: int
    payload_bytes: int
    payload_hash: str
    created: float


@dataclass(frozen=True, slots=True)
class SnapshotFile:
    """A snapshot on disk and the header the daemon indexed: a restore sends both, and the
    engine worker maps the file and checks it against that header itself."""

    path: Path
    header: SnapshotHeader


def payload_hash(blob: bytes | memoryview) -> str:
    return xxhash.xxh3_128(blob).hexdigest()


def _tokens_bytes(tokens: Sequence[int]) -> bytes:
    arr = array("I", tokens)
    if arr.itemsize != 4:  # pragma: no cover - every supported platform has 32-bit unsigned int
        raise SnapshotError("this platform's array('I') is not 32 bits")
    if struct.pack("=I", 1) != struct.pack("<I", 1):  # pragma: no cover - big-endian machine
        arr.byteswap()
    return arr.tobytes()


def _encode_header(
    *,
    model_digest: str,
    identity: str,
    snapshot_format: str,
    tokens: Sequence[int],
    prefix_tokens: int,
    payload: bytes | memoryview,
) -> bytes:
    """The bytes before the payload: magic, version, the JSON header and the tokens."""
    header = json.dumps(
        {
            "model_digest": model_digest,
            "identity": identity,
            "snapshot_format": snapshot_format,
            "n_tokens": len(tokens),
            "token_hash": token_hash(tokens),
            "prefix_tokens": prefix_tokens,
            "payload_bytes": len(payload),
            "payload_hash": payload_hash(payload),
            "created": time.time(),
        },
        separators=(",", ":"),
    ).encode("utf-8")
    return _FIXED.pack(MAGIC, FORMAT_VERSION, len(header)) + header + _tokens_bytes(tokens)


def write_atomic(
    path: Path,
    *,
    model_digest: str,
    identity: str,
    snapshot_format: str,
    tokens: Sequence[int],
    prefix_tokens: int,
    payload: bytes | memoryview,
    tmp_tag: str = "",
) -> int:
    """Write a snapshot file atomically; returns its size in bytes. Raises ``OSError``.

    The temporary file is named after the process (``tmp_tag`` adds to it: writers in several
    processes or on several machines that may share a pid and a directory give a unique tag)."""
    head = _encode_header(
        model_digest=model_digest,
        identity=identity,
        snapshot_format=snapshot_format,
        tokens=tokens,
        prefix_tokens=prefix_tokens,
        payload=payload,
    )
    tmp = path.with_name(f".{path.name}.{os.getpid()}{'.' + tmp_tag if tmp_tag else ''}.tmp")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_CLOEXEC, 0o600)
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(head)
            f.write(payload)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(OSError):
            tmp.unlink()
        raise
    dfd = os.open(path.parent, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(dfd)
    finally:
        os.close(dfd)
    return len(head) + len(payload)


def _read_fixed(f: object, path: Path) -> SnapshotHeader:
    del path
    size = os.fstat(f.fileno()).st_size  # type: ignore[attr-defined]  # the file opened, not the name
    return _parse_fixed(f.read, size)  # type: ignore[attr-defined]


def _parse_fixed(read: Callable[[int], bytes], size: int) -> SnapshotHeader:
    """The header, read through ``read`` from a snapshot of ``size`` bytes in all (checked
    against what the header says)."""
    fixed = read(_FIXED.size)
    if len(fixed) < _FIXED.size:
        raise SnapshotError("truncated: shorter than the fixed header")
    magic, version, header_len = _FIXED.unpack(fixed)
    if magic != MAGIC:
        raise SnapshotError("not a modeld snapshot (bad magic)")
    if version != FORMAT_VERSION:
        raise SnapshotError(f"snapshot format version {version}; this daemon reads {FORMAT_VERSION}")
    if header_len > _MAX_HEADER:
        raise SnapshotError(f"header of {header_len} bytes is over the {_MAX_HEADER}-byte limit")
    raw = read(header_len)
    if len(raw) < header_len:
        raise SnapshotError("truncated inside the header")
    try:
        fields = json.loads(raw.decode("utf-8"))
        header = SnapshotHeader(
            model_digest=str(fields["model_digest"]),
            identity=str(fields["identity"]),
            snapshot_format=str(fields["snapshot_format"]),
            n_tokens=int(fields["n_tokens"]),
            token_hash=str(fields["token_hash"]),
            prefix_tokens=int(fields["prefix_tokens"]),
            payload_bytes=int(fields["payload_bytes"]),
            payload_hash=str(fields["payload_hash"]),
            created=float(fields["created"]),
        )
    except (UnicodeDecodeError, ValueError, KeyError, TypeError) as exc:
        raise SnapshotError(f"unreadable header ({exc.__class__.__name__}: {exc})") from exc
    if header.n_tokens <= 0 or header.payload_bytes <= 0 or not 0 <= header.prefix_tokens <= header.n_tokens:
        raise SnapshotError("the header's counts are inconsistent")
    expected = _FIXED.size + header_len + 4 * header.n_tokens + header.payload_bytes
    if size != expected:
        raise SnapshotError(f"{size} bytes on disk, the header says {expected} (truncated or padded)")
    return header


def _tokens_from(raw: bytes | memoryview, header: SnapshotHeader) -> list[int]:
    if len(raw) < 4 * header.n_tokens:
        raise SnapshotError("truncated inside the tokens")
    arr = array("I")
    arr.frombytes(raw)
    if struct.pack("=I", 1) != struct.pack("<I", 1):  # pragma: no cover - big-endian machine
        arr.byteswap()
    tokens = arr.tolist()
    if token_hash(tokens) != header.token_hash:
        raise SnapshotError("the tokens do not match their hash (corrupt)")
    return tokens


def read_verified(f: BinaryIO) -> tuple[SnapshotHeader, list[int], bytes]:
    """A whole snapshot read from an open file, after every check (magic, version, sizes, the
    token hash, the payload's checksum): its header, tokens and payload. Reading through one
    descriptor reads the file that was opened, whole, whatever is renamed over its name
    meanwhile. Raises ``SnapshotError`` or ``OSError``."""
    header = _parse_fixed(f.read, os.fstat(f.fileno()).st_size)
    tokens = _tokens_from(f.read(4 * header.n_tokens), header)
    payload = f.read(header.payload_bytes)
    if len(payload) != header.payload_bytes:
        raise SnapshotError("truncated inside the payload")
    if payload_hash(payload) != header.payload_hash:
        raise SnapshotError("the payload does not match its checksum (corrupt)")
    return header, tokens, payload


def read_header_from(f: BinaryIO) -> tuple[SnapshotHeader, list[int]]:
    """The header and tokens of an open snapshot file (checks the token hash, not the payload)."""
    header = _parse_fixed(f.read, os.fstat(f.fileno()).st_size)
    return header, _tokens_from(f.read(4 * header.n_tokens), header)


def read_header(path: Path) -> tuple[SnapshotHeader, list[int]]:
    """The header and tokens of a snapshot file (checks the token hash, not the payload)."""
    with path.open("rb") as f:
        return read_header_from(f)


@dataclass(frozen=True, slots=True)
class Salvaged:
    """What a refused snapshot file still says it held, as far as it can be read: ``""`` (and
    ``tokens`` None) for what cannot. ``model_digest`` and ``identity`` may be prefixes (read from
    the file name: ``<digest[:16]>-<identity[:12]>-<format hash[:8]>-<token hash[:20]>``);
    ``format_hash`` is ``bytes_hash(snapshot_format)[:8]``."""

    model_digest: str = ""
    identity: str = ""
    format_hash: str = ""
    tokens: tuple[int, ...] | None = None


def salvage(path: Path) -> Salvaged:
    """What a file that failed :func:`read_header` says it held, for the turn it would have
    served (its ``snapshot_rejected`` reason): the header's fields when its JSON still parses
    (whatever the magic, version or size say), the tokens when they can be read and match their
    hash (else which text it held is unknown), else the fields its name carries. Never raises."""
    from modeld.manifest import bytes_hash

    named = Salvaged()
    parts = path.name[: -len(SUFFIX)].split("-") if path.name.endswith(SUFFIX) else []
    if len(parts) == 4:
        named = Salvaged(model_digest=parts[0], identity=parts[1], format_hash=parts[2])
    try:
        with path.open("rb") as f:
            fixed = f.read(_FIXED.size)
            if len(fixed) < _FIXED.size:
                return named
            _, _, header_len = _FIXED.unpack(fixed)
            if header_len > _MAX_HEADER:
                return named
            fields = json.loads(f.read(header_len).decode("utf-8"))
            digest, identity = str(fields["model_digest"]), str(fields["identity"])
            fmt, n = str(fields["snapshot_format"]), int(fields["n_tokens"])
            want = str(fields.get("token_hash", ""))
            raw = f.read(4 * n) if 0 < n <= _MAX_SALVAGED_TOKENS else b""
    except (OSError, ValueError, KeyError, TypeError, UnicodeDecodeError, struct.error):
        return named
    tokens: tuple[int, ...] | None = None
    if raw and len(raw) == 4 * n:
        arr = array("I")
        arr.frombytes(raw)
        if struct.pack("=I", 1) != struct.pack("<I", 1):  # pragma: no cover - big-endian machine
            arr.byteswap()
        if token_hash(arr.tolist()) == want:  # corrupt tokens say nothing about the text
            tokens = tuple(arr)
    return Salvaged(model_digest=digest, identity=identity, format_hash=bytes_hash(fmt)[:8], tokens=tokens)


_MAX_SALVAGED_TOKENS = 1 << 20
"""Tokens :func:`salvage` reads from a refused file at most (4 MiB)."""


@contextlib.contextmanager
def open_verified(path: Path, expected: SnapshotHeader) -> Iterator[memoryview]:
    """The payload of a snapshot file, mapped (never read into a copy), after checking it is
    still the file that was indexed (same header) and that the payload matches its hash.

    The view is private and writable (copy on write: a restore may rewrite a few bytes of its
    header in place; the file never changes) and valid inside the ``with`` block only. Mapping
    instead of reading: 100 MB read into fresh memory costs ~50 ms of page faults and copying,
    mapped and hashed ~4 ms, and the engine copies from the mapping into its own cache anyway.
    Raises ``SnapshotError`` (or ``OSError``)."""
    with path.open("rb") as f:
        header = _read_fixed(f, path)
        if header != expected:
            raise SnapshotError("the file changed since it was indexed")
        start = f.tell() + 4 * header.n_tokens
        try:
            mapped = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_COPY)
        except ValueError as exc:  # emptied since the size check
            raise SnapshotError(f"truncated ({exc})") from exc
    try:
        view = memoryview(mapped)[start : start + header.payload_bytes]
        try:
            if len(view) != header.payload_bytes:
                raise SnapshotError("truncated inside the payload")
            if payload_hash(view) != header.payload_hash:
                raise SnapshotError("the payload does not match its checksum (corrupt)")
            yield view
        finally:
            view.release()
    finally:
        with contextlib.suppress(BufferError):  # a consumer still holds a view: freed with it
            mapped.close()
