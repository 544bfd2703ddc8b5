"""Request records in process: the ring, the append-only file, retention by age and bytes, a
restart, queries; and a session's turns recorded with the very numbers the metrics count (the
memory backend, real tiers: cold, warm, an eviction to the RAM tier and back, a prefix-only
turn, a refused operation)."""

from __future__ import annotations

import json
import os
import time
from pathlib import Path

import pytest

from modeld.contract import DecodeConfig, OpenSessionRequest, PrefixInput, SuffixInput
from modeld.engine import Engine
from modeld.errors import LimitExceededError
from modeld.observe.metrics import Metrics
from modeld.observe.records import COUNTED, MAX_LABEL_CHARS, RecordQuery, Records, clean_label, sums
from modeld.server.http.ui.answer import metric_totals
from modeld.settings import Limits, Residency

A = "a" * 200 + "\n"  # 202 tokens with BOS on the memory backend: above snapshot_min_tokens
B = "b" * 200 + "\n"


class Clock:
    def __init__(self) -> None:
        self.now = time.time()  # file times are real: retention by age compares them

    def __call__(self) -> float:
        return self.now


def _done(records: Records, api: str = "openai", **labels: object) -> str:
    recording = records.begin(api, **labels)
    recording.add(prefix_tokens=10, reused_kv=7, prefilled_tokens=3)
    recording.finish(finish="stop", status=200)
    return recording.id


def test_a_finished_record_is_a_json_line_and_a_restart_reads_it_back(tmp_path: Path) -> None:
    records = Records(tmp_path / "requests")
    running = records.begin("openai", job="nightly", conversation="auto:1")
    rid = _done(records, job="nightly", conversation="auto:1")
    records.flush()  # written behind, by a thread of its own
    (segment,) = sorted((tmp_path / "requests").glob("requests-*.jsonl"))
    (line,) = segment.read_text().splitlines()  # only the finished one is written
    assert json.loads(line)["id"] == rid
    assert json.loads(line)["reused_tokens"] == 7
    assert records.get(running.id) is not None and records.get(running.id).state == "running"  # type: ignore[union-attr]

    again = Records(tmp_path / "requests")
    assert [r.id for r in again.recent()] == [rid]
    found = again.get(rid)
    assert found is not None and (found.job, found.finish, found.prefix_tokens) == ("nightly", "stop", 10)


def test_the_ring_keeps_its_size_and_older_records_are_read_from_the_file(tmp_path: Path) -> None:
    clock = Clock()
    records = Records(tmp_path, ring=5, clock=clock)
    ids = []
    for i in range(12):
        clock.now += 1
        ids.append(_done(records, job="even" if i % 2 == 0 else "odd"))
    assert [r.id for r in records.recent()] == ids[-5:]
    # The ring is full: a query reads the file for what it no longer holds, oldest first.
    evens = records.query(RecordQuery(job="even", limit=100))
    assert [r.id for r in evens] == ids[0::2]
    assert [r.id for r in records.query(RecordQuery(limit=3))] == ids[-3:]
    assert records.get(ids[0]) is not None  # from the file
    since = records.query(RecordQuery(since=clock.now - 2.5))
    assert [r.id for r in since] == ids[-3:]


def test_retention_drops_whole_segments_by_bytes_then_by_age(tmp_path: Path) -> None:
    clock = Clock()
    records = Records(tmp_path, ring=10_000, max_bytes=8 * (64 << 10), max_age_seconds=3600.0, clock=clock)
    pad = "x" * 200
    ids = []
    for _ in range(4000):  # ~4 MB of lines (1 KB each) into a 512 KiB budget
        recording = records.begin("grpc", job=pad)
        recording.finish(finish="stop")
        ids.append(recording.id)
    records.close()
    files = sorted(tmp_path.glob("requests-*.jsonl"))
    total = sum(p.stat().st_size for p in files)
    assert total <= 8 * (64 << 10) + (64 << 10)  # the budget, and the segment being written
    kept = [json.loads(line)["id"] for p in files for line in p.read_text().splitlines()]
    assert kept == ids[-len(kept) :] and 400 < len(kept) < 4000 / 4  # the newest, in order; the oldest went
    # Age: segments whose newest record is older than the limit go at the next start.
    for path in files:
        os.utime(path, (clock.now - 7200, clock.now - 7200))
    clock.now += 1
    fresh = Records(tmp_path, ring=10, max_bytes=8 * (64 << 10), max_age_seconds=3600.0, clock=clock)
    assert sorted(tmp_path.glob("requests-*.jsonl")) == []
    assert fresh.recent() == []


def test_no_file_when_the_byte_budget_is_zero(tmp_path: Path) -> None:
    records = Records(tmp_path / "r", max_bytes=0)
    _done(records)
    assert not list((tmp_path / "r").glob("*.jsonl")) if (tmp_path / "r").exists() else True
    assert len(records.recent()) == 1


def test_a_label_is_bounded_and_printable() -> None:
    assert clean_label("nightly-42") == "nightly-42"
    with pytest.raises(ValueError, match="limit is 256"):
        clean_label("x" * (MAX_LABEL_CHARS + 1), "job")
    with pytest.raises(ValueError, match="control character"):
        clean_label("a\nb", "job")


