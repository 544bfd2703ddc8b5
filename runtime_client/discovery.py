"""Finding the daemon: the explicit address, then ``MODELD_ADDRESS``, then the owner lease.

The lease record (in the data directory, ``$MODELD_DATA_DIR`` or the default) names the
endpoint and the owner's instance id; a client that found the daemon that way fences its
sessions with that instance id, so a takeover in between makes ``open_session`` fail with
``stale_fence`` instead of talking to a daemon the caller did not mean.

After the daemon restarts, a client with ``resume`` on (the default) finds the new one the same
way (:class:`Discovery` keeps what ``connect`` was given) and reads the owner record again to
tell a restart from a takeover (``blueprints/0005-owner-lease.md``, "Resuming across a restart").

A TCP endpoint needs the daemon's token (``blueprints/0005-owner-lease.md``): the explicit
argument, then ``MODELD_TOKEN``, then the file ``grpc.token`` in the data directory, read the
same way as the lease. A unix socket needs none (its permissions are the access control).
"""

from __future__ import annotations

import os
from dataclasses import dataclass, replace
from pathlib import Path

from modeld.errors import DaemonUnavailableError
from modeld.lease import LeaseRecord, read_lease
from modeld.paths import default_data_dir, token_path

__all__ = ["Discovery", "Endpoint", "discover", "normalize_address", "read_token"]


@dataclass(frozen=True, slots=True)
class Endpoint:
    target: str  # what grpc dials: unix:/path or host:port
    instance_id: str = ""  # the owner, when known from the lease
    source: str = ""  # argument | MODELD_ADDRESS | lease
    token: str = ""  # sent as authorization metadata (TCP endpoints)
    epoch: int = 0  # the owner's epoch, when known from the lease

    @property
    def metadata(self) -> tuple[tuple[str, str], ...] | None:
        return (("authorization", f"Bearer {self.token}"),) if self.token else None


def normalize_address(address: str) -> str:
    """Accept ``unix:/p``, ``unix:///p``, a bare socket path, or ``host:port``."""
    address = address.strip()
    if address.startswith("unix://"):
        return "unix:" + address[len("unix://") :]
    if address.startswith("unix:"):
        return address
    if address.startswith(("/", "./", "~")) or address.endswith(".sock"):
        return "unix:" + str(Path(address).expanduser().absolute())
    return address


def read_token(data_dir: Path | None = None) -> str:
    """``MODELD_TOKEN``, else the daemon's token file if this user can read it, else ""."""
    env = os.environ.get("MODELD_TOKEN")
    if env:
        return env.strip()
    try:
        return token_path(data_dir or default_data_dir()).read_text().strip()
    except (OSError, UnicodeDecodeError):
        return ""


def _with_token(endpoint: Endpoint, token: str | None, data_dir: Path | None) -> Endpoint:
    if endpoint.target.startswith("unix:"):
        return endpoint
    found = token if token is not None else read_token(data_dir)
    return replace(endpoint, token=found)


def discover(
    address: str | None = None, data_dir: str | os.PathLike[str] | None = None, token: str | None = None
) -> Endpoint:
    """The daemon's endpoint (and, for TCP, its token); ``token`` overrides the discovered one."""
    data_dir = Path(data_dir) if data_dir is not None else None
    if address:
        return _with_token(Endpoint(normalize_address(address), source="argument"), token, data_dir)
    env = os.environ.get("MODELD_ADDRESS")
    if env:
        return _with_token(Endpoint(normalize_address(env), source="MODELD_ADDRESS"), token, data_dir)
    directory = data_dir or default_data_dir()
    record = read_lease(directory)
    if record is None:
        raise DaemonUnavailableError(
            f"no modeld daemon found: no owner record in {directory}; start one with "
            f"`modeld serve` or set MODELD_ADDRESS",
            data_dir=str(directory),
        )
    if not record.alive or not record.endpoint:
        raise DaemonUnavailableError(
            f"no modeld daemon is running: the owner record in {directory} says "
            f"{record.state!r} (pid {record.pid}); start one with `modeld serve`",
            data_dir=str(directory),
        )
    found = Endpoint(record.endpoint, instance_id=record.instance_id, source="lease", epoch=record.epoch)
    return _with_token(found, token, directory)


@dataclass(frozen=True, slots=True)
class Discovery:
    """What ``connect`` was given, kept to find the daemon again after a restart."""

    address: str | None = None
    data_dir: Path | None = None
    token: str | None = None

    def find(self) -> Endpoint:
        """The endpoint serving now (raises :class:`DaemonUnavailableError` while none is)."""
        return discover(self.address, self.data_dir, self.token)

    def owner_record(self, endpoint: Endpoint) -> LeaseRecord | None:
        """The owner record that names ``endpoint``: the one it was found through, or for an
        address given directly, the data directory's record if it names that address."""
        record = read_lease(self.data_dir or default_data_dir())
        if record is None or not record.endpoint:
            return None
        if endpoint.source == "lease" or normalize_address(record.endpoint) == endpoint.target:
            return record
        return None
