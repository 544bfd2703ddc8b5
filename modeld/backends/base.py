"""The seam between modeld and an inference engine: coarse units of work on numbered sequences.

A backend has two halves:

* :class:`Backend` (daemon side) describes a model from its file without loading weights or
  importing the native engine, so the daemon process never loads llama.cpp or OpenVINO itself.
* :class:`ModelRuntime` (worker side) is one loaded model holding ``Layout.n_seq`` KV sequences.
  It runs inside a supervised worker process (``modeld/workers/``) or, for the in-memory
  reference backend, in-process; either way the daemon reaches it only through the messages of
  ``modeld/workers/protocol.py``, one message per unit of work: the vocabulary once, tokenize,
  sync a sequence to target tokens, generate a batch of tokens, copy / drop / snapshot /
  restore a sequence, cancel by message.

Everything else -- manifests, reuse decisions, which warm context lives in which sequence,
tiers, accounting, stop strings, UTF-8 safe streaming -- is the daemon's, written once for
every backend (``modeld/engine/``, ``modeld/cache/``). Design records: ``blueprints/0001-the-seam.md``
(the seam), ``blueprints/0016-warm-state.md`` (the sequences and snapshots), ``blueprints/0017-workers.md``
(the worker process).

Step-wise work: :meth:`ModelRuntime.sync` and :meth:`ModelRuntime.generate` are generators, one
engine step (a prefill batch, or one token) per ``next()``. The worker's scheduler advances the
generators of several sequences in turn, so a long prefill of one session does not stall the
decode of another, and a cancel message is honoured between two steps. Every other method is one
atomic step. All methods are called from one thread (the worker's engine thread).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Protocol

from modeld.contract import NUM_BATCH, Config, DecodeConfig, ModelInfo, OpenSessionRequest
from modeld.decoding.speculation import DecodeStats
from modeld.errors import InvalidArgumentError

__all__ = [
    "CELL_PAD",
    "Backend",
    "DecodeStats",
    "HeldTokens",
    "Layout",
    "LoadOptions",
    "ModelRuntime",
    "SNAPSHOT_CELL_BYTES",
    "SNAPSHOT_HEADER_BYTES",
    "SyncStep",
    "Vocab",
    "kv_allocated_bytes",
    "micro_batch",
    "default_batch",
    "SMALL_BATCH",
    "LARGE_BATCH",
    "swa_ring_cells",
]


@dataclass(frozen=True, slots=True)
class Vocab:
    """What the daemon needs to turn tokens into text itself: sent once, after loading.

    ``pieces[t]`` is the bytes token ``t`` stands for (empty for control tokens such as BOS);
    ``eog`` the tokens that end generation; ``bos`` the BOS token (-1 when the model has none);
    ``lengths[t]`` the length of ``pieces[t]``, computed once (every turn adds up a prompt's
    token lengths: one list look-up a token, not a call).
    """

    pieces: tuple[bytes, ...]
    eog: frozenset[int]
    bos: int
    lengths: tuple[int, ...] = field(default=(), compare=False, repr=False)

    def __post_init__(self) -> None:
        if len(self.lengths) != len(self.pieces):
            object.__setattr__(self, "lengths", tuple(len(p) for p in self.pieces))

    def piece(self, token: int) -> bytes:
        return self.pieces[token] if 0 <= token < len(self.pieces) else b""

    def byte_lengths(self, tokens: Sequence[int]) -> Iterable[int]:
        """The length in bytes of each token's piece (0 for a token outside the vocabulary)."""
        lengths = self.lengths
        if tokens and min(tokens) >= 0 and max(tokens) < len(lengths):
            return map(lengths.__getitem__, tokens)
        return (len(self.piece(t)) for t in tokens)


SNAPSHOT_CELL_BYTES = 32
"""A snapshot's bytes per token beside the KV: llama.cpp's cell metadata (12 bytes per cell and
cache) and the recorded batch starts and prefill ends of a checkpointed sequence (4 bytes each).
Measured on the generated models (blueprint 0016): 13.6 bytes a token (llama) to 26 (qwen35)."""

SNAPSHOT_HEADER_BYTES = 4096
"""A snapshot's fixed bytes: llama.cpp's per-layer headers, the checkpoint section's."""

CELL_PAD = 256
"""llama.cpp pads a context to a multiple of 256 cells: windows are planned in these steps."""


