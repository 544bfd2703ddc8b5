"""The SGLang gateway's worker routes, the answers: the load in ``smg``'s and SGLang's shapes,
from the daemon's status (the routes and what each means: ``routes.py``)."""

from __future__ import annotations

from datetime import UTC, datetime
from typing import Any

from modeld.observe.status import DaemonStatus

__all__ = ["load_report", "worker_loads"]


def load_report(status: DaemonStatus, draining: bool) -> list[dict[str, Any]]:
    """SGLang's ``/get_load`` list from the daemon's status (one scheduler: one entry)."""
    models = status.models
    running = sum(m.busy_slots for m in models)
    waiting = sum(m.queued for m in models)
    return [
        {
            "dp_rank": 0,
            "num_reqs": running + waiting,
            "num_waiting_reqs": waiting,
            "num_tokens": sum(m.busy_tokens for m in models),
            "num_pending_tokens": 0,
            "resident_tokens": sum(m.resident_tokens for m in models),
            "kv_capacity_tokens": sum(m.pool_tokens for m in models),
            "busy_slots": running,
            "slots": sum(m.slots for m in models),
            "sessions": status.sessions,
            "draining": draining,
        }
    ]


def worker_loads(status: DaemonStatus, now: float) -> dict[str, Any]:
    """``smg``'s ``WorkerLoadResponse`` (``GET /v1/loads``) from the daemon's status: one rank.

    Before a model is loaded the capacity is 0 and so is every ratio (an idle daemon)."""
    models = status.models
    running = sum(m.busy_slots for m in models)
    waiting = sum(m.queued for m in models)
    used = sum(m.busy_tokens for m in models)
    capacity = sum(m.pool_tokens for m in models)
    slots = sum(m.slots for m in models)
    queried = sum(m.counters.get("queries", 0) for m in models)
    reused = sum(v for m in models for k, v in m.counters.items() if k.startswith("reused_"))
    return {
        "timestamp": datetime.fromtimestamp(now, UTC).isoformat(),
        "dp_rank_count": 1,
        "loads": [
            {
                "dp_rank": 0,
                "num_running_reqs": running,
                "num_waiting_reqs": waiting,
                "num_total_reqs": running + waiting,
                "num_used_tokens": used,
                "max_total_num_tokens": capacity,
                "token_usage": used / capacity if capacity else 0.0,
                "gen_throughput": 0.0,
                "cache_hit_rate": reused / queried if queried else 0.0,
                "utilization": running / slots if slots else 0.0,
                "max_running_requests": slots,
            }
        ],
    }
