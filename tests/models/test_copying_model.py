"""COPYING: a generated model with constructed weights whose greedy continuation copies earlier
context (an n-gram induction circuit, ``modeld/testmodels/_copying.py``). Its copy rate is
measured on a rewritten held-out file (``modeld.testmodels.measure``) in llama.cpp and OpenVINO
GenAI. See ``blueprints/0008-test-models.md``.

The engine tests in the default run use SMALL: the same construction at hidden 768, 11 layers
(the circuit only), TINY's 4096-token vocabulary and f16 (~80 MB, generated in ~1 s). COPYING
itself (412 MB) is exercised by the ``slow`` tests.
"""

from __future__ import annotations

import hashlib
import math
from collections.abc import Iterator
from dataclasses import replace
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from gguf import GGMLQuantizationType, GGUFReader

from modeld.testmodels import COPYING, REALISTIC, TINY, ModelSpec, ensure_model
from modeld.testmodels import _copying as circuit
from modeld.testmodels._tokenizer import build_vocabulary
from modeld.testmodels.measure import (
    LlamaDriver,
    RewriteCase,
    free_running_cuts,
    free_running_rate,
    held_out_lines,
    rewrite_case,
    rewritten,
    teacher_forced_rate,
)

SMALL = replace(
    COPYING,
    name="copying-small",
    hidden=768,
    heads=6,
    layers=circuit.CIRCUIT_LAYERS,
    ff=1024,
    vocab_size=TINY.vocab_size,
    context_length=8192,
    dtype="f16",
)
SMALL_LINES = 36  # held-out lines in SMALL's rewrite: ~1400 tokens in all
COPYING_LINES = 64  # ~2300 tokens

# Measured (blueprint 0008) at these sizes: teacher-forced 0.9968 (SMALL) and 0.9955 (COPYING),
# free-running 1.0 on both engines; TINY and REALISTIC score 0.0 on both. The thresholds leave
# room for another Python's textwrap.py and fail if the circuit breaks.
MIN_TEACHER_FORCED = 0.95
MIN_FREE_RUNNING = 0.9
N_NEW = 32


def _param_count(spec: ModelSpec) -> int:
    h, hd = spec.hidden, spec.head_dim
    per_layer = h * h * 2 + 2 * h * spec.kv_heads * hd + 3 * h * spec.ff + 2 * h
    return spec.layers * per_layer + spec.vocab_size * h + h


# --- the spec and the construction (no engine) -------------------------------------------------


def test_copying_has_realistic_size_and_per_token_cost() -> None:
    same = ("hidden", "layers", "ff", "vocab_size", "context_length", "dtype", "tied_embeddings")
    assert {f: getattr(COPYING, f) for f in same} == {f: getattr(REALISTIC, f) for f in same}
    # 7 heads of 128 sharing one KV head instead of 14 of 64 sharing two: the same matrices,
    # the same KV bytes per token and the same attention FLOPs (heads x head_dim).
    assert (COPYING.heads, COPYING.kv_heads, COPYING.head_dim) == (7, 1, 128)
    assert COPYING.heads * COPYING.head_dim == REALISTIC.heads * REALISTIC.head_dim
    assert COPYING.kv_heads * COPYING.head_dim == REALISTIC.kv_heads * REALISTIC.head_dim
    assert COPYING.heads // COPYING.kv_heads == REALISTIC.heads // REALISTIC.kv_heads
    assert _param_count(COPYING) == _param_count(REALISTIC)
    assert (COPYING.weights, COPYING.rope_freq_base) == ("copying", 1e38)
    assert COPYING.file_name.startswith("copying-")


@pytest.mark.parametrize(
    "change",
    [
        {"heads": 14},  # head dimension 64
        {"kv_heads": 7},
        {"rope_freq_base": 1e6},  # the code pairs would rotate
        {"layers": circuit.CIRCUIT_LAYERS - 1},
        {"ff": 512},
        {"hidden": 640, "heads": 5},  # too few residual dimensions for the slots
        {"tied_embeddings": False},
        {"context_length": 65536},  # the position heads are solved up to 32768
    ],
)
def test_a_spec_that_cannot_carry_the_circuit_is_rejected(change: dict[str, Any]) -> None:
    with pytest.raises(ValueError, match=r"invalid ModelSpec.*copying weights need"):
        replace(COPYING, **change)


@pytest.mark.parametrize("offset", [1, 2, 4, 8, 16])
def test_a_previous_token_head_peaks_at_its_offset_over_the_whole_context(offset: int) -> None:
    """The position weights (constants in _copying) against every distance up to 32768."""
    weights = np.array(circuit._POS_WEIGHTS)
    thetas = np.array([circuit._theta(p) for p in range(len(weights))])
    distances = np.arange(COPYING.context_length + 1)
    scores = np.cos(np.outer(distances - offset, thetas)) @ weights
    assert math.isclose(weights.sum(), 1.0) and scores[offset] == pytest.approx(1.0)
    others = np.delete(scores, offset)
    # x 200 (the peak score) = a margin of >= 29 logits over any other position.
    assert scores[offset] - others.max() >= 0.145
    # the code pairs barely rotate over the context (the induction match is rotation-free)
    code_pairs = np.array([circuit._theta(p) for p in range(circuit._POS_PAIRS, circuit._SINK_PAIR)])
    assert code_pairs.max() * COPYING.context_length < 0.6
    assert circuit._theta(circuit._SINK_PAIR) * COPYING.context_length < 1e-30


