"""What ``modeld status``, ``logs``, ``describe`` and ``explain-context`` print for a person
(``--json`` prints the data).

:func:`format_status` renders a :class:`~modeld.observe.status.DaemonStatus`: who owns the machine,
the machine itself (what a coordinator places models by), the RAM and disk tiers, and per
loaded model its engine worker (pid, state, uptime, restarts and why, RSS), where its memory
goes (weights, KV allocated and used, compute buffer, runtime; the daemon's own and the RAM tier
beside them, with whether the parts add up to the measured RSS), its admission
slots, its cumulative reuse counters and every warm context with the tier it lives in; then
the settings and limits in force. :func:`format_logs` renders the workers' last log lines
(``StatusRequest.debug``). :func:`format_model_info` renders ``modeld describe``,
:func:`format_sessions` and :func:`format_report` ``modeld explain-context`` (a session's
context, its manifest and segments, why its last turn was warm, restored or cold).

What not: fetching (the command line does), colours, or anything that needs a terminal: the
output is plain text that survives ``| head`` and ``| grep``.
"""

from __future__ import annotations

import time
from collections.abc import Iterable, Sequence

from modeld.contract import ContextReport, ModelInfo, PrefixStatus, WarmContextInfo
from modeld.observe.status import (
    DaemonMemory,
    DaemonStatus,
    LoadedModelSummary,
    Machine,
    ModelMemory,
    SessionSummary,
    TierStatus,
    WorkerInfo,
)

__all__ = [
    "age",
    "format_bytes",
    "format_logs",
    "format_model_info",
    "format_report",
    "format_sessions",
    "format_status",
    "match_models",
    "short",
    "table",
]

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
    # Checkpoints (memory that cannot be cut at any token) sit beside the KV, shown when held.
    ckpts = f" + checkpoints {format_bytes(m.checkpoint_bytes)}" if m.checkpoint_bytes else ""
    if m.isolation != "process":
        return (
            f"    memory    inline (part of the daemon's own) · KV {format_bytes(m.kv_allocated_bytes)} "
            f"allocated, {format_bytes(m.kv_used_bytes)} used{ckpts}"
        )
    return (
        f"    memory    weights {format_bytes(m.weights_bytes)} + KV {format_bytes(m.kv_allocated_bytes)} "
        f"({format_bytes(m.kv_used_bytes)} used){ckpts} + compute {format_bytes(m.compute_bytes)} + runtime "
        f"{format_bytes(m.runtime_bytes)} = {format_bytes(m.parts_bytes)} · RSS {format_bytes(m.rss_bytes)}"
    )


def _counters(c: dict[str, int]) -> list[str]:
    """The model's cumulative counters, each labelled as its metric counts it
    (``modeld_prefix_cache_queries``, ``_hits{source}``, ``modeld_prompt_tokens_prefilled``,
    ``modeld_evictions{to}``, ``modeld_snapshots_rejected``)."""
    return [
        f"    prefixes  {c.get('queries', 0)} tokens looked up · reused from kv {c.get('reused_kv', 0)}, "
        f"ram {c.get('reused_ram', 0)}, disk {c.get('reused_disk', 0)}, shared {c.get('reused_shared', 0)}",
        f"    prefill   {c.get('prefilled', 0)} prompt tokens computed (prefixes, suffixes, recomputed ones) · "
        f"{c.get('recomputed', 0)} a session had computed before · contexts brought back before "
        f"asked {c.get('prefetched', 0)}",
        f"    evicted   to ram {c.get('evicted_to_ram', 0)}, disk {c.get('evicted_to_disk', 0)}, dropped "
        f"{c.get('evicted_dropped', 0)} · snapshots taken {c.get('snapshots_taken', 0)}, rejected "
        f"{c.get('snapshots_rejected', 0)} · prefixes copied {c.get('copies', 0)}",
    ]


