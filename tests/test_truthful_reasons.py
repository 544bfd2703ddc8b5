"""Reasons and counters that say what happened (issue 21, item 4), each with the case that was wrong.

* A turn a refused snapshot file would have served says ``snapshot_rejected``, for every kind of
  damage: before, 9 of these 12 (the files refused while the disk tier was indexed at start)
  said ``cold / empty_cache``.
"""

from __future__ import annotations

import json
import struct
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from modeld.cache.snapfile import FORMAT_VERSION, SUFFIX, read_header, write_atomic
from modeld.cache.tiers import entry_key
from modeld.contract import Config, OpenSessionRequest, PrefixInput
from modeld.engine import Engine
from modeld.settings import Residency

testmodels = pytest.importorskip("modeld.testmodels")

TEXT = "You are a careful engineer.\nrepo: lib/parser.c parse() lex()\nlib/ast.h node_t\n" * 4
_FIXED = struct.Struct("<8sHI")


@pytest.fixture(scope="module")
def tiny() -> str:
    return str(testmodels.ensure_model(testmodels.TINY))


def _request(path: str, **config: Any) -> OpenSessionRequest:
    return OpenSessionRequest(
        type="llama", path=path, config=Config(**{"num_ctx": 2048, "num_batch": 32, **config})
    )


# --- every refused snapshot file names itself in the turn it would have served ------------------


def _header_len(raw: bytes) -> int:
    return int(_FIXED.unpack(raw[: _FIXED.size])[2])


def _flip(raw: bytearray, at: int) -> bytes:
    raw[at] ^= 0xFF
    return bytes(raw)


def _engine_refuses(path: Path) -> None:
    """Checksums that hold over a payload llama.cpp cannot load (a broken engine wrote it)."""
    header, tokens = read_header(path)
    path.unlink()
    key = entry_key(header.model_digest, header.identity, header.snapshot_format, tokens)
    write_atomic(
        path.with_name(f"{key}{SUFFIX}"),
        model_digest=header.model_digest,
        identity=header.identity,
        snapshot_format=header.snapshot_format,
        tokens=tokens,
        prefix_tokens=header.prefix_tokens,
        payload=b"\x00" * header.payload_bytes,
    )


def _rewrite(change: Callable[[bytearray], bytes]) -> Callable[[Path], None]:
    def apply(path: Path) -> None:
        path.write_bytes(change(bytearray(path.read_bytes())))

    return apply


def _version(raw: bytearray) -> bytes:
    raw[8:10] = (FORMAT_VERSION + 1).to_bytes(2, "little")
    return bytes(raw)


def _magic(raw: bytearray) -> bytes:
    raw[:8] = b"NOTMODEL"
    return bytes(raw)


def _header_json(raw: bytearray) -> bytes:
    at = _FIXED.size
    assert raw[at : at + 1] == b"{"
    raw[at : at + 1] = b"X"  # no longer JSON
    return bytes(raw)


def _tokens(raw: bytearray) -> bytes:
    return _flip(raw, _FIXED.size + _header_len(raw) + 5)


def _rename(path: Path) -> None:  # foreign, or renamed by hand: its name claims other contents
    path.rename(path.with_name("0" * 16 + path.name[16:]))


DAMAGES: dict[str, Callable[[Path], None]] = {
    "payload byte flipped": _rewrite(lambda raw: _flip(raw, len(raw) - 10)),
    "payload the engine refuses": _engine_refuses,
    "payload cut short": _rewrite(lambda raw: bytes(raw[:-100])),
    "padded": _rewrite(lambda raw: bytes(raw) + b"\0" * 64),
    "cut inside the tokens": _rewrite(lambda raw: bytes(raw[: _FIXED.size + _header_len(raw) + 6])),
    "cut inside the header": _rewrite(lambda raw: bytes(raw[: _FIXED.size + _header_len(raw) // 2])),
    "empty": _rewrite(lambda raw: b""),
    "another format version": _rewrite(_version),
    "not a snapshot file": _rewrite(_magic),
    "header not JSON": _rewrite(_header_json),
    "tokens corrupted": _rewrite(_tokens),
    "name does not match": _rename,
}


@pytest.fixture
def persisted(tmp_path: Path, tiny: str) -> tuple[Path, int]:
    """A data directory holding the disk snapshot of one tiny-model prefix."""
    data = tmp_path / "data"
    with Engine(backends=("llama",), data_dir=data, residency=Residency(persist_min_tokens=8)) as engine:
        size = engine.open_session(_request(tiny)).ensure_prefix(PrefixInput(text=TEXT)).prefix_tokens
    (only,) = (data / "kv").glob(f"*{SUFFIX}")
    header, _ = read_header(only)
    assert json.loads(json.dumps(header.n_tokens)) == size
    return data, size


@pytest.mark.llama
@pytest.mark.parametrize("damage", list(DAMAGES))
def test_a_turn_a_refused_snapshot_would_have_served_says_snapshot_rejected(
    persisted: tuple[Path, int], tiny: str, damage: str
) -> None:
    data, size = persisted
    (path,) = (data / "kv").glob(f"*{SUFFIX}")
    DAMAGES[damage](path)
    with Engine(backends=("llama",), data_dir=data) as engine:
        status = engine.open_session(_request(tiny)).ensure_prefix(PrefixInput(text=TEXT))
        assert (status.reuse.outcome, status.reuse.reason) == ("cold", "snapshot_rejected"), status.reuse
        assert status.prefilled_tokens == size
        (model,) = engine.status().models
        assert model.counters["snapshots_rejected"] == 1
        tiers = engine.status().tiers
        assert tiers is not None and tiers.rejected == 1
        again = engine.open_session(_request(tiny)).ensure_prefix(PrefixInput(text=TEXT))
        assert again.reuse.outcome == "warm"  # said once; the turn's own context serves now


@pytest.mark.llama
def test_a_refused_file_of_another_text_does_not_explain_a_cold_turn(
    persisted: tuple[Path, int], tiny: str
) -> None:
    data, _ = persisted
    (path,) = (data / "kv").glob(f"*{SUFFIX}")
    DAMAGES["payload cut short"](path)
    with Engine(backends=("llama",), data_dir=data) as engine:
        other = "Nothing in common with that workspace at all.\n" * 8
        status = engine.open_session(_request(tiny)).ensure_prefix(PrefixInput(text=other))
        assert (status.reuse.outcome, status.reuse.reason) == ("cold", "empty_cache")
        status = engine.open_session(_request(tiny)).ensure_prefix(PrefixInput(text=TEXT))
        assert status.reuse.reason == "snapshot_rejected"
