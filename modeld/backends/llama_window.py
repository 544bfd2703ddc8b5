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
checkpoint taken at its end, restored padded). The padded blob is transient and its zeros are
never written (an anonymous mapping: untouched pages take no memory), so a restore at position
``p`` costs the cells' headers and the window, not ``p`` cells of every local layer (which, on a
27B Gemma 3 at 100k tokens, would be tens of GB).

The layout read (llama.cpp's ``llama_kv_cache::state_write`` for one sequence, after the
context's ``u32`` magic and ``i32`` sequence id): ``u32 n_stream``; per stream ``u32 cells``,
per cell ``i32 pos, u32 n_seq_id`` and the ids, then ``u32 v_trans, u32 n_layer``, per layer
``i32 type, u64 row`` and the key rows; then per layer the values, as rows (``i32 type, u64
row``) or transposed (``i32 type, u32 element, u32 n_embd`` and per embedding index the cells'
elements). Anything else (cell extensions of M-RoPE models, a layer without values, a count that
does not add up) gives None: the caller does not use the checkpoint.
"""

from __future__ import annotations

import mmap
import struct

__all__ = ["pad_window"]

_U32 = struct.Struct("<I")
_I32 = struct.Struct("<i")
_CELL = struct.Struct("<iI")
_CELL_SEQ = struct.Struct("<iIi")  # a cell with its one sequence id
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


def pad_window(blob: bytes) -> tuple[mmap.mmap, int] | None:
    """The checkpoint ``blob`` with zero cells before its window (see the module docstring), in
    an anonymous mapping the caller closes, and the window's first position (the first one whose
    cells are real once it is restored), or None when its layout is not the one read here.

    The padding's key and value bytes are never written: an anonymous mapping reads as zeros, and
    pages never written take no memory (llama.cpp's read of them maps the kernel's zero page), so
    the transient cost is the cells' headers (12 bytes a cell) and the window itself, not ``p``
    cells of every local layer."""
    try:
        size = _walk(blob, _Counter())
    except (_BadLayoutError, struct.error):
        return None
    out = _MapWriter(size)
    try:
        low = _walk(blob, out)
    except BaseException:
        out.mm.close()
        raise
    return out.mm, low


class _Counter:
    """Counts the bytes a walk writes and skips (the padded blob's size)."""

    def __init__(self) -> None:
        self.at = 0

    def put(self, data: bytes) -> None:
        self.at += len(data)

    def skip(self, n: int) -> None:
        self.at += n

    def cells(self, pad: int, cells: list[tuple[int, int]]) -> None:
        """The padded stream's cell headers: ``pad`` cells of the window's sequence at positions
        ``0 .. pad - 1``, then the window's own (counted here, not built)."""
        self.at += _CELL_SEQ.size * (pad + len(cells))

    def end(self) -> int:
        return self.at


class _MapWriter(_Counter):
    """Writes a walk into an anonymous mapping; skipped bytes stay zero and unwritten."""

    def __init__(self, size: int) -> None:
        super().__init__()
        self.mm = mmap.mmap(-1, max(size, 1), flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)

    def put(self, data: bytes) -> None:
        self.mm[self.at : self.at + len(data)] = data
        self.at += len(data)

    def cells(self, pad: int, cells: list[tuple[int, int]]) -> None:
        cell = _CELL_SEQ.pack
        self.put(b"".join(cell(pos, 1, cells[0][1]) for pos in range(pad)))
        self.put(b"".join(cell(pos, 1, seq) for pos, seq in cells))


def _walk(blob: bytes, out: _Counter) -> int:
    """Read ``blob`` and write its padded form to ``out``: returns the padded size for a
    :class:`_Counter`, the window's first position for a :class:`_MapWriter`."""
    r = _Reader(blob)
    low = 0
    out.put(r.take(8))  # the context's magic and the sequence id
    (n_stream,) = r.unpack(_U32)
    out.put(_U32.pack(n_stream))
    for _ in range(n_stream):
        (count,) = r.unpack(_U32)
        if count == 0:
            out.put(_U32.pack(0))
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
        out.put(_U32.pack(pad + count))
        out.cells(pad, cells)
        v_trans, n_layer = r.unpack(_U32), r.unpack(_U32)
        out.put(_U32.pack(v_trans[0]) + _U32.pack(n_layer[0]))
        for _ in range(n_layer[0]):
            k_type, row = r.unpack(_KROW)
            out.put(_KROW.pack(k_type, row))
            out.skip(pad * row)
            out.put(r.take(count * row))
        for _ in range(n_layer[0]):
            if not v_trans[0]:
                v_type, row = r.unpack(_KROW)
                out.put(_KROW.pack(v_type, row))
                out.skip(pad * row)
                out.put(r.take(count * row))
            else:
                v_type, el, n_embd = r.unpack(_VT)
                out.put(_VT.pack(v_type, el, n_embd))
                for _ in range(n_embd):
                    out.skip(pad * el)
                    out.put(r.take(count * el))
    if r.at != len(blob):
        raise _BadLayoutError
    return low if isinstance(out, _MapWriter) else out.end()
