"""Checkpoints inside a sequence whose memory cannot be cut (engine-worker side).

Recurrent and hybrid models (Mamba, Mamba-2, gated DeltaNet, short convolutions beside
attention) keep a state that only moves forward: llama.cpp cannot remove a suffix of it. A
*checkpoint* is that state at a token position, taken with ``llama_state_seq_get_data_ext`` and
``LLAMA_STATE_SEQ_FLAGS_PARTIAL_ONLY`` (the part that cannot be cut: the recurrent state; an
attention KV beside it is cut as usual). Cutting a sequence back to ``keep`` restores the last
checkpoint at or before ``keep`` and removes the attention cells after it; the context then
evaluates what lies between (:mod:`modeld.backends.llama_context`). Measured bit-exact on the
generated lfm2, qwen35, granitehybrid and mamba2 models (blueprint 0016, "Checkpoints").

Where they are taken (:class:`Checkpoints.wanted`), at batch boundaries of a prefill:

* **segment starts** (the manifest's, :data:`SEGMENT_GAP` tokens or more after the canonical
  position before them): where a repo map, a pinned file or a message that changes begins, so
  an edit of a segment goes back no further than its start;
* **turn starts**: before a control token that does not end generation (``<|im_start|>`` in
  ChatML, ``<start_of_turn>``, ...) at least :data:`TURN_GAP` tokens after the canonical
  position before it: a chat's message boundaries, where agents' prompts diverge (a moved
  reminder, a re-read file, the reasoning a template drops from earlier turns);
* **line starts** inside a long stretch without the others (a large segment: a repo map, a
  file; a raw prompt): the first line start :data:`LINE_GAP` tokens or more after the canonical
  position before it (:data:`LINE_SHARE` of the position further on), so an edit inside one
  segment goes back less than ~128 tokens, not to the segment's start;
* **a spacing**: every ``spacing`` tokens (the micro-batch), which bounds what a divergence
  anywhere costs to recompute while the checkpoints are all kept;
* **the end of a prompt** (:meth:`Checkpoints.take` with ``canonical=False``): a repeat, a retry,
  the same prefix with a new suffix restore it exactly.

**Numerics.** On these architectures a token's logits depend on where the batches that
evaluated the prompt began (measured: a 200-token prompt as one batch, or as 150 + 50, differs
by up to 0.03 of a logit on gpt-oss, 0.008 on granitehybrid, 0 on mamba2). So the prefill of
non-cuttable memory starts its batches at positions that depend only on the tokens
(:func:`canonical`: multiples of the micro-batch, turn starts, line starts and the manifest's
segment starts, which the daemon sends with every sync: a fresh evaluation of the same manifest
has them too), and a cut resumes from a
*canonical* checkpoint (one at such a position) unless a checkpoint sits exactly at the cut: a
warm turn then evaluates its tail in the batches a fresh evaluation uses, and its output is the
fresh one, bit for bit. The batches a sequence was evaluated in are recorded, so a restore that
re-evaluates known tokens (the last tokens' logits for a repeated prompt) repeats them exactly.

**Value.** At most ``limit`` checkpoints per sequence (``--checkpoints``, 8 by default; each one
holds the model's recurrent state, counted in the memory budget); past it the one whose loss
widens the gap between its neighbours least goes, a segment start's last (an agent edits a
segment: the one at its start serves the edit whole, one of the spacing only part of it). The
newest, the last prompt end and the last one at or before each of the two latest divergences
stay: an agent's prompt tends to diverge where it did last turn (a repo map's line that changes
every turn goes back less than ~128 tokens from the second edit on).
"""

from __future__ import annotations

import bisect
import ctypes
import logging
import struct
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from modeld.backends._llama_lib import bindings as _llama
from modeld.backends.llama_window import pad_window

__all__ = ["LINE_GAP", "LINE_SHARE", "PARTIAL", "SEGMENT_GAP", "TURN_GAP", "Checkpoints", "canonical", "plan"]

log = logging.getLogger("modeld.llama")

_MAGIC = b"mdckpt02"
_TRAILER = struct.Struct("<Q8s")
"""A snapshot's checkpoint section ends with its length and this magic (:meth:`Checkpoints.pack`)."""
_ITEM = struct.Struct("<IBI")

_RECENT = 2
"""Checkpoints that served the latest cuts of a sequence, kept whatever their spacing."""

