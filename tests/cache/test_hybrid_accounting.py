"""Memory that cannot be cut at any token, counted where it lives (blueprint 0016, "Checkpoints
travel with their context"): a recurrent or hybrid snapshot holds its state and the checkpoints
that travel with it beside its KV cells, and the RAM tier makes room for all of it before the
blob comes; the memory table counts every sequence's state, which llama.cpp allocates at load.

Before, both counted the KV cells only: the room made for a generated mamba2 context's snapshot
was 0 bytes (a pure recurrent model has no KV per token) for a blob of ~360 KB, for qwen35 about
a quarter of its blob; a 27B hybrid's checkpoint holds 157 MiB.
"""

from __future__ import annotations

import struct
from typing import Any

import pytest
from prometheus_client.parser import text_string_to_metric_families

from modeld.backends.llama_checkpoints import Checkpoints
from modeld.cache import eviction
from modeld.cache.tiers import Tiers
from modeld.contract import Config, DecodeConfig, OpenSessionRequest, PrefixInput, SuffixInput
from modeld.engine import Engine
from modeld.observe.metrics import Metrics
from modeld.observe.views import format_bytes, format_status
from modeld.settings import Residency

pytestmark = pytest.mark.llama

testmodels = pytest.importorskip("modeld.testmodels")
pytest.importorskip("modeld.backends.llama")

SPECS = {spec.name: spec for spec in testmodels.ARCH_SPECS}

BASE = "".join(
    f"def handler_{i}(request):\n    value = compute({i}, request.body)\n    return respond(value)\n\n"
    for i in range(24)
)


def _request(path: str) -> OpenSessionRequest:
    return OpenSessionRequest(
        type="llama", path=path, config=Config(num_ctx=2048, num_batch=16, num_threads=2)
    )


