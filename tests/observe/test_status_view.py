"""``modeld status`` and ``modeld explain-context`` show a person where warm state lives and
why a turn was warm, restored or cold, from a real daemon (issue 8, item 6; issue 9, item 6).

The daemon keeps one warm sequence per model, so a second session's prefix evicts the first
one's context: to the RAM tier when it has a budget (the next turn is restored from there),
nowhere when both tiers are off (the next turn is cold, ``evicted``)."""

from __future__ import annotations

import json
import shutil
import subprocess
import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest
from daemon_proc import MODELD, modeld, start_serve, stop, wait_serving

import runtime_client as rc
from modeld.contract import OpenSessionRequest, PrefixInput

pytestmark = pytest.mark.wire

MODEL = OpenSessionRequest(type="memory", path="tiny", model_name="coder")
A = "a" * 200 + "\n"  # 202 tokens with BOS
B = "b" * 200 + "\n"


def _serve(*flags: str) -> Iterator[Path]:
    data = Path(tempfile.mkdtemp(prefix="mds"))
    proc = start_serve(data, data / "s.sock", "--sequences", "1", *flags)
    try:
        wait_serving(data, proc.pid)
        yield data
    finally:
        stop(proc)
        shutil.rmtree(data, ignore_errors=True)


@pytest.fixture
def with_ram_tier() -> Iterator[Path]:
    yield from _serve("--ram-tier-bytes", "64M", "--disk-tier-bytes", "0")


@pytest.fixture
def without_tiers() -> Iterator[Path]:
    yield from _serve("--ram-tier-bytes", "0", "--disk-tier-bytes", "0")


def test_a_context_evicted_to_ram_and_restored(with_ram_tier: Path) -> None:
    data = with_ram_tier
    with rc.connect(data_dir=data) as client:
        a = client.open_session(MODEL)
        b = client.open_session(MODEL)
        a.ensure_prefix(PrefixInput(text=A))
        b.ensure_prefix(PrefixInput(text=B))  # a's context goes to the RAM tier

        text = modeld("explain-context", a.session_id, data_dir=data).stdout
        assert (
            "  this session  no warm context in the KV now (the next operation restores or recomputes it)"
            in text
        )
        assert "  last turn     cold: nothing compatible was warm · reused 0 of 202 tokens · prefill " in text

        restored = a.ensure_prefix(PrefixInput(text=A))
        assert restored.reuse.reason == "restored_from_ram"
        report = a.explain_context()
        text = modeld("explain-context", a.session_id, data_dir=data).stdout
        assert f"  this session  context {report.context_id} in the kv tier (202 tokens, " in text
        assert "· not pinned · kept until the pool needs room" in text
        assert (
            f"  last turn     warm: restored from the ram tier (snapshot {restored.reuse.context}) · reused 202 of "
            f"202 tokens · prefill 0.0 ms · restore {restored.restore_ms:.1f} ms"
        ) in text
        assert "  queue         not waiting (last wait 0.0s)" in text
        rows = [line.split() for line in text.splitlines() if line.startswith("    ") and "202" in line]
        assert [report.context_id, "*", "kv", "202", "202"] == rows[0][:5]  # this session's, marked
        # b's snapshot; a's left the RAM tier when its restore brought it back whole (held once)
        assert [r[1:4] for r in rows[1:]] == [["ram", "202", "202"]]

        status = json.loads(modeld("status", "--json", data_dir=data).stdout)
        (model,) = status["models"]
        assert model["model_name"] == "coder"
        assert sorted(c["tier"] for c in model["contexts"]) == ["kv", "ram"]
        counters = model["counters"]
        assert (counters["reused_ram"], counters["reused_kv"], counters["evicted_to_ram"]) == (202, 0, 2)
        assert status["tiers"]["ram_entries"] == 1
        memory = status["memory"]
        assert memory["ram_tier_bytes"] == status["tiers"]["ram_bytes"] > 0
        assert memory["own_bytes"] == memory["rss_bytes"] - memory["ram_tier_bytes"]
        machine = status["machine"]
        assert machine["cpu_count"] >= 1 and machine["ram_total_bytes"] > 0

        human = modeld("status", data_dir=data).stdout
        assert "  coder  memory · digest " in human
        assert " · window 32768 · 2 sessions · idle " in human  # the memory model's own window
        assert "    worker    pid " in human and " · ready (inline) · " in human
        assert "    slots     0 of 1 busy · 0 queued · 1 sequence · " in human
        assert "    prefixes  606 tokens looked up · reused from kv 0, ram 202, disk 0, shared 0\n" in human
        assert (
            "    prefill   404 prompt tokens computed (prefixes, suffixes, recomputed ones) · 0 a session "
            "had computed before · contexts brought back before asked 0\n"
        ) in human
        assert (
            f"    evicted   to ram 2, disk 0, dropped 0 · snapshots taken {counters['snapshots_taken']}, "
            "rejected 0 · prefixes copied 0\n"
        ) in human
        assert f"              {report.context_id}  " in human
        assert "machine   " in human and " CPU" in human
        assert "tiers     ram   1 snapshot, " in human
        assert "memory    daemon " in human and ": adds up (within " in human
        assert "    memory    inline (part of the daemon's own) · KV " in human
        debug = modeld("status", "--debug", data_dir=data).stdout
        assert "    log (the model runs inline: its lines are in the daemon's log)" in debug
        logs = modeld("logs", "coder", data_dir=data)
        assert (
            logs.stdout
            == "== coder (memory, ready) (the model runs inline: its lines are in the daemon's log)\n"
        )
        missing = modeld("logs", "nope", data_dir=data)
        assert (missing.returncode, missing.stderr) == (
            1,
            "modeld: error: no loaded model matches 'nope' (loaded: coder)\n",
        )
        a.close()
        b.close()