PARTIAL = 1
"""``LLAMA_STATE_SEQ_FLAGS_PARTIAL_ONLY``: only the part of the memory that cannot be cut."""


TURN_GAP = 128
"""A turn start begins a batch only this many tokens or more after the last canonical position:
a chat of short messages is not evaluated in batches of a few dozen tokens. Measured on the
generated qwen35, a 2.5k-token chat of short messages (medians of 4, a loaded machine): batches
of 512 only 1.05-1.26 s; a batch at every turn start 2.8 s; at turn starts 64 tokens apart or
more 1.4-1.8 s; 128 apart 1.4 s."""


SEGMENT_GAP = 64
"""A manifest's segment start begins a batch only this many tokens or more after the segment
start before it (a manifest of tiny segments is not evaluated in tiny batches: at most one batch
more per this many tokens)."""


LINE_GAP = 64
"""Inside a long stretch without other batch starts (a large segment: a repo map, a file; a raw
prompt) the first line start this many tokens or more after the last canonical position begins
a batch (:data:`LINE_SHARE` further on): an edit inside it goes back less than this plus a line.
Blueprint 0016, "Edits inside a segment", has the measured cost of the smaller batches."""

LINE_SHARE = 32
"""Past ``LINE_GAP x LINE_SHARE`` tokens the line starts' spacing grows with the position (a
line start ``last / LINE_SHARE`` tokens or more after the canonical position ``last`` before
it): an edit goes back at most about that share of what precedes it (plus a line), and a prompt
of any length has a bounded number of batches more than the micro-batch grid (about
``LINE_SHARE x (1 + ln(chunk / LINE_GAP))``), where a fixed spacing would add one per
``LINE_GAP`` tokens."""


