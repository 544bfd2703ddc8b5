"""The manifest's canonical encoding and compatibility rules.

Golden vectors pin the digests: they must be identical in every process, on every platform and
Python version. A second, independent encoder written from blueprints/0002-context-manifest.md
checks that the documentation and the code say the same thing byte for byte.
"""

from __future__ import annotations

import struct
import subprocess
import sys
from dataclasses import fields, replace

import pytest
import xxhash

from modeld.errors import ManifestMismatchError
from modeld.manifest import (
    RUNTIME_FIELDS,
    ContextManifest,
    Segment,
    bytes_hash,
    canonical_encoding,
    check_text,
    runtime_digest,
    token_hash,
)

RUNTIME = runtime_digest(
    num_ctx=4096, num_batch=512, num_gpu_layers=0, tensor_split=(), flash_attn=False, kv_cache_type="f16"
)
FULL = ContextManifest(
    profile_id="aider",
    backend="llama",
    backend_version="0.3.36",
    model_digest="a" * 32,
    tokenizer_digest="b" * 32,
    prompt_format="raw",
    prompt_template_digest="",
    runtime_digest=RUNTIME,
    add_bos=True,
    stable_bytes=120,
    total_bytes=150,
    stable_byte_hash=bytes_hash("x"),
    stable_token_hash=token_hash([1, 2, 3]),
    volatile_token_hash="",
    segments=(
        Segment(
            "system", 0, 100, hash="c" * 32, stable=True, cache_class="static", token_start=1, token_end=30
        ),
        Segment("user_turn", 120, 150, stable=False, cache_class="turn"),
    ),
)
UNICODE = ContextManifest(profile_id="ünïcödé ✓ 日本", add_bos=False, stable_bytes=-1)

GOLDEN = [
    (ContextManifest(), "6f1956dbb7d1dd65574c17f0fad378f9"),
    (FULL, "66687fa2c9dd2bd01650f36121dbc652"),
    (UNICODE, "c551a1929a9c7a91132c183c7b363d28"),
]


@pytest.mark.parametrize(("manifest", "digest"), GOLDEN)
def test_golden_digests(manifest: ContextManifest, digest: str) -> None:
    assert manifest.digest() == digest


def test_golden_hashes() -> None:
    assert RUNTIME == "94e3f02a50a503910d47040b7bb7cf57"
    assert (
        runtime_digest(
            num_ctx=4096,
            num_batch=512,
            num_gpu_layers=0,
            tensor_split=(0.5, 0.5),
            flash_attn=True,
            kv_cache_type="q8_0",
        )
        == "55e0fbe8769f3649fe4ef07ae667f047"
    )
    assert bytes_hash("hello") == "b5e9c1ad071b3e7fc779cfaa5e523818"
    assert bytes_hash("") == token_hash([]) == "99aa06d3014798d86001c324468d497f"
    assert token_hash([1, 2, 3, 65535, 100000]) == "365236e6b267e1cc48252448d9da4327"


def _independent_encoding(m: ContextManifest) -> bytes:
    """The encoding exactly as the blueprint documents it, written separately from the code."""

    def name(n: str) -> bytes:
        return bytes([len(n)]) + n.encode("ascii")

    def value(v: object) -> bytes:
        if v is None:
            return b"\x00"
        if isinstance(v, bool):
            return b"\x03" + (b"\x01" if v else b"\x00")
        if isinstance(v, int):
            return b"\x02" + struct.pack("<q", v)
        assert isinstance(v, str)
        raw = v.encode("utf-8")
        return b"\x01" + struct.pack("<I", len(raw)) + raw

    scalars = (
        "profile_id backend backend_version model_digest tokenizer_digest prompt_format "
        "prompt_template_digest runtime_digest add_bos stable_bytes total_bytes stable_byte_hash "
        "stable_token_hash volatile_token_hash"
    ).split()
    segment_fields = "kind byte_start byte_end hash stable cache_class role token_start token_end".split()
    out = b"modeld.manifest\x00" + struct.pack("<H", 1)
    for n in scalars:
        out += name(n) + value(getattr(m, n))
    out += name("segments") + b"\x04" + struct.pack("<I", len(m.segments))
    for seg in m.segments:
        for n in segment_fields:
            out += name(n) + value(getattr(seg, n))
    return out