def test_a_context_evicted_with_no_tier_is_a_cold_turn_saying_so(without_tiers: Path) -> None:
    data = without_tiers
    with rc.connect(data_dir=data) as client:
        a = client.open_session(MODEL)
        b = client.open_session(MODEL)
        a.ensure_prefix(PrefixInput(text=A))
        b.ensure_prefix(PrefixInput(text=B))
        again = a.ensure_prefix(PrefixInput(text=A))
        assert (again.reuse.outcome, again.reuse.reason) == ("cold", "evicted")
        text = modeld("explain-context", a.session_id, data_dir=data).stdout
        assert "last ensure_prefix: COLD (evicted)" in text
        assert (
            "  last turn     cold: this session's warm context had been evicted and dropped · reused 0 of 202"
            in text
        )
        human = modeld("status", data_dir=data).stdout
        assert "    evicted   to ram 0, disk 0, dropped 2 · " in human
        assert "tiers     ram   off (budget 0)" in human
        a.close()
        b.close()


def test_status_into_a_closed_pipe_ends_quietly(with_ram_tier: Path) -> None:
    """``modeld status | head``: the reader is gone before modeld writes; no traceback."""
    for args in (["status"], ["status", "--debug"], ["logs"], ["explain-context"]):
        proc = subprocess.Popen(
            [MODELD, "--data-dir", str(with_ram_tier), *args], stdout=subprocess.PIPE, stderr=subprocess.PIPE
        )
        assert proc.stdout is not None and proc.stderr is not None
        proc.stdout.close()  # like `head` exiting at once
        with proc.stderr:
            err = proc.stderr.read().decode()
        assert proc.wait(timeout=60) == 141, err
        assert err == ""
    shell = subprocess.run(
        f"'{MODELD}' --data-dir '{with_ram_tier}' status | head -1",
        shell=True,
        capture_output=True,
        text=True,
        timeout=60,
        check=True,
    )
    assert shell.stdout.startswith("modeld ") and shell.stdout.count("\n") == 1
    assert shell.stderr == ""
