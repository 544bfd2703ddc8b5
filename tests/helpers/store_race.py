"""Processes that write and read one shared snapshot store at once (``tests/cache/test_shared_store.py``
starts them with ``multiprocessing``'s spawn: this module imports only the store, so a process
is up in a fraction of a second). Each waits at a barrier, works for ``seconds``, and puts one
result tuple on ``out``."""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

from modeld.cache.shared import DirectoryStore, SharedTier
from modeld.cache.snapfile import SnapshotError
from modeld.cache.tiers import entry_key

MODEL = "f" * 32
IDENTITY = "e" * 32
FORMAT = "memory-1 split"
RACE_TOKENS = list(range(1000, 1400))
PAYLOADS = (bytes([1]) * (3 << 20), bytes([2]) * (3 << 20))
FILLER_PAYLOAD = 50_000


def put(store: DirectoryStore, payload: bytes, tokens: list[int], model: str = MODEL) -> str:
    key = entry_key(model, IDENTITY, FORMAT, tokens)
    store.put(
        key,
        model_digest=model,
        identity=IDENTITY,
        snapshot_format=FORMAT,
        tokens=tokens,
        prefix_tokens=len(tokens),
        payload=payload,
    )
    return key


def writer(directory: str, which: int, seconds: float, start: Any, out: Any) -> None:
    """Write one key again and again (removing it first, so every round really writes)."""
    store = DirectoryStore(Path(directory), 1 << 30)
    key = entry_key(MODEL, IDENTITY, FORMAT, RACE_TOKENS)
    start.wait()
    until = time.monotonic() + seconds
    rounds = 0
    while time.monotonic() < until:
        store.delete(key)
        put(store, PAYLOADS[which], RACE_TOKENS)
        rounds += 1
    out.put(("writer", which, rounds, 0, ""))


def reader(directory: str, seconds: float, start: Any, out: Any) -> None:
    """Read the key through the daemon's path (candidates, then a verified load)."""
    tier = SharedTier(DirectoryStore(Path(directory), 1 << 30))
    start.wait()
    until = time.monotonic() + seconds
    loaded = missed = 0
    bad = ""
    while time.monotonic() < until and not bad:
        entries = tier.candidates(MODEL, IDENTITY, FORMAT)
        if not entries:
            missed += 1
            continue
        try:
            payload = tier.load(entries[0])
        except SnapshotError as exc:
            if "is gone" in str(exc):
                missed += 1  # removed between the listing and the read: a miss
                continue
            bad = f"refused: {exc}"
            break
        if payload in PAYLOADS:
            loaded += 1
        else:
            bad = f"a payload that neither writer wrote ({len(payload)} bytes)"
    rejected = int(tier.stats()["shared_rejected"])
    tier.close()
    out.put(("reader", loaded, missed, rejected, bad))


def filler(directory: str, worker: int, budget: int, seconds: float, start: Any, out: Any) -> None:
    """Write distinct keys into a small store while loading what the others wrote."""
    store = DirectoryStore(Path(directory), budget)
    tier = SharedTier(store)
    start.wait()
    until = time.monotonic() + seconds
    written = loaded = 0
    bad = ""
    i = 0
    while time.monotonic() < until and not bad:
        i += 1
        put(store, bytes([worker]) * FILLER_PAYLOAD + bytes([i % 251]), [worker + 1, i, *range(60)])
        written += 1
        for entry in tier.candidates(MODEL, IDENTITY, FORMAT)[:3]:
            try:
                payload = tier.load(entry)
            except SnapshotError as exc:
                if "is gone" not in str(exc):
                    bad = str(exc)
                continue
            owner, n = entry.tokens[0] - 1, entry.tokens[1]
            if payload != bytes([owner]) * FILLER_PAYLOAD + bytes([n % 251]):
                bad = "a payload that does not belong to its key"
            loaded += 1
    rejected = int(tier.stats()["shared_rejected"])
    tier.close()
    out.put((written, loaded, rejected, bad))
