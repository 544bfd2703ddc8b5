"""How big a model's context may be, and what a model takes in memory, computed before loading.

* ``effective_context = min(trained context, requested num_ctx, what fits in free memory after the
  weights and a stated overhead)`` (blueprints/0009); weights already mapped by a loaded model of
  the same digest are not counted twice. The engine then caps it by the memory budget under the
  configured KV layout (:func:`max_window`).
* The KV layout a model is loaded with (:func:`plan_layout`, blueprint 0016): a unified pool of
  one window that every sequence may fill (the default, llama-server's ``-np auto``), or split
  streams of a full window each (``kv_unified`` off: warm output bit-identical to a fresh
  evaluation by construction, ``n`` windows of memory).
* :func:`footprint`: what the model will take (weights, KV, the engine's compute buffer, the
  per-model rest) under that layout, and the largest window that fits the budget
  (:class:`~modeld.contract.Footprint`; ``modeld describe``).
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from dataclasses import replace

from modeld.backends.base import LoadOptions
from modeld.backends.probe import MAX_SHOWN_PATH, show_path
from modeld.contract import Footprint
from modeld.errors import ModelLoadError

__all__ = [
    "CELL_PAD",
    "MODEL_OVERHEAD",
    "WeightsInUse",
    "check_digest",
    "compute_bytes",
    "effective_context",
    "footprint",
    "layout_name",
    "max_window",
    "plan_layout",
]

MODEL_OVERHEAD = 128 << 20
"""Memory counted per loaded model beyond its weights, KV and compute buffer: the worker process
(Python, modeld, llama.cpp's own small buffers). Measured on the test models: the worker's
anonymous memory outside the KV and compute buffers is 40-125 MiB (``python -m bench.kv_layout
memory``; blueprint 0016)."""

CELL_PAD = 256
"""llama.cpp pads a context to a multiple of 256 cells: windows are planned in these steps."""

_MAX_WINDOW = 1 << 24


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
    free_bytes: int,
    weights_bytes: int,
    kv_bytes_per_token: int,
    overhead: int,
) -> int:
    if kv_bytes_per_token <= 0:
        fits = requested
    else:
        fits = max(0, (free_bytes - weights_bytes - overhead) // kv_bytes_per_token)
    return max(0, min(trained or requested, requested, fits))


def compute_bytes(fp: Footprint, cells: int) -> int:
    """The engine's compute buffer for a context of ``cells`` cells (the model's estimate)."""
    return max(fp.compute_floor_bytes, fp.compute_fixed_bytes + fp.compute_bytes_per_token * max(0, cells))


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
) -> tuple[LoadOptions, str]:
    """The KV layout a model loads with: ``sequences`` sequences of ``window`` tokens, in a
    unified pool (``pool_tokens`` cells, 0: one window) or in split streams of a window each.
    A window larger than the pool is cut to the pool. ``room``: the bytes the memory budget
    leaves for this model (None: no limit). A split
    layout that does not fit gets fewer sequences (at least 1); a unified pool that does not fit
    is made smaller, and the window with it. Returns the options and a note for the log ("" when
    the settings fit as asked)."""
    n_seq = max(1, sequences)
    if unified:
        pool = pool_tokens or window
        options = LoadOptions(n_seq=n_seq, window=min(window, pool), pool_tokens=pool, unified=True)
    else:
        options = LoadOptions(n_seq=n_seq, window=window, pool_tokens=n_seq * window)
    if room is None or fp.kv_bytes_per_token <= 0:
        return options, ""

    def cost(o: LoadOptions) -> int:
        cells = o.pool_tokens if o.unified else o.window
        return (
            fp.weights_bytes
            + o.pool_tokens * fp.kv_bytes_per_token
            + compute_bytes(fp, cells)
            + MODEL_OVERHEAD
        )

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
        total = fp.weights_bytes + cells * fp.kv_bytes_per_token + compute_bytes(fp, cells) + MODEL_OVERHEAD
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
    kv = options.pool_tokens * fp.kv_bytes_per_token
    compute = compute_bytes(fp, cells)
    return replace(
        fp,
        trained_window=trained,
        trained_kv_bytes=trained * fp.kv_bytes_per_token,
        layout=layout_name(options),
        window=options.window,
        kv_bytes=kv,
        compute_bytes=compute,
        overhead_bytes=MODEL_OVERHEAD,
        total_bytes=fp.weights_bytes + kv + compute + MODEL_OVERHEAD,
        budget_bytes=budget,
        max_window=max_fit,
    )


class WeightsInUse:
    """Which model digests have a loaded runtime (their weights are already in memory)."""

    def __init__(self) -> None:
        self._count: dict[str, int] = {}
        self._lock = threading.Lock()

    def add(self, digest: str) -> None:
        with self._lock:
            self._count[digest] = self._count.get(digest, 0) + 1

    def remove(self, digest: str) -> None:
        with self._lock:
            self._count[digest] = max(0, self._count.get(digest, 0) - 1)

    def __contains__(self, digest: object) -> bool:
        return bool(isinstance(digest, str) and self._count.get(digest))
