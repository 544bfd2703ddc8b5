"""Looking at a model path safely, before anything reads it, and noticing when it changes later.

What:

* :func:`open_model_file` opens a model file for reading only if it is a regular file (a
  symlink to one is fine). A FIFO, socket, character or block device, or a directory is refused
  at once with ``model_load_failed`` naming what it is, and nothing ever blocks: the path is
  classified with ``stat`` first, then opened with ``O_PATH`` (which never runs a device
  driver's ``open``, so no tape rewinds and no watchdog arms), checked with ``fstat``, and
  reopened for reading through ``/proc/self/fd`` with ``O_NONBLOCK``, so the file that is read is
  exactly the inode that was checked (no stat/open race). Without ``/proc`` it falls back to
  ``open(O_RDONLY | O_NONBLOCK)`` + ``fstat``, which still never blocks.
* :func:`probe_model_path` does the same for backends that also take directories (OpenVINO IR):
  a directory is accepted when every entry in it is a regular file or a directory.
* OS errors on a path (``ENOENT``, ``ENAMETOOLONG``, ``EIO``, ``EACCES``, ``ELOOP``,
  ``ENOTDIR``, ...) become ``model_load_failed`` with a plain message, never ``internal``. A
  relative path is resolved by the daemon from its own working directory, which may not be the
  client's: every error on one says so and suggests an absolute path.
* :class:`FileIdentity` (device, inode, size, mtime, ctime) is what the file was when it was
  described or loaded; :func:`changed` says what happened to it since (removed, replaced,
  truncated, rewritten in place), so a worker that dies of SIGBUS can be reported as "the model
  file changed while loaded". An identity is trusted to name the bytes read under it only once
  the file has not changed for :data:`SETTLE_NS` (:meth:`FileIdentity.settled`): a write still
  copying shows the final identity over a mix of bytes. A :class:`Probe` is the identity of a whole model path (a
  directory's files too): the engine compares one before every turn that would reuse KV.

Errors never contain bytes read from the file, and paths in messages are escaped and cut to
:data:`MAX_SHOWN_PATH` characters (:func:`show_path`).

What not: no timeout here. ``stat`` or ``read`` on a hung network file system can still block the
calling thread; describing happens off the request threads for that reason (the engine's job).
Decision record: ``blueprints/0013-probing-and-inventory.md``.
"""

from __future__ import annotations

import errno
import os
import stat
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

from modeld.contract import Closing
from modeld.errors import InvalidArgumentError, ModelLoadError

__all__ = [
    "MAX_DIRECTORY_ENTRIES",
    "MAX_SHOWN_PATH",
    "FileIdentity",
    "ModelFile",
    "Probe",
    "changed",
    "file_kind",
    "identify",
    "open_model_file",
    "probe_model_path",
    "show_path",
]

MAX_SHOWN_PATH = 200
"""Characters of a client-supplied path echoed in a message (the rest is cut, with a note)."""

MAX_DIRECTORY_ENTRIES = 1024
"""Entries a model directory may have (an OpenVINO IR directory has about ten)."""

SETTLE_NS = 2_000_000_000
"""How long after its last change a file's bytes are trusted to match its identity (2 s: above
the coarsest timestamp tick of the file systems models live on, FAT's 2 s aside)."""

_O_PATH = getattr(os, "O_PATH", 0)
_O_CLOEXEC = getattr(os, "O_CLOEXEC", 0)
_O_NONBLOCK = getattr(os, "O_NONBLOCK", 0)

_KINDS = (
    (stat.S_ISREG, "a regular file"),
    (stat.S_ISDIR, "a directory"),
    (stat.S_ISFIFO, "a FIFO (named pipe)"),
    (stat.S_ISSOCK, "a socket"),
    (stat.S_ISCHR, "a character device"),
    (stat.S_ISBLK, "a block device"),
)