def _model(m: LoadedModelSummary, now: float, debug: bool) -> list[str]:
    head = (
        f"  {m.model_name or '-'}  {m.backend} · digest {short(m.model_digest)} · window {m.n_ctx} · "
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
        rendered = _contexts(m.contexts, now)
        lines.append(f"    contexts  {rendered[0]}")
        lines += [f"              {row}" for row in rendered[1:]]
    else:
        lines.append("    contexts  none warm")
    if debug and m.worker is not None:
        lines += _log_lines(m.worker, indent="      ", title="    log")
    return lines


def _contexts(
    contexts: Iterable[WarmContextInfo], now: float, *, mark: str = "", indent: str = ""
) -> list[str]:
    """A model's warm contexts as a table, the one whose id is ``mark`` starred."""
    contexts = list(contexts)
    checkpoints = any(c.checkpoint_bytes for c in contexts)  # memory that cannot be cut anywhere
    rows = [
        ("ID", "TIER", "TOKENS", "PREFIX", "BYTES", "SHARED")
        + (("CHECKPOINTS",) if checkpoints else ())
        + ("LAST USE", "PINNED", "SESSION")
    ]
    for c in contexts:
        # In RAM or on disk a context's checkpoints are inside its snapshot, counted in BYTES.
        held = format_bytes(c.checkpoint_bytes) if c.tier == "kv" else "(in bytes)"
        rows.append(
            (
                c.id + (" *" if mark and c.id == mark else ""),
                c.tier,
                str(c.tokens),
                str(c.prefix_tokens),
                format_bytes(c.bytes),
                format_bytes(c.shared_bytes),
                *((held,) if checkpoints else ()),
                f"{age(now - c.last_used_at)} ago",
                "yes" if c.pinned else "no",
                c.session_id or "-",
            )
        )
    return table(rows, indent=indent)


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


# --- modeld describe, explain-context ------------------------------------------------------


def short(digest: str, n: int = 12) -> str:
    """A digest's first characters, ``-`` for none."""
    return digest[:n] if digest else "-"


def format_model_info(info: ModelInfo, num_ctx: int, kv_cache_type: str, flash_attn: bool) -> str:
    """What ``modeld describe`` prints: the model, its context and where its memory goes under
    the asked window, KV precision and attention."""
    fp = info.footprint
    rows = [
        ("model", f"{info.model_name}  ({info.path})"),
        ("backend", f"{info.backend} {info.backend_version} on {info.device}"),
        ("digest", info.model_digest),
        (
            "context",
            f"{info.effective_context} tokens effective (trained {info.model_max_context}, asked {num_ctx})",
        ),
        (
            "kv cache",
            f"{info.kv_bytes_per_token} bytes per token ({kv_cache_type}); "
            f"{format_bytes(info.kv_bytes_per_token * info.effective_context)} at the effective context",
        ),
        ("weights", format_bytes(info.weights_bytes)),
    ]
    if fp.memory != "attention":
        # Memory that cannot be cut at any token: what it is, what it keeps, where it is cut.
        if fp.swa_ring:
            cache = "a ring of SWA cells (--no-swa-full): the local layers keep about a window per sequence"
        else:
            cache = "llama.cpp's full-size SWA cache: the KV above counts every layer at every token"
        what = fp.memory + (
            f", a window of {fp.sliding_window} tokens ({cache})" if fp.sliding_window else ""
        )
        if fp.state_bytes:
            what += f"; a recurrent state of {format_bytes(fp.state_bytes)} per sequence"
        rows.append(("memory", what))
        rows.append(("cuts", fp.cuts))
        if fp.warm:
            rows.append(("warm output", fp.warm))
        if fp.swa_full_kv_bytes:
            rows.append(
                (
                    "swa cache",
                    f"full-size {format_bytes(fp.swa_full_kv_bytes)} of KV (--swa-full, the default), "
                    f"a ring {format_bytes(fp.swa_ring_kv_bytes)} (--no-swa-full); the local layers hold "
                    f"{fp.swa_kv_bytes_per_token} of the {fp.kv_bytes_per_token} bytes a token",
                )
            )
        if fp.checkpoint_bytes:
            each = "each one state" if fp.state_bytes else "each one window's KV, at most"
            rows.append(("checkpoints", f"up to {format_bytes(fp.checkpoint_bytes)} ({each})"))
    if fp.layout:
        attention = "flash attention on" if flash_attn else "flash attention off"
        rows += [
            (
                "trained kv",
                f"{format_bytes(fp.trained_kv_bytes)} for one trained window ({fp.trained_window} tokens)",
            ),
            (
                "layout",
                f"{fp.layout}: {format_bytes(fp.kv_bytes)} of KV allocated at load ({_layout_words(fp.layout)})",
            ),
            ("compute", f"~{format_bytes(fp.compute_bytes)} (llama.cpp's compute buffer, {attention})"),
            (
                "total",
                f"~{format_bytes(fp.total_bytes)} = weights + KV + compute"
                + (" + states" if fp.state_bytes else "")
                + (" + checkpoints" if fp.checkpoint_bytes else "")
                + f" + {format_bytes(fp.overhead_bytes)} per model (budget {format_bytes(fp.budget_bytes)})",
            ),
            ("max window", f"{fp.max_window} tokens fit the budget under this layout"),
        ]
    rows += [
        ("free memory", format_bytes(info.free_bytes)),
        ("vocabulary", f"{info.vocab_size} tokens, tokenizer {short(info.tokenizer_digest)}"),
        ("template", _template_words(info)),
        ("bos", "added" if info.add_bos else "not added"),
        (
            "capabilities",
            f"truncation={'yes' if info.capabilities.truncation else 'no'} reuse={info.capabilities.reuse} "
            f"formats={','.join(info.capabilities.prompt_formats)} "
            f"speculation={','.join(info.capabilities.speculation)}"
            + (
                " (memory that cannot be cut at any token: no rejected draft could be taken back exactly)"
                if "ngram" not in info.capabilities.speculation and fp.memory != "attention"
                else ""
            ),
        ),
    ]
    return "\n".join(f"{k:<13} {v}" for k, v in rows)


def _template_words(info: ModelInfo) -> str:
    """The chat template: its digest, where it comes from, and the formats read from it."""
    if not info.chat_template:
        return f"{short(info.template_digest)} (none)"
    source = {"model": "the model file's", "override": "an override (--chat-template-file)"}.get(
        info.template_source, "present"
    )
    return (
        f"{short(info.template_digest)} ({source}); tool calls {info.tool_format or 'not recognised'}, "
        f"reasoning {info.reasoning_format or 'none recognised'}"
    )


def _layout_words(layout: str) -> str:
    """``unified/4:8704`` -> "4 sequences share 8704 cells"; ``split/4`` -> "4 streams of a window"."""
    shape, _, n = layout.partition("/")
    if shape == "unified":
        seqs, _, pool = n.partition(":")
        return (
            f"{seqs} sequences share {pool} cells; warm output is bit-identical to a fresh evaluation "
            "for a context alone in the pool and can differ when contexts share it"
        )
    streams = "1 stream" if n == "1" else f"{n} streams"
    return f"{streams} of a window each; warm output bit-identical to a fresh evaluation"


def format_sessions(sessions: Sequence[SessionSummary], now: float) -> str:
    """One line per open session (``modeld explain-context`` without an id)."""
    # TOKENS: the session's context (prefix, suffix, generated); IN KV: how many of
    # them the engine holds now (fewer once evicted: the next operation restores them).
    rows = [("SESSION", "MODEL", "BACKEND", "TOKENS/CTX", "IN KV", "PREFIX", "LAST", "STREAM", "IDLE")]
    for s in sessions:
        rows.append(
            (
                s.session_id,
                s.model_name,
                s.backend,
                f"{s.resident_tokens}/{s.num_ctx}",
                str(s.kv_tokens),
                str(s.prefix_tokens),
                s.last_outcome or "-",
                "attached" if s.attached else "detached",
                age(now - s.last_used_at),
            )
        )
    return "\n".join(table(rows))


def _numerics(r: ContextReport) -> str:
    """Whether warm output equals a fresh evaluation here, and why (blueprint 0016)."""
    if r.warm_exact:
        return f"warm output is bit-identical to a fresh evaluation (KV layout {r.kv_layout})"
    return (
        f"warm output can differ from a fresh evaluation (KV layout {r.kv_layout}: a unified pool; "
        "the attention sums in another order when other contexts hold cells, enough to change greedy "
        "tokens; bit-identical while this context is alone in the pool; "
        "`modeld serve --no-kv-unified` makes it exact by construction, at a window of memory per sequence)"
    )


def _speculation(r: ContextReport) -> str:
    """What speculation did over the session's decodes (blueprint 0021)."""
    line = f"speculation {r.speculation} (last decode)"
    if r.draft_batches:
        line += (
            f"; {r.accepted_tokens} of {r.drafted_tokens} drafted tokens accepted "
            f"({r.accepted_tokens / r.drafted_tokens:.0%}) in {r.draft_batches} batches "
            f"(mean draft {r.drafted_tokens / r.draft_batches:.1f})"
        )
    if r.forced_tokens:
        line += f"; {r.forced_tokens} tokens forced by constraints"
    return line


def format_report(r: ContextReport) -> str:
    state = "closed" if r.closed else "open"
    out = [
        f"session   {r.session_id}  ({r.backend} model {r.model_name!r}, owner epoch {r.owner_epoch}, {state})",
        f"context   {r.resident_tokens} of {r.num_ctx} tokens: prefix {r.prefix_tokens}, suffix {r.suffix_tokens}, "
        f"generated {r.generated_tokens}; {r.available_tokens} available; {r.kv_tokens} of them in the KV now",
        f"manifest  {r.manifest_digest or '-'}",
    ]
    if r.kv_layout:
        out.append(f"numerics  {_numerics(r)}")
    if r.speculation:
        out.append(f"decode    {_speculation(r)}")
    m = r.manifest
    if m is not None:
        out.append(
            f"  backend {m.backend} {m.backend_version} · model {short(m.model_digest)} · tokenizer "
            f"{short(m.tokenizer_digest)} · format {m.prompt_format} · template {short(m.prompt_template_digest)} · "
            f"runtime {short(m.runtime_digest)} · bos {'yes' if m.add_bos else 'no'}"
            + (f" · profile {m.profile_id}" if m.profile_id else "")
        )
        out.append(
            f"  stable {m.stable_bytes} bytes (bytes {short(m.stable_byte_hash)}, tokens {short(m.stable_token_hash)}) · "
            f"total {m.total_bytes} bytes · volatile tokens {short(m.volatile_token_hash)}"
        )
        if m.segments:
            rows = [("  KIND", "TOKENS", "BYTES", "STABLE", "CLASS", "HASH")]
            for s in m.segments:
                tokens = f"{s.token_start}-{s.token_end}" if s.token_start is not None else "?"
                rows.append(
                    (
                        f"  {s.kind} {s.role}" if s.kind == "message" else f"  {s.kind}",
                        tokens,
                        f"{s.byte_start}-{s.byte_end}",
                        "yes" if s.stable else "no",
                        s.cache_class or "-",
                        short(s.hash),
                    )
                )
            if r.tools_token_start is not None and r.tools_token_end is not None:
                # Not a segment of the text: the template renders tools_json (often the largest part).
                rows.append(
                    ("  tools", f"{r.tools_token_start}-{r.tools_token_end}", "(template)", "yes", "-", "-")
                )
            out.append("segments")
            out.extend(table(rows))
    if r.last_reuse is not None:
        d = r.last_reuse
        out.append(
            f"last ensure_prefix: {d.outcome.upper()} ({d.reason}{': ' + d.field if d.field else ''}) - {d.message}"
        )
        if d.diverged_at_token is not None:
            out.append(
                f"  diverged at token {d.diverged_at_token}"
                + (f", byte {d.diverged_at_byte}" if d.diverged_at_byte is not None else "")
                + (f", in segment {d.diverged_segment!r}" if d.diverged_segment else "")
            )
        if r.last_prefix is not None:
            p = r.last_prefix
            out.append(
                f"  reused {p.reused_tokens} · prefilled {p.prefilled_tokens} · dropped {p.dropped_tokens}"
            )
    else:
        out.append("last ensure_prefix: none yet")
    if r.ahead is not None:
        out.extend(_ahead_lines(r.ahead))
    for c in r.changing_segments:
        out.append(
            f"likely cause of repeated misses: stable segment {c.kind!r} #{c.position} (segment {c.index}) "
            f"changed on each of the last {c.turns} prefixes; move what changes (a timestamp, a request id) "
            "into the volatile suffix"
        )
    out.extend(_warm_state_lines(r))
    return "\n".join(out)


def _ahead_lines(p: PrefixStatus) -> list[str]:
    """The last prefix computed ahead of a turn (``--prefill-ahead``), apart from the turns."""
    d = p.reuse
    out = [
        f"last prefix computed ahead of a turn: {p.prefix_tokens} tokens, {p.reused_tokens} of them warm, "
        f"{p.prefilled_tokens} computed while the user read ({d.outcome}, {d.reason})"
    ]
    if d.diverged_at_token is not None:
        out.append(
            f"  diverged at token {d.diverged_at_token}"
            + (f", in segment {d.diverged_segment!r}" if d.diverged_segment else "")
            + ": the template renders the conversation otherwise once a user message follows the answer"
        )
    return out


_COLD_WHY = {
    "empty_cache": "nothing compatible was warm",
    "engine_reset": "the engine's state was lost (a failed operation or a worker restart)",
    "manifest_changed": "a runtime field of the manifest changed, so no warm context was compatible",
    "truncation_unsupported": "the model's memory cannot be cut inside a warm context",
    "snapshot_rejected": "the snapshot that would have served was refused and removed",
    "diverged": "the prefix differs from every warm context from its first token",
}


def _warm_state_lines(r: ContextReport) -> list[str]:
    """Where the session's warm context lives, why its last turn was warm, restored or cold, its
    place in the model's queue, pin and keep-alive, and the server-side timings."""
    now = time.time()
    out = ["warm state"]
    own = next((c for c in r.contexts if c.id == r.context_id), None) if r.context_id else None
    where = (
        f"context {own.id} in the {own.tier} tier ({own.tokens} tokens, {format_bytes(own.bytes)})"
        if own is not None
        else "no warm context in the KV now"
        + (" (closed)" if r.closed else " (the next operation restores or recomputes it)")
    )
    keep = (
        f"keep-alive {_num(r.keep_alive_seconds)}s"
        if r.keep_alive_seconds
        else "kept until the pool needs room"
    )
    out.append(f"  this session  {where} · {'pinned' if r.pinned else 'not pinned'} · {keep}")
    d, p = r.last_reuse, r.last_prefix
    if d is not None:
        if d.reason == "restored_from_shared" or (d.outcome != "cold" and d.tier == "shared"):
            turn = f"{d.outcome}: restored from the shared store (snapshot {d.context or '?'}, written by this or another box)"
        elif d.reason in ("restored_from_ram", "restored_from_disk") or (
            d.outcome != "cold" and d.tier in ("ram", "disk")
        ):
            turn = f"{d.outcome}: restored from the {d.tier} tier (snapshot {d.context or '?'})"
        elif d.outcome != "cold":
            turn = f"{d.outcome}: reused from the KV" + (f" (warm context {d.context})" if d.context else "")
        elif d.reason == "evicted":
            went = f"evicted to the {d.tier} tier" if d.tier in ("ram", "disk") else "evicted and dropped"
            turn = f"cold: this session's warm context had been {went}"
        else:
            turn = f"cold: {_COLD_WHY.get(d.reason, d.reason)}"
        if p is not None:
            turn += f" · reused {p.reused_tokens} of {p.prefix_tokens} tokens · prefill {p.prefill_ms:.1f} ms"
            if p.restore_ms or d.tier in ("ram", "disk", "shared"):
                turn += f" · restore {p.restore_ms:.1f} ms"
        out.append(f"  last turn     {turn}")
    if r.queue_position:
        out.append(
            f"  queue         waiting for a slot: position {r.queue_position}, {r.queue_wait_seconds:.1f}s so far"
        )
    else:
        out.append(f"  queue         not waiting (last wait {r.queue_wait_seconds:.1f}s)")
    if r.contexts:
        out.append("  the model's warm contexts (* this session's)")
        out.extend(_contexts(r.contexts, now, mark=r.context_id, indent="    "))
    return out
