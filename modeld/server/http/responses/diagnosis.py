"""The Responses API's prompt-cache options and diagnosis: ``prompt_cache_options`` with
``comparison_response_id`` (where the prompt parted from that response's request: the response's
``prompt_cache_diagnostics``), ``prewarm`` (prepare the prompt without generating: the prompt is
computed and kept warm, the response has no output), ``mode`` and ``ttl`` (accepted: modeld keeps
what is warm by its own budget).

``prompt_cache_diagnostics`` is ``{"type": "cache_hit"}`` when nothing changed inside the earlier
prompt, ``{"type": "cache_miss", "reason", "cache_missed_tokens", "comparison_reusable_tokens"}``
(reasons ``model_changed``, ``prompt_cache_key_changed``, ``tools_changed``, ``input_changed``:
the instructions or any input item), ``{"type": "comparison_response_not_found"}`` or
``{"type": "unavailable"}``; the comparison is the shared layer's
(:mod:`modeld.server.http.diagnosis`), from the same facts as ``modeld explain-context``."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from modeld.errors import echo
from modeld.server.http.conversations import Started
from modeld.server.http.diagnosis import Diagnosis, compared_turn
from modeld.server.http.errors import bad
from modeld.server.http.fields import boolean, obj, refuse_unknown
from modeld.server.http.turn import Turn

__all__ = ["cache_options", "diagnostics_field"]

RESPONSE_PREFIX = "resp_"
_REASONS = {
    "model": "model_changed",
    "prompt_cache_key": "prompt_cache_key_changed",
    "tools": "tools_changed",
    "system": "input_changed",
    "messages": "input_changed",
}


def cache_options(body: Mapping[str, Any]) -> tuple[str | None, bool]:
    """``prompt_cache_options``: the turn ``comparison_response_id`` names (None: not asked),
    and whether to prewarm only."""
    options = obj(body, "prompt_cache_options")
    if options is None:
        return None, False
    refuse_unknown(
        options, frozenset({"comparison_response_id", "mode", "ttl", "prewarm"}), "prompt_cache_options"
    )
    mode = options.get("mode")
    if mode not in (None, "implicit", "explicit"):
        raise bad(
            "prompt_cache_options.mode",
            f"prompt_cache_options.mode must be implicit or explicit, got {echo(mode)}",
        )
    ttl = options.get("ttl")
    if ttl is not None and (not isinstance(ttl, str) or len(ttl) > 16):
        raise bad("prompt_cache_options.ttl", "prompt_cache_options.ttl must be a duration such as 30m")
    prewarm = boolean(options, "prewarm", param="prompt_cache_options.prewarm") or False
    previous = options.get("comparison_response_id")
    if previous is None:
        return None, prewarm
    return compared_turn(previous, "prompt_cache_options.comparison_response_id", RESPONSE_PREFIX), prewarm


def _diagnostics(diagnosis: Diagnosis) -> dict[str, Any]:
    if diagnosis.outcome == "none":
        return {"type": "cache_hit"}
    if diagnosis.outcome == "not_found":
        return {"type": "comparison_response_not_found"}
    reason = _REASONS.get(diagnosis.part)
    if diagnosis.outcome == "changed" and reason is not None:
        return {
            "type": "cache_miss",
            "reason": reason,
            "cache_missed_tokens": diagnosis.missed_tokens,
            "comparison_reusable_tokens": diagnosis.reusable_tokens,
        }
    return {"type": "unavailable"}


def diagnostics_field(turn: Turn, started: Started | None) -> dict[str, Any]:
    """``{"prompt_cache_diagnostics": ...}`` for a request that asked, else nothing."""
    if turn.compare is None or started is None or started.diagnosis is None:
        return {}
    return {"prompt_cache_diagnostics": _diagnostics(started.diagnosis)}
