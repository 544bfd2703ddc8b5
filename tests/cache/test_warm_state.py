"""Many warm contexts per model that survive: sub-agents, workspaces, restarts (issue 8).

The central property: whatever the engine did to get there -- reuse its own context, copy
another session's prefix, restore a snapshot from the RAM or the disk tier after an eviction or
a restart -- greedy output equals a fresh evaluation of the same text. Then: exact accounting
under concurrency, evictions that say where they went, pins, keep-alive, restarts of the daemon
(SIGTERM and SIGKILL), and every kind of bad snapshot file, made by editing files on disk.
"""

from __future__ import annotations

import contextlib
import os
import random
import shutil
import signal
import threading
import time
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest
from daemon_proc import start_serve, stop, wait_serving

import runtime_client as rc
from modeld.backends.base import LoadOptions
from modeld.cache.snapfile import (
    FORMAT_VERSION,
    SUFFIX,
    SnapshotError,
    SnapshotHeader,
    open_verified,
    read_header,
    verify_payload,
    write_atomic,
)
from modeld.cache.tiers import WRITER_NICE, Tiers, entry_key
from modeld.contract import Config, DecodeConfig, OpenSessionRequest, PrefixInput, SuffixInput
from modeld.engine import Engine
from modeld.engine.session import EngineSession
from modeld.settings import Residency
from modeld.workers.protocol import ProtocolError, Restore, decode_frame, encode_frame

testmodels = pytest.importorskip("modeld.testmodels")

WORKSPACES = [
    "You are a careful engineer.\nrepo: src/app.py main() load_config()\nsrc/db.py connect() migrate()\n" * 4,
    "You are a careful engineer.\nrepo: lib/parser.c parse() lex()\nlib/ast.h node_t\n" * 4,
    "You are a terse reviewer.\nrepo: web/index.ts render() route()\nweb/api.ts fetchUser()\n" * 4,
]
SUFFIXES = ["fix the failing test\n", "why does migrate() hang?\n", "add a docstring\n", "rename lex\n"]
EDITS = ["history: user asked about tests\n", "history: tool returned 3 lines\n", "pinned: def f(): pass\n"]


def _request(path: str, **config: Any) -> OpenSessionRequest:
    return OpenSessionRequest(
        type="llama", path=path, config=Config(**{"num_ctx": 2048, "num_batch": 32, **config})
    )


class Reference:
    """A fresh evaluation: the llama runtime in this process, one sequence emptied before each text."""

    def __init__(self, path: str) -> None:
        from modeld.backends.llama import LlamaBackend

        backend = LlamaBackend()
        request = _request(path)
        self.runtime = backend.load(
            request, backend.describe(request), LoadOptions(n_seq=1, window=2048, pool_tokens=2048)
        )
        self._cache: dict[tuple[str, str], list[int]] = {}

    def greedy(self, prefix: str, suffix: str, n: int) -> list[int]:
        """The first ``n`` greedy tokens (computed for 8 and cut: greedy is deterministic)."""
        key = (prefix, suffix)
        if key not in self._cache:
            rt = self.runtime
            head = rt.tokenize(prefix, add_bos=True)
            rt.drop(0)
            # Two prefills, as a session's prefix and suffix are (on models whose numbers depend
            # on where batches begin, the boundary between them is one).
            for _ in rt.sync(0, 0, head):
                pass
            for _ in rt.sync(0, len(head), rt.tokenize(suffix, add_bos=False)):
                pass
            eog = rt.vocab().eog
            out = []
            for token in rt.generate(0, DecodeConfig(max_tokens=8), 8):
                if token in eog:
                    break
                out.append(token)
            self._cache[key] = out
        return self._cache[key][:n]

    def close(self) -> None:
        self.runtime.close()


def _greedy(session: Any, n: int) -> list[int]:
    with session.decode(DecodeConfig(max_tokens=n)) as stream:
        chunks = list(stream)
    assert chunks[-1].finish_reason in ("length", "stop"), chunks[-1]
    return [t for c in chunks for t in c.token_ids]


def _walk(
    model_path: str, data_dir: Path, seed: int, steps: int, residency: Residency, *, turns: bool = False
) -> dict[str, int]:
    """Random turns of several sessions over few sequences; every decode checked against a
    fresh evaluation. Returns how often each reuse reason happened. ``turns``: each piece of
    history is a chat turn (``<|im_start|>``...), as agents' prompts grow."""
    rng = random.Random(seed)
    reference = Reference(model_path)
    seen: dict[str, int] = {}
    engine = Engine(backends=("llama",), residency=residency, data_dir=data_dir)
    try:
        sessions: list[EngineSession] = [engine.open_session(_request(model_path)) for _ in range(4)]
        texts = {i: rng.randrange(len(WORKSPACES)) for i in range(len(sessions))}
        histories: dict[int, str] = {i: "" for i in range(len(sessions))}
        for _step in range(steps):
            roll = rng.random()
            if roll < 0.05:  # the daemon restarts: only the disk tier survives
                engine.shutdown()
                engine = Engine(backends=("llama",), residency=residency, data_dir=data_dir)
                sessions = [engine.open_session(_request(model_path)) for _ in range(4)]
                continue
            i = rng.randrange(len(sessions))
            if roll < 0.12:  # a session closes and a new client takes its place
                sessions[i].close()
                sessions[i] = engine.open_session(_request(model_path))
            if rng.random() < 0.2:
                texts[i] = rng.randrange(len(WORKSPACES))
                histories[i] = ""
            if rng.random() < 0.4:
                edit = rng.choice(EDITS)
                # A turn as long as an agent's tool result: a turn start begins a batch when it
                # comes TURN_GAP tokens or more after the last one (llama_checkpoints).
                histories[i] += f"<|im_start|>user\n{edit * 16}<|im_end|>\n" if turns else edit
            prefix = WORKSPACES[texts[i]] + histories[i]
            suffix = rng.choice(SUFFIXES)
            status = sessions[i].ensure_prefix(PrefixInput(text=prefix))
            assert status.reused_tokens + status.prefilled_tokens == status.prefix_tokens
            seen[status.reuse.reason] = seen.get(status.reuse.reason, 0) + 1
            sessions[i].prefill_suffix(SuffixInput(text=suffix))
            n = rng.choice((4, 8))
            assert _greedy(sessions[i], n) == reference.greedy(prefix, suffix, n), (seed, _step, status.reuse)
    finally:
        engine.shutdown()
        reference.close()
    return seen


