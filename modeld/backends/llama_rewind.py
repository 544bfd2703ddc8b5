"""Cuts and prefills of memory that cannot be cut at any token (engine-worker side).

The part of :class:`~modeld.backends.llama_context.LlamaContext` that recurrent, hybrid and
sliding-window models need (the checkpoints themselves: :mod:`modeld.backends.llama_checkpoints`):

* :meth:`Rewind._rewind` goes back as far as a cut must: for sliding-window attention to a
  position whose window the cache still holds (llama-server's rule: ``seq_pos_min <= keep -
  n_swa``), else (recurrent and hybrid memory; a sliding window restored from a snapshot, which
  holds only the last window) to the last checkpoint at or before it;
* :meth:`Rewind._sync_planned` evaluates what lies after it in batches that begin at positions
  that depend only on the tokens and the manifest's segment starts (multiples of the
  micro-batch, turn starts, segment starts, the end of the previous prefill when the new tokens
  begin there), taking checkpoints on the way: a warm turn's numbers are then a fresh
  evaluation's, bit for bit (blueprint 0016, "Checkpoints");
* :meth:`Rewind._fresh_logits` gives fresh logits for a sequence's last token: the ones its
  prefill kept when the sequence holds exactly the tokens that prefill ended on, else
  (:meth:`Rewind._replay_last`) by evaluating its last batch again as it was first evaluated: a
  repeated prompt answers, and answers the same.
"""

from __future__ import annotations

import ctypes
import itertools
import logging
from collections.abc import Iterator, Sequence
from typing import Any

import numpy as np

from modeld.backends._llama_lib import bindings as _llama
from modeld.backends.base import SyncStep
from modeld.backends.llama_checkpoints import Checkpoints, canonical, plan
from modeld.errors import EngineError

__all__ = ["Rewind"]

log = logging.getLogger("modeld.llama")


