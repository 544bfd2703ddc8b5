"""One llama.cpp context with several warm sequences (engine-worker side): the runtime's core.

One llama.cpp context holds ``n_seq`` sequences (``n_seq_max``). modeld drives the KV cache
directly: ``sync`` cuts a sequence with ``llama_memory_seq_rm`` and evaluates only the
divergent tail; ``copy`` shares a prefix between sequences; ``snapshot`` / ``restore`` move a
sequence's state in and out (the format: :mod:`modeld.backends.llama_state`). The decode jobs
(plain, speculative, ``n`` choices) are :class:`~modeld.backends.llama_runtime.LlamaRuntime`'s,
built on this class's batches. Design records: ``blueprints/0009-llama-backend.md`` and
``blueprints/0016-warm-state.md``. The points that matter for correctness:

* **Two KV layouts.** *Unified* (``kv_unified``, the default: one pool of one window): every
  sequence may fill the pool; a copy only tags the shared cells, so a prefix shared by
  sub-agents is stored once, but a sequence's cells land wherever the pool has room, and when
  other sequences hold cells attention sums in another order: logits differ from a fresh
  evaluation (measured in blueprint 0016; a sequence alone in the pool is bit-identical).
  *Split*: every sequence has its own stream of ``window`` cells, so a sequence's tokens sit at
  the cells a fresh context would use and warm output is bit-identical to a fresh evaluation; a
  copy is a state copy (get, set, cut).
* **Numerics of batches.** A *single-token* batch takes another kernel path (~1e-3 relative
  difference); prefill never evaluates a lone token when it can avoid it: a 1-token remainder
  borrows a token from the previous batch, and a 1-token tail re-evaluates the token before it.
* **Memory that cannot be cut at any token** (recurrent, hybrid, sliding-window models):
  ``can_truncate`` is False and ``Layout.checkpoints`` True. A cut goes back as far as it must:
  to the last checkpoint at or before it (recurrent and hybrid memory,
  :mod:`modeld.backends.llama_checkpoints`), or, for sliding-window attention, to a position
  whose window the cache still holds (llama-server's rule, ``seq_pos_min <= keep - n_swa``);
  ``sync`` then evaluates the tokens between and reports what it kept. Their prefills start
  batches at positions that depend only on the tokens, so a warm turn's numbers are a fresh
  evaluation's. If ``llama_memory_seq_rm`` refuses a cut anyway, the sequence is emptied.
* **Restores are verified**: llama.cpp returning 0 empties the sequence; a restore whose
  position range does not match the tokens it claims is undone (llama.cpp #26676).
"""

from __future__ import annotations

import ctypes
import logging
import os
import threading
import typing
from collections.abc import Iterator, Sequence
from typing import Any

import numpy as np

from modeld.backends import _llama_lib
from modeld.backends._llama_lib import bindings as _llama
from modeld.backends.base import (
    HeldTokens,
    Layout,
    LoadOptions,
    SyncStep,
    Vocab,
    default_batch,
    micro_batch,
    swa_ring_cells,
)
from modeld.backends.cpu import cpu_has_amx
from modeld.backends.gguf_meta import GGUFInfo
from modeld.backends.llama_checkpoints import PARTIAL, Checkpoints
from modeld.backends.llama_constraints import LlamaConstraints
from modeld.backends.llama_rewind import Rewind
from modeld.backends.llama_state import SeqStates
from modeld.backends.llama_step import Step
from modeld.contract import Config, DecodeConfig, ModelInfo
from modeld.decoding.speculation import DecodeStats, Drafter
from modeld.errors import EngineError, InvalidArgumentError, ModelLoadError, UnsupportedError

__all__ = ["LlamaContext", "chunk_sizes", "micro_batch"]

log = logging.getLogger("modeld.llama")

_GGML_TYPES = {"f32": 0, "f16": 1, "q4_0": 2, "q8_0": 8, "bf16": 30}
_GGML_LOG_INFO = 2
_GGML_LOG_WARN = 3
_GGML_LOG_ERROR = 4

CHECKPOINT_BATCHES = 1
"""Checkpoints of recurrent and hybrid memory are taken every this many micro-batches of a
prefill (besides turn starts and prompt ends): a divergence anywhere recomputes at most that
while they are all kept (``--checkpoints`` keeps the most valuable ones)."""