@pytest.mark.llama
@pytest.mark.parametrize("seed", [1, 2])
def test_warm_output_equals_a_fresh_evaluation_across_evictions_snapshots_and_restores(
    tmp_path: Path, seed: int
) -> None:
    residency = Residency(
        sequences=2,  # four sessions on two sequences: evictions on most switches
        snapshot_min_tokens=8,
        # No prefix is long enough to be written behind: contexts reach the tiers by eviction
        # (to RAM, spilling to disk) and by restarts (to disk). The write-behind is walked below.
        persist_min_tokens=4096,
        ram_tier_bytes=200_000,  # about one snapshot of the tiny model: the rest spills to disk
    )
    seen = _walk(str(testmodels.ensure_model(testmodels.TINY)), tmp_path / "data", seed, 45, residency)
    # The walk went through every path it is meant to test.
    for reason in ("restored_from_ram", "restored_from_disk", "diverged", "full_match", "extended"):
        assert seen.get(reason, 0) > 0, seen


@pytest.mark.llama
def test_the_same_walk_on_a_unified_kv_pool(tmp_path: Path) -> None:
    """Shared cells, copies that only tag them, a pool that fills: the reuse logic holds. (The
    tiny model does not show the rounding-level differences of cell placement on a unified pool;
    blueprint 0016 measures them on the realistic model.)"""
    residency = Residency(
        sequences=2, kv_unified=True, pool_tokens=2048, snapshot_min_tokens=8, persist_min_tokens=8
    )
    seen = _walk(str(testmodels.ensure_model(testmodels.TINY)), tmp_path / "data", 5, 45, residency)
    assert seen.get("restored_from_disk", 0) > 0, seen


@pytest.mark.llama
def test_warm_output_equals_a_fresh_evaluation_on_a_recurrent_model(tmp_path: Path) -> None:
    """Recurrent memory cannot be cut at any token: a turn that diverges inside a warm context
    goes back to the last checkpoint before the divergence (``diverged``, the engine evaluating
    the rest), and a context that left the pool comes back whole from the disk tier."""
    # A workspace's first prefix is written behind to disk; a prefix that computed fewer tokens
    # (an edit) keeps its boundary state in the RAM tier.
    residency = Residency(sequences=2, snapshot_min_tokens=8, persist_min_tokens=64)
    path = str(testmodels.ensure_model(testmodels.RECURRENT))
    seen = _walk(path, tmp_path / "data", 3, 30, residency)
    assert seen.get("diverged", 0) > 0 and seen.get("restored_from_disk", 0) > 0, seen


@pytest.mark.llama
@pytest.mark.parametrize("name", [s.name for s in testmodels.ARCH_SPECS])
def test_the_walk_on_sliding_window_hybrid_and_recurrent_models(tmp_path: Path, name: str) -> None:
    """The random walk (sessions, evictions, tiers, restarts) on every class of memory that
    cannot be cut at any token: every decode equals a fresh evaluation, turns extend or reuse
    their warm context whole, and contexts come back from the tiers. (The workspaces share
    fewer tokens than a batch: a switch between them goes back to the start, ``truncation_unsupported``;
    edits inside a prefix are tests/cache/test_hybrid_memory.py's.) The history grows by chat turns of
    130-odd tokens: on these models a prefill that resumes where an earlier one ended, inside a
    batch of a fresh evaluation, differs from it by rounding (blueprint 0016, "Checkpoints"); a
    turn start TURN_GAP tokens or more after the last one is where a fresh evaluation's batches
    begin too."""
    spec = next(s for s in testmodels.ARCH_SPECS if s.name == name)
    residency = Residency(sequences=2, snapshot_min_tokens=8, persist_min_tokens=64)
    seen = _walk(str(testmodels.ensure_model(spec)), tmp_path / "data", 4, 24, residency, turns=True)
    warm = ("extended", "full_match")
    restored = seen.get("restored_from_disk", 0) + seen.get("restored_from_ram", 0)
    assert all(seen.get(reason, 0) > 0 for reason in warm) and restored > 0, sorted(seen.items())


# --- several warm contexts per model ----------------------------------------------------------


@pytest.fixture(scope="module")
def tiny() -> str:
    return str(testmodels.ensure_model(testmodels.TINY))


@pytest.mark.llama
def test_sub_agents_share_their_common_prefix_once_on_a_unified_kv(tiny: str) -> None:
    """Three sub-agents with the same system prompt, tools and repo map and private tails: each
    keeps its own sequence, the shared head is stored once (copied cells are only tagged)."""
    shared = WORKSPACES[0] * 3
    with Engine(
        backends=("llama",), residency=Residency(sequences=4, kv_unified=True, pool_tokens=4096)
    ) as engine:
        agents = [engine.open_session(_request(tiny)) for _ in range(3)]
        first = [
            a.ensure_prefix(PrefixInput(text=shared + f"agent {i}: private notes\n" * 8))
            for i, a in enumerate(agents)
        ]
        head = first[1].reused_tokens
        assert head > 0 and first[2].reused_tokens == head  # copied from agent 0's context
        model = engine.status().models[0]
        kv = [c for c in model.contexts if c.tier == "kv"]
        assert len(kv) == 3
        assert sum(c.shared_bytes for c in kv) > 0
        total_tokens = sum(s.prefix_tokens for s in first)
        assert model.resident_tokens == total_tokens - 2 * head  # the head counted once
        for a, st in zip(agents, first, strict=True):  # every agent stays warm on its own sequence
            again = a.ensure_prefix(
                PrefixInput(text=shared + f"agent {agents.index(a)}: private notes\n" * 8)
            )
            assert (again.reuse.outcome, again.reused_tokens) == ("warm", st.prefix_tokens)


