"""GGUF metadata is parsed at a bounded cost, keeps every digest byte-identical, and refuses
the crafted files that would crash llama.cpp, each with ``model_load_failed`` naming why.

The crafted files are real GGUF files written byte by byte (``gguf_craft``), most of them the
generated TINY model with one field changed. Each refused case is one llama.cpp aborted the
whole process on (measured on the pinned build) or one that would make describe's figures
wrong; the accepted cases are variants llama.cpp loads.
"""

from __future__ import annotations

import os
import subprocess
import sys
import tracemalloc
from dataclasses import replace
from pathlib import Path
from typing import Any

import gguf_craft as c
import pytest
import xxhash

from modeld.backends import gguf_meta
from modeld.backends.gguf_meta import LIMITS, read_gguf
from modeld.errors import BackendMismatchError, ModelLoadError

gguf = pytest.importorskip("gguf")
testmodels = pytest.importorskip("modeld.testmodels")


@pytest.fixture(scope="module")
def tiny() -> Path:
    return testmodels.ensure_model(testmodels.TINY)


@pytest.fixture(scope="module")
def base(tiny: Path) -> c.GGUF:
    return c.load(tiny)


def _reference_tokenizer_digest(path: Path) -> str:
    """The tokenizer digest as modeld computed it with gguf.GGUFReader (before its own parser)."""
    reader = gguf.GGUFReader(str(path), "r")

    def field(key: str) -> Any:
        f = reader.fields.get(key)
        return None if f is None else f.contents()

    h = xxhash.xxh3_128()
    for key in (
        "tokenizer.ggml.model",
        "tokenizer.ggml.pre",
        "tokenizer.ggml.bos_token_id",
        "tokenizer.ggml.eos_token_id",
        "tokenizer.ggml.add_bos_token",
        "tokenizer.ggml.add_eos_token",
    ):
        h.update(f"{key}={field(key)!r}\0".encode())
    for key in (
        "tokenizer.ggml.tokens",
        "tokenizer.ggml.token_type",
        "tokenizer.ggml.merges",
        "tokenizer.ggml.scores",
    ):
        f = reader.fields.get(key)
        if f is None:
            h.update(f"{key}=None\0".encode())
            continue
        h.update(f"{key}\0".encode())
        for part in f.data:
            h.update(bytes(f.parts[part]))
    return h.hexdigest()


def _refusal(path: Path) -> ModelLoadError:
    with pytest.raises(ModelLoadError) as err:
        read_gguf(str(path))
    assert err.value.reason == "model_load_failed"
    return err.value


# --- digests are cache keys: byte-identical -----------------------------------------------------


def test_the_tiny_models_digests_are_pinned(tiny: Path) -> None:
    """The TINY file is pinned byte for byte (test_testmodels); so are its digests."""
    info = read_gguf(str(tiny))
    assert info.digest == "dda6e3669689a7651d36e618ae6bba38"  # the 32k-window TINY
    assert info.tokenizer_digest == "2e7ffa0a5b5e983e335b438f70b3d4dc"
    assert info.template_digest == "86b8ec9e998c4062293f4c3c2f57ce4d"
    assert (info.layers, info.kv_heads, info.key_length, info.value_length) == (2, (2, 2), 32, 32)
    assert (info.vocab_size, info.context_length, info.weights_bytes) == (4096, 32768, 2886144)
    assert (info.bos_token, info.eos_token, info.add_bos) == ("<|endoftext|>", "<|im_end|>", True)
    assert info.identity is not None and info.identity.size == tiny.stat().st_size


