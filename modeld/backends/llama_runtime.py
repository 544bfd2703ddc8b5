"""The llama.cpp runtime (engine-worker side): several warm sequences in one context.

One llama.cpp context holds ``n_seq`` sequences (``n_seq_max``). modeld drives the KV cache
directly: ``sync`` cuts a sequence with ``llama_memory_seq_rm`` and evaluates only the
divergent tail; ``copy`` shares a prefix between sequences; ``snapshot`` / ``restore`` move a
sequence's state in and out (``llama_state_seq_get_data`` / ``set_data``). Design records:
``blueprints/0009-llama-backend.md`` and ``blueprints/0016-warm-state.md``. The points that
matter for correctness:

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
* **Memory that cannot be cut** (recurrent, hybrid, sliding-window models): ``can_truncate`` is
  False; the daemon only ever appends to or empties such a sequence, and if
  ``llama_memory_seq_rm`` refuses a cut anyway, the sequence is emptied and ``sync`` reports it
  kept nothing (the daemon evaluates everything again).
* **Restores are verified**: llama.cpp returning 0 empties the sequence; a restore whose
  position range does not match the tokens it claims is undone (llama.cpp #26676).
* **Constraints and the extra samplers** (``blueprints/0018``): a constrained decode masks the
  logits in the context's own buffer (llguidance's token mask over the compiled GBNF,
  :mod:`modeld.backends.llama_constraints`), then ``logit_bias`` and presence/frequency
  penalties are applied there (``modeld.decoding.sampling``), then the usual choice reads the
  buffer: the bare ``argmax`` when greedy (unchanged without a constraint), else the sampler
  chain. A dead end of the constraint ends the job cleanly (``constraint_failed``).
* **Speculation** (``DecodeConfig.speculation == "ngram"``, ``blueprints/0021``): the chosen
  token and a draft from the context (:class:`~modeld.decoding.speculation.Drafter`) are
  evaluated in one batch with logits at every drafted position; each position's token is chosen
  as above, the draft holds while the choices equal it, and the rejected drafted tokens' cells
  are removed (``llama_memory_seq_rm``). Tokens a constraint forces (the only one its mask
  allows) are appended to that batch without a choice of their own. A batch takes llama.cpp's
  multi-token kernels, whose rounding differs from the single-token step's by ~3e-4 of a logit:
  greedy output equals plain decoding wherever the top two logits are further apart than that
  (every test and benchmark turn; blueprint 0021 measures it). Memory that cannot be cut
  decodes plainly.
"""

from __future__ import annotations

import contextlib
import ctypes
import logging
import mmap
import os
import struct
import threading
import typing
from collections.abc import Callable, Iterator, Sequence
from dataclasses import replace
from typing import Any

import numpy as np

from modeld.backends import _llama_lib
from modeld.backends._llama_lib import bindings as _llama
from modeld.backends.base import Layout, LoadOptions, SyncStep, Vocab
from modeld.backends.cpu import cpu_has_amx
from modeld.backends.gguf_meta import GGUFInfo
from modeld.backends.llama_constraints import LlamaConstraints, TokenConstraint
from modeld.contract import Config, DecodeConfig, ModelInfo, TokenLogprob, TopLogprob
from modeld.decoding.constraints import ConstraintFailed, runtime_constraint
from modeld.decoding.sampling import (
    ChoiceToken,
    SampledToken,
    adjust_array,
    choice_seed,
    logit_bias_of,
    logprob_array,
)
from modeld.decoding.speculation import DRAFT_MAX, DecodeStats, Drafter, DraftLength
from modeld.errors import EngineError, InvalidArgumentError, ModelLoadError, UnsupportedError

__all__ = ["LlamaRuntime", "chunk_sizes"]

log = logging.getLogger("modeld.llama")

