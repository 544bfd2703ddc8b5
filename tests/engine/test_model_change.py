"""A model file changed on disk under an open session never mixes two models (issue 21, failure 1).

Before: TINY copied to ``m.gguf``, one turn, then ``m.gguf`` overwritten in place with a
same-size file whose K/V weights differ (TINY's own bytes with the K and V tensors of TINY at
another seed): the same turn on the same session said ``warm / full_match`` under the old
digest, and its output matched neither model (llama.cpp maps the file, so the loaded worker
read the new weights next to KV computed under the old ones).

Now the model's file is checked before every turn that would reuse KV (one ``stat``; the digest
when it moved): the turn fails with ``model_changed`` naming the file, the session ends, and a
new session is cold (``model_changed``) with the output of a fresh evaluation of the file as it
is now. Snapshots of the old file are never restored for the new one (they are keyed by the
model digest); they are again once the old bytes come back. A touch, or the same bytes written
over the file, changes nothing.
"""

from __future__ import annotations

import mmap
import os
import signal
import time
from collections.abc import Iterator
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest
from daemon_proc import start_serve, stop, wait_serving

import runtime_client as rc
from modeld.backends import gguf_meta
from modeld.backends.base import LoadOptions
from modeld.contract import Config, DecodeConfig, OpenSessionRequest, PrefixInput, SuffixInput
from modeld.engine import Engine
from modeld.errors import ModelChangedError
from modeld.settings import Residency

testmodels = pytest.importorskip("modeld.testmodels")
gguf = pytest.importorskip("gguf")

pytestmark = pytest.mark.llama

PREFIX = "You are a careful engineer.\nrepo: src/app.py main() load_config()\nsrc/db.py connect()\n" * 3
SUFFIX = "fix the failing test\n"
N = 12


@pytest.fixture(scope="module")
def files(tmp_path_factory: pytest.TempPathFactory) -> tuple[bytes, bytes]:
    """TINY's bytes, and the same bytes with other K/V weights (same size, same tokenizer)."""
    from gguf_craft import with_kv_of

    tiny = testmodels.ensure_model(testmodels.TINY)
    other = testmodels.ensure_model(replace(testmodels.TINY, seed=1))
    return tiny.read_bytes(), with_kv_of(tiny, other)


def _write_in_place(path: Path, data: bytes) -> None:
    """Overwrite without truncating (same inode; the worker's mapping sees the new bytes)."""
    with path.open("r+b") as f:
        f.write(data)


def _request(path: Path, **config: Any) -> OpenSessionRequest:
    return OpenSessionRequest(
        type="llama", path=str(path), config=Config(**{"num_ctx": 2048, "num_batch": 32, **config})
    )


class Fresh:
    """A fresh evaluation of a file's bytes: llama.cpp in this process, one sequence, emptied
    before each text (no warm state of any kind)."""

    def __init__(self, tmp: Path) -> None:
        self._dir = tmp
        self._memo: dict[bytes, list[int]] = {}

    def greedy(self, data: bytes, prefix: str = PREFIX, suffix: str = SUFFIX, n: int = N) -> list[int]:
        import hashlib

        key = hashlib.sha256(data + prefix.encode() + b"\0" + suffix.encode()).digest()
        if key not in self._memo:
            from modeld.backends.llama import LlamaBackend

            path = self._dir / f"fresh-{key.hex()[:12]}.gguf"
            path.write_bytes(data)
            backend = LlamaBackend()
            request = _request(path)
            rt = backend.load(
                request, backend.describe(request), LoadOptions(n_seq=1, window=2048, pool_tokens=2048)
            )
            try:
                tokens = rt.tokenize(prefix, add_bos=True) + rt.tokenize(suffix, add_bos=False)
                for _ in rt.sync(0, 0, tokens):
                    pass
                eog = rt.vocab().eog
                out: list[int] = []
                for token in rt.generate(0, DecodeConfig(max_tokens=n), n):
                    if token in eog:
                        break
                    out.append(token)
            finally:
                rt.close()
            self._memo[key] = out
        return self._memo[key]


@pytest.fixture(scope="module")
def fresh(tmp_path_factory: pytest.TempPathFactory) -> Fresh:
    return Fresh(tmp_path_factory.mktemp("fresh"))


def _turn(session: Any, prefix: str = PREFIX, suffix: str = SUFFIX) -> tuple[Any, list[int]]:
    status = session.ensure_prefix(PrefixInput(text=prefix))
    session.prefill_suffix(SuffixInput(text=suffix))
    with session.decode(DecodeConfig(max_tokens=N)) as stream:
        chunks = list(stream)
    assert chunks[-1].finish_reason in ("length", "stop"), chunks[-1]
    return status, [t for c in chunks for t in c.token_ids]


@pytest.fixture
def model(tmp_path: Path, files: tuple[bytes, bytes]) -> Path:
    path = tmp_path / "m.gguf"
    path.write_bytes(files[0])
    return path


@pytest.fixture
def engine(tmp_path: Path) -> Iterator[Engine]:
    with Engine(
        backends=("llama",), data_dir=tmp_path / "data", residency=Residency(persist_min_tokens=8)
    ) as e:
        yield e