def test_tokenizer_digest_equals_the_gguf_reader_definition(base: c.GGUF, tmp_path: Path) -> None:
    spm_tokens = [b"<0x%02X>" % i for i in range(256)] + base.get("tokenizer.ggml.tokens").value[256:]
    variants = {
        "as generated": base,
        "big endian": replace(base, endian=">"),
        "gguf version 2": replace(base, version=2),
        "no merges, no token types": base.drop("tokenizer.ggml.merges").drop("tokenizer.ggml.token_type"),
        "sentencepiece with scores": base.set("tokenizer.ggml.model", "llama")
        .set("tokenizer.ggml.tokens", spm_tokens)
        .set("tokenizer.ggml.scores", [float(-i) for i in range(4096)], c.ARRAY, c.FLOAT32),
        "no special ids": base.drop("tokenizer.ggml.bos_token_id").drop("tokenizer.ggml.eos_token_id"),
        "u8 flags and i32 ids": base.set("tokenizer.ggml.add_bos_token", 1, c.UINT8).set(
            "tokenizer.ggml.bos_token_id", 7, c.INT32
        ),
    }
    digests: dict[str, str] = {}
    for i, (name, variant) in enumerate(variants.items()):
        path = variant.write(tmp_path / f"{i}.gguf")
        digests[name] = read_gguf(str(path)).tokenizer_digest
        assert digests[name] == _reference_tokenizer_digest(path), name
    assert digests["gguf version 2"] == digests["as generated"]  # same tokenizer, older container
    assert len(set(digests.values())) == len(variants) - 1


def test_every_field_matches_on_a_big_endian_copy(base: c.GGUF, tiny: Path, tmp_path: Path) -> None:
    little = read_gguf(str(tiny))
    big = read_gguf(str(replace(base, endian=">").write(tmp_path / "big.gguf")))
    same = ("architecture", "name", "context_length", "layers", "kv_heads", "key_length", "vocab_size")
    assert [getattr(big, f) for f in same] == [getattr(little, f) for f in same]
    assert (big.chat_template, big.bos_token, big.weights_bytes) == (
        little.chat_template,
        little.bos_token,
        little.weights_bytes,
    )


def test_a_150k_vocabulary_is_described(base: c.GGUF, tmp_path: Path) -> None:
    n = 151_936
    tokens = [b"t%d" % i for i in range(n)]
    big = (
        base.set("tokenizer.ggml.tokens", tokens)
        .set("tokenizer.ggml.token_type", [1] * n)
        .set("tokenizer.ggml.merges", [b"t%d t%d" % (i, i + 1) for i in range(n - 600)])
        .set("llama.vocab_size", n)
    )
    path = big.write(tmp_path / "qwen-sized.gguf")
    info = read_gguf(str(path))
    assert (info.vocab_size, info.bos_token, info.eos_token) == (n, "t4093", "t4095")
    assert info.tokenizer_digest == _reference_tokenizer_digest(path)


def test_variants_llama_cpp_loads_are_accepted(base: c.GGUF, tmp_path: Path) -> None:
    for i, variant in enumerate(
        [
            base.set("llama.rope.scaling.type", "yarn", c.STRING),
            base.set("llama.attention.head_count_kv", [2, 2], c.ARRAY, c.UINT32),
            base.set("llama.attention.head_count", [4, 0], c.ARRAY, c.UINT32),  # a layer without attention
            base.set("llama.expert_count", 0, c.UINT32).set("llama.expert_used_count", 0, c.UINT32),
            base.set("tokenizer.ggml.tokens", [b""] * 4096),  # llama.cpp names them [EMPTY_i]
        ]
    ):
        read_gguf(str(variant.write(tmp_path / f"{i}.gguf")))
    recurrent = read_gguf(str(testmodels.ensure_model(testmodels.RECURRENT)))
    assert (recurrent.recurrent, recurrent.kv_heads) == (True, (0, 0))


# --- what would crash llama.cpp is refused, naming the field ------------------------------------

_SPM = [b"<0x%02X>" % i for i in range(256)]

