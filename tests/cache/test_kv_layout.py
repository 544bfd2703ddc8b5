"""The KV layout a model loads with (blueprint 0016): planned within the memory budget, the
default one unified window, snapshots that move between layouts, and explain-context saying
whether warm output is bit-identical to a fresh evaluation."""

from __future__ import annotations

from pathlib import Path

import pytest

from modeld.backends.sizing import MODEL_OVERHEAD_BYTES, compute_bytes, plan_layout
from modeld.contract import Config, DecodeConfig, Footprint, OpenSessionRequest, PrefixInput
from modeld.engine import Engine
from modeld.settings import Residency
from modeld.wire.convert import report_from_pb, report_to_pb

MIB = 1 << 20
FP = Footprint(
    weights_bytes=400 * MIB,
    kv_bytes_per_token=12288,
    compute_floor_bytes=66 * MIB,
    compute_fixed_bytes=11 * MIB,
    compute_bytes_per_token=512 * 15 * 4,
)


def _cost(pool: int, cells: int) -> int:
    return FP.weights_bytes + pool * FP.kv_bytes_per_token + compute_bytes(FP, cells) + MODEL_OVERHEAD_BYTES


def test_the_default_is_one_unified_window_whatever_the_sequences() -> None:
    options, note = plan_layout(sequences=4, unified=True, pool_tokens=0, window=8704, fp=FP, room=None)
    assert (options.n_seq, options.window, options.pool_tokens, options.unified, note) == (
        4,
        8704,
        8704,
        True,
        "",
    )
    split, _ = plan_layout(sequences=4, unified=False, pool_tokens=0, window=8704, fp=FP, room=None)
    assert (split.n_seq, split.pool_tokens, split.unified) == (4, 4 * 8704, False)


def test_a_short_budget_shrinks_the_pool_or_the_sequences() -> None:
    room = _cost(4096, 4096) + 1  # a 4096-cell pool fits, 8704 does not
    options, note = plan_layout(sequences=4, unified=True, pool_tokens=0, window=8704, fp=FP, room=room)
    assert (options.n_seq, options.window, options.pool_tokens) == (4, 4096, 4096)
    assert "unified/4:8704" in note and "unified/4:4096" in note
    split, note = plan_layout(
        sequences=4, unified=False, pool_tokens=0, window=8704, fp=FP, room=_cost(2 * 8704, 8704)
    )
    assert (split.n_seq, split.window) == (2, 8704)
    assert note == "4 sequences of 8704 tokens would not fit in the memory budget; using 2"
    one, note = plan_layout(
        sequences=4, unified=False, pool_tokens=0, window=8704, fp=FP, room=_cost(2048, 2048)
    )
    assert (one.n_seq, one.window) == (1, 2048)  # even one stream was too big: the window shrinks
    nothing, note = plan_layout(
        sequences=4, unified=True, pool_tokens=0, window=8704, fp=FP, room=FP.weights_bytes
    )
    assert nothing.pool_tokens == 8704 and note == ""  # nothing fits: the load is refused by the budget check


def test_an_explicit_pool_caps_the_window() -> None:
    options, _ = plan_layout(sequences=3, unified=True, pool_tokens=3000, window=4096, fp=FP, room=None)
    assert (options.window, options.pool_tokens) == (3000, 3000)
    larger, _ = plan_layout(sequences=4, unified=True, pool_tokens=3 * 4096, window=4096, fp=FP, room=None)
    assert (larger.window, larger.pool_tokens, larger.unified) == (4096, 3 * 4096, True)


def test_a_pool_of_every_sequences_window_is_split() -> None:
    """Sharing a pool that holds every sequence's whole window gains no capacity (no sequence
    grows past its window) and makes each sequence attend over the others' cells: split streams
    hold the same, exactly. Unless the budget has room only for the pool as asked."""
    options, note = plan_layout(
        sequences=3, unified=True, pool_tokens=3 * 4096, window=4096, fp=FP, room=None
    )
    assert (options.n_seq, options.window, options.pool_tokens, options.unified, note) == (
        3,
        4096,
        3 * 4096,
        False,
        "",
    )
    roomy, _ = plan_layout(
        sequences=3, unified=True, pool_tokens=4 * 4096, window=4096, fp=FP, room=_cost(4 * 4096, 4 * 4096)
    )
    assert (roomy.pool_tokens, roomy.unified) == (3 * 4096, False)  # the fourth window could never be used
    # The split layout's compute buffer is a window's; a budget that fits neither layout keeps
    # the unified plan and its own shrinking rule.
    short, note = plan_layout(
        sequences=3, unified=True, pool_tokens=3 * 4096, window=4096, fp=FP, room=_cost(2048, 2048)
    )
    assert short.unified and short.pool_tokens == 2048 and "unified/3:2048" in note


# --- on the engine ----------------------------------------------------------------------------

llama = pytest.importorskip("modeld.backends.llama")
testmodels = pytest.importorskip("modeld.testmodels")
TEXT = "You are a careful engineer.\nrepo: src/app.py main() load_config()\nsrc/db.py connect()\n" * 6


def _request(path: str) -> OpenSessionRequest:
    return OpenSessionRequest(type="llama", path=path, config=Config(num_ctx=2048, num_batch=32))


