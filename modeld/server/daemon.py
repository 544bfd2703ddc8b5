"""``modeld serve``: the owner lease, the gRPC server, signals and an orderly shutdown.

:class:`Server` is the gRPC server around an engine (used as is by the tests, on a temporary
socket). :func:`run` is the daemon: it takes the owner lease, serves, watches the lease, and on
SIGTERM/SIGINT or a takeover stops accepting, ends every session's stream with a clear status,
releases the lease and removes its socket.
"""

from __future__ import annotations

import contextlib
import ipaddress
import logging
import os
import signal
import socket
import stat
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from types import FrameType

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection

from modeld import __version__
from modeld.engine import Engine, Limits, Owner, new_instance_id
from modeld.lease import CHECK_INTERVAL, AlreadyOwnedError, Lease, LeaseError
from modeld.paths import MAX_UNIX_PATH, default_data_dir, default_socket_path
from modeld.server.servicer import SERVICE_NAME, ModeldServicer, add_to_server

__all__ = ["ListenAddress", "ServeOptions", "Server", "parse_listen", "run"]

log = logging.getLogger("modeld.daemon")

EXIT_OK = 0
EXIT_ERROR = 1
EXIT_USAGE = 2
EXIT_OWNED = 3

MIN_CLIENT_PING_INTERVAL_MS = 10_000
"""The most often a client may ping the daemon while nothing else is sent."""


class ServeError(Exception):
    """A configuration problem reported to the operator in one line."""


@dataclass(frozen=True, slots=True)
class ListenAddress:
    unix_path: Path | None = None
    host: str = ""
    port: int = 0

    @property
    def grpc_target(self) -> str:
        if self.unix_path is not None:
            return f"unix:{self.unix_path}"
        host = f"[{self.host}]" if ":" in self.host else self.host
        return f"{host}:{self.port}"


def parse_listen(spec: str, *, allow_remote: bool = False) -> ListenAddress:
    """``unix:PATH`` or ``HOST:PORT``; a non-loopback host needs ``allow_remote``."""
    if spec.startswith("unix:"):
        raw = spec[len("unix:") :]
        if raw.startswith("//"):
            raw = raw[2:]
        path = Path(raw).expanduser().absolute()
        if len(str(path).encode()) > MAX_UNIX_PATH:
            raise ServeError(
                f"unix socket path is {len(str(path).encode())} bytes; the limit is {MAX_UNIX_PATH}: {path}"
            )
        return ListenAddress(unix_path=path)
    host, sep, port_text = spec.rpartition(":")
    if not sep or not port_text.isdigit():
        raise ServeError(f"--listen must be unix:PATH or HOST:PORT, got {spec!r}")
    host = host.strip("[]")
    port = int(port_text)
    if port > 65535:
        raise ServeError(f"port {port} is out of range")
    if host == "localhost":
        loopback = True
    else:
        try:
            loopback = ipaddress.ip_address(host).is_loopback
        except ValueError as exc:
            raise ServeError(f"--listen host must be an IP address or localhost, got {host!r}") from exc
    if not loopback and not allow_remote:
        raise ServeError(
            f"refusing to listen on non-loopback address {host}: modeld has no authentication "
            f"(access control is the socket's permissions). Pass --allow-remote to do it anyway."
        )
    return ListenAddress(host=host, port=port)


def _prepare_unix_socket(path: Path) -> None:
    parent = path.parent
    if not parent.exists():
        parent.mkdir(parents=True, mode=0o700)
    if path.exists() or path.is_symlink():
        mode = path.lstat().st_mode
        if not stat.S_ISSOCK(mode):
            raise ServeError(f"{path} exists and is not a socket; refusing to replace it")
        probe = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            probe.settimeout(0.5)
            probe.connect(str(path))
        except OSError:
            path.unlink()  # nobody is listening: a stale socket from a dead daemon
        else:
            raise ServeError(f"another process is listening on {path}")
        finally:
            probe.close()


