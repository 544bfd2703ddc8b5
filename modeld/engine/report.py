"""What ``modeld status`` says about the engine's parts: each loaded model, the tiers, the
daemon's memory in parts and the machine (the types: :mod:`modeld.observe.status`).

:meth:`~modeld.engine.engine.Engine.status` gathers them under its lock; these functions only
read the parts they are given. Design records ``blueprints/0015-metrics.md`` (where each number
comes from) and ``blueprints/0016-warm-state.md`` (the memory in parts).
"""

from __future__ import annotations

import os
import time
from dataclasses import fields, replace
from pathlib import Path

from modeld.cache.tiers import Tiers
from modeld.engine.memory import accounting_tolerance, model_memory
from modeld.engine.model import LoadedModel
from modeld.observe.memory import rss as process_rss
from modeld.observe.status import Accelerator, DaemonMemory, LoadedModelSummary, Machine, TierStatus

__all__ = ["daemon_memory", "fields_of", "machine", "model_summary", "tier_status"]


def model_summary(model: LoadedModel, *, debug: bool, listed: set[str]) -> LoadedModelSummary:
    """A loaded model as ``modeld status`` shows it: its layout, slots, warm contexts, memory and
    worker (``listed``: the tier snapshots already shown under another model)."""
    base = model.summary()
    worker = model.supervisor.status(debug=debug)
    return replace(
        base,
        sequences=model.layout.n_seq,
        pool_tokens=model.layout.pool_tokens,
        kv_bytes_per_token=model.layout.kv_bytes_per_token,
        slots=model.admission.slots,
        busy_slots=model.admission.busy,
        queued=model.admission.queued,
        busy_tokens=model.cache.busy_cells(),
        contexts=model.warm_contexts(listed),
        counters=dict(model.cache.counters),
        memory=model_memory(model, worker),
        worker=worker,
    )


def daemon_memory(models: tuple[LoadedModelSummary, ...], tiers: Tiers) -> DaemonMemory:
    """The daemon's memory in parts (its own, the RAM tier) beside its models' (each
    summary's ``memory``), and what the kernel counts for all of it."""
    rss = process_rss(os.getpid())
    ram = int(tiers.stats()["ram_bytes"])
    workers = sum(m.memory.rss_bytes for m in models if m.memory.isolation == "process")
    own = max(0, rss - ram)
    measured = rss + workers
    return DaemonMemory(
        rss_bytes=rss,
        ram_tier_bytes=ram,
        own_bytes=own,
        parts_bytes=own + ram + sum(m.memory.parts_bytes for m in models),
        measured_bytes=measured,
        tolerance_bytes=accounting_tolerance(measured),
        untouched_max_bytes=sum(m.memory.compute_bytes for m in models if m.memory.isolation == "process"),
    )


def tier_status(tiers: Tiers, memory_budget: int) -> TierStatus:
    """The RAM and disk tiers as ``modeld status`` shows them."""
    stats = tiers.stats()
    return TierStatus(
        **{k: v for k, v in stats.items() if k in TierStatus.__dataclass_fields__},  # type: ignore[arg-type]
        memory_budget=memory_budget,
        recent_rejections=tuple(
            f"{time.strftime('%Y-%m-%d %H:%M:%S', time.localtime(r.at))} {r.file}: {r.reason}"
            for r in tiers.recent_rejections()
        ),
    )


def machine(data_dir: Path | None) -> Machine:
    """The machine, for placement (hardware inventory; never waits for a slow probe)."""
    from modeld.observe.hardware import inventory

    hw = inventory(data_dir, wait=False)
    accelerators = tuple(
        Accelerator(kind="nvidia", name=g.name, memory_bytes=g.memory_total_bytes, driver=g.driver_version)
        for g in hw.gpus
    ) + tuple(
        Accelerator(kind="openvino", name=d.full_name or d.name, memory_bytes=d.memory_total_bytes or 0)
        for d in hw.openvino_devices
    )
    return Machine(
        cpu_count=hw.cpu_count,
        ram_total_bytes=hw.ram_total_bytes,
        ram_available_bytes=hw.ram_available_bytes,
        disk_free_bytes=hw.disk_free_bytes,
        accelerators=accelerators,
        problems=tuple(f"{part}: {why}" for part, why in hw.problems),
    )


def fields_of(obj: object) -> dict[str, object]:
    """A settings dataclass's fields by name (its ``settings`` lines in the status)."""
    return {f.name: getattr(obj, f.name) for f in fields(obj)}  # type: ignore[arg-type]
