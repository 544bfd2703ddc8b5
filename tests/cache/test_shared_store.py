"""The shared snapshot store (``modeld/cache/shared.py``, blueprint 0020): verified reads, files
named by what they hold, eviction by last use within a budget, and many processes writing and
reading one directory at once (real processes, real files): nothing torn, corrupt or foreign is
ever loaded. Then two engines on one store: a prefix one computed is ``restored_from_shared`` by
the other, and its output equals a fresh evaluation."""

from __future__ import annotations

import multiprocessing
import os
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import store_race
from prometheus_client.parser import text_string_to_metric_families

from modeld.cache.shared import STALE_TMP_SECONDS, DirectoryStore, SharedTier
from modeld.cache.snapfile import SUFFIX, SnapshotError
from modeld.cache.tiers import entry_key
from modeld.contract import DecodeConfig, OpenSessionRequest, PrefixInput, SuffixInput
from modeld.engine import Engine
from modeld.observe.metrics import Metrics
from modeld.settings import Residency

MODEL = "f" * 32
IDENTITY = "e" * 32
FORMAT = "memory-1 split"
TOKENS = list(range(1, 300))


def _key(tokens: list[int] = TOKENS, model: str = MODEL, identity: str = IDENTITY) -> str:
    return entry_key(model, identity, FORMAT, tokens)


def _put(store: DirectoryStore, payload: bytes, tokens: list[int] = TOKENS, model: str = MODEL) -> str:
    key = _key(tokens, model)
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


@pytest.fixture
def directory() -> Iterator[Path]:
    with tempfile.TemporaryDirectory(prefix="mdshared") as tmp:
        yield Path(tmp) / "store"


def test_a_snapshot_round_trips_and_is_found_by_its_model_identity_and_format(directory: Path) -> None:
    store = DirectoryStore(directory, 1 << 30)
    key = _put(store, b"x" * 1000)
    header, tokens, payload, _version = store.get(key)
    assert (header.model_digest, header.identity, tokens, payload) == (MODEL, IDENTITY, TOKENS, b"x" * 1000)
    tier = SharedTier(store)
    try:
        (entry,) = tier.candidates(MODEL, IDENTITY, FORMAT)
        assert entry.tier == "shared" and entry.tokens == TOKENS and tier.owns(entry)
        assert tier.load(entry) == b"x" * 1000
        assert tier.candidates(MODEL, "d" * 32, FORMAT) == []  # another runtime identity
        assert tier.candidates(MODEL, IDENTITY, "memory-1 unified") == []  # another engine format
        assert tier.stats()["shared_restored"] == 1
    finally:
        tier.close()
    assert (
        store.put(
            key,
            model_digest=MODEL,
            identity=IDENTITY,
            snapshot_format=FORMAT,
            tokens=TOKENS,
            prefix_tokens=1,
            payload=b"y",
        )
        is False
    )  # the key is there: only touched


def _bad_files(directory: Path, store: DirectoryStore) -> dict[str, str]:
    """One file per way a snapshot can be bad; returns key -> what is wrong with it."""
    bad: dict[str, str] = {}
    flipped = _put(store, b"a" * 4096, tokens=[7] * 100)
    path = directory / f"{flipped}{SUFFIX}"
    data = bytearray(path.read_bytes())
    data[10] ^= 0xFF  # the payload comes first
    path.write_bytes(bytes(data))
    bad[flipped] = "checksum"
    cut = _put(store, b"b" * 4096, tokens=[8] * 100)
    path = directory / f"{cut}{SUFFIX}"
    path.write_bytes(path.read_bytes()[:-100])
    bad[cut] = "truncated"
    # A valid snapshot renamed to another key of this model and identity (a foreign file).
    other = _put(store, b"c" * 4096, tokens=[9] * 100)
    renamed = _key([10] * 100)
    (directory / f"{other}{SUFFIX}").rename(directory / f"{renamed}{SUFFIX}")
    bad[renamed] = "name does not match"
    # Another model's snapshot, put under a name of this model.
    theirs = _put(store, b"d" * 4096, tokens=[11] * 100, model="0" * 32)
    mine = _key([11] * 100)
    (directory / f"{theirs}{SUFFIX}").rename(directory / f"{mine}{SUFFIX}")
    bad[mine] = "name does not match"
    junk = _key([12] * 100)
    (directory / f"{junk}{SUFFIX}").write_bytes(b"not a snapshot at all" * 10)
    bad[junk] = "bad magic"
    empty = _key([13] * 100)
    (directory / f"{empty}{SUFFIX}").write_bytes(b"")
    bad[empty] = "truncated"
    return bad