CRASHES: list[tuple[str, Any, str, str]] = [
    # (case, change to TINY, field, words in the message)
    ("no layers", lambda g: g.set("llama.block_count", 0), "llama.block_count", "has llama.block_count = 0"),
    ("100000 layers", lambda g: g.set("llama.block_count", 100000), "llama.block_count", "1 to 512 layers"),
    ("513 layers", lambda g: g.set("llama.block_count", 513), "llama.block_count", "= 513"),
    (
        "duplicate tokens",
        lambda g: g.set("tokenizer.ggml.tokens", [*g.get("tokenizer.ggml.tokens").value[:-1], b"\xc4\x80"]),
        "tokenizer.ggml.tokens",
        "1 duplicate tokens",
    ),
    (
        "sentencepiece without a byte token",
        lambda g: g.set("tokenizer.ggml.model", "llama").set(
            "tokenizer.ggml.tokens",
            [*_SPM[:65], b"not A", *_SPM[66:], *g.get("tokenizer.ggml.tokens").value[256:]],
        ),
        "tokenizer.ggml.tokens",
        "without the byte token <0x41> (1 of 256 missing)",
    ),
    (
        "a layer with heads but no KV heads",
        lambda g: g.set("llama.attention.head_count_kv", [2, 0], c.ARRAY, c.UINT32),
        "llama.attention.head_count_kv",
        "4 attention heads and 0 KV heads in layer 1",
    ),
    (
        "too many experts",
        lambda g: g.set("llama.expert_count", 2000, c.UINT32).set("llama.expert_used_count", 2, c.UINT32),
        "llama.expert_count",
        "= 2000; at most 1024",
    ),
    (
        "experts but none used",
        lambda g: g.set("llama.expert_count", 8, c.UINT32),
        "llama.expert_used_count",
        "= 0 for 8 experts",
    ),
    (
        "more experts used than exist",
        lambda g: g.set("llama.expert_used_count", 3, c.UINT32),
        "llama.expert_used_count",
        "= 3 for 0 experts",
    ),
    (
        "an unknown rope scaling",
        lambda g: g.set("llama.rope.scaling.type", "", c.STRING),
        "llama.rope.scaling.type",
        "llama.rope.scaling.type llama.cpp does not know",
    ),
]

INCONSISTENT: list[tuple[str, Any, str, str]] = [
    ("no heads", lambda g: g.set("llama.attention.head_count", 0), "llama.attention.head_count", "= 0"),
    (
        "KV heads that do not divide the heads",
        lambda g: g.set("llama.attention.head_count_kv", 3),
        "llama.attention.head_count_kv",
        "4 attention heads and 3 KV heads in layer 0",
    ),
    (
        "per-layer values for another layer count",
        lambda g: g.set("llama.attention.head_count_kv", [2], c.ARRAY, c.UINT32),
        "llama.attention.head_count_kv",
        "1 per-layer values for llama.attention.head_count_kv, for 2 layers",
    ),
    ("no context", lambda g: g.set("llama.context_length", 0), "llama.context_length", "= 0"),
    (
        "vocab mismatch",
        lambda g: g.set("llama.vocab_size", 5000),
        "llama.vocab_size",
        "= 5000 but 4096 tokens",
    ),
    (
        "tokens that are numbers",
        lambda g: g.set("tokenizer.ggml.tokens", list(range(4096)), c.ARRAY, c.INT32),
        "tokenizer.ggml.tokens",
        "not an array of strings",
    ),
    (
        "token types for another vocabulary",
        lambda g: g.set("tokenizer.ggml.token_type", [1] * 10),
        "tokenizer.ggml.token_type",
        "not one i32 per token",
    ),
    (
        "scores of the wrong type",
        lambda g: g.set("tokenizer.ggml.scores", [b"x"] * 4096, c.ARRAY, c.STRING),
        "tokenizer.ggml.scores",
        "not one f32 per token",
    ),
    (
        "layer count of the wrong type",
        lambda g: g.set("llama.block_count", "2", c.STRING),
        "llama.block_count",
        "not an integer",
    ),
    (
        "no architecture",
        lambda g: g.drop("general.architecture"),
        "general.architecture",
        "has no general.architecture",
    ),
]