def _greedy(session: object) -> list[int]:
    with session.decode(DecodeConfig(max_tokens=8)) as stream:  # type: ignore[attr-defined]
        return [t for chunk in stream for t in chunk.token_ids]


@pytest.mark.llama
@pytest.mark.parametrize(("written", "read"), [(False, True), (True, False)])
def test_a_snapshot_moves_between_split_and_unified(tmp_path: Path, written: bool, read: bool) -> None:
    """A disk snapshot written under one layout restores under the other (the default changed
    from split to unified: a data directory keeps its warm contexts), and the restored context,
    alone in its pool, decodes what a fresh evaluation does."""
    tiny = str(testmodels.ensure_model(testmodels.TINY))
    data = tmp_path / "data"
    with Engine(
        backends=("llama",), data_dir=data, residency=Residency(kv_unified=written, persist_min_tokens=8)
    ) as engine:
        first = engine.open_session(_request(tiny))
        size = first.ensure_prefix(PrefixInput(text=TEXT)).prefix_tokens
        fresh = _greedy(first)
        assert first.explain_context().kv_layout == ("unified/4:2048" if written else "split/4")
    with Engine(backends=("llama",), data_dir=data, residency=Residency(kv_unified=read)) as engine:
        session = engine.open_session(_request(tiny))
        status = session.ensure_prefix(PrefixInput(text=TEXT))
        assert (status.reuse.reason, status.reused_tokens) == ("restored_from_disk", size)
        assert _greedy(session) == fresh
        report = session.explain_context()
    assert report.warm_exact is (not read)
    assert report_from_pb(report_to_pb(report)).kv_layout == report.kv_layout


@pytest.mark.llama
def test_explain_context_says_when_warm_output_can_differ() -> None:
    from modeld.observe.views import format_report as _format_report

    tiny = str(testmodels.ensure_model(testmodels.TINY))
    with Engine(backends=("llama",)) as engine:
        session = engine.open_session(_request(tiny))
        session.ensure_prefix(PrefixInput(text=TEXT))
        unified = session.explain_context()
    with Engine(backends=("llama",), residency=Residency(kv_unified=False)) as engine:
        session = engine.open_session(_request(tiny))
        session.ensure_prefix(PrefixInput(text=TEXT))
        split = session.explain_context()
    assert (unified.kv_layout, unified.warm_exact, split.kv_layout, split.warm_exact) == (
        "unified/4:2048",
        False,
        "split/4",
        True,
    )
    assert (
        "numerics  warm output can differ from a fresh evaluation (KV layout unified/4:2048"
        in _format_report(unified)
    )
    assert "--no-kv-unified" in _format_report(unified)
    assert (
        "numerics  warm output is bit-identical to a fresh evaluation (KV layout split/4)"
        in _format_report(split)
    )


# --- KV precision, end to end ------------------------------------------------------------------

Q8_0_TINY = 2 * 2 * 32 * 2 // 32 * 34  # 2 layers x 2 KV heads x 32 wide, K and V: 256 values in q8_0 blocks


@pytest.mark.llama
def test_a_q8_0_kv_cache_halves_the_kv_and_stays_warm() -> None:
    """OpenSessionRequest.config: q8_0 with flash attention (llama.cpp needs it for a quantized V)
    loads, reuses its prefix warm, and costs 34/32 of a byte per value."""
    tiny = str(testmodels.ensure_model(testmodels.TINY))
    request = OpenSessionRequest(
        type="llama",
        path=tiny,
        config=Config(num_ctx=2048, num_batch=32, kv_cache_type="q8_0", flash_attn=True),
    )
    with Engine(backends=("llama",)) as engine:
        info = engine.describe(request)
        assert (info.kv_bytes_per_token, info.footprint.kv_bytes) == (Q8_0_TINY, 2048 * Q8_0_TINY)
        session = engine.open_session(request)
        first = session.ensure_prefix(PrefixInput(text=TEXT))
        _greedy(session)
        again = engine.open_session(request).ensure_prefix(PrefixInput(text=TEXT + "one more line\n"))
        (model,) = engine.status().models
    assert first.reuse.outcome == "cold" and again.reused_tokens == first.prefix_tokens
    assert model.kv_bytes_per_token == Q8_0_TINY


@pytest.mark.llama
def test_serve_kv_cache_type_reaches_http_sessions(tmp_path: Path) -> None:
    """``modeld serve --kv-cache-type q8_0``: HTTP sessions load a q8_0 KV (flash attention on)."""
    import httpx
    from daemon_proc import serve_http, stop

    import runtime_client as rc

    proc, record = serve_http(tmp_path, "--kv-cache-type", "q8_0", backend="llama")
    try:
        reply = httpx.post(
            f"{record.http_endpoint}/v1/completions",
            json={"model": "modeld-tiny", "prompt": TEXT, "max_tokens": 2, "temperature": 0},
            timeout=120,
        )
        assert reply.status_code == 200, reply.text
        with rc.connect(data_dir=tmp_path) as client:
            (model,) = client.status().models
        assert model.kv_bytes_per_token == Q8_0_TINY
    finally:
        stop(proc)
