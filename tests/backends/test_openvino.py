"""The OpenVINO GenAI backend beyond the contract suite: the same greedy tokens as llama.cpp,
warm equals cold after prefix edits, long texts tokenized exactly, IR directories, refusals."""

from __future__ import annotations

import itertools
from dataclasses import replace
from pathlib import Path

import pytest
from harness import openvino_model, status_answers_during, wire_harness
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from modeld.cache.reuse import common_prefix_len
from modeld.contract import Config, DecodeConfig, OpenSessionRequest, PrefixInput, SuffixInput
from modeld.engine import Engine
from modeld.errors import UnsupportedError

pytestmark = pytest.mark.openvino

ov_runtime = pytest.importorskip("modeld.backends.openvino_runtime")
testmodels = pytest.importorskip("modeld.testmodels")

BASE = (
    "You are a careful coding assistant.\n"
    "src/app.py: main(), load_config(path), save(state)\n"
    "src/db.py: connect(url), migrate(version), rollback()\n"
    "def load_config(path):\n    with open(path) as f:\n        return json.load(f)\n"
)
PROMPTS = [BASE, "Once upon a time\n", "def fib(n):\n", "Ünïcödé ✓ 日本語\n", BASE * 4]


@pytest.fixture(scope="module")
def tiny() -> str:
    return str(testmodels.ensure_model(testmodels.TINY))


def _request(kind: str, path: str, **config: object) -> OpenSessionRequest:
    return OpenSessionRequest(
        type=kind, path=path, config=replace(Config(num_ctx=2048, num_batch=64), **config)
    )  # type: ignore[arg-type]


def _greedy(session: object, prompt: str, suffix: str = "", n: int = 24) -> list[int]:
    session.ensure_prefix(PrefixInput(text=prompt))  # type: ignore[attr-defined]
    if suffix:
        session.prefill_suffix(SuffixInput(text=suffix))  # type: ignore[attr-defined]
    with session.decode(DecodeConfig(max_tokens=n)) as stream:  # type: ignore[attr-defined]
        return [t for chunk in stream for t in chunk.token_ids]


def test_greedy_tokens_match_llama_cpp_on_the_same_file(tiny: str) -> None:
    pytest.importorskip("modeld.backends.llama")
    with Engine(backends=("llama",)) as llama, Engine(backends=("openvino",)) as openvino:
        a = llama.open_session(_request("llama", tiny))
        b = openvino.open_session(_request("openvino", tiny))
        for prompt in PROMPTS:
            assert b.model.tokenize(prompt, True) == a.model.tokenize(prompt, True)
            assert _greedy(b, prompt) == _greedy(a, prompt)


@pytest.fixture(scope="module")
def warm_session(tiny: str) -> object:
    engine = Engine(backends=("openvino",))
    session = engine.open_session(_request("openvino", tiny))
    yield session
    engine.shutdown()


