"""The live page's state and the request records, as JSON (the routes: ``routes.py``).

:func:`page_state` is everything the page draws, computed on the observers' pool from three
sources and nothing else: the engine's status (models, workers, the KV pool, tiers, memory,
warm contexts: what ``modeld status`` prints), the request records (turns, per conversation:
what ``/v1/requests`` and ``modeld requests`` list) and the metrics' own counters (what
``/metrics`` exposes). A conversation's sums are its records' counts, which are the very
numbers counted into the metrics (``modeld/observe/turns.py``), so per model they add up to
:func:`metric_totals` exactly while the ring holds the model's turns (blueprint 0022).

Prompt text never appears: a record holds ids, labels, counts, segment kinds and positions; its
``excerpt`` is filled only when the daemon runs with ``--ui-show-prompts``.
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable, Iterable
from typing import Any

from prometheus_client import Counter

from modeld import __version__
from modeld.contract import ContextReport, WarmContextInfo
from modeld.observe.metrics import Metrics, model_label
from modeld.observe.records import COUNTED, REFUSALS, Records, RequestRecord, Tally, conversation_of
from modeld.observe.status import DaemonStatus, LoadedModelSummary

__all__ = [
    "REFUSALS",
    "metric_totals",
    "page_state",
    "page_text",
    "records_part",
    "status_part",
    "waiting_turns",
]

WAITING_CHECKS = 8
"""Running turns asked about, per push, whether they wait for a slot."""
WAITING_AFTER_SECONDS = 0.5
"""A turn is asked about once it has run this long without progress or a first token."""
MAX_CONVERSATIONS = 300
"""Conversations the page receives (the most recently used); the count says how many exist."""
RECENT_RECORDS = 50
"""Records the page receives with each state; a conversation's turns beyond them it fetches
(``/v1/requests?conversation=``)."""
_TIER_ORDER = {"kv": 0, "ram": 1, "disk": 2, "shared": 3}


def _counter(counter: Counter, labels: Iterable[str] = ("model",)) -> dict[tuple[str, ...], float]:
    """A counter's values by label values (its ``_total`` samples)."""
    names = tuple(labels)
    out: dict[tuple[str, ...], float] = {}
    for family in counter.collect():
        for sample in family.samples:
            if sample.name.endswith("_total"):
                key = tuple(sample.labels.get(n, "") for n in names)
                out[key] = out.get(key, 0.0) + sample.value
    return out


def metric_totals(metrics: Metrics) -> dict[str, dict[str, int]]:
    """The metrics' counters per model, under the records' names (:data:`COUNTED`)."""
    out: dict[str, dict[str, int]] = {}

    def put(model: str, name: str, value: float) -> None:
        out.setdefault(model, dict.fromkeys(COUNTED, 0))[name] += int(value)

    for (model,), value in _counter(metrics.queries).items():
        put(model, "prefix_tokens", value)
    for (model, source), value in _counter(metrics.hits, ("model", "source")).items():
        put(model, f"reused_{source}", value)
    for name, counter in (
        ("prefilled_tokens", metrics.prefilled),
        ("prompt_tokens", metrics.prompt),
        ("cached_tokens", metrics.cached),
        ("generated_tokens", metrics.generated),
        ("decodes", metrics.requests),
        ("draft_batches", metrics.drafts),
        ("drafted_tokens", metrics.draft_tokens),
        ("accepted_tokens", metrics.accepted_tokens),
        ("forced_tokens", metrics.forced_tokens),
    ):
        for (model,), value in _counter(counter).items():
            put(model, name, value)
    return out