def _in_kv(engine: Engine) -> set[str]:
    """The sessions whose context is in the KV pool."""
    return {c.session_id for c in engine.status().models[0].contexts if c.tier == "kv" and c.session_id}


def _on_disk(engine: Engine) -> list[int]:
    """The prompt tokens of each disk-tier entry, once every write has landed."""
    assert engine.tiers.flush(30)
    return sorted(c.tokens for c in engine.status().models[0].contexts if c.tier == "disk")


def _checked_turn(reference: Reference, session: Any, prefix: str, suffix: str) -> Any:
    """One turn (prefix, suffix, 4 greedy tokens checked against a fresh evaluation): its status."""
    status = session.ensure_prefix(PrefixInput(text=prefix))
    session.prefill_suffix(SuffixInput(text=suffix))
    assert _greedy(session, 4) == reference.greedy(prefix, suffix, 4)
    return status


def _named_in_kv(engine: Engine, **sessions: Any) -> set[str]:
    """The names (keyword) of the sessions whose context is in the KV pool."""
    names = {session.session_id: name for name, session in sessions.items()}
    return {names[i] for i in _in_kv(engine)}


def _measured(engine: Engine, per_cell_us: float, samples: int = 60) -> None:
    """The model's costs as its own turns would have measured them: prefill jobs of 64 tokens
    and decodes of 4 over spans of 0-3.5k cells, each token costing ``per_cell_us`` microseconds
    more per resident cell (``modeld/cache/cost.py``; the engine's later turns add their own)."""
    costs = engine.models()[0].cache.costs
    for i in range(samples):
        span = (i % 8) * 500
        for add, n in ((costs.prefilled, 64), (costs.decoded, 4)):
            add(n, span, 1.0 + 0.05 * n + per_cell_us / 1000.0 * n * (span + n / 2))
    assert costs.known()


@pytest.mark.llama
def test_idle_contexts_leave_a_unified_pool_only_when_their_cells_cost_more_than_moving_them(
    tmp_path: Path, tiny: str
) -> None:
    """A unified pool's attention spans every used cell, so an idle context slows every token of
    the turn that runs; moved out, it costs a snapshot and a restore. Until the engine's
    attention was measured, what fits stays. Measured expensive, a turn that starts moves the
    idle contexts out (all of their tokens: the next turn of each computes nothing it computed
    before) and they come back exact; measured cheap, they stay. A context inside its own turn
    (a prefix in place, its decode to come) never leaves."""
    residency = Residency(sequences=4, kv_unified=True, pool_tokens=4096, persist_min_tokens=64)
    reference = Reference(tiny)
    long_a, long_b = WORKSPACES[0] * 2, WORKSPACES[1] * 2
    try:
        with Engine(backends=("llama",), residency=residency, data_dir=tmp_path / "data") as engine:
            a, b, c = (engine.open_session(_request(tiny)) for _ in range(3))

            def kv() -> set[str]:
                return _named_in_kv(engine, a=a, b=b, c=c)

            def turn(session: Any, prefix: str, suffix: str) -> Any:
                return _checked_turn(reference, session, prefix, suffix)

            turn(a, long_a, SUFFIXES[0])
            other = turn(b, long_b, SUFFIXES[1])
            assert kv() == {"a", "b"}  # nothing measured: what fits stays
            _measured(engine, per_cell_us=50.0)
            again = turn(a, long_a, SUFFIXES[2])
            assert again.reuse.reason == "full_match"
            assert kv() == {"a"}  # b's 265 cells would cost a's turn ~ 13 ms a token
            [b_copy] = [x for x in engine.status().models[0].contexts if x.tier == "ram"]
            suffix_b = len(reference.runtime.tokenize(SUFFIXES[1], add_bos=False))
            assert b_copy.tokens == other.prefix_tokens + suffix_b + 3  # the 4th sampled is not evaluated

            # b comes back whole: its prefix, its suffix and what it decoded; nothing computed.
            back = b.ensure_prefix(PrefixInput(text=long_b))
            assert (back.reuse.reason, back.prefilled_tokens) == ("restored_from_ram", 0)
            suffix = b.prefill_suffix(SuffixInput(text=SUFFIXES[1]))
            assert suffix.reused_tokens == suffix.suffix_tokens and suffix.restored_tokens == 0
            assert _greedy(b, 4) == reference.greedy(long_b, SUFFIXES[1], 4)
            assert kv() == {"b"}

            # Inside its turn: a's prefix is in place, its decode comes after c's turn.
            a.ensure_prefix(PrefixInput(text=long_a))
            turn(c, "You are brief.\n" * 20, SUFFIXES[3])
            assert "a" in kv() and "b" not in kv()
            a.prefill_suffix(SuffixInput(text=SUFFIXES[0]))
            assert _greedy(a, 4) == reference.greedy(long_a, SUFFIXES[0], 4)

            _measured(engine, per_cell_us=0.0, samples=200)  # cheap now: what fits stays
            turn(b, long_b, SUFFIXES[1])
            assert kv() == {"a", "b", "c"}
            assert engine.status().models[0].counters["recomputed"] == 0
    finally:
        reference.close()


@pytest.mark.llama
def test_a_new_session_sending_the_same_prompt_copies_its_suffix_from_the_context_that_holds_it(
    tmp_path: Path, tiny: str
) -> None:
    """The real Claude Code's second run: a new session whose prompt another session's idle
    context holds whole. Its prefix is copied from that context; the context holds more (the
    suffix to come), so it stays in the pool for the suffix, which is copied from it too:
    nothing is computed and nothing restored. (It used to leave the pool at the prefix stage,
    weighed against a suffix measured over earlier turns, and come straight back from RAM.)"""
    residency = Residency(sequences=4, kv_unified=True, pool_tokens=4096, persist_min_tokens=64)
    reference = Reference(tiny)
    prefix, suffix = WORKSPACES[0], "".join(WORKSPACES[1:]) + SUFFIXES[0]
    try:
        with Engine(backends=("llama",), residency=residency, data_dir=tmp_path / "data") as engine:
            a, d = (engine.open_session(_request(tiny)) for _ in range(2))
            _checked_turn(reference, a, prefix, suffix)
            _measured(engine, per_cell_us=50.0)
            first = d.ensure_prefix(PrefixInput(text=prefix))
            assert first.prefilled_tokens == 0
            assert _named_in_kv(engine, a=a, d=d) == {"a", "d"}
            after = d.prefill_suffix(SuffixInput(text=suffix))
            assert after.suffix_tokens > 100  # a's own cells past the prefix: a few hundred
            assert (after.reused_tokens, after.restored_tokens, after.restore_ms) == (
                after.suffix_tokens,
                0,
                0,
            )
            assert _greedy(d, 4) == reference.greedy(prefix, suffix, 4)
            assert engine.status().models[0].counters["recomputed"] == 0
    finally:
        reference.close()