_init_lock = threading.Lock()
_initialized = False


def _log(level: int, text: bytes | None, _data: Any) -> None:
    """llama.cpp's log lines go to the worker's log (its ring buffer in the daemon): warnings and
    errors at WARNING, information (what it loaded, how) at INFO, the rest at DEBUG."""
    if text:
        message = text.decode("utf-8", errors="replace").rstrip()
        if message:
            if level in (_GGML_LOG_WARN, _GGML_LOG_ERROR):
                log.warning("%s", message)
            else:
                log.log(logging.INFO if level == _GGML_LOG_INFO else logging.DEBUG, "%s", message)


_log_callback: Any = ctypes.CFUNCTYPE(None, ctypes.c_int, ctypes.c_char_p, ctypes.c_void_p)(_log)
"""Module-level: llama.cpp keeps the pointer, so the callback object must never be collected."""


def _init() -> None:
    global _initialized
    with _init_lock:
        if not _initialized:
            _llama.llama_log_set(_log_callback, ctypes.c_void_p(0))
            _llama.llama_backend_init()
            _initialized = True


def _threads(requested: int) -> int:
    if requested > 0:
        return requested
    try:
        return max(1, len(os.sched_getaffinity(0)))
    except AttributeError:  # pragma: no cover - not Linux
        return max(1, os.cpu_count() or 1)


