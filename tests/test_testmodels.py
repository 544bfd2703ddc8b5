"""The generated test models: shape, metadata, tokenizer, determinism, caching, and that both
real engines (llama.cpp and OpenVINO GenAI) load TINY and agree on its greedy output.

Everything here runs on TINY in a few seconds; REALISTIC (a 412 MB file) is only touched by the
``slow`` test at the end. See ``blueprints/test-models.md``.
"""

from __future__ import annotations

import hashlib
import json
import os
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import fields, replace
from pathlib import Path
from typing import Any

import jinja2
import numpy as np
import pytest
from gguf import GGMLQuantizationType, GGUFReader

from modeld import testmodels
from modeld.testmodels import (
    GENERATOR_VERSION,
    REALISTIC,
    TINY,
    ModelSpec,
    default_cache_dir,
    ensure_model,
)
from modeld.testmodels.__main__ import main as cli_main
from modeld.testmodels._corpus import build_corpus
from modeld.testmodels._template import CHATML_TOOLS_TEMPLATE
from modeld.testmodels._tokenizer import CONTROL_TOKENS, build_vocabulary, train_merges

REPO_ROOT = Path(__file__).resolve().parents[1]

# sha256 of TINY's file. It pins cross-machine determinism: if this changes on another machine,
# Python, NumPy, gguf or tokenizers version, the generator is not deterministic there (fix it);
# if it changes because the generator changed on purpose, bump GENERATOR_VERSION and update it.
TINY_SHA256 = "6f7f8e2f5cfdf9357dba1d427469fee8ead632aa91367e4e570899f53795988e"

BOS_ID, IM_START_ID, EOS_ID = 4093, 4094, 4095  # control tokens are the last three ids

ROUND_TRIP_TEXTS = [
    "def add(a: int, b: int) -> int:\n    return a + b\n",
    "const f = async (x) => { await g(`${x}`); };\n",
    "Déjà vu: naïve café, Ærøskøbing, Straße, ¿qué tal?",
    "你好，世界！日本語のテキスト。한국어 문장.",  # noqa: RUF001
    "emoji 🎉🚀 family 👨\u200d👩\u200d👧 flag 🇫🇷 thumbs 👍🏽",
    "\tcol1\tcol2\n\t\tnested\ttabs\n",
    "line1\nline2\r\nline3\n\n\n",
    "  mixed \t whitespace  \n\t  \n   ",
    "<|im_start|> is plain text when special=False",
    "\x00\x01 control bytes \x7f and a no-break\u00a0space",
    " ",
]

PROMPT_A = "def fibonacci(n):\n    "
PROMPT_B = "The quick brown fox jumps over the lazy dog."
N_GREEDY = 24


# --- fixtures --------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def tiny_path(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return ensure_model(TINY, tmp_path_factory.mktemp("models"))


@pytest.fixture(scope="module")
def llm(tiny_path: Path) -> Iterator[Any]:
    llama_cpp = pytest.importorskip("llama_cpp")
    model = llama_cpp.Llama(str(tiny_path), n_ctx=512, n_batch=512, logits_all=True, verbose=False)
    yield model
    model.close()


def greedy(llm: Any, tokens: list[int], n: int = N_GREEDY) -> tuple[list[int], list[float]]:
    """Greedy tokens after ``tokens`` and the top-1 minus top-2 logit margin of each step."""
    llm.reset()
    llm.eval(tokens)
    out: list[int] = []
    margins: list[float] = []
    for _ in range(n):
        logits = llm.scores[llm.n_tokens - 1]
        second, first = np.partition(logits, -2)[-2:]
        margins.append(float(first - second))
        out.append(int(np.argmax(logits)))
        llm.eval([out[-1]])
    return out, margins


def field(reader: GGUFReader, key: str) -> Any:
    return reader.fields[key].contents()


# --- specs and API ---------------------------------------------------------------------------


def test_public_api_is_pinned() -> None:
    assert sorted(testmodels.__all__) == sorted(
        [
            "GENERATOR_VERSION",
            "REALISTIC",
            "TINY",
            "ModelSpec",
            "default_cache_dir",
            "ensure_model",
        ]
    )


def test_tiny_is_a_small_gqa_f16_model_with_a_long_trained_context() -> None:
    assert TINY.kv_heads < TINY.heads
    assert TINY.heads % TINY.kv_heads == 0
    assert TINY.dtype == "f16"  # OpenVINO GenAI refuses f32 matrices
    assert TINY.context_length >= 4096
    assert 2048 <= TINY.vocab_size <= 4096
    assert TINY.hidden <= 128
    assert TINY.layers <= 4


