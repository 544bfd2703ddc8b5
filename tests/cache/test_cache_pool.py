"""The pool's record of what a warm context holds (``modeld/cache/pool.py``): pure state, no engine.

A context's committed prefix is never longer than what it holds. Before (found by the chaos run,
issue 21): a prefix whose prefill stopped short of the context's old prefix (a diverged target,
then a failure, a cancel or a changed model file before the commit) kept the old prefix length,
the daemon's orderly stop snapshotted it with ``prefix_tokens > n_tokens``, the written file
failed its own header check, and the disk tier turned itself off with that file left behind.
"""

from __future__ import annotations

from pathlib import Path

from modeld.backends.base import Layout
from modeld.cache.pool import CacheSettings, Pool, SessionSlot
from modeld.cache.snapfile import read_header
from modeld.cache.tiers import Tiers


def _pool(tiers: Tiers | None = None) -> tuple[Pool, SessionSlot]:
    layout = Layout(n_seq=2, window=256, pool_tokens=512, snapshots=True, snapshot_format="f")
    pool = Pool(name="m", model_digest="d" * 32, layout=layout, tiers=tiers, settings=CacheSettings())
    slot = SessionSlot("s", "i" * 32)
    return pool, slot


def test_a_prefill_that_kept_less_than_the_prefix_cuts_the_committed_prefix() -> None:
    pool, slot = _pool()
    context = pool.add(slot, 0)
    old = list(range(100, 166))
    pool.record_sync(context, 0, 66, old)
    context.prefix_tokens = 66  # committed
    new = [*old[:59], 7, 8, 9]  # diverges at 59, shorter than the old prefix
    pool.record_sync(context, 59, 62, new)  # evaluated, never committed
    assert (len(context.tokens), context.prefix_tokens) == (62, 59)
    pool.record_sync(context, 62, 62, new)  # a suffix on top keeps it
    assert context.prefix_tokens == 59
    pool.record_generate(context, [1, 2], 30)  # the engine holds only 30 now
    assert (len(context.tokens), context.prefix_tokens) == (30, 30)


def test_a_snapshot_never_claims_more_prefix_than_tokens(tmp_path: Path) -> None:
    tiers = Tiers(data_dir=tmp_path, ram_bytes=0, disk_bytes=1 << 20)
    try:
        entry = tiers.put(
            model_digest="d" * 32,
            identity="i" * 32,
            snapshot_format="f",
            tokens=list(range(59)),
            prefix_tokens=66,
            blob=b"x" * 64,
            truncatable=True,
        )  # the RAM tier is off: straight to disk
        assert entry is not None and entry.prefix_tokens == 59
        assert tiers.flush(30)
        (path,) = (tmp_path / "kv").glob("*.kvs")
        header, _ = read_header(path)
        assert (header.n_tokens, header.prefix_tokens) == (59, 59)
        assert tiers.disk_on
    finally:
        tiers.close()


def test_the_ledger_counts_a_restored_start_shared_again_once() -> None:
    """A unified pool: sequence 0 computed 700 tokens, sequence 1 copied its first 600 and added
    100 of its own (800 cells in all). Sequence 1 leaves and comes back from a snapshot into 700
    cells of its own (1400 in all); shared again from 600 tokens on, the pool holds 800 once more,
    and emptying either sequence frees only what it alone holds."""
    from modeld.cache.ledger import Ledger

    ledger = Ledger(shared_cells=True)
    ledger.extend(0, 700)
    ledger.copy(0, 1, 600)
    ledger.extend(1, 100)
    assert ledger.used() == 800
    ledger.set(1, 700)  # restored: its own cells
    assert ledger.used() == 1400
    ledger.share(0, 1, 600)
    assert (ledger.used(), ledger.length(1), ledger.unique(1), ledger.unique(0)) == (800, 700, 100, 100)
    ledger.extend(1, 10)  # its own tail grows
    assert (ledger.used(), ledger.length(1)) == (810, 710)
    ledger.drop(0)
    assert ledger.used() == 710
