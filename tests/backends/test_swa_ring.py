"""Sliding-window models with a ring of SWA cells (``serve --no-swa-full``, llama-server's
default) beside llama.cpp's full-size SWA cache (modeld's default): what each costs and what
each gives (blueprint 0016, "Sliding windows").

The cost is checked against llama.cpp itself: the cells and layers its SWA cache says it
created (its load log, kept by the worker), the growth of a sequence's partial state per token
(the local layers' KV), and the memory table's KV. What it gives is measured on the generated
gemma3 and gpt-oss: an edit inside the prefix goes back to a checkpoint of the window (the ring
no longer holds the window before the cut), and the warm turn, like a repeat, equals a fresh
evaluation, tokens and log-probabilities.
"""

from __future__ import annotations

import re
import time

import pytest
from greedy import greedy_logprobs

from modeld.contract import Config, OpenSessionRequest, PrefixInput, SuffixInput
from modeld.engine import Engine
from modeld.settings import Residency

pytestmark = pytest.mark.llama

llama = pytest.importorskip("modeld.backends.llama")
testmodels = pytest.importorskip("modeld.testmodels")

SPECS = {spec.name: spec for spec in testmodels.ARCH_SPECS}
SWA = ["swa-gemma3", "swa-gptoss"]

BASE = "".join(
    f"def handler_{i}(request):\n    value = compute({i}, request.body)\n    return respond(value)\n\n"
    for i in range(24)
)
EDITED = BASE.replace("handler_15(", "handler_15b(")


def _request(name: str, num_ctx: int = 2048, batch: int = 16) -> OpenSessionRequest:
    path = str(testmodels.ensure_model(SPECS[name]))
    return OpenSessionRequest(
        type="llama", path=path, config=Config(num_ctx=num_ctx, num_batch=batch, num_threads=2)
    )


def _swa_cache(lines: tuple[str, ...]) -> tuple[int, int]:
    """The cells and layers of the SWA cache llama.cpp created: its load log's size line after
    "creating SWA KV cache"."""
    text = "\n".join(lines)
    at = text.rfind("creating     SWA KV cache")
    assert at >= 0, text[-2000:]
    size = re.search(r"llama_kv_cache: size = .*?\(\s*(\d+) cells,\s*(\d+) layers", text[at:])
    assert size is not None, text[at:]
    return int(size.group(1)), int(size.group(2))


@pytest.mark.parametrize("name", SWA)
@pytest.mark.parametrize("full", [True, False])
def test_describe_and_the_memory_table_show_what_each_swa_cache_costs(name: str, full: bool) -> None:
    """describe's KV under each setting, the loaded layout's and the memory table's are what
    llama.cpp allocates: a ring of ``n_swa x n_seq + n_ubatch`` cells (padded to 256) in the
    local layers with ``--no-swa-full``, every pool cell with the full-size cache."""
    req = _request(name, num_ctx=4096, batch=64)
    with Engine(backends=("llama",), residency=Residency(sequences=2, swa_full=full)) as engine:
        fp = engine.describe(req).footprint
        s = engine.open_session(req)
        s.ensure_prefix(PrefixInput(text="def f():\n    return 1\n"))
        status = engine.status(debug=True).models[0]
        layout = engine.models()[0].layout
    assert status.worker is not None
    cells, local_layers = _swa_cache(status.worker.log_lines)
    # The local layers' part of a token's KV, as describe reads the header: every local layer's.
    per_layer = fp.kv_bytes_per_token // SPECS[name].layers  # every layer alike on these models
    assert fp.swa_kv_bytes_per_token == local_layers * per_layer > 0
    assert fp.swa_ring is (not full)
    assert fp.swa_full_kv_bytes == status.pool_tokens * fp.kv_bytes_per_token
    ring = fp.swa_full_kv_bytes - (status.pool_tokens - layout.swa_ring_cells) * fp.swa_kv_bytes_per_token
    if full:
        assert cells == status.pool_tokens and layout.swa_ring_cells == 0
        assert fp.kv_bytes == fp.swa_full_kv_bytes
        assert "bit for bit" in fp.warm
    else:
        assert cells == layout.swa_ring_cells == 256 < status.pool_tokens  # 32 x 2 + 64, padded
        assert fp.kv_bytes == fp.swa_ring_kv_bytes == ring < fp.swa_full_kv_bytes
        assert "differ" in fp.warm
    assert status.memory.kv_allocated_bytes == fp.kv_bytes == layout.kv_allocated_bytes