def test_realistic_has_the_shape_of_a_half_billion_parameter_gqa_model() -> None:
    assert (
        REALISTIC.hidden,
        REALISTIC.layers,
        REALISTIC.heads,
        REALISTIC.kv_heads,
    ) == (
        896,
        24,
        14,
        2,
    )
    assert (REALISTIC.ff, REALISTIC.vocab_size, REALISTIC.dtype) == (
        4864,
        32000,
        "q8_0",
    )
    assert REALISTIC.tied_embeddings


@pytest.mark.parametrize(
    "change",
    [
        {"heads": 3},  # 128 is not a multiple of 3
        {"kv_heads": 3},  # 4 heads are not a multiple of 3 KV heads
        {"dtype": "f32"},
        {"vocab_size": 100},
        {"seed": -1},
        {"name": "a/b"},
    ],
)
def test_inconsistent_specs_are_rejected(change: dict[str, Any]) -> None:
    with pytest.raises(ValueError, match="invalid ModelSpec"):
        replace(TINY, **change)


def test_file_name_is_spec_name_plus_digest_of_spec_and_generator_version(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    assert TINY.file_name == f"tiny-{TINY.digest()}.gguf"
    assert replace(TINY, seed=1).file_name != TINY.file_name
    assert replace(TINY, context_length=4096).file_name != TINY.file_name
    before = TINY.digest()
    monkeypatch.setattr("modeld.testmodels._spec.GENERATOR_VERSION", GENERATOR_VERSION + 1)
    assert TINY.digest() != before


# --- the file --------------------------------------------------------------------------------


def test_metadata_read_back_matches_the_spec(tiny_path: Path) -> None:
    reader = GGUFReader(tiny_path)
    assert field(reader, "general.architecture") == "llama"
    assert field(reader, "general.file_type") == 1  # MOSTLY_F16
    assert field(reader, "llama.context_length") == TINY.context_length
    assert field(reader, "llama.embedding_length") == TINY.hidden
    assert field(reader, "llama.block_count") == TINY.layers
    assert field(reader, "llama.feed_forward_length") == TINY.ff
    assert field(reader, "llama.attention.head_count") == TINY.heads
    assert field(reader, "llama.attention.head_count_kv") == TINY.kv_heads
    assert field(reader, "llama.rope.dimension_count") == TINY.hidden // TINY.heads
    assert field(reader, "llama.vocab_size") == TINY.vocab_size
    assert field(reader, "modeld.testmodels.spec_digest") == TINY.digest()

    assert field(reader, "tokenizer.ggml.model") == "gpt2"
    assert field(reader, "tokenizer.ggml.pre") == "qwen2"
    tokens = field(reader, "tokenizer.ggml.tokens")
    types = field(reader, "tokenizer.ggml.token_type")
    assert len(tokens) == len(types) == TINY.vocab_size
    assert tokens[-3:] == list(CONTROL_TOKENS)
    assert types[-3:] == [3, 3, 3]  # CONTROL
    assert set(types[:-3]) == {1}  # NORMAL: TINY needs no filler tokens
    assert len(field(reader, "tokenizer.ggml.merges")) == TINY.vocab_size - 256 - 3
    assert field(reader, "tokenizer.ggml.bos_token_id") == BOS_ID
    assert field(reader, "tokenizer.ggml.padding_token_id") == BOS_ID
    assert field(reader, "tokenizer.ggml.eos_token_id") == EOS_ID
    assert field(reader, "tokenizer.ggml.add_bos_token") is True
    assert field(reader, "tokenizer.ggml.add_eos_token") is False
    assert field(reader, "tokenizer.chat_template") == CHATML_TOOLS_TEMPLATE


def test_tensors_are_f16_matrices_f32_norms_and_an_untied_output(
    tiny_path: Path,
) -> None:
    tensors = {t.name: t for t in GGUFReader(tiny_path).tensors}
    per_layer = ["attn_norm", "attn_q", "attn_k", "attn_v", "attn_output"]
    per_layer += ["ffn_norm", "ffn_gate", "ffn_up", "ffn_down"]
    expected = {"token_embd.weight", "output_norm.weight", "output.weight"}
    expected |= {f"blk.{i}.{n}.weight" for i in range(TINY.layers) for n in per_layer}
    assert set(tensors) == expected
    for name, t in tensors.items():
        norm = name.endswith("norm.weight")
        assert t.tensor_type == (GGMLQuantizationType.F32 if norm else GGMLQuantizationType.F16)
    kv_dim = TINY.kv_heads * TINY.hidden // TINY.heads
    # GGUF lists dimensions innermost first: (in, out).
    assert list(tensors["blk.0.attn_k.weight"].shape) == [TINY.hidden, kv_dim]
    assert list(tensors["blk.0.ffn_down.weight"].shape) == [TINY.ff, TINY.hidden]
    assert list(tensors["token_embd.weight"].shape) == [TINY.hidden, TINY.vocab_size]


def test_tiny_file_is_byte_identical_to_the_pinned_golden(tiny_path: Path) -> None:
    assert hashlib.sha256(tiny_path.read_bytes()).hexdigest() == TINY_SHA256


# --- determinism and caching -----------------------------------------------------------------


def test_bpe_training_is_deterministic_for_the_same_corpus() -> None:
    corpus = build_corpus(seed=7, n_chars=100_000)
    assert build_corpus(seed=7, n_chars=100_000) == corpus
    assert train_merges(corpus, 500) == train_merges(corpus, 500)


def test_vocabulary_starts_with_the_256_bytes_in_byte_order() -> None:
    vocab = build_vocabulary(TINY.vocab_size, TINY.seed)
    assert vocab.tokens[ord("A")] == "A"
    assert vocab.tokens[ord(" ")] == "Ġ"
    assert vocab.tokens[ord("\n")] == "Ċ"
    assert (vocab.bos_id, vocab.im_start_id, vocab.eos_id) == (
        BOS_ID,
        IM_START_ID,
        EOS_ID,
    )


def test_generation_in_another_process_with_other_hash_seed_and_one_thread_is_identical(
    tiny_path: Path, tmp_path: Path
) -> None:
    env = {**os.environ, "PYTHONHASHSEED": "12345", "RAYON_NUM_THREADS": "1"}
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO_ROOT), env.get("PYTHONPATH")]))
    out = subprocess.run(
        [
            sys.executable,
            "-m",
            "modeld.testmodels",
            "tiny",
            "--cache-dir",
            str(tmp_path),
        ],
        env=env,
        check=True,
        capture_output=True,
        text=True,
    )
    other = Path(out.stdout.strip())
    assert other == tmp_path / TINY.file_name
    assert other.read_bytes() == tiny_path.read_bytes()


