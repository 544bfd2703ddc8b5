"""What ``modeld status`` and ``modeld logs`` print for a person (``--json`` prints the data).

:func:`format_status` renders a :class:`~modeld.contract.DaemonStatus`: who owns the machine,
the machine itself (what a coordinator places models by), the RAM and disk tiers, and per
loaded model its engine worker (pid, state, uptime, restarts and why, RSS), where its memory
goes (weights, KV allocated and used, compute buffer, runtime; the daemon's own and the RAM tier
beside them, with whether the parts add up to the measured RSS), its admission
slots, its cumulative reuse counters and every warm context with the tier it lives in; then
the settings and limits in force. :func:`format_logs` renders the workers' last log lines
(``StatusRequest.debug``).

What not: fetching (the command line does), colours, or anything that needs a terminal: the
output is plain text that survives ``| head`` and ``| grep``.
"""

from __future__ import annotations

import time
from collections.abc import Iterable, Sequence

from modeld.contract import (
    DaemonMemory,
    DaemonStatus,
    LoadedModelSummary,
    Machine,
    ModelMemory,
    TierStatus,
    WorkerInfo,
)

__all__ = ["age", "format_bytes", "format_logs", "format_status", "match_models", "table"]

_BYTE_SETTINGS = ("ram_tier_bytes", "disk_tier_bytes", "memory_budget_bytes", "shared_store_bytes")


def age(seconds: float) -> str:
    """``42s``, ``3m05s``, ``2h07m``, ``3d04h``."""
    seconds = max(0.0, seconds)
    if seconds < 60:
        return f"{seconds:.0f}s"
    if seconds < 3600:
        return f"{seconds // 60:.0f}m{seconds % 60:02.0f}s"
    if seconds < 86400:
        return f"{seconds // 3600:.0f}h{(seconds % 3600) // 60:02.0f}m"
    return f"{seconds // 86400:.0f}d{(seconds % 86400) // 3600:02.0f}h"


