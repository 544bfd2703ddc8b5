"""The generated test models: shape, metadata, tokenizer, determinism, caching, and that both
real engines (llama.cpp and OpenVINO GenAI) load TINY and agree on its greedy output; that
llama.cpp sees RECURRENT as a recurrent model whose memory cannot be cut mid-sequence.

Everything here runs on TINY and RECURRENT in a few seconds; REALISTIC (a 412 MB file) is only
touched by the ``slow`` test. See ``blueprints/0008-test-models.md``.
"""

from __future__ import annotations

import ctypes
import hashlib
import json
import os
import subprocess
import sys
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
    RECURRENT,
    TINY,
    ModelSpec,
    default_cache_dir,
    ensure_model,
)
from modeld.testmodels.__main__ import main as cli_main
from modeld.testmodels._corpus import build_corpus
from modeld.testmodels._template import CHATML_TOOLS_TEMPLATE
from modeld.testmodels._tokenizer import CONTROL_TOKENS, build_vocabulary, train_merges

REPO_ROOT = Path(__file__).resolve().parents[2]

# sha256 of TINY's file. It pins cross-machine determinism: if this changes on another machine,
# Python, NumPy, gguf or tokenizers version, the generator is not deterministic there (fix it);
# if it changes because the generator changed on purpose, bump GENERATOR_VERSION and update it.
TINY_SHA256 = (
    "351efe475afe933a180be942e22ad6fcba96cf76bbe6b49dd3275074d45a784c"  # context_length 32768 (agents)
)
RECURRENT_SHA256 = "efa711150a899d505f5a207bff4c6813da614c2c086b0fdc215ee8920a123d18"

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
            "ARCH_SPECS",
            "COPYING",
            "GEMMA3",
            "GENERATOR_VERSION",
            "GPT_OSS",
            "GRANITE_HYBRID",
            "LFM2",
            "MAMBA2",
            "QWEN35",
            "REALISTIC",
            "RECURRENT",
            "REPLY",
            "THINK",
            "TINY",
            "TOOLS",
            "ArchSpec",
            "ModelSpec",
            "default_cache_dir",
            "ensure_ir",
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
        {"arch": "gpt2"},
        {"ssm_state": 16},  # SSM sizes belong to mamba
        {"arch": "mamba"},  # with TINY's heads and ff, and no SSM sizes
        {"weights": "trained"},
        {"weights": "copying"},  # TINY cannot carry the circuit (see test_copying_model.py)
        {"rope_freq_base": 0.0},
    ],
)
def test_inconsistent_specs_are_rejected(change: dict[str, Any]) -> None:
    with pytest.raises(ValueError, match="invalid ModelSpec"):
        replace(TINY, **change)


@pytest.mark.parametrize("change", [{"heads": 4}, {"ff": 384}, {"ssm_conv": 1}, {"dtype": "q8_0"}])
def test_inconsistent_mamba_specs_are_rejected(change: dict[str, Any]) -> None:
    with pytest.raises(ValueError, match="invalid ModelSpec"):
        replace(RECURRENT, **change)


