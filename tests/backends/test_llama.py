"""The llama.cpp backend beyond the contract suite: warm equals cold (property-based), exact
accounting after random edits, describe's figures, bad files, and a responsive daemon while
the engine computes."""

from __future__ import annotations

import shutil
from collections.abc import Iterator
from dataclasses import replace
from pathlib import Path

import pytest
from harness import Harness, llama_model, local_harness, status_answers_during, wire_harness
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from modeld.backends.base import LoadOptions
from modeld.cache.reuse import common_prefix_len
from modeld.contract import Config, DecodeConfig, OpenSessionRequest, PrefixInput, SuffixInput
from modeld.engine import Engine
from modeld.errors import BackendMismatchError, ModelLoadError, UnsupportedError

pytestmark = pytest.mark.llama

llama = pytest.importorskip("modeld.backends.llama")
testmodels = pytest.importorskip("modeld.testmodels")

BASE = (
    "You are a careful coding assistant.\n"
    "src/app.py: main(), load_config(path), save(state)\n"
    "src/db.py: connect(url), migrate(version), rollback()\n"
    "tests/test_app.py: test_main, test_config_roundtrip\n"
    "def load_config(path):\n    with open(path) as f:\n        return json.load(f)\n"
)


@pytest.fixture(scope="module")
def tiny() -> str:
    return str(testmodels.ensure_model(testmodels.TINY))


def _request(path: str, **config: object) -> OpenSessionRequest:
    return OpenSessionRequest(
        type="llama", path=path, config=replace(Config(num_ctx=2048, num_batch=16), **config)
    )  # type: ignore[arg-type]


def _greedy(session: object, n: int = 10) -> list[int]:
    with session.decode(DecodeConfig(max_tokens=n)) as stream:  # type: ignore[attr-defined]
        return [t for chunk in stream for t in chunk.token_ids]


# --- chunking -------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("n", "batch", "sizes"),
    [
        (0, 8, []),
        (1, 8, [1]),
        (8, 8, [8]),
        (9, 8, [7, 2]),
        (17, 8, [8, 7, 2]),
        (10, 8, [8, 2]),
        (3, 2, [2, 1]),
    ],
)
def test_prefill_batches_never_leave_a_lone_last_token(n: int, batch: int, sizes: list[int]) -> None:
    from modeld.backends.llama_runtime import chunk_sizes

    assert chunk_sizes(n, batch) == sizes
    assert sum(sizes) == n


@pytest.mark.parametrize(
    ("num_batch", "n_seq", "chunk"),
    [(512, 1, 512), (512, 4, 512), (512, 3, 510), (512, 5, 510), (512, 6, 510), (32, 3, 30), (2, 4, 4)],
)
def test_the_micro_batch_is_a_multiple_of_the_sequences(num_batch: int, n_seq: int, chunk: int) -> None:
    """Never below the sequences (llama.cpp aborts), and a multiple of them (llama.cpp otherwise
    reserves a rounded-up graph and every prefill runs ~20% slower)."""
    from modeld.backends.llama_runtime import micro_batch

    assert micro_batch(num_batch, n_seq) == chunk


@pytest.mark.slow
def test_a_lone_token_in_the_middle_of_a_prefill_keeps_cold_numerics() -> None:
    """A 1-token prefill batch takes another kernel in llama.cpp (on the realistic q8_0 model a
    lone token at position 150 moves later logits by ~0.13 of their spread); the runtime pairs
    it with its predecessor, so prefilling in pieces gives bit-identical logits to one cold
    evaluation."""
    import numpy as np

    from modeld.backends import llama_runtime

    path = str(testmodels.ensure_model(testmodels.REALISTIC))
    backend = llama.LlamaBackend()
    req = _request(path, num_batch=512)
    runtime = backend.load(req, backend.describe(req), LoadOptions(n_seq=1, window=2048, pool_tokens=2048))
    tokens = runtime.tokenize(BASE * 20, add_bos=True)[:300]

    def logits() -> object:
        ptr = llama_runtime._llama.llama_get_logits_ith(runtime._ctx, -1)
        return np.ctypeslib.as_array(ptr, shape=(runtime._n_vocab,)).copy()

    for _ in runtime.sync(0, 0, tokens):
        pass
    cold = logits()
    held = 0
    for piece in (tokens[:150], tokens[150:151], tokens[151:260], tokens[260:261], tokens[261:]):
        for _ in runtime.sync(0, held if held else 0, piece):
            pass
        held += len(piece)
    assert list(runtime.resident(0)) == tokens
    assert np.array_equal(logits(), cold)
    runtime.close()


