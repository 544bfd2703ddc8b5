"""What every file-backed backend's describe computes the same way: identity, context size and
the :class:`~modeld.contract.ModelInfo` of a model file (the llama and openvino backends).

``effective_context = min(trained context, requested num_ctx, (memory budget - weights -
MODEL_OVERHEAD_BYTES) / kv_bytes_per_token)`` (blueprints/0009-llama-backend.md): one sequence
of that window fits in the budget the engine counts a loaded model against (weights, KV and
the same overhead). The memory budget is the daemon's (``--memory-budget``; default
:func:`default_memory_budget`), fixed for its life: the same request is described the same way
whatever else the machine is doing. The effective
context is part of a session's runtime identity, so a size taken from the free memory of the
moment could turn a warm prefix cold when another process came or went, or when the model's own
weights were mapped.

The engine then caps the context by the memory budget under the configured KV layout
(:func:`max_window`) and plans that layout (:func:`plan_layout`, blueprint 0016): a unified pool
of one window that every sequence may fill (the default, llama-server's ``-np auto``), or split
streams of a full window each (``kv_unified`` off: warm output bit-identical to a fresh
evaluation by construction, ``n`` windows of memory). :func:`footprint` says what the model will
take (weights, KV, the engine's compute buffer, the per-model rest) under that layout, and the
largest window that fits the budget (:class:`~modeld.contract.Footprint`; ``modeld describe``).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import replace
from typing import Protocol

import psutil

from modeld.backends.base import CELL_PAD, LoadOptions, kv_allocated_bytes, micro_batch
from modeld.backends.base import swa_ring_cells as ring_cells
from modeld.backends.probe import MAX_SHOWN_PATH, show_path
from modeld.contract import Capabilities, Footprint, ModelInfo, OpenSessionRequest, SpecialToken
from modeld.decoding.tools import detect_format
from modeld.errors import ModelLoadError

__all__ = [
    "CELL_PAD",
    "MODEL_OVERHEAD_BYTES",
    "ModelFacts",
    "check_digest",
    "checkpoint_size",
    "compute_bytes",
    "default_memory_budget",
    "effective_context",
    "footprint",
    "kv_cost",
    "layout_name",
    "load_cost",
    "max_window",
    "model_info",
    "plan_layout",
    "state_cost",
    "swa_ring_cells",
]

BUDGET_SHARE = 0.9
"""The default memory budget: this share of the machine's RAM (``--memory-budget``)."""
MODEL_OVERHEAD_BYTES = 128 << 20
"""Memory counted per loaded model beyond its weights, KV and compute buffer: the worker process
(Python, modeld, llama.cpp's own small buffers). Measured on the test models: the worker's
anonymous memory outside the KV and compute buffers is 40-125 MiB (``python -m bench.kv_layout
memory``; blueprint 0016)."""
UNKNOWN_COMPUTE_BYTES = 128 << 20
"""The compute buffer counted for a model whose footprint does not estimate one (OpenVINO, the
memory backend)."""
WARM_SWA_FULL = (
    "a fresh evaluation's, bit for bit: the full-size SWA cache keeps every token's KV, so a cut "
    "keeps the window before it, and a window restored from a tier goes back where a fresh "
    "evaluation holds it"
)
"""``Footprint.warm`` of a sliding-window model with llama.cpp's full-size SWA cache (the default)."""

WARM_SWA_RING = (
    "a fresh evaluation's up to rounding: a cut goes back to a checkpoint of the window where the "
    "ring no longer holds it (further back than with a full-size cache), and the ring's cells "
    "then, or a window restored from a tier, are not in a fresh evaluation's order, so the "
    "log-probabilities can differ (up to 1e-3 measured, the same tokens; after an edit bit for "
    "bit on some CPUs' kernels, not on others)"
)
"""``Footprint.warm`` of a sliding-window model whose local layers keep a ring (``--no-swa-full``;
blueprint 0016, "Sliding windows")."""
_MAX_WINDOW = 1 << 24


def default_memory_budget() -> int:
    """Weights + KV of every loaded model, by default: 90% of the machine's RAM."""
    return int(psutil.virtual_memory().total * BUDGET_SHARE)


def check_digest(path: str, requested: str, actual: str) -> None:
    """Refuse a request whose digest does not name the file as it is now."""
    if requested and requested != actual:
        raise ModelLoadError(
            f"model {show_path(path)} has digest {actual}, the request asked for {show_path(requested)}",
            path=path[:MAX_SHOWN_PATH],
            expected=requested[:MAX_SHOWN_PATH],
            actual=actual,
        )


