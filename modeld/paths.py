"""Where modeld keeps things on this machine (shared by the daemon and the runtime client).

* data directory: ``$MODELD_DATA_DIR``, else the user data directory (``~/.local/share/modeld``
  on Linux). It holds the owner lease and ``grpc.token``, the credential a TCP gRPC listener
  requires (mode 0600: only the daemon's user can read it).
* default socket: ``$XDG_RUNTIME_DIR/modeld/`` if set, else the user cache directory; the file
  is ``modeld.sock`` for the default data directory and ``modeld-<hash>.sock`` for any other, so
  that two data directories never fight over one socket.
"""

from __future__ import annotations

import os
from pathlib import Path

import platformdirs
import xxhash

__all__ = [
    "MAX_UNIX_PATH",
    "TOKEN_FILE",
    "default_data_dir",
    "default_socket_path",
    "socket_dir",
    "token_path",
]

TOKEN_FILE = "grpc.token"

MAX_UNIX_PATH = 107
"""sun_path holds 108 bytes including the terminating NUL."""


def default_data_dir() -> Path:
    env = os.environ.get("MODELD_DATA_DIR")
    if env:
        return Path(env).expanduser()
    return Path(platformdirs.user_data_dir("modeld", appauthor=False))


def socket_dir() -> Path:
    runtime = os.environ.get("XDG_RUNTIME_DIR")
    if runtime:
        return Path(runtime) / "modeld"
    return Path(platformdirs.user_cache_dir("modeld", appauthor=False))


def default_socket_path(data_dir: Path) -> Path:
    if data_dir.resolve() == default_data_dir().resolve():
        name = "modeld.sock"
    else:
        name = f"modeld-{xxhash.xxh3_64_hexdigest(str(data_dir.resolve()).encode())[:10]}.sock"
    return socket_dir() / name


def token_path(data_dir: Path) -> Path:
    """Where the daemon keeps the token its TCP gRPC listener requires."""
    return data_dir / TOKEN_FILE