def test_second_ensure_model_returns_the_cached_file_without_regenerating(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    first = ensure_model(TINY, tmp_path)
    mtime = first.stat().st_mtime_ns

    def fail(*_: object) -> None:
        raise AssertionError("regenerated a cached model")

    monkeypatch.setattr(testmodels, "write_gguf", fail)
    assert ensure_model(TINY, tmp_path) == first
    assert first.stat().st_mtime_ns == mtime


def test_two_cache_dirs_get_byte_identical_files_and_no_temporary_files(
    tiny_path: Path, tmp_path: Path
) -> None:
    other = ensure_model(TINY, tmp_path)
    assert other.read_bytes() == tiny_path.read_bytes()
    assert sorted(p.name for p in tmp_path.iterdir()) == [
        TINY.file_name,
        f"{TINY.file_name}.lock",
    ]


def test_concurrent_generation_in_two_processes_yields_one_complete_file(
    tiny_path: Path, tmp_path: Path
) -> None:
    env = {**os.environ}
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO_ROOT), env.get("PYTHONPATH")]))
    cmd = [
        sys.executable,
        "-m",
        "modeld.testmodels",
        "tiny",
        "--cache-dir",
        str(tmp_path),
    ]
    procs = [subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, text=True) for _ in range(2)]
    outputs = [p.communicate(timeout=120)[0].strip() for p in procs]
    assert [p.returncode for p in procs] == [0, 0]
    assert outputs == [str(tmp_path / TINY.file_name)] * 2
    assert Path(outputs[0]).read_bytes() == tiny_path.read_bytes()
    assert not [p for p in tmp_path.iterdir() if p.name.endswith(".tmp")]


def test_default_cache_dir_honours_the_environment(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("MODELD_MODEL_CACHE", str(tmp_path / "cache"))
    assert default_cache_dir() == tmp_path / "cache"
    monkeypatch.delenv("MODELD_MODEL_CACHE")
    assert default_cache_dir().parts[-2:] == ("modeld", "models")


def test_cli_prints_the_path_of_the_generated_file(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    assert cli_main(["tiny", "--cache-dir", str(tmp_path), "--seed", "3"]) == 0
    printed = Path(capsys.readouterr().out.strip())
    assert printed == tmp_path / replace(TINY, seed=3).file_name
    assert printed.is_file()


# --- chat template ---------------------------------------------------------------------------

TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "read_file",
            "description": "Read a file",
            "parameters": {
                "type": "object",
                "properties": {"path": {"type": "string"}},
                "required": ["path"],
            },
        },
    }
]
CONVERSATION: list[dict[str, Any]] = [
    {"role": "system", "content": "You are a coding agent."},
    {"role": "user", "content": "Open main.py"},
    {
        "role": "assistant",
        "content": "",
        "tool_calls": [{"function": {"name": "read_file", "arguments": {"path": "main.py"}}}],
    },
    {"role": "tool", "content": "print('hi')"},
    {"role": "user", "content": "Thanks"},
]