@pytest.mark.parametrize("ring", [False, True])
def test_ollama_ps_says_the_size_of_the_swa_cache_in_force(
    ring: bool, tmp_path_factory: pytest.TempPathFactory
) -> None:
    """``/api/ps`` (Ollama's list of loaded models, through the ollama SDK) sizes a model as its
    weights, the KV the engine allocated under the setting in force, checkpoints and compute:
    the ring's KV with ``--no-swa-full``, the full-size cache's without (it counted the
    full-size KV alone, whatever the setting)."""
    import httpx
    import ollama
    from daemon_proc import serve_http, stop

    path = str(testmodels.ensure_model(SPECS["swa-gemma3"]))
    flags = ["--model", f"m={path}", "--num-ctx", "4096", *(["--no-swa-full"] if ring else [])]
    proc, record = serve_http(tmp_path_factory.mktemp("ps"), *flags, backend="llama")
    client = ollama.Client(host=record.http_endpoint, timeout=120)
    try:
        client.chat(
            model="m", messages=[{"role": "user", "content": "def f():\n"}], options={"num_predict": 2}
        )
        for _ in range(600):  # the answer's prefill ahead of the next turn takes its checkpoints
            records = httpx.get(f"{record.http_endpoint}/v1/requests", timeout=30).json()["data"]
            if records and all(r["state"] == "done" for r in records):
                break
            time.sleep(0.05)
        fp = httpx.get(f"{record.http_endpoint}/v1/models", timeout=30).json()["data"][0]["modeld"][
            "footprint"
        ]
        loaded = client.ps().models
        raw = httpx.get(f"{record.http_endpoint}/api/ps", timeout=30).json()["models"][0]["modeld"]
    finally:
        client._client.close()  # the client keeps a connection pool and has no close()
        stop(proc)
    parts = raw["memory_bytes"]
    assert [m.model for m in loaded] == ["m"]
    assert parts["kv_allocated"] == (fp["swa_ring_kv_bytes"] if ring else fp["swa_full_kv_bytes"])
    assert fp["swa_ring_kv_bytes"] < fp["swa_full_kv_bytes"]
    assert parts["weights"] == fp["weights_bytes"] > 0 and parts["compute"] > 0
    assert 0 < parts["kv_used"] <= parts["kv_allocated"]
    assert (
        loaded[0].size == parts["weights"] + parts["kv_allocated"] + parts["checkpoints"] + parts["compute"]
    )


def _decode(session: object, n: int = 8) -> list[tuple[int, float]]:
    return greedy_logprobs(session, n)


ROUNDING = 2e-3
"""How far a ring's warm log-probability may be from a fresh evaluation's (measured: up to 0.0010
on the AVX2-only build, 0 on AMX; the full-size cache's tests demand bit for bit)."""


def _assert_matches(warm: list[tuple[int, float]], fresh: list[tuple[int, float]]) -> None:
    assert [t for t, _ in warm] == [t for t, _ in fresh]
    assert max(abs(a - b) for (_, a), (_, b) in zip(warm, fresh, strict=True)) <= ROUNDING, (warm, fresh)


def _fresh(name: str, prefix: str) -> list[tuple[int, float]]:
    with Engine(backends=("llama",), residency=Residency(sequences=1, swa_full=False)) as engine:
        s = engine.open_session(_request(name))
        assert s.ensure_prefix(PrefixInput(text=prefix)).reuse.outcome == "cold"
        s.prefill_suffix(SuffixInput(text="fix it\n"))
        return _decode(s)


@pytest.mark.parametrize("name", SWA)
def test_a_ring_goes_back_to_a_window_checkpoint_and_warm_matches_fresh(name: str) -> None:
    """With a ring the cache no longer holds the window before an edit at ~60% of the prefix:
    the turn restores the window's checkpoint at or before it (the full-size cache cuts at the
    batch boundary itself). The warm turn and a repeat of it are a fresh evaluation's (with a
    ring too) up to rounding: the same greedy tokens, log-probabilities within :data:`ROUNDING`
    (bit for bit on the AMX build, not on the AVX2-only one: blueprint 0016)."""
    with Engine(backends=("llama",), residency=Residency(sequences=1, swa_full=False)) as engine:
        s = engine.open_session(_request(name))
        first = s.ensure_prefix(PrefixInput(text=BASE))
        s.prefill_suffix(SuffixInput(text="fix it\n"))
        _decode(s)
        st = s.ensure_prefix(PrefixInput(text=EDITED))
        diverged = st.reuse.diverged_at_token
        assert diverged is not None and diverged > first.prefix_tokens // 2
        assert st.reuse.outcome == "partial", st.reuse
        assert 0 < st.reused_tokens < diverged - 16, st.reuse.message  # before the last batch start
        assert f"checkpoint at token {st.reused_tokens}" in st.reuse.message
        s.prefill_suffix(SuffixInput(text="fix it\n"))
        warm = _decode(s)
        again = s.ensure_prefix(PrefixInput(text=EDITED))
        assert again.reused_tokens == again.prefix_tokens
        s.prefill_suffix(SuffixInput(text="fix it\n"))
        repeat = _decode(s)
    fresh = _fresh(name, EDITED)
    _assert_matches(warm, fresh)
    _assert_matches(repeat, fresh)


@pytest.mark.parametrize("name", SWA)
def test_a_prefix_copied_between_sequences_of_a_ring_leaves_room_for_the_next_batch(name: str) -> None:
    """Two sequences in one unified pool with a ring of SWA cells: a second session that starts
    with the first one's prefix copies its context, then evaluates more. The ring reuses a cell
    outside the window only when one sequence holds it; before the copy gave the second
    sequence a window of its own, every ring cell was shared after it and the next batch failed
    (``llama_decode failed with code 1``). Its answer is a fresh evaluation's, up to rounding."""
    longer = BASE + "".join(f"def extra_{i}(x):\n    return x + {i}\n\n" for i in range(8))
    with Engine(backends=("llama",), residency=Residency(sequences=2, swa_full=False)) as engine:
        a = engine.open_session(_request(name))
        a.ensure_prefix(PrefixInput(text=BASE))
        b = engine.open_session(_request(name))
        st = b.ensure_prefix(PrefixInput(text=longer))
        assert st.reused_tokens > 0, st.reuse.message  # copied from a's context
        b.prefill_suffix(SuffixInput(text="fix it\n"))
        warm = _decode(b)
    _assert_matches(warm, _fresh(name, longer))
