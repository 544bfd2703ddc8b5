"""The RAM tier within its limit, counting the blobs on their way to disk (``modeld/cache/tiers.py``).

Before: a snapshot entering a full RAM tier pushed the least recently used blob out to the disk
writer and returned at once, the pushed-out blob still in memory until written. On a slow disk
(or a busy machine: the writer runs at nice 19) the tier read over its limit after the turn, and
evictions faster than the disk queued blobs without bound (found as a flake of
``tests/cache/test_memory_budget.py`` under the full suite's load: 20.1 MB in a 16 MiB room). Now the
snapshot waits for the blobs it pushed out (:meth:`Tiers.make_ram_room` before it is taken,
:meth:`Tiers.put` after), so an eviction runs at the disk's speed when the tier is full of blobs
with no disk copy, and the daemon never holds more than the limit.
"""

from __future__ import annotations

import errno
import logging
import threading
import time
from pathlib import Path
from typing import Any

import pytest

import modeld.cache.tiers as tiers_module
from modeld.cache.tiers import Tiers

MIB = 1 << 20


def _put(tiers: Tiers, i: int, nbytes: int = MIB) -> None:
    entry = tiers.put(
        model_digest="d" * 32,
        identity="i" * 32,
        snapshot_format="f",
        tokens=[i, *range(1000, 1010)],
        prefix_tokens=11,
        blob=bytes([i % 251]) * nbytes,
        truncatable=True,
    )
    assert entry is not None


@pytest.fixture
def slow_disk(monkeypatch: pytest.MonkeyPatch) -> threading.Event:
    """Every blob write takes 0.3 s (a slow disk, or a writer starved of CPU) until released."""
    release = threading.Event()
    write = tiers_module.write_atomic

    def slow(*args: Any, **kwargs: Any) -> Any:
        release.wait(0.3)
        return write(*args, **kwargs)

    monkeypatch.setattr(tiers_module, "write_atomic", slow)
    return release


def test_a_full_ram_tier_waits_for_the_blobs_it_pushes_to_disk(
    tmp_path: Path, slow_disk: threading.Event
) -> None:
    tiers = Tiers(data_dir=tmp_path, ram_bytes=2 * MIB + 4096, disk_bytes=1 << 30)
    try:
        seen = []
        started = time.monotonic()
        for i in range(5):
            _put(tiers, i)
            stats = tiers.stats()
            seen.append(stats["ram_bytes"])
            assert stats["ram_bytes"] <= stats["ram_budget"], (i, seen)
        # The last three puts each waited for one blob's write (0.3 s each).
        assert time.monotonic() - started >= 0.8
        assert tiers.flush(30)
        stats = tiers.stats()
        assert (stats["ram_entries"], stats["disk_entries"], stats["spilled_to_disk"]) == (2, 3, 3), stats
        assert stats["dropped"] == 0
    finally:
        slow_disk.set()
        tiers.close()


def test_room_is_made_before_a_blob_comes(tmp_path: Path, slow_disk: threading.Event) -> None:
    tiers = Tiers(data_dir=tmp_path, ram_bytes=2 * MIB + 4096, disk_bytes=1 << 30)
    try:
        _put(tiers, 0)
        _put(tiers, 1)
        assert tiers.stats()["ram_entries"] == 2
        # Larger than the tier: refused, and nothing pushed out for it.
        assert not tiers.make_ram_room(3 * MIB)
        assert tiers.stats()["ram_entries"] == 2
        assert tiers.make_ram_room(MIB)
        stats = tiers.stats()
        assert int(stats["ram_bytes"]) + MIB <= int(stats["ram_budget"]), stats
        assert (stats["ram_entries"], stats["spilled_to_disk"]) == (1, 1), stats
        _put(tiers, 2)  # fits now: nothing more goes
        assert tiers.stats()["spilled_to_disk"] == 1
    finally:
        slow_disk.set()
        tiers.close()


def test_a_write_that_fails_while_a_snapshot_waits_drops_the_blob(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The disk fails under the wait: the tier turns the disk off and drops the blob the put
    was waiting for (never a hang, never over the limit)."""

    def failing(*args: Any, **kwargs: Any) -> Any:
        time.sleep(0.1)
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(tiers_module, "write_atomic", failing)
    tiers = Tiers(data_dir=tmp_path, ram_bytes=2 * MIB + 4096, disk_bytes=1 << 30)
    try:
        for i in range(4):
            _put(tiers, i)
            stats = tiers.stats()
            assert stats["ram_bytes"] <= stats["ram_budget"], (i, stats)
        stats = tiers.stats()
        assert stats["disk_off_reason"] and stats["ram_entries"] == 2 and stats["dropped"] == 2, stats
    finally:
        tiers.close()


def test_a_long_wait_for_the_disk_is_logged(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    write = tiers_module.write_atomic

    def slower(*args: Any, **kwargs: Any) -> Any:
        time.sleep(tiers_module.SLOW_SPILL + 0.1)
        return write(*args, **kwargs)

    monkeypatch.setattr(tiers_module, "write_atomic", slower)
    tiers = Tiers(data_dir=tmp_path, ram_bytes=MIB + 4096, disk_bytes=1 << 30)
    try:
        with caplog.at_level(logging.INFO, logger="modeld.cache"):
            _put(tiers, 0)
            assert not caplog.records
            _put(tiers, 1)  # pushes blob 0 out and waits for its write
        (record,) = [r for r in caplog.records if "waited" in r.getMessage()]
        assert "written to disk" in record.getMessage()
        assert tiers.stats()["ram_entries"] == 1
    finally:
        tiers.close()
