"""Budgets that hold (issue 22 item 5): under ``--memory-budget``, more workspaces than the KV
pool holds come and go, and the daemon and its worker stay within the budget.

A real ``modeld serve`` with a llama worker on a generated model whose KV is large for its
compute (16 layers of width 256: 16 KiB per token, so a 450-token workspace is a 7 MiB snapshot
and its prefill takes a few tens of milliseconds). The budget is what ``describe`` says the
model takes plus room for two evicted contexts; ten workspaces, on a pool of four
sequences, are driven round robin twice, some closed and new ones opened between the rounds. The
test samples the daemon's and the worker's RSS all along and holds:

* the RAM tier within the room the loaded model leaves of the budget (one budget: the tier used
  to have its own, a quarter of the RAM, beside the models'), the rest of the evicted contexts
  on disk;
* the least recently used context is the one that leaves the KV, and the next turn of every
  workspace finds its context again (restored from RAM or disk, never cold);
* no turn fails, the worker is never killed or restarted;
* what ``status`` reports (the model's parts and the RAM tier) within the budget, and the peak
  memory of daemon and worker under the budget plus a margin: the daemon's own memory, which the
  budget does not cover (measured before the model loaded), and the accounting's tolerance
  (``accounting_tolerance``: 32 MiB + 2%); the daemon grows by no more than the RAM tier's room
  and that tolerance.

The memory measured is what the kernel cannot take back: anonymous and shared memory
(``RssAnon + RssShmem``), plus the model's weights at their size (a mapped file, which the budget
counts whole). RSS also counts clean pages of files (shared libraries, the mapped weights and
snapshot files), and how many of those a process has mapped depends on the page cache, not on the
daemon: on the same code, a fresh clone (its libraries just written, so whole in the cache)
measured 134-142 MiB of them at the peak against 116-117 in a tree in use, the anonymous
memory 178-180 MiB in both; RSS so failed the bound once in CI (342 MiB against 337) and never
in the tree in use (293-297). The peak RSS is printed beside it.
"""

from __future__ import annotations

import json
import shutil
import tempfile
import threading
from dataclasses import replace
from pathlib import Path

import psutil
import pytest
from daemon_proc import modeld, serve_http, stop

import runtime_client as rc
from modeld.contract import Config, DecodeConfig, OpenSessionRequest, PrefixInput
from modeld.engine.memory import accounting_tolerance

testmodels = pytest.importorskip("modeld.testmodels")

MIB = 1 << 20
# TINY's vocabulary and tokenizer, a deep narrow stack: KV per token 2 x 16 layers x 4 heads x 64
# x 2 bytes = 16 KiB, 8M parameters.
DEEP_KV = replace(testmodels.TINY, name="tiny-deep-kv", hidden=256, layers=16, heads=4, kv_heads=4, ff=256)
WINDOW = 2048
WORKSPACES = 10
ROOM = 16 * MIB  # what the budget leaves beside the model: two 7 MiB contexts


NAMES = "alpha bravo charlie delta echo foxtrot golf hotel india juliet kilo lima mike november oscar papa".split()


def _text(i: int) -> str:
    # ~450 tokens of TINY's vocabulary, distinct from the first token on (nothing to copy from
    # another workspace, so which context is the least valuable depends on use alone).
    name = NAMES[i]
    return f"{name}:\n" + "".join(
        f"def {name}_{j}(request):\n    return respond(request.body, {i * 31 + j})\n" for j in range(18)
    )


def _held(pid: int) -> int:
    """The memory a process holds that the kernel cannot drop: anonymous and shared (its clean
    file pages are the page cache's)."""
    fields = dict(line.split(":", 1) for line in Path(f"/proc/{pid}/status").read_text().splitlines())
    return (int(fields["RssAnon"].split()[0]) + int(fields["RssShmem"].split()[0])) << 10


class _Peak:
    """Samples the summed held memory (:func:`_held`) and RSS of the daemon and its children
    every 20 ms."""

    def __init__(self, pid: int) -> None:
        self.daemon = psutil.Process(pid)
        self.peak = 0
        self.daemon_peak = 0
        self.rss_peak = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.wait(0.02):
            try:
                procs = [self.daemon, *self.daemon.children(recursive=True)]
                held = [_held(p.pid) for p in procs]
                rss = sum(p.memory_info().rss for p in procs)
            except (psutil.Error, OSError, KeyError):
                continue
            self.peak = max(self.peak, sum(held))
            self.daemon_peak = max(self.daemon_peak, held[0])
            self.rss_peak = max(self.rss_peak, rss)

    def stop(self) -> None:
        self._stop.set()
        self._thread.join()