def _rewrite(how: str, path: Path, data: bytes) -> None:
    st = path.stat()
    if how == "in place":
        _write_in_place(path, data)
    elif how == "in place, mtime put back":  # cp -p, rsync -t: only the ctime tells
        time.sleep(0.02)
        _write_in_place(path, data)
        os.utime(path, ns=(st.st_atime_ns, st.st_mtime_ns))
    elif how == "renamed over":  # a download renamed into place: the worker keeps the old inode
        part = path.with_name(path.name + ".part")
        part.write_bytes(data)
        os.replace(part, path)
    else:
        raise AssertionError(how)


@pytest.mark.parametrize("how", ["in place", "in place, mtime put back", "renamed over"])
def test_a_model_file_changed_under_an_open_session_fails_the_turn_then_a_new_session_is_fresh(
    engine: Engine, model: Path, files: tuple[bytes, bytes], fresh: Fresh, how: str
) -> None:
    old, new = files
    session = engine.open_session(_request(model))
    first, tokens = _turn(session)
    assert first.reuse.outcome == "cold"
    assert tokens == fresh.greedy(old)
    assert fresh.greedy(new) != fresh.greedy(old)  # the two files really answer differently

    _rewrite(how, model, new)
    with pytest.raises(ModelChangedError) as caught:
        _turn(session)
    err = caught.value
    assert err.reason == "model_changed" and err.path == str(model)
    assert str(model) in err.message and "open a new session" in err.message.lower()
    assert err.details["loaded_digest"] != err.details["digest"] != ""
    assert err.details["change"].split()[0] in ("rewritten", "changed", "replaced")
    for again in (  # the session has ended: every operation says why
        lambda: session.ensure_prefix(PrefixInput(text=PREFIX)),
        lambda: session.decode(DecodeConfig(max_tokens=2)),
    ):
        with pytest.raises(ModelChangedError):
            again()
    deadline = time.monotonic() + 30  # the old model is retired in the background
    while any(m.model_digest == err.details["loaded_digest"] for m in engine.status().models):
        assert time.monotonic() < deadline
        time.sleep(0.05)

    later = engine.open_session(_request(model))
    status, tokens = _turn(later)
    assert (status.reuse.outcome, status.reuse.reason) == ("cold", "model_changed")
    assert str(model) in status.reuse.message
    assert status.reused_tokens == 0
    assert tokens == fresh.greedy(new)
    session.close()
    later.close()


def test_old_snapshots_are_never_restored_for_the_new_file_and_are_again_for_the_old_bytes(
    tmp_path: Path, model: Path, files: tuple[bytes, bytes], fresh: Fresh
) -> None:
    """The RAM and disk tiers hold the old file's prefix (keyed by its digest): a new session on
    the rewritten file, and a daemon started after the rewrite, compute the new file's answer;
    once the old bytes are back, their snapshot serves again."""
    old, new = files
    data = tmp_path / "data"
    residency = Residency(persist_min_tokens=8)
    with Engine(backends=("llama",), data_dir=data, residency=residency) as engine:
        _turn(engine.open_session(_request(model)))
        engine.tiers.flush(30)
        assert engine.tiers.stats()["disk_entries"] >= 1
        _write_in_place(model, new)
        status, tokens = _turn(engine.open_session(_request(model)))
        assert (status.reuse.outcome, status.reuse.reason) == ("cold", "model_changed")
        assert tokens == fresh.greedy(new)
    with Engine(backends=("llama",), data_dir=data, residency=residency) as engine:  # a restart
        status, tokens = _turn(engine.open_session(_request(model)))
        assert status.reuse.reason == "restored_from_disk"  # the new file's own snapshot
        assert tokens == fresh.greedy(new)
        _write_in_place(model, old)
        status, tokens = _turn(engine.open_session(_request(model)))
        assert (status.reuse.outcome, status.reuse.reason) == ("warm", "restored_from_disk")
        assert tokens == fresh.greedy(old)


def test_a_file_changed_during_a_decode_ends_it_with_model_changed(
    engine: Engine, model: Path, files: tuple[bytes, bytes]
) -> None:
    """The engine may already have sampled every token on the old weights or on the new ones:
    the final chunk says ``model_changed`` instead of a normal finish, never a mixed answer."""
    session = engine.open_session(_request(model))
    session.ensure_prefix(PrefixInput(text=PREFIX))
    session.prefill_suffix(SuffixInput(text=SUFFIX))
    chunks = []
    with session.decode(DecodeConfig(max_tokens=64)) as stream:
        for chunk in stream:
            chunks.append(chunk)
            if len(chunks) == 1:
                _write_in_place(model, files[1])
    final = chunks[-1]
    assert final.finish_reason == "error" and final.error is not None
    assert final.error.reason == "model_changed"
    with pytest.raises(ModelChangedError):
        session.ensure_prefix(PrefixInput(text=PREFIX))


