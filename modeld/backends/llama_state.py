"""A llama.cpp sequence's state in and out (engine-worker side): the snapshot format.

A snapshot (the RAM tier's blob, the payload of a disk-tier file) is llama.cpp's own
sequence-state *file* format with no tokens: ``u32 'ggsq' magic, u32 version, u32 0`` (tokens;
modeld keeps them itself), then the KV cache's ``u32 n_stream`` and, per stream, a ``u32`` cell
count followed (when not 0) by that stream's cells. Stored with the sequence's cells in the
first stream and at least ``_LISTED - 1`` empty streams after it (4 zero bytes each, 1 KB), it
fits a context with any number of streams, split or unified: changing --sequences or
--kv-unified (or the memory budget doing it) keeps the disk tier usable. A context whose stream
count is the one the snapshot lists reads a file itself, a tensor row at a time
(``llama_state_seq_load_file``), and writes one the same way (``llama_state_seq_save_file``): a
snapshot on its way to or from disk never exists as one blob in memory. Another stream count is
a four-byte edit of a private mapping.

:class:`SeqStates` only moves bytes; the context (:mod:`modeld.backends.llama_context`) checks
the sequence, empties it first and verifies what a restore put there (the positions its tokens
claim). Design record: ``blueprints/0016-warm-state.md`` (the snapshot blob).
"""

from __future__ import annotations

import contextlib
import ctypes
import mmap
import os
import struct
import typing
from typing import Any

from modeld.backends._llama_lib import bindings as _llama
from modeld.errors import EngineError, ModelLoadError

__all__ = ["SeqStates"]

_LISTED = 256
"""Streams a stored snapshot fits (``--sequences`` goes up to 256): its cells first, then
``_LISTED - 1`` empty streams, so a context of up to this many streams reads it as it is."""
_PAD = 4 * (_LISTED - 1)
_SEQ_FILE = struct.Struct("<III")
"""llama.cpp's sequence-state file head: magic, version, token count (0: modeld keeps the tokens)."""
_HEAD = _SEQ_FILE.size