@settings(max_examples=8, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(
    cut=st.floats(min_value=0.05, max_value=0.95),
    insert=st.text(alphabet="xyz()\n _", min_size=1, max_size=20),
    suffix=st.text(alphabet="fix it\n", min_size=1, max_size=20),
)
def test_warm_greedy_decoding_equals_cold_after_prefix_edits(
    warm_session: object, tiny: str, cut: float, insert: str, suffix: str
) -> None:
    model = warm_session.model  # type: ignore[attr-defined]
    text = BASE[: int(len(BASE) * cut)] + insert + BASE[int(len(BASE) * cut) :]
    context = warm_session.slot.context  # type: ignore[attr-defined]
    before = list(context.tokens) if context is not None else []
    warm = _greedy(warm_session, text, suffix, n=12)
    status = warm_session.explain_context().last_prefix  # type: ignore[attr-defined]
    assert status.reused_tokens == common_prefix_len(before, model.tokenize(text, True))
    with Engine(backends=("openvino",)) as cold_engine:
        cold = cold_engine.open_session(_request("openvino", tiny))
        assert _greedy(cold, text, suffix, n=12) == warm


def test_long_text_is_tokenized_exactly_despite_the_tokenizer_limit(tiny: str) -> None:
    pytest.importorskip("modeld.backends.llama")
    text = Path(__file__).read_text() * 3  # well over 8192 tokens
    with Engine(backends=("llama",)) as llama, Engine(backends=("openvino",)) as openvino:
        expected = llama.open_session(_request("llama", tiny)).model.tokenize(text, True)
        got = openvino.open_session(_request("openvino", tiny)).model.tokenize(text, True)
    assert len(expected) > ov_runtime.TOKENIZER_LIMIT
    assert got == expected


def test_a_long_run_without_line_breaks_is_refused_not_truncated(tiny: str) -> None:
    with Engine(backends=("openvino",)) as engine:
        session = engine.open_session(_request("openvino", tiny, num_ctx=8192))
        with pytest.raises(UnsupportedError, match="tokenizer limit"):
            session.ensure_prefix(PrefixInput(text="\u00e9" * 9000))


@pytest.mark.parametrize(
    ("text", "limit"),
    [("short\n", 100), ("line one\nline two\nline three\n" * 50, 64), ("x" * 500, 64), ("a\n1\n" * 100, 16)],
)
def test_split_for_tokenizer_only_cuts_before_a_letter_after_a_newline(text: str, limit: int) -> None:
    pieces = ov_runtime.split_for_tokenizer(text, limit)
    assert "".join(pieces) == text
    for a, b in itertools.pairwise(pieces):
        assert a.endswith("\n")
        assert b[0].isalpha()


def test_ir_directory_serves_the_same_model(tiny: str) -> None:
    ir = str(testmodels.ensure_ir(testmodels.TINY))
    with Engine(backends=("openvino",)) as engine:
        info = engine.describe(_request("openvino", ir))
        spec = testmodels.TINY
        assert info.model_max_context == spec.context_length
        assert info.kv_bytes_per_token == 2 * spec.layers * spec.kv_heads * (spec.hidden // spec.heads) * 2
        assert info.chat_template
        ir_session = engine.open_session(_request("openvino", ir))
        gguf_session = engine.open_session(_request("openvino", tiny, disable_bos=not info.add_bos))
        assert _greedy(ir_session, BASE, "fix\n") == _greedy(gguf_session, BASE, "fix\n")
        again = ir_session.ensure_prefix(PrefixInput(text=BASE))
        assert again.reuse.outcome == "warm"


def test_what_openvino_cannot_do_is_refused_clearly(tiny: str) -> None:
    recurrent = str(testmodels.ensure_model(testmodels.RECURRENT))
    with Engine(backends=("openvino",)) as engine:
        for request, field in (
            (_request("openvino", recurrent), "path"),  # OpenVINO would crash on it
            (_request("openvino", tiny, kv_cache_type="q8_0"), "config.kv_cache_type"),
            (_request("openvino", tiny, flash_attn=True), "config.flash_attn"),
            (_request("openvino", tiny, num_gpu_layers=10), "config.num_gpu_layers"),
            (_request("openvino", tiny, tensor_split=(0.5, 0.5)), "config.tensor_split"),
        ):
            with pytest.raises(UnsupportedError) as err:
                engine.open_session(request)
            assert err.value.field == field
        assert engine.describe(_request("openvino", tiny)).device == "cpu"


def test_a_gguf_without_the_gguf_extension_loads(tiny: str, tmp_path: Path) -> None:
    path = tmp_path / "model.bin"
    path.write_bytes(Path(tiny).read_bytes())
    with Engine(backends=("openvino",)) as engine:
        session = engine.open_session(_request("openvino", str(path)))
        assert session.ensure_prefix(PrefixInput(text=BASE)).prefix_tokens > 0


@pytest.mark.slow
def test_the_daemon_answers_while_openvino_computes() -> None:
    """LLMPipeline.generate releases the GIL: Status answers while a long prefill is running
    (about 800 tokens, several seconds here: one that held the GIL would answer at most once;
    one that releases it answers every ~50 ms, and the check needs 20, about 1 s of it)."""
    realistic = str(testmodels.ensure_model(testmodels.REALISTIC))
    with wire_harness(replace(openvino_model(), path=realistic)) as h:
        s = h.service.open_session(h.request(num_ctx=8192))
        assert status_answers_during(h, lambda: s.ensure_prefix(PrefixInput(text=BASE * 10))) >= 20
        s.close()