def effective_context(
    *,
    trained: int,
    requested: int,
    memory_budget: int | None,
    weights_bytes: int,
    kv_bytes_per_token: int,
    compute_floor_bytes: int = UNKNOWN_COMPUTE_BYTES,
) -> int:
    """The context a session gets (see the module docstring; ``memory_budget`` None: the
    default). ``compute_floor_bytes``: the smallest compute buffer the engine reserves (the
    footprint's estimate, when the backend makes one); the engine's layout plan then counts the
    buffer at the window's size."""
    budget = default_memory_budget() if memory_budget is None else memory_budget
    if kv_bytes_per_token <= 0:
        fits = requested
    else:
        rest = MODEL_OVERHEAD_BYTES + compute_floor_bytes
        fits = max(0, (budget - weights_bytes - rest) // kv_bytes_per_token)
    return max(0, min(trained or requested, requested, fits))


def compute_bytes(fp: Footprint, cells: int) -> int:
    """The engine's compute buffer for a context of ``cells`` cells (the model's estimate;
    :data:`UNKNOWN_COMPUTE_BYTES` when it has none)."""
    if not (fp.compute_floor_bytes or fp.compute_fixed_bytes or fp.compute_bytes_per_token):
        return UNKNOWN_COMPUTE_BYTES
    return max(fp.compute_floor_bytes, fp.compute_fixed_bytes + fp.compute_bytes_per_token * max(0, cells))


def checkpoint_size(fp: Footprint) -> int:
    """One checkpoint's bytes: a recurrent state, or a sliding window's cells (at most the
    window's tokens of every layer's KV: only the local layers' are saved); 0 for memory that
    can be cut."""
    if fp.state_bytes > 0:
        return fp.state_bytes
    if fp.memory == "sliding-window" and fp.sliding_window > 0:
        return fp.sliding_window * max(0, fp.kv_bytes_per_token)
    return 0


def swa_ring_cells(fp: Footprint, options: LoadOptions) -> int:
    """The cells of llama.cpp's SWA cache when it is a ring (``LoadOptions.swa_full`` False) in
    the layout ``options`` (``base.swa_ring_cells``), the micro-batch as the llama backend rounds
    the session's."""
    n_seq = max(1, options.n_seq)
    cells = options.pool_tokens if options.unified else options.window
    ubatch = micro_batch(fp.micro_batch or 512, n_seq)
    return ring_cells(fp.sliding_window, n_seq, ubatch, unified=options.unified, cells=cells)


def kv_cost(fp: Footprint, options: LoadOptions, *, swa_full: bool | None = None) -> int:
    """The KV a layout allocates at load: ``pool_tokens`` cells of every layer's KV, except that
    a sliding window's local layers keep only :func:`swa_ring_cells` with a ring (``swa_full``:
    the setting to count; None: ``options.swa_full``)."""
    ring = not (options.swa_full if swa_full is None else swa_full)
    if not ring or fp.sliding_window <= 0 or fp.swa_kv_bytes_per_token <= 0:
        return kv_allocated_bytes(options.pool_tokens, fp.kv_bytes_per_token)
    cells = swa_ring_cells(fp, options)
    return kv_allocated_bytes(options.pool_tokens, fp.kv_bytes_per_token, cells, fp.swa_kv_bytes_per_token)


def state_cost(fp: Footprint, options: LoadOptions) -> tuple[int, int]:
    """What a layout's sequences hold beside their KV cells: every sequence's recurrent state
    (llama.cpp allocates one per sequence at load), and the checkpoints the layout may keep
    (``options.checkpoints`` per sequence: recurrent states, or sliding windows' cells)."""
    return (
        options.n_seq * max(0, fp.state_bytes),
        options.n_seq * options.checkpoints * checkpoint_size(fp),
    )


def load_cost(fp: Footprint, options: LoadOptions) -> int:
    """What a model loaded with ``options`` counts against the memory budget: its weights, the
    layout's KV and compute buffer, the per-model rest, the sequences' recurrent states and
    their checkpoints."""
    cells = options.pool_tokens if options.unified else options.window
    return (
        fp.weights_bytes
        + kv_cost(fp, options)
        + compute_bytes(fp, cells)
        + MODEL_OVERHEAD_BYTES
        + sum(state_cost(fp, options))
    )


def layout_name(options: LoadOptions) -> str:
    """``unified/4:8704`` (4 sequences sharing 8704 cells) or ``split/4`` (4 streams of a window)."""
    if options.unified:
        return f"unified/{options.n_seq}:{options.pool_tokens}"
    return f"split/{options.n_seq}"


def plan_layout(
    *,
    sequences: int,
    unified: bool,
    pool_tokens: int,
    window: int,
    fp: Footprint,
    room: int | None,
    checkpoints: int = 8,
    swa_full: bool = True,
) -> tuple[LoadOptions, str]:
    """The KV layout a model loads with: ``sequences`` sequences of ``window`` tokens, in a
    unified pool (``pool_tokens`` cells, 0: one window) or in split streams of a window each
    (also when ``unified`` asks for a pool of at least ``sequences`` windows: the same capacity).
    A window larger than the pool is cut to the pool. ``room``: the bytes the memory budget
    leaves for this model (None: no limit). A split
    layout that does not fit gets fewer sequences (at least 1); a unified pool that does not fit
    is made smaller, and the window with it. Returns the options and a note for the log ("" when
    the settings fit as asked)."""
    n_seq = max(1, sequences)

    def cost(o: LoadOptions) -> int:
        cells = o.pool_tokens if o.unified else o.window
        return (
            fp.weights_bytes
            + kv_cost(fp, o)
            + compute_bytes(fp, cells)
            + MODEL_OVERHEAD_BYTES
            + sum(state_cost(fp, o))
        )

    split = LoadOptions(
        n_seq=n_seq, window=window, pool_tokens=n_seq * window, checkpoints=checkpoints, swa_full=swa_full
    )
    budgeted = room is not None and fp.kv_bytes_per_token > 0
    if unified and pool_tokens >= n_seq * window and (not budgeted or cost(split) <= (room or 0)):
        # A pool that holds every sequence's whole window gains nothing from sharing it (no
        # sequence may grow past its window): split streams hold the same, stay exact, and no
        # sequence's attention spans another's cells (three concurrent turns in one unified
        # pool each paid for all three contexts' cells: blueprint 0016).
        return split, ""
    if unified:
        pool = pool_tokens or window
        options = LoadOptions(
            n_seq=n_seq,
            window=min(window, pool),
            pool_tokens=pool,
            unified=True,
            checkpoints=checkpoints,
            swa_full=swa_full,
        )
    else:
        options = split
    if not budgeted:
        return options, ""
    assert room is not None
    if cost(options) <= room:
        return options, ""
    if not unified:
        while options.n_seq > 1 and cost(options) > room:
            options = replace(options, n_seq=options.n_seq - 1, pool_tokens=(options.n_seq - 1) * window)
        if cost(options) <= room:
            return (
                options,
                f"{n_seq} sequences of {window} tokens would not fit in the memory budget; using {options.n_seq}",
            )
    fits = _largest(lambda w: cost(_resized(options, w)) <= room, options.pool_tokens if unified else window)
    if fits <= 0:
        return options, ""  # nothing fits: the load is refused by the budget check (with its numbers)
    resized = _resized(options, fits)
    return resized, (
        f"a {layout_name(options)} KV of {window}-token windows would not fit in the memory budget; "
        f"using {layout_name(resized)} with {resized.window}-token windows"
    )


def _resized(options: LoadOptions, cells: int) -> LoadOptions:
    """``options`` with its pool (unified) or windows (split) made ``cells`` cells."""
    if options.unified:
        return replace(options, window=min(options.window, cells), pool_tokens=cells)
    return replace(options, window=cells, pool_tokens=options.n_seq * cells)


def _largest(fits: Callable[[int], bool], upper: int) -> int:
    """The largest multiple of :data:`CELL_PAD` up to ``upper`` for which ``fits`` holds (0: none);
    ``fits`` must be monotonic (true up to some size, false beyond)."""
    lo, hi = 0, max(0, upper) // CELL_PAD
    while lo < hi:
        mid = (lo + hi + 1) // 2
        if fits(mid * CELL_PAD):
            lo = mid
        else:
            hi = mid - 1
    return lo * CELL_PAD


def max_window(fp: Footprint, *, unified: bool, pool_tokens: int, budget: int, trained: int) -> int:
    """The largest window whose smallest layout fits in ``budget``: one split stream, or a unified
    pool of one window (a unified pool of ``pool_tokens`` cells when that is set: no window is
    larger than its pool). Capped at the trained window (``trained``, 0: unknown); a window
    found by search is a multiple of :data:`CELL_PAD`."""
    upper = min(trained or _MAX_WINDOW, _MAX_WINDOW)
    if fp.kv_bytes_per_token <= 0:
        return upper

    def fits(cells: int) -> bool:
        total = (
            fp.weights_bytes + cells * fp.kv_bytes_per_token + compute_bytes(fp, cells) + MODEL_OVERHEAD_BYTES
        )
        return total <= budget

    if unified and pool_tokens:
        if fits(pool_tokens):
            return min(upper, pool_tokens)
        upper = min(upper, pool_tokens)
    best = _largest(fits, upper)
    return upper if best and fits(upper) else best


def footprint(fp: Footprint, options: LoadOptions, *, budget: int, trained: int, max_fit: int) -> Footprint:
    """``fp`` (the model's own figures) completed with the layout ``options`` within ``budget``."""
    cells = options.pool_tokens if options.unified else options.window
    kv = kv_cost(fp, options)
    compute = compute_bytes(fp, cells)
    states, checkpoints = state_cost(fp, options)
    swa = fp.memory == "sliding-window" and fp.swa_kv_bytes_per_token > 0
    return replace(
        fp,
        swa_ring=swa and not options.swa_full,
        swa_full_kv_bytes=kv_cost(fp, options, swa_full=True) if swa else 0,
        swa_ring_kv_bytes=kv_cost(fp, options, swa_full=False) if swa else 0,
        warm=(WARM_SWA_FULL if options.swa_full else WARM_SWA_RING) if swa else fp.warm,
        checkpoint_bytes=checkpoints,
        trained_window=trained,
        trained_kv_bytes=trained * fp.kv_bytes_per_token,
        layout=layout_name(options),
        window=options.window,
        kv_bytes=kv,
        compute_bytes=compute,
        overhead_bytes=MODEL_OVERHEAD_BYTES,
        total_bytes=fp.weights_bytes + kv + compute + MODEL_OVERHEAD_BYTES + states + checkpoints,
        budget_bytes=budget,
        max_window=max_fit,
    )


class ModelFacts(Protocol):
    """What a backend read from a model file (``GGUFInfo``, an OpenVINO ``Source``)."""

    @property
    def name(self) -> str: ...
    @property
    def digest(self) -> str: ...
    @property
    def context_length(self) -> int: ...
    @property
    def weights_bytes(self) -> int: ...
    @property
    def vocab_size(self) -> int: ...
    @property
    def tokenizer_digest(self) -> str: ...
    @property
    def chat_template(self) -> str: ...
    @property
    def add_bos(self) -> bool: ...
    @property
    def bos_token(self) -> str: ...
    @property
    def eos_token(self) -> str: ...
    @property
    def architecture(self) -> str: ...


def model_info(
    request: OpenSessionRequest,
    facts: ModelFacts,
    *,
    backend: str,
    version: str,
    kv_bytes_per_token: int,
    memory_budget: int | None,
    template_digest: str,
    device: str,
    capabilities: Capabilities,
    special_tokens: tuple[SpecialToken, ...],
    footprint: Footprint | None = None,
) -> ModelInfo:
    """The one assembly of a model file's description (``memory_budget`` None: the default)."""
    config = request.config
    trained = facts.context_length or config.num_ctx
    fp = footprint or Footprint(weights_bytes=facts.weights_bytes, kv_bytes_per_token=kv_bytes_per_token)
    effective = effective_context(
        trained=trained,
        requested=config.num_ctx,
        memory_budget=memory_budget,
        weights_bytes=facts.weights_bytes,
        kv_bytes_per_token=kv_bytes_per_token,
        compute_floor_bytes=compute_bytes(fp, 0),
    )
    return ModelInfo(
        backend=backend,
        backend_version=version,
        path=request.path,
        model_name=request.model_name or facts.name,
        model_digest=facts.digest,
        model_max_context=trained,
        effective_context=effective,
        kv_bytes_per_token=kv_bytes_per_token,
        free_bytes=psutil.virtual_memory().available,
        weights_bytes=facts.weights_bytes,
        vocab_size=facts.vocab_size,
        tokenizer_digest=facts.tokenizer_digest,
        template_digest=template_digest,
        chat_template=facts.chat_template,
        add_bos=facts.add_bos,
        bos_token=facts.bos_token,
        eos_token=facts.eos_token,
        device=device,
        capabilities=capabilities,
        special_tokens=special_tokens,
        tool_format=detect_format(facts.chat_template),
        architecture=facts.architecture,
        footprint=footprint
        or Footprint(weights_bytes=facts.weights_bytes, kv_bytes_per_token=kv_bytes_per_token),
    )