@pytest.mark.llama
def test_a_context_the_pool_needs_leaves_with_every_token_its_lagging_disk_copy_brought_up_to_date(
    tmp_path: Path, tiny: str
) -> None:
    """A chat's prefix takes each turn's new messages, so after a short turn its disk copy
    (written when a turn computed --persist-min-tokens or more: crash safety) lacks its last
    messages, its suffix and its decode. When the pool needs its cells, the context leaves with
    all of its tokens (the RAM tier takes the copy up to date; the crash-safe file stays), and its
    next turn computes nothing it computed before. The threshold decides only the write-through."""
    persist = 64
    residency = Residency(sequences=4, kv_unified=True, pool_tokens=1024, persist_min_tokens=persist)
    reference = Reference(tiny)
    head_a, head_b = WORKSPACES[0] * 2, WORKSPACES[1] * 2
    try:
        with Engine(backends=("llama",), residency=residency, data_dir=tmp_path / "data") as engine:
            a, b = (engine.open_session(_request(tiny)) for _ in range(2))

            def turn(session: Any, prefix: str, suffix: str) -> Any:
                return _checked_turn(reference, session, prefix, suffix)

            first = turn(a, head_a + "user: fix the failing test\n", SUFFIXES[0])  # written behind
            chat = head_a + "user: fix the failing test\nassistant: done\nuser: add a docstring\n"
            short = turn(a, chat, SUFFIXES[2])
            assert 0 < short.prefilled_tokens < persist
            assert _on_disk(engine) == [first.prefix_tokens]  # the copy lags
            turn(b, head_b * 3, SUFFIXES[1])  # 795 tokens: the pool of 1024 needs a's cells
            assert _named_in_kv(engine, a=a, b=b) == {"b"}
            assert first.prefix_tokens in _on_disk(engine)  # the crash-safe file stays meanwhile
            back = a.ensure_prefix(PrefixInput(text=chat))
            assert (back.reuse.reason, back.prefilled_tokens) == ("restored_from_ram", 0)
            suffix = a.prefill_suffix(SuffixInput(text=SUFFIXES[2]))
            assert suffix.reused_tokens == suffix.suffix_tokens
            assert _greedy(a, 4) == reference.greedy(chat, SUFFIXES[2], 4)
            counters = engine.status().models[0].counters
            assert counters["evicted_to_ram"] >= 1 and counters["recomputed"] == 0
    finally:
        reference.close()


def test_idle_contexts_stay_where_attention_does_not_span_the_pool(tmp_path: Path) -> None:
    """The memory backend's unified pool (and llama's split streams) costs an idle context
    nothing: it stays in the KV."""
    residency = Residency(sequences=4, kv_unified=True, pool_tokens=4096, persist_min_tokens=64)
    with Engine(backends=("memory",), data_dir=tmp_path / "data", residency=residency) as engine:
        a, b = (
            engine.open_session(OpenSessionRequest(path="m")),
            engine.open_session(OpenSessionRequest(path="m")),
        )
        assert a.ensure_prefix(PrefixInput(text=WORKSPACES[0] * 3)).prefilled_tokens >= 64
        list(a.decode(DecodeConfig(max_tokens=2)))
        b.ensure_prefix(PrefixInput(text=WORKSPACES[1] * 3))
        assert _in_kv(engine) == {a.session_id, b.session_id}