def _turn(session: rc.ClientSession, i: int) -> str:
    status = session.ensure_prefix(PrefixInput(text=_text(i)))
    with session.decode(DecodeConfig(max_tokens=8)) as stream:  # type: ignore[attr-defined]
        tokens = [t for chunk in stream for t in chunk.token_ids]
    assert tokens, f"workspace {i} decoded nothing"
    return f"{status.reuse.outcome}/{status.reuse.reason}"


@pytest.mark.llama
@pytest.mark.timeout(300)
def test_more_workspaces_than_fit_stay_within_the_memory_budget() -> None:
    path = str(testmodels.ensure_model(DEEP_KV))
    tmp = Path(tempfile.mkdtemp(prefix="mdbud"))
    described = modeld(
        "describe", "--type", "llama", "--path", path, "--num-ctx", str(WINDOW), "--json", data_dir=tmp
    )
    assert described.returncode == 0, described.stderr
    cost = json.loads(described.stdout)["footprint"]["total_bytes"]
    budget = cost + ROOM
    # No write-behind (a prefix of any length stays in the KV only): every evicted context goes
    # through the RAM tier, which is what the budget must hold.
    proc, record = serve_http(
        tmp,
        "--memory-budget",
        str(budget),
        "--persist-min-tokens",
        "100000",
        backend="llama",
        timeout=300,
    )
    before = _held(record.pid)  # the daemon alone, no model yet
    peak = _Peak(record.pid)
    outcomes: dict[int, list[str]] = {}
    ram_seen: list[int] = []
    try:
        client = rc.connect(f"unix:{tmp / 's.sock'}")
        request = OpenSessionRequest(type="llama", path=path, config=Config(num_ctx=WINDOW))
        sessions = {i: client.open_session(request) for i in range(WORKSPACES)}
        order: list[int] = []  # least recently used first
        for i in range(WORKSPACES):
            outcomes[i] = [_turn(sessions[i], i)]
            order = [j for j in order if j != i] + [i]
            status = client.status()
            (model,) = status.models
            in_kv = {c.session_id for c in model.contexts if c.tier == "kv"}
            # The least recently used contexts are the ones that left the KV.
            assert in_kv == {sessions[j].session_id for j in order[-len(in_kv) :]}, (i, model.contexts)
            assert status.memory.ram_tier_bytes <= status.tiers.ram_budget == budget - cost, status.tiers
            ram_seen.append(status.memory.ram_tier_bytes)
        worker_pid = model.worker.pid if model.worker is not None else 0
        # Workspaces come and go: three close (their contexts stay warm, detached) and two new
        # ones open. A detached context is worth less than an open workspace's: while a closed
        # one's context is still in the KV, no open workspace's left it for the new one. (Which
        # stay at all also depends on what their attention measured: idle contexts leave a
        # unified pool when they cost a turn more than moving them, blueprint 0016.)
        kv_before = {c.session_id for c in model.contexts if c.tier == "kv"}
        closed = {sessions[i].session_id for i in (1, 5, WORKSPACES - 3)}
        for i in (1, 5, WORKSPACES - 3):
            sessions.pop(i).close()
        for i in (WORKSPACES, WORKSPACES + 1):
            sessions[i] = client.open_session(request)
            outcomes[i] = [_turn(sessions[i], i)]
            if i == WORKSPACES:
                (model,) = client.status().models
                kv_now = {c.session_id for c in model.contexts if c.tier == "kv"}
                assert sessions[i].session_id in kv_now, model.contexts
                if kv_now & closed:
                    assert kv_before - closed <= kv_now, model.contexts
        for i, session in sorted(sessions.items()):
            outcomes.setdefault(i, []).append(_turn(session, i))
            status = client.status()
            # Blobs on their way to disk count: a turn that pushed them out waited for them.
            assert status.memory.ram_tier_bytes <= status.tiers.ram_budget, (i, status.tiers)
            ram_seen.append(status.memory.ram_tier_bytes)
        status = client.status()
        client.close()
    finally:
        peak.stop()
        _, err = stop(proc)
        shutil.rmtree(tmp, ignore_errors=True)
    assert "Traceback" not in err, err[-3000:]

    (model,) = status.models
    # Nothing was killed or restarted; every turn was served.
    assert model.worker is not None and model.worker.pid == worker_pid and model.worker.restarts == 0
    assert len(model.contexts) >= WORKSPACES  # every workspace's context is still somewhere
    # The first round was cold for everyone; every second turn found its context again.
    assert all(o[0].startswith("cold") for o in outcomes.values()), outcomes
    seconds = {i: o[-1] for i, o in outcomes.items() if len(o) == 2}
    assert all(o.startswith("warm") for o in seconds.values()), seconds
    assert any(o.endswith("restored_from_disk") for o in seconds.values()), seconds
    assert any(o.endswith("restored_from_ram") for o in seconds.values()), seconds
    # The RAM tier held what the room allows and no more; the rest went to disk.
    assert max(ram_seen) > 0 and max(ram_seen) <= ROOM, ram_seen
    assert status.tiers.spilled_to_disk > 0 and status.tiers.dropped == 0, status.tiers
    # What status reports is within the budget.
    m = model.memory
    reported = m.weights_bytes + m.kv_allocated_bytes + m.compute_bytes + m.runtime_bytes
    assert reported + status.memory.ram_tier_bytes <= budget, (m, status.memory)
    # The peak of daemon and worker (what they hold, and the weights): within the budget plus
    # the margin, the daemon's own memory (outside the budget) and the accounting's tolerance
    # (blueprint 0016).
    used = peak.peak + m.weights_bytes
    margin = before + accounting_tolerance(used)
    print(
        f"budget {budget >> 20} MiB (model {cost >> 20} + room {ROOM >> 20}), daemon alone {before >> 20} MiB; "
        f"peak daemon + worker {peak.peak >> 20} MiB + weights {m.weights_bytes >> 20} (RSS {peak.rss_peak >> 20}), "
        f"daemon {peak.daemon_peak >> 20} MiB; RAM tier at most {max(ram_seen) >> 20} MiB; "
        f"reported {(reported + status.memory.ram_tier_bytes) >> 20} MiB; worker {m}"
    )
    assert used <= budget + margin, (used >> 20, budget >> 20, margin >> 20)
    # The daemon grew by no more than the RAM tier's room and the slack.
    grown = peak.daemon_peak - before
    assert grown <= ROOM + accounting_tolerance(peak.daemon_peak), (grown >> 20, ram_seen)