_LISTED = 256
"""Streams a stored snapshot fits (``--sequences`` goes up to 256): its cells first, then
``_LISTED - 1`` empty streams, so a context of up to this many streams reads it as it is."""
_PAD = 4 * (_LISTED - 1)
_SEQ_FILE = struct.Struct("<III")
"""llama.cpp's sequence-state file head: magic, version, token count (0: modeld keeps the tokens)."""
_HEAD = _SEQ_FILE.size

PENALTY_LAST_N = 64
_GGML_TYPES = {"f32": 0, "f16": 1, "q4_0": 2, "q8_0": 8, "bf16": 30}
_GGML_LOG_INFO = 2
_GGML_LOG_WARN = 3
_GGML_LOG_ERROR = 4

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


def micro_batch(num_batch: int, n_seq: int) -> int:
    """The tokens per ``llama_decode`` (and llama.cpp's ``n_batch`` = ``n_ubatch``) for a
    context of ``n_seq`` sequences: ``num_batch`` rounded down to a multiple of ``n_seq``, and
    never below ``n_seq``.

    Below ``n_seq`` llama.cpp aborts (SIGABRT while reserving its graphs). Not a multiple, it
    reserves its worst-case graph for a rounded-up token count, and every prefill then ran ~20%
    slower: measured with plain llama-cpp-python calls (215 tokens after 1141, realistic model,
    2 threads), ``n_seq_max`` 3, 5 or 6 with ``n_ubatch`` 512: 964-1005 ms; 1, 2 or 4 with 512, or
    3, 5 or 6 with 510: 802-861 ms."""
    return max(n_seq, num_batch - num_batch % n_seq)


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