_ERRNO_TEXT = {
    errno.ENOENT: "does not exist",
    errno.ENOTDIR: "does not exist (a component of the path is not a directory)",
    errno.ENAMETOOLONG: "is too long for the file system (a component over 255 bytes, or the whole path)",
    errno.EACCES: "is not readable by the daemon (permission denied)",
    errno.EPERM: "is not readable by the daemon (operation not permitted)",
    errno.ELOOP: "has too many levels of symbolic links (a loop?)",
    errno.EIO: "could not be read (I/O error from the file system or device)",
    errno.ENXIO: "is a socket or a device with nothing behind it",
    errno.ENODEV: "is a device with no driver",
    errno.EOVERFLOW: "is too large for this system to open",
    errno.ESTALE: "is on a network file system that lost it (stale file handle)",
    errno.ENOMEM: "could not be opened (the kernel is out of memory)",
    errno.EMFILE: "could not be opened (the daemon has too many open files)",
    errno.ENFILE: "could not be opened (the system has too many open files)",
}


def show_path(raw: str) -> str:
    """``raw`` quoted and escaped (``repr``), cut to :data:`MAX_SHOWN_PATH` characters."""
    if len(raw) <= MAX_SHOWN_PATH:
        return repr(raw)
    return f"{raw[:MAX_SHOWN_PATH]!r}... ({len(raw)} characters)"


def file_kind(mode: int) -> str:
    """What a ``st_mode`` is, in words ("a FIFO (named pipe)", "a socket", ...)."""
    for test, name in _KINDS:
        if test(mode):
            return name
    return "not a regular file"


@dataclass(frozen=True, slots=True)
class FileIdentity:
    """What a file was when it was looked at: enough to tell that it changed since.

    ``ctime_ns`` is the inode's change time: a write in place moves it even when the writer puts
    the modification time back (``touch -r``, ``cp -p``, ``rsync -t``), and nobody can set it."""

    dev: int
    inode: int
    size: int
    mtime_ns: int
    ctime_ns: int

    @classmethod
    def of(cls, st: os.stat_result) -> FileIdentity:
        return cls(
            dev=st.st_dev, inode=st.st_ino, size=st.st_size, mtime_ns=st.st_mtime_ns, ctime_ns=st.st_ctime_ns
        )

    def settled(self) -> bool:
        """Whether the file's last change is more than :data:`SETTLE_NS` old, so that its bytes
        can be trusted to belong to this identity.

        A write moves the times when it starts, not as it copies: a reader that looks while
        one ``write`` (or several within one tick of a file system's coarse clock) is still
        copying sees the final identity and a mix of old and new bytes. What is read from a
        file changed within the window is used once and never remembered under its identity
        (git's "racily clean" entries, for the same reason)."""
        return time.time_ns() - self.ctime_ns > SETTLE_NS


def changed(path: str | os.PathLike[str], identity: FileIdentity) -> str | None:
    """What happened to the file at ``path`` since ``identity`` was taken, or None if nothing did.

    The answer starts with a stable word: ``removed``, ``replaced`` (another file now has the
    name: a re-download renamed over it), ``truncated`` or ``rewritten`` (same file, other
    size or modification time), ``changed`` (same size and modification time, but the inode
    changed: a write that put the time back, or only its metadata: the caller compares
    contents), or ``unreadable`` (the path gives an OS error now).
    """
    try:
        st = os.stat(path)
    except FileNotFoundError:
        return "removed"
    except OSError as exc:
        return f"unreadable ({errno.errorcode.get(exc.errno or 0, 'error')})"
    except ValueError:
        return "unreadable (invalid path)"
    if (st.st_dev, st.st_ino) != (identity.dev, identity.inode):
        return "replaced by another file"
    if st.st_size < identity.size:
        return f"truncated in place ({identity.size} -> {st.st_size} bytes)"
    if st.st_size != identity.size or st.st_mtime_ns != identity.mtime_ns:
        return f"rewritten in place ({identity.size} -> {st.st_size} bytes)"
    if st.st_ctime_ns != identity.ctime_ns:
        return f"changed in place (same size, {st.st_size} bytes, and modification time)"
    return None


