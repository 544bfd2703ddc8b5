"""``modeld serve``: the owner lease, the listeners (gRPC, and HTTP with ``--http``), signals
and an orderly shutdown.

:class:`Server` is the gRPC server around an engine (used as is by the tests, on a temporary
socket). :func:`run` is the daemon: it takes the owner lease, serves, watches the lease, and on
SIGTERM/SIGINT or a takeover stops accepting, ends every session's stream with a clear status,
releases the lease and removes its socket. Both listeners reach the engine through one
:class:`~modeld.server.gateway.Gateway` (the contract plus observers) and share its metrics.
"""

from __future__ import annotations

import asyncio
import contextlib
import importlib.util
import ipaddress
import logging
import os
import signal
import socket
import stat
import threading
import time
from collections.abc import Coroutine
from dataclasses import dataclass, field
from pathlib import Path
from types import FrameType
from typing import TYPE_CHECKING, Any, Protocol, TypeVar

import grpc
from grpc_health.v1 import health, health_pb2_grpc

from modeld import __version__
from modeld.errors import ModeldError
from modeld.lease import CHECK_INTERVAL, AlreadyOwnedError, Lease, LeaseError
from modeld.observe.metrics import Metrics
from modeld.observe.records import Records
from modeld.observe.status import EngineObserver
from modeld.paths import MAX_UNIX_PATH, default_data_dir, default_socket_path
from modeld.server.auth import TokenInterceptor, ensure_token
from modeld.server.bridge import Bridge, Pools
from modeld.server.gateway import Gateway, ServedEngine
from modeld.server.grpc.servicer import SERVICE_NAME, ModeldServicer, add_to_server
from modeld.server.health import ModelHealth
from modeld.server.reflection import enable_reflection
from modeld.settings import (
    HttpSettings,
    Limits,
    RequestRecords,
    Residency,
    RestartPolicy,
    Serving,
    Timeouts,
    parse_tool_formats,
)

if TYPE_CHECKING:
    from modeld.server.http.models import ModelRegistry

__all__ = ["ListenAddress", "ServeOptions", "Server", "parse_listen", "run"]

log = logging.getLogger("modeld.daemon")

EXIT_OK = 0
EXIT_ERROR = 1
EXIT_USAGE = 2
EXIT_OWNED = 3

_T = TypeVar("_T")

MIN_CLIENT_PING_INTERVAL_MS = 10_000
"""The most often a client may ping the daemon while nothing else is sent."""


class LifecycleEngine(ServedEngine, Protocol):
    """What the daemon needs beyond the gateway's view: its events, and stopping it."""

    def add_observer(self, observer: EngineObserver) -> None: ...

    def begin_shutdown(self) -> None: ...

    def shutdown(self) -> None: ...

    def running_operations(self) -> int: ...

    def persist_warm_state(self, timeout: float) -> bool: ...


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


