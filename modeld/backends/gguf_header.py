"""The header of a GGUF file (metadata and tensor table), parsed at a bounded cost.

What: :class:`Header` reads the header from an open :class:`~modeld.backends.probe.ModelFile`
incrementally (1 MiB at a time), checks every count against :data:`LIMITS` *before* it walks or
keeps anything, keeps only the string arrays it is asked to keep, and answers typed questions
about values (:meth:`Header.py`, :meth:`Header.integer`, :meth:`Header.integers`,
:meth:`Header.leaf_bytes`). Format: https://github.com/ggml-org/ggml/blob/master/docs/gguf.md
(versions 2 and 3, either byte order).

Why not ``gguf.GGUFReader``: it materialises every value as NumPy views before anything can be
checked; a 12 MB file of 1.5 M empty metadata strings took 44 s and 2.4 GB to open. Here that
file is refused from its array's count after reading 1 MiB.

What not: no tensor data is read, and no model semantics live here (the checks llama.cpp needs
are in :mod:`modeld.backends.gguf_checks`). Errors are :class:`GGUFFormatError` whose message
continues "<path> ..." and never quotes bytes of a file that lacks the GGUF magic.
"""

from __future__ import annotations

import struct
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any, Final

from modeld.backends._lean import submodule
from modeld.backends.probe import ModelFile

__all__ = [
    "ARRAY",
    "BOOL",
    "F32",
    "I32",
    "INTEGERS",
    "LIMITS",
    "STRING",
    "U32",
    "GGUFFormatError",
    "Header",
    "Value",
]

GGUF_MAGIC = b"GGUF"

LIMITS: Final = {
    # name: maximum. Real models are far below each (a 262k vocabulary has 262,144 tokens,
    # metadata of a few MB, under 100 metadata entries and a few thousand tensors).
    "max_metadata_entries": 65_536,
    "max_array_elements": 1 << 20,  # per array
    "max_metadata_strings": 1 << 21,  # strings in all of the metadata (array elements included)
    "max_header_bytes": 64 << 20,  # metadata + tensor table
    "max_name_bytes": 65_536,  # one metadata key or tensor name
    "max_tensors": 65_536,
}

_GGML_MAX_DIMS = 4

# GGUF value types
U8, I8, U16, I16, U32, I32, F32, BOOL, STRING, ARRAY, U64, I64, F64 = range(13)
SCALARS: Final = {
    U8: "B",
    I8: "b",
    U16: "H",
    I16: "h",
    U32: "I",
    I32: "i",
    F32: "f",
    BOOL: "?",
    U64: "Q",
    I64: "q",
    F64: "d",
}
INTEGERS: Final = frozenset({U8, I8, U16, I16, U32, I32, U64, I64})


class GGUFFormatError(Exception):
    """The file is not a GGUF modeld accepts; ``details`` go into the ModelLoadError."""

    def __init__(self, message: str, **details: str | int) -> None:
        super().__init__(message)
        self.details = details


def _limit(name: str, value: int) -> GGUFFormatError:
    maximum = LIMITS[name]
    return GGUFFormatError(
        f"exceeds the limit {name} ({value} > {maximum})", limit=name, value=value, maximum=maximum
    )


@dataclass(slots=True)
class Value:
    """One metadata value: where it is in the header buffer, and what it is."""

    type: int
    item: int = -1  # element type of an array
    count: int = 1  # elements of an array
    start: int = 0  # payload span in the header buffer: a string's bytes, an array's
    end: int = 0  #   elements (numeric arrays: contiguous), a scalar's bytes
    scalar: Any = None  # a numeric scalar, decoded
    strings: list[bytes] | None = None  # kept string array elements (tokens, merges)


