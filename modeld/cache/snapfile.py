"""The on-disk form of a KV snapshot: one self-describing, verified file per snapshot.

Layout (``blueprints/0016-warm-state.md``)::

    payload                         the engine's sequence state, exactly the blob its runtime
                                    restores (llama.cpp: a sequence-state file of its own,
                                    which llama.cpp writes and reads itself, streaming)
    tokens                          n_tokens x u32le
    header                          UTF-8 JSON: model_digest, identity, snapshot_format,
                                    n_tokens, token_hash, prefix_tokens, payload_bytes,
                                    payload_hash, created
    u32le header length
    u16le version                   FORMAT_VERSION
    "MODELDKV"                      8 bytes, magic: the file's last bytes

The payload comes first so that the engine worker can write it straight into the file (the
engine streams its KV cells out a tensor row at a time: a prefix written behind for crash
safety never exists as one blob in any process), and the daemon appends the rest; the header
is found from the tail. ``identity``
is the digest of the runtime fields of the manifest the KV was computed under (what makes reuse
valid, blueprint 0002); ``snapshot_format`` names the engine build and KV layout the blob fits
(a blob is never handed to an engine that reports another one); ``token_hash`` is xxh3-128 of
the tokens and ``payload_hash`` xxh3-128 of the payload. A file is used only if every one of
these checks passes (:func:`verify_payload`, :func:`open_verified`); otherwise the caller
removes it with the logged reason.

Writing is atomic: a hidden temporary file in the same directory (:func:`temporary`), the
payload written (by the daemon, :func:`write_atomic`, or by the engine worker), then
:func:`seal`: the tokens, header and tail appended, fsync'd, renamed over the final name, the directory fsync'd.
A daemon killed mid-write leaves only a ``.tmp`` file, which the next start removes; a visible
file is always whole.
"""

from __future__ import annotations

import contextlib
import dataclasses
import itertools
import json
import mmap
import os
import struct
import time
from array import array
from collections.abc import Iterator, Sequence
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
    "open_verified",
    "read_header",
    "read_header_from",
    "read_verified",
    "salvage",
    "seal",
    "temporary",
    "verify_payload",
    "write_atomic",
]