def format_bytes(n: float) -> str:
    for unit, size in (("TiB", 1 << 40), ("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if n >= size:
            return f"{n / size:.2f} {unit}"
    return f"{n:.0f} B"


def table(rows: Sequence[Sequence[str]], indent: str = "") -> list[str]:
    """Rows as left-aligned columns (the first row is the header)."""
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    return [indent + "  ".join(c.ljust(w) for c, w in zip(r, widths, strict=True)).rstrip() for r in rows]


def _num(value: float) -> str:
    return str(int(value)) if float(value).is_integer() else f"{value:g}"


def _plural(n: int, word: str) -> str:
    return f"{n} {word}" if n == 1 else f"{n} {word}s"


def _machine(m: Machine) -> list[str]:
    accelerators = (
        ", ".join(
            f"{a.kind} {a.name}" + (f" ({format_bytes(a.memory_bytes)})" if a.memory_bytes else "")
            for a in m.accelerators
        )
        or "no accelerators"
    )
    lines = [
        f"machine   {_plural(m.cpu_count, 'CPU')} · RAM {format_bytes(m.ram_available_bytes)} free of "
        f"{format_bytes(m.ram_total_bytes)} · disk {format_bytes(m.disk_free_bytes)} free · {accelerators}"
    ]
    lines += [f"          problem: {p}" for p in m.problems]
    return lines


def _tiers(t: TierStatus) -> list[str]:
    def tier(name: str, entries: int, held: int, budget: int, off: str = "") -> str:
        if not budget:
            return f"{name}  off (budget 0)"
        line = f"{name}  {_plural(entries, 'snapshot')}, {format_bytes(held)} of {format_bytes(budget)}"
        return line + (f"  OFF: {off}" if off else "")

    ram = tier("ram ", t.ram_entries, t.ram_bytes, t.ram_budget)
    disk = tier("disk", t.disk_entries, t.disk_bytes, t.disk_budget, t.disk_off_reason)
    shared = (
        [
            f"          shared {_plural(t.shared_entries, 'snapshot')}, {format_bytes(t.shared_bytes)} of "
            f"{format_bytes(t.shared_budget)} in {t.shared_location} · written {t.shared_written} · restored "
            f"{t.shared_restored} · rejected {t.shared_rejected} · write failures {t.shared_write_failures}"
        ]
        if t.shared_location
        else []
    )
    lines = [
        f"tiers     {ram}",
        f"          {disk}",
        *shared,
        f"          written {t.written} · spilled to disk {t.spilled_to_disk} · dropped {t.dropped} · "
        f"rejected {t.rejected} · write failures {t.write_failures}",
        f"          memory budget {format_bytes(t.memory_budget)} (the loaded models and the RAM tier)",
    ]
    if t.recent_rejections:
        lines.append("          recent rejections:")
        lines += [f"            {r}" for r in t.recent_rejections]
    return lines


def _worker(w: WorkerInfo, now: float) -> list[str]:
    parts = [f"pid {w.pid}" if w.pid else "no process", f"{w.state} ({w.isolation})"]
    if w.started_at and w.pid:
        parts.append(f"up {age(now - w.started_at)}")
    if w.rss_bytes:
        parts.append(f"RSS {format_bytes(w.rss_bytes)}")
    restarts = _plural(w.restarts, "restart")
    if w.last_restart_at:
        restarts += f", last {age(now - w.last_restart_at)} ago"
    parts.append(restarts)
    lines = [f"    worker    {' · '.join(parts)}"]
    if w.last_restart_reason:
        lines.append(f"              last restart: {w.last_restart_reason}")
    if w.last_error and w.last_error != w.last_restart_reason:
        lines.append(f"              last error: {w.last_error}")
    return lines


def _memory(d: DaemonMemory) -> str:
    """The daemon's memory in parts, and whether every part adds up to what the kernel counts."""
    verdict = "adds up" if d.adds_up() else "DOES NOT ADD UP"
    untouched = (
        f", compute buffers up to {format_bytes(d.untouched_max_bytes)} not yet touched"
        if d.untouched_max_bytes
        else ""
    )
    return (
        f"memory    daemon {format_bytes(d.own_bytes)} + RAM tier {format_bytes(d.ram_tier_bytes)} "
        f"(RSS {format_bytes(d.rss_bytes)}) · all parts {format_bytes(d.parts_bytes)}, measured "
        f"{format_bytes(d.measured_bytes)}: {verdict} (within {format_bytes(d.tolerance_bytes)}{untouched})"
    )


def _model_memory(m: ModelMemory) -> str:
    if m.isolation != "process":
        return (
            f"    memory    inline (part of the daemon's own) · KV {format_bytes(m.kv_allocated_bytes)} "
            f"allocated, {format_bytes(m.kv_used_bytes)} used"
        )
    return (
        f"    memory    weights {format_bytes(m.weights_bytes)} + KV {format_bytes(m.kv_allocated_bytes)} "
        f"({format_bytes(m.kv_used_bytes)} used) + compute {format_bytes(m.compute_bytes)} + runtime "
        f"{format_bytes(m.runtime_bytes)} = {format_bytes(m.parts_bytes)} · RSS {format_bytes(m.rss_bytes)}"
    )


def _counters(c: dict[str, int]) -> list[str]:
    """The model's cumulative counters, each labelled as its metric counts it
    (``modeld_prefix_cache_queries``, ``_hits{source}``, ``modeld_prompt_tokens_prefilled``,
    ``modeld_evictions{to}``, ``modeld_snapshots_rejected``)."""
    return [
        f"    prefixes  {c.get('queries', 0)} tokens looked up · reused from kv {c.get('reused_kv', 0)}, "
        f"ram {c.get('reused_ram', 0)}, disk {c.get('reused_disk', 0)}, shared {c.get('reused_shared', 0)}",
        f"    prefill   {c.get('prefilled', 0)} prompt tokens computed (prefixes, suffixes, recomputed ones)",
        f"    evicted   to ram {c.get('evicted_to_ram', 0)}, disk {c.get('evicted_to_disk', 0)}, dropped "
        f"{c.get('evicted_dropped', 0)} · snapshots taken {c.get('snapshots_taken', 0)}, rejected "
        f"{c.get('snapshots_rejected', 0)} · prefixes copied {c.get('copies', 0)}",
    ]


def _model(m: LoadedModelSummary, now: float, debug: bool) -> list[str]:
    head = (
        f"  {m.model_name or '-'}  {m.backend} · digest {m.model_digest[:12] or '-'} · window {m.n_ctx} · "
        f"{_plural(m.sessions, 'session')} · idle {age(now - m.last_used_at)}"
    )
    lines = [head]
    if m.worker is not None:
        lines += _worker(m.worker, now)
    lines.append(
        f"    slots     {m.busy_slots} of {m.slots} busy · {m.queued} queued · {_plural(m.sequences, 'sequence')}"
        + (f" · pool {m.pool_tokens} tokens" if m.pool_tokens else "")
        + (f" · {format_bytes(m.kv_bytes_per_token)} per token" if m.kv_bytes_per_token else "")
        + f" · {m.resident_tokens} tokens resident"
    )
    lines.append(_model_memory(m.memory))
    lines += _counters(dict(m.counters))
    if m.contexts:
        rows = [("ID", "TIER", "TOKENS", "PREFIX", "BYTES", "SHARED", "LAST USE", "PINNED", "SESSION")]
        for c in m.contexts:
            rows.append(
                (
                    c.id,
                    c.tier,
                    str(c.tokens),
                    str(c.prefix_tokens),
                    format_bytes(c.bytes),
                    format_bytes(c.shared_bytes),
                    f"{age(now - c.last_used_at)} ago",
                    "yes" if c.pinned else "no",
                    c.session_id or "-",
                )
            )
        rendered = table(rows)
        lines.append(f"    contexts  {rendered[0]}")
        lines += [f"              {row}" for row in rendered[1:]]
    else:
        lines.append("    contexts  none warm")
    if debug and m.worker is not None:
        lines += _log_lines(m.worker, indent="      ", title="    log")
    return lines


def _log_lines(w: WorkerInfo, *, indent: str, title: str) -> list[str]:
    if w.isolation != "process":
        return [f"{title} (the model runs inline: its lines are in the daemon's log)"]
    if not w.log_lines:
        return [f"{title} (no lines from worker pid {w.pid} yet)"]
    return [f"{title} (last {_plural(len(w.log_lines), 'line')} of worker pid {w.pid})"] + [
        indent + line for line in w.log_lines
    ]


def _settings(settings: dict[str, str]) -> str:
    shown = []
    for key, value in sorted(settings.items()):
        if key in _BYTE_SETTINGS and value.lstrip("-").isdigit():
            number = int(value)
            value = "auto" if number < 0 else ("off" if number == 0 else format_bytes(number))
        shown.append(f"{key}={value}")
    return "settings  " + " ".join(shown)


def format_status(status: DaemonStatus, *, debug: bool = False, now: float | None = None) -> str:
    """``modeld status`` for a person (``debug``: each worker's last log lines too)."""
    now = time.time() if now is None else now
    lines = [
        f"modeld {status.version}  instance {status.instance_id}  epoch {status.epoch}  pid {status.pid}",
        f"endpoint  {status.endpoint}",
        f"uptime    {age(status.uptime_seconds)}",
        f"backends  {', '.join(status.backends)} (default {status.default_backend})",
        f"sessions  {status.sessions}",
    ]
    if status.owner_lost:
        lines.append(f"OWNERSHIP LOST: {status.owner_lost}")
    if status.machine is not None:
        lines += _machine(status.machine)
    if status.tiers is not None:
        lines += _tiers(status.tiers)
    if status.memory.measured_bytes:
        lines.append(_memory(status.memory))
    if status.models:
        lines.append(f"models    {len(status.models)} loaded")
        for model in status.models:
            lines += _model(model, now, debug)
    else:
        lines.append("models    none loaded")
    if status.settings:
        lines.append(_settings(dict(status.settings)))
    lines.append("limits    " + " ".join(f"{k}={_num(v)}" for k, v in sorted(status.limits.items())))
    return "\n".join(lines)


def match_models(models: Iterable[LoadedModelSummary], name: str) -> list[LoadedModelSummary]:
    """The loaded models ``name`` designates: by model name, file name or path, or a digest prefix."""
    found = []
    for m in models:
        base = m.path.rstrip("/").rsplit("/", 1)[-1]
        if name in (m.model_name, m.path, base) or (len(name) >= 6 and m.model_digest.startswith(name)):
            found.append(m)
    return found


def format_logs(models: Sequence[LoadedModelSummary]) -> str:
    """The last log lines of each model's worker (``modeld logs``)."""
    lines: list[str] = []
    for m in models:
        if m.worker is None:
            continue
        title = f"== {m.model_name or m.path} ({m.backend}, {m.worker.state})"
        lines += _log_lines(m.worker, indent="", title=title)
    return "\n".join(lines)