def test_corrupt_truncated_and_foreign_files_are_refused_removed_and_never_loaded(directory: Path) -> None:
    store = DirectoryStore(directory, 1 << 30)
    good = _put(store, b"g" * 4096)
    bad = _bad_files(directory, store)
    tier = SharedTier(store)
    try:
        entries = {e.key: e for e in tier.candidates(MODEL, IDENTITY, FORMAT)}
        # The header checks catch all but the flipped payload byte, which only the checksum of a
        # whole read finds.
        loaded = {key: tier.load(e) for key, e in entries.items() if key == good}
        assert loaded == {good: b"g" * 4096}
        flipped = next(k for k, why in bad.items() if why == "checksum")
        assert set(entries) == {good, flipped}
        with pytest.raises(SnapshotError, match="checksum"):
            tier.load(entries[flipped])
        reasons = {r.file.removeprefix("shared:"): r.reason for r in tier.rejections}
        assert set(reasons) == set(bad)
        for key, why in bad.items():
            assert why in reasons[key], (key, reasons[key])
            assert not (directory / f"{key}{SUFFIX}").exists()
        assert (directory / f"{good}{SUFFIX}").exists()
        assert tier.stats()["shared_rejected"] == len(bad)
    finally:
        tier.close()


def test_a_good_file_renamed_over_a_bad_one_after_the_read_is_kept(directory: Path) -> None:
    store = DirectoryStore(directory, 1 << 30)
    key = _put(store, b"a" * 4096)
    path = directory / f"{key}{SUFFIX}"
    data = bytearray(path.read_bytes())
    data[0] ^= 1  # the payload comes first
    path.write_bytes(bytes(data))
    with pytest.raises(SnapshotError) as caught:
        store.get(key)
    version = caught.value.version  # type: ignore[attr-defined]
    # Another daemon writes the key again (a new file in place of the bad one) before the reader
    # removes what it read: the removal spares the new file, even when the file system handed
    # the new file the freed inode within the same clock tick.
    path.unlink()
    _put(store, b"a" * 4096)
    assert store.discard(key, version) is False
    assert store.get(key)[2] == b"a" * 4096
    # The bad file itself is removed.
    path.write_bytes(bytes(data))
    with pytest.raises(SnapshotError) as caught:
        store.get(key)
    assert store.discard(key, caught.value.version) is True  # type: ignore[attr-defined]
    assert not path.exists() and [p.name for p in directory.iterdir() if p.name.endswith(".tmp")] == []


def test_eviction_goes_by_last_use_and_a_read_counts_as_use(directory: Path) -> None:
    payload = b"p" * 10_000
    store = DirectoryStore(directory, 45_000)  # four snapshots fit, a fifth does not
    keys = []
    for i in range(4):
        keys.append(_put(store, payload, tokens=[i + 1] * 50))
        past = time.time() - 100 + i
        os.utime(directory / f"{keys[-1]}{SUFFIX}", (past, past))
    store.get(keys[0])  # the oldest is read: it is used now
    keys.append(_put(store, payload, tokens=[99] * 50))
    left = {i.key for i in store.items()}
    # Cut to 90% of the budget with room for the new one: the two least recently used went.
    assert left == {keys[0], keys[3], keys[4]}
    assert sum(i.size for i in store.items()) <= store.budget


def test_a_writer_that_died_leaves_a_temporary_file_the_evicting_daemon_removes(directory: Path) -> None:
    store = DirectoryStore(directory, 25_000)
    stale = directory / ".dead.kvs.123.host.abc.tmp"
    stale.write_bytes(b"half a snapshot")
    old = time.time() - STALE_TMP_SECONDS - 10
    os.utime(stale, (old, old))
    fresh = directory / ".alive.kvs.124.host.def.tmp"
    fresh.write_bytes(b"being written now")
    for i in range(3):
        _put(store, b"q" * 10_000, tokens=[i + 1] * 50)  # the third is over the budget: eviction
    assert not stale.exists() and fresh.exists()


# --- many processes on one directory ---------------------------------------------------------


def _run(targets: list[tuple[Any, tuple[Any, ...]]]) -> list[tuple[Any, ...]]:
    """Start the processes, let them work from one moment (a barrier), collect their results."""
    ctx = multiprocessing.get_context("spawn")
    out = ctx.Queue()
    start = ctx.Barrier(len(targets))
    procs = [ctx.Process(target=fn, args=(*args, start, out)) for fn, args in targets]
    for p in procs:
        p.start()
    try:
        return [out.get(timeout=180) for _ in procs]
    finally:
        for p in procs:
            p.join(timeout=30)
            if p.is_alive():
                p.kill()


