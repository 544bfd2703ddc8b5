"""The HTTP listener: uvicorn serving the app on a thread of the daemon's process.

The socket is bound here, before the daemon reports that it serves, so a port in use fails
``serve`` at once with a clear message, and ``--http 127.0.0.1:0`` picks a free port that the
daemon then publishes (log line and owner record). uvicorn runs its own event loop on a
thread; it installs no signal handlers there (the daemon owns SIGTERM/SIGINT).
"""

from __future__ import annotations

import logging
import socket
import threading
import time

import uvicorn

from modeld.server.http.app import HttpService
from modeld.server.http.routes import build_app

__all__ = ["HttpListener", "ListenError"]

log = logging.getLogger("modeld.http")


class ListenError(Exception):
    """The HTTP listener could not start (reported by ``serve``)."""


class HttpListener:
    """uvicorn on a thread, serving one :class:`HttpService`."""

    def __init__(self, service: HttpService, host: str, port: int, *, grace: float = 3.0) -> None:
        self.service = service
        self.host = host
        self.port = port
        self.grace = grace
        self.url = ""
        self._server: uvicorn.Server | None = None
        self._thread: threading.Thread | None = None
        self._sweeper = threading.Event()

    def start(self) -> str:
        """Bind, serve, and return the base URL (``http://HOST:PORT``)."""
        family = socket.AF_INET6 if ":" in self.host else socket.AF_INET
        # proto IPPROTO_TCP, not 0: asyncio turns Nagle off (TCP_NODELAY) only on sockets that
        # say so, and with Nagle on every response waits ~40 ms for the client's delayed ACK.
        sock = socket.socket(family, socket.SOCK_STREAM, socket.IPPROTO_TCP)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        try:
            sock.bind((self.host, self.port))
            sock.listen(128)
        except OSError as exc:
            sock.close()
            raise ListenError(
                f"could not listen on {self.host}:{self.port} for HTTP: {exc.strerror}"
            ) from None
        sock.setblocking(False)
        port = sock.getsockname()[1]
        config = uvicorn.Config(
            build_app(self.service),
            log_config=None,
            access_log=False,
            lifespan="off",
            timeout_graceful_shutdown=max(1, int(self.grace)),
            server_header=False,
            # A Responses WebSocket frame up to the message limit is read and answered (an error
            # event beyond it, responses/websocket.py); far beyond it the socket is closed (1009).
            ws_max_size=self.service.limits.max_message_bytes + (1 << 20),
        )
        server = uvicorn.Server(config)
        self._server = server
        self._thread = threading.Thread(
            target=server.run, kwargs={"sockets": [sock]}, name="http", daemon=True
        )
        self._thread.start()
        deadline = time.monotonic() + 30
        while not server.started:
            if not self._thread.is_alive() or time.monotonic() > deadline:
                raise ListenError(f"the HTTP listener on {self.host}:{port} did not start")
            time.sleep(0.01)
        host = f"[{self.host}]" if ":" in self.host else self.host
        self.url = f"http://{host}:{port}"
        threading.Thread(target=self._sweep, name="http-sweep", daemon=True).start()
        return self.url

    def _sweep(self) -> None:
        """Close conversations left idle (every few seconds)."""
        while not self._sweeper.wait(5.0):
            try:
                self.service.conversations.sweep()
            except Exception:
                log.exception("conversation sweep failed")

    def stop(self) -> None:
        self._sweeper.set()
        if self._server is not None:
            self._server.should_exit = True
        if self._thread is not None:
            self._thread.join(self.grace + 2)
        self.service.close()