def canonical(
    tokens: Sequence[int],
    chunk: int,
    starts: frozenset[int],
    gap: int = TURN_GAP,
    segments: Sequence[int] = (),
    lines: frozenset[int] = frozenset(),
    spacing: int = LINE_GAP,
    share: int = LINE_SHARE,
) -> list[int]:
    """The canonical positions of a token sequence, where a prefill of it begins batches
    whatever came before: every multiple of ``chunk``, every segment start (``segments``:
    positions the manifest names) at least :data:`SEGMENT_GAP` tokens after the segment start
    before it (a multiple of ``chunk`` just before does not hide it: the edit of a segment goes
    back to its start), every turn start (a token of ``starts``) at least ``gap`` tokens after
    the canonical position before it, and every line start (the position after a token of
    ``lines``, whose text holds a newline) at least ``spacing`` tokens, and ``1 / share`` of its
    position, after it (a line start less than half that before a multiple of ``chunk`` is not
    one: that multiple is). A function of the tokens and the segment starts alone, read from the
    first (a fresh evaluation of the same manifest has the same, and an edit leaves every
    position before it as it was)."""
    out: list[int] = []
    last = last_mark = 0
    n = len(tokens)
    turns = {q for q, t in enumerate(tokens) if q and t in starts} if starts else set()
    breaks = {q + 1 for q, t in enumerate(tokens[:-1]) if t in lines} if lines else set()
    marks = {q for q in segments if 0 < q < n}
    grid = range(chunk, n, chunk)
    for q in sorted({*turns, *marks, *grid, *breaks}):
        segment = q in marks and q - last_mark >= SEGMENT_GAP
        step = max(spacing, last // share)
        if (
            q % chunk == 0
            or segment
            or (q in turns and q - last >= gap)
            or (q in breaks and q - last >= step and -q % chunk >= step // 2)
        ):
            out.append(q)
            last = q
            if segment:
                last_mark = q
    return out


def plan(start: int, end: int, chunk: int, starts: Sequence[int]) -> list[int]:
    """The batch boundaries of a prefill of positions ``start .. end`` (exclusive): ``start``,
    then every multiple of ``chunk`` and every turn start (``starts``, sorted) after it, ending
    with ``end``. A batch never exceeds ``chunk`` tokens, and every boundary after ``start``
    depends only on the tokens' positions and content."""
    cuts = {start, end}
    cuts.update(range((start // chunk + 1) * chunk, end, chunk))
    lo = bisect.bisect_right(starts, start)
    hi = bisect.bisect_left(starts, end)
    cuts.update(starts[lo:hi])
    return sorted(cuts)


@dataclass
class _Seq:
    """One sequence's checkpoints (position -> blob; canonical positions) and the positions its
    batches began at."""

    blobs: dict[int, bytes] = field(default_factory=dict)
    canonical: set[int] = field(default_factory=set)
    aims: list[int] = field(default_factory=list)  # where the latest cuts were asked to keep, the latest last
    bounds: list[int] = field(default_factory=list)
    ends: set[int] = field(default_factory=set)
    segments: set[int] = field(default_factory=set)  # the manifest's segment starts it was evaluated with
    floor: int = 0  # the first position whose sliding-window cells are real (Checkpoints.restore)


class Checkpoints:
    """The checkpoints of a context's sequences (see the module docstring)."""

    def __init__(
        self, ctx: Any, n_seq: int, *, spacing: int, limit: int = 8, window: bool = False, placed: bool = True
    ) -> None:
        self._ctx = ctx
        self.window = window
        """Checkpoints of a sliding window (its local layers' cells), not of a recurrent state."""
        self.placed = placed
        """A window's checkpoint goes back at the cells a fresh evaluation used (a full-size SWA
        cache); False: as llama.cpp puts it (a ring of SWA cells, ``--no-swa-full``, has room
        for the window only)."""
        self.spacing = max(1, spacing)
        self.limit = max(1, limit)
        self._seqs = [_Seq() for _ in range(n_seq)]

    # --- where -------------------------------------------------------------------------------

    def wanted(self, pos: int, marked: bool) -> bool:
        """Is a canonical checkpoint taken at batch boundary ``pos`` of a prefill (``marked``: a
        turn or segment start)?"""
        return pos > 0 and (marked or pos % self.spacing == 0)

    # --- taking and choosing -------------------------------------------------------------------

    def take(self, seq: int, pos: int, *, canonical: bool) -> int:
        """Save ``seq``'s non-cuttable state, which now covers its first ``pos`` tokens; returns
        the bytes kept (0 when llama.cpp gave nothing)."""
        s = self._seqs[seq]
        if pos in s.blobs:
            if canonical:
                s.canonical.add(pos)
            return len(s.blobs[pos])
        size = int(_llama.llama_state_seq_get_size_ext(self._ctx, seq, PARTIAL))
        if size <= 0:
            return 0
        buf = (ctypes.c_uint8 * size)()
        got = int(_llama.llama_state_seq_get_data_ext(self._ctx, buf, size, seq, PARTIAL))
        if got <= 0:
            log.warning("llama.cpp gave no checkpoint of sequence %d at token %d", seq, pos)
            return 0
        s.blobs[pos] = bytes(buf)[:got]
        if canonical:
            s.canonical.add(pos)
        self._evict(s)
        return got

    def best(self, seq: int, keep: int) -> int:
        """The position a cut to ``keep`` restores: the last checkpoint at or before it (every
        checkpoint sits where a prefill may resume: a canonical position or the end of a
        prefill); 0 when there is none."""
        return max((p for p in self._seqs[seq].blobs if p <= keep), default=0)

    def restore(self, seq: int, pos: int) -> bool:
        """Load the checkpoint at ``pos`` into ``seq`` (its non-cuttable part only). A sliding
        window's goes in at the cells a fresh evaluation used (:func:`pad_window`); its cells
        before the window hold zeros then (:meth:`floor`)."""
        s = self._seqs[seq]
        blob = s.blobs.get(pos)
        if blob is None:
            return False
        low = 0
        if self.window and self.placed:
            padded = pad_window(blob)
            if padded is None:
                log.warning("a sliding window's checkpoint of sequence %d is not in a known form", seq)
                return False
            mm, low = padded
            view = (ctypes.c_uint8 * len(mm)).from_buffer(mm)
            try:
                ok = int(_llama.llama_state_seq_set_data_ext(self._ctx, view, len(mm), seq, PARTIAL)) > 0
            finally:
                del view  # the mapping cannot close while a view exports it
                mm.close()
            if not ok:
                return False
            s.floor = low
            return True
        buf = (ctypes.c_uint8 * len(blob)).from_buffer_copy(blob)
        if int(_llama.llama_state_seq_set_data_ext(self._ctx, buf, len(blob), seq, PARTIAL)) <= 0:
            return False
        s.floor = low
        return True

    def aim(self, seq: int, keep: int) -> None:
        """A cut of ``seq`` was asked to keep ``keep`` tokens (where its prompt diverged). An
        agent's prompt tends to diverge where it did last turn (a repo map's line, a moved
        reminder): the last checkpoint at or before it is worth keeping, and after the prefill
        that follows the cut that is a new one, closer than the one the cut restored."""
        s = self._seqs[seq]
        s.aims = [*[p for p in s.aims if p != keep][-(_RECENT - 1) :], keep]

    def floor(self, seq: int) -> int:
        """The first position whose sliding-window cells ``seq`` really holds (the cells before
        a restored window's are padding)."""
        return self._seqs[seq].floor

    # --- what the sequence holds ----------------------------------------------------------------

    def batch(self, seq: int, start: int) -> None:
        """A batch of ``seq`` began at position ``start``."""
        bounds = self._seqs[seq].bounds
        if not bounds or bounds[-1] < start:
            bounds.append(start)

    def bounds(self, seq: int, start: int, end: int) -> list[int]:
        """Where the batches that evaluated positions ``start .. end`` began (with ``start`` and
        ``end``): a re-evaluation of the same tokens in the same batches."""
        bounds = self._seqs[seq].bounds
        inner = bounds[bisect.bisect_right(bounds, start) : bisect.bisect_left(bounds, end)]
        return [start, *inner, end]

    def ended(self, seq: int, end: int) -> None:
        """A prefill of ``seq`` ended at position ``end`` (a later one resumes there: the split
        between a prefix and its suffix is a batch boundary of a fresh evaluation too)."""
        self._seqs[seq].ends.add(end)

    def segments(self, seq: int) -> list[int]:
        """The manifest's segment starts ``seq``'s tokens were evaluated with."""
        return sorted(self._seqs[seq].segments)

    def mark(self, seq: int, segments: Sequence[int]) -> None:
        """``seq``'s tokens are (to be) evaluated with these segment starts."""
        self._seqs[seq].segments = set(segments)

    def is_end(self, seq: int, pos: int) -> bool:
        return pos in self._seqs[seq].ends

    def ends_before(self, seq: int, keep: int) -> int:
        """The last prefill end at or before ``keep`` (0: none)."""
        return max((p for p in self._seqs[seq].ends if p <= keep), default=0)

    def cut(self, seq: int, keep: int) -> None:
        """``seq`` holds its first ``keep`` tokens now: later checkpoints and batches are gone."""
        s = self._seqs[seq]
        for p in [p for p in s.blobs if p > keep]:
            del s.blobs[p]
            s.canonical.discard(p)
        s.ends = {p for p in s.ends if p <= keep}
        s.segments = {p for p in s.segments if p <= keep}
        del s.bounds[bisect.bisect_right(s.bounds, keep - 1) :]

    def copy(self, src: int, dst: int, n: int) -> None:
        """``dst`` holds a copy of ``src``'s first ``n`` tokens: their checkpoints too."""
        a = self._seqs[src]
        self._seqs[dst] = _Seq(
            blobs={p: b for p, b in a.blobs.items() if p <= n},
            canonical={p for p in a.canonical if p <= n},
            bounds=[p for p in a.bounds if p < n],
            ends={p for p in a.ends if p <= n},
            aims=list(a.aims),
            segments={p for p in a.segments if p <= n},
            floor=a.floor,
        )

    def clear(self, seq: int) -> None:
        self._seqs[seq] = _Seq()

    # --- in a snapshot: the checkpoints travel with their context -------------------------------

    def pack(self, seq: int, upto: int) -> bytes:
        """``seq``'s checkpoints (and recorded batches, prefill ends and segment starts) of its
        first ``upto`` tokens, as the section a snapshot carries after the engine's state:
        ``u32 count``, per checkpoint ``u32 position, u8 canonical, u32 length`` and its bytes,
        then ``u32 n`` and the batch starts, ``u32 n`` and the prefill ends, ``u32 n`` and the
        segment starts, then ``u64`` the section's length and the magic ``mdckpt02``."""
        s = self._seqs[seq]
        items = [(p, b) for p, b in sorted(s.blobs.items()) if p <= upto]
        out = bytearray(struct.pack("<I", len(items)))
        for p, b in items:
            out += _ITEM.pack(p, p in s.canonical, len(b)) + b
        for marks in (
            [p for p in s.bounds if p < upto],
            sorted(p for p in s.ends if p <= upto),
            sorted(p for p in s.segments if p <= upto),
        ):
            out += struct.pack(f"<I{len(marks)}I", len(marks), *marks)
        out += _TRAILER.pack(len(out), _MAGIC)
        return bytes(out)

    @staticmethod
    def section(view: memoryview) -> tuple[int, memoryview | None]:
        """Where a snapshot's engine state ends, and its checkpoint section (None: it has none)."""
        n = view.nbytes
        if n < _TRAILER.size or bytes(view[n - 8 :]) != _MAGIC:
            return n, None
        (length, _magic) = _TRAILER.unpack_from(view, n - _TRAILER.size)
        start = n - _TRAILER.size - length
        if length < 12 or start < 0:
            return n, None
        return start, view[start : n - _TRAILER.size]

    @staticmethod
    def read_section(path: str, size: int) -> memoryview | None:
        """The checkpoint section of the snapshot stored in the first ``size`` bytes of a file
        (None: it has none)."""
        if size < _TRAILER.size:
            return None
        with open(path, "rb") as f:
            f.seek(size - _TRAILER.size)
            length, magic = _TRAILER.unpack(f.read(_TRAILER.size))
            if magic != _MAGIC or not 12 <= length <= size - _TRAILER.size:
                return None
            f.seek(size - _TRAILER.size - length)
            return memoryview(f.read(length))

    def unpack(self, seq: int, section: memoryview, n_tokens: int) -> bool:
        """Load a snapshot's checkpoint section into ``seq`` (which holds ``n_tokens`` restored
        tokens); False, and nothing loaded, when it is not well formed."""
        got = _Seq()
        try:
            at = 0
            (count,) = struct.unpack_from("<I", section, at)
            at += 4
            for _ in range(count):
                pos, canonical, length = _ITEM.unpack_from(section, at)
                at += _ITEM.size
                if not 0 < pos <= n_tokens or at + length > section.nbytes:
                    return False
                got.blobs[pos] = bytes(section[at : at + length])
                if canonical:
                    got.canonical.add(pos)
                at += length
            marks: list[list[int]] = []
            for _ in range(3):
                (k,) = struct.unpack_from("<I", section, at)
                marks.append(list(struct.unpack_from(f"<{k}I", section, at + 4)))
                at += 4 + 4 * k
            if at != section.nbytes or any(p > n_tokens for m in marks for p in m):
                return False
        except struct.error:
            return False
        got.bounds = sorted(set(marks[0]))
        got.ends = set(marks[1]) | self._seqs[seq].ends
        got.segments = set(marks[2])
        got.floor = self._seqs[seq].floor
        got.blobs = {**got.blobs, **self._seqs[seq].blobs}
        got.canonical |= self._seqs[seq].canonical
        self._seqs[seq] = got
        self._evict(got)
        return True

    def positions(self, seq: int) -> list[int]:
        return sorted(self._seqs[seq].blobs)

    def nbytes(self) -> tuple[int, ...]:
        """The bytes each sequence's checkpoints hold, by sequence."""
        return tuple(sum(len(b) for b in s.blobs.values()) for s in self._seqs)

    def _evict(self, s: _Seq) -> None:
        """Keep ``limit`` checkpoints: drop the one whose loss widens the gap between its
        neighbours least, a segment start only when no other is left (never the newest, the
        last prompt end, the two latest segment starts: a moved reminder, the reasoning a
        template drops, diverge near the end of the last prompt; nor the last one at or before
        each of the two latest cuts' divergences: :meth:`aim`)."""
        while len(s.blobs) > self.limit:
            ps = sorted(s.blobs)
            ends = [p for p in ps if p not in s.canonical]
            latest = [p for p in ps if p in s.segments][-_RECENT:]
            aimed = [max((p for p in ps if p <= d), default=ps[0]) for d in s.aims]
            keep_last = {ps[-1], *ends[-1:], *aimed, *latest}
            gaps = [
                (ps[i] in s.segments, ps[i + 1] - (ps[i - 1] if i > 0 else 0), ps[i])
                for i in range(len(ps) - 1)
                if ps[i] not in keep_last
            ]
            if not gaps:
                gaps = [(False, 0, ps[0])]
            *_, victim = min(gaps)
            del s.blobs[victim]
            s.canonical.discard(victim)