SMALL_BATCH = 48
"""The micro-batch when ``Config.num_batch`` is 0 and the model's memory is attention alone,
on the CPU, without flash attention (blueprint 0009, "The micro-batch"). llama.cpp reserves the
attention scores of a micro-batch over every cell (``b x cells x (heads + 1) x 4`` bytes, and a
work buffer half that size touched by a long prefill): 363 MiB at 512 tokens and an 8k window on
the realistic model, 34 at 48. Prefill was as fast at 48 as at 64 and faster than at 512 (the
scores stay in cache), and slower at 32: 7.8k tokens in 106-111 s at 48, 108-109 at 64, 112-115
at 32 (AMD EPYC; on an Intel Xeon 74-77 s at 64, 79-82 at 512, 80 at 32)."""

LARGE_BATCH = NUM_BATCH
"""The micro-batch otherwise (llama.cpp's own default): memory that cannot be cut takes a
checkpoint at batch starts (a 27B hybrid's state is ~157 MiB to copy), flash attention keeps no
scores, and an accelerator wants large batches."""


def default_batch(config: Config, memory: str) -> int:
    """The micro-batch of a llama.cpp session: ``Config.num_batch``, or when it is 0 the choice
    for a model whose memory is ``memory`` (``GGUFInfo.memory``)."""
    if config.num_batch:
        return config.num_batch
    small = memory == "attention" and not config.flash_attn and config.num_gpu_layers == 0
    return SMALL_BATCH if small else LARGE_BATCH


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


