"""Write GGUF files byte by byte, including the malformed and hostile ones a checker must refuse.

``gguf.GGUFWriter`` refuses to write most of what these tests need (duplicate keys, wrong value
types, lying counts, a version it does not know), so this writes the format directly
(https://github.com/ggml-org/ggml/blob/master/docs/gguf.md): magic, version, tensor count,
metadata count, metadata (key string, value type, value), tensor infos (name, dims, type,
offset), padding to the alignment, tensor data.

:func:`load` reads an existing file's metadata and tensors (with ``gguf.GGUFReader``, an
implementation independent of the one under test) so a real generated model can be rewritten
with one field changed.
"""

from __future__ import annotations

import struct
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import gguf

UINT8, INT8, UINT16, INT16, UINT32, INT32, FLOAT32, BOOL, STRING, ARRAY, UINT64, INT64, FLOAT64 = range(13)
_SCALAR = {
    UINT8: "B",
    INT8: "b",
    UINT16: "H",
    INT16: "h",
    UINT32: "I",
    INT32: "i",
    FLOAT32: "f",
    BOOL: "?",
    UINT64: "Q",
    INT64: "q",
    FLOAT64: "d",
}


@dataclass(frozen=True)
class KV:
    """One metadata pair. For arrays ``item`` is the element type and ``value`` a list
    (``count`` overrides the written element count, to lie about it)."""

    key: str
    type: int
    value: Any
    item: int = -1
    count: int | None = None


@dataclass(frozen=True)
class Tensor:
    name: str
    dims: tuple[int, ...]  # ggml order (innermost first)
    type: int
    data: bytes
    offset: int | None = None  # None: placed after the previous one, aligned
    size: int | None = None  # with empty data: this many zero bytes, left as a hole in the file


def _nbytes(t: Tensor) -> int:
    return len(t.data) if t.size is None else t.size


@dataclass
class GGUF:
    kvs: list[KV]
    tensors: list[Tensor] = field(default_factory=list)
    version: int = 3
    alignment: int = 32
    endian: str = "<"
    kv_count: int | None = None  # None: len(kvs); else written as is (a lie)
    tensor_count: int | None = None

    def get(self, key: str) -> KV:
        return next(kv for kv in self.kvs if kv.key == key)

    def set(self, key: str, value: Any, type: int | None = None, item: int = -1) -> GGUF:
        """A copy with ``key`` set (replaced in place, or appended)."""
        kvs = list(self.kvs)
        for i, kv in enumerate(kvs):
            if kv.key == key:
                kvs[i] = replace(
                    kv,
                    value=value,
                    type=kv.type if type is None else type,
                    item=item if item >= 0 else kv.item,
                )
                return replace(self, kvs=kvs)
        assert type is not None, f"new key {key} needs a type"
        kvs.append(KV(key, type, value, item))
        return replace(self, kvs=kvs)

    def drop(self, key: str) -> GGUF:
        return replace(self, kvs=[kv for kv in self.kvs if kv.key != key])

    def write(self, path: Path) -> Path:
        e = self.endian
        out = bytearray(b"GGUF")
        out += struct.pack(f"{e}I", self.version)
        out += struct.pack(
            f"{e}QQ",
            len(self.tensors) if self.tensor_count is None else self.tensor_count,
            len(self.kvs) if self.kv_count is None else self.kv_count,
        )
        for kv in self.kvs:
            out += _string(kv.key, e) + struct.pack(f"{e}I", kv.type)
            out += _value(kv, e)
        offsets: list[int] = []
        position = 0
        for t in self.tensors:
            position = -(-position // self.alignment) * self.alignment
            offsets.append(position if t.offset is None else t.offset)
            position += _nbytes(t)
        for t, offset in zip(self.tensors, offsets, strict=True):
            out += _string(t.name, e) + struct.pack(f"{e}I", len(t.dims))
            out += b"".join(struct.pack(f"{e}Q", d) for d in t.dims)
            out += struct.pack(f"{e}IQ", t.type, offset)
        out += b"\0" * (-len(out) % self.alignment)
        start = len(out)
        end = start
        for t, offset in zip(self.tensors, offsets, strict=True):
            if t.size is not None:  # a hole: the file is extended sparsely below
                end = max(end, start + offset + t.size)
                continue
            out += b"\0" * (start + offset - len(out))
            out += t.data
        path.write_bytes(bytes(out))
        if end > len(out):
            with path.open("r+b") as f:
                f.truncate(end)
        return path


def _string(s: str | bytes, e: str) -> bytes:
    raw = s.encode("utf-8") if isinstance(s, str) else s
    return struct.pack(f"{e}Q", len(raw)) + raw


def _scalar(type_: int, value: Any, e: str) -> bytes:
    if type_ == STRING:
        return _string(value, e)
    if type_ not in _SCALAR:  # an unknown type: the value is the raw bytes to write
        return bytes(value)
    return struct.pack(f"{e}{_SCALAR[type_]}", value)


def _value(kv: KV, e: str) -> bytes:
    if kv.type != ARRAY:
        return _scalar(kv.type, kv.value, e)
    count = len(kv.value) if kv.count is None else kv.count
    head = struct.pack(f"{e}IQ", kv.item, count)
    if kv.item in _SCALAR:
        return head + struct.pack(f"{e}{len(kv.value)}{_SCALAR[kv.item]}", *kv.value)
    return head + b"".join(_scalar(kv.item, v, e) for v in kv.value)


def load(path: Path) -> GGUF:
    """Every metadata pair and tensor of a (well-formed, little-endian) GGUF file."""
    reader = gguf.GGUFReader(str(path))
    kvs: list[KV] = []
    alignment = 32
    for name, f in reader.fields.items():
        if name.startswith("GGUF."):
            continue
        if name == "general.alignment":
            alignment = int(f.contents())
        main = int(f.types[0])
        if main == ARRAY:
            item = int(f.types[-1]) if len(f.types) > 1 else UINT8
            if item == STRING:
                value: Any = [bytes(f.parts[i]) for i in f.data]
            else:
                value = f.contents()
            kvs.append(KV(name, ARRAY, value, item))
        elif main == STRING:
            kvs.append(KV(name, STRING, bytes(f.parts[-1])))
        else:
            kvs.append(KV(name, main, f.contents()))
    tensors = [
        Tensor(t.name, tuple(int(d) for d in t.shape), int(t.tensor_type), bytes(t.data.tobytes()))
        for t in reader.tensors
    ]
    return GGUF(kvs, tensors, alignment=alignment)


def with_kv_of(model: Path, donor: Path) -> bytes:
    """``model``'s bytes with the K and V projection weights of ``donor`` (the same shapes: a
    generated model at another seed): same size, same tokenizer and header, another model whose
    KV differs from the first layer on. What a file rewritten in place under a running daemon
    looks like."""
    old = model.read_bytes()
    new = bytearray(old)
    theirs = {t.name: t for t in gguf.GGUFReader(str(donor)).tensors}
    donor_bytes = donor.read_bytes()
    swapped = 0
    for t in gguf.GGUFReader(str(model)).tensors:
        if ".attn_k." in t.name or ".attn_v." in t.name:
            u = theirs[t.name]
            assert u.n_bytes == t.n_bytes, t.name
            new[t.data_offset : t.data_offset + t.n_bytes] = donor_bytes[
                u.data_offset : u.data_offset + u.n_bytes
            ]
            swapped += 1
    assert swapped >= 2 and len(new) == len(old) and bytes(new) != old
    return bytes(new)