def test_token_codes_are_signs_and_the_hash_permutations_have_no_fixed_point() -> None:
    codes = circuit.token_codes(0, 4096)
    assert codes.shape == (4096, circuit.CODE_DIM)
    assert set(np.unique(codes)) == {-1.0, 1.0}
    overlap = codes @ codes.T / circuit.CODE_DIM
    np.fill_diagonal(overlap, 0)
    assert np.abs(overlap).max() < 0.6  # near-orthogonal: the copy decodes to one token
    for name in ("h2", "h4", "h8", "h16", "h32", "fallback"):
        perm = circuit._derangement(0, f"copying.perm.{name}", circuit.CODE_DIM)
        assert sorted(perm) == list(range(circuit.CODE_DIM))
        assert not np.any(perm == np.arange(circuit.CODE_DIM))


def test_every_ffn_fits_and_the_schedule_frees_what_it_erases() -> None:
    occupied = circuit._occupied()
    assert len(occupied) == circuit.CIRCUIT_LAYERS
    assert occupied[0] == (("E",), ("A", "E"))
    widest = max(len(slots) for pair in occupied for slots in pair)
    assert circuit._SLOT0 + (widest + 1) * circuit.CODE_DIM <= COPYING.hidden  # + the output slot E
    assert circuit._FFN_UNITS_NEEDED <= SMALL.ff <= COPYING.ff


def test_rewrite_changes_a_few_lines_and_keeps_the_rest() -> None:
    lines = [f"line {i} with text\n" for i in range(96)]
    out = rewritten(lines)
    assert out != lines
    kept = set(out) & set(lines)
    assert len(kept) >= 90
    assert "# (edited here)\n" in out
    assert "line 36 with content\n" in out  # renamed
    assert "line 60 with text\n" not in out  # deleted


# --- SMALL in llama.cpp and OpenVINO GenAI ----------------------------------------------------