class Header:
    """The metadata and tensor table of a GGUF file, read incrementally from an open file
    with every count checked against :data:`LIMITS` before it is walked."""

    CHUNK = 1 << 20

    def __init__(self, f: ModelFile, *, keep: frozenset[str] = frozenset()) -> None:
        """``keep``: keys whose string arrays are kept (every other one is only stepped over)."""
        self._f = f
        self._keep = keep
        self._size = f.identity.size
        self.buf = bytearray()
        self.pos = 0
        self.endian = "<"
        self.strings = 0
        self.version = 0
        self.kvs: dict[str, Value] = {}
        self.tensor_names: set[bytes] = set()
        self.weights_bytes = 0
        self.tensor_end = 0
        self.data_offset = 0
        self.alignment = 32

    # reading

    def _need(self, n: int) -> None:
        end = self.pos + n
        if end <= len(self.buf):
            return
        if end > LIMITS["max_header_bytes"]:
            raise _limit("max_header_bytes", end)
        if end > self._size:
            raise GGUFFormatError(f"is truncated: its header needs more than the file's {self._size} bytes")
        want = min(max(end, len(self.buf) + self.CHUNK), LIMITS["max_header_bytes"], self._size)
        self.buf += self._f.read_at(len(self.buf), want - len(self.buf))
        if end > len(self.buf):
            raise GGUFFormatError("is truncated: it ended while its header was being read")

    def _unpack(self, fmt: str) -> Any:
        s = struct.Struct(self.endian + fmt)
        self._need(s.size)
        (value,) = s.unpack_from(self.buf, self.pos)
        self.pos += s.size
        return value

    def _string(self, limit: str | None = None) -> tuple[int, int]:
        n = self._unpack("Q")
        if limit is not None and n > LIMITS[limit]:
            raise _limit(limit, n)
        self._need(n)
        start = self.pos
        self.pos += n
        return start, self.pos

    def _text(self, start: int, end: int, what: str) -> str:
        try:
            return self.buf[start:end].decode("utf-8")
        except UnicodeDecodeError:
            raise GGUFFormatError(f"has a {what} that is not valid UTF-8") from None

    def _count_strings(self, n: int) -> None:
        self.strings += n
        if self.strings > LIMITS["max_metadata_strings"]:
            raise _limit("max_metadata_strings", self.strings)

    # structure

    def parse(self) -> None:
        self._need(4)
        if bytes(self.buf[:4]) != GGUF_MAGIC:
            raise GGUFFormatError("is not a GGUF file (it does not start with the GGUF magic)")
        self.pos = 4
        version = self._unpack("I")
        if version & 0xFFFF == 0:  # written on a machine of the other byte order
            self.endian = ">"
            version = struct.unpack(">I", struct.pack("<I", version))[0]
        if version not in (2, 3):
            raise GGUFFormatError(
                f"is GGUF version {version}; modeld reads versions 2 and 3", field="version"
            )
        self.version = version
        n_tensors = self._unpack("Q")
        n_kv = self._unpack("Q")
        if n_kv > LIMITS["max_metadata_entries"]:
            raise _limit("max_metadata_entries", n_kv)
        if n_tensors > LIMITS["max_tensors"]:
            raise _limit("max_tensors", n_tensors)
        for _ in range(n_kv):
            start, end = self._string("max_name_bytes")
            key = self._text(start, end, "metadata key")
            if key in self.kvs:
                raise GGUFFormatError(f"has the metadata key {_quote(key)} twice")
            value_type = self._unpack("I")
            self.kvs[key] = self._value(value_type, keep=key in self._keep)
        alignment = self.kvs.get("general.alignment")
        if alignment is not None:
            if alignment.type != U32 or alignment.scalar <= 0 or alignment.scalar & (alignment.scalar - 1):
                raise GGUFFormatError(
                    "has a general.alignment that is not a power of two (u32)", field="general.alignment"
                )
            self.alignment = int(alignment.scalar)
        infos = [self._tensor_info() for _ in range(n_tensors)]
        self.data_offset = -(-self.pos // self.alignment) * self.alignment
        for offset, n_bytes in infos:
            if offset % self.alignment:
                raise GGUFFormatError(f"has a tensor whose data is not aligned to {self.alignment} bytes")
            self.tensor_end = max(self.tensor_end, self.data_offset + offset + n_bytes)

    def _value(self, value_type: int, *, keep: bool) -> Value:
        if value_type in SCALARS:
            s = struct.Struct(self.endian + SCALARS[value_type])
            self._need(s.size)
            start = self.pos
            self.pos += s.size
            (scalar,) = s.unpack_from(self.buf, start)
            return Value(value_type, start=start, end=self.pos, scalar=scalar)
        if value_type == STRING:
            self._count_strings(1)
            start, end = self._string()
            return Value(value_type, start=start, end=end)
        if value_type != ARRAY:
            raise GGUFFormatError(f"has a metadata value of unknown type {value_type}")
        item = self._unpack("I")
        count = self._unpack("Q")
        if count > LIMITS["max_array_elements"]:
            raise _limit("max_array_elements", count)
        if item in SCALARS:
            size = struct.calcsize(SCALARS[item]) * count
            self._need(size)
            start = self.pos
            self.pos += size
            return Value(ARRAY, item=item, count=count, start=start, end=self.pos)
        if item != STRING:  # nested arrays: llama.cpp refuses them too
            raise GGUFFormatError(
                f"has a metadata array of element type {item} (arrays of arrays are not supported)"
            )
        self._count_strings(count)
        start = self.pos
        kept = self._walk_strings(count, keep)
        return Value(ARRAY, item=STRING, count=count, start=start, end=self.pos, strings=kept)

    def _walk_strings(self, count: int, keep: bool) -> list[bytes] | None:
        """Step over ``count`` length-prefixed strings (keeping them if asked)."""
        kept: list[bytes] | None = [] if keep else None
        length = struct.Struct(self.endian + "Q").unpack_from
        buf = self.buf
        for _ in range(count):
            if self.pos + 8 > len(buf):
                self._need(8)
                buf = self.buf
            (n,) = length(buf, self.pos)
            self.pos += 8
            if self.pos + n > len(buf):
                self._need(n)
                buf = self.buf
            if kept is not None:
                kept.append(bytes(buf[self.pos : self.pos + n]))
            self.pos += n
        return kept

    def _tensor_info(self) -> tuple[int, int]:
        start, end = self._string("max_name_bytes")
        name = bytes(self.buf[start:end])
        if name in self.tensor_names:
            raise GGUFFormatError("has two tensors with the same name")
        self.tensor_names.add(name)
        n_dims = self._unpack("I")
        if n_dims > _GGML_MAX_DIMS:
            raise GGUFFormatError(
                f"has a tensor with {n_dims} dimensions (ggml has at most {_GGML_MAX_DIMS})"
            )
        dims = [self._unpack("Q") for _ in range(n_dims)]
        raw_type = self._unpack("I")
        offset = self._unpack("Q")
        sizes = _quant_sizes().get(raw_type)
        if sizes is None:
            raise GGUFFormatError(f"has a tensor of unknown ggml type {raw_type}")
        block, type_size = sizes
        if dims and dims[0] % block:
            raise GGUFFormatError(
                f"has a tensor whose rows do not fill whole blocks of its type ({block} values)"
            )
        elements = 1
        for d in dims:
            elements *= d
        n_bytes = elements * type_size // block
        self.weights_bytes += n_bytes
        return offset, n_bytes

    # values, as describe needs them

    def get(self, key: str) -> Value | None:
        return self.kvs.get(key)

    def py(self, key: str, default: Any = None) -> Any:
        """A scalar value as Python (str, int, float, bool), or ``default`` if the key is absent.

        Matches ``gguf.ReaderField.contents()`` for scalars (strings strictly UTF-8), so the
        tokenizer digest's text is unchanged."""
        v = self.kvs.get(key)
        if v is None:
            return default
        if v.type == STRING:
            return self._text(v.start, v.end, key)
        if v.type == ARRAY:
            raise GGUFFormatError(f"has an array for {key}, which must be a single value", field=key)
        if v.type == BOOL:
            return bool(v.scalar)
        return v.scalar

    def integer(self, key: str, default: int = 0) -> int:
        v = self.kvs.get(key)
        if v is None:
            return default
        if v.type not in INTEGERS:
            raise GGUFFormatError(f"has {key} of type {v.type}, not an integer", field=key)
        return int(v.scalar)

    def integers(self, key: str) -> list[int] | None:
        """An integer, or a per-layer array of integers, as a list (None if absent)."""
        v = self.kvs.get(key)
        if v is None:
            return None
        if v.type == ARRAY and v.item in INTEGERS:
            return list(struct.unpack_from(f"{self.endian}{v.count}{SCALARS[v.item]}", self.buf, v.start))
        if v.type in INTEGERS:
            return [int(v.scalar)]
        raise GGUFFormatError(
            f"has {key} of type {v.type}, not an integer or an array of integers", field=key
        )

    def leaf_bytes(self, key: str) -> Iterator[bytes]:
        """The raw bytes of a value's elements in file order, without length prefixes (what
        ``bytes(field.parts[i]) for i in field.data`` gave with ``gguf.GGUFReader``)."""
        v = self.kvs[key]
        if v.type == ARRAY and v.item == STRING:
            if v.strings is None:  # pragma: no cover - every digested string array is kept
                raise AssertionError(f"{key} was not kept")
            yield from v.strings
        else:
            yield bytes(self.buf[v.start : v.end])

    def tokens(self) -> list[bytes]:
        v = self.kvs.get("tokenizer.ggml.tokens")
        if v is None:
            return []
        if v.strings is None:
            raise GGUFFormatError(
                "has tokenizer.ggml.tokens that is not an array of strings", field="tokenizer.ggml.tokens"
            )
        return v.strings


_QUANT_SIZES: dict[int, tuple[int, int]] = {}


def _quant_sizes() -> dict[int, tuple[int, int]]:
    """ggml tensor type -> (values per block, bytes per block), from the ``gguf`` package's
    constants alone (``_lean``: its ``__init__`` would load numpy, OpenBLAS and yaml into the
    daemon for this table)."""
    if not _QUANT_SIZES:
        try:
            sizes = submodule("gguf", "constants").GGML_QUANT_SIZES
        except ImportError as exc:  # pragma: no cover - a dependency of the llama/openvino extras
            raise GGUFFormatError(f"cannot be read: reading GGUF needs the gguf package ({exc})") from None
        _QUANT_SIZES.update({int(t): (int(b), int(s)) for t, (b, s) in sizes.items()})
    return _QUANT_SIZES


def _quote(text: str) -> str:
    return repr(text[:80]) + ("..." if len(text) > 80 else "")
