"""Model paths are probed safely: what is not a regular file is refused at once (a FIFO never
blocks), OS errors are clear ``model_load_failed`` errors, messages are bounded and escaped and
never quote file bytes, and a file's identity tells later what happened to it."""

from __future__ import annotations

import os
import socket
import stat
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from modeld.backends.probe import (
    MAX_SHOWN_PATH,
    FileIdentity,
    changed,
    identify,
    open_model_file,
    probe_model_path,
    show_path,
)
from modeld.contract import OpenSessionRequest
from modeld.engine import Engine
from modeld.errors import InvalidArgumentError, ModelLoadError


@pytest.fixture
def fifo(tmp_path: Path) -> Path:
    path = tmp_path / "model.gguf"
    os.mkfifo(path)
    return path


@pytest.fixture
def unix_socket(tmp_path: Path) -> Iterator[Path]:
    path = tmp_path / "model.sock"
    with socket.socket(socket.AF_UNIX) as s:
        s.bind(str(path))
        yield path


def _refused(raw: str) -> ModelLoadError:
    with pytest.raises(ModelLoadError) as err:
        open_model_file(raw)
    return err.value


# --- what is not a regular file ---------------------------------------------------------------


def test_a_fifo_is_refused_at_once_and_named(fifo: Path) -> None:
    """Nobody writes to this FIFO: an open() without O_NONBLOCK would wait forever."""
    err = _refused(str(fifo))
    assert err.reason == "model_load_failed"
    assert err.details["kind"] == "a FIFO (named pipe)"
    assert str(err) == f"model file {str(fifo)!r} is a FIFO (named pipe), not a regular file"


def test_a_symlink_to_a_fifo_is_a_fifo(fifo: Path, tmp_path: Path) -> None:
    link = tmp_path / "link.gguf"
    link.symlink_to(fifo)
    assert _refused(str(link)).details["kind"] == "a FIFO (named pipe)"


def test_a_socket_is_refused(unix_socket: Path) -> None:
    assert _refused(str(unix_socket)).details["kind"] == "a socket"


def test_character_devices_are_refused_without_being_opened() -> None:
    for device in ("/dev/zero", "/dev/null"):
        assert _refused(device).details["kind"] == "a character device"


def test_a_block_device_is_refused() -> None:
    devices = [
        e.path for e in os.scandir("/dev") if stat.S_ISBLK(os.stat(e.path, follow_symlinks=False).st_mode)
    ]
    if not devices:
        pytest.skip("no block device on this machine")
    assert _refused(devices[0]).details["kind"] == "a block device"


def test_a_directory_is_not_a_model_file(tmp_path: Path) -> None:
    err = _refused(str(tmp_path))
    assert err.details["kind"] == "a directory"
    assert "is a directory, not a regular file" in str(err)


def test_a_regular_file_opens_with_its_identity(tmp_path: Path) -> None:
    path = tmp_path / "m.bin"
    path.write_bytes(b"0123456789")
    st = path.stat()
    with open_model_file(str(path)) as f:
        assert f.identity == FileIdentity(st.st_dev, st.st_ino, 10, st.st_mtime_ns, st.st_ctime_ns)
        assert f.read_at(3, 4) == b"3456"
        assert f.read_at(8, 100) == b"89"
        assert b"".join(f.chunks(size=4)) == b"0123456789"
        assert f.still_same()
    assert identify(str(path)) == f.identity


def test_a_symlink_to_a_regular_file_is_that_file(tmp_path: Path) -> None:
    target = tmp_path / "m.bin"
    target.write_bytes(b"abc")
    link = tmp_path / "link.bin"
    link.symlink_to(target)
    assert identify(str(link)).inode == target.stat().st_ino


# --- OS errors ----------------------------------------------------------------------------------


def test_os_errors_are_model_load_failed_with_plain_words(tmp_path: Path) -> None:
    file = tmp_path / "file"
    file.write_text("x")
    loop = tmp_path / "loop"
    loop.symlink_to(tmp_path / "loop2")
    (tmp_path / "loop2").symlink_to(loop)
    cases = [
        (tmp_path / "missing.gguf", "ENOENT", "does not exist"),
        (file / "model.gguf", "ENOTDIR", "a component of the path is not a directory"),
        (tmp_path / ("x" * 300), "ENAMETOOLONG", "is too long for the file system"),
        (loop, "ELOOP", "too many levels of symbolic links"),
    ]
    for path, code, words in cases:
        err = _refused(str(path))
        assert err.details["errno"] == code
        assert words in str(err)