@pytest.mark.llama
def test_concurrent_sessions_never_prefill_each_others_work(tiny: str) -> None:
    """N sessions with different prefixes, driven from N threads over the wire: after its first
    turn every turn of every session reuses its whole prefix and restores nothing."""
    from harness import llama_model, wire_harness

    n, turns = 3, 4
    with wire_harness(llama_model()) as h:
        errors: list[BaseException] = []
        counts: list[list[tuple[int, int, int]]] = [[] for _ in range(n)]

        def agent(i: int) -> None:
            try:
                session = h.service.open_session(h.request(num_ctx=2048))
                for turn in range(turns):
                    st = session.ensure_prefix(PrefixInput(text=WORKSPACES[i]))
                    sf = session.prefill_suffix(SuffixInput(text=f"turn {turn}\n"))
                    list(session.decode(DecodeConfig(max_tokens=4)))
                    counts[i].append((st.reused_tokens, st.prefilled_tokens, sf.restored_tokens))
                session.close()
            except BaseException as exc:
                errors.append(exc)

        threads = [threading.Thread(target=agent, args=(i,)) for i in range(n)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(timeout=120)
        assert not errors, errors
        for rows in counts:
            prefix_tokens = rows[0][0] + rows[0][1]
            assert all(row == (prefix_tokens, 0, 0) for row in rows[1:]), rows


@pytest.mark.llama
def test_a_session_with_another_thread_count_shares_the_warm_context(tiny: str) -> None:
    """num_threads changes speed, not the KV: it never rebuilds the context behind a warm report."""
    with Engine(backends=("llama",)) as engine:
        a = engine.open_session(_request(tiny, num_threads=2))
        cold = a.ensure_prefix(PrefixInput(text=WORKSPACES[0]))
        a.close()
        b = engine.open_session(_request(tiny, num_threads=1))
        warm = b.ensure_prefix(PrefixInput(text=WORKSPACES[0]))
        assert (warm.reuse.outcome, warm.reused_tokens) == ("warm", cold.prefix_tokens)
        assert len(engine.models()) == 1


# --- eviction, tiers, pins, keep-alive -------------------------------------------------------------


def _memory(**residency: Any) -> Engine:
    return Engine(backends=("memory",), residency=Residency(**{"snapshot_min_tokens": 8, **residency}))


def test_an_evicted_context_comes_back_from_the_ram_tier() -> None:
    with _memory(sequences=1) as engine:
        a = engine.open_session(OpenSessionRequest(path="m"))
        b = engine.open_session(OpenSessionRequest(path="m"))
        first = a.ensure_prefix(PrefixInput(text=WORKSPACES[0]))
        b.ensure_prefix(PrefixInput(text=WORKSPACES[2]))  # one sequence: a's context is evicted
        back = a.ensure_prefix(PrefixInput(text=WORKSPACES[0]))
        assert (back.reuse.outcome, back.reuse.reason, back.reuse.tier) == (
            "warm",
            "restored_from_ram",
            "ram",
        )
        assert back.reused_tokens == first.prefix_tokens
        assert back.restore_ms >= 0
        counters = engine.status().models[0].counters
        assert counters["evicted_to_ram"] >= 1 and counters["reused_ram"] >= first.prefix_tokens


def _tier_bytes(engine: Engine) -> tuple[int, int, int]:
    """RAM-tier entries and bytes, disk-tier entries, once every write has landed."""
    assert engine.tiers.flush(30)
    tiers = engine.status().tiers
    assert tiers is not None
    return tiers.ram_entries, tiers.ram_bytes, tiers.disk_entries


def test_a_byte_is_held_once_a_live_context_on_disk_an_evicted_one_in_ram(tmp_path: Path) -> None:
    """A context in the KV pool is never also in the RAM tier: a long prefix is written behind to
    disk only; a context evicted from the KV goes to RAM (unless its prefix is on disk already),
    and when a restore brings it back whole it leaves RAM (written to disk first)."""
    residency = Residency(sequences=1, snapshot_min_tokens=8, persist_min_tokens=64)
    with Engine(backends=("memory",), data_dir=tmp_path / "data", residency=residency) as engine:
        a = engine.open_session(OpenSessionRequest(path="m"))
        b = engine.open_session(OpenSessionRequest(path="m"))
        long_a, long_b = WORKSPACES[0] * 3, WORKSPACES[2] * 3
        first = a.ensure_prefix(PrefixInput(text=long_a))
        assert first.prefilled_tokens >= 64
        assert _tier_bytes(engine) == (0, 0, 1)  # on disk, not in RAM, while it is in the KV
        extended = a.ensure_prefix(PrefixInput(text=long_a + EDITS[0]))  # a few tokens: not written
        assert 0 < extended.prefilled_tokens < 64
        assert _tier_bytes(engine)[:2] == (0, 0)
        b.ensure_prefix(PrefixInput(text=long_b))  # one sequence: a's context leaves the KV
        ram_entries, ram_bytes, _ = _tier_bytes(engine)
        assert ram_entries == 1 and ram_bytes > 0
        ram = [c for c in engine.status().models[0].contexts if c.tier == "ram"]
        assert [c.tokens for c in ram] == [extended.prefix_tokens]
        back = a.ensure_prefix(PrefixInput(text=long_a + EDITS[0]))  # b's goes: it is on disk
        assert (back.reuse.reason, back.reused_tokens) == ("restored_from_ram", extended.prefix_tokens)
        # a moved back: its RAM copy is on disk now, in place of its shorter first prefix
        assert _tier_bytes(engine) == (0, 0, 2)
        counters = engine.status().models[0].counters
        assert counters["evicted_to_ram"] == 1 and counters["evicted_to_disk"] == 1


def test_a_turn_in_a_full_pool_reuses_the_cells_of_its_own_last_suffix() -> None:
    """One session filling most of a one-window pool: the next turn's suffix needs the cells its
    last suffix and decode held, which its own cut frees; nothing else has to go, and the turn is
    never refused as busy (the 8k coding loop's third turn was, on a pool of one window)."""
    residency = Residency(sequences=2, kv_unified=True, pool_tokens=512, snapshot_min_tokens=8)
    with Engine(backends=("memory",), residency=residency) as engine:
        s = engine.open_session(OpenSessionRequest(path="m"))
        prefix = "p" * 300 + "\n"
        for turn in range(3):
            status = s.ensure_prefix(PrefixInput(text=prefix))
            assert status.reused_tokens == (0 if turn == 0 else status.prefix_tokens)
            s.prefill_suffix(SuffixInput(text=f"{turn}" + "s" * 150 + "\n"))
            assert len(_greedy(s, 8)) == 8
        assert engine.status().models[0].counters["evicted_to_ram"] == 0


def test_with_the_tiers_off_an_eviction_is_a_cold_turn_that_says_so() -> None:
    with _memory(sequences=1, ram_tier_bytes=0, disk_tier_bytes=0) as engine:
        a = engine.open_session(OpenSessionRequest(path="m"))
        b = engine.open_session(OpenSessionRequest(path="m"))
        a.ensure_prefix(PrefixInput(text=WORKSPACES[0]))
        b.ensure_prefix(PrefixInput(text=WORKSPACES[2]))
        back = a.ensure_prefix(PrefixInput(text=WORKSPACES[0]))
        assert (back.reuse.outcome, back.reuse.reason, back.reuse.tier) == ("cold", "evicted", "none")
        assert "evicted" in back.reuse.message and "not saved" in back.reuse.message


def test_a_pinned_context_is_never_evicted() -> None:
    with _memory(sequences=2, ram_tier_bytes=0) as engine:
        pinned = engine.open_session(OpenSessionRequest(path="m", pin=True))
        pinned.ensure_prefix(PrefixInput(text=WORKSPACES[0]))
        others = [engine.open_session(OpenSessionRequest(path="m")) for _ in range(2)]
        for turn in range(3):  # two sessions fight over the one free sequence
            for i, other in enumerate(others):
                other.ensure_prefix(PrefixInput(text=WORKSPACES[1 + i] + f"turn {turn}\n"))
        again = pinned.ensure_prefix(PrefixInput(text=WORKSPACES[0]))
        assert (again.reuse.outcome, again.reuse.reason) == ("warm", "full_match")
        assert pinned.explain_context().pinned


def test_an_idle_context_past_its_keep_alive_moves_to_the_ram_tier() -> None:
    with _memory(sequences=4) as engine:
        s = engine.open_session(OpenSessionRequest(path="m", keep_alive_seconds=0.5))
        s.ensure_prefix(PrefixInput(text=WORKSPACES[0]))
        assert s.explain_context().context_id
        assert _wait(lambda: not any(c.tier == "kv" for c in engine.status().models[0].contexts), 10)
        back = s.ensure_prefix(PrefixInput(text=WORKSPACES[0]))
        assert back.reuse.reason == "restored_from_ram"


def _wait(predicate: Any, timeout: float) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():
            return True
        time.sleep(0.05)
    return False


# --- restarts of the daemon --------------------------------------------------------------------


def _serve(data: Path, sock: Path) -> Any:
    proc = start_serve(data, sock, backend="llama")
    wait_serving(data, proc.pid)
    return proc


def _warm_three(sock: Path, model: str) -> list[int]:
    client = rc.connect(f"unix:{sock}")
    sizes = []
    for text in WORKSPACES:
        session = client.open_session(_request(model))
        st = session.ensure_prefix(PrefixInput(text=text * 5))  # over 512 tokens: written at once
        sizes.append(st.prefix_tokens)
        session.close()
    client.close()
    return sizes


def _first_turns(sock: Path, model: str) -> list[Any]:
    client = rc.connect(f"unix:{sock}")
    out = []
    for text in WORKSPACES:
        session = client.open_session(_request(model))
        out.append(session.ensure_prefix(PrefixInput(text=text * 5)))
        session.close()
    client.close()
    return out


@pytest.mark.llama
@pytest.mark.parametrize("how", [signal.SIGTERM, signal.SIGKILL])
def test_warm_contexts_come_back_from_disk_after_a_restart(
    tmp_path: Path, tiny: str, how: signal.Signals
) -> None:
    data, sock = tmp_path / "data", tmp_path / "d.sock"
    proc = _serve(data, sock)
    try:
        sizes = _warm_three(sock, tiny)
        if how == signal.SIGKILL:  # only what was fully written may be used
            assert _wait(lambda: len(list((data / "kv").glob(f"*{SUFFIX}"))) >= 3, 30)
        stop(proc, how)
        proc = _serve(data, sock)
        turns = _first_turns(sock, tiny)
        for st, size in zip(turns, sizes, strict=True):
            assert (st.reuse.outcome, st.reuse.reason, st.reuse.tier) == (
                "warm",
                "restored_from_disk",
                "disk",
            )
            assert st.reused_tokens == size
    finally:
        stop(proc, signal.SIGKILL)
    assert not list((data / "kv").glob(".*.tmp"))


# --- bad snapshot files ------------------------------------------------------------------------


@pytest.fixture
def persisted(tmp_path: Path, tiny: str) -> tuple[Path, str, int]:
    """A data directory holding the disk snapshot of one tiny-model prefix."""
    data = tmp_path / "data"
    with Engine(backends=("llama",), data_dir=data, residency=Residency(persist_min_tokens=8)) as engine:
        s = engine.open_session(_request(tiny))
        size = s.ensure_prefix(PrefixInput(text=WORKSPACES[1])).prefix_tokens
    return data, tiny, size


@pytest.fixture
def split_persisted(tmp_path: Path, tiny: str) -> tuple[Path, str, int]:
    """The same, written from a split context of 4 sequences (``--no-kv-unified``)."""
    data = tmp_path / "data"
    residency = Residency(persist_min_tokens=8, kv_unified=False)
    with Engine(backends=("llama",), data_dir=data, residency=residency) as engine:
        s = engine.open_session(_request(tiny))
        size = s.ensure_prefix(PrefixInput(text=WORKSPACES[1])).prefix_tokens
    return data, tiny, size


def _first_turn(data: Path, tiny: str, text: str = WORKSPACES[1]) -> tuple[Any, Engine]:
    engine = Engine(backends=("llama",), data_dir=data)
    session = engine.open_session(_request(tiny))
    return session.ensure_prefix(PrefixInput(text=text)), engine


def _only_file(data: Path) -> Path:
    files = list((data / "kv").glob(f"*{SUFFIX}"))
    assert len(files) == 1, files
    return files[0]


@pytest.mark.llama
def test_a_good_snapshot_is_restored(persisted: tuple[Path, str, int]) -> None:
    data, tiny, size = persisted
    st, engine = _first_turn(data, tiny)
    engine.shutdown()
    assert (st.reuse.reason, st.reused_tokens) == ("restored_from_disk", size)


@pytest.mark.llama
@pytest.mark.parametrize(
    ("damage", "words"),
    [
        ("flip_payload", "checksum"),
        ("truncate", "truncated"),
        ("version", "format version"),
        ("rename", "does not match its contents"),
    ],
)
def test_a_damaged_snapshot_is_removed_never_loaded(
    persisted: tuple[Path, str, int], damage: str, words: str
) -> None:
    data, tiny, size = persisted
    path = _only_file(data)
    raw = bytearray(path.read_bytes())
    if damage == "flip_payload":  # the payload comes first, the header and tail at the end
        raw[100] ^= 0xFF
        path.write_bytes(raw)
    elif damage == "truncate":
        path.write_bytes(raw[: len(raw) - 100])
    elif damage == "version":  # the tail: u32 header length, u16 version, 8-byte magic
        raw[-10:-8] = (FORMAT_VERSION + 1).to_bytes(2, "little")
        path.write_bytes(raw)
    else:  # a file whose name claims other contents (foreign, or renamed by hand)
        path.rename(path.with_name("0" * 16 + path.name[16:]))
    st, engine = _first_turn(data, tiny)
    try:
        assert st.reuse.outcome == "cold"
        assert st.prefilled_tokens == size
        if damage == "flip_payload":  # found when it is used: the turn says why it was cold
            assert st.reuse.reason == "snapshot_rejected" and words in st.reuse.message
        tiers = engine.status().tiers
        assert tiers is not None and tiers.rejected == 1
        assert any(words in r for r in tiers.recent_rejections), tiers.recent_rejections
    finally:
        engine.shutdown()
    # The damaged file is gone (the cold turn wrote a good one of its own, when it could).
    for p in (data / "kv").iterdir():
        assert p.read_bytes() != bytes(raw)


@pytest.mark.llama
def test_a_snapshot_the_engine_refuses_falls_back_to_a_full_prefill(persisted: tuple[Path, str, int]) -> None:
    """A file whose checksums hold but whose payload llama.cpp cannot load (as a snapshot written by
    a broken engine): llama.cpp empties the sequence, the snapshot is removed, the turn prefills."""
    data, tiny, size = persisted
    path = _only_file(data)
    header, tokens = read_header(path)
    path.unlink()
    key = entry_key(header.model_digest, header.identity, header.snapshot_format, tokens)
    write_atomic(
        data / "kv" / f"{key}{SUFFIX}",
        model_digest=header.model_digest,
        identity=header.identity,
        snapshot_format=header.snapshot_format,
        tokens=tokens,
        prefix_tokens=header.prefix_tokens,
        payload=b"\x00" * header.payload_bytes,
    )
    st, engine = _first_turn(data, tiny)
    try:
        assert (st.reuse.outcome, st.reuse.reason) == ("cold", "snapshot_rejected")
        assert "refused" in st.reuse.message
        assert st.prefilled_tokens == size
        again = engine.open_session(_request(tiny)).ensure_prefix(PrefixInput(text=WORKSPACES[1]))
        assert again.reuse.outcome == "warm"  # the engine is fine afterwards
    finally:
        engine.shutdown()


@pytest.mark.llama
@pytest.mark.parametrize(("sequences", "how"), [(3, "edited in a private mapping"), (4, "read by llama.cpp")])
def test_a_snapshot_comes_back_into_a_context_with_another_number_of_sequences(
    split_persisted: tuple[Path, str, int], sequences: int, how: str
) -> None:
    """Written from a split context of 4 sequences (the fixture, its cells listed first), restored
    into one of 3 (another stream count: the mapped file's count is edited in place; the file
    stays as it was) or of 4 (the same count: llama.cpp reads the file itself); the output equals
    a fresh evaluation."""
    data, tiny, size = split_persisted
    path = _only_file(data)
    before = path.read_bytes()
    listed = int.from_bytes(before[12:16], "little")  # after llama.cpp's 12-byte file head
    assert listed == 4
    residency = Residency(sequences=sequences, kv_unified=False)
    engine = Engine(backends=("llama",), data_dir=data, residency=residency)
    reference = Reference(tiny)
    try:
        session = engine.open_session(_request(tiny))
        st = session.ensure_prefix(PrefixInput(text=WORKSPACES[1]))
        assert (st.reuse.reason, st.reused_tokens) == ("restored_from_disk", size), how
        session.prefill_suffix(SuffixInput(text=SUFFIXES[0]))
        assert _greedy(session, 8) == reference.greedy(WORKSPACES[1], SUFFIXES[0], 8)
        # (At the stop the context is written whole, and that file supersedes this one.)
        assert path.read_bytes() == before
    finally:
        engine.shutdown()
        reference.close()


def test_a_mapped_payload_is_verified_and_private(tmp_path: Path) -> None:
    path = tmp_path / f"x{SUFFIX}"
    payload = bytes(range(256)) * 64
    write_atomic(
        path,
        model_digest="m",
        identity="i",
        snapshot_format="f",
        tokens=[1, 2],
        prefix_tokens=2,
        payload=payload,
    )
    header, _ = read_header(path)
    with open_verified(path, header) as view:
        assert bytes(view) == payload and not view.readonly
        view[:4] = b"edit"  # a restore's in-place edit: never reaches the file
    with open_verified(path, header) as view:
        assert bytes(view) == payload
    verify_payload(path, header)  # the same check, reading instead of mapping
    raw = bytearray(path.read_bytes())
    raw[0] ^= 1  # the payload comes first
    path.write_bytes(raw)
    with pytest.raises(SnapshotError, match="checksum"), open_verified(path, header):
        pass
    with pytest.raises(SnapshotError, match="checksum"):
        verify_payload(path, header)
    with (
        pytest.raises(SnapshotError, match="changed since it was indexed"),
        open_verified(path, replace(header, created=header.created + 1)),
    ):
        pass


def test_a_restore_from_a_file_names_its_header_and_carries_no_bytes() -> None:
    header = SnapshotHeader("m", "i", "f", 1, "t", 1, 4, "p", 0.0)
    with pytest.raises(ProtocolError):
        Restore(0, (1,), path="x.kvs")
    with pytest.raises(ProtocolError):
        Restore(0, (1,), path="x.kvs", header=header, payload=b"abcd")
    message = Restore(0, (1,), path="x.kvs", header=header)
    _, head, payload = encode_frame(3, message)
    assert decode_frame(bytes(head), bytes(payload)) == (3, message)


def _nice_by_thread() -> dict[int, int]:
    """This process's threads and their nice values, as the kernel schedules them."""
    out = {}
    for task in Path("/proc/self/task").iterdir():
        with contextlib.suppress(OSError):
            fields = (task / "stat").read_text().rsplit(")", 1)[1].split()
            out[int(task.name)] = int(fields[16])  # stat field 19: nice
    return out


def test_the_disk_writer_yields_the_cpu_to_serving(tmp_path: Path) -> None:
    before = _nice_by_thread()
    tiers = Tiers(data_dir=tmp_path, ram_bytes=1 << 20, disk_bytes=1 << 30)
    try:
        assert _wait(
            lambda: any(n == WRITER_NICE for t, n in _nice_by_thread().items() if t not in before), 10
        )
        assert os.getpriority(os.PRIO_PROCESS, 0) == before[threading.get_native_id()]  # only the writer
    finally:
        tiers.close()


@pytest.mark.llama
def test_an_unusable_disk_turns_the_disk_tier_off_and_serving_goes_on(tmp_path: Path, tiny: str) -> None:
    data = tmp_path / "data"
    data.mkdir()
    (data / "kv").write_text("not a directory\n")  # as a broken mount or a stray file would
    with Engine(backends=("llama",), data_dir=data, residency=Residency(persist_min_tokens=8)) as engine:
        tiers = engine.status().tiers
        assert tiers is not None and tiers.disk_off_reason
        s = engine.open_session(_request(tiny))
        assert s.ensure_prefix(PrefixInput(text=WORKSPACES[0])).reuse.outcome == "cold"
        assert s.ensure_prefix(PrefixInput(text=WORKSPACES[0])).reuse.outcome == "warm"


@pytest.mark.llama
def test_a_disk_that_fails_while_writing_turns_the_tier_off(tmp_path: Path, tiny: str) -> None:
    data = tmp_path / "data"
    with Engine(backends=("llama",), data_dir=data, residency=Residency(persist_min_tokens=8)) as engine:
        kv = data / "kv"
        shutil.rmtree(kv)
        kv.write_text("the disk went away\n")
        s = engine.open_session(_request(tiny))
        s.ensure_prefix(PrefixInput(text=WORKSPACES[2]))
        assert _wait(lambda: bool(engine.status().tiers.disk_off_reason), 10)  # type: ignore[union-attr]
        assert s.ensure_prefix(PrefixInput(text=WORKSPACES[2])).reuse.outcome == "warm"


@pytest.mark.llama
def test_a_full_disk_turns_the_disk_tier_off_and_the_daemon_serves_on(tmp_path: Path, tiny: str) -> None:
    """A real write failure (the file size limit of the daemon's process: EFBIG, as a full disk
    gives ENOSPC): the tier turns itself off with one log line, and turns stay warm."""
    import resource
    import subprocess

    from daemon_proc import MODELD

    data, sock = tmp_path / "data", tmp_path / "d.sock"

    def limit() -> None:
        resource.setrlimit(resource.RLIMIT_FSIZE, (64 << 10, 64 << 10))

    proc = subprocess.Popen(
        [MODELD, "--data-dir", str(data), "serve", "--backend", "llama", "--listen", f"unix:{sock}"],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=True,
        preexec_fn=limit,
    )
    try:
        wait_serving(data, proc.pid)
        client = rc.connect(f"unix:{sock}")
        session = client.open_session(_request(tiny))
        first = session.ensure_prefix(PrefixInput(text=WORKSPACES[0] * 5))
        assert _wait(lambda: bool(client.status().tiers.disk_off_reason), 20)  # type: ignore[union-attr]
        again = session.ensure_prefix(PrefixInput(text=WORKSPACES[0] * 5))
        assert (again.reuse.outcome, again.reused_tokens) == ("warm", first.prefix_tokens)
        client.close()
    finally:
        _, err = stop(proc, signal.SIGTERM)
    assert err.count("the disk tier is off") == 1
    assert "File too large" in err


# --- model residency ------------------------------------------------------------------------------


@pytest.mark.llama
def test_an_idle_model_is_unloaded_beyond_the_budget_and_its_contexts_come_back(
    tmp_path: Path, tiny: str
) -> None:
    other = tmp_path / "other.gguf"
    shutil.copyfile(testmodels.ensure_model(replace(testmodels.TINY, seed=77)), other)
    data = tmp_path / "data"
    with Engine(backends=("llama",), data_dir=data) as probe:
        cost = probe.describe(_request(tiny)).footprint.total_bytes  # weights, KV, compute, the worker
    residency = Residency(memory_budget_bytes=cost * 3 // 2, persist_min_tokens=8)  # one model fits, not two
    with Engine(backends=("llama",), data_dir=data, residency=residency) as engine:
        a = engine.open_session(_request(tiny))
        size = a.ensure_prefix(PrefixInput(text=WORKSPACES[0])).prefix_tokens
        a.close()
        b = engine.open_session(_request(str(other)))  # needs the room: the idle model goes
        b.ensure_prefix(PrefixInput(text=WORKSPACES[0]))
        assert [m.path for m in engine.status().models] == [str(other)]
        b.close()
        c = engine.open_session(_request(tiny))
        back = c.ensure_prefix(PrefixInput(text=WORKSPACES[0]))
        assert (back.reuse.reason, back.reused_tokens) in {
            ("restored_from_disk", size),
            ("restored_from_ram", size),
        }


def test_a_turn_that_diverges_early_in_a_full_unified_pool_cuts_its_own_context_first(tmp_path: Path) -> None:
    """One conversation whose context fills most of a unified pool, then a turn that diverges
    near its start (a tool list changed): the cells past the divergence are freed by the cut
    itself, so the turn needs no other room. It used to count them as still in use, find no
    other context to evict and fail with the pool 'full of busy or pinned contexts'."""
    residency = Residency(pool_tokens=1024, ram_tier_bytes=0, disk_tier_bytes=0)
    with Engine(backends=("memory",), residency=residency, data_dir=tmp_path) as engine:
        session = engine.open_session(OpenSessionRequest(path="repo", model_name="coder"))
        first = "x" * 100 + "".join(f"line {i} of the repository map\n" for i in range(28))
        assert 800 < len(first) < 1024  # the memory backend: one token per byte
        session.ensure_prefix(PrefixInput(text=first))
        session.prefill_suffix(SuffixInput(text="question one\n"))
        list(session.decode(DecodeConfig(max_tokens=8, temperature=0.0)))
        changed = "y" + first[1:]  # diverges at its second token
        status = session.ensure_prefix(PrefixInput(text=changed))
        # BOS, then "y": reusing only the format's head counts as cold (blueprint 0016).
        assert (status.reuse.outcome, status.reuse.diverged_at_token) == ("cold", 1)
        assert status.prefilled_tokens == status.prefix_tokens - 1 >= len(changed)