def test_the_ram_tier_holds_what_the_budget_leaves_and_spills_the_oldest_to_disk(tmp_path: Path) -> None:
    """``Tiers.limit_ram``, the engine's half of one budget, without an engine: a smaller room
    moves the least recently used blobs to disk at once; the tier's own budget still caps it."""
    from modeld.cache.tiers import Tiers

    tiers = Tiers(data_dir=tmp_path, ram_bytes=1 << 20, disk_bytes=64 << 20)
    try:
        entries = []
        for i in range(4):
            entry = tiers.put(
                model_digest="m",
                identity="i",
                snapshot_format="f",
                tokens=[1000 * i + t for t in range(50)],
                prefix_tokens=50,
                blob=bytes([i]) * 100_000,
                truncatable=True,
            )
            assert entry is not None
            entry.last_used = float(i)  # 0 is the least recently used
            entries.append(entry)
        assert tiers.stats()["ram_bytes"] == 400_000 and tiers.stats()["ram_budget"] == 1 << 20
        tiers.limit_ram(250_000)  # the models took the rest of the budget
        assert tiers.flush(30)
        stats = tiers.stats()
        assert stats["ram_budget"] == 250_000 and stats["ram_bytes"] == 200_000, stats
        assert [e.tier for e in entries] == ["disk", "disk", "ram", "ram"]
        assert stats["spilled_to_disk"] == 2 and stats["dropped"] == 0
        big = tiers.put(
            model_digest="m",
            identity="i",
            snapshot_format="f",
            tokens=[9, 9, 9],
            prefix_tokens=3,
            blob=b"x" * 300_000,
            truncatable=True,
        )
        assert big is not None and tiers.flush(30) and big.tier == "disk"  # larger than the room
        tiers.limit_ram(10 << 20)  # a model went: the tier's own budget caps it again
        assert tiers.stats()["ram_budget"] == 1 << 20
    finally:
        tiers.close()