@pytest.mark.parametrize(
    ("case", "change", "field", "words"),
    CRASHES + INCONSISTENT,
    ids=lambda v: v if isinstance(v, str) else "",
)
def test_crafted_dimensions_are_refused_naming_the_field(
    base: c.GGUF, tmp_path: Path, case: str, change: Any, field: str, words: str
) -> None:
    path = change(base).write(tmp_path / "crafted.gguf")
    err = _refusal(path)
    assert err.details["field"] == field, case
    assert words in str(err), case


@pytest.mark.llama
def test_llama_cpp_really_aborts_on_a_model_without_layers(base: c.GGUF, tmp_path: Path) -> None:
    """Why describe refuses it: the engine would take the whole process down (SIGABRT)."""
    pytest.importorskip("llama_cpp")
    path = base.set("llama.block_count", 0).write(tmp_path / "no-layers.gguf")
    script = (
        "import sys, llama_cpp as L\n"
        "L.llama_backend_init()\n"
        "L.llama_model_load_from_file(sys.argv[1].encode(), L.llama_model_default_params())\n"
    )
    run = subprocess.run([sys.executable, "-c", script, str(path)], capture_output=True, timeout=120)
    assert run.returncode == -6  # SIGABRT: GGML_ASSERT(hparams.n_layer_all > 0 ...)


# --- the format itself: limits and structure ------------------------------------------------------


def test_a_million_and_a_half_empty_strings_are_refused_cheaply(tmp_path: Path) -> None:
    """12 MB that cost 44 s and 2.4 GB with gguf.GGUFReader: refused from the array's count."""
    path = c.GGUF(
        [
            c.KV("general.architecture", c.STRING, "llama"),
            c.KV("junk", c.ARRAY, [b""] * 1_500_000, c.STRING),
        ]
    ).write(tmp_path / "empty-strings.gguf")
    assert path.stat().st_size > 12_000_000
    tracemalloc.start()
    try:
        err = _refusal(path)
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert str(err).endswith("exceeds the limit max_array_elements (1500000 > 1048576)")
    assert (err.details["limit"], err.details["value"], err.details["maximum"]) == (
        "max_array_elements",
        "1500000",
        "1048576",
    )
    assert peak < 8 << 20  # it read one megabyte of header, never the strings


def _lying(kvs: list[c.KV], **header: Any) -> c.GGUF:
    return c.GGUF([c.KV("general.architecture", c.STRING, "llama"), *kvs], **header)


LIMIT_CASES: list[tuple[str, c.GGUF, str, str]] = [
    ("metadata entries", _lying([], kv_count=70_000), "max_metadata_entries", "70000 > 65536"),
    ("tensors", _lying([], tensor_count=100_000), "max_tensors", "100000 > 65536"),
    (
        "a 100 MB string",
        _lying([c.KV("junk", c.STRING, b"x" * 10)]),
        "max_header_bytes",
        "",
    ),
    (
        "strings in all arrays",
        _lying([c.KV(f"junk{i}", c.ARRAY, [b""] * (1 << 20), c.STRING) for i in range(2)]),
        "max_metadata_strings",
        "2097153 > 2097152",  # the architecture's string, then two full arrays
    ),
]


@pytest.mark.parametrize(("case", "crafted", "limit", "words"), LIMIT_CASES, ids=[x[0] for x in LIMIT_CASES])
def test_limits_are_checked_before_anything_is_walked(
    tmp_path: Path, case: str, crafted: c.GGUF, limit: str, words: str
) -> None:
    path = crafted.write(tmp_path / "crafted.gguf")
    if case == "a 100 MB string":  # the string claims 100 MB; the file has 10 bytes of it
        data = bytearray(path.read_bytes())
        at = data.index(b"junk") + 4 + 4
        data[at : at + 8] = (100 << 20).to_bytes(8, "little")
        path.write_bytes(bytes(data))
    err = _refusal(path)
    assert err.details["limit"] == limit
    assert words in str(err)
    assert int(err.details["maximum"]) == LIMITS[limit]