# --- warm equals cold -------------------------------------------------------------------------

edit = st.one_of(
    st.tuples(st.just("append"), st.text(alphabet="abcdefgh ().:\n_=é✓", min_size=1, max_size=30)),
    st.tuples(st.just("middle"), st.text(alphabet="xyz[]\n ", min_size=1, max_size=12)),
    st.tuples(st.just("start"), st.text(alphabet="QRST ", min_size=1, max_size=6)),
    st.tuples(st.just("last_char"), st.sampled_from(["!", "?", "\n", "z"])),
    st.tuples(st.just("identical"), st.just("")),
)


def _apply(text: str, kind: str, payload: str, where: float) -> str:
    if kind == "append":
        return text + payload
    if kind == "middle":
        i = int(len(text) * where)
        return text[:i] + payload + text[i + len(payload) :]
    if kind == "start":
        return payload + text[len(payload) :]
    if kind == "last_char":
        return text[:-1] + payload
    return text


@pytest.fixture(scope="module")
def engines(tiny: str) -> Iterator[tuple[Engine, object]]:
    warm_engine = Engine(backends=("llama",))
    session = warm_engine.open_session(_request(tiny))
    yield warm_engine, session
    warm_engine.shutdown()


@settings(max_examples=30, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(
    edits=st.lists(st.tuples(edit, st.floats(min_value=0.05, max_value=0.95)), min_size=1, max_size=4),
    suffix=st.text(alphabet="fix the bug in load_config\n", min_size=1, max_size=40),
)
def test_warm_greedy_decoding_equals_cold_after_random_prefix_edits(
    engines: tuple[Engine, object], tiny: str, edits: list[tuple[tuple[str, str], float]], suffix: str
) -> None:
    """For random edits of the prefix (append, middle, start, last character, identical), greedy
    tokens after a warm ensure_prefix equal those of a fresh context evaluating the same text,
    and reuse is exactly the longest common token prefix with what the KV held."""
    _, session = engines
    model = session.model  # type: ignore[attr-defined]
    text = BASE
    session.ensure_prefix(PrefixInput(text=text))  # type: ignore[attr-defined]
    for (kind, payload), where in edits:
        text = _apply(text, kind, payload, where)
        context = session.slot.context  # type: ignore[attr-defined]
        before = list(context.tokens) if context is not None else []  # in the KV (a tail included)
        had = model.cache.kv_tokens(session.slot, session._tokens)  # type: ignore[attr-defined]
        wanted = [model.vocab.bos, *model.tokenize(text, False)]
        status = session.ensure_prefix(PrefixInput(text=text))  # type: ignore[attr-defined]
        assert status.reused_tokens == common_prefix_len(before, wanted)
        assert status.reused_tokens + status.prefilled_tokens == status.prefix_tokens == len(wanted)
        # Dropped: what the session had (its prefix, suffix and output) and does not keep; a tail
        # a previous ensure_prefix left in place is not the session's any more.
        assert status.dropped_tokens == max(0, had - status.reused_tokens)
        session.prefill_suffix(SuffixInput(text=suffix))  # type: ignore[attr-defined]
        warm = _greedy(session)
        with Engine(backends=("llama",)) as cold_engine:
            cold = cold_engine.open_session(_request(tiny))
            assert cold.ensure_prefix(PrefixInput(text=text)).reuse.outcome == "cold"
            cold.prefill_suffix(SuffixInput(text=suffix))
            assert _greedy(cold) == warm


def test_edit_at_token_k_reuses_exactly_k(tiny: str) -> None:
    with Engine(backends=("llama",)) as engine:
        s = engine.open_session(_request(tiny))
        vocab = s.model.vocab
        tokens = [vocab.bos, *s.model.tokenize(BASE, False)]
        s.ensure_prefix(PrefixInput(text=BASE))
        for cut in (5, len(tokens) // 2, len(tokens) - 1):
            prefix_text = "".join(vocab.piece(t).decode() for t in tokens[1:cut])
            edited = prefix_text + "@@@" + BASE[len(prefix_text) + 3 :]
            k = common_prefix_len(tokens, [vocab.bos, *s.model.tokenize(edited, False)])
            st_ = s.ensure_prefix(PrefixInput(text=edited))
            assert st_.reused_tokens == k
            assert cut - 1 <= k <= cut  # the edit starts right after token cut-1
            s.ensure_prefix(PrefixInput(text=BASE))


# --- describe -----------------------------------------------------------------------------------


def test_describe_computes_the_kv_cost_from_the_file(tiny: str) -> None:
    engine = Engine(backends=("llama",))
    spec = testmodels.TINY
    head_dim = spec.hidden // spec.heads
    for kv_type, per_value, flash in (("f16", 2.0, False), ("f32", 4.0, False), ("q8_0", 34 / 32, True)):
        info = engine.describe(_request(tiny, num_ctx=4096, kv_cache_type=kv_type, flash_attn=flash))
        expected = 2 * spec.layers * spec.kv_heads * head_dim * per_value
        assert info.kv_bytes_per_token == int(-(-expected // 1))
        assert info.model_max_context == spec.context_length
        assert info.effective_context == 4096
        assert info.vocab_size == spec.vocab_size
        assert info.add_bos is True
        assert info.chat_template and info.template_digest
    big = engine.describe(_request(tiny, num_ctx=1 << 20))
    assert big.effective_context == spec.context_length  # capped by the trained context


def test_settings_this_build_cannot_honour_are_refused(tiny: str) -> None:
    """Refused by name: a quantized KV without flash attention (at describe), GPU settings on a
    build without GPU offload (when the worker loads the model; nothing stays loaded)."""
    import llama_cpp

    with Engine(backends=("llama",)) as engine:
        with pytest.raises(UnsupportedError, match="flash_attn"):
            engine.describe(_request(tiny, kv_cache_type="q8_0"))
        if not llama_cpp.llama_supports_gpu_offload():
            for field, config in (
                ("config.tensor_split", {"tensor_split": (0.5, 0.5)}),
                ("config.num_gpu_layers", {"num_gpu_layers": 4}),
            ):
                with pytest.raises(UnsupportedError) as err:
                    engine.open_session(_request(tiny, **config))
                assert err.value.field == field
            assert engine.models() == []


# --- bad files ------------------------------------------------------------------------------------


def test_bad_model_files_are_clear_errors_and_the_daemon_keeps_serving(tiny: str, tmp_path: Path) -> None:
    truncated = tmp_path / "truncated.gguf"
    truncated.write_bytes(Path(tiny).read_bytes()[: Path(tiny).stat().st_size // 2])
    not_gguf = tmp_path / "notes.gguf"
    not_gguf.write_text("this is not a model\n")
    ir = tmp_path / "ir"
    ir.mkdir()
    (ir / "openvino_model.xml").write_text("<net/>")
    with wire_harness(llama_model()) as h:
        for path, error, words in (
            (truncated, ModelLoadError, "truncated"),
            (not_gguf, ModelLoadError, "not a GGUF"),
            (tmp_path / "missing.gguf", ModelLoadError, "does not exist"),
            (ir, BackendMismatchError, "OpenVINO IR"),
        ):
            with pytest.raises(error) as err:
                h.service.open_session(h.request(path=str(path)))
            assert words in str(err.value)
            assert str(path) in str(err.value) or path.name in str(err.value)
        with pytest.raises(BackendMismatchError):
            h.service.open_session(replace(h.request(), type="openvino"))
        with h.open() as s:
            assert s.ensure_prefix(PrefixInput(text=BASE)).prefix_tokens > 0


def test_a_replaced_file_is_never_served_under_its_old_identity(tiny: str, tmp_path: Path) -> None:
    path = tmp_path / "model.gguf"
    shutil.copyfile(tiny, path)
    engine = Engine(backends=("llama",))
    first = engine.describe(_request(str(path)))
    shutil.copyfile(testmodels.ensure_model(replace(testmodels.TINY, seed=4242)), path)
    with pytest.raises(ModelLoadError, match="digest"):
        engine.open_session(replace(_request(str(path)), digest=first.model_digest))
    assert engine.describe(_request(str(path))).model_digest != first.model_digest
    engine.shutdown()


# --- the daemon stays responsive ---------------------------------------------------------------


@pytest.mark.slow
def test_the_daemon_answers_while_the_engine_prefills() -> None:
    """llama_decode releases the GIL: Status answers while a long prefill is running. About 680
    tokens in three batches of 256 take 6-10 s here: an engine that held the GIL through each
    batch would answer only between them, at most 3 times; one that releases it answers every
    ~50 ms (the check needs 20, about 1 s of it)."""
    realistic = str(testmodels.ensure_model(testmodels.REALISTIC))
    with wire_harness(replace(llama_model(), path=realistic)) as h:
        s = h.service.open_session(h.request(num_ctx=4096, num_batch=256))
        assert status_answers_during(h, lambda: s.ensure_prefix(PrefixInput(text=BASE * 7))) >= 20
        s.close()


def test_closed_sessions_kv_serves_a_new_client(tiny: str) -> None:
    with wire_harness(llama_model()) as h:
        from runtime_client import connect

        first = connect(h.service.target)  # type: ignore[attr-defined]
        s1 = first.open_session(h.request())
        cold = s1.ensure_prefix(PrefixInput(text=BASE))
        first.close()  # a client process goes away
        second = connect(h.service.target)  # type: ignore[attr-defined]
        s2 = second.open_session(h.request())
        warm = s2.ensure_prefix(PrefixInput(text=BASE + "more\n"))
        assert warm.reused_tokens >= cold.prefix_tokens - 1
        assert warm.reuse.outcome == "warm"
        second.close()


def test_local_harness_describes_llama(tiny: str) -> None:
    with local_harness(llama_model()) as h:
        assert isinstance(h, Harness)
        assert h.service.describe(h.request()).backend == "llama"


# --- memory that cannot be cut -----------------------------------------------------------------


def test_recurrent_model_falls_back_to_a_cold_prefill_never_a_wrong_reuse() -> None:
    path = str(testmodels.ensure_model(testmodels.RECURRENT))
    with Engine(backends=("llama",)) as engine:
        req = replace(_request(path), config=Config(num_ctx=1024, num_batch=16, num_threads=1))
        info = engine.describe(req)
        assert info.capabilities.truncation is False
        assert info.kv_bytes_per_token == 0  # a fixed recurrent state, not a per-token cache
        s = engine.open_session(req)
        first = s.ensure_prefix(PrefixInput(text=BASE))
        appended = s.ensure_prefix(PrefixInput(text=BASE + "more history\n"))
        assert appended.reuse.reason == "extended"  # appending needs no cut
        assert appended.reused_tokens == first.prefix_tokens
        edited = BASE.replace("migrate", "upgrade")
        st_ = s.ensure_prefix(PrefixInput(text=edited))
        # Back to the last checkpoint of the state before the edit (one every batch of 16).
        assert (st_.reuse.outcome, st_.reuse.reason) == ("partial", "diverged")
        diverged = st_.reuse.diverged_at_token or 0
        assert diverged - 16 <= st_.reused_tokens < diverged
        assert f"checkpoint at token {st_.reused_tokens}" in st_.reuse.message
        assert st_.reused_tokens + st_.prefilled_tokens == st_.prefix_tokens
        s.prefill_suffix(SuffixInput(text="fix it\n"))
        warm_path = _greedy(s)
        # The generated tokens cannot be cut off the recurrent state, but the state at the
        # prefix's end was checkpointed when the prefix was computed: the engine goes back to it.
        again = s.ensure_prefix(PrefixInput(text=edited))
        assert (again.reuse.outcome, again.reuse.reason) == ("warm", "full_match")
        assert again.reused_tokens == again.prefix_tokens
        with Engine(backends=("llama",)) as cold_engine:
            cold = cold_engine.open_session(req)
            cold.ensure_prefix(PrefixInput(text=edited))
            cold.prefill_suffix(SuffixInput(text="fix it\n"))
            assert _greedy(cold) == warm_path
        # An edit before the first checkpoint: nothing to go back to.
        start = s.ensure_prefix(PrefixInput(text="Q" + edited[1:]))
        assert (start.reuse.outcome, start.reuse.reason) == ("cold", "truncation_unsupported")
        assert start.reused_tokens == 0 and start.prefilled_tokens == start.prefix_tokens


@pytest.mark.parametrize("spec", ["TINY", "QWEN35", "GEMMA3"])
def test_a_repeated_prompt_decodes_from_the_logits_its_prefill_kept(spec: str) -> None:
    """A prompt decoded, then the same prompt again (a retry, a regeneration, the same request
    after another sequence's turn): the second decode reads the logits the prefill kept for its
    last token, evaluates no token before its first (llama.cpp's own counters), and answers as
    the first did, token and log-probability alike; so does a copy of the sequence into another
    (a new session sending that prompt). On a prompt one token shorter nothing kept applies: its
    last batch is evaluated again, and it still answers as a fresh evaluation."""
    from modeld.backends._llama_lib import bindings as llama
    from modeld.backends.llama import LlamaBackend

    backend = LlamaBackend()
    request = _request(str(testmodels.ensure_model(getattr(testmodels, spec))))
    runtime = backend.load(
        request, backend.describe(request), LoadOptions(n_seq=2, window=2048, pool_tokens=4096)
    )
    config = DecodeConfig(max_tokens=6, logprobs=True, top_logprobs=3)

    def evaluated() -> int:
        perf = llama.llama_perf_context(runtime._ctx)
        return int(perf.n_p_eval) + int(perf.n_eval)

    def answer(seq: int, tokens: list[int]) -> tuple[list[object], int]:
        keep = common_prefix_len(list(runtime.resident(seq)), tokens)
        for _ in runtime.sync(seq, keep, tokens[keep:]):
            pass
        kept = len(runtime.resident(seq))  # memory that cannot be cut there goes back further
        for _ in runtime.sync(seq, kept, tokens[kept:]) if kept < len(tokens) else ():
            pass
        before = evaluated()
        out = list(runtime.generate(seq, config, 6))
        return out, evaluated() - before

    try:
        prompt = runtime.tokenize("A repeated prompt: " + "the quick brown fox " * 40, add_bos=True)
        first, _ = answer(0, prompt)
        other, _ = answer(1, prompt[:50])  # another sequence's turn between (the buffer moves on)
        again, cost = answer(0, prompt)
        assert again == first
        assert cost == len(again) - 1  # each yielded token but the last; nothing before the first
        # A new session sending the prompt another sequence holds: a copy takes its kept logits.
        runtime.copy(0, 1, len(prompt))
        before = evaluated()
        copied = list(runtime.generate(1, config, 6))
        assert copied == first and evaluated() - before == len(copied) - 1
        shorter, _ = answer(0, prompt[:-1])
        for _ in runtime.sync(1, 0, prompt[:-1]):  # a fresh evaluation of the shorter prompt
            pass
        assert shorter == list(runtime.generate(1, config, 6))
        assert other
    finally:
        runtime.close()