class Rewind:
    """Cuts and prefills of memory that cannot be cut at any token (a mixin of the context)."""

    _seqs: list[list[int]]
    _ckpts: Checkpoints
    _planned: bool
    _starts: frozenset[int]
    _lines: frozenset[int]
    _takes: bool
    _n_swa: int
    _chunk: int
    _fresh: int
    _mem: Any
    _vocab: Any
    _n_vocab: int
    _bos: int
    _ctx: Any
    # Per sequence: the tokens a prefill ended on and its last token's logits, as evaluated.
    _kept: dict[int, tuple[list[int], np.ndarray]]

    def _cut(self, seq: int, keep: int) -> int:
        raise NotImplementedError

    def _decode(self, seq: int, tokens: list[int], outputs: int = 1) -> None:
        raise NotImplementedError

    def _seq(self, seq: int) -> list[int]:
        raise NotImplementedError

    def _turn_starts(self) -> frozenset[int]:
        """Control tokens that do not end generation (BOS aside): where a chat's turns start."""
        control = _llama.LLAMA_TOKEN_ATTR_CONTROL
        return frozenset(
            t
            for t in range(self._n_vocab)
            if t != self._bos
            and int(_llama.llama_vocab_get_attr(self._vocab, t)) & control
            and not _llama.llama_vocab_is_eog(self._vocab, t)
        )

    def _line_ends(self) -> frozenset[int]:
        """Tokens whose text holds a newline: the position after one is a line start."""
        out = set()
        buf = ctypes.create_string_buffer(256)
        for t in range(self._n_vocab):
            n = int(_llama.llama_token_to_piece(self._vocab, t, buf, len(buf), 0, False))
            if n > 0 and b"\n" in buf.raw[:n]:
                out.add(t)
        return frozenset(out)

    def _rewind(self, seq: int, keep: int, *, exact: bool = False) -> int:
        """Make ``seq`` hold its first ``p <= keep`` tokens, ``p`` as large as the memory allows
        (0 < keep < len): a checkpoint at or before ``keep``, or, for sliding-window attention,
        ``keep`` itself (``exact``, or where a prefill resumes: a canonical position or a
        prefill's end) while the cache still holds the window before it. Returns ``p``."""
        ckpts = self._ckpts
        held = self._seqs[seq]
        if self._fresh == seq:
            self._fresh = -1
        ckpts.aim(seq, keep)
        p = 0
        window = False
        if self._n_swa:
            p = keep if exact or self._resumes(seq, keep) else self._resume_before(seq, keep)
            low = max(int(_llama.llama_memory_seq_pos_min(self._mem, seq)), ckpts.floor(seq))
            if low > p - self._n_swa:
                p = 0  # the window before p is gone from the cache (restored from a snapshot)
            window = p > 0
        if not p and self._takes:
            # A checkpoint: the recurrent state, or the sliding window's cells, at a position.
            p = ckpts.best(seq, keep)
            if p and not ckpts.restore(seq, p):
                log.warning("llama.cpp refused checkpoint %d of sequence %d; emptying it", p, seq)
                p = 0
        if p and not _llama.llama_memory_seq_rm(self._mem, seq, p, -1):
            log.warning("llama.cpp refused to cut sequence %d at token %d; emptying it", seq, p)
            p = 0
        if not p:
            _llama.llama_memory_seq_rm(self._mem, seq, -1, -1)
        del held[p:]
        if p:
            ckpts.cut(seq, p)
        else:
            ckpts.clear(seq)
        if window and self._takes and not exact:
            # The window where this edit went back to, as a prefill there would have taken it:
            # the context's snapshot carries it, so the next edit here after a restart (which
            # restores only the last window) goes back no further than this one did.
            ckpts.take(seq, p, canonical=not ckpts.is_end(seq, p))
        return p

    def _marks(self, tokens: Sequence[int], segments: Sequence[int]) -> list[int]:
        """The canonical positions of ``tokens`` evaluated with the manifest's segment starts
        ``segments`` (:func:`~modeld.backends.llama_checkpoints.canonical`)."""
        return canonical(tokens, self._chunk, self._starts, segments=segments, lines=self._lines)

    def _resumes(self, seq: int, pos: int) -> bool:
        """May a prefill of ``seq`` resume at ``pos`` with a fresh evaluation's batches?"""
        held = self._seqs[seq]
        marks = self._marks(held[: pos + 1], self._ckpts.segments(seq))
        return pos in marks or self._ckpts.is_end(seq, pos)

    def _resume_before(self, seq: int, keep: int) -> int:
        """The last position at or before ``keep`` where a prefill may resume."""
        marks = self._marks(self._seqs[seq][: keep + 1], self._ckpts.segments(seq))
        return max(max(marks, default=0), self._ckpts.ends_before(seq, keep))

    def _sync_planned(
        self, seq: int, keep: int, tokens: Sequence[int], segments: Sequence[int] | None = None
    ) -> Iterator[SyncStep]:
        """:meth:`sync` on memory that cannot be cut at any token: back to what the memory
        allows, then every token after it in batches that begin at canonical positions (and at
        ``keep`` when a prefill ended there: a prefix's end, where its suffix begins).
        ``segments``: the manifest's segment starts over the whole target (None: the tokens
        kept are re-evaluated with the segment starts they were first evaluated with, and
        ``tokens`` with none). The kept tokens keep the segment starts they were evaluated with
        (the same as the manifest's where its text is the same)."""
        ckpts = self._ckpts
        held = self._seqs[seq]
        before = ckpts.segments(seq)
        after = sorted({p for p in segments or () if p > keep})
        known = held[:keep]
        resumes = ckpts.is_end(seq, keep)
        kept = keep if keep >= len(held) else self._rewind(seq, keep)
        ckpts.mark(seq, [p for p in before if p <= keep] + after)
        pending = known[kept:] + list(tokens)
        start, end = kept, kept + len(pending)
        yield SyncStep(kept, 0, len(pending))
        if not pending:
            return
        marks = [m for m in self._marks(held[:start] + pending, ckpts.segments(seq)) if start < m < end]
        turn = set(marks)
        if resumes and start < keep < end:
            marks = sorted({*marks, keep})
        bounds = plan(start, end, self._chunk, marks)
        for a, b in itertools.pairwise(bounds):
            self._decode(seq, pending[a - start : b - start])
            if b < end and self._takes and ckpts.wanted(b, b in turn):
                ckpts.take(seq, b, canonical=True)
            yield SyncStep(kept, b - start, len(pending))
        ckpts.ended(seq, end)
        if self._takes:
            ckpts.take(seq, end, canonical=False)

    def _fresh_logits(self, seq: int) -> list[int]:
        """``seq``'s tokens, with its last token's logits in the context: the ones its prefill
        kept when it holds the tokens that prefill ended on, else its last batch evaluated
        again."""
        held = self._seq(seq)
        if not held:
            raise EngineError("nothing resident to decode from")
        if self._fresh != seq and not self._kept_logits(seq, held):
            self._replay_last(seq)
        return held

    def _keep_logits(self, seq: int) -> None:
        """A prefill ended on ``seq``: keep its last token's logits, the bits this evaluation
        gave. A decode from exactly these tokens later (a repeated prompt, a retry, a
        regeneration, the same prompt after another sequence's turn) reads them instead of
        evaluating the last batch again (two tokens over every cell on attention models; on
        hybrid and recurrent ones the last batch from its checkpoint, tens of tokens). One
        vocabulary's floats a sequence."""
        if self._fresh != seq:
            return  # nothing evaluated: what was kept stands (checked against the tokens when read)
        row = _llama.llama_get_logits_ith(self._ctx, -1)
        if not row:
            self._kept.pop(seq, None)
            return
        logits = np.ctypeslib.as_array(row, shape=(self._n_vocab,)).copy()
        self._kept[seq] = (list(self._seqs[seq]), logits)

    def _kept_logits(self, seq: int, held: list[int]) -> bool:
        """Put the logits ``seq``'s prefill kept into the context's buffer (where a sampler reads
        the last evaluated row) when ``seq`` holds the tokens they were kept for."""
        kept = self._kept.get(seq)
        if kept is None or kept[0] != held:
            return False
        row = _llama.llama_get_logits_ith(self._ctx, -1)
        if not row:
            return False
        np.ctypeslib.as_array(row, shape=(self._n_vocab,))[:] = kept[1]
        self._fresh = seq
        return True

    def _inherit_logits(self, src: int, dst: int) -> None:
        """``dst`` was copied from ``src``: when it holds exactly the tokens ``src``'s kept
        logits follow, they are its logits too: a new session sending a prompt another context
        holds, as every run of an agent does, starts without a replay (py-spy on the worker put
        it at ~13 ms of a 20k-token request on the tiny model; end to end within the noise)."""
        kept = self._kept.get(src)
        if kept is not None and kept[0] == self._seqs[dst]:
            self._kept[dst] = kept  # never written in place: shared safely

    def _replay_last(self, seq: int) -> None:
        """Fresh logits for ``seq``'s last token: back to where its last batch began (or, on
        memory that cannot be cut there, the checkpoint before it), then its tokens again in the
        batches that first evaluated them, so the logits are the bits the first evaluation had (a
        repeated prompt answers as it did the first time: on these architectures re-evaluating
        only the last two tokens of a longer batch differs in the last bits). Where the batches
        are not known (a sequence restored from a snapshot), batches that begin where a fresh
        evaluation's do. Memory that can be cut re-evaluates its last two tokens."""
        ckpts = self._ckpts
        held = self._seqs[seq]
        tokens = list(held)
        n = len(tokens)
        marks = ckpts.bounds(seq, 0, n)
        last = max(m for m in marks if m <= n - 1)
        if not self._planned:
            # Attention models of llama's shape give the same bits for any batch of 2 or more
            # (blueprint 0009): the last two tokens, not the whole last batch.
            p = self._cut(seq, max(0, n - 2))
            marks = [p, n]
        else:
            p = self._rewind(seq, last, exact=True) if last > 0 else self._cut(seq, 0)
        redo = [p, *[m for m in marks if p < m < n], n]
        # The batches first evaluated, as they were (none spans a canonical position); where none
        # are known (restored from a snapshot), a fresh evaluation's.
        canon = self._marks(tokens, ckpts.segments(seq)) if self._planned else []
        for a, b in itertools.pairwise(redo):
            inner = [m for m in canon if a < m < b]
            for c, d in itertools.pairwise(plan(a, b, self._chunk, inner)):
                self._decode(seq, tokens[c:d])