@pytest.mark.parametrize("how", ["touched", "same bytes written over it"])
def test_a_file_touched_or_rewritten_with_the_same_bytes_stays_warm(
    engine: Engine, model: Path, files: tuple[bytes, bytes], fresh: Fresh, how: str
) -> None:
    session = engine.open_session(_request(model))
    _turn(session)
    time.sleep(0.02)
    if how == "touched":
        os.utime(model)
    else:
        _write_in_place(model, files[0])
    status, tokens = _turn(session)
    assert (status.reuse.outcome, status.reuse.reason) == ("warm", "full_match")
    assert tokens == fresh.greedy(files[0])


def test_bytes_changed_under_an_identity_seen_while_the_file_was_being_written_are_caught(
    engine: Engine, model: Path, files: tuple[bytes, bytes], fresh: Fresh
) -> None:
    """A write moves a file's times when it starts, not as it copies: a check that looks while
    it copies sees the final identity over the old bytes, finds the loaded digest, and (before)
    trusted that identity for good, so the bytes that followed were served next to KV of the
    old weights. Crafted with a shared mapping: its first store to a page moves the times, its
    later stores to that page do not (the page is already dirty), so the file's bytes change
    under an identity a check has seen."""
    old, new = files
    at = next(i for i, (a, b) in enumerate(zip(old, new, strict=True)) if a != b)
    page = at - at % mmap.PAGESIZE
    end = min(page + mmap.PAGESIZE, len(old))
    session = engine.open_session(_request(model))
    _turn(session)
    with model.open("r+b") as f, mmap.mmap(f.fileno(), 0) as mapped:
        time.sleep(0.02)
        mapped[at] = old[at]  # the same byte: the times move, the bytes do not
        status, tokens = _turn(session)  # the check describes the moved file: the loaded digest
        assert (status.reuse.outcome, status.reuse.reason) == ("warm", "full_match")
        assert tokens == fresh.greedy(old)
        seen = model.stat()
        mapped[page:end] = new[page:end]  # the page is dirty: no fault, the times stay
        if (model.stat().st_mtime_ns, model.stat().st_ctime_ns) != (seen.st_mtime_ns, seen.st_ctime_ns):
            pytest.skip("this file system moved the times on a store to a dirty mapped page")
        mapped.flush()
    # The digest names the bytes now in the file (before: the one remembered for its identity).
    now = model.read_bytes()
    assert now != old
    assert gguf_meta.fingerprint(model) == gguf_meta.fingerprint(_copy(now, model.with_name("now.gguf")))
    with pytest.raises(ModelChangedError) as caught:
        _turn(session)
    assert caught.value.details["change"] == "changed"


def _copy(data: bytes, path: Path) -> Path:
    path.write_bytes(data)
    return path


def test_a_file_removed_under_an_open_session_is_model_changed(engine: Engine, model: Path) -> None:
    session = engine.open_session(_request(model))
    _turn(session)
    model.unlink()
    with pytest.raises(ModelChangedError) as caught:
        _turn(session)
    assert caught.value.details["change"] == "removed" and caught.value.details["digest"] == ""


@pytest.mark.wire
def test_over_the_wire_the_stream_ends_with_model_changed_and_a_new_session_is_fresh(
    tmp_path: Path, model: Path, files: tuple[bytes, bytes], fresh: Fresh
) -> None:
    data = tmp_path / "d"
    proc = start_serve(data, data / "d.sock", backend="llama")
    try:
        wait_serving(data, proc.pid, timeout=120)
        with rc.connect(data_dir=data) as client:
            session = client.open_session(_request(model))
            _turn(session)
            _write_in_place(model, files[1])
            with pytest.raises(rc.ModelChangedError) as caught:
                _turn(session)
            assert caught.value.details["path"] == str(model)
            with pytest.raises(rc.ModelChangedError):  # its stream ended with that status
                session.ensure_prefix(PrefixInput(text=PREFIX))
            later = client.open_session(_request(model))
            status, tokens = _turn(later)
            assert status.reuse.reason == "model_changed"
            assert tokens == fresh.greedy(files[1])
    finally:
        _, err = stop(proc, signal.SIGTERM)
        assert "Traceback" not in err, err[-3000:]


def test_the_daemon_never_mixes_models_when_a_worker_dies_of_the_change(
    engine: Engine, model: Path, files: tuple[bytes, bytes], fresh: Fresh
) -> None:
    """Truncated and written again (``cp`` over it): the worker may die of SIGBUS on its
    mapping; either way no turn runs on the new bytes under the old digest."""
    session = engine.open_session(_request(model))
    _turn(session)
    with model.open("wb") as f:  # truncates, then writes: what cp does
        f.write(files[1])
    (loaded,) = engine.models()
    os.kill(loaded.supervisor.status().pid, signal.SIGBUS)  # as if it touched a page past the end
    deadline = time.monotonic() + 30  # the death is noticed, the file checked, the model retired
    while engine.models():
        assert time.monotonic() < deadline
        time.sleep(0.05)
    assert loaded.supervisor.state == "stopped"  # not restarted on the new bytes
    with pytest.raises(ModelChangedError):
        _turn(session)
    status, tokens = _turn(engine.open_session(_request(model)))
    assert status.reuse.reason == "model_changed"
    assert tokens == fresh.greedy(files[1])
