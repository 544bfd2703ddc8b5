"""What the daemon shows about itself: ``modeld status``, ListSessions, the engine's events.

The Status call returns a :class:`DaemonStatus` (who owns the machine, the machine, the tiers,
each loaded model with its worker, memory and warm contexts, the settings and limits in
force); ListSessions one :class:`SessionSummary` per session. :class:`EngineObserver` is what
the engine reports as it happens, to metrics and health. ``modeld/observe/views.py`` renders
them for people, ``modeld/wire/convert.py`` carries them over gRPC.

What not: what a Service or Session speaks (``modeld/contract.py``): a session's own report
(``ContextReport``, with the warm contexts it can see) stays there.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Protocol

from modeld.contract import WarmContextInfo

__all__ = [
    "Accelerator",
    "DaemonMemory",
    "DaemonStatus",
    "EngineObserver",
    "LoadedModelSummary",
    "Machine",
    "ModelMemory",
    "SessionSummary",
    "TierStatus",
    "WorkerInfo",
]


class EngineObserver(Protocol):
    """What the engine reports as it happens, to metrics and health (the daemon subscribes).

    Called on engine threads; an observer must be quick and must not raise."""

    def queue_waited(self, seconds: float) -> None:
        """An operation waited ``seconds`` for a slot of a busy model."""
        ...

    def worker_restarted(self) -> None:
        """An engine worker died (or hung) and is being restarted."""
        ...

    def model_state(self, model_name: str, state: str) -> None:
        """A loaded model's worker changed state (ready, restarting, failed, stopped)."""
        ...


@dataclass(frozen=True, slots=True)
class WorkerInfo:
    """An engine worker as ``modeld status`` shows it."""

    pid: int
    state: str  # loading, ready, busy, restarting, failed, stopped
    isolation: str  # process or inline
    started_at: float
    restarts: int
    last_error: str
    last_restart_reason: str
    last_restart_at: float
    rss_bytes: int
    log_lines: tuple[str, ...] = ()


@dataclass(frozen=True, slots=True)
class ModelMemory:
    """Where a loaded model's memory goes, in bytes (``modeld status``, ``/metrics``; blueprint
    0016, "Accounting that adds up to RSS"). Measured where the kernel can say, exact where
    llama.cpp allocates what the layout names.

    ``weights_bytes``: the model file's pages resident in its worker (measured: the worker's
    mappings of the file); ``kv_allocated_bytes``: the KV pool the engine allocated (and cleared:
    resident whole) when it loaded, ``pool_tokens x kv_bytes_per_token``, with every sequence's
    recurrent state on recurrent and hybrid memory (``n_seq x Layout.state_bytes``, allocated at
    load too); ``checkpoint_bytes``: the checkpoints the worker's sequences hold now (memory that
    cannot be cut at any token: recurrent states or sliding windows, taken as prefills pass and
    kept in the worker's heap beside the KV; exact, as the worker counts them: its last reply
    says); ``kv_used_bytes``: the
    cells the warm contexts hold now (a shared prefix once), part of the allocated pool;
    ``compute_bytes``: the engine's compute buffer as it reserved it (the model's estimate,
    within 5% of llama.cpp's figure; touched only as far as the cells in use, so it counts in
    full once a long prefill has run); ``runtime_bytes``: the worker process just before it
    loaded the model (Python, modeld, the engine's libraries; measured then); ``rss_bytes``: the
    worker's resident set now (measured). A model run inline (in the daemon) has no worker: its
    memory is part of the daemon's own."""

    isolation: str = "process"
    weights_bytes: int = 0
    kv_allocated_bytes: int = 0
    kv_used_bytes: int = 0
    compute_bytes: int = 0
    runtime_bytes: int = 0
    rss_bytes: int = 0
    checkpoint_bytes: int = 0

    @property
    def parts_bytes(self) -> int:
        """What the parts say the worker holds (0 inline)."""
        if self.isolation != "process":
            return 0
        return (
            self.weights_bytes
            + self.kv_allocated_bytes
            + self.checkpoint_bytes
            + self.compute_bytes
            + self.runtime_bytes
        )


