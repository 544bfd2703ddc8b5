"""``python -m modeld.workers.child``: the engine worker process (one loaded model).

Started by the daemon with ``subprocess`` (never ``fork``: OpenMP thread pools do not survive
it, and the daemon must never import llama.cpp or OpenVINO itself), in a process group of its
own, with one end of a socket pair as ``--fd``. It imports the backend named by the first
``Load`` request, serves protocol frames until ``Close``, and exits.

No orphans: the worker asks the kernel for SIGKILL when its parent dies
(``PR_SET_PDEATHSIG``), checks that the parent it was started by is still its parent (the
daemon may have died before that call), and exits as soon as the socket reaches EOF. Its log
(llama.cpp's own lines included) goes to stderr, which the daemon keeps in a ring buffer.
"""

from __future__ import annotations

import argparse
import ctypes
import ctypes.util
import importlib
import logging
import os
import signal
import socket
import sys
import threading
import typing

from modeld.backends.base import ModelRuntime
from modeld.errors import InvalidArgumentError
from modeld.observe.memory import rss
from modeld.workers.protocol import (
    HEAD_SIZE,
    Load,
    Message,
    ProtocolError,
    decode_frame,
    encode_frame,
    frame_sizes,
)
from modeld.workers.scheduler import Scheduler

__all__ = ["load_runtime", "main", "read_frame"]

log = logging.getLogger("modeld.worker")

PR_SET_PDEATHSIG = 1

_BACKENDS = {
    "memory": ("modeld.backends.memory", "MemoryBackend", "modeld.backends.memory"),
    "llama": ("modeld.backends.llama", "LlamaBackend", "modeld.backends.llama_runtime"),
    "openvino": ("modeld.backends.openvino", "OpenVINOBackend", "modeld.backends.openvino_runtime"),
}
"""Per backend: its module, its class, and the module of its runtime (the engine's libraries)."""


def _die_with_parent(parent: int) -> None:
    libc_name = ctypes.util.find_library("c")
    if libc_name:
        libc = ctypes.CDLL(libc_name, use_errno=True)
        libc.prctl(PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)
    if os.getppid() != parent:  # the daemon died before prctl took effect
        os._exit(0)


def read_exact(sock: socket.socket, n: int) -> bytes | None:
    """``n`` bytes, or None at EOF. A ``bytearray`` typed as ``bytes``: a KV snapshot's tens of
    megabytes are not copied again; the message it lands in is used once, so a restore may edit
    it in place (``ModelRuntime.restore``)."""
    buf = bytearray(n)
    view = memoryview(buf)
    got = 0
    while got < n:
        k = sock.recv_into(view[got:], n - got)
        if k == 0:
            return None
        got += k
    return typing.cast(bytes, buf)


def read_frame(sock: socket.socket) -> tuple[int, Message] | None:
    """The next frame's operation id and message, or None at EOF."""
    head = read_exact(sock, HEAD_SIZE)
    if head is None:
        return None
    header_len, payload_len = frame_sizes(head)
    header = read_exact(sock, header_len)
    payload = read_exact(sock, payload_len) if payload_len else b""
    if header is None or payload is None:
        return None
    return decode_frame(header, payload)


def load_runtime(message: Load) -> tuple[ModelRuntime, int]:
    """Import the backend a ``Load`` names and load its model (in this process). Also returns
    this process's resident memory just before the model loaded, its backend's libraries
    imported: the runtime's own part of a worker's memory (``ModelMemory.runtime_bytes``)."""
    entry = _BACKENDS.get(message.backend)
    if entry is None:
        raise InvalidArgumentError(f"unknown backend {message.backend!r}", field="type")
    module = importlib.import_module(entry[0])
    backend = getattr(module, entry[1])()
    importlib.import_module(entry[2])  # the engine's libraries, before the baseline
    before = rss(os.getpid())
    runtime: ModelRuntime = backend.load(message.request, message.info, message.options)
    return runtime, before


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="modeld.workers.child")
    parser.add_argument("--fd", type=int, required=True)
    parser.add_argument("--parent", type=int, required=True)
    parser.add_argument("--log-level", default="INFO")
    args = parser.parse_args(argv)
    _die_with_parent(args.parent)
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # the daemon decides when we stop
    logging.basicConfig(
        stream=sys.stderr,
        level=getattr(logging, str(args.log_level).upper(), logging.INFO),
        format="%(levelname)s %(name)s: %(message)s",
    )
    sock = socket.socket(fileno=args.fd)
    send_lock = threading.Lock()

    def send(op: int, message: Message) -> None:
        parts = encode_frame(op, message)
        with send_lock:
            try:
                for part in parts:
                    sock.sendall(part)
            except OSError:
                os._exit(0)  # the daemon is gone

    scheduler = Scheduler(send, load_runtime)

    def reader() -> None:
        try:
            while True:
                frame = read_frame(sock)
                if frame is None:
                    break
                scheduler.submit(*frame)
        except (OSError, ProtocolError) as exc:
            log.error("the link to the daemon broke: %s", exc)
        os._exit(0)  # EOF: the daemon is gone (or closed us): never outlive it

    threading.Thread(target=reader, name="worker-reader", daemon=True).start()
    scheduler.run()
    sock.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