def test_permission_denied_is_model_load_failed(tmp_path: Path) -> None:
    if os.geteuid() == 0:
        pytest.skip("root reads every file")
    path = tmp_path / "secret.gguf"
    path.write_text("x")
    path.chmod(0)
    err = _refused(str(path))
    assert err.details["errno"] == "EACCES"
    assert "is not readable by the daemon (permission denied)" in str(err)


def test_a_nul_in_the_path_is_an_invalid_argument() -> None:
    with pytest.raises(InvalidArgumentError) as err:
        open_model_file("model\0.gguf")
    assert err.value.field == "path"
    with pytest.raises(InvalidArgumentError):
        open_model_file("")


def test_a_relative_path_error_says_who_resolves_it(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(tmp_path)
    err = _refused("models/missing.gguf")
    assert str(err) == (
        "model file 'models/missing.gguf' does not exist (a relative path is resolved by the daemon "
        f"from its own working directory, {str(tmp_path)!r}, not the client's: pass an absolute path)"
    )
    (tmp_path / "here.gguf").write_bytes(b"GGUF")
    assert identify("here.gguf").size == 4


# --- what the messages echo -------------------------------------------------------------------


def test_echoed_paths_are_escaped_and_cut(tmp_path: Path) -> None:
    odd = str(tmp_path / "line\nbreak\x1b[31m.gguf")
    err = _refused(odd)
    assert "\n" not in str(err) and "\x1b" not in str(err)
    assert "line\\nbreak\\x1b[31m.gguf" in str(err)
    long = "/" + "/".join(["d" * 200] * 20)  # 4020 characters, every component too long
    err = _refused(long)
    assert len(str(err)) < MAX_SHOWN_PATH + 200
    assert str(err).startswith(f"model file {long[:MAX_SHOWN_PATH]!r}... (4020 characters) ")
    assert len(err.details["path"]) == MAX_SHOWN_PATH
    assert show_path("short") == "'short'"


def test_a_secret_file_is_never_quoted(tmp_path: Path) -> None:
    """Before, describe said what a non-GGUF file starts with (measured on /etc/shadow)."""
    from modeld.backends.gguf_meta import read_gguf

    secret = tmp_path / "shadow"
    secret.write_bytes(b"admin:$6$s4ltS3cret$h4sh:19000:0:99999:7:::\n")
    with pytest.raises(ModelLoadError) as err:
        read_gguf(str(secret))
    assert str(err.value) == f"{str(secret)!r} is not a GGUF file (it does not start with the GGUF magic)"
    assert not any("adm" in v or "S3cret" in v for v in err.value.details.values())


# --- directories (OpenVINO IR) ------------------------------------------------------------------


def test_a_model_directory_lists_its_files_and_refuses_special_entries(tmp_path: Path) -> None:
    ir = tmp_path / "ir"
    ir.mkdir()
    (ir / "openvino_model.xml").write_text("<net/>")
    (ir / "openvino_model.bin").write_bytes(b"\0" * 16)
    (ir / "sub").mkdir()
    probe = probe_model_path(str(ir), directory_ok=True)
    assert probe.kind == "directory"
    assert [(name, ident.size) for name, ident in probe.files] == [
        ("openvino_model.bin", 16),
        ("openvino_model.xml", 6),
    ]
    with pytest.raises(ModelLoadError) as err:
        probe_model_path(str(ir))  # a GGUF backend takes no directory
    assert err.value.details["kind"] == "a directory"
    os.mkfifo(ir / "openvino_tokenizer.bin")
    with pytest.raises(ModelLoadError) as err:
        probe_model_path(str(ir), directory_ok=True)
    assert str(err.value).startswith(
        f"'openvino_tokenizer.bin' in model path {str(ir)!r} is a FIFO (named pipe)"
    )
    (ir / "openvino_tokenizer.bin").unlink()
    (ir / "dangling").symlink_to(ir / "nowhere")
    with pytest.raises(ModelLoadError) as err:
        probe_model_path(str(ir), directory_ok=True)
    assert "'dangling' does not exist" in str(err.value)


def test_a_regular_file_probes_as_a_file(tmp_path: Path) -> None:
    path = tmp_path / "m.gguf"
    path.write_bytes(b"GGUF")
    probe = probe_model_path(str(path), directory_ok=True)
    assert (probe.kind, probe.identity.size, probe.files) == ("file", 4, ())


# --- identity and change ------------------------------------------------------------------------


def test_changed_says_what_happened_to_a_file(tmp_path: Path) -> None:
    path = tmp_path / "model.gguf"
    path.write_bytes(b"a" * 100)
    identity = identify(str(path))
    assert changed(path, identity) is None

    with path.open("r+b") as f:  # same size, new bytes (a re-download written over the old file)
        f.write(b"b" * 100)
    os.utime(path, ns=(identity.mtime_ns + 1_000_000, identity.mtime_ns + 1_000_000))
    assert changed(path, identity) == "rewritten in place (100 -> 100 bytes)"

    os.truncate(path, 40)
    assert changed(path, identity) == "truncated in place (100 -> 40 bytes)"

    fresh = tmp_path / "download.part"
    fresh.write_bytes(b"a" * 100)
    os.replace(fresh, path)
    assert changed(path, identity) == "replaced by another file"

    path.unlink()
    assert changed(path, identity) == "removed"

    path.parent.joinpath("dir").write_text("not a directory")
    assert changed(path.parent / "dir" / "model.gguf", identity) == "unreadable (ENOTDIR)"


def test_a_write_in_place_that_puts_the_modification_time_back_is_still_seen(tmp_path: Path) -> None:
    """``cp -p``, ``rsync -t`` and ``touch -r`` restore the mtime; the inode's ctime still moves."""
    path = tmp_path / "model.gguf"
    path.write_bytes(b"a" * 100)
    identity = identify(str(path))
    time.sleep(0.02)  # past the file system's timestamp granularity
    with path.open("r+b") as f:
        f.write(b"b" * 100)
    os.utime(path, ns=(identity.mtime_ns, identity.mtime_ns))
    assert os.stat(path).st_mtime_ns == identity.mtime_ns
    assert changed(path, identity) == "changed in place (same size, 100 bytes, and modification time)"
    assert identify(str(path)) != identity


# --- through the engine: clear errors, never internal ------------------------------------------


def test_the_memory_backend_refuses_special_files_and_bad_paths(
    fifo: Path, unix_socket: Path, tmp_path: Path
) -> None:
    engine = Engine(backends=("memory",))
    for path, words in (
        (str(fifo), "is a FIFO (named pipe)"),
        (str(unix_socket), "is a socket"),
        ("/dev/zero", "is a character device"),
        (str(tmp_path / ("y" * 300) / "m.gguf"), "is too long for the file system"),
        (str(tmp_path) + "/", "is a directory"),
    ):
        with pytest.raises(ModelLoadError) as err:
            engine.describe(OpenSessionRequest(type="memory", path=path))
        assert words in str(err.value)
    model = tmp_path / "weights.bin"
    model.write_bytes(b"w" * 3000)
    info = engine.describe(OpenSessionRequest(type="memory", path=str(model)))
    assert info.weights_bytes == 3000
    engine.shutdown()


@pytest.mark.wire
def test_a_fifo_over_the_wire_is_model_load_failed(wire: object, fifo: Path) -> None:
    h = wire
    with pytest.raises(ModelLoadError) as err:
        h.service.describe(h.request(path=str(fifo)))  # type: ignore[attr-defined]
    assert err.value.details["kind"] == "a FIFO (named pipe)"
    assert h.service.describe(h.request()).backend == "memory"  # type: ignore[attr-defined]


@pytest.mark.openvino
def test_openvino_describe_refuses_a_fifo_inside_an_ir_directory(tmp_path: Path) -> None:
    openvino = pytest.importorskip("modeld.backends.openvino")
    ir = tmp_path / "ir"
    ir.mkdir()
    (ir / "openvino_model.xml").write_text("<net/>")
    os.mkfifo(ir / "openvino_model.bin")  # read_model would wait on it forever
    with pytest.raises(ModelLoadError) as err:
        openvino.OpenVINOBackend().describe(OpenSessionRequest(type="openvino", path=str(ir)))
    assert err.value.details["kind"] == "a FIFO (named pipe)"
    assert "'openvino_model.bin' in model path" in str(err.value)
