"""What every file-backed backend's describe computes the same way: identity and context size.

``effective_context = min(trained context, requested num_ctx, what fits in free memory after the
weights and a stated overhead)`` (blueprints/0009); weights already mapped by a loaded model of
the same digest are not counted twice.
"""

from __future__ import annotations

import threading

from modeld.backends.probe import MAX_SHOWN_PATH, show_path
from modeld.errors import ModelLoadError

__all__ = ["WeightsInUse", "check_digest", "effective_context"]


def check_digest(path: str, requested: str, actual: str) -> None:
    """Refuse a request whose digest does not name the file as it is now."""
    if requested and requested != actual:
        raise ModelLoadError(
            f"model {show_path(path)} has digest {actual}, the request asked for {show_path(requested)}",
            path=path[:MAX_SHOWN_PATH],
            expected=requested[:MAX_SHOWN_PATH],
            actual=actual,
        )


def effective_context(
    *,
    trained: int,
    requested: int,
    free_bytes: int,
    weights_bytes: int,
    kv_bytes_per_token: int,
    overhead: int,
) -> int:
    if kv_bytes_per_token <= 0:
        fits = requested
    else:
        fits = max(0, (free_bytes - weights_bytes - overhead) // kv_bytes_per_token)
    return max(0, min(trained or requested, requested, fits))


class WeightsInUse:
    """Which model digests have a loaded runtime (their weights are already in memory)."""

    def __init__(self) -> None:
        self._count: dict[str, int] = {}
        self._lock = threading.Lock()

    def add(self, digest: str) -> None:
        with self._lock:
            self._count[digest] = self._count.get(digest, 0) + 1

    def remove(self, digest: str) -> None:
        with self._lock:
            self._count[digest] = max(0, self._count.get(digest, 0) - 1)

    def __contains__(self, digest: object) -> bool:
        return bool(isinstance(digest, str) and self._count.get(digest))