def _resolved(raw: str) -> tuple[Path, str]:
    """The path the daemon will use for ``raw``, and what to add to errors about it."""
    if not raw:
        raise InvalidArgumentError("a model path is required", field="path")
    if "\0" in raw:
        raise InvalidArgumentError("the model path contains a NUL character", field="path")
    path = Path(raw).expanduser()
    if path.is_absolute():
        return path, ""
    try:
        cwd = os.getcwd()
    except OSError:
        cwd = "?"
    hint = (
        f" (a relative path is resolved by the daemon from its own working directory, "
        f"{show_path(cwd)}, not the client's: pass an absolute path)"
    )
    return path, hint


def _os_error(raw: str, what: str, exc: OSError, hint: str) -> ModelLoadError:
    code = exc.errno or 0
    text = _ERRNO_TEXT.get(code) or f"could not be opened ({os.strerror(code)})"
    return ModelLoadError(
        f"{what} {show_path(raw)} {text}{hint}",
        path=raw[:MAX_SHOWN_PATH],
        errno=errno.errorcode.get(code, str(code)),
    )


def _refuse_kind(raw: str, what: str, mode: int, hint: str, accepted: str) -> ModelLoadError:
    return ModelLoadError(
        f"{what} {show_path(raw)} is {file_kind(mode)}, not {accepted}{hint}",
        path=raw[:MAX_SHOWN_PATH],
        kind=file_kind(mode),
    )


class ModelFile(Closing):
    """A model file opened for reading (regular files only); close it, or use ``with``.

    ``path`` is what the daemon resolved (``~`` expanded; relative paths stay relative to the
    daemon's working directory), ``identity`` what the opened inode was at open time.
    """

    def __init__(self, raw: str, path: Path, fd: int, identity: FileIdentity) -> None:
        self.raw = raw
        self.path = path
        self.identity = identity
        self._fd = fd

    @property
    def fd(self) -> int:
        return self._fd

    def read_at(self, offset: int, size: int) -> bytes:
        """Up to ``size`` bytes at ``offset`` (fewer at the end of the file)."""
        first = os.pread(self._fd, size, offset)
        if len(first) in (0, size):
            return first
        out = bytearray(first)  # a short read before the end (rare on regular files)
        while len(out) < size:
            chunk = os.pread(self._fd, size - len(out), offset + len(out))
            if not chunk:
                break
            out += chunk
        return bytes(out)

    def chunks(self, start: int = 0, size: int = 1 << 20) -> Iterator[bytes]:
        """The file from ``start`` to its end, ``size`` bytes at a time."""
        offset = start
        while True:
            chunk = os.pread(self._fd, size, offset)
            if not chunk:
                return
            offset += len(chunk)
            yield chunk

    def still_same(self) -> bool:
        """Whether the open inode still has the size, mtime and ctime it had when opened."""
        return FileIdentity.of(os.fstat(self._fd)) == self.identity

    def close(self) -> None:
        if self._fd >= 0:
            os.close(self._fd)
            self._fd = -1


def _open_checked(path: Path) -> tuple[int, os.stat_result]:
    """Open ``path`` for reading without blocking and without running a device's open;
    return the descriptor and its ``fstat``. The caller checks the file type."""
    if _O_PATH:
        pfd = os.open(path, _O_PATH | _O_CLOEXEC)
        try:
            st = os.fstat(pfd)
            if not stat.S_ISREG(st.st_mode):
                return -1, st
            try:
                fd = os.open(f"/proc/self/fd/{pfd}", os.O_RDONLY | _O_NONBLOCK | _O_CLOEXEC)
            except FileNotFoundError:  # no /proc: open the path itself (still non-blocking)
                fd = os.open(path, os.O_RDONLY | _O_NONBLOCK | _O_CLOEXEC)
        finally:
            os.close(pfd)
    else:  # pragma: no cover - not Linux
        fd = os.open(path, os.O_RDONLY | _O_NONBLOCK | _O_CLOEXEC)
    st = os.fstat(fd)
    if not stat.S_ISREG(st.st_mode):
        os.close(fd)
        return -1, st
    return fd, st