class SeqStates:
    """Snapshots of one context's sequences. ``portable``: the blob is stored as its own cells
    followed by empty streams (not for recurrent, hybrid or sliding-window memory, whose state
    is not a KV stream); ``n_stream``: the streams of the context (1 for a unified pool)."""

    def __init__(self, ctx: Any, *, portable: bool, unified: bool, n_stream: int, path: str) -> None:
        self._ctx = ctx
        self._portable = portable
        self._unified = unified
        self._n_stream = n_stream
        self._io_magic = self._magic(path)  # every sequence is empty now

    def _blob_head(self) -> bytes:
        return _SEQ_FILE.pack(_llama.LLAMA_STATE_SEQ_MAGIC, _llama.LLAMA_STATE_SEQ_VERSION, 0)

    def snapshot(self, seq: int) -> bytes:
        size = int(_llama.llama_state_seq_get_size(self._ctx, seq))
        pad = _PAD if self._portable else 0
        # llama.cpp's in-memory form (u32 magic, i32 source sequence, the KV) is written at
        # offset 4, so its 8-byte head is replaced by the file format's 12 in place: one
        # buffer, no copy (a KV snapshot is tens of megabytes).
        out = bytearray(4 + size + pad)
        buf = (ctypes.c_uint8 * size).from_buffer(out, 4)
        got = int(_llama.llama_state_seq_get_data(self._ctx, buf, size, seq))
        del buf  # releases the buffer, so ``out`` may be cut
        if got <= 8 or got > size:
            raise EngineError(f"llama.cpp could not save sequence {seq} ({got} of {size} bytes)")
        del out[4 + got + pad :]
        out[:_HEAD] = self._blob_head()
        if self._portable:
            self._cells_first(out, pad, 0 if self._unified else seq)
        return typing.cast(bytes, out)  # nobody writes to it: bytes without another copy

    def _cells_first(self, out: bytearray, pad: int, stream: int) -> None:
        """Move the one stream that holds cells (``stream``: the sequence's own in a split
        context) to the front, in place; the empty streams before it go after it."""
        n = self._n_stream
        before, after = 4 * stream, 4 * (n - stream - 1)
        end = len(out) - pad
        if (
            end < _HEAD + 8 + before + after
            or int.from_bytes(out[_HEAD : _HEAD + 4], "little") != n
            or any(out[_HEAD + 4 : _HEAD + 4 + before])
            or (after and any(out[end - after : end]))
        ):
            raise EngineError(f"llama.cpp saved a sequence in an unexpected form ({len(out)} bytes)")
        if before:
            cells = end - after - (_HEAD + 4 + before)
            base = ctypes.addressof((ctypes.c_char * len(out)).from_buffer(out))
            ctypes.memmove(base + _HEAD + 4, base + _HEAD + 4 + before, cells)
            out[_HEAD + 4 + cells :] = bytes(len(out) - _HEAD - 4 - cells)

    def save(self, seq: int, path: str) -> int:
        """Write ``seq``'s snapshot into a new file at ``path``; returns its size. The
        unified pool (one stream) and memory that cannot be cut have llama.cpp stream it from
        the KV into the file; a split context's sequence sits in its own stream and is
        rearranged in memory first. Raises ``OSError`` when the file cannot be written."""
        if self._portable and self._n_stream > 1:
            blob = self.snapshot(seq)
            fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o600)
            with os.fdopen(fd, "wb") as f:
                f.write(blob)
            return len(blob)
        none = (_llama.llama_token * 1)()
        if not _llama.llama_state_seq_save_file(self._ctx, os.fsencode(path), seq, none, 0):
            # llama.cpp logged why; the file system's own error names the cause (a full disk,
            # a size limit, a read-only mount): one more write to the same file finds it.
            with open(path, "ab") as f:
                f.write(bytes(1 << 20))
                f.flush()
                os.fsync(f.fileno())
            raise EngineError(f"llama.cpp could not write sequence {seq} to {path} (see the worker log)")
        if self._portable:
            with open(path, "ab") as f:
                f.write(bytes(_PAD))
        return os.stat(path).st_size

    def restore(self, seq: int, blob: bytes | bytearray | memoryview) -> bool:
        """Load ``blob`` into the empty sequence ``seq``: did llama.cpp read it?"""
        view = memoryview(blob)
        head = self._blob_head()
        if view.nbytes <= _HEAD + 4 or view[:_HEAD] != head:
            return False
        n = self._n_stream
        edit: memoryview = view
        if self._portable:
            listed = int.from_bytes(view[_HEAD : _HEAD + 4], "little")
            empty = 4 * (n - 1)
            if listed < 1 or (empty and any(view[view.nbytes - min(empty, _PAD) :])):
                return False
            if n - 1 > _PAD // 4:  # more streams than a snapshot lists: one copy, extended
                grown = bytearray(view)
                grown.extend(bytes(empty - _PAD))
                edit = memoryview(grown)
        if edit.readonly:
            edit = memoryview(bytearray(edit))  # the caller's blob stays as it is
        # Read in place from a writable blob (the socket's bytearray, a private file mapping):
        # llama.cpp's in-memory head (magic, source sequence) over the file head's last 8 bytes,
        # and this context's stream count; put back afterwards (a blob may be restored again).
        saved = bytes(edit[: _HEAD + 4])
        edit[4:8] = self._io_magic
        if self._portable:
            edit[_HEAD : _HEAD + 4] = n.to_bytes(4, "little")
        size = edit.nbytes - 4
        buf = (ctypes.c_uint8 * size).from_buffer(edit, 4)
        try:
            read = int(_llama.llama_state_seq_set_data(self._ctx, buf, size, seq))
        finally:
            del buf  # releases the caller's buffer (a mapping is closed after this call)
            edit[: _HEAD + 4] = saved
            edit.release()
            view.release()
        return read > 0

    def restore_file(self, seq: int, path: str, size: int) -> bool:
        """Load the snapshot stored in the first ``size`` bytes of the file at ``path``
        (verified by the caller) into the empty sequence ``seq``. A context with the stream
        count the file lists has llama.cpp read it a tensor row at a time; another is given a
        private mapping to edit."""
        with open(path, "rb") as f:
            head = f.read(_HEAD + 4)
            if len(head) < _HEAD + 4 or head[:_HEAD] != self._blob_head():
                return False
            listed = int.from_bytes(head[_HEAD:], "little")
            if self._portable and (listed != self._n_stream or self._n_stream - 1 > _PAD // 4):
                mapped = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_COPY)
                try:
                    return self.restore(seq, memoryview(mapped)[:size])
                finally:
                    with contextlib.suppress(BufferError):
                        mapped.close()
        out = (_llama.llama_token * 1)()
        count = ctypes.c_size_t(0)
        read = int(
            _llama.llama_state_seq_load_file(self._ctx, os.fsencode(path), seq, out, 1, ctypes.byref(count))
        )
        return read > 0

    def _magic(self, path: str) -> bytes:
        """The first 4 bytes of llama.cpp's in-memory sequence state (no header names them:
        read from an empty sequence's state when the context is made)."""
        size = int(_llama.llama_state_seq_get_size(self._ctx, 0))
        buf = (ctypes.c_uint8 * size)()
        if size < 8 or int(_llama.llama_state_seq_get_data(self._ctx, buf, size, 0)) < 8:
            raise ModelLoadError("llama.cpp could not save an empty sequence's state", path=path)
        return bytes(buf[:4])
