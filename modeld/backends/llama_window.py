"""A sliding window's checkpoint, restored at the cells a fresh evaluation uses (engine-worker side).

A checkpoint of sliding-window attention (``llama_state_seq_get_data_ext`` with
``LLAMA_STATE_SEQ_FLAGS_PARTIAL_ONLY`` on llama.cpp's iSWA cache) holds the local layers' cells of
the last ``n_swa`` positions before it: ``p - n_swa .. p - 1``. llama.cpp restores them at the
first free cells of the sequence's stream (cell 0 on), where a fresh evaluation holds position
``q`` at cell ``q``. Attention sums over cells in cell order, with SIMD lanes by cell index, so
the same keys at other cells round differently (measured on the generated gemma3 and gpt-oss: a
log-probability off by ~1e-4 after a restart). :func:`pad_window` rewrites the checkpoint with
``p - n_swa`` cells of zeros before the window, at positions ``0 .. p - n_swa - 1``: restored,
the window lands at the cells a fresh evaluation used, and the padding cells, outside every later
token's window, are masked (a masked cell adds an exact 0, as the stale cells of a fresh
evaluation do). A whole snapshot's window is put back the same way after it is restored (the
checkpoint taken at its end, restored padded). The padded blob is transient: ``p`` cells of the local layers, what the
sequence's local cells hold anyway in llama.cpp's full-size SWA cache (``swa_full``).

The layout read (llama.cpp's ``llama_kv_cache::state_write`` for one sequence, after the
context's ``u32`` magic and ``i32`` sequence id): ``u32 n_stream``; per stream ``u32 cells``,
per cell ``i32 pos, u32 n_seq_id`` and the ids, then ``u32 v_trans, u32 n_layer``, per layer
``i32 type, u64 row`` and the key rows; then per layer the values, as rows (``i32 type, u64
row``) or transposed (``i32 type, u32 element, u32 n_embd`` and per embedding index the cells'
elements). Anything else (cell extensions of M-RoPE models, a layer without values, a count that
does not add up) gives None: the caller does not use the checkpoint.
"""

from __future__ import annotations

import struct

__all__ = ["pad_window"]

_U32 = struct.Struct("<I")
_I32 = struct.Struct("<i")
_CELL = struct.Struct("<iI")
_KROW = struct.Struct("<iQ")
_VT = struct.Struct("<iII")


class _BadLayoutError(Exception):
    pass


class _Reader:
    def __init__(self, data: bytes) -> None:
        self.data = data
        self.at = 0

    def take(self, n: int) -> bytes:
        if n < 0 or self.at + n > len(self.data):
            raise _BadLayoutError
        out = self.data[self.at : self.at + n]
        self.at += n
        return out

    def unpack(self, fmt: struct.Struct) -> tuple[int, ...]:
        return fmt.unpack(self.take(fmt.size))


def pad_window(blob: bytes) -> tuple[bytes, int] | None:
    """The checkpoint ``blob`` with zero cells before its window (see the module docstring) and
    the window's first position (the first one whose cells are real once it is restored), or
    None when its layout is not the one read here."""
    try:
        return _pad(blob)
    except (_BadLayoutError, struct.error):
        return None


def _pad(blob: bytes) -> tuple[bytes, int]:
    r = _Reader(blob)
    low = 0
    out = bytearray(r.take(8))  # the context's magic and the sequence id
    (n_stream,) = r.unpack(_U32)
    out += _U32.pack(n_stream)
    for _ in range(n_stream):
        (count,) = r.unpack(_U32)
        if count == 0:
            out += _U32.pack(0)
            continue
        cells = []
        for _ in range(count):
            pos, n_ids = r.unpack(_CELL)
            if n_ids != 1:
                raise _BadLayoutError
            (seq,) = r.unpack(_I32)
            cells.append((pos, seq))
        first = cells[0][0]
        if [p for p, _ in cells] != list(range(first, first + count)) or first < 0:
            raise _BadLayoutError  # not one contiguous window
        pad = low = first
        out += _U32.pack(pad + count)
        for pos in range(pad):
            out += _CELL.pack(pos, 1) + _I32.pack(cells[0][1])
        for pos, seq in cells:
            out += _CELL.pack(pos, 1) + _I32.pack(seq)
        v_trans, n_layer = r.unpack(_U32), r.unpack(_U32)
        out += _U32.pack(v_trans[0]) + _U32.pack(n_layer[0])
        for _ in range(n_layer[0]):
            k_type, row = r.unpack(_KROW)
            out += _KROW.pack(k_type, row) + bytes(pad * row) + r.take(count * row)
        for _ in range(n_layer[0]):
            if not v_trans[0]:
                v_type, row = r.unpack(_KROW)
                out += _KROW.pack(v_type, row) + bytes(pad * row) + r.take(count * row)
            else:
                v_type, el, n_embd = r.unpack(_VT)
                out += _VT.pack(v_type, el, n_embd)
                zeros = bytes(pad * el)
                for _ in range(n_embd):
                    out += zeros + r.take(count * el)
    if r.at != len(blob):
        raise _BadLayoutError
    return bytes(out), low
