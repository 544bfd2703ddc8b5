"""Finding the daemon: the explicit address, then ``MODELD_ADDRESS``, then the owner lease.

The lease record (in the data directory, ``$MODELD_DATA_DIR`` or the default) names the
endpoint and the owner's instance id; a client that found the daemon that way fences its
sessions with that instance id, so a takeover in between makes ``open_session`` fail with
``stale_fence`` instead of talking to a daemon the caller did not mean.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

from modeld.errors import DaemonUnavailableError
from modeld.lease import read_lease
from modeld.paths import default_data_dir

__all__ = ["Endpoint", "discover", "normalize_address"]


@dataclass(frozen=True, slots=True)
class Endpoint:
    target: str  # what grpc dials: unix:/path or host:port
    instance_id: str = ""  # the owner, when known from the lease
    source: str = ""  # argument | MODELD_ADDRESS | lease


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


def discover(address: str | None = None, data_dir: Path | None = None) -> Endpoint:
    if address:
        return Endpoint(normalize_address(address), source="argument")
    env = os.environ.get("MODELD_ADDRESS")
    if env:
        return Endpoint(normalize_address(env), source="MODELD_ADDRESS")
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
    return Endpoint(record.endpoint, instance_id=record.instance_id, source="lease")