def is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def parse_listen(spec: str, *, allow_remote: bool = False, option: str = "--listen") -> ListenAddress:
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
        raise ServeError(f"{option} must be unix:PATH or HOST:PORT, got {spec!r}")
    host = host.strip("[]")
    port = int(port_text)
    if port > 65535:
        raise ServeError(f"port {port} is out of range")
    if host != "localhost":
        try:
            ipaddress.ip_address(host)
        except ValueError as exc:
            raise ServeError(f"{option} host must be an IP address or localhost, got {host!r}") from exc
    if not is_loopback(host) and not allow_remote:
        raise ServeError(
            f"refusing to listen on non-loopback address {host}: anyone who can reach it could use "
            f"the daemon. Pass --allow-remote to do it anyway (a token or API key is then required)."
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
    """The gRPC server for an engine, with health checking (per model too) and reflection.

    A ``grpc.aio`` server on an event loop of its own thread: the loop only waits, and every
    engine call runs on the bridge's pools (``modeld/server/bridge.py``), so a Session
    stream holds no thread while it waits and ``Status`` always has one. ``token``: require it
    as ``authorization: Bearer`` metadata (TCP listeners; :mod:`modeld.server.auth`).
    ``metrics``: share a registry with the HTTP listener. The engine's events reach the metrics
    and the per-model health (:mod:`modeld.server.health`).
    """

    def __init__(
        self,
        engine: LifecycleEngine,
        address: ListenAddress,
        limits: Limits,
        *,
        min_ping_interval_ms: int = MIN_CLIENT_PING_INTERVAL_MS,
        token: str = "",
        metrics: Metrics | None = None,
        describe_timeout: float = Serving().describe_seconds,
        records: Records | None = None,
    ) -> None:
        self.engine = engine
        self.address = address
        self.limits = limits
        self.gateway = Gateway(engine, limits, metrics, records)
        self.bridge = Bridge(Pools.for_sessions(limits.max_sessions))
        self.servicer = ModeldServicer(self.gateway, self.bridge, describe_timeout=describe_timeout)
        self.health = ModelHealth()
        self._token = token
        self._options: list[tuple[str, Any]] = [
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
        ]
        # Streams hold no thread: the bound is on calls in flight, generous beyond the streams.
        self.max_concurrent_rpcs = self.servicer.max_streams + 2 * self.limits.max_sessions + 64
        self._loop: asyncio.AbstractEventLoop | None = None
        self._thread: threading.Thread | None = None
        self._grpc: grpc.aio.Server | None = None
        self.endpoint = ""
        engine.add_observer(self.gateway.metrics)
        engine.add_observer(self.health)

    def _run(self, coroutine: Coroutine[Any, Any, _T], timeout: float | None = None) -> _T:
        assert self._loop is not None
        return asyncio.run_coroutine_threadsafe(coroutine, self._loop).result(timeout)

    def start(self) -> str:
        """Bind and start; returns the endpoint clients should dial."""
        if self.address.unix_path is not None:
            _prepare_unix_socket(self.address.unix_path)
        loop = asyncio.new_event_loop()
        self._loop = loop
        self._thread = threading.Thread(target=loop.run_forever, name="grpc-loop", daemon=True)
        self._thread.start()
        self.health.bind(loop)
        try:
            port = self._run(self._start())
        except BaseException:
            self._stop_loop()
            raise
        if self.address.unix_path is not None:
            os.chmod(self.address.unix_path, 0o600)
            self.endpoint = f"unix:{self.address.unix_path}"
        else:
            host = f"[{self.address.host}]" if ":" in self.address.host else self.address.host
            self.endpoint = f"{host}:{port}"
        self.engine.endpoint = self.endpoint
        self.health.serving(("", SERVICE_NAME))
        return self.endpoint

    async def _start(self) -> int:
        server = grpc.aio.server(
            interceptors=[TokenInterceptor(self._token)] if self._token else None,
            options=self._options,
            maximum_concurrent_rpcs=self.max_concurrent_rpcs,
        )
        add_to_server(self.servicer, server)
        health_pb2_grpc.add_HealthServicer_to_server(self.health.servicer, server)
        enable_reflection(server, (SERVICE_NAME, health.SERVICE_NAME))
        old_umask = os.umask(0o177)  # the socket is created 0600: no window with wider access
        try:
            try:
                port = server.add_insecure_port(self.address.grpc_target)
            except RuntimeError:  # grpc.aio raises where the sync server returned 0
                port = 0
            if port == 0:
                raise ServeError(f"could not listen on {self.address.grpc_target} (is it in use?)")
            await server.start()
        finally:
            os.umask(old_umask)
        self._grpc = server
        return port

    def reap_unattached(self) -> None:
        """Close sessions that were opened but never attached within the attach timeout."""
        self.gateway.reap_unattached()

    def stop(self, grace: float = 3.0) -> None:
        """Stop accepting, end every session (their streams end with shutting_down), stop."""
        if self._loop is not None and self._grpc is not None:
            self.health.shutting_down()
            self.engine.begin_shutdown()
            time.sleep(min(grace, 0.5))  # let open streams deliver their final status
            with contextlib.suppress(Exception):
                self._run(self._grpc.stop(grace), timeout=grace + 10)
        # The engine first: workers die with the thread that started them (PR_SET_PDEATHSIG is
        # per thread), and a pool thread may have started one; it must live to persist.
        self.engine.shutdown()
        self.servicer.close()
        self._stop_loop()
        if self.address.unix_path is not None:
            with contextlib.suppress(FileNotFoundError):
                self.address.unix_path.unlink()

    def _stop_loop(self) -> None:
        loop, thread = self._loop, self._thread
        if loop is None or thread is None or loop.is_closed():
            return
        with contextlib.suppress(Exception):
            self._run(_finish_tasks(), timeout=5)
        loop.call_soon_threadsafe(loop.stop)
        thread.join(timeout=5)
        if not thread.is_alive():
            loop.run_until_complete(loop.shutdown_asyncgens())
            loop.close()


async def _finish_tasks() -> None:
    """Cancel what still runs on the loop (readers of ended streams) and let it finish."""
    current = asyncio.current_task()
    tasks = [t for t in asyncio.all_tasks() if t is not current]
    for task in tasks:
        task.cancel()
    await asyncio.gather(*tasks, return_exceptions=True)


@dataclass
class ServeOptions:
    """What ``modeld serve`` runs with: the settings (``modeld/settings.py``, one flag each), the
    data directory (``--data-dir``) and the grace given to streams when the daemon stops."""

    serving: Serving = field(default_factory=Serving)
    http: HttpSettings = field(default_factory=HttpSettings)
    limits: Limits = field(default_factory=Limits)
    residency: Residency = field(default_factory=Residency)
    timeouts: Timeouts = field(default_factory=Timeouts)
    restart: RestartPolicy = field(default_factory=RestartPolicy)
    recording: RequestRecords = field(default_factory=RequestRecords)
    data_dir: Path = field(default_factory=default_data_dir)
    grace: float = 3.0


def _http_setup(options: ServeOptions) -> tuple[ListenAddress, ModelRegistry] | None:
    """Check the HTTP options and build the model registry, before taking the lease."""
    http, backend = options.http, options.serving.backend
    try:
        parse_tool_formats(http.tool_formats)
    except ValueError as exc:
        raise ServeError(str(exc)) from None
    if not http.http:
        if http.models or http.models_dir or http.tool_formats or http.chat_templates:
            raise ServeError(
                "--model, --models-dir, --tool-format and --chat-template-file name the models --http "
                "serves; add --http HOST:PORT"
            )
        return None
    address = parse_listen(http.http, allow_remote=options.serving.allow_remote, option="--http")
    if address.unix_path is not None:
        raise ServeError("--http wants HOST:PORT (a TCP address)")
    for origin in http.allowed_origins:
        if not origin or origin == "null" or "://" not in origin or origin.endswith("/"):
            raise ServeError(
                f"--allow-origin {origin!r}: give an origin as a browser sends it, e.g. https://example.com "
                "(scheme and host, no path; 'null' is never allowed)"
            )
    if not is_loopback(address.host) and not http.api_key:
        raise ServeError(
            f"--http {http.http} listens off loopback: an API key is required (--api-key or MODELD_API_KEY)"
        )
    missing = [m for m in ("starlette", "uvicorn", "jinja2") if importlib.util.find_spec(m) is None]
    if missing:
        raise ServeError(
            f"--http needs the http extra ({', '.join(missing)} missing): pip install 'modeld[http]'"
        )
    from modeld.server.http.models import (
        ModelRegistry,
        RegistryError,
        default_models,
        parse_model_option,
        parse_template_option,
    )

    try:
        entries = {}
        for spec in http.models:
            entry = parse_model_option(spec, backend)
            if entry.name in entries:
                raise RegistryError(f"--model {entry.name} is given twice")
            entries[entry.name] = entry
        models_dir = Path(http.models_dir) if http.models_dir else None
        fallback = default_models(backend) if not entries and models_dir is None else None
        templates: dict[str, tuple[str, str]] = {}
        for spec in http.chat_templates:
            name, path, text = parse_template_option(spec)
            if name in templates:
                raise RegistryError(f"--chat-template-file {name} is given twice")
            templates[name] = (path, text)
        registry = ModelRegistry(backend, entries, models_dir, fallback, templates, aliases=http.aliases)
    except RegistryError as exc:
        raise ServeError(str(exc)) from None
    return address, registry


def run(options: ServeOptions) -> int:
    """Run the daemon until a signal or a takeover. Returns the process exit code."""
    from modeld.engine import Engine, Owner, new_instance_id

    limits, serving = options.limits, options.serving
    try:
        address = parse_listen(
            serving.listen or f"unix:{default_socket_path(options.data_dir)}",
            allow_remote=serving.allow_remote,
        )
        if address.unix_path is None and not is_loopback(address.host) and not serving.token:
            raise ServeError(
                f"--listen {serving.listen} is off loopback: --no-token would let anyone who can reach "
                "it drive the daemon; keep the token (it is created in the data directory)"
            )
        http = _http_setup(options)
    except ServeError as exc:
        log.error("%s", exc)
        return EXIT_USAGE
    instance_id = new_instance_id()
    lease = Lease(options.data_dir, instance_id, version=__version__)
    try:
        record = lease.acquire(takeover=serving.takeover, takeover_timeout=serving.takeover_seconds)
    except AlreadyOwnedError as exc:
        log.error("%s", exc)
        return EXIT_OWNED
    except (LeaseError, OSError) as exc:
        log.error("could not take the owner lease in %s: %s", options.data_dir, exc)
        return EXIT_ERROR
    stop = threading.Event()
    hurry = threading.Event()  # a second signal: stop draining, stop now
    received: list[str] = []

    def on_signal(signum: int, _frame: FrameType | None) -> None:
        received.append(signal.Signals(signum).name)
        if stop.is_set():
            hurry.set()
        stop.set()

    signal.signal(signal.SIGTERM, on_signal)
    signal.signal(signal.SIGINT, on_signal)
    owner = Owner(instance_id, record.epoch)
    try:
        engine: LifecycleEngine = Engine(  # conformance: the engine is what the listeners expect
            backends=(serving.backend,),
            owner=owner,
            limits=limits,
            residency=options.residency,
            timeouts=options.timeouts,
            restart=options.restart,
            data_dir=options.data_dir,
            worker_log_level=serving.log_level.upper(),
            speculation=serving.speculation,
        )
    except ModeldError as exc:
        log.error("%s", exc.message)
        lease.release()
        return EXIT_USAGE
    token = ensure_token(options.data_dir) if address.unix_path is None and serving.token else ""
    recording = options.recording
    records = Records.under(
        options.data_dir,
        ring=recording.records_kept,
        max_age_seconds=recording.records_max_age_seconds,
        max_bytes=recording.records_max_bytes,
        show_prompts=recording.ui_show_prompts,
    )
    server = Server(
        engine, address, limits, token=token, describe_timeout=serving.describe_seconds, records=records
    )
    listener: Any = None
    try:
        # Every listener is bound before the daemon says it serves (gRPC health, the lease):
        # a client that saw one never finds the other refusing connections.
        if http is not None:
            listener = _start_http(server.gateway, server.bridge, http, options)
        endpoint = server.start()
    except Exception as exc:
        log.error("%s", exc)
        if listener is not None:
            listener.stop()
        server.stop(0)
        lease.release()
        return EXIT_ERROR
    lease.publish(endpoint, http_endpoint=listener.url if listener is not None else "")
    if listener is not None:
        listener.service.announce()  # /health says 200 from here: the owner record names both
    log.info(
        "modeld %s serving the %s backend at %s%s (instance %s, epoch %d, data %s)",
        __version__,
        serving.backend,
        endpoint,
        f" and {listener.url}/v1 (models: {', '.join(e.name for e in http[1].entries())}; the live page at "
        f"{listener.url}/ui)"
        if listener is not None and http is not None
        else "",
        instance_id,
        record.epoch,
        options.data_dir,
    )
    if token:
        log.info("gRPC over TCP requires the token in %s", options.data_dir / "grpc.token")
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
    if received[:1] == ["SIGTERM"] and not handed_over:
        drain(engine, listener, server, options.timeouts.drain_seconds, hurry)
    if listener is not None:
        engine.begin_shutdown()  # in-flight HTTP turns end now, with shutting_down
        listener.stop()
    server.stop(options.grace)
    records.close()  # the finished records still on their way to the file
    lease.release(handed_over=handed_over)
    log.info("stopped (instance %s)", instance_id)
    return EXIT_OK


PERSIST_SECONDS = 60.0
"""The most a drain waits for the warm contexts to be written (disk and shared store)."""


def drain(
    engine: LifecycleEngine, listener: Any, server: Server, seconds: float, hurry: threading.Event
) -> None:
    """SIGTERM (what ``modeld drain``, systemd and a container runtime send): stop taking new
    turns, let running ones finish for at most ``seconds`` (``--drain-timeout``), save every warm
    context to the disk tier and the shared store, and only then answer the turns that arrived
    meanwhile with 503 and ``Retry-After``. A gateway that retries them on another box finds the
    conversation's latest state in the shared store (``restored_from_shared``); ``/health`` says
    503 "draining" from the first moment, so it stops sending here. A second signal (``hurry``)
    cuts the wait for running turns. Blueprint ``blueprints/0020-fleet.md``."""
    service = listener.service if listener is not None else None
    started = time.monotonic()
    if service is not None:
        service.drain.begin()
    server.health.shutting_down()
    log.info(
        "draining: /health answers 503, new turns are held and then refused with 503; running turns "
        "have %.0fs to finish (--drain-timeout)",
        seconds,
    )
    deadline = started + seconds
    while not hurry.is_set():
        running = (service.drain.running if service is not None else 0) + engine.running_operations()
        if running <= 0:
            break
        if time.monotonic() >= deadline:
            log.warning("drain timeout: %d turns still running are stopped", running)
            break
        hurry.wait(0.05)
    saved = engine.persist_warm_state(PERSIST_SECONDS)
    log.info(
        "drained in %.1fs: warm contexts %s",
        time.monotonic() - started,
        "saved" if saved else f"not all saved within {PERSIST_SECONDS:.0f}s",
    )
    if service is not None:
        service.drain.release()
        time.sleep(0.2)  # the held turns' 503s leave before the listener closes


def _start_http(
    gateway: Gateway, bridge: Bridge, http: tuple[ListenAddress, ModelRegistry], options: ServeOptions
) -> Any:
    from modeld.server.http.app import HttpService
    from modeld.server.http.listener import HttpListener

    address, registry = http
    gateway.names = registry.name_of  # one file, one name on every transport
    service = HttpService(
        gateway,
        registry,
        options.http,
        bridge,
        data_dir=options.data_dir,
        describe_seconds=options.serving.describe_seconds,
        starting=True,
    )
    listener = HttpListener(service, address.host, address.port, grace=options.grace)
    listener.start()
    return listener