MAGIC = b"MODELDKV"
FORMAT_VERSION = 2
SUFFIX = ".kvs"
_TAIL = struct.Struct("<IH8s")
_V1 = struct.Struct("<8sHI")
_MAX_HEADER = 1 << 16
_CHUNK = 4 << 20
"""Bytes read at a time to hash a payload: the page cache is read, the process's RSS does not grow."""
_temporaries = itertools.count()


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
    engine worker checks the file against that header itself."""

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


def temporary(path: Path, tag: str = "") -> Path:
    """A hidden temporary name beside ``path`` (``.<name>.<pid>.<n>[.<tag>].tmp``): what a write
    goes to until :func:`seal` renames it; a daemon start removes every such file. ``tag`` adds
    to it: writers in several processes or on several machines that may share a pid and a
    directory give a unique tag."""
    extra = f".{tag}" if tag else ""
    return path.with_name(f".{path.name}.{os.getpid()}.{next(_temporaries)}{extra}.tmp")


def _hash_file(f: object, size: int) -> str:
    """xxh3-128 of the first ``size`` bytes of an open file, read a chunk at a time."""
    h = xxhash.xxh3_128()
    buf = bytearray(min(_CHUNK, max(size, 1)))
    view = memoryview(buf)
    left = size
    readinto = f.readinto  # type: ignore[attr-defined]
    while left:
        n = readinto(view[: min(left, len(buf))])
        if not n:
            raise SnapshotError("truncated inside the payload")
        h.update(view[:n])
        left -= n
    return h.hexdigest()


def seal(
    tmp: Path,
    path: Path,
    *,
    model_digest: str,
    identity: str,
    snapshot_format: str,
    tokens: Sequence[int],
    prefix_tokens: int,
) -> SnapshotHeader:
    """Finish a temporary file that holds a payload: hash it, append the header, the tokens and
    the tail, fsync, rename it to ``path`` and fsync the directory. Returns the header written.
    Raises ``OSError`` (the temporary file is removed)."""
    try:
        with tmp.open("r+b") as f:
            size = os.fstat(f.fileno()).st_size
            if size <= 0:
                raise SnapshotError("the engine wrote an empty snapshot")
            digest = _hash_file(f, size)
            header = SnapshotHeader(
                model_digest=model_digest,
                identity=identity,
                snapshot_format=snapshot_format,
                n_tokens=len(tokens),
                token_hash=token_hash(tokens),
                prefix_tokens=prefix_tokens,
                payload_bytes=size,
                payload_hash=digest,
                created=time.time(),
            )
            raw = json.dumps(dataclasses.asdict(header), separators=(",", ":")).encode("utf-8")
            f.seek(size)
            f.write(_tokens_bytes(tokens))
            f.write(raw)
            f.write(_TAIL.pack(len(raw), FORMAT_VERSION, MAGIC))
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
    return header


def write_atomic(
    path: Path,
    *,
    model_digest: str,
    identity: str,
    snapshot_format: str,
    tokens: Sequence[int],
    prefix_tokens: int,
    payload: bytes | bytearray | memoryview,
    tmp_tag: str = "",
) -> SnapshotHeader:
    """Write a snapshot file whose payload is in memory (a RAM-tier blob moving to disk, a
    shared store's copy) atomically; returns its header. Raises ``OSError``. ``tmp_tag``: see
    :func:`temporary`."""
    tmp = temporary(path, tmp_tag)
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o600)
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(payload)
    except BaseException:
        with contextlib.suppress(OSError):
            tmp.unlink()
        raise
    return seal(
        tmp,
        path,
        model_digest=model_digest,
        identity=identity,
        snapshot_format=snapshot_format,
        tokens=tokens,
        prefix_tokens=prefix_tokens,
    )


def _parse(raw: bytes) -> SnapshotHeader:
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
    except (UnicodeDecodeError, ValueError, KeyError, TypeError, AttributeError) as exc:
        raise SnapshotError(f"unreadable header ({exc.__class__.__name__}: {exc})") from exc
    if header.n_tokens <= 0 or header.payload_bytes <= 0 or not 0 <= header.prefix_tokens <= header.n_tokens:
        raise SnapshotError("the header's counts are inconsistent")
    return header


def _read_trailer(f: BinaryIO) -> SnapshotHeader:
    """The header of an open snapshot file, after checking its tail and its size (of the file
    opened, whatever is renamed over its name meanwhile)."""
    seek, read = f.seek, f.read
    size = os.fstat(f.fileno()).st_size
    tail = b""
    if size >= _TAIL.size:
        seek(size - _TAIL.size)
        tail = read(_TAIL.size)
    if len(tail) < _TAIL.size or tail[-8:] != MAGIC:
        seek(0)
        first = read(_V1.size)
        if len(first) == _V1.size and first[:8] == MAGIC:  # the first format: magic first
            raise SnapshotError(
                f"snapshot format version {_V1.unpack(first)[1]}; this daemon reads {FORMAT_VERSION}"
            )
        raise SnapshotError("not a modeld snapshot (bad magic at its end), or truncated")
    header_len, version, _ = _TAIL.unpack(tail)
    if version != FORMAT_VERSION:
        raise SnapshotError(f"snapshot format version {version}; this daemon reads {FORMAT_VERSION}")
    if header_len > _MAX_HEADER or header_len + _TAIL.size > size:
        raise SnapshotError(f"a header of {header_len} bytes does not fit in a file of {size}")
    seek(size - _TAIL.size - header_len)
    header = _parse(read(header_len))
    expected = header.payload_bytes + 4 * header.n_tokens + header_len + _TAIL.size
    if size != expected:
        raise SnapshotError(f"{size} bytes on disk, the header says {expected} (truncated or padded)")
    return header


def _tokens_from(raw: bytes, header: SnapshotHeader) -> list[int]:
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


def read_header_from(f: BinaryIO) -> tuple[SnapshotHeader, list[int]]:
    """The header and tokens of an open snapshot file (checks the token hash, not the payload)."""
    header = _read_trailer(f)
    f.seek(header.payload_bytes)
    return header, _tokens_from(f.read(4 * header.n_tokens), header)


def read_header(path: Path) -> tuple[SnapshotHeader, list[int]]:
    """The header and tokens of a snapshot file (checks the token hash, not the payload)."""
    with path.open("rb") as f:
        return read_header_from(f)


def read_verified(f: BinaryIO) -> tuple[SnapshotHeader, list[int], bytes]:
    """A whole snapshot read from an open file, after every check (magic, version, sizes, the
    token hash, the payload's checksum): its header, tokens and payload. Reading through one
    descriptor reads the file that was opened, whole, whatever is renamed over its name
    meanwhile. Raises ``SnapshotError`` or ``OSError``."""
    header, tokens = read_header_from(f)
    f.seek(0)
    payload = f.read(header.payload_bytes)
    if len(payload) != header.payload_bytes:
        raise SnapshotError("truncated inside the payload")
    if payload_hash(payload) != header.payload_hash:
        raise SnapshotError("the payload does not match its checksum (corrupt)")
    return header, tokens, payload


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


def _salvage_fields(f: BinaryIO, size: int) -> tuple[dict[str, object], bytes]:
    """The JSON header of a file of either format as far as it parses, and its raw tokens
    (b"" when they cannot be located). Raises what reading or parsing raises."""
    first = f.read(_V1.size)
    if len(first) == _V1.size and first[:8] == MAGIC:  # format 1: magic, version, length first
        _, _, header_len = _V1.unpack(first)
        if header_len > _MAX_HEADER:
            return {}, b""
        fields = json.loads(f.read(header_len).decode("utf-8"))
        n = int(fields["n_tokens"])
        return fields, f.read(4 * n) if 0 < n <= _MAX_SALVAGED_TOKENS else b""
    if size < _TAIL.size:
        return {}, b""
    f.seek(size - _TAIL.size)
    header_len, _, _ = _TAIL.unpack(f.read(_TAIL.size))
    if header_len > _MAX_HEADER or header_len + _TAIL.size > size:
        return {}, b""
    f.seek(size - _TAIL.size - header_len)
    fields = json.loads(f.read(header_len).decode("utf-8"))
    n = int(fields["n_tokens"])
    start = size - _TAIL.size - header_len - 4 * n
    if not 0 < n <= _MAX_SALVAGED_TOKENS or start < 0:
        return fields, b""
    f.seek(start)
    return fields, f.read(4 * n)


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
            fields, raw = _salvage_fields(f, os.fstat(f.fileno()).st_size)
        if not fields:
            return named
        digest, identity = str(fields["model_digest"]), str(fields["identity"])
        fmt, n = str(fields["snapshot_format"]), int(str(fields["n_tokens"]))
        want = str(fields.get("token_hash", ""))
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


def verify_payload(path: Path, expected: SnapshotHeader) -> None:
    """Check that a snapshot file is still the one that was indexed (same header) and that its
    payload matches its hash, reading it a chunk at a time (through the page cache: the
    caller's memory does not grow with the snapshot). Raises ``SnapshotError`` (or ``OSError``)."""
    with path.open("rb") as f:
        if _read_trailer(f) != expected:
            raise SnapshotError("the file changed since it was indexed")
        f.seek(0)
        if _hash_file(f, expected.payload_bytes) != expected.payload_hash:
            raise SnapshotError("the payload does not match its checksum (corrupt)")


@contextlib.contextmanager
def open_verified(path: Path, expected: SnapshotHeader) -> Iterator[memoryview]:
    """The payload of a snapshot file, mapped (never read into a copy), after checking it is
    still the file that was indexed (same header) and that the payload matches its hash.

    The view is private and writable (copy on write: a restore may rewrite a few bytes of its
    header in place; the file never changes) and valid inside the ``with`` block only. Every
    page of the payload is resident while the view is held; an engine that can read the file
    itself streams it instead (:func:`verify_payload`, blueprint 0016). Raises
    ``SnapshotError`` (or ``OSError``)."""
    with path.open("rb") as f:
        if _read_trailer(f) != expected:
            raise SnapshotError("the file changed since it was indexed")
        try:
            mapped = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_COPY)
        except ValueError as exc:  # emptied since the size check
            raise SnapshotError(f"truncated ({exc})") from exc
    try:
        view = memoryview(mapped)[: expected.payload_bytes]
        try:
            if len(view) != expected.payload_bytes:
                raise SnapshotError("truncated inside the payload")
            if payload_hash(view) != expected.payload_hash:
                raise SnapshotError("the payload does not match its checksum (corrupt)")
            yield view
        finally:
            view.release()
    finally:
        with contextlib.suppress(BufferError):  # a consumer still holds a view: freed with it
            mapped.close()