def open_model_file(raw: str, *, what: str = "model file") -> ModelFile:
    """Open the regular file ``raw`` names, or raise the clear error for what is there instead.

    ``what`` names the file in messages ("model file", "IR file", ...).
    """
    path, hint = _resolved(raw)
    try:
        st = os.stat(path)
        if not stat.S_ISREG(st.st_mode):
            raise _refuse_kind(raw, what, st.st_mode, hint, "a regular file")
        fd, st = _open_checked(path)
    except OSError as exc:
        raise _os_error(raw, what, exc, hint) from None
    if fd < 0:  # it changed between stat and open
        raise _refuse_kind(raw, what, st.st_mode, hint, "a regular file")
    return ModelFile(raw, path, fd, FileIdentity.of(st))


def identify(raw: str, *, what: str = "model file") -> FileIdentity:
    """The identity of the regular file ``raw`` names now (for a check at load time)."""
    with open_model_file(raw, what=what) as f:
        return f.identity


@dataclass(frozen=True, slots=True)
class Probe:
    """What a model path is: a regular ``file`` or a ``directory``.

    For a directory, ``files`` maps each regular file in it (not recursively) to its identity.
    """

    raw: str
    path: Path
    kind: str  # file | directory
    identity: FileIdentity
    files: tuple[tuple[str, FileIdentity], ...] = ()

    def settled(self) -> bool:
        """Whether the path and every file in it are :meth:`FileIdentity.settled`."""
        return self.identity.settled() and all(identity.settled() for _, identity in self.files)


def probe_model_path(raw: str, *, directory_ok: bool = False, what: str = "model path") -> Probe:
    """Classify ``raw`` without reading it: a regular file, or (when ``directory_ok``) a
    directory whose entries are all regular files or directories. Anything else, or any OS
    error, is ``model_load_failed``."""
    path, hint = _resolved(raw)
    accepted = "a regular file or a directory" if directory_ok else "a regular file"
    try:
        st = os.stat(path)
    except OSError as exc:
        raise _os_error(raw, what, exc, hint) from None
    if stat.S_ISREG(st.st_mode):
        return Probe(raw, path, "file", FileIdentity.of(st))
    if not (directory_ok and stat.S_ISDIR(st.st_mode)):
        raise _refuse_kind(raw, what, st.st_mode, hint, accepted)
    files: list[tuple[str, FileIdentity]] = []
    try:
        with os.scandir(path) as entries:
            for count, entry in enumerate(entries, start=1):
                if count > MAX_DIRECTORY_ENTRIES:
                    raise ModelLoadError(
                        f"{what} {show_path(raw)} has more than {MAX_DIRECTORY_ENTRIES} entries; "
                        "a model directory has a few files",
                        path=raw[:MAX_SHOWN_PATH],
                        limit="max_directory_entries",
                    )
                try:
                    est = os.stat(entry.path)  # follows symlinks: a link to a FIFO is a FIFO
                except OSError as exc:
                    raise _os_error(entry.name, f"{show_path(raw)}: entry", exc, hint) from None
                if stat.S_ISREG(est.st_mode):
                    files.append((entry.name, FileIdentity.of(est)))
                elif not stat.S_ISDIR(est.st_mode):
                    raise ModelLoadError(
                        f"{show_path(entry.name)} in {what} {show_path(raw)} is "
                        f"{file_kind(est.st_mode)}; a model directory holds only files and "
                        f"directories{hint}",
                        path=raw[:MAX_SHOWN_PATH],
                        kind=file_kind(est.st_mode),
                    )
    except OSError as exc:
        raise _os_error(raw, what, exc, hint) from None
    return Probe(raw, path, "directory", FileIdentity.of(st), tuple(sorted(files)))