def test_chat_template_renders_chatml_with_a_tools_block() -> None:
    template = jinja2.Environment().from_string(CHATML_TOOLS_TEMPLATE)
    text = template.render(messages=CONVERSATION, tools=TOOLS, add_generation_prompt=True)
    assert text.startswith("<|im_start|>system\nYou are a coding agent.\n\n# Tools\n")
    assert "<tools>\n" + json.dumps(TOOLS[0], sort_keys=True) + "\n</tools>" in text
    assert (
        '<|im_start|>assistant\n<tool_call>\n{"name": "read_file", "arguments": '
        '{"path": "main.py"}}\n</tool_call><|im_end|>\n'
    ) in text
    assert "<|im_start|>user\n<tool_response>\nprint('hi')\n</tool_response><|im_end|>\n" in text
    assert text.endswith("<|im_start|>user\nThanks<|im_end|>\n<|im_start|>assistant\n")

    plain = template.render(messages=[{"role": "user", "content": "hi"}])
    assert plain == (
        "<|im_start|>system\nYou are a helpful assistant.<|im_end|>\n<|im_start|>user\nhi<|im_end|>\n"
    )


@pytest.mark.llama
def test_tool_definitions_given_as_json_strings_render_verbatim_in_every_renderer() -> None:
    llama_chat_format = pytest.importorskip("llama_cpp.llama_chat_format")
    as_strings = [json.dumps(t) for t in TOOLS]
    plain = jinja2.Environment().from_string(CHATML_TOOLS_TEMPLATE)
    formatter = llama_chat_format.Jinja2ChatFormatter(
        template=CHATML_TOOLS_TEMPLATE,
        eos_token="<|im_end|>",
        bos_token="<|endoftext|>",
    )
    rendered = formatter(messages=CONVERSATION, tools=as_strings).prompt
    assert rendered == plain.render(messages=CONVERSATION, tools=as_strings, add_generation_prompt=True)
    assert as_strings[0] in rendered


# --- llama.cpp -------------------------------------------------------------------------------


@pytest.mark.llama
@pytest.mark.parametrize("text", ROUND_TRIP_TEXTS)
def test_llama_cpp_tokenization_round_trips_exactly(llm: Any, text: str) -> None:
    data = text.encode()
    tokens = llm.tokenize(data, add_bos=False, special=False)
    assert all(t < BOS_ID for t in tokens)
    assert llm.detokenize(tokens, special=False) == data


@pytest.mark.llama
def test_llama_cpp_bos_handling_follows_add_bos_token(llm: Any) -> None:
    assert (llm.token_bos(), llm.token_eos()) == (BOS_ID, EOS_ID)
    assert llm.metadata["tokenizer.ggml.add_bos_token"] == "true"
    without = llm.tokenize(PROMPT_A.encode(), add_bos=False)
    assert llm.tokenize(PROMPT_A.encode(), add_bos=True) == [BOS_ID, *without]


@pytest.mark.llama
def test_llama_cpp_control_tokens_are_single_tokens_only_when_special(llm: Any) -> None:
    turn = b"<|im_start|>user\nhi<|im_end|>"
    special = llm.tokenize(turn, add_bos=False, special=True)
    assert special[0] == IM_START_ID
    assert special[-1] == EOS_ID
    assert llm.detokenize(special, special=True) == turn
    assert IM_START_ID not in llm.tokenize(turn, add_bos=False, special=False)


@pytest.mark.llama
def test_llama_cpp_greedy_decoding_is_context_dependent_and_not_degenerate(
    llm: Any,
) -> None:
    out_a, margins_a = greedy(llm, llm.tokenize(PROMPT_A.encode()))
    out_b, margins_b = greedy(llm, llm.tokenize(PROMPT_B.encode()))
    assert out_a != out_b
    for out in (out_a, out_b):
        assert len(set(out)) >= N_GREEDY // 2, out
        assert max(out) < BOS_ID  # control tokens have tiny output rows: never greedy
    # Observed: median margin ~1.1 logits (logit std ~6). Near-ties exist (as in any random
    # model) but must stay rare; see blueprints/test-models.md.
    margins = np.array(margins_a + margins_b)
    assert np.median(margins) > 0.5
    assert np.mean(margins < 0.01) < 0.1