def test_fields_added_later_enter_the_digest_only_when_not_at_their_default() -> None:
    # TINY's and REALISTIC's digests (and so their files) predate arch/ssm_*; pinned values
    # (TINY's window grew to 32768 for the agents, a change of its spec, not of the generator).
    assert TINY.digest() == "7b643ad8499d"
    assert REALISTIC.digest() == "2e77b3a63855"
    assert replace(RECURRENT, ssm_state=8).digest() != RECURRENT.digest()
    assert replace(RECURRENT, ssm_conv=3).digest() != RECURRENT.digest()
    assert replace(TINY, rope_freq_base=1e6).digest() != TINY.digest()


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
def test_realistic_model_generates_and_loads_with_its_documented_shape(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Speed is measured by ``make bench``, never asserted here (shared, noisy machines)."""
    llama_cpp = pytest.importorskip("llama_cpp")
    from modeld.backends.cpu import cpu_has_amx

    if cpu_has_amx():  # llama.cpp's AMX matmul crashes on q8_0 (blueprint 0009): as modeld loads it
        defaults = llama_cpp.llama_cpp.llama_model_default_params

        def without_extra_buffers() -> object:
            params = defaults()
            params.use_extra_bufts = False
            return params

        monkeypatch.setattr(llama_cpp.llama_cpp, "llama_model_default_params", without_extra_buffers)
    path = ensure_model(REALISTIC)  # the user cache: benchmarks reuse it
    assert 380e6 < path.stat().st_size < 450e6
    model = llama_cpp.Llama(str(path), n_ctx=1024, n_batch=512, n_threads=os.cpu_count() or 1, verbose=False)
    try:
        assert model.metadata["llama.block_count"] == "24"
        assert model.metadata["llama.attention.head_count_kv"] == "2"
        text = "def handler(request):\n    return response  # ok\n" * 100
        tokens = model.tokenize(text.encode())[:512]
        assert len(tokens) == 512
        model.eval(tokens)
        assert model.n_tokens == 512
    finally:
        model.close()


# --- RECURRENT: a Mamba model, through llama-cpp-python's low-level API ----------------------


@pytest.fixture(scope="module")
def recurrent_path(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return ensure_model(RECURRENT, tmp_path_factory.mktemp("recurrent"))


class LowLevel:
    """One model and a one-sequence context, driven with ``llama_cpp``'s C-level functions (the
    API a backend uses for memory control)."""

    def __init__(self, path: Path, n_ctx: int = 512) -> None:
        self.lib = pytest.importorskip("llama_cpp")
        lib = self.lib
        lib.llama_backend_init()
        self.model = lib.llama_model_load_from_file(str(path).encode(), lib.llama_model_default_params())
        assert self.model, f"llama.cpp could not load {path.name}"
        params = lib.llama_context_default_params()
        params.n_ctx = params.n_batch = n_ctx
        # One thread: the model is tiny, and ggml's spinning thread barriers crawl when the
        # cores are busy (2 threads on a loaded 2-core box: 0.04 s -> 10 s for a greedy test).
        params.n_threads = params.n_threads_batch = 1
        self.ctx = lib.llama_init_from_model(self.model, params)
        assert self.ctx
        self.vocab = lib.llama_model_get_vocab(self.model)
        self.mem = lib.llama_get_memory(self.ctx)
        self.n_vocab = lib.llama_vocab_n_tokens(self.vocab)

    def close(self) -> None:
        self.lib.llama_free(self.ctx)
        self.lib.llama_model_free(self.model)

    def tokenize(self, text: str, add_bos: bool = True) -> list[int]:
        data = text.encode()
        buf = (self.lib.llama_token * (len(data) + 2))()
        n = self.lib.llama_tokenize(self.vocab, data, len(data), buf, len(buf), add_bos, False)
        assert n >= 0
        return list(buf[:n])

    def detokenize(self, tokens: list[int]) -> bytes:
        arr = (self.lib.llama_token * len(tokens))(*tokens)
        buf = ctypes.create_string_buffer(64 * len(tokens) + 16)
        n = self.lib.llama_detokenize(self.vocab, arr, len(tokens), buf, len(buf), False, False)
        assert n >= 0
        return buf.raw[:n]

    def decode(self, tokens: list[int]) -> np.ndarray[Any, np.dtype[np.float32]]:
        """Append ``tokens`` (one batch, positions continue after the memory's end); the logits
        after the last one."""
        arr = (self.lib.llama_token * len(tokens))(*tokens)
        assert self.lib.llama_decode(self.ctx, self.lib.llama_batch_get_one(arr, len(tokens))) == 0
        logits = self.lib.llama_get_logits_ith(self.ctx, -1)
        return np.ctypeslib.as_array(logits, shape=(self.n_vocab,)).copy()

    def pos_max(self) -> int:
        return int(self.lib.llama_memory_seq_pos_max(self.mem, 0))

    def seq_rm(self, seq_id: int, p0: int, p1: int) -> bool:
        return bool(self.lib.llama_memory_seq_rm(self.mem, seq_id, p0, p1))

    def greedy(self, prompt: list[int], n: int = N_GREEDY) -> tuple[list[int], list[float]]:
        """From an empty memory: greedy tokens after ``prompt`` and each step's top-2 margin."""
        self.lib.llama_memory_clear(self.mem, True)
        logits = self.decode(prompt)
        out: list[int] = []
        margins: list[float] = []
        for _ in range(n):
            second, first = np.partition(logits, -2)[-2:]
            margins.append(float(first - second))
            out.append(int(np.argmax(logits)))
            logits = self.decode([out[-1]])
        return out, margins


@pytest.fixture(scope="module")
def recurrent(recurrent_path: Path) -> Iterator[LowLevel]:
    model = LowLevel(recurrent_path)
    yield model
    model.close()


def test_recurrent_is_a_small_mamba_with_tinys_vocabulary(recurrent_path: Path, tiny_path: Path) -> None:
    assert (RECURRENT.arch, RECURRENT.vocab_size, RECURRENT.seed) == ("mamba", TINY.vocab_size, TINY.seed)
    assert recurrent_path.stat().st_size < 4_000_000
    reader = GGUFReader(recurrent_path)
    assert field(reader, "general.architecture") == "mamba"
    assert field(reader, "mamba.embedding_length") == RECURRENT.hidden
    assert field(reader, "mamba.block_count") == RECURRENT.layers
    assert field(reader, "mamba.ssm.inner_size") == 2 * RECURRENT.hidden
    assert field(reader, "mamba.ssm.state_size") == RECURRENT.ssm_state
    assert field(reader, "mamba.ssm.conv_kernel") == RECURRENT.ssm_conv
    assert field(reader, "mamba.ssm.time_step_rank") == RECURRENT.hidden // 16
    assert field(reader, "modeld.testmodels.spec_digest") == RECURRENT.digest()
    tiny = GGUFReader(tiny_path)
    for key in ["tokenizer.ggml.tokens", "tokenizer.ggml.merges", "tokenizer.chat_template"]:
        assert field(reader, key) == field(tiny, key)
    tensors = {t.name: t for t in reader.tensors}
    # ggml's SSM ops read these directly and need f32; the projections are f16.
    assert tensors["blk.0.ssm_conv1d.weight"].tensor_type == GGMLQuantizationType.F32
    assert tensors["blk.0.ssm_a"].tensor_type == GGMLQuantizationType.F32
    assert tensors["blk.0.ssm_x.weight"].tensor_type == GGMLQuantizationType.F16
    assert hashlib.sha256(recurrent_path.read_bytes()).hexdigest() == RECURRENT_SHA256


@pytest.mark.llama
def test_llama_cpp_loads_recurrent_as_recurrent_with_tinys_tokenization(
    recurrent: LowLevel, llm: Any
) -> None:
    lib = recurrent.lib
    assert lib.llama_model_is_recurrent(recurrent.model)
    assert not lib.llama_model_is_hybrid(recurrent.model)
    assert lib.llama_model_n_swa(recurrent.model) == 0
    # True for recurrent memory too, so it says nothing about truncation; only seq_rm does.
    assert lib.llama_memory_can_shift(recurrent.mem)
    assert (lib.llama_vocab_bos(recurrent.vocab), lib.llama_vocab_eos(recurrent.vocab)) == (BOS_ID, EOS_ID)
    for text in ROUND_TRIP_TEXTS:
        ids = recurrent.tokenize(text, add_bos=False)
        assert ids == llm.tokenize(text.encode(), add_bos=False)
        assert recurrent.detokenize(ids) == text.encode()
    assert recurrent.tokenize(PROMPT_A)[0] == BOS_ID


@pytest.mark.llama
def test_recurrent_memory_cannot_be_cut_mid_sequence_only_cleared_or_appended(
    recurrent: LowLevel,
) -> None:
    prompt = recurrent.tokenize(PROMPT_A * 3)
    extra = recurrent.tokenize(PROMPT_B, add_bos=False)
    n = len(prompt)
    recurrent.lib.llama_memory_clear(recurrent.mem, True)
    first = recurrent.decode(prompt)
    assert recurrent.pos_max() == n - 1
    for k in (1, n // 2, n - 1):
        assert not recurrent.seq_rm(0, k, -1)  # one state per sequence: no suffix to drop
        assert recurrent.pos_max() == n - 1
    # Ranges that do not reach the end "succeed" but remove nothing: the state is unchanged.
    assert recurrent.seq_rm(0, 0, n // 2)
    assert recurrent.seq_rm(0, n // 2, n - 1)
    # Removing nothing past the end succeeds; appending then equals a fresh run with the same
    # batching, so the refused calls left the state intact.
    assert recurrent.seq_rm(0, n, -1)
    appended = recurrent.decode(extra)
    assert recurrent.pos_max() == n + len(extra) - 1
    recurrent.lib.llama_memory_clear(recurrent.mem, True)
    recurrent.decode(prompt)
    assert np.array_equal(recurrent.decode(extra), appended)
    # Removing the whole sequence works ([0, inf) and [-1, -1) both mean "all of it").
    for p0 in (0, -1):
        assert recurrent.seq_rm(0, p0, -1)
        assert recurrent.pos_max() == -1
        assert np.array_equal(recurrent.decode(prompt), first)
    # llama.cpp quirk (0.3.36): "any sequence" (-1) is refused by recurrent memory ("invalid
    # seq_id (-1) - larger than n_seq_max" logged), even for the whole range. Use seq 0 or
    # llama_memory_clear.
    assert not recurrent.seq_rm(-1, -1, -1)
    assert recurrent.pos_max() == n - 1


@pytest.mark.llama
def test_tiny_memory_can_be_cut_mid_sequence_unlike_recurrent(tiny_path: Path) -> None:
    tiny = LowLevel(tiny_path)
    try:
        assert not tiny.lib.llama_model_is_recurrent(tiny.model)
        prompt = tiny.tokenize(PROMPT_A * 3)
        tiny.decode(prompt)
        assert tiny.seq_rm(0, len(prompt) // 2, -1)
        assert tiny.pos_max() == len(prompt) // 2 - 1
    finally:
        tiny.close()


@pytest.mark.llama
def test_recurrent_greedy_decoding_is_deterministic_context_dependent_and_not_degenerate(
    recurrent: LowLevel,
) -> None:
    out_a, margins_a = recurrent.greedy(recurrent.tokenize(PROMPT_A))
    out_b, margins_b = recurrent.greedy(recurrent.tokenize(PROMPT_B))
    assert out_a != out_b
    for out in (out_a, out_b):
        assert len(set(out)) >= N_GREEDY // 2, out
        assert max(out) < BOS_ID
    assert recurrent.greedy(recurrent.tokenize(PROMPT_A)) == (out_a, margins_a)
    margins = np.array(margins_a + margins_b)
    assert np.median(margins) > 0.5
    assert np.mean(margins < 0.01) < 0.1
    # The state carries context: one token changed 32 positions back changes the continuation.
    long_prompt = recurrent.tokenize(ROUND_TRIP_TEXTS[0] * 8)[:96]
    changed = list(long_prompt)
    changed[-32] = changed[-32] + 1 if changed[-32] < 1000 else changed[-32] - 1
    assert recurrent.greedy(changed)[0] != recurrent.greedy(long_prompt)[0]


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
        "arch",
        "ssm_state",
        "ssm_conv",
        "weights",
        "rope_freq_base",
    ]


@pytest.mark.llama
def test_reply_answers_every_chat_turn_briefly_and_ends_it() -> None:
    """REPLY's whole point: greedy or sampled, after any conversation, the answer is REPLY_TEXT
    and the end-of-turn token (an agent treats a turn cut off at its limit as an error)."""
    import llama_cpp

    from modeld.testmodels import REPLY
    from modeld.testmodels._reply import REPLY_TEXT

    llm = llama_cpp.Llama(model_path=str(ensure_model(REPLY)), n_ctx=8192, verbose=False)
    try:
        prompts = [
            "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n",
            "<|im_start|>system\nYou are terse.<|im_end|>\n<|im_start|>user\n"
            + "def f(x):\n    return x\n" * 200
            + "<|im_end|>\n<|im_start|>assistant\n",
            "<|im_start|>user\n<tool_response>\nsetup.py\n</tool_response><|im_end|>\n<|im_start|>assistant\n",
        ]
        for prompt in prompts:
            for temperature, seed in ((0.0, 0), (1.0, 7), (1.0, 8)):
                out = llm.create_completion(prompt, max_tokens=32, temperature=temperature, seed=seed)
                choice = out["choices"][0]
                assert (choice["text"], choice["finish_reason"]) == (REPLY_TEXT, "stop"), (prompt[:40], seed)
    finally:
        llm.close()
