"""Settings of the warm state and the engine workers, in one typed place.

``modeld serve`` sets them from its flags (``modeld serve --help``) and ``modeld status`` shows
them; :class:`~modeld.engine.limits.Limits` holds the limits on client input beside them and the
timeout profile is :class:`Timeouts`. Every default is chosen from a
measurement recorded in ``blueprints/0016-warm-state.md``.
"""

from __future__ import annotations

from dataclasses import dataclass, fields

__all__ = ["ISOLATIONS", "Residency", "RestartPolicy", "Timeouts"]

ISOLATIONS = ("auto", "process", "inline")


@dataclass(frozen=True, slots=True)
class Residency:
    """Where warm state lives, and how much of it."""

    sequences: int = 4
    """Warm KV sequences per loaded model (each session's turn runs on its own)."""
    kv_unified: bool = True
    """One KV pool shared by every sequence (llama.cpp ``kv_unified``, llama-server's default):
    any sequence may grow to the whole pool, a copied prefix is stored once, and the pool is
    one window, so a model takes one window of KV however many sequences it keeps warm (more
    warm contexts live in the RAM and disk tiers). Warm output is bit-identical to a fresh
    evaluation while a context is alone in the pool and can differ when contexts share it (the
    attention sums in another order); ``explain-context`` says which. Off: each sequence has its own window of
    cells (``sequences`` windows of memory), and warm output is bit-identical by construction.
    Chosen by measurement: blueprint 0016."""
    pool_tokens: int = 0
    """With ``kv_unified``: KV cells in the pool (0: one window; a smaller pool caps the window)."""
    ram_tier_bytes: int = -1
    """RAM tier budget; -1: a quarter of the RAM available at start (at most 8 GiB); 0: off."""
    disk_tier_bytes: int = -1
    """Disk tier budget under the data directory; -1: a tenth of its free space (at most
    32 GiB); 0: off."""
    memory_budget_bytes: int = -1
    """Weights + KV of all loaded models; beyond it the least recently used idle model is
    unloaded (its warm contexts saved to the tiers first). -1: 90% of the machine's RAM."""
    isolation: str = "auto"
    """``process``: each loaded model runs in a supervised worker process; ``inline``: in the
    daemon (only sensible for the memory backend); ``auto``: inline for memory, else process."""
    slots: int = 0
    """Operations a model runs at once (0: as many as ``sequences``)."""
    max_queue: int = 64
    """Operations that may wait for a slot of one model."""
    snapshot_min_tokens: int = 64
    """Shorter warm contexts are not worth a snapshot."""
    persist_min_tokens: int = 512
    """A prefix this long, just computed, is written to the disk tier at once."""
    shared_store: str = ""
    """A directory several daemons mount (NFS, a shared volume): persisted snapshots are written
    through to it and a miss looks there, so a conversation moved to another box restores
    (blueprint 0020). "": none."""
    shared_store_bytes: int = -1
    """The shared store's budget; -1: a tenth of its file system's free space (at most 64
    GiB); give every daemon of a fleet the same value."""

    def as_dict(self) -> dict[str, str]:
        return {f.name: str(getattr(self, f.name)) for f in fields(self)}


@dataclass(frozen=True, slots=True)
class Timeouts:
    """The daemon's timeout profile (``modeld serve`` flags; 0 switches one off)."""

    load_seconds: float = 600.0
    """Loading a model (the worker's answer to ``Load``)."""
    stall_seconds: float = 120.0
    """A busy worker with no progress and no CPU time for this long is killed (``stall_timeout``)."""
    idle_stream_seconds: float = 300.0
    """A decode that produces no token for this long is stopped (``timeout``)."""
    operation_seconds: float = 0.0
    """Any one operation (prefill or decode) longer than this is stopped (``timeout``); off by default."""
    drain_seconds: float = 60.0
    """On SIGTERM or ``modeld drain``: how long turns already running may take to finish before
    the daemon persists its warm contexts and exits (new turns get 503 at once; blueprint 0020)."""
    stream_interval_seconds: float = 0.05
    """A decode's tokens that come faster than this are streamed together, each at most this
    late (the first at once); 0: every token on its own. Each message costs the daemon and its
    client CPU that the engine's threads lose: 50 ms is 20 updates a second and measured
    decode tok/s over gRPC at 0.97 of direct llama.cpp, against 0.93 token by token
    (blueprint 0017)."""


@dataclass(frozen=True, slots=True)
class RestartPolicy:
    backoff_initial: float = 0.5
    backoff_max: float = 30.0
    crash_limit: int = 5
    crash_window: float = 300.0