class Server:
    """The gRPC server for an engine, with health checking and reflection."""

    def __init__(
        self,
        engine: Engine,
        address: ListenAddress,
        limits: Limits | None = None,
        *,
        min_ping_interval_ms: int = MIN_CLIENT_PING_INTERVAL_MS,
    ) -> None:
        self.engine = engine
        self.address = address
        self.limits = limits or engine.limits
        workers = self.limits.max_sessions + 16
        self._grpc = grpc.server(
            ThreadPoolExecutor(max_workers=workers, thread_name_prefix="grpc"),
            options=[
                ("grpc.max_receive_message_length", self.limits.max_message_bytes),
                ("grpc.max_send_message_length", self.limits.max_message_bytes),
                ("grpc.so_reuseport", 0),
                ("grpc.keepalive_time_ms", 60_000),
                ("grpc.keepalive_timeout_ms", 20_000),
                ("grpc.keepalive_permit_without_calls", 1),
                # Clients ping every 30 s (runtime_client.channel_options); a prefill can run for
                # minutes without a message, and gRPC's default (5 min) would answer those pings
                # with GOAWAY "too_many_pings" and kill the session.
                ("grpc.http2.min_ping_interval_without_data_ms", min_ping_interval_ms),
            ],
            maximum_concurrent_rpcs=workers,
        )
        self.servicer = ModeldServicer(engine)
        add_to_server(self.servicer, self._grpc)
        self.health = health.HealthServicer()
        health_pb2_grpc.add_HealthServicer_to_server(self.health, self._grpc)
        reflection.enable_server_reflection(
            (SERVICE_NAME, health.SERVICE_NAME, reflection.SERVICE_NAME), self._grpc
        )
        self.endpoint = ""

    def start(self) -> str:
        """Bind and start; returns the endpoint clients should dial."""
        if self.address.unix_path is not None:
            _prepare_unix_socket(self.address.unix_path)
        old_umask = os.umask(0o177)  # the socket is created 0600: no window with wider access
        try:
            port = self._grpc.add_insecure_port(self.address.grpc_target)
            if port == 0:
                raise ServeError(f"could not listen on {self.address.grpc_target}")
            self._grpc.start()
        finally:
            os.umask(old_umask)
        if self.address.unix_path is not None:
            os.chmod(self.address.unix_path, 0o600)
            self.endpoint = f"unix:{self.address.unix_path}"
        else:
            host = f"[{self.address.host}]" if ":" in self.address.host else self.address.host
            self.endpoint = f"{host}:{port}"
        self.engine.endpoint = self.endpoint
        for name in ("", SERVICE_NAME):
            self.health.set(name, health_pb2.HealthCheckResponse.SERVING)
        return self.endpoint

    def reap_unattached(self) -> None:
        """Close sessions that were opened but never attached within the attach timeout."""
        cutoff = time.time() - self.limits.attach_timeout_seconds
        for session in self.engine.sessions():
            if not session.attached and session.opened_at < cutoff and not session.closed:
                log.info("closing session %s: never attached", session.session_id)
                session.close()

    def stop(self, grace: float = 3.0) -> None:
        """Stop accepting, end every session (their streams end with shutting_down), stop."""
        self.health.enter_graceful_shutdown()
        self.engine.begin_shutdown()
        time.sleep(min(grace, 0.5))  # let open streams deliver their final status
        self._grpc.stop(grace).wait()
        self.engine.shutdown()
        if self.address.unix_path is not None:
            with contextlib.suppress(FileNotFoundError):
                self.address.unix_path.unlink()


@dataclass
class ServeOptions:
    backend: str = "llama"
    listen: str = ""
    data_dir: Path = field(default_factory=default_data_dir)
    takeover: bool = False
    takeover_timeout: float = 10.0
    allow_remote: bool = False
    limits: Limits = field(default_factory=Limits)
    grace: float = 3.0


def run(options: ServeOptions) -> int:
    """Run the daemon until a signal or a takeover. Returns the process exit code."""
    try:
        address = parse_listen(
            options.listen or f"unix:{default_socket_path(options.data_dir)}",
            allow_remote=options.allow_remote,
        )
    except ServeError as exc:
        log.error("%s", exc)
        return EXIT_USAGE
    instance_id = new_instance_id()
    lease = Lease(options.data_dir, instance_id, version=__version__)
    try:
        record = lease.acquire(takeover=options.takeover, takeover_timeout=options.takeover_timeout)
    except AlreadyOwnedError as exc:
        log.error("%s", exc)
        return EXIT_OWNED
    except (LeaseError, OSError) as exc:
        log.error("could not take the owner lease in %s: %s", options.data_dir, exc)
        return EXIT_ERROR
    stop = threading.Event()
    received: list[str] = []

    def on_signal(signum: int, _frame: FrameType | None) -> None:
        received.append(signal.Signals(signum).name)
        stop.set()

    signal.signal(signal.SIGTERM, on_signal)
    signal.signal(signal.SIGINT, on_signal)
    owner = Owner(instance_id, record.epoch)
    engine = Engine(backends=(options.backend,), owner=owner, limits=options.limits)
    server = Server(engine, address, options.limits)
    try:
        endpoint = server.start()
    except (ServeError, RuntimeError, OSError) as exc:
        log.error("%s", exc)
        lease.release()
        return EXIT_ERROR
    lease.publish(endpoint)
    log.info(
        "modeld %s serving the %s backend at %s (instance %s, epoch %d, data %s)",
        __version__,
        options.backend,
        endpoint,
        instance_id,
        record.epoch,
        options.data_dir,
    )
    handed_over = False
    while not stop.wait(CHECK_INTERVAL):
        lost = lease.check()
        if lost is not None:
            log.warning("ownership lost: %s; failing sessions with stale_fence and exiting", lost)
            owner.revoke(lost)
            handed_over = True
            break
        server.reap_unattached()
    if received:
        log.info("received %s: shutting down", received[0])
    server.stop(options.grace)
    lease.release(handed_over=handed_over)
    log.info("stopped (instance %s)", instance_id)
    return EXIT_OK