@pytest.mark.parametrize("name", ["hybrid-qwen35", "hybrid-lfm2", "recurrent-mamba2"])
def test_the_ram_tier_makes_room_for_a_snapshots_state_and_checkpoints(
    name: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """One sequence: a second session makes the first context leave the KV, whole, into the RAM
    tier. The room made before the blob came bounds the blob (cells, state, checkpoints)."""
    rooms: list[int] = []
    make_room = Tiers.make_ram_room

    def spy(self: Tiers, nbytes: int, *args: Any, **kwargs: Any) -> bool:
        rooms.append(nbytes)
        return make_room(self, nbytes, *args, **kwargs)

    monkeypatch.setattr(Tiers, "make_ram_room", spy)
    path = str(testmodels.ensure_model(SPECS[name]))
    with Engine(backends=("llama",), residency=Residency(sequences=1)) as engine:
        a = engine.open_session(_request(path))
        a.ensure_prefix(PrefixInput(text=BASE))
        a.prefill_suffix(SuffixInput(text="fix it\n"))
        b = engine.open_session(_request(path))
        b.ensure_prefix(PrefixInput(text="class Other:\n    pass\n" * 40))
        assert engine.tiers is not None
        # The context left whole (its suffix too); the write-behind's copy of its state at the
        # prefix's end may sit beside it (its blob counted as it arrives: ``Tiers.put``).
        whole = max((e for e in engine.tiers.entries() if e.tier == "ram"), key=lambda e: len(e.tokens))
        assert len(rooms) == 1, rooms
        assert rooms[0] >= whole.nbytes, (rooms, whole.nbytes)
        assert rooms[0] <= 3 * whole.nbytes, (rooms, whole.nbytes)  # a bound, not a guess far above it


@pytest.mark.parametrize("name", ["hybrid-qwen35", "recurrent-mamba2"])
def test_the_memory_table_counts_every_sequences_recurrent_state(name: str) -> None:
    """``modeld status``'s KV counts the recurrent states llama.cpp allocated at load: 0 KV
    bytes a token on mamba2 is not 0 bytes of memory."""
    path = str(testmodels.ensure_model(SPECS[name]))
    with Engine(backends=("llama",), residency=Residency(sequences=2)) as engine:
        s = engine.open_session(_request(path))
        s.ensure_prefix(PrefixInput(text=BASE))
        info = s.info.footprint
        model = engine.status().models[0]
        assert info.state_bytes > 0
        cells = model.pool_tokens * model.kv_bytes_per_token
        assert model.memory.kv_allocated_bytes == cells + model.sequences * info.state_bytes, model.memory


def test_an_idle_hybrid_context_leaves_once_the_prefills_attention_is_measured_dear() -> None:
    """Sequences of one unified pool, the attention's cost measured as dear from prefill jobs
    only (turns that decode nothing never measure the decode). A new session's turn starts: the
    idle hybrid context leaves (its snapshot, checkpoints inside, serves an edit anywhere).
    Before, the decode's cost had to be measured too, and it stayed."""
    path = str(testmodels.ensure_model(SPECS["hybrid-qwen35"]))
    with Engine(backends=("llama",), residency=Residency(sequences=3)) as engine:
        # The new turn copies the start it shares with its best candidate (``near``), which
        # stays for that: ``a`` is the idle context that could leave.
        near = engine.open_session(_request(path))
        near.ensure_prefix(PrefixInput(text="class Idle:\n    pass\n" * 10))
        a = engine.open_session(_request(path))
        a.ensure_prefix(PrefixInput(text=BASE))
        a.prefill_suffix(SuffixInput(text="fix it\n"))
        list(a.decode(DecodeConfig(max_tokens=1)))  # its turn ends: idle
        costs = engine.models()[0].cache.costs
        for i in range(40):
            span = (i % 8) * 250
            costs.prefilled(300, span, 2.0 + 0.03 * 300 + 0.05 * 300 * (span + 150))
        assert costs.prefill.known() and not costs.decode.known()
        b = engine.open_session(_request(path))
        b.ensure_prefix(PrefixInput(text="class Other:\n    pass\n" * 20))
        kv = {c.session_id for c in engine.status().models[0].contexts if c.tier == "kv"}
        assert a.session_id not in kv, kv


def _held_by(blob: bytes) -> int:
    """The bytes of the checkpoints a snapshot carries (its section after llama.cpp's state:
    ``Checkpoints.pack``), read from the blob the worker sent."""
    _end, section = Checkpoints.section(memoryview(blob))
    assert section is not None
    (count,) = struct.unpack_from("<I", section, 0)
    at, held = 4, 0
    for _ in range(count):
        _pos, _canonical, length = struct.unpack_from("<IBI", section, at)
        at += 9 + length
        held += length
    return held


def _memory_metric(engine: Engine, part: str) -> float:
    metrics = Metrics(status=engine.status)
    text, _ = metrics.render()
    return next(
        s.value
        for family in text_string_to_metric_families(text.decode())
        for s in family.samples
        if s.name == "modeld_model_memory_bytes" and s.labels.get("part") == part
    )


@pytest.mark.parametrize("name", ["hybrid-qwen35", "swa-gemma3"])
def test_the_memory_table_shows_the_checkpoints_each_context_holds(name: str) -> None:
    """The checkpoints a worker's sequences hold live in its heap beside the KV: the table
    shows what they hold now (the worker's own count, sent with its replies), the parts add
    it, ``/metrics`` exposes it; once the context leaves the KV they are gone, and so is their
    count. Before, the table had no such part (the budget counted the most they could hold)."""
    path = str(testmodels.ensure_model(SPECS[name]))
    with Engine(backends=("llama",), residency=Residency(sequences=1)) as engine:
        s = engine.open_session(_request(path))
        s.ensure_prefix(PrefixInput(text=BASE))
        s.prefill_suffix(SuffixInput(text="fix it\n"))
        (model,) = engine.models()
        (context,) = model.cache.state.pool.contexts.values()
        blob = model.supervisor.host().snapshot(context.seq).result()
        held = _held_by(blob)  # one context: every checkpoint the worker holds
        memory = engine.status().models[0].memory
        assert held > 0
        assert memory.checkpoint_bytes == held, (memory, held)
        assert memory.isolation == "process"
        parts = memory.weights_bytes + memory.kv_allocated_bytes + memory.compute_bytes + memory.runtime_bytes
        assert memory.parts_bytes == parts + held
        assert _memory_metric(engine, "checkpoints") == held
        # And per context, in status's list (``modeld status``'s CHECKPOINTS column).
        (listed,) = [c for c in engine.status().models[0].contexts if c.tier == "kv"]
        assert listed.checkpoint_bytes == held, listed
        shown = format_status(engine.status())
        assert "CHECKPOINTS" in shown and format_bytes(held) in shown, shown
        # The context leaves the KV (to the RAM tier, its checkpoints inside its snapshot).
        with model.cache.state.lock:
            eviction.evict(model.cache.state.pool, context, model.cache.runtime(), "a test made room")
        assert not model.cache.state.pool.contexts
        assert engine.status().models[0].memory.checkpoint_bytes == 0
        listed_now = engine.status().models[0].contexts
        assert "kv" not in {c.tier for c in listed_now} and not any(c.checkpoint_bytes for c in listed_now)
        assert _memory_metric(engine, "checkpoints") == 0
