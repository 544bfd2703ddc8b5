"""A loaded model's memory in parts, for ``modeld status`` and ``/metrics``.

The parts of a worker: the model file's pages it has resident (measured from its mappings),
the KV pool the engine allocated at load (exact: llama.cpp allocates and clears what the layout
names), the compute buffer as reserved (the model's estimate, within 5% of llama.cpp's own
figure), and the process before the model loaded (measured then). With the daemon's RSS split
into the RAM tier (exact) and the rest, they add up to what the kernel counts, within
:func:`accounting_tolerance`. Design record: ``blueprints/0016-warm-state.md``.
"""

from __future__ import annotations

from modeld.backends.sizing import compute_bytes
from modeld.engine.model import LoadedModel
from modeld.observe.memory import file_rss
from modeld.observe.status import ModelMemory, WorkerInfo

__all__ = ["ACCOUNTING_SLACK", "accounting_tolerance", "model_memory"]

ACCOUNTING_SLACK = 32 << 20
"""Bytes by which the parts may differ from the kernel's count, besides a share of it (what a
worker holds beyond its parts: the vocabulary's Python objects, the engine's logits and batch
buffers, thread stacks; measured 8-13 MiB on the test models, blueprint 0016)."""
ACCOUNTING_SHARE = 0.02


def accounting_tolerance(measured: int) -> int:
    """How far the sum of the parts may be from ``measured`` bytes of RSS, besides the compute
    buffers not yet touched (``DaemonMemory.adds_up``)."""
    return ACCOUNTING_SLACK + int(ACCOUNTING_SHARE * measured)


def model_memory(model: LoadedModel, worker: WorkerInfo) -> ModelMemory:
    """``model``'s parts now (``worker``: its worker's status, with its RSS and pid)."""
    layout = model.layout
    per = layout.kv_bytes_per_token
    fp = model.info.footprint
    has_compute = bool(fp.compute_floor_bytes or fp.compute_fixed_bytes or fp.compute_bytes_per_token)
    cells = layout.pool_tokens if layout.shared_cells else layout.window
    process = worker.isolation == "process" and worker.pid > 0 and worker.rss_bytes > 0
    return ModelMemory(
        isolation=worker.isolation,
        weights_bytes=file_rss(worker.pid, model.info.path) if process else 0,
        # Recurrent and hybrid memory: every sequence's state too, allocated at load (157 MiB
        # each on a 27B hybrid; 0 KV bytes a token on a pure recurrent model).
        kv_allocated_bytes=layout.kv_allocated_bytes + layout.n_seq * layout.state_bytes,
        kv_used_bytes=model.cache.used_cells() * per,
        checkpoint_bytes=sum(model.supervisor.checkpoint_bytes),
        compute_bytes=compute_bytes(fp, cells) if has_compute else 0,
        runtime_bytes=model.supervisor.base_rss if process else 0,
        rss_bytes=worker.rss_bytes if process else 0,
    )