def test_two_writers_of_one_key_and_readers_racing_them_never_load_a_torn_snapshot(directory: Path) -> None:
    DirectoryStore(directory, 1 << 30)
    d = str(directory)
    results = _run(
        [(store_race.writer, (d, w, 4.0)) for w in (0, 1)] + [(store_race.reader, (d, 4.0)) for _ in range(2)]
    )
    writers = [r for r in results if r[0] == "writer"]
    readers = [r for r in results if r[0] == "reader"]
    assert all(r[2] > 0 for r in writers), writers
    for _, loaded, _missed, rejected, bad in readers:
        assert bad == "" and rejected == 0, readers
        assert loaded > 0, readers
    leftovers = [p.name for p in directory.iterdir() if p.name.endswith(".tmp")]
    assert leftovers == []


def test_concurrent_writers_and_readers_keep_the_store_near_its_budget_and_load_only_their_own(
    directory: Path,
) -> None:
    budget = 600_000
    DirectoryStore(directory, budget)
    results = _run([(store_race.filler, (str(directory), w, budget, 4.0)) for w in range(3)])
    assert all(bad == "" and rejected == 0 for _w, _l, rejected, bad in results), results
    assert sum(r[0] for r in results) * store_race.FILLER_PAYLOAD > 3 * budget  # far more than fits
    assert sum(r[1] for r in results) > 0
    held = sum(i.size for i in DirectoryStore(directory, budget).items())
    # Within the budget after the last eviction, plus what the writers wrote since (a writer that
    # found another evicting skipped its own pass, and the evicting one lists the store again
    # after its pass to count what they wrote meanwhile: at most one snapshot each).
    assert held <= budget + 3 * (store_race.FILLER_PAYLOAD + 1024), held


# --- two engines, one store --------------------------------------------------------------------

PREFIX = "You are a careful assistant. " * 12 + "\n"  # ~350 tokens of the memory backend


def _engine(data: Path, store: Path | None) -> Engine:
    residency = Residency(persist_min_tokens=64, shared_store=str(store) if store else "")
    return Engine(backends=("memory",), residency=residency, data_dir=data)


def _turn(engine: Engine, prefix: str, suffix: str) -> tuple[Any, list[int]]:
    session = engine.open_session(OpenSessionRequest(path="repo", model_name="coder"))
    status = session.ensure_prefix(PrefixInput(text=prefix))
    session.prefill_suffix(SuffixInput(text=suffix))
    stream = session.decode(DecodeConfig(max_tokens=8, temperature=0.0))
    tokens = [t for chunk in stream for t in chunk.token_ids]
    return status, tokens


def test_a_prefix_one_engine_computed_is_restored_from_shared_by_another(directory: Path) -> None:
    base = directory.parent
    with _engine(base / "a", directory) as a:
        first, _ = _turn(a, PREFIX, "question one")
        assert first.reuse.outcome == "cold"
        assert a.tiers.flush(30)
    written = [p for p in directory.iterdir() if p.name.endswith(SUFFIX)]
    assert written, "the persisted prefix was not written through to the shared store"
    longer = PREFIX + "question one\nanswer one\n"
    with _engine(base / "b", directory) as b:
        metrics = Metrics(b.status)
        status, tokens = _turn(b, longer, "question two")
        assert (status.reuse.outcome, status.reuse.reason, status.reuse.tier) == (
            "warm",
            "restored_from_shared",
            "shared",
        )
        assert status.reused_tokens >= len(PREFIX) and status.restore_ms > 0
        text = metrics.render()[0].decode()
        samples = {
            (s.name, tuple(sorted(s.labels.items()))): s.value
            for family in text_string_to_metric_families(text)
            for s in family.samples
        }
        assert samples[("modeld_tier_entries", (("tier", "shared"),))] >= 1
        assert samples[("modeld_shared_store_snapshots_total", (("event", "restored"),))] == 1
        tiers = b.status().tiers
        assert tiers is not None and tiers.shared_location == str(directory) and tiers.shared_restored == 1
    with _engine(base / "c", None) as fresh:
        cold, expected = _turn(fresh, longer, "question two")
        assert cold.reuse.outcome == "cold"
    assert tokens == expected