@pytest.fixture(scope="module")
def small_path(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return ensure_model(SMALL, tmp_path_factory.mktemp("copying"))


@pytest.fixture(scope="module")
def small(small_path: Path) -> Iterator[LlamaDriver]:
    pytest.importorskip("llama_cpp")
    driver = LlamaDriver(small_path, n_ctx=4096, threads=1)
    yield driver
    driver.close()


@pytest.fixture(scope="module")
def small_case(small: LlamaDriver) -> RewriteCase:
    return rewrite_case(small.tokenize, small.bos_id, SMALL_LINES)


def test_small_file_has_the_constructed_metadata(small_path: Path) -> None:
    reader = GGUFReader(small_path)
    assert reader.fields["llama.rope.freq_base"].contents() == pytest.approx(1e38)
    assert reader.fields["llama.attention.head_count_kv"].contents() == 1
    assert "induction circuit" in reader.fields["general.description"].contents()
    vocab = build_vocabulary(TINY.vocab_size, TINY.seed)
    assert reader.fields["tokenizer.ggml.tokens"].contents() == list(vocab.tokens)
    assert {t.tensor_type for t in reader.tensors if len(t.shape) == 2} == {GGMLQuantizationType.F16}


@pytest.mark.llama
def test_llama_cpp_copies_a_rewritten_file_teacher_forced(
    small: LlamaDriver, small_case: RewriteCase
) -> None:
    assert len(small_case.positions) > 500
    rate = teacher_forced_rate(small_case, small.argmax_all(small_case.ids))
    assert rate >= MIN_TEACHER_FORCED


@pytest.mark.llama
def test_llama_cpp_greedy_generation_continues_the_copy(small: LlamaDriver, small_case: RewriteCase) -> None:
    rate, runs = free_running_rate(small_case, small.greedy, N_NEW, count=4)
    assert len(runs) == 4
    assert rate >= MIN_FREE_RUNNING, runs


@pytest.mark.llama
def test_a_chat_rewrite_copies_the_whole_file_and_then_ends_the_turn(small: LlamaDriver) -> None:
    """The prompt ends with the assistant's opening fence: the model copies the user's file,
    its closing fence, and then the <|im_end|> that followed it (EOS)."""
    case = rewrite_case(small.tokenize, small.bos_id, 8)
    prompt = case.ids[: case.answer_start]
    expected = small.tokenize("".join(held_out_lines(8)) + "```")
    out = small.greedy(prompt, len(expected) + 8)
    eos = small.tokenize("<|im_end|>")
    assert out[: len(expected) + 1] == expected + eos


@pytest.mark.llama
def test_fresh_text_gets_a_deterministic_fallback_without_control_tokens(small: LlamaDriver) -> None:
    for prompt in ("def fibonacci(n):\n    ", "The quick brown fox jumps over the lazy dog."):
        ids = [small.bos_id, *small.tokenize(prompt)]
        first = small.greedy(ids, 32)
        small.reset()
        assert small.greedy(ids, 32) == first
        assert len(set(first)) >= 28  # pseudo-random tokens, not a loop
        assert not set(first) & {TINY.vocab_size - 3, TINY.vocab_size - 2, TINY.vocab_size - 1}


@pytest.mark.openvino
@pytest.mark.llama
def test_openvino_loads_the_small_model_and_copies(small_path: Path, small_case: RewriteCase) -> None:
    _assert_openvino_copies(small_path, small_case)


def _assert_openvino_copies(path: Path, case: RewriteCase) -> None:
    """Default precision (bf16 compute and a u8 KV cache on a CPU with AMX): what users get."""
    ov_genai = pytest.importorskip("openvino_genai")
    import openvino as ov

    pipeline = ov_genai.LLMPipeline(str(path), "CPU")
    config = ov_genai.GenerationConfig()
    config.max_new_tokens = N_NEW
    config.do_sample = False

    def generate(ids: list[int], n_new: int) -> list[int]:
        assert n_new == N_NEW
        result = pipeline.generate(ov.Tensor(np.array([ids], dtype=np.int64)), config)
        return [int(t) for t in result.tokens[0]]

    rate, runs = free_running_rate(case, generate, N_NEW, count=3)
    assert len(runs) == 3
    assert rate >= MIN_FREE_RUNNING, runs


# --- COPYING itself ------------------------------------------------------------------------


@pytest.fixture(scope="module")
def copying_path() -> Path:
    return ensure_model(COPYING)  # the user cache: benchmarks reuse it


@pytest.mark.slow
def test_copying_file_is_realistic_sized_q8_0_and_byte_identical_to_the_pinned_golden(
    copying_path: Path,
) -> None:
    assert 380e6 < copying_path.stat().st_size < 450e6
    reader = GGUFReader(copying_path)
    assert reader.fields["llama.block_count"].contents() == 24
    assert reader.fields["llama.attention.head_count"].contents() == 7
    assert {t.tensor_type for t in reader.tensors if len(t.shape) == 2} == {GGMLQuantizationType.Q8_0}
    digest = hashlib.sha256()
    with copying_path.open("rb") as f:
        while chunk := f.read(1 << 24):
            digest.update(chunk)
    assert digest.hexdigest() == COPYING_SHA256


@pytest.mark.slow
@pytest.mark.llama
@pytest.mark.timeout(900)  # ~25 s on an idle 2-core box; 230 s seen with the cores shared 5 ways
def test_copying_copies_a_rewritten_file_in_llama_cpp(copying_path: Path) -> None:
    driver = LlamaDriver(copying_path, n_ctx=8192, threads=2)
    try:
        case = rewrite_case(driver.tokenize, driver.bos_id, COPYING_LINES)
        assert teacher_forced_rate(case, driver.argmax_all(case.ids)) >= MIN_TEACHER_FORCED
        rate, runs = free_running_rate(case, driver.greedy, N_NEW, count=3)
        assert rate >= MIN_FREE_RUNNING, runs
    finally:
        driver.close()


@pytest.mark.slow
@pytest.mark.llama
@pytest.mark.openvino
def test_openvino_loads_copying_and_copies(copying_path: Path) -> None:
    llama_cpp = pytest.importorskip("llama_cpp")
    vocab = llama_cpp.Llama(str(copying_path), vocab_only=True, verbose=False)
    try:
        case = rewrite_case(
            lambda text: vocab.tokenize(text.encode(), add_bos=False, special=True),
            vocab.token_bos(),
            COPYING_LINES,
        )
    finally:
        vocab.close()
    assert free_running_cuts(case, N_NEW, 3)
    _assert_openvino_copies(copying_path, case)


# sha256 of COPYING's file, pinned like TINY's (tests/models/test_testmodels.py): a change here on another machine
# or with other NumPy, gguf or tokenizers versions is a determinism bug; an intended change of
# the construction bumps GENERATOR_VERSION and updates it.
COPYING_SHA256 = "2bdacdfa9330c9a3294cecf0d9f93d87309c05c0d67efd75f3d7e72857bbf001"


def test_the_construction_version_renames_copying_files_only(monkeypatch: pytest.MonkeyPatch) -> None:
    before = (COPYING.digest(), TINY.digest(), REALISTIC.digest())
    monkeypatch.setattr(circuit, "COPYING_VERSION", circuit.COPYING_VERSION + 1)
    assert COPYING.digest() != before[0]
    assert (TINY.digest(), REALISTIC.digest()) == before[1:]