# --- OpenVINO GenAI --------------------------------------------------------------------------


@pytest.fixture(scope="module")
def ov_pipeline(tiny_path: Path) -> Any:
    ov_genai = pytest.importorskip("openvino_genai")
    # f32: on CPUs with bf16 support OpenVINO computes in bf16 by default, whose rounding flips
    # greedy near-ties of a random model within 24 tokens (seen on 4 of 9 prompts).
    return ov_genai.LLMPipeline(str(tiny_path), "CPU", INFERENCE_PRECISION_HINT="f32")


def _ov_config(max_new_tokens: int) -> Any:
    import openvino_genai as ov_genai

    config = ov_genai.GenerationConfig()
    config.max_new_tokens = max_new_tokens
    config.do_sample = False
    return config


@pytest.mark.llama
@pytest.mark.openvino
@pytest.mark.parametrize("prompt", [PROMPT_A, PROMPT_B, ROUND_TRIP_TEXTS[4]])
def test_openvino_greedy_tokens_equal_llama_cpp_for_the_same_input_ids(
    llm: Any, ov_pipeline: Any, prompt: str
) -> None:
    import openvino as ov

    ids = llm.tokenize(prompt.encode(), add_bos=True)
    expected, _ = greedy(llm, ids)
    result = ov_pipeline.generate(ov.Tensor(np.array([ids], dtype=np.int64)), _ov_config(N_GREEDY))
    assert [int(t) for t in result.tokens[0]] == expected


@pytest.mark.llama
@pytest.mark.openvino
def test_openvino_tokenizer_matches_llama_cpp_but_never_adds_bos(llm: Any, ov_pipeline: Any) -> None:
    tokenizer = ov_pipeline.get_tokenizer()
    assert (tokenizer.get_bos_token_id(), tokenizer.get_eos_token_id()) == (
        BOS_ID,
        EOS_ID,
    )
    for text in ROUND_TRIP_TEXTS[:8]:
        ids = [int(t) for t in tokenizer.encode(text).input_ids.data[0]]
        # OpenVINO GenAI's GGUF tokenizer ignores tokenizer.ggml.add_bos_token: a string
        # prompt reaches the model without BOS, unlike llama.cpp. Pass token ids to OpenVINO.
        assert ids == llm.tokenize(text.encode(), add_bos=False)
        assert tokenizer.decode(ids) == text
    result = ov_pipeline.generate([PROMPT_A], _ov_config(1), apply_chat_template=False)
    no_bos = llm.tokenize(PROMPT_A.encode(), add_bos=False)
    assert result.perf_metrics.get_num_input_tokens() == len(no_bos)


# --- REALISTIC -------------------------------------------------------------------------------


@pytest.mark.llama
@pytest.mark.slow
def test_realistic_model_generates_loads_and_prefills_at_benchmark_speed() -> None:
    llama_cpp = pytest.importorskip("llama_cpp")
    cached = (default_cache_dir() / REALISTIC.file_name).is_file()
    started = time.perf_counter()
    path = ensure_model(REALISTIC)  # the user cache: benchmarks reuse it
    generation_s = time.perf_counter() - started
    if not cached:
        assert generation_s < 60, f"generation took {generation_s:.1f} s (measured ~7 s)"
    assert 380e6 < path.stat().st_size < 450e6

    threads = os.cpu_count() or 1
    model = llama_cpp.Llama(str(path), n_ctx=1024, n_batch=512, n_threads=threads, verbose=False)
    try:
        assert model.metadata["llama.block_count"] == "24"
        assert model.metadata["llama.attention.head_count_kv"] == "2"
        text = "def handler(request):\n    return response  # ok\n" * 100
        tokens = model.tokenize(text.encode())[:512]
        assert len(tokens) == 512
        started = time.perf_counter()
        model.eval(tokens)
        tok_per_s = 512 / (time.perf_counter() - started)
    finally:
        model.close()
    # Measured ~230 tok/s on 2 cores with AVX-512; a loose floor keeps busy CI machines green.
    assert tok_per_s > 60, f"prefill {tok_per_s:.0f} tok/s"


def test_model_spec_fields_are_exactly_the_documented_ones() -> None:
    assert [f.name for f in fields(ModelSpec)] == [
        "name",
        "hidden",
        "layers",
        "heads",
        "kv_heads",
        "ff",
        "vocab_size",
        "context_length",
        "dtype",
        "tied_embeddings",
        "seed",
    ]