class LlamaRuntime:
    """One llama.cpp model and context with ``n_seq`` sequences."""

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
        self._chunk = micro_batch(config.num_batch, n_seq)
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
        if recurrent:
            layout_name = "recurrent"
        elif self._portable:
            layout_name = "split"
        elif unified:
            layout_name = "unified"
        else:
            layout_name = f"split/{n_seq}"
        self._layout = Layout(
            n_seq=n_seq,
            window=window,
            pool_tokens=total,
            shared_cells=unified,
            can_truncate=can_truncate,
            snapshots=True,
            explicit=True,
            snapshot_format=f"llama.cpp {_llama_lib.version()} {layout_name}",
            kv_bytes_per_token=info.kv_bytes_per_token,
            exact=not unified,
            name=f"unified/{n_seq}:{total}" if unified else f"split/{n_seq}",
            forks=can_truncate and n_seq > 1,
            attention_spans_pool=unified and n_seq > 1,
        )
        self._seqs: list[list[int]] = [[] for _ in range(n_seq)]
        self._io_magic = self._magic()  # every sequence is empty now
        self._stats = [DecodeStats() for _ in range(n_seq)]
        self._fresh = -1  # the sequence whose last token's logits are in the context, or -1
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
                f"{self._meta.path!r} (kv {config.kv_cache_type}, batch {config.num_batch}; see the worker log)",
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

    def _seq(self, seq: int) -> list[int]:
        if not 0 <= seq < len(self._seqs):
            raise InvalidArgumentError(f"sequence {seq} does not exist", field="seq")
        return self._seqs[seq]

    def resident(self, seq: int) -> Sequence[int]:
        return self._seq(seq)

    def _cut(self, seq: int, keep: int) -> int:
        """Drop ``seq``'s tokens after the first ``keep``; returns how many it kept."""
        held = self._seq(seq)
        if keep >= len(held):
            return len(held)
        if self._fresh == seq:
            self._fresh = -1
        if keep <= 0:
            _llama.llama_memory_seq_rm(self._mem, seq, -1, -1)
            held.clear()
            return 0
        if _llama.llama_memory_seq_rm(self._mem, seq, keep, -1):
            del held[keep:]
            return keep
        log.warning("llama.cpp refused to cut sequence %d at token %d; emptying it", seq, keep)
        _llama.llama_memory_seq_rm(self._mem, seq, -1, -1)
        held.clear()
        return 0

    def sync(self, seq: int, keep: int, tokens: Sequence[int]) -> Iterator[SyncStep]:
        held = self._seq(seq)
        if keep > len(held):
            raise EngineError(f"sequence {seq} holds {len(held)} tokens; asked to keep {keep}")
        if keep + len(tokens) > self._layout.window:
            raise InvalidArgumentError("tokens exceed the context window", field="tokens")
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

    def generate(
        self,
        seq: int,
        config: DecodeConfig,
        max_tokens: int,
        forks: Sequence[int] = (),
        stopped: Callable[[int], bool] | None = None,
    ) -> Iterator[int]:
        if forks:
            return self._choices(seq, tuple(forks), config, max_tokens, stopped or (lambda _i: False))
        return self._generate(seq, config, max_tokens)

    def _fresh_logits(self, seq: int) -> list[int]:
        """``seq``'s tokens, with its last token's logits in the context (re-evaluated if not)."""
        held = self._seq(seq)
        if not held:
            raise EngineError("nothing resident to decode from")
        if self._fresh != seq:
            # Re-evaluate the last tokens (two, so the batch is not a lone token) for fresh logits.
            back = min(2, len(held)) if self._layout.can_truncate else 0
            if not back:
                raise EngineError("the model's memory cannot re-evaluate its last token")
            tail = held[-back:]
            self._cut(seq, len(held) - back)
            self._decode(seq, tail)
        return held

    def _generate(self, seq: int, config: DecodeConfig, max_tokens: int) -> Iterator[int]:
        compiled = runtime_constraint(config)
        held = self._fresh_logits(seq)
        stats = self._stats[seq] = DecodeStats()
        # Speculation needs cells that can be cut (rejected drafts are removed again).
        speculate = config.speculation == "ngram" and self._layout.can_truncate
        step = _Step(self, config, held)
        base = len(held)
        window = self._layout.window
        produced = 0
        drafter = Drafter(held) if speculate else None
        lengths = DraftLength(min(DRAFT_MAX, self._chunk - 1))
        try:
            if compiled is not None:
                if self._constraints is None:
                    self._constraints = LlamaConstraints(self._vocab, self._n_vocab)
                step.tc = self._constraints.start(compiled)
            rows: list[int] = [-1]  # the logits rows to choose from, in order
            draft: list[int] = []  # draft[i]: the token drafted after rows[i]
            while True:
                token = -1
                accepted = 0
                overwritten = False
                for i, row in enumerate(rows):
                    if i and self._fresh != seq:
                        # Another slot's batch was evaluated while this job yielded: the rows
                        # left are gone. The last token kept is evaluated again (its cell cut
                        # below) for fresh logits, as after a rejected draft.
                        overwritten = True
                        break
                    token = step.choose(row)
                    produced += 1
                    if drafter is not None:
                        drafter.append(token)
                    yield step.out(token)
                    if step.eog(token) or produced >= max_tokens or base + produced > window:
                        return
                    if i < len(draft) and token == draft[i]:
                        accepted += 1  # resident already: its row follows
                        stats.accepted += 1
                        continue
                    break
                if draft:
                    if not overwritten:  # an interruption says nothing of the drafts' quality
                        lengths.record(len(draft), accepted)
                    self._cut(seq, base + produced - 1)  # the rejected drafted tokens' cells
                # ``token`` is chosen, not yet evaluated. Tokens a constraint forces after it
                # are the only choice plain decoding has: yield them and evaluate all at once.
                pending = [token]
                if speculate and step.tc is not None:
                    room = min(max_tokens - produced, window + 1 - base - produced, self._chunk - 1)
                    for forced in step.forced(room):
                        pending.append(forced)
                        produced += 1
                        stats.forced += 1
                        if drafter is not None:
                            drafter.append(forced)
                        yield step.out(forced, forced=True)
                        if step.eog(forced) or produced >= max_tokens or base + produced > window:
                            return
                draft = []
                if drafter is not None:
                    room = min(
                        max_tokens - produced - 1,  # the draft's tokens and the one after them
                        window - base - produced,  # every drafted token needs a cell
                        self._chunk - len(pending),  # one batch
                    )
                    draft = drafter.draft(room)
                    del draft[lengths.budget(drafter.matched) :]
                    if draft and step.tc is not None:
                        del draft[step.tc.valid_prefix(draft) :]
                if draft:
                    stats.verifies += 1
                    stats.drafted += len(draft)
                    self._decode(seq, pending + draft, outputs=len(draft) + 1)
                    rows = list(range(len(pending) - 1, len(pending) + len(draft)))
                else:
                    self._decode(seq, pending)
                    rows = [-1]
        except ConstraintFailed as exc:
            # A dead end of the constraint: end the job cleanly (the daemon reports
            # constraint_failed; the sequence holds what was evaluated).
            log.info("a constrained decode of sequence %d cannot go on: %s", seq, exc)
        finally:
            step.close()
            if produced and len(held) > base + produced - 1:
                # Drafted tokens verified ahead of what was consumed: hold what plain decoding
                # would (every yielded token but the last), so the warm state says the truth.
                self._cut(seq, base + produced - 1)
            if step.adjusted and self._fresh == seq:
                # The buffer holds masked/adjusted logits of the last step: not fresh for the
                # next decode of this sequence (it re-evaluates its last tokens).
                self._fresh = -1

    def _choices(
        self,
        seq: int,
        forks: tuple[int, ...],
        config: DecodeConfig,
        max_tokens: int,
        stopped: Callable[[int], bool],
    ) -> Iterator[int]:
        """Choices decoded together (``DecodeConfig.n``): choice 0 on ``seq``, choice ``i`` on
        ``forks[i - 1]``, each fork holding a copy of ``seq``'s tokens (the cache copied them:
        shared cells in a unified pool). Every step evaluates one batch with one token per live
        choice; each choice has its own sampler chain (seed + i: ``choice_seed``), constraint,
        penalties and end (an end-of-generation token, ``max_tokens``, the window, a dead end of
        its constraint, or ``stopped(i)``: the daemon canceled that choice). Yields
        :class:`~modeld.decoding.sampling.ChoiceToken`. No speculation. A fork's cells are freed
        when its choice ends; ``seq`` is left as a one-choice decode leaves it (every yielded
        token but the last)."""
        seqs = (seq, *forks)
        if len(set(seqs)) != len(seqs):
            raise InvalidArgumentError("a decode's choices need distinct sequences", field="forks")
        for fork in forks:
            if self._seq(fork) != self._seq(seq):
                raise EngineError(f"sequence {fork} does not hold a copy of sequence {seq}'s tokens")
        compiled = runtime_constraint(config)
        held = self._fresh_logits(seq)
        self._stats[seq] = DecodeStats()
        base = len(held)
        window = self._layout.window
        n = len(seqs)
        steps = [_Step(self, replace(config, seed=choice_seed(config.seed, i)), held) for i in range(n)]
        produced = [0] * n
        live = list(range(n))
        rows = [-1] * n  # each live choice's logits row in the last batch
        first = n > 1  # the first step: every choice reads the prompt's last row
        try:
            if compiled is not None:
                if self._constraints is None:
                    self._constraints = LlamaConstraints(self._vocab, self._n_vocab)
                for step in steps:
                    step.tc = self._constraints.start(compiled)
            while live:
                view = saved = None
                if first:
                    # Masks, biases and penalties edit the row in place: each choice reads the original.
                    view = np.ctypeslib.as_array(
                        _llama.llama_get_logits_ith(self._ctx, -1), shape=(self._n_vocab,)
                    )
                    saved = view.copy()
                chosen: list[tuple[int, int, int]] = []  # (choice, token, as yielded)
                for i in live:
                    if view is not None and saved is not None and chosen:
                        view[:] = saved
                    step = steps[i]
                    try:
                        token = step.choose(rows[i])
                    except ConstraintFailed as exc:
                        log.info("a constrained choice %d of sequence %d cannot go on: %s", i, seq, exc)
                        chosen.append((i, -1, -1))
                        continue
                    produced[i] += 1
                    out = step.out(token)
                    chosen.append((i, token, out))
                first = False
                # Every live choice has chosen (no other job's batch can overwrite the logits
                # between them); now hand the tokens over.
                batch: list[tuple[int, int]] = []
                for i, token, out in chosen:
                    if token >= 0:
                        logprob = getattr(out, "logprob", None)
                        yield ChoiceToken(token, i, logprob)
                    ended = (
                        token < 0
                        or steps[i].eog(token)
                        or produced[i] >= max_tokens
                        or base + produced[i] > window
                    )
                    if not ended:
                        batch.append((i, token))
                    else:
                        self._end_choice(seqs, i, base + produced[i] - 1)
                        live.remove(i)
                for i, _token in list(batch):  # canceled while its token was on its way
                    if stopped(i):
                        batch.remove((i, _token))
                        self._end_choice(seqs, i, base + produced[i] - 1)
                        live.remove(i)
                if not batch:
                    break
                self._decode_choices([(seqs[i], token) for i, token in batch])
                for j, (i, _token) in enumerate(batch):
                    rows[i] = j
        finally:
            for step in steps:
                step.close()
            for fork in forks:
                self._cut(fork, 0)
            if len(held) > base + max(0, produced[0] - 1) and produced[0]:
                self._cut(seq, base + produced[0] - 1)
            self._fresh = -1  # the buffer holds several choices' rows (or masked ones)

    def _end_choice(self, seqs: tuple[int, ...], i: int, keep: int) -> None:
        """Choice ``i`` ended: a fork's cells are freed now; choice 0 keeps every yielded token
        but the last (as a one-choice decode leaves its sequence)."""
        if i == 0:
            self._cut(seqs[0], max(0, keep))
        else:
            self._cut(seqs[i], 0)

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

    def decode_stats(self, seq: int) -> DecodeStats:
        self._seq(seq)
        return self._stats[seq]

    def copy(self, src: int, dst: int, n: int) -> None:
        source = self._seq(src)
        self._seq(dst)
        n = min(n, len(source))
        self._cut(dst, 0)
        if n == 0:
            return
        if n < len(source) and not self._layout.can_truncate:
            raise EngineError("the model's memory cannot be cut: only a whole sequence can be copied")
        if self._layout.shared_cells:
            _llama.llama_memory_seq_cp(self._mem, src, dst, 0, n)  # tags the cells: no data copy
            self._seqs[dst] = source[:n]
            return
        # Separate streams: copy the state (exact cells), then cut it to n.
        blob = self.snapshot(src)
        if not self.restore(dst, blob, source):
            raise EngineError(f"llama.cpp could not copy sequence {src} into {dst}")
        self._cut(dst, n)

    def drop(self, seq: int) -> None:
        self._cut(seq, 0)

    # --- snapshots ------------------------------------------------------------------------------
    #
    # A snapshot (the RAM tier's blob, the payload of a disk-tier file) is llama.cpp's own
    # sequence-state *file* format with no tokens: ``u32 'ggsq' magic, u32 version, u32 0``
    # (tokens; modeld keeps them itself), then the KV cache's ``u32 n_stream`` and, per stream, a
    # ``u32`` cell count followed (when not 0) by that stream's cells. Stored with the
    # sequence's cells in the first stream and at least ``_LISTED - 1`` empty streams after it
    # (4 zero bytes each, 1 KB), it fits a context with any number of streams, split or unified:
    # changing --sequences or --kv-unified (or the memory budget doing it) keeps the disk tier
    # usable. A context whose stream count is the one the snapshot lists reads a file itself,
    # a tensor row at a time (``llama_state_seq_load_file``), and writes one the same way
    # (``llama_state_seq_save_file``): a snapshot on its way to or from disk never exists as
    # one blob in memory. Another stream count is a four-byte edit of a private mapping.

    def _blob_head(self) -> bytes:
        return _SEQ_FILE.pack(_llama.LLAMA_STATE_SEQ_MAGIC, _llama.LLAMA_STATE_SEQ_VERSION, 0)

    def snapshot(self, seq: int) -> bytes:
        self._seq(seq)
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
        self._seq(seq)
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

    def restore(self, seq: int, blob: bytes | bytearray | memoryview, tokens: Sequence[int]) -> bool:
        held = self._seq(seq)
        self._cut(seq, 0)
        view = memoryview(blob)
        head = self._blob_head()
        if view.nbytes <= _HEAD + 4 or view[:_HEAD] != head or len(tokens) > self._layout.window:
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
        return read > 0 and self._restored(seq, held, tokens)

    def restore_file(self, seq: int, path: str, size: int, tokens: Sequence[int]) -> bool:
        """Load the snapshot stored in the first ``size`` bytes of the file at ``path``
        (verified by the caller). A context with the stream count the file lists has llama.cpp
        read it a tensor row at a time; another is given a private mapping to edit."""
        held = self._seq(seq)
        self._cut(seq, 0)
        with open(path, "rb") as f:
            head = f.read(_HEAD + 4)
            if (
                len(head) < _HEAD + 4
                or head[:_HEAD] != self._blob_head()
                or len(tokens) > self._layout.window
            ):
                return False
            listed = int.from_bytes(head[_HEAD:], "little")
            if self._portable and (listed != self._n_stream or self._n_stream - 1 > _PAD // 4):
                mapped = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_COPY)
                try:
                    return self.restore(seq, memoryview(mapped)[:size], tokens)
                finally:
                    with contextlib.suppress(BufferError):
                        mapped.close()
        out = (_llama.llama_token * 1)()
        count = ctypes.c_size_t(0)
        read = int(
            _llama.llama_state_seq_load_file(self._ctx, os.fsencode(path), seq, out, 1, ctypes.byref(count))
        )
        return read > 0 and self._restored(seq, held, tokens)

    def _magic(self) -> bytes:
        """The first 4 bytes of llama.cpp's in-memory sequence state (no header names them:
        read from an empty sequence's state when the context is made)."""
        size = int(_llama.llama_state_seq_get_size(self._ctx, 0))
        buf = (ctypes.c_uint8 * size)()
        if size < 8 or int(_llama.llama_state_seq_get_data(self._ctx, buf, size, 0)) < 8:
            raise ModelLoadError("llama.cpp could not save an empty sequence's state", path=self._meta.path)
        return bytes(buf[:4])

    def _restored(self, seq: int, held: list[int], tokens: Sequence[int]) -> bool:
        """llama.cpp loaded a snapshot into ``seq``: does it hold the positions ``tokens`` claims?"""
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
        held.extend(tokens)
        self._fresh = seq

    def _sampler(self, config: DecodeConfig, held: list[int]) -> Any:
        """A llama.cpp sampler chain, or None for plain greedy decoding (argmax of the logits)."""
        if config.temperature <= 0 and config.repeat_penalty == 1.0:
            return None
        chain = _llama.llama_sampler_chain_init(_llama.llama_sampler_chain_default_params())
        if config.repeat_penalty != 1.0:
            _llama.llama_sampler_chain_add(
                chain,
                _llama.llama_sampler_init_penalties(
                    self._n_vocab, PENALTY_LAST_N, config.repeat_penalty, 0.0, 0.0
                ),
            )
            for token in held[-PENALTY_LAST_N:]:
                _llama.llama_sampler_accept(chain, token)
        if config.temperature <= 0:
            _llama.llama_sampler_chain_add(chain, _llama.llama_sampler_init_greedy())
            return chain
        if config.top_k > 0:
            _llama.llama_sampler_chain_add(chain, _llama.llama_sampler_init_top_k(config.top_k))
        if config.top_p < 1.0:
            _llama.llama_sampler_chain_add(chain, _llama.llama_sampler_init_top_p(config.top_p, 1))
        if config.min_p > 0.0:
            _llama.llama_sampler_chain_add(chain, _llama.llama_sampler_init_min_p(config.min_p, 1))
        _llama.llama_sampler_chain_add(chain, _llama.llama_sampler_init_temp(config.temperature))
        seed = 0xFFFFFFFF if config.seed is None else config.seed % 0xFFFFFFFF  # 0xFFFFFFFF = random
        _llama.llama_sampler_chain_add(chain, _llama.llama_sampler_init_dist(seed))
        return chain