@pytest.mark.parametrize(("manifest", "digest"), GOLDEN)
def test_encoding_matches_the_documented_layout(manifest: ContextManifest, digest: str) -> None:
    encoded = canonical_encoding(manifest)
    assert encoded == _independent_encoding(manifest)
    assert xxhash.xxh3_128_hexdigest(encoded) == digest


def test_digest_is_the_same_in_another_process() -> None:
    code = (
        "from modeld.manifest import *\n"
        "print(ContextManifest(profile_id='ünïcödé ✓ 日本', add_bos=False, stable_bytes=-1).digest())"
    )
    out = subprocess.run(
        [sys.executable, "-c", code],
        capture_output=True,
        text=True,
        check=True,
        env={"PYTHONHASHSEED": "123"},
    )
    assert out.stdout.strip() == "c551a1929a9c7a91132c183c7b363d28"


def test_every_field_changes_the_digest() -> None:
    changed = {
        "profile_id": "x",
        "backend": "x",
        "backend_version": "x",
        "model_digest": "x",
        "tokenizer_digest": "x",
        "prompt_format": "x",
        "prompt_template_digest": "x",
        "runtime_digest": "x",
        "add_bos": False,
        "stable_bytes": 121,
        "total_bytes": 151,
        "stable_byte_hash": "x",
        "stable_token_hash": "x",
        "volatile_token_hash": "x",
        "segments": FULL.segments[:1],
    }
    assert set(changed) == {f.name for f in fields(ContextManifest)}
    for name, value in changed.items():
        assert replace(FULL, **{name: value}).digest() != FULL.digest(), name  # type: ignore[arg-type]


@pytest.mark.parametrize("field", RUNTIME_FIELDS)
def test_each_runtime_field_breaks_compatibility_and_is_named(field: str) -> None:
    other = replace(FULL, **{field: False if field == "add_bos" else "different"})  # type: ignore[arg-type]
    compat = FULL.compatible_runtime(other)
    assert not compat
    assert compat.field == field


def test_text_and_annotations_never_break_compatibility() -> None:
    other = replace(
        FULL,
        profile_id="another tool",
        stable_bytes=1,
        total_bytes=2,
        stable_byte_hash="y",
        stable_token_hash="y",
        volatile_token_hash="y",
        segments=(),
    )
    assert FULL.compatible_runtime(other)


def test_runtime_digest_ignores_threads_but_not_the_window() -> None:
    base = {
        "num_ctx": 4096,
        "num_batch": 512,
        "num_gpu_layers": 0,
        "tensor_split": (),
        "flash_attn": False,
        "kv_cache_type": "f16",
    }
    assert runtime_digest(**base) == RUNTIME  # type: ignore[arg-type]
    for key, value in (
        ("num_ctx", 2048),
        ("num_batch", 256),
        ("kv_cache_type", "q8_0"),
        ("flash_attn", True),
    ):
        assert runtime_digest(**{**base, key: value}) != RUNTIME  # type: ignore[arg-type]


def test_check_text_names_what_is_inconsistent() -> None:
    text = b"system prompt\nrepo map\n"
    good = ContextManifest(
        stable_bytes=len(text),
        stable_byte_hash=bytes_hash(text),
        segments=(Segment("system", 0, 14, hash=bytes_hash(text[:14])), Segment("repo_map", 14, len(text))),
    )
    check_text(good, text, start=0, stable=True)
    cases = {
        "stable_bytes": replace(good, stable_bytes=3),
        "stable_byte_hash": replace(good, stable_byte_hash="0" * 32),
        "segments[0].hash": good.with_segments([replace(good.segments[0], hash="0" * 32), good.segments[1]]),
        "segments[1].byte_start": good.with_segments(
            [good.segments[0], replace(good.segments[1], byte_start=10)]
        ),
        "segments[0].kind": good.with_segments([replace(good.segments[0], kind="banner")]),
        "segments[1].stable": good.with_segments([good.segments[0], replace(good.segments[1], stable=False)]),
    }
    for field, manifest in cases.items():
        with pytest.raises(ManifestMismatchError) as err:
            check_text(manifest, text, start=0, stable=True)
        assert err.value.field == field
