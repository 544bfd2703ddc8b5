"""Anthropic's cache diagnosis (beta ``cache-diagnosis-2026-04-07``): a request's
``diagnostics: {"previous_message_id": ...}`` is answered with ``diagnostics`` on the message
(in ``message_start`` when streaming): ``null`` when nothing changed (or nothing was named yet),
else ``{"cache_miss_reason": {"type": ..., "cache_missed_input_tokens": N}}`` with the types
``model_changed``, ``system_changed``, ``tools_changed``, ``messages_changed`` (the tokens of the
earlier request's prompt from the first difference on), ``previous_message_not_found`` and
``unavailable``. The comparison is the shared layer's (:mod:`modeld.server.http.diagnosis`),
made from the same facts as ``modeld explain-context``."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from modeld.server.http.conversations import Started
from modeld.server.http.diagnosis import Diagnosis, compared_turn
from modeld.server.http.fields import obj, refuse_unknown
from modeld.server.http.turn import Turn

__all__ = ["diagnostics_field", "previous_message"]

MESSAGE_PREFIX = "msg_"


def previous_message(body: Mapping[str, Any]) -> str | None:
    """The turn ``diagnostics.previous_message_id`` names ("" for null: opted in, nothing to
    compare yet; None: no ``diagnostics``)."""
    diagnostics = obj(body, "diagnostics")
    if diagnostics is None:
        return None
    refuse_unknown(diagnostics, frozenset({"previous_message_id"}), "diagnostics")
    previous = diagnostics.get("previous_message_id")
    if previous is None:
        return ""
    return compared_turn(previous, "diagnostics.previous_message_id", MESSAGE_PREFIX)


def _reason(diagnosis: Diagnosis) -> dict[str, Any] | None:
    if diagnosis.outcome == "none":
        return None
    if diagnosis.outcome == "not_found":
        return {"type": "previous_message_not_found"}
    if diagnosis.outcome == "changed" and diagnosis.part in ("model", "system", "tools", "messages"):
        return {"type": f"{diagnosis.part}_changed", "cache_missed_input_tokens": diagnosis.missed_tokens}
    return {"type": "unavailable"}


def diagnostics_field(turn: Turn, started: Started) -> dict[str, Any]:
    """``{"diagnostics": ...}`` for a request that asked, else nothing."""
    if turn.compare is None or started.diagnosis is None:
        return {}
    reason = _reason(started.diagnosis)
    return {"diagnostics": None if reason is None else {"cache_miss_reason": reason}}