@pytest.mark.llama
@pytest.mark.slow
def test_a_snapshot_restored_into_a_full_pool_makes_room_first(directory: Path) -> None:
    """A conversation moved to a box whose unified KV pool is full of its own warm contexts: the
    engine would refuse the restore for want of cells, so the cache evicts first (to a tier),
    and the shared snapshot is restored, not rejected and removed from the store."""
    from modeld.testmodels import TINY, ensure_model

    model = str(ensure_model(TINY))

    def engine(data: Path) -> Engine:
        residency = Residency(persist_min_tokens=64, shared_store=str(directory), pool_tokens=2048)
        return Engine(backends=("llama",), residency=residency, data_dir=data)

    def prefix(engine: Engine, text: str) -> Any:
        session = engine.open_session(OpenSessionRequest(type="llama", path=model))
        return session.ensure_prefix(PrefixInput(text=text))

    moved = "The moved conversation's repository map, line by line.\n" * 80
    with engine(directory.parent / "a") as a:
        first = prefix(a, moved)
        assert first.reuse.outcome == "cold" and 1200 < first.prefix_tokens < 2048
        assert a.tiers.flush(30)
    with engine(directory.parent / "b") as b:
        for i in range(2):  # the box's own conversations: most of its 2048 cells
            own = prefix(b, f"{i}: box b's own conversation about another repository.\n" * 40)
            assert own.reuse.reason != "restored_from_shared" and own.prefix_tokens > 400
        (model_status,) = b.status().models
        assert model_status.resident_tokens + first.prefix_tokens > model_status.pool_tokens
        status = prefix(b, moved + "and one more turn\n")
        assert (status.reuse.outcome, status.reuse.reason) == ("warm", "restored_from_shared"), status.reuse
        assert status.reused_tokens == first.prefix_tokens
        (model_status,) = b.status().models
        counters = model_status.counters
        # The box's own contexts were written behind to its disk tier: evicted, they go nowhere
        # else (a byte is held once, blueprint 0016).
        assert counters["evicted_to_ram"] + counters["evicted_to_disk"] >= 1
        assert counters["snapshots_rejected"] == 0
    assert any(p.name.endswith(SUFFIX) for p in directory.iterdir()), "the good snapshot was removed"


def test_a_store_that_cannot_be_used_is_refused_at_start(directory: Path) -> None:
    directory.parent.mkdir(parents=True, exist_ok=True)
    directory.write_text("a file, not a directory")
    with pytest.raises(Exception, match="shared-store"):
        _engine(directory.parent / "a", directory)


def test_a_snapshot_still_being_written_to_disk_counts_as_on_its_way_to_the_store(directory: Path) -> None:
    """A snapshot the engine is writing to the disk tier goes through to the shared store only
    once sealed; until it is in the store, ``shared_pending`` (the metric
    ``modeld_shared_store_pending_writes``) counts it: what a SIGKILL would lose. Reading 0
    while the disk write was in progress made the fleet test's kill lose the last turn's
    snapshot now and then (``test_fleet``'s memory-kill case)."""
    from modeld.cache.runtime import Saved
    from modeld.cache.tiers import Tiers

    tiers = Tiers(data_dir=directory.parent / "data", ram_bytes=0, disk_bytes=1 << 30)
    tiers.attach_remote(SharedTier(DirectoryStore(directory, 1 << 30)))

    def reserve(tokens: list[int]) -> Any:
        return tiers.reserve(
            model_digest=MODEL,
            identity=IDENTITY,
            snapshot_format=FORMAT,
            tokens=tokens,
            prefix_tokens=len(tokens),
            truncatable=True,
        )

    try:
        reserved = reserve(TOKENS)
        assert reserved is not None
        entry, tmp = reserved
        assert tmp is not None
        assert tiers.stats()["shared_pending"] == 1  # the engine is writing its file
        tmp.write_bytes(b"p" * 4096)  # what the engine writes
        tiers.seal(entry, Saved(ok=True, size=4096))
        assert tiers.flush(30)
        assert tiers.stats()["shared_pending"] == 0
        assert tiers.stats()["shared_written"] == 1
        assert (directory / f"{_key()}{SUFFIX}").exists()
        # An abandoned write (the engine failed) is not on its way anywhere.
        again = reserve([*TOKENS, 1])
        assert again is not None and again[1] is not None
        assert tiers.stats()["shared_pending"] == 1
        tiers.abandon(again[0])
        assert tiers.stats()["shared_pending"] == 0
    finally:
        tiers.close()