def test_a_sessions_turns_are_recorded_with_the_numbers_the_metrics_count(tmp_path: Path) -> None:
    """Two sessions on one sequence: cold, warm, the other session evicts the first to the RAM
    tier, the first comes back restored from RAM; a turn that only puts a prefix in place; an
    operation refused (a suffix over the text limit). Per model, the records' sums equal the
    counters; each turn is one record."""
    request = OpenSessionRequest(path="repo", model_name="coder")
    records = Records(tmp_path / "requests")
    limits = Limits(max_text_bytes=64 << 10)
    with Engine(
        backends=("memory",), residency=Residency(sequences=1), data_dir=tmp_path, limits=limits
    ) as engine:
        metrics = Metrics(engine.status)
        a = metrics.observe(engine.open_session(request), records, "grpc", "job-a")
        b = metrics.observe(engine.open_session(request), records, "grpc", "job-b")

        def turn(session: object, prefix: str, suffix: str) -> None:
            session.ensure_prefix(PrefixInput(text=prefix))  # type: ignore[attr-defined]
            session.prefill_suffix(SuffixInput(text=suffix))  # type: ignore[attr-defined]
            with session.decode(DecodeConfig(max_tokens=5)) as stream:  # type: ignore[attr-defined]
                list(stream)

        turn(a, A, "q1\n")  # cold
        turn(a, A, "q2\n")  # warm
        turn(b, B, "q3\n")  # cold; a's context goes to the RAM tier
        turn(a, A, "q4\n")  # restored from RAM
        b.ensure_prefix(PrefixInput(text=B))  # a prefix only: its record ends with the next turn
        with pytest.raises(LimitExceededError):
            b.prefill_suffix(SuffixInput(text="z" * (65 << 10)))
        a.close()
        b.close()

    done = records.recent()
    assert [(r.job, r.finish) for r in done] == [
        ("job-a", "length"),
        ("job-a", "length"),
        ("job-b", "length"),
        ("job-a", "length"),
        ("job-b", "error"),
    ]
    assert [r.outcome for r in done[:4]] == ["cold", "warm", "cold", "warm"]
    assert done[3].reused_ram == 202 and done[3].reason == "restored_from_ram"
    assert done[4].error == "limit_exceeded" and done[4].prefix_tokens == 202
    assert all(r.state == "done" and r.api == "grpc" for r in done)
    assert all(r.ttft_ms is not None for r in done[:4])
    by_model = sums(done, lambda r: r.model)
    assert by_model == metric_totals(metrics)
    assert set(by_model) == {"coder"}
    assert by_model["coder"]["decodes"] == 4 and set(COUNTED) == set(by_model["coder"])


def test_a_turn_cut_short_is_done_when_its_transport_and_its_session_have_let_it_go(tmp_path: Path) -> None:
    """An HTTP request's record is handed to its session: the client goes away mid-decode (the
    runner lets go first, canceled) while the engine is still decoding; the record stays running
    until the session lets go too, and the counts the metrics took reach it."""
    records = Records(tmp_path / "requests")
    with Engine(backends=("memory",), data_dir=tmp_path) as engine:
        metrics = Metrics(engine.status)
        session = metrics.observe(
            engine.open_session(OpenSessionRequest(path="repo", model_name="coder")), records, "http"
        )
        recording = records.begin("openai", external=True, job="cut", conversation="auto:1")
        session.record(recording)
        session.ensure_prefix(PrefixInput(text=A))
        session.prefill_suffix(SuffixInput(text="go on\n"))
        stream = session.decode(DecodeConfig(max_tokens=200))
        next(stream)
        recording.finish(status=200, finish="canceled", error="canceled")  # the runner: the client left
        assert records.get(recording.id).state == "running"  # type: ignore[union-attr]
        stream.close()  # the engine stops; the session lets go
        session.close()
    record = records.get(recording.id)
    assert record is not None and (record.state, record.finish, record.error) == (
        "done",
        "canceled",
        "canceled",
    )
    assert record.prefix_tokens == 202 and record.prefilled_tokens > 202
    assert sums([record], lambda r: r.model) == metric_totals(metrics)


def test_a_prefill_ahead_counts_in_its_conversations_sums_but_is_no_turn(tmp_path: Path) -> None:
    records = Records(tmp_path / "requests", ring=3)
    turn = records.begin(
        "anthropic", external=True, model="m", job="j", agent="claude-cli", conversation="c1"
    )
    turn.add(prefix_tokens=10, reused_kv=7, prefilled_tokens=3)
    ahead = turn.follow_up()  # the work the turn left its session: the turn's labels
    turn.finish(finish="end_turn", status=200)
    ahead.add(prefix_tokens=14, reused_kv=12, prefilled_tokens=2)
    ahead.finish(finish="ahead")
    got = records.get(ahead.id)
    assert got is not None and got.state == "done" and got.finish == "ahead"
    assert (got.api, got.model, got.job, got.agent, got.conversation) == (
        "anthropic",
        "m",
        "j",
        "claude-cli",
        "c1",
    )
    (tally,), count = records.tallies()
    assert count == 1 and tally.turns == 1, tally  # one turn; its prefill ahead is none
    assert tally.last is not None and tally.last.id == turn.id  # the page's last turn is the turn
    assert tally.sums["prefilled_tokens"] == 5 and tally.sums["prefix_tokens"] == 24  # both counted
    for _ in range(3):  # both leave the ring: the conversation's tally goes with them
        _done(records, conversation="c2")
    assert [t.key for t in records.tallies()[0]] == ["c2"]