def swa_ring_cells(n_swa: int, n_seq: int, ubatch: int, *, unified: bool, cells: int) -> int:
    """The cells of llama.cpp's SWA cache as a ring (``--no-swa-full``), as
    ``llama_kv_cache_iswa`` sizes it: ``n_swa x n_seq + n_ubatch`` in a unified pool of
    ``cells``, ``n_swa + n_ubatch`` in each of ``n_seq`` streams of ``cells``, at most the pool
    or the stream, padded to :data:`CELL_PAD`. The planner counts it before loading
    (``sizing.kv_cost``), the loaded context reports it (``Layout.swa_ring_cells``)."""

    def pad(n: int) -> int:
        return -(-n // CELL_PAD) * CELL_PAD

    if unified:
        return pad(min(cells, n_swa * n_seq + ubatch))
    return n_seq * pad(min(cells, n_swa + ubatch))


def kv_allocated_bytes(
    pool_tokens: int, kv_bytes_per_token: int, ring_cells: int = 0, swa_bytes: int = 0
) -> int:
    """The KV allocated at load: ``pool_tokens`` cells of every layer, except that with a ring
    (``ring_cells`` > 0) the local layers, ``swa_bytes`` of a token's KV, keep only the ring."""
    full = pool_tokens * max(0, kv_bytes_per_token)
    if ring_cells <= 0:
        return full
    return full - (pool_tokens - ring_cells) * swa_bytes


@dataclass(frozen=True, slots=True)
class Layout:
    """How a loaded runtime holds its KV sequences (fixed for the runtime's life).

    ``n_seq`` sequences (ids ``0 .. n_seq-1``), each of at most ``window`` tokens, ``pool_tokens``
    KV cells in all. ``shared_cells``: :meth:`ModelRuntime.copy` shares the copied cells between
    the two sequences (llama.cpp's unified KV) instead of duplicating them. ``can_truncate``:
    a sequence can be cut at any token (False for recurrent memory: it can only be emptied).
    ``snapshots``: :meth:`ModelRuntime.snapshot` / :meth:`ModelRuntime.restore` work.
    ``explicit``: modeld decides what the KV holds (False for an engine that owns its cache and
    reuses blocks by content, like OpenVINO GenAI: sequences are then logical only).
    ``snapshot_format`` names what a snapshot blob is compatible with (engine build and KV
    layout); a blob is only ever restored into a runtime that reports the same string.
    ``kv_bytes_per_token`` is the KV cost of one resident token (all layers, K and V).
    ``exact``: a warm context's output is bit-identical to a fresh evaluation of the same tokens
    by construction (False for llama.cpp's unified pool, where a context's cells can interleave
    with other contexts' and the attention then sums in another order: blueprint 0016).
    ``name`` says how the KV is laid out (``unified/4:8704``, ``split/4``), for people.
    ``forks``: :meth:`ModelRuntime.generate` decodes several choices of one prompt together on
    further sequences (``DecodeConfig.n``); without it the daemon decodes them one after another.
    ``attention_spans_pool``: a sequence's attention covers every used cell of the pool up to the
    highest one, other sequences' cells masked (llama.cpp's unified KV): an idle context's cells
    slow every turn of the others, so the cache moves an idle context out of the pool when a turn
    starts whose attention over its cells costs more, as measured, than moving it out and back
    (blueprint 0016, "Where a context goes").
    ``checkpoints``: memory that cannot be cut at any token (``can_truncate`` False) whose warm
    sequence can still be cut back: :meth:`ModelRuntime.sync` goes back to the last point at or
    before ``keep`` the memory can return to (a checkpoint of a recurrent or hybrid state, a
    sliding window the cache still holds), evaluates the known tokens from there and reports the
    ``kept`` it reached; :meth:`ModelRuntime.copy` of part of such a sequence does the same. A
    snapshot in a tier is restored only whole unless ``snapshot_cuts``: its checkpoints travel
    inside the blob, and a restored sequence is cut back as one in the pool is. ``memory`` is what the engine says the
    model's memory is (``attention``, ``sliding-window``, ``hybrid``, ``recurrent``: the same
    words as ``Footprint.memory``, which describe reads from the file).
    ``state_bytes``: one sequence's state beside its KV cells, which cannot be cut (a recurrent
    state: llama.cpp allocates one per sequence at load, and a snapshot carries it);
    ``checkpoint_limit``: the checkpoints a sequence may keep (they travel inside its snapshots
    when ``snapshot_cuts``); ``checkpoint_bytes``: one checkpoint's size at most (a recurrent
    state, or a sliding window's cells).
    ``swa_ring_cells``: the local layers of a sliding-window model keep this many cells, a ring
    (``LoadOptions.swa_full`` False), each ``swa_kv_bytes_per_token`` (their part of
    ``kv_bytes_per_token``); 0: a cell per pool cell, as every other layer
    (:attr:`kv_allocated_bytes`).
    """

    n_seq: int
    window: int
    pool_tokens: int
    shared_cells: bool = False
    can_truncate: bool = True
    snapshots: bool = False
    explicit: bool = True
    snapshot_format: str = ""
    kv_bytes_per_token: int = 0
    exact: bool = True
    name: str = ""
    forks: bool = False
    attention_spans_pool: bool = False
    checkpoints: bool = False
    memory: str = "attention"
    snapshot_cuts: bool = False
    state_bytes: int = 0
    checkpoint_limit: int = 0
    checkpoint_bytes: int = 0
    swa_ring_cells: int = 0
    swa_kv_bytes_per_token: int = 0

    @property
    def kv_allocated_bytes(self) -> int:
        """The KV the engine allocates at load: ``pool_tokens`` cells of every layer, less what a
        ring of sliding-window cells saves."""
        return kv_allocated_bytes(
            self.pool_tokens, self.kv_bytes_per_token, self.swa_ring_cells, self.swa_kv_bytes_per_token
        )

    def snapshot_bytes(self, tokens: int) -> int:
        """About what a snapshot of a sequence holding ``tokens`` takes, at most: its KV cells
        with their metadata, its state, and the checkpoints that travel with it (the RAM tier
        makes this much room before the blob comes). An upper bound: a sequence may hold fewer
        checkpoints than its limit, and a sliding window's snapshot holds only the window."""
        carried = self.checkpoint_limit if self.snapshot_cuts else 0
        per = max(0, self.kv_bytes_per_token) + SNAPSHOT_CELL_BYTES
        return (
            max(0, tokens) * per
            + max(0, self.state_bytes)
            + carried * max(0, self.checkpoint_bytes)
            + SNAPSHOT_HEADER_BYTES
        )

    @property
    def whole_snapshots(self) -> bool:
        """A snapshot of every resident token serves a later turn that shares only its start:
        the engine can cut the restored sequence (memory that can be cut, or checkpoints that
        travel inside the snapshot: ``snapshot_cuts``). So a context leaving the KV keeps its
        suffix and decode (blueprint 0016, "Where a context goes")."""
        return self.can_truncate or self.snapshot_cuts


@dataclass(frozen=True, slots=True)
class LoadOptions:
    """How the daemon wants a model loaded (decided by the engine from its settings).

    ``n_seq`` sequences of ``window`` tokens each. ``unified``: one KV pool of ``pool_tokens``
    cells that every sequence may fill up to its window, sharing copied prefixes (llama.cpp's
    ``kv_unified``; the default is a pool of one window, as llama-server's ``-np auto``);
    otherwise each sequence has its own ``window`` cells (``pool_tokens`` is then
    ``n_seq * window``). ``threads`` 0 means the backend's default. Planned by
    :func:`modeld.backends.sizing.plan_layout` within the memory budget.
    """

    n_seq: int
    window: int
    pool_tokens: int
    unified: bool = False
    threads: int = 0
    checkpoints: int = 8
    """Checkpoints kept per sequence of memory that cannot be cut at any token (``--checkpoints``;
    0: none)."""
    swa_full: bool = True
    """Sliding-window attention keeps every token's KV in its local layers too (llama.cpp's
    ``swa_full``, its context default; ``--no-swa-full``: the local layers keep a ring of
    ``n_swa x n_seq + n_ubatch`` cells, llama-server's default; blueprint 0016)."""


@dataclass(frozen=True, slots=True)
class SyncStep:
    """Progress of :meth:`ModelRuntime.sync`: ``kept`` tokens were kept, then ``evaluated`` of
    ``total`` new tokens were evaluated. ``kept`` may be less than asked when the memory could
    not be cut there: a runtime whose layout has ``checkpoints`` then evaluates the known tokens
    after ``kept`` itself (``total`` counts them), others stop and the daemon asks again from
    ``kept``. ``seconds``: the engine's time for the batch this step evaluated (the worker's
    scheduler times each step of a job by itself, so another job's steps never count; 0 for the
    cut and where nothing timed it): a sample of the attention's cost (``cache/cost.py``)."""

    kept: int
    evaluated: int
    total: int
    seconds: float = 0.0


class HeldTokens:
    """The tokens each of a runtime's sequences holds, as every runtime keeps them (``_seqs``,
    one list per sequence): ``resident`` and the bounds check of a sequence number; and what
    speculation did in each sequence's last decode (``_stats``, for a runtime that speculates)."""

    _seqs: list[list[int]]
    _stats: list[DecodeStats]

    def _seq(self, seq: int) -> list[int]:
        if not 0 <= seq < len(self._seqs):
            raise InvalidArgumentError(f"sequence {seq} does not exist", field="seq")
        return self._seqs[seq]

    def resident(self, seq: int) -> Sequence[int]:
        return self._seq(seq)

    def decode_stats(self, seq: int) -> DecodeStats:
        self._seq(seq)
        return self._stats[seq]

    def checkpoint_bytes(self) -> tuple[int, ...]:
        """A runtime without checkpoints holds none."""
        return ()


class ModelRuntime(Protocol):
    """One loaded model and its numbered KV sequences (worker side)."""

    @property
    def layout(self) -> Layout: ...

    def vocab(self) -> Vocab: ...

    def tokenize(self, text: str, *, add_bos: bool) -> list[int]: ...

    def resident(self, seq: int) -> Sequence[int]:
        """The tokens whose KV sequence ``seq`` holds now, in order."""
        ...

    def sync(
        self, seq: int, keep: int, tokens: Sequence[int], segments: Sequence[int] | None = None
    ) -> Iterator[SyncStep]:
        """Make ``seq`` hold its first ``keep`` tokens followed by ``tokens``.

        The first step cuts (and yields with ``evaluated == 0``); each further step evaluates
        one batch. If the consumer stops early, ``seq`` holds a consistent prefix of the target.
        ``segments``: where the manifest's segments start in the target (token positions; None:
        not known). Memory that cannot be cut at any token begins batches and takes checkpoints
        there, so an edit of a segment goes back no further than its start.
        """
        ...

    def generate(
        self,
        seq: int,
        config: DecodeConfig,
        max_tokens: int,
        forks: Sequence[int] = (),
        stopped: Callable[[int], bool] | None = None,
    ) -> Iterator[int]:
        """Sample up to ``max_tokens`` tokens after what ``seq`` holds.

        ``forks`` (only where ``Layout.forks``): further sequences holding a copy of ``seq``'s
        tokens; choice ``i`` (0: ``seq``) is decoded on ``forks[i - 1]`` with the seed
        ``choice_seed(config.seed, i)``, all choices together, one batch per step, and each
        token is yielded as a ``ChoiceToken`` naming its choice; ``stopped(i)`` ends choice
        ``i`` (the daemon canceled it), and a fork is empty when the generator ends.

        Each yielded token is evaluated (becomes resident) at the latest when the generator is
        resumed, before the next one is chosen; when the consumer stops, the sequence holds at
        most every yielded token but the last (a runtime that verified drafted tokens ahead cuts
        them back). The generator ends after yielding an end-of-generation token, or when the
        window is full. Needs at least one resident token. ``config.speculation`` is ``off`` or
        ``ngram`` here (the daemon resolved ``""``); a runtime that cannot speculate decodes
        plainly (``blueprints/0021-speculation.md``).
        """
        ...

    def decode_stats(self, seq: int) -> DecodeStats:
        """What speculation did in ``seq``'s current or last generate (zeros if none)."""
        ...

    def checkpoint_bytes(self) -> tuple[int, ...]:
        """The bytes each sequence's checkpoints hold now, by sequence (``Layout.checkpoints``:
        kept in the worker's heap beside the KV; empty for memory without them)."""
        ...

    def copy(self, src: int, dst: int, n: int) -> None:
        """Make ``dst`` hold the first ``n`` tokens of ``src`` (``dst`` is emptied first)."""
        ...

    def drop(self, seq: int) -> None:
        """Empty ``seq`` (its cells are freed unless another sequence shares them)."""
        ...

    def share(self, src: int, dst: int, n: int) -> bool:
        """``dst``'s first ``n`` tokens, the same as ``src``'s first ``n``, are held in ``src``'s
        cells from now on and ``dst``'s own are freed (``Layout.shared_cells``: a context
        restored beside another that shares its start stores that start once again); False
        (nothing changed) when the tokens differ or the layout cannot share."""
        ...

    def snapshot(self, seq: int) -> bytes:
        """The state of ``seq`` as an opaque blob (``Layout.snapshots`` must be True)."""
        ...

    def restore(self, seq: int, blob: bytes | bytearray | memoryview, tokens: Sequence[int]) -> bool:
        """Load a blob taken from a sequence that held ``tokens``; False (and ``seq`` empty) if
        the engine refused it. A writable blob (``bytearray``, or a writable ``memoryview``: read
        from the worker's socket, or a private mapping of a snapshot file) exists for this call
        alone: the runtime may rewrite it in place instead of copying it. It is valid only
        during the call."""
        ...

    def save(self, seq: int, path: str) -> int:
        """Write the state of ``seq`` into a new file at ``path``, exactly the blob
        :meth:`snapshot` would return (the engine may stream it from its cache into the file
        without holding it whole); returns the bytes written. Raises ``OSError`` when the file
        system refuses the write."""
        ...

    def restore_file(self, seq: int, path: str, size: int, tokens: Sequence[int]) -> bool:
        """:meth:`restore` from the blob stored in the first ``size`` bytes of the file at
        ``path`` (the caller verified it; the engine may read it in pieces)."""
        ...

    def close(self) -> None:
        """Free the model and every sequence."""
        ...


class Backend(Protocol):
    """Describes models of one kind (daemon side) and loads them (worker side)."""

    @property
    def name(self) -> str: ...

    def describe(self, request: OpenSessionRequest, *, memory_budget: int | None = None) -> ModelInfo:
        """Read what the model is and what it can do here, without loading the weights and
        without importing the native engine into the calling process. The context is sized
        from ``memory_budget`` (None: ``sizing.default_memory_budget``), never from the free
        memory of the moment: the same request is described the same way every time."""
        ...

    def check_decode(self, config: DecodeConfig) -> None:
        """Refuse what ``Capabilities`` cannot say (the values of this backend's
        ``DecodeConfig.extra`` keys): the daemon checks a decode before it reaches the engine,
        so no worker round trip is spent on it."""
        ...

    def load(self, request: OpenSessionRequest, info: ModelInfo, options: LoadOptions) -> ModelRuntime:
        """Load the model described by ``info`` as ``options`` say (runs in the worker);
        raises ``ModelLoadError`` naming the file."""
        ...
