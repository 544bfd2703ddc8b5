"""The real ``modeld`` command: describe, status, explain-context, and one-line errors."""

from __future__ import annotations

import json
import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest
from daemon_proc import modeld, start_serve, stop, wait_serving

import runtime_client as rc
from modeld.contract import PrefixInput

pytestmark = pytest.mark.wire


@pytest.fixture(scope="module")
def daemon() -> Iterator[Path]:
    data = Path(tempfile.mkdtemp(prefix="mdc"))
    proc = start_serve(data, data / "s.sock")
    try:
        wait_serving(data, proc.pid)
        yield data
    finally:
        stop(proc)


def test_describe_prints_the_window_and_kv_cost() -> None:
    out = modeld("describe", "--type", "memory", "--path", "tiny", "--num-ctx", "2048")
    assert out.returncode == 0, out.stderr
    assert "2048 tokens effective" in out.stdout
    assert "bytes per token" in out.stdout
    js = json.loads(modeld("describe", "--type", "memory", "--path", "tiny", "--json").stdout)
    assert js["backend"] == "memory"
    assert js["effective_context"] == js["model_max_context"]  # by default: the model's own window


def test_describe_of_a_missing_file_is_one_line_and_non_zero() -> None:
    out = modeld("describe", "--type", "memory", "--path", "/nonexistent/model.gguf")
    assert out.returncode == 1
    assert out.stderr.count("\n") == 1
    assert "model_load_failed" in out.stderr
    assert "Traceback" not in out.stderr


def test_status_shows_the_owner(daemon: Path) -> None:
    out = modeld("status", data_dir=daemon)
    assert out.returncode == 0, out.stderr
    assert "instance" in out.stdout and "epoch 1" in out.stdout
    js = json.loads(modeld("status", "--json", data_dir=daemon).stdout)
    assert js["epoch"] == 1
    assert js["backends"] == ["memory"]


def test_explain_context_lists_sessions_and_explains_one(daemon: Path) -> None:
    with rc.connect(data_dir=daemon) as client:
        session = client.open_session(rc.OpenSessionRequest(type="memory", path="tiny"))
        ctx = (
            rc.ContextBuilder(identity=session.identity)
            .system("sys\n")
            .repo_map("a.py\n")
            .user_turn("go\n")
            .build()
        )
        session.ensure_prefix(ctx.prefix_input())
        edited = (
            rc.ContextBuilder(identity=session.identity)
            .system("sys\n")
            .repo_map("b.py\n")
            .user_turn("go\n")
            .build()
        )
        session.ensure_prefix(edited.prefix_input())
        session.prefill_suffix(edited.suffix_input())

        listing = modeld("explain-context", data_dir=daemon)
        assert listing.returncode == 0, listing.stderr
        assert session.session_id in listing.stdout
        assert "attached" in listing.stdout

        one = modeld("explain-context", session.session_id, data_dir=daemon)
        assert one.returncode == 0, one.stderr
        text = one.stdout
        assert "PARTIAL (diverged)" in text
        assert "in segment 'repo_map'" in text
        assert "repo_map" in text and "user_turn" in text
        assert session.identity.model_digest[:12] in text

        js = json.loads(modeld("explain-context", session.session_id, "--json", data_dir=daemon).stdout)
        assert js["session_id"] == session.session_id
        assert js["last_reuse"]["reason"] == "diverged"
        assert [s["kind"] for s in js["manifest"]["segments"]] == ["system", "repo_map", "user_turn"]
        session.close()
        closed = modeld("explain-context", session.session_id, data_dir=daemon)
        assert "closed" in closed.stdout


def test_unknown_session_is_one_clear_line(daemon: Path) -> None:
    out = modeld("explain-context", "nope", data_dir=daemon)
    assert out.returncode == 1
    assert "session_not_found" in out.stderr
    assert "Traceback" not in out.stderr


def test_no_daemon_is_a_clear_line_and_exit_4() -> None:
    empty = Path(tempfile.mkdtemp(prefix="mdc"))
    out = modeld("status", data_dir=empty)
    assert out.returncode == 4
    assert "no modeld daemon" in out.stderr
    assert "Traceback" not in out.stderr
    out = modeld("--address", "unix:/nonexistent/x.sock", "status")
    assert out.returncode == 4
    assert "could not reach modeld" in out.stderr


def test_serve_refuses_a_non_loopback_address() -> None:
    empty = Path(tempfile.mkdtemp(prefix="mdc"))
    out = modeld("serve", "--listen", "0.0.0.0:0", data_dir=empty, timeout=30)
    assert out.returncode == 2
    assert "--allow-remote" in out.stderr
    assert "Traceback" not in out.stderr


def test_serve_on_loopback_tcp(tmp_path: Path) -> None:
    data = Path(tempfile.mkdtemp(prefix="mdc"))
    import subprocess

    from daemon_proc import MODELD

    proc = subprocess.Popen(
        [MODELD, "--data-dir", str(data), "serve", "--backend", "memory", "--listen", "127.0.0.1:0"],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        record = wait_serving(data, proc.pid)
        assert record.endpoint.startswith("127.0.0.1:")
        with (
            rc.connect(data_dir=data) as client,
            client.open_session(rc.OpenSessionRequest(type="memory", path="tiny")) as s,
        ):
            assert s.ensure_prefix(PrefixInput(text="tcp\n")).prefix_tokens == 5
    finally:
        stop(proc)  # type: ignore[arg-type]