def chunk_sizes(n: int, batch: int) -> list[int]:
    """Split ``n`` tokens into batches of at most ``batch``, never leaving a 1-token last batch.

    A lone token in a batch is computed by a different kernel than the same token inside a
    larger batch; moving one token from the previous batch keeps every prefill batch >= 2 tokens
    (when ``n >= 2`` and ``batch >= 2``), so where a prefill starts does not change its numbers.
    """
    if n <= 0:
        return []
    sizes = [batch] * (n // batch)
    if n % batch:
        sizes.append(n % batch)
    if len(sizes) >= 2 and sizes[-1] == 1 and batch >= 3:
        sizes[-2] -= 1
        sizes[-1] = 2
    return sizes


class LlamaContext(HeldTokens, Rewind):
    """One llama.cpp model and context with ``n_seq`` sequences: their tokens, cells and batches."""

    def __init__(self, info: ModelInfo, meta: GGUFInfo, config: Config, options: LoadOptions) -> None:
        _init()
        self._info = info
        self._meta = meta
        self._config = config
        self._model: Any = None
        self._ctx: Any = None
        self._batch: Any = None
        self._split: Any = None
        if config.num_gpu_layers > 0 and not _llama.llama_supports_gpu_offload():
            raise UnsupportedError(
                "num_gpu_layers offloads layers to a GPU; this llama.cpp build has no GPU offload",
                field="config.num_gpu_layers",
            )
        if config.tensor_split and not _llama.llama_supports_gpu_offload():
            raise UnsupportedError(
                "tensor_split splits layers across GPUs; this llama.cpp build has no GPU offload",
                field="config.tensor_split",
            )
        self._load_model()
        self._vocab = _llama.llama_model_get_vocab(self._model)
        self._n_vocab = int(_llama.llama_vocab_n_tokens(self._vocab))
        self._bos = int(_llama.llama_vocab_bos(self._vocab))
        recurrent = bool(_llama.llama_model_is_recurrent(self._model))
        hybrid = bool(_llama.llama_model_is_hybrid(self._model))
        swa = int(_llama.llama_model_n_swa(self._model))
        can_truncate = meta.can_truncate and not (recurrent or hybrid or swa > 0)
        n_seq = max(1, options.n_seq)
        unified = options.unified and not recurrent
        n_ctx = max(options.pool_tokens, options.window) if unified else n_seq * options.window
        self._chunk = micro_batch(default_batch(config, meta.memory), n_seq)
        # A ring of SWA cells (--no-swa-full) only where the model has sliding-window layers.
        self._swa_ring = swa > 0 and not (recurrent or hybrid) and not options.swa_full
        self._create_context(n_ctx, n_seq, unified, _threads(options.threads))
        total = int(_llama.llama_n_ctx(self._ctx))
        window = min(options.window, total) if unified else min(options.window, total // n_seq)
        # A sequence's blob lists every stream of its context (empty ones as a zero cell count;
        # a unified pool has one stream). Stored as its own cells followed by empty streams, it
        # fits a context with any number of streams, split or unified: changing --sequences or
        # --kv-unified (or the memory budget doing it) keeps the disk tier usable. The format
        # string names that blob format ("split", as written before the unified default).
        self._unified = unified
        self._portable = not (recurrent or hybrid or swa > 0)
        self._n_stream = 1 if unified else n_seq
        # Memory that cannot be cut takes checkpoints (the recurrent state, or the sliding
        # window's cells: a snapshot holds only the last window, its checkpoints the earlier ones).
        takes = (recurrent or hybrid or swa > 0) and options.checkpoints > 0
        if recurrent:
            layout_name = "recurrent"
        elif self._portable:
            layout_name = "split"
        elif unified:
            layout_name = "unified"
        else:
            layout_name = f"split/{n_seq}"
        if self._swa_ring:
            layout_name += "+swa-ring"  # its snapshots hold a ring's cells: never mixed with full ones
        self._layout = Layout(
            n_seq=n_seq,
            window=window,
            pool_tokens=total,
            shared_cells=unified,
            can_truncate=can_truncate,
            snapshots=True,
            explicit=True,
            snapshot_format=f"llama.cpp {_llama_lib.version()} {layout_name}"
            + ("+checkpoints2" if takes else ""),
            kv_bytes_per_token=info.kv_bytes_per_token,
            exact=not unified,
            name=f"unified/{n_seq}:{total}" if unified else f"split/{n_seq}",
            forks=can_truncate and n_seq > 1,
            attention_spans_pool=unified and n_seq > 1,
            checkpoints=not can_truncate,
            snapshot_cuts=takes,
            state_bytes=meta.state_bytes if recurrent or hybrid else 0,
            checkpoint_limit=options.checkpoints if takes else 0,
            # A window's checkpoint: at most the window's tokens of every layer's KV (only the
            # local layers' are saved; sizing.checkpoint_size counts it the same way).
            checkpoint_bytes=meta.state_bytes
            if recurrent or hybrid
            else swa * max(0, info.kv_bytes_per_token),
            memory="recurrent"
            if recurrent
            else "hybrid"
            if hybrid
            else "sliding-window"
            if swa
            else "attention",
            swa_ring_cells=swa_ring_cells(
                swa, n_seq, self._chunk, unified=unified, cells=total if unified else total // n_seq
            )
            if self._swa_ring
            else 0,
            swa_kv_bytes_per_token=info.footprint.swa_kv_bytes_per_token,
        )
        self._seqs: list[list[int]] = [[] for _ in range(n_seq)]
        # Memory that cannot be cut at any token: batches at canonical positions, cuts back to
        # a checkpoint (recurrent, hybrid) or to a window the cache still holds (SWA).
        self._n_swa = swa if not (recurrent or hybrid) else 0
        self._takes = takes
        self._planned = not can_truncate
        # Every sequence's batches are recorded (a repeated prompt replays its last batch); only
        # non-cuttable memory takes checkpoints.
        spacing = CHECKPOINT_BATCHES * self._chunk
        self._ckpts = Checkpoints(
            self._ctx,
            n_seq,
            spacing=spacing,
            limit=options.checkpoints,
            window=self._n_swa > 0,
            placed=not self._swa_ring,
        )
        self._starts = self._turn_starts() if self._planned else frozenset()
        self._lines = self._line_ends() if self._planned else frozenset()
        self._states = SeqStates(
            self._ctx, portable=self._portable, unified=unified, n_stream=self._n_stream, path=meta.path
        )
        self._stats = [DecodeStats() for _ in range(n_seq)]
        self._drafters: dict[int, Drafter] = {}  # per sequence: its history's n-gram index
        self._fresh = -1  # the sequence whose last token's logits are in the context, or -1
        # Per sequence: the tokens a prefill ended on and its last token's logits, as evaluated.
        self._kept: dict[int, tuple[list[int], np.ndarray]] = {}
        self._pieces: tuple[bytes, ...] | None = None
        self._constraints: LlamaConstraints | None = None  # made on the first constrained decode

    # --- loading ----------------------------------------------------------------------------

    def _load_model(self) -> None:
        params = _llama.llama_model_default_params()
        params.n_gpu_layers = self._config.num_gpu_layers
        params.use_mmap = True
        if cpu_has_amx():
            log.info("the CPU has AMX: loading without llama.cpp's extra buffer types (AMX crashes here)")
            params.use_extra_bufts = False
        if self._config.tensor_split:
            split = self._config.tensor_split
            self._split = (ctypes.c_float * len(split))(*split)  # kept alive
            params.tensor_split = self._split
        model = _llama.llama_model_load_from_file(self._meta.path.encode(), params)
        if not model:
            raise ModelLoadError(
                f"llama.cpp could not load {self._meta.path!r} (see the worker log)", path=self._meta.path
            )
        self._model = model

    def _create_context(self, n_ctx: int, n_seq: int, unified: bool, threads: int) -> None:
        config = self._config
        params = _llama.llama_context_default_params()
        params.n_ctx = n_ctx
        # modeld feeds llama.cpp at most this many tokens per decode, one micro-batch each.
        params.n_batch = params.n_ubatch = self._chunk
        params.n_seq_max = n_seq
        params.kv_unified = unified
        params.swa_full = not self._swa_ring
        params.n_threads = threads
        params.n_threads_batch = threads
        params.type_k = _GGML_TYPES[config.kv_cache_type]
        params.type_v = _GGML_TYPES[config.kv_cache_type]
        params.flash_attn_type = (
            _llama.LLAMA_FLASH_ATTN_TYPE_ENABLED
            if config.flash_attn
            else _llama.LLAMA_FLASH_ATTN_TYPE_DISABLED
        )
        params.no_perf = True
        ctx = _llama.llama_init_from_model(self._model, params)
        if not ctx:
            raise ModelLoadError(
                f"llama.cpp could not create a {n_ctx}-token context with {n_seq} sequences for "
                f"{self._meta.path!r} (kv {config.kv_cache_type}, batch {self._chunk}; see the worker log)",
                path=self._meta.path,
            )
        self._ctx = ctx
        self._mem = _llama.llama_get_memory(ctx)
        self._batch = _llama.llama_batch_init(max(2, self._chunk), 0, 1)

    # --- ModelRuntime -------------------------------------------------------------------------

    @property
    def layout(self) -> Layout:
        return self._layout

    def vocab(self) -> Vocab:
        if self._pieces is None:
            self._pieces = tuple(self._piece(t) for t in range(self._n_vocab))
        eog = frozenset(t for t in range(self._n_vocab) if _llama.llama_vocab_is_eog(self._vocab, t))
        return Vocab(pieces=self._pieces, eog=eog, bos=self._bos)

    def _piece(self, token: int) -> bytes:
        buf = ctypes.create_string_buffer(64)
        n = _llama.llama_token_to_piece(self._vocab, token, buf, len(buf), 0, True)
        if n < 0:
            buf = ctypes.create_string_buffer(-n)
            n = _llama.llama_token_to_piece(self._vocab, token, buf, len(buf), 0, True)
        return buf.raw[: max(0, n)]

    def tokenize(self, text: str, *, add_bos: bool) -> list[int]:
        data = text.encode("utf-8")
        capacity = len(data) + 8
        buf = (_llama.llama_token * capacity)()
        n = _llama.llama_tokenize(self._vocab, data, len(data), buf, capacity, False, True)
        if n < 0:  # pragma: no cover - a token is never shorter than a byte
            capacity = -n
            buf = (_llama.llama_token * capacity)()
            n = _llama.llama_tokenize(self._vocab, data, len(data), buf, capacity, False, True)
        tokens = list(buf[:n])
        if add_bos and self._bos >= 0:
            tokens.insert(0, self._bos)
        return tokens

    def _cut(self, seq: int, keep: int) -> int:
        """Drop ``seq``'s tokens after the first ``keep``; returns how many it kept."""
        held = self._seq(seq)
        kept = self._kept.get(seq)
        if kept is not None and keep < len(kept[0]):
            del self._kept[seq]  # the token those logits follow goes
        if keep >= len(held):
            return len(held)
        if self._fresh == seq:
            self._fresh = -1
        if keep <= 0:
            _llama.llama_memory_seq_rm(self._mem, seq, -1, -1)
            held.clear()
            self._ckpts.clear(seq)
            return 0
        if self._planned:
            return self._rewind(seq, keep, exact=True)
        if _llama.llama_memory_seq_rm(self._mem, seq, keep, -1):
            del held[keep:]
            self._ckpts.cut(seq, keep)
            return keep
        log.warning("llama.cpp refused to cut sequence %d at token %d; emptying it", seq, keep)
        _llama.llama_memory_seq_rm(self._mem, seq, -1, -1)
        held.clear()
        return 0

    def sync(
        self, seq: int, keep: int, tokens: Sequence[int], segments: Sequence[int] | None = None
    ) -> Iterator[SyncStep]:
        held = self._seq(seq)
        if keep > len(held):
            raise EngineError(f"sequence {seq} holds {len(held)} tokens; asked to keep {keep}")
        if keep + len(tokens) > self._layout.window:
            raise InvalidArgumentError("tokens exceed the context window", field="tokens")
        if self._planned:
            yield from self._sync_planned(seq, keep, tokens, segments)
            self._keep_logits(seq)
            return
        kept = self._cut(seq, keep)
        total = len(tokens)
        yield SyncStep(kept, 0, total)
        if kept < keep:
            return  # the daemon evaluates everything after what was kept
        pending = list(tokens)
        if len(pending) == 1 and held and self._layout.can_truncate:
            # A lone token would take the single-token kernel: evaluate it with its predecessor.
            back = held[-1]
            self._cut(seq, len(held) - 1)
            pending.insert(0, back)
        done = 0
        for size in chunk_sizes(len(pending), self._chunk):
            self._decode(seq, pending[:size])
            del pending[:size]
            done = total - len(pending)
            yield SyncStep(kept, min(done, total), total)
        self._keep_logits(seq)

    def _decode_choices(self, items: list[tuple[int, int]]) -> None:
        """Evaluate one token after what each of several sequences holds, in one batch, with
        logits for every token (batch index ``j`` is ``items[j]``'s)."""
        batch = self._batch
        for j, (seq, token) in enumerate(items):
            batch.token[j] = token
            batch.pos[j] = len(self._seqs[seq])
            batch.n_seq_id[j] = 1
            batch.seq_id[j][0] = seq
            batch.logits[j] = 1
        batch.n_tokens = len(items)
        rc = _llama.llama_decode(self._ctx, batch)
        if rc != 0:
            self._fresh = -1
            for seq, _token in items:
                held = self._seqs[seq]
                kept = int(_llama.llama_memory_seq_pos_max(self._mem, seq)) + 1
                del held[max(0, kept) :]
            raise EngineError(f"llama_decode failed with code {rc} on a batch of {len(items)} choices")
        for seq, token in items:
            self._seqs[seq].append(token)
        self._fresh = -1

    def copy(self, src: int, dst: int, n: int) -> None:
        self._copy(src, dst, n)
        self._inherit_logits(src, dst)

    def _copy(self, src: int, dst: int, n: int) -> None:
        source = self._seq(src)
        self._seq(dst)
        self._drafters.pop(dst, None)  # another context's text: nothing to recall from
        n = min(n, len(source))
        self._cut(dst, 0)
        if n == 0:
            return
        if self._planned:
            # The whole sequence (a unified pool tags the attention cells and copies the recurrent
            # state), its checkpoints with it; then back to n as a sync would go.
            if self._layout.shared_cells:
                _llama.llama_memory_seq_cp(self._mem, src, dst, -1, -1)
                if self._swa_ring:
                    self._own_window(src, dst)
                self._seqs[dst] = list(source)
            elif not self._states.restore(dst, self.snapshot(src)):
                raise EngineError(f"llama.cpp could not copy sequence {src} into {dst}")
            else:
                self._seqs[dst] = list(source)
            self._ckpts.copy(src, dst, len(source))
            for _ in self._sync_planned(dst, n, ()):
                pass
            return
        if self._layout.shared_cells:
            _llama.llama_memory_seq_cp(self._mem, src, dst, 0, n)  # tags the cells: no data copy
            self._seqs[dst] = source[:n]
            self._ckpts.copy(src, dst, n)
            return
        # Separate streams: copy the state (exact cells), then cut it to n.
        blob = self.snapshot(src)
        if not self.restore(dst, blob, source):
            raise EngineError(f"llama.cpp could not copy sequence {src} into {dst}")
        self._cut(dst, n)

    def share(self, src: int, dst: int, n: int) -> bool:
        source, held = self._seq(src), self._seq(dst)
        if not (self._layout.shared_cells and self._layout.can_truncate):
            return False
        if not 0 < n <= min(len(source), len(held)) or source[:n] != held[:n]:
            return False
        # dst's own cells for positions 0..n-1 go; src's cells of the same tokens are tagged
        # for dst instead (no data copy): llama.cpp frees a cell once no sequence holds it.
        if not _llama.llama_memory_seq_rm(self._mem, dst, 0, n):
            return False
        _llama.llama_memory_seq_cp(self._mem, src, dst, 0, n)
        return True

    def _own_window(self, src: int, dst: int) -> None:
        """Give ``dst``, which shares every cell of ``src`` (``llama_memory_seq_cp``), cells of its
        own in a ring of SWA cells: src's window (its partial state) written for dst, which
        takes dst's tag off the shared SWA cells. A ring reuses a cell outside a window only
        when one sequence holds it, so shared cells stayed taken and the next batch found no
        cell (``llama_decode`` code 1, measured on the generated gemma3: blueprint 0016)."""
        size = int(_llama.llama_state_seq_get_size_ext(self._ctx, src, PARTIAL))
        buf = (ctypes.c_uint8 * max(1, size))()
        got = int(_llama.llama_state_seq_get_data_ext(self._ctx, buf, size, src, PARTIAL)) if size > 0 else 0
        if got <= 0 or int(_llama.llama_state_seq_set_data_ext(self._ctx, buf, got, dst, PARTIAL)) <= 0:
            _llama.llama_memory_seq_rm(self._mem, dst, -1, -1)
            raise EngineError(f"llama.cpp could not copy sequence {src}'s window into {dst}")

    def drop(self, seq: int) -> None:
        self._cut(seq, 0)
        self._drafters.pop(seq, None)  # the sequence's next text is another context's

    def checkpoint_bytes(self) -> tuple[int, ...]:
        return self._ckpts.nbytes()

    # --- snapshots (the format: llama_state.py) -------------------------------------------------

    def snapshot(self, seq: int) -> bytes:
        held = self._seq(seq)
        blob = self._states.snapshot(seq)
        if not self._takes:
            return blob
        # Memory that cannot be cut: the checkpoints travel with their context (a section
        # after the engine's state), so a restored context can still be cut back.
        section = self._ckpts.pack(seq, len(held))
        if isinstance(blob, bytearray):
            blob.extend(section)  # the state is tens of megabytes: no second copy
            return typing.cast(bytes, blob)
        return blob + section

    def save(self, seq: int, path: str) -> int:
        """Write ``seq``'s snapshot into a new file at ``path``; returns its size. Raises
        ``OSError`` when the file cannot be written."""
        held = self._seq(seq)
        size = self._states.save(seq, path)
        if self._takes:
            section = self._ckpts.pack(seq, len(held))
            with open(path, "ab") as f:
                f.write(section)
            size += len(section)
        return size

    def restore(self, seq: int, blob: bytes | bytearray | memoryview, tokens: Sequence[int]) -> bool:
        held = self._seq(seq)
        self._cut(seq, 0)
        self._drafters.pop(seq, None)
        if len(tokens) > self._layout.window:
            return False
        view = memoryview(blob)
        end, section = Checkpoints.section(view) if self._takes else (view.nbytes, None)
        if not (self._states.restore(seq, view[:end]) and self._restored(seq, held, tokens)):
            return False
        if section is not None and not self._ckpts.unpack(seq, section, len(tokens)):
            log.warning("a snapshot of sequence %d carried checkpoints in an unknown form: ignored", seq)
        return True

    def restore_file(self, seq: int, path: str, size: int, tokens: Sequence[int]) -> bool:
        """Load the snapshot stored in the first ``size`` bytes of the file at ``path``
        (verified by the caller)."""
        held = self._seq(seq)
        self._cut(seq, 0)
        self._drafters.pop(seq, None)
        if len(tokens) > self._layout.window:
            return False
        section = Checkpoints.read_section(path, size) if self._takes else None
        if not (self._states.restore_file(seq, path, size) and self._restored(seq, held, tokens)):
            return False
        if section is not None and not self._ckpts.unpack(seq, memoryview(section), len(tokens)):
            log.warning("a snapshot file of sequence %d carried checkpoints in an unknown form: ignored", seq)
        return True

    def _restored(self, seq: int, held: list[int], tokens: Sequence[int]) -> bool:
        """llama.cpp loaded a snapshot into ``seq``: does it hold the positions ``tokens`` claims?
        (Memory that cannot be cut keeps a checkpoint where the snapshot ends: a later cut back
        to it restores it.)"""
        lo = int(_llama.llama_memory_seq_pos_min(self._mem, seq))
        hi = int(_llama.llama_memory_seq_pos_max(self._mem, seq))
        # A KV cache holds every position; recurrent memory one state, at the last position.
        if hi != len(tokens) - 1 or (lo != 0 and self._layout.can_truncate):
            log.warning(
                "a restored sequence holds positions %d..%d, not 0..%d: refusing it", lo, hi, len(tokens) - 1
            )
            _llama.llama_memory_seq_rm(self._mem, seq, -1, -1)
            return False
        held.extend(tokens)
        self._ckpts.clear(seq)  # the batches that computed it are not known
        self._ckpts.ended(seq, len(tokens))
        if self._takes:
            self._ckpts.take(seq, len(tokens), canonical=False)
            # A sliding window comes back at cell 0 on; put it where a fresh evaluation holds it
            # (llama_window.pad_window), or later turns round differently (~1e-4 of a logprob).
            # A ring (--no-swa-full) has no such place: its cells move round as it fills.
            placed = self._n_swa and not self._swa_ring and len(tokens) > self._n_swa
            if placed and not self._ckpts.restore(seq, len(tokens)):
                log.warning("the restored window of sequence %d could not be placed: refusing it", seq)
                self._cut(seq, 0)
                return False
        return True

    def close(self) -> None:
        if self._batch is not None:
            _llama.llama_batch_free(self._batch)
            self._batch = None
        if self._ctx:
            _llama.llama_free(self._ctx)
            self._ctx = None
        if self._model:
            _llama.llama_model_free(self._model)
            self._model = None
        for held in self._seqs:
            held.clear()

    # --- internals ------------------------------------------------------------------------------

    def _decode(self, seq: int, tokens: list[int], outputs: int = 1) -> None:
        """Evaluate ``tokens`` after what ``seq`` holds, in one batch, with logits for the last
        ``outputs`` of them (batch indices ``n - outputs .. n - 1``)."""
        held = self._seqs[seq]
        batch = self._batch
        n = len(tokens)
        pos = len(held)
        first = n - outputs
        for i, token in enumerate(tokens):
            batch.token[i] = token
            batch.pos[i] = pos + i
            batch.n_seq_id[i] = 1
            batch.seq_id[i][0] = seq
            batch.logits[i] = 1 if i >= first else 0
        batch.n_tokens = n
        rc = _llama.llama_decode(self._ctx, batch)
        if rc != 0:
            kept = int(_llama.llama_memory_seq_pos_max(self._mem, seq)) + 1
            evaluated = held + tokens
            self._seqs[seq] = evaluated[: max(0, kept)]
            self._fresh = -1
            raise EngineError(
                f"llama_decode failed with code {rc} after {kept} resident tokens of sequence {seq}"
            )
        self._ckpts.batch(seq, pos)
        held.extend(tokens)
        self._fresh = seq

    def _step(self, config: DecodeConfig, held: list[int]) -> Step:
        """How a decode of ``config`` chooses its tokens from this context's logits."""
        return Step(self._ctx, self._vocab, self._n_vocab, config, held)

    def _constraints_for(self) -> LlamaConstraints:
        """The constraints' token masks over this vocabulary (made on the first constrained decode)."""
        if self._constraints is None:
            self._constraints = LlamaConstraints(self._vocab, self._n_vocab)
        return self._constraints