class _Step:
    """One decode's choice of a token from a logits row: the constraint's mask, logit bias and
    penalties (in the context's own buffer, so the sampler chain reads the result too), then the
    bare ``argmax`` when greedy, else the sampler chain (its random draw, its penalty window).
    Plain decoding and every verified position of a speculative step choose through here."""

    def __init__(self, runtime: LlamaRuntime, config: DecodeConfig, held: list[int]) -> None:
        self._rt = runtime
        self._config = config
        self.tc: TokenConstraint | None = None
        self._sampler = runtime._sampler(config, held)
        self._bias = logit_bias_of(config.logit_bias)
        self._penalties = bool(config.presence_penalty or config.frequency_penalty)
        self._counts: dict[int, int] = {}
        self._logprob: TokenLogprob | None = None

    @property
    def adjusted(self) -> bool:
        """The logits buffer was masked or adjusted in place."""
        return self.tc is not None or bool(self._bias) or self._penalties

    def choose(self, row: int) -> int:
        """The token at batch index ``row`` (-1: the last evaluated)."""
        rt, config = self._rt, self._config
        logits = None
        if self.adjusted or config.logprobs or self._sampler is None:
            logits = np.ctypeslib.as_array(_llama.llama_get_logits_ith(rt._ctx, row), shape=(rt._n_vocab,))
            if self.tc is not None:
                self.tc.apply(logits)
            if self._bias or self._penalties:
                adjust_array(
                    logits,
                    counts=self._counts,
                    logit_bias=self._bias,
                    presence_penalty=config.presence_penalty,
                    frequency_penalty=config.frequency_penalty,
                )
        if self._sampler is None:
            assert logits is not None
            token = int(np.argmax(logits))
        else:
            token = int(_llama.llama_sampler_sample(self._sampler, rt._ctx, row))
        if self.tc is not None:
            self.tc.accept(token)
        self._counts[token] = self._counts.get(token, 0) + 1
        self._logprob = (
            logprob_array(logits, token, config.top_logprobs)
            if config.logprobs and logits is not None
            else None
        )
        return token

    def forced(self, limit: int) -> list[int]:
        """Tokens the constraint forces next (consumed), counted as chosen ones are. Each had
        probability 1 for plain decoding: its log-probability is 0 and it is its own only
        alternative. (The sampler's random draw is not spent on them, so a seeded sampled
        decode may continue differently from a plain one; its distribution is the same.)"""
        if self.tc is None:
            return []
        tokens = self.tc.forced(limit)
        for token in tokens:
            self._counts[token] = self._counts.get(token, 0) + 1
            if self._sampler is not None:
                _llama.llama_sampler_accept(self._sampler, token)  # its penalty window
        return tokens

    def out(self, token: int, *, forced: bool = False) -> int:
        """The token as the scheduler wants it: with its log-probabilities when asked for."""
        if not self._config.logprobs:
            return token
        if forced:
            top = (TopLogprob(token, 0.0),) if self._config.top_logprobs else ()
            return SampledToken(token, TokenLogprob(token, 0.0, top))
        return SampledToken(token, self._logprob) if self._logprob is not None else token

    def eog(self, token: int) -> bool:
        return bool(_llama.llama_vocab_is_eog(self._rt._vocab, token))

    def close(self) -> None:
        if self._sampler is not None:
            _llama.llama_sampler_free(self._sampler)
            self._sampler = None
        if self.tc is not None:
            self.tc.close()
