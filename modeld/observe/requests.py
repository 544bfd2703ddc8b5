"""Request records for people: ``modeld requests`` (a table, or one record whole) and ``modeld
top`` (a screen that refreshes: what runs now, per model, the newest turns).

Reads :class:`~modeld.observe.records.RequestRecord` values (over gRPC ``ListRequests``), the
same records the live page and ``/v1/requests`` show.
"""

from __future__ import annotations

import time
from collections.abc import Sequence

from modeld.observe.records import RequestRecord
from modeld.observe.views import age, format_bytes, table

__all__ = ["format_record", "format_records", "format_top"]


def _ms(value: float | None) -> str:
    if value is None:
        return "-"
    return f"{value / 1000:.2f}s" if value >= 1000 else f"{value:.0f}ms"


def _finish(r: RequestRecord) -> str:
    if r.state == "running":
        progress = f" {r.progress_done}/{r.progress_total}" if r.progress_total else ""
        return f"running: {r.stage}{progress}"
    return f"{r.finish} ({r.error})" if r.error else r.finish or "-"


def _reuse(r: RequestRecord) -> str:
    if not r.outcome:
        return "-"
    where = f" @{r.diverged_at_token}" if r.diverged_at_token is not None else ""
    segment = f" {r.diverged_segment}" if r.diverged_segment else ""
    return f"{r.outcome} {r.reason}{where}{segment}"


def format_records(records: Sequence[RequestRecord], now: float | None = None) -> str:
    """One line per record, oldest first."""
    if not records:
        return "no request records"
    now = time.time() if now is None else now
    rows = [
        [
            "ID",
            "STARTED",
            "API",
            "JOB",
            "CONVERSATION",
            "MODEL",
            "FINISH",
            "REUSE",
            "PROMPT",
            "REUSED",
            "PREFILLED",
            "GEN",
            "TTFT",
        ]
    ]
    for r in records:
        rows.append(
            [
                r.id,
                age(now - r.started_at),
                r.api,
                r.job[:24] or "-",
                r.conversation[:32] or "-",
                r.model[:24],
                _finish(r),
                _reuse(r),
                str(r.prompt_tokens),
                str(r.reused_tokens),
                str(r.prefilled_tokens),
                str(r.generated_tokens),
                _ms(r.ttft_ms),
            ]
        )
    return "\n".join(table(rows))


def format_record(r: RequestRecord) -> str:
    """One record, every field."""
    lines = [f"request {r.id} ({r.api}, {r.state}{': ' + r.stage if r.state == 'running' else ''})"]
    pairs = [
        ("model", r.model),
        ("job", r.job or "-"),
        ("agent", r.agent or "-"),
        ("conversation", r.conversation or "-"),
        ("session", r.session or "-"),
        ("started", time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(r.started_at))),
        ("finish", _finish(r)),
        ("reuse", _reuse(r) + (f" (tier {r.tier})" if r.tier else "")),
        (
            "prompt",
            f"{r.prompt_tokens} tokens: {r.reused_kv} reused from kv, {r.reused_ram} ram, {r.reused_disk} disk, "
            f"{r.reused_shared} shared; {r.prefilled_tokens} computed",
        ),
        ("generated", f"{r.generated_tokens} tokens in {r.decodes} decodes ({r.decode_tps:.1f} tok/s)"),
        (
            "timings",
            f"TTFT {_ms(r.ttft_ms)}, prefill {_ms(r.prefill_ms)}, restore {_ms(r.restore_ms)}, decode {_ms(r.decode_ms)}",
        ),
        (
            "speculation",
            f"{r.accepted_tokens} of {r.drafted_tokens} drafted accepted, {r.forced_tokens} forced",
        ),
        (
            "bytes",
            f"{format_bytes(r.bytes_in)} in, {format_bytes(r.bytes_out)} out"
            + (f" (HTTP {r.status})" if r.status else ""),
        ),
    ]
    if r.diverged_message is not None:
        pairs.append(("diverged", f"message {r.diverged_message}, byte {r.diverged_at_byte}"))
    if r.error_message:
        pairs.append(("error", r.error_message))
    if r.excerpt:
        pairs.append(("excerpt", repr(r.excerpt)))
    width = max(len(k) for k, _ in pairs)
    lines += [f"  {k.ljust(width)}  {v}" for k, v in pairs]
    return "\n".join(lines)


def format_top(records: Sequence[RequestRecord], now: float, recent: int = 15) -> str:
    """``modeld top``'s screen: the turns running now, per model totals of the records, and the
    newest turns."""
    running = [r for r in records if r.state == "running"]
    done = [r for r in records if r.state == "done"]
    lines = [
        f"modeld top: {len(running)} running, {len(done)} recent turns  ({time.strftime('%H:%M:%S', time.localtime(now))})",
        "",
    ]
    lines.append("RUNNING")
    lines += ["  " + line for line in format_records(running, now).splitlines()] if running else ["  none"]
    models: dict[str, list[RequestRecord]] = {}
    for r in records:
        models.setdefault(r.model or "-", []).append(r)
    lines += ["", "BY MODEL (the records listed)"]
    rows = [["MODEL", "TURNS", "PROMPT", "REUSED", "PREFILLED", "GENERATED", "ERRORS", "MEDIAN TTFT"]]
    for name, rs in sorted(models.items()):
        ttfts = sorted(r.ttft_ms for r in rs if r.ttft_ms is not None)
        rows.append(
            [
                name,
                str(len(rs)),
                str(sum(r.prompt_tokens for r in rs)),
                str(sum(r.reused_tokens for r in rs)),
                str(sum(r.prefilled_tokens for r in rs)),
                str(sum(r.generated_tokens for r in rs)),
                str(sum(1 for r in rs if r.error)),
                _ms(ttfts[len(ttfts) // 2]) if ttfts else "-",
            ]
        )
    lines += ["  " + line for line in table(rows)]
    lines += ["", "NEWEST"]
    lines += ["  " + line for line in format_records(done[-recent:], now).splitlines()]
    return "\n".join(lines)