def _model(m: LoadedModelSummary, label: str) -> dict[str, Any]:
    worker = m.worker
    mem = m.memory
    # The pool's cells: each warm context's own (its bytes over a cell's), the prefixes they share
    # (stored once), the free ones; they add up to the pool.
    per_cell = m.kv_bytes_per_token
    used = {
        c.session_id or c.id: (c.bytes // per_cell if per_cell else c.tokens)
        for c in m.contexts
        if c.tier == "kv"
    }
    shared = max(0, m.resident_tokens - sum(used.values()))
    return {
        "name": m.model_name,
        "label": label,
        "backend": m.backend,
        "n_ctx": m.n_ctx,
        "sequences": m.sequences,
        "pool_tokens": m.pool_tokens,
        "resident_tokens": m.resident_tokens,
        "busy_tokens": m.busy_tokens,
        "free_tokens": max(0, m.pool_tokens - m.resident_tokens),
        "kv_bytes_per_token": m.kv_bytes_per_token,
        "contexts_in_kv": used,
        "shared_tokens": shared,
        "slots": m.slots,
        "busy_slots": m.busy_slots,
        "queued": m.queued,
        "sessions": m.sessions,
        "counters": dict(m.counters),
        "worker": None
        if worker is None
        else {
            "pid": worker.pid,
            "state": worker.state,
            "isolation": worker.isolation,
            "restarts": worker.restarts,
            "rss_bytes": worker.rss_bytes,
            "last_error": worker.last_error[:200],
        },
        "memory": {
            "isolation": mem.isolation,
            "weights": mem.weights_bytes,
            "kv_allocated": mem.kv_allocated_bytes,
            "kv_used": mem.kv_used_bytes,
            "checkpoints": mem.checkpoint_bytes,
            "compute": mem.compute_bytes,
            "runtime": mem.runtime_bytes,
            "rss": mem.rss_bytes,
        },
    }


def _tiers(status: DaemonStatus) -> dict[str, Any]:
    t = status.tiers
    if t is None:
        return {}
    out: dict[str, Any] = {
        "ram": {"bytes": t.ram_bytes, "entries": t.ram_entries, "budget": t.ram_budget},
        "disk": {
            "bytes": t.disk_bytes,
            "entries": t.disk_entries,
            "budget": t.disk_budget,
            "off": t.disk_off_reason,
        },
        "memory_budget": t.memory_budget,
    }
    if t.shared_location:
        out["shared"] = {
            "bytes": t.shared_bytes,
            "entries": t.shared_entries,
            "budget": t.shared_budget,
            "written": t.shared_written,
            "restored": t.shared_restored,
            "rejected": t.shared_rejected,
            "write_failed": t.shared_write_failures,
            "lookups": t.shared_lookups,
            "pending": t.shared_pending,
        }
    return out


def _conversations(
    status: DaemonStatus, tallies: list[Tally], running: list[RequestRecord]
) -> list[dict[str, Any]]:
    """Every conversation the records know and every warm context (one row each): its key and
    labels from its newest record, where its context is (tier, tokens, last use, pinned) from
    the status, and its finished records' sums."""
    contexts: dict[str, list[tuple[str, WarmContextInfo]]] = {}
    for m in status.models:
        for c in m.contexts:
            contexts.setdefault(c.session_id or f"context:{c.id}", []).append((model_label(m.model_name), c))
    busy: dict[str, int] = {}
    for r in running:
        key = conversation_of(r)
        busy[key] = busy.get(key, 0) + 1
    rows: dict[str, dict[str, Any]] = {}
    seen: set[str] = set()
    for t in tallies:
        session = t.last.session if t.last else ""
        seen.add(session)
        rows[t.key] = _row(t.key, t, contexts.get(session, []), busy.get(t.key, 0))
    for session, held in contexts.items():
        if session not in seen:
            key = session if session.startswith("context:") else f"grpc:{session}"
            rows[key] = _row(key, None, held, busy.get(key, 0))
    for key, n in busy.items():
        if key not in rows:
            rows[key] = _row(key, None, [], n)
    return sorted(rows.values(), key=lambda r: -float(r["last_used_at"] or 0))


def _row(
    key: str, tally: Tally | None, held: list[tuple[str, WarmContextInfo]], running: int
) -> dict[str, Any]:
    best = min(held, key=lambda h: _TIER_ORDER.get(h[1].tier, 9), default=None)
    context = best[1] if best is not None else None
    last = tally.last if tally is not None else None
    return {
        "key": key,
        "job": last.job if last else "",
        "agent": last.agent if last else "",
        "api": last.api if last else "",
        "model": (last.model if last else "") or (best[0] if best else ""),
        "session": last.session if last else (context.session_id if context else ""),
        "context": context.id if context else "",
        "tier": context.tier if context else "",
        "tiers": sorted({h[1].tier for h in held}, key=lambda t: _TIER_ORDER.get(t, 9)),
        "tokens": context.tokens if context else 0,
        "bytes": sum(h[1].bytes for h in held),
        "pinned": any(h[1].pinned for h in held),
        "last_used_at": max(
            context.last_used_at if context else 0.0, (last.ended_at or last.started_at) if last else 0.0
        ),
        "turns": tally.turns if tally else 0,
        "running": running,
        "last_outcome": last.outcome if last else "",
        "last_reason": last.reason if last else "",
        "sums": dict(tally.sums) if tally else dict.fromkeys(COUNTED, 0),
    }


def status_part(status: DaemonStatus, records: Records, metrics: Metrics) -> dict[str, Any]:
    """What the page draws of the status and the counters (rebuilt every few seconds)."""
    label = {m.model_name: metrics.label(m.model_name) for m in status.models}
    return {
        "daemon": {
            "instance": status.instance_id,
            "epoch": status.epoch,
            "version": __version__,
            "uptime_seconds": status.uptime_seconds,
            "sessions": status.sessions,
            "owner_lost": status.owner_lost,
        },
        "models": [_model(m, label[m.model_name]) for m in status.models],
        "tiers": _tiers(status),
        "memory": {
            "own": status.memory.own_bytes,
            "ram_tier": status.memory.ram_tier_bytes,
            "parts": status.memory.parts_bytes,
            "measured": status.memory.measured_bytes,
            "adds_up": status.memory.adds_up(),
        },
        "queued": sum(m.queued for m in status.models),
        "records_file": records.stats(),
        # Since this daemon started (the metrics' counters start at 0 with it; the ring keeps
        # the records of earlier runs), kept as records finish: whatever the ring still holds.
        "records_by_model": records.by_model(),
        "metrics": metric_totals(metrics),
    }


def records_part(
    status: DaemonStatus, records: Records, waiting: dict[str, int] | None = None
) -> dict[str, Any]:
    """What the page draws of the records (rebuilt when one changes): the conversations (the
    :data:`MAX_CONVERSATIONS` most recent, and how many there are), the turns running (those
    waiting for a slot with their place, ``waiting``: record id -> position), the refusals; the
    newest records come as JSON text (:func:`page_text`)."""
    running = records.running()
    tallies, total = records.tallies(MAX_CONVERSATIONS)
    rows = _conversations(status, tallies, running)[:MAX_CONVERSATIONS]
    inflight = [r.to_json() for r in running]
    for entry in inflight:
        entry["queue_position"] = (waiting or {}).get(entry["id"], 0)
    return {
        "now": time.time(),
        "show_prompts": records.show_prompts,
        "conversations": rows,
        "conversations_total": max(total, len(rows)),
        "inflight": inflight,
        "refusals": [r.to_json() for r in records.refused()],
    }


def waiting_turns(running: list[RequestRecord], explain: Callable[[str], ContextReport]) -> dict[str, int]:
    """The running turns that wait for a slot of a busy model, and their place in its queue:
    asked of the engine (``explain-context``'s queue position) for at most
    :data:`WAITING_CHECKS` turns that are past :data:`WAITING_AFTER_SECONDS` in an operation with
    neither progress nor a first token (a turn that runs shows one or the other soon)."""
    now = time.time()
    candidates = [
        r
        for r in running
        if r.session
        and r.stage in ("prefix", "suffix", "decode")
        and r.ttft_ms is None
        and not r.progress_total
        and now - r.started_at > WAITING_AFTER_SECONDS
    ]
    out: dict[str, int] = {}
    for r in candidates[:WAITING_CHECKS]:
        try:
            position = explain(r.session).queue_position
        except Exception:  # the session ended meanwhile: it waits for nothing
            continue
        if position:
            out[r.id] = position
    return out


def page_text(status: dict[str, Any] | str, live: dict[str, Any], newest: list[str]) -> str:
    """The page's state as JSON text: the status part (its text, when cached), the records
    part, and the newest records' own texts (a finished record's is made once)."""
    head = status if isinstance(status, str) else json.dumps(status, separators=(",", ":"))
    body = json.dumps(live, separators=(",", ":"))
    return f'{head[:-1]},{body[1:-1]},"records":[{",".join(newest)}]}}'


def page_state(
    status: DaemonStatus, records: Records, metrics: Metrics, explain: Callable[[str], ContextReport]
) -> dict[str, Any]:
    """The whole state at once, fresh (``GET /ui/state``)."""
    waiting = waiting_turns(records.running(), explain)
    text = page_text(
        status_part(status, records, metrics),
        records_part(status, records, waiting),
        records.newest_json(RECENT_RECORDS),
    )
    state: dict[str, Any] = json.loads(text)
    return state