def test_structural_faults_are_refused(base: c.GGUF, tiny: Path, tmp_path: Path) -> None:
    t0 = base.tensors[0]
    half = tmp_path / "half.gguf"
    half.write_bytes(tiny.read_bytes()[: tiny.stat().st_size // 2])
    header_only = tmp_path / "header-only.gguf"
    header_only.write_bytes(tiny.read_bytes()[:5000])
    cases: list[tuple[Path, str]] = [
        (half, "is truncated: its tensors need 3019360 bytes, the file has 1509680"),
        (header_only, "is truncated: its header needs more than the file's 5000 bytes"),
        (
            replace(base, version=1).write(tmp_path / "v1.gguf"),
            "is GGUF version 1; modeld reads versions 2 and 3",
        ),
        (replace(base, version=4).write(tmp_path / "v4.gguf"), "is GGUF version 4"),
        (
            replace(base, kvs=[*base.kvs, base.kvs[0]]).write(tmp_path / "dup.gguf"),
            "has the metadata key 'general.architecture' twice",
        ),
        (base.set("x", b"\0" * 4, 13).write(tmp_path / "type13.gguf"), "a metadata value of unknown type 13"),
        (
            base.set("x", [], c.ARRAY, c.ARRAY).write(tmp_path / "nested.gguf"),
            "arrays of arrays are not supported",
        ),
        (
            replace(base, tensors=[replace(t0, type=200), *base.tensors[1:]]).write(tmp_path / "t200.gguf"),
            "a tensor of unknown ggml type 200",
        ),
        (
            replace(base, tensors=[replace(t0, dims=(128, 4096, 1, 1, 1)), *base.tensors[1:]]).write(
                tmp_path / "5d.gguf"
            ),
            "a tensor with 5 dimensions",
        ),
        (
            replace(base, tensors=[t0, *base.tensors]).write(tmp_path / "twice.gguf"),
            "two tensors with the same name",
        ),
        (
            replace(base, tensors=[replace(t0, offset=1), *base.tensors[1:]]).write(
                tmp_path / "misaligned.gguf"
            ),
            "not aligned to 32 bytes",
        ),
        (base.set("general.alignment", 3, c.UINT32).write(tmp_path / "align3.gguf"), "not a power of two"),
        (
            base.set("tokenizer.chat_template", b"\xff\xfe", c.STRING).write(tmp_path / "latin.gguf"),
            "tokenizer.chat_template that is not valid UTF-8",
        ),
    ]
    for path, words in cases:
        err = _refusal(path)
        assert words in str(err), path.name
        assert str(err).startswith(repr(str(path))), path.name


def test_a_directory_is_not_a_gguf_and_an_ir_directory_says_so(tmp_path: Path) -> None:
    with pytest.raises(ModelLoadError, match="is a directory, not a regular file"):
        read_gguf(str(tmp_path))
    (tmp_path / "openvino_model.xml").write_text("<net/>")
    with pytest.raises(BackendMismatchError, match="OpenVINO IR directory"):
        read_gguf(str(tmp_path))


def test_a_rewritten_file_is_described_again(base: c.GGUF, tmp_path: Path) -> None:
    path = base.write(tmp_path / "m.gguf")
    first = read_gguf(str(path))
    base.set("general.name", "renamed-model").write(path)
    second = read_gguf(str(path))
    assert (first.name, second.name) == ("modeld-test-tiny", "renamed-model")
    assert second.digest != first.digest
    assert second.identity != first.identity
    assert gguf_meta.fingerprint(path) == second.digest


def test_special_files_never_reach_the_parser(tmp_path: Path) -> None:
    fifo = tmp_path / "fifo.gguf"
    os.mkfifo(fifo)
    for path, kind in ((fifo, "a FIFO (named pipe)"), (Path("/dev/zero"), "a character device")):
        err = _refusal(path)
        assert err.details["kind"] == kind
    err = _refusal(tmp_path / ("n" * 300 + ".gguf"))
    assert err.details["errno"] == "ENAMETOOLONG"