@dataclass(frozen=True, slots=True)
class DaemonMemory:
    """The daemon's and its workers' memory, in parts that add up to their resident sets.

    ``rss_bytes``: the daemon's resident set (measured); ``ram_tier_bytes``: the snapshots the
    RAM tier holds (exact; only contexts evicted from a KV pool); ``own_bytes``: the rest of
    the daemon (its RSS minus the RAM tier: Python, gRPC, sessions, inline models). Per model,
    :class:`ModelMemory` (``LoadedModelSummary.memory``). ``parts_bytes`` is the sum of every
    part (the daemon's own and RAM tier, and per worker its weights, KV pool, checkpoints,
    compute buffer and runtime); ``measured_bytes`` the daemon's and the workers' RSS as the kernel counts it.
    The compute buffers count as reserved (``untouched_max_bytes``, their sum), and the engine
    touches a buffer only as far as the cells in use: a long prefill makes it resident, until
    then the parts exceed the measure by at most that much. So the parts add up when
    ``measured - tolerance <= parts <= measured + untouched_max + tolerance``
    (``tolerance_bytes``: a worker's heap and the engine's small buffers; :meth:`adds_up`)."""

    rss_bytes: int = 0
    ram_tier_bytes: int = 0
    own_bytes: int = 0
    parts_bytes: int = 0
    measured_bytes: int = 0
    tolerance_bytes: int = 0
    untouched_max_bytes: int = 0

    def adds_up(self, measured: int | None = None) -> bool:
        """Do the parts add up to ``measured`` bytes of RSS (default: the status's own measure)?"""
        rss = self.measured_bytes if measured is None else measured
        over = self.parts_bytes - rss
        return -self.tolerance_bytes <= over <= self.untouched_max_bytes + self.tolerance_bytes


@dataclass(frozen=True, slots=True)
class Accelerator:
    kind: str  # nvidia, openvino
    name: str
    memory_bytes: int = 0
    driver: str = ""


@dataclass(frozen=True, slots=True)
class Machine:
    """What a coordinator needs to place models: the machine the daemon runs on."""

    cpu_count: int
    ram_total_bytes: int
    ram_available_bytes: int
    disk_free_bytes: int
    accelerators: tuple[Accelerator, ...] = ()
    problems: tuple[str, ...] = ()


@dataclass(frozen=True, slots=True)
class TierStatus:
    """The RAM and disk tiers: contents, budgets, and what happened to snapshots."""

    ram_entries: int = 0
    ram_bytes: int = 0
    ram_budget: int = 0
    disk_entries: int = 0
    disk_bytes: int = 0
    disk_budget: int = 0
    disk_off_reason: str = ""
    written: int = 0
    write_failures: int = 0
    spilled_to_disk: int = 0
    dropped: int = 0
    rejected: int = 0
    memory_budget: int = 0
    recent_rejections: tuple[str, ...] = ()
    shared_location: str = ""  # the shared snapshot store ("" : none; blueprint 0020)
    shared_entries: int = 0
    shared_bytes: int = 0
    shared_budget: int = 0
    shared_written: int = 0  # snapshots this daemon wrote through to it
    shared_write_failures: int = 0
    shared_restored: int = 0  # snapshots this daemon restored from it
    shared_rejected: int = 0  # snapshots refused (corrupt, foreign) and removed
    shared_lookups: int = 0  # misses that looked it up
    shared_read_failures: int = 0  # snapshots gone between listing and reading (a miss)
    shared_pending: int = 0  # snapshots on their way to it (queued, or still being written to disk)


@dataclass(frozen=True, slots=True)
class SessionSummary:
    """One line of ``modeld explain-context`` without an id. ``resident_tokens`` counts the
    session's context (prefix + suffix + generated), ``kv_tokens`` how many of those are in the
    engine's KV now (as ``ContextReport``)."""

    session_id: str
    model_name: str
    backend: str
    path: str
    owner_epoch: int
    opened_at: float
    last_used_at: float
    num_ctx: int
    resident_tokens: int
    prefix_tokens: int
    available_tokens: int
    last_outcome: str
    closed: bool
    attached: bool = False
    kv_tokens: int = 0


@dataclass(frozen=True, slots=True)
class LoadedModelSummary:
    """A model kept loaded by the engine: its warm contexts, counters and worker.

    ``resident_tokens`` counts KV cells in use (a shared prefix once); ``counters`` are
    cumulative tokens reused from the KV / RAM / disk, tokens prefilled, evictions, rejected
    snapshots (``blueprints/0016``)."""

    backend: str
    path: str
    model_name: str
    model_digest: str
    n_ctx: int
    resident_tokens: int
    sessions: int
    loaded_at: float
    last_used_at: float
    sequences: int = 1
    pool_tokens: int = 0
    kv_bytes_per_token: int = 0
    slots: int = 1
    busy_slots: int = 0
    queued: int = 0
    contexts: tuple[WarmContextInfo, ...] = ()
    counters: Mapping[str, int] = field(default_factory=dict)
    worker: WorkerInfo | None = None
    busy_tokens: int = 0  # of resident_tokens, held by running operations (the rest can give way)
    memory: ModelMemory = field(default_factory=ModelMemory)


@dataclass(frozen=True, slots=True)
class DaemonStatus:
    """``modeld status``: who owns the machine, since when, and what is loaded."""

    instance_id: str
    epoch: int
    pid: int
    endpoint: str
    version: str
    started_at: float
    uptime_seconds: float
    backends: tuple[str, ...]
    default_backend: str
    models: tuple[LoadedModelSummary, ...]
    sessions: int
    limits: Mapping[str, float]
    owner_lost: str = ""
    tiers: TierStatus | None = None
    machine: Machine | None = None
    settings: Mapping[str, str] = field(default_factory=dict)
    memory: DaemonMemory = field(default_factory=DaemonMemory)
