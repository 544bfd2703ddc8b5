"""A session waiting for a busy model is visible, with a real daemon: explain-context shows its
place in the queue, ``modeld status`` the busy slots and the queue, the metrics the same, and
the wait itself reaches the queue-wait histogram through the engine's events (issue 9, item 4)."""

from __future__ import annotations

import shutil
import tempfile
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from daemon_proc import modeld, start_serve, stop, wait_serving
from prometheus_client.parser import text_string_to_metric_families

import runtime_client as rc
from modeld.contract import DecodeConfig, OpenSessionRequest, PrefixInput, PrefixStatus

pytestmark = pytest.mark.wire

MODEL = OpenSessionRequest(type="memory", path="tiny", model_name="coder")


@pytest.fixture
def daemon() -> Iterator[Path]:
    data = Path(tempfile.mkdtemp(prefix="mdq"))
    proc = start_serve(data, data / "s.sock", "--slots", "1", "--sequences", "2")
    try:
        wait_serving(data, proc.pid)
        yield data
    finally:
        stop(proc)
        shutil.rmtree(data, ignore_errors=True)


def _metrics(data: Path) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    text = modeld("metrics", data_dir=data).stdout
    return {
        (s.name, tuple(sorted(s.labels.items()))): s.value
        for family in text_string_to_metric_families(text)
        for s in family.samples
    }


def _wait_behind_a_decode(data: Path, check: object) -> PrefixStatus:
    """Session A decodes slowly on the model's only slot; session B's ensure_prefix waits for
    it. ``check(client, b)`` runs while B waits; then A's decode is cancelled and B proceeds."""
    with rc.connect(data_dir=data) as client:
        a, b = client.open_session(MODEL), client.open_session(MODEL)
        a.ensure_prefix(PrefixInput(text="session a\n"))
        # The memory model ends its answer after ~70 tokens: 200 ms each keeps A decoding for the
        # whole check (three CLI runs), which 20 ms did not on a loaded machine.
        stream = a.decode(DecodeConfig(max_tokens=2000, extra={"delay_ms": "200"}))
        next(stream)  # A holds the slot now
        result: list[PrefixStatus] = []
        waiting = threading.Thread(
            target=lambda: result.append(b.ensure_prefix(PrefixInput(text="session b\n")))
        )
        waiting.start()
        while client.explain_context(b.session_id).queue_position != 1:
            time.sleep(0.01)  # until B is queued (a state, not a time)
        check(client, b)  # type: ignore[operator]
        stream.cancel()
        assert list(stream)[-1].finish_reason == "canceled"
        waiting.join()
        report = b.explain_context()
        assert report.queue_position == 0
        assert report.queue_wait_seconds > 0
        text = modeld("explain-context", b.session_id, data_dir=data).stdout
        assert f"not waiting (last wait {report.queue_wait_seconds:.1f}s)" in text
        a.close()
        b.close()
        return result[0]


def test_a_queued_session_shows_in_explain_context_status_and_metrics(daemon: Path) -> None:
    def check(client: rc.Client, b: rc.ClientSession) -> None:
        text = modeld("explain-context", b.session_id, data_dir=daemon).stdout
        assert "  queue         waiting for a slot: position 1, " in text
        status = modeld("status", data_dir=daemon).stdout
        assert "    slots     1 of 1 busy · 1 queued · 2 sequences" in status
        m = _metrics(daemon)
        assert m[("modeld_slots", (("model", "coder"),))] == 1
        assert m[("modeld_slots_busy", (("model", "coder"),))] == 1
        assert m[("modeld_queue_length", (("model", "coder"),))] == 1
        assert m[("modeld_worker_state", (("model", "coder"), ("state", "busy")))] == 1

    status = _wait_behind_a_decode(daemon, check)
    assert status.prefix_tokens == 11
    m = _metrics(daemon)
    assert m[("modeld_queue_length", (("model", "coder"),))] == 0
    assert m[("modeld_worker_state", (("model", "coder"), ("state", "ready")))] == 1


def test_a_wait_for_a_slot_reaches_the_queue_wait_histogram(daemon: Path) -> None:
    _wait_behind_a_decode(daemon, lambda client, b: None)
    m = _metrics(daemon)
    assert m[("modeld_queue_wait_seconds_count", ())] == 1
    assert m[("modeld_queue_wait_seconds_sum", ())] > 0
