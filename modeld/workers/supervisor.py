"""Supervision of one model's engine host: start, notice death, restart with backoff, stalls.

:class:`Supervisor` keeps one loaded model's host alive. The host's death is noticed at once
(the worker's socket reaches EOF, ``modeld/workers/proxy.py``); calls in flight have already
failed with a typed error by then. The supervisor tells the model's owner (so the warm-state
cache forgets what was in the dead KV and sessions report ``engine_reset``), then starts a new
worker after an exponential backoff. Past ``crash_limit`` deaths within ``crash_window`` seconds
the model is marked ``failed`` with the last reason, and stays so until a client asks for it
again (:meth:`revive`). Nothing is ever replayed.

A watchdog thread ticks once a second while the host has work in flight: progress is tokens
evaluated or generated (every reply counts), and the worker's CPU time counts as liveness, so
a 10-minute prefill on a slow machine is not a stall while a hung worker (a deadlock, a stopped
process, a read that never returns) is: after ``stall_seconds`` without either, the worker's
process group is killed and its calls fail with :class:`~modeld.errors.StallTimeoutError`.
"""

from __future__ import annotations

import contextlib
import logging
import threading
import time
from collections import deque
from collections.abc import Callable

from modeld.errors import EngineRestartedError, ModeldError, ModelLoadError, StallTimeoutError
from modeld.observe.status import WorkerInfo
from modeld.settings import RestartPolicy, Timeouts
from modeld.workers.host import Host
from modeld.workers.protocol import Load
from modeld.workers.proxy import WorkerHost

__all__ = ["RestartPolicy", "Supervisor", "Timeouts"]

log = logging.getLogger("modeld.supervisor")


class Supervisor:
    """Keeps one model's engine host alive (see the module docstring)."""

    def __init__(
        self,
        name: str,
        make_host: Callable[[Callable[[WorkerHost], None]], Host],
        load: Load,
        *,
        timeouts: Timeouts,
        policy: RestartPolicy | None = None,
        on_reset: Callable[[ModeldError], None] | None = None,
        on_ready: Callable[[Host], None] | None = None,
        on_state: Callable[[str], None] | None = None,
    ) -> None:
        self.name = name
        self._make_host = make_host
        self._load_message = load
        self.timeouts = timeouts
        self.policy = policy or RestartPolicy()
        self._on_reset = on_reset
        self._on_ready = on_ready
        self._on_state = on_state
        self._lock = threading.Condition()
        self._host: Host | None = None
        self.state = "loading"
        self.restarts = 0
        self.last_error = ""
        self.last_restart_reason = ""
        self.last_restart_at = 0.0
        self._deaths: deque[float] = deque()
        self._stopping = False
        self._failed: ModeldError | None = None
        self._watch_stop = threading.Event()
        self._watchdog: threading.Thread | None = None

    # --- life ---------------------------------------------------------------------------------------

    def _set_state(self, state: str) -> None:
        """A state change (called with the lock held); observers hear of it on another thread."""
        if state == self.state:
            return
        self.state = state
        if self._on_state is not None:
            threading.Thread(target=self._on_state, args=(state,), name="worker-state", daemon=True).start()

    def start(self) -> Host:
        """Start the first host and load the model (raises ``ModelLoadError``)."""
        host = self._spawn()
        with self._lock:
            self._host = host
            self._set_state("ready")
            self._lock.notify_all()
        if self._watchdog is None:
            self._watchdog = threading.Thread(target=self._watch, name=f"watchdog-{self.name}", daemon=True)
            self._watchdog.start()
        return host

    def _spawn(self) -> Host:
        host = self._make_host(self._exited)
        done = threading.Event()
        error: list[BaseException] = []

        def load() -> None:
            try:
                host.load(self._load_message)
            except BaseException as exc:
                error.append(exc)
            done.set()

        threading.Thread(target=load, name=f"load-{self.name}", daemon=True).start()
        limit = self.timeouts.load_seconds or None
        if not done.wait(limit):
            timeout = ModelLoadError(
                f"loading {self.name} took longer than the {self.timeouts.load_seconds:.0f}s load timeout; "
                "the worker was stopped",
                path=self._load_message.info.path,
                timeout="load_seconds",
            )
            self._kill(host, timeout)
            done.wait(10)
            raise timeout
        if error:
            self._kill(host, None)
            exc = error[0]
            if isinstance(exc, ModeldError) and exc.reason not in ("engine_restarted", "engine_error"):
                raise exc  # a typed refusal (model_load_failed, unsupported, ...) as the engine gave it
            if isinstance(exc, ModeldError):
                raise ModelLoadError(
                    f"loading {self.name} failed: {exc.message}", path=self._load_message.info.path
                ) from exc
            raise exc
        if self._on_ready is not None:
            self._on_ready(host)
        return host

    def host(self, wait: float | None = None) -> Host:
        """The live host; while restarting, wait for it (up to ``wait`` s, default the load timeout)."""
        deadline = time.monotonic() + (wait if wait is not None else (self.timeouts.load_seconds or 600.0))
        with self._lock:
            while True:
                if self._failed is not None:
                    raise self._failed
                if self._stopping:
                    raise EngineRestartedError(f"the engine worker for {self.name} is stopping")
                host = self._host
                if host is not None and host.alive:
                    return host
                left = deadline - time.monotonic()
                if left <= 0:
                    raise EngineRestartedError(
                        f"the engine worker for {self.name} is restarting ({self.last_restart_reason})"
                    )
                self._lock.wait(min(left, 0.5))

    def current(self) -> Host | None:
        return self._host

    def revive(self) -> None:
        """A client asks for a failed model again: forget its crash history and restart it."""
        with self._lock:
            if self._failed is None or self._stopping:
                return
            self._failed = None
            self._deaths.clear()
            self._set_state("restarting")
        threading.Thread(target=self._restart, args=(0.0,), name=f"restart-{self.name}", daemon=True).start()

    def stop(self, grace: float = 5.0) -> None:
        """Free the model and stop the worker (no restart); never raises."""
        with self._lock:
            self._stopping = True
            self._set_state("stopped")
            host = self._host
            self._lock.notify_all()
        self._watch_stop.set()
        if host is not None:
            with contextlib.suppress(Exception):
                if isinstance(host, WorkerHost):
                    host.close(grace)
                else:
                    host.close()

    # --- death and restart ---------------------------------------------------------------------

    def _exited(self, host: WorkerHost) -> None:
        """Called on the dead host's reader thread."""
        with self._lock:
            if host is not self._host or self._stopping:
                return
            error = host.death or EngineRestartedError(f"the engine worker for {self.name} exited")
            now = time.monotonic()
            self._deaths.append(now)
            while self._deaths and now - self._deaths[0] > self.policy.crash_window:
                self._deaths.popleft()
            self.last_error = error.message
            self.last_restart_reason = error.message
            self.last_restart_at = time.time()
            failed = len(self._deaths) >= self.policy.crash_limit
            self._set_state("failed" if failed else "restarting")
            if failed:
                self._failed = EngineRestartedError(
                    f"the engine worker for {self.name} died {len(self._deaths)} times in "
                    f"{self.policy.crash_window:.0f}s and is marked failed (last: {error.message}); "
                    "open a session on it again to retry",
                    **error.details,
                )
            delay = min(self.policy.backoff_max, self.policy.backoff_initial * 2 ** (len(self._deaths) - 1))
            self._lock.notify_all()
        if self._on_reset is not None:
            self._on_reset(error)
        if not failed:
            threading.Thread(
                target=self._restart, args=(delay,), name=f"restart-{self.name}", daemon=True
            ).start()
        else:
            log.error("%s", self._failed.message if self._failed else "")

    def _restart(self, delay: float) -> None:
        if delay:
            time.sleep(delay)
        with self._lock:
            if self._stopping or self._failed is not None:
                return
        try:
            host = self._spawn()
        except ModeldError as exc:
            log.error("restarting the engine worker for %s failed: %s", self.name, exc.message)
            with self._lock:
                self.last_error = exc.message
                now = time.monotonic()
                self._deaths.append(now)
                if len(self._deaths) >= self.policy.crash_limit:
                    self._set_state("failed")
                    self._failed = EngineRestartedError(
                        f"the engine worker for {self.name} could not be restarted: {exc.message}"
                    )
                    self._lock.notify_all()
                    return
                delay = min(
                    self.policy.backoff_max, self.policy.backoff_initial * 2 ** (len(self._deaths) - 1)
                )
            self._restart(delay)
            return
        with self._lock:
            if self._stopping:
                with contextlib.suppress(Exception):
                    host.close()
                return
            self._host = host
            self.restarts += 1
            self._set_state("ready")
            self._lock.notify_all()
        log.info("the engine worker for %s was restarted (pid %d)", self.name, host.pid)

    def _kill(self, host: Host, reason: ModeldError | None) -> None:
        if isinstance(host, WorkerHost):
            host.kill(reason or EngineRestartedError(f"the engine worker for {self.name} was stopped"))
        else:
            with contextlib.suppress(Exception):
                host.close()

    # --- stall watchdog --------------------------------------------------------------------------

    def _watch(self) -> None:
        last_progress = -1
        last_cpu = -1.0
        last_alive = time.monotonic()
        watched: Host | None = None
        while not self._watch_stop.wait(1.0):
            host = self._host
            now = time.monotonic()
            if host is not watched:
                watched, last_progress, last_cpu, last_alive = host, -1, -1.0, now
            if host is None or not host.alive or not host.busy or not isinstance(host, WorkerHost):
                last_alive = now
                continue
            cpu = host.cpu_seconds()
            if host.tokens_done != last_progress or cpu - last_cpu >= 0.05:
                last_progress, last_cpu, last_alive = host.tokens_done, cpu, now
                continue
            limit = self.timeouts.stall_seconds
            if limit and now - last_alive > limit:
                log.error("the engine worker for %s made no progress for %.0fs: killing it", self.name, limit)
                host.kill(
                    StallTimeoutError(
                        f"the engine worker for {self.name} made no progress and used no CPU for "
                        f"{limit:.0f}s (stall_seconds); it was killed and is being restarted, nothing was replayed",
                        seconds=int(limit),
                    )
                )
                last_alive = now

    # --- status ----------------------------------------------------------------------------------

    def status(self, *, debug: bool = False) -> WorkerInfo:
        host = self._host
        state = self.state
        if state == "ready" and host is not None and host.busy:
            state = "busy"
        process = isinstance(host, WorkerHost)
        return WorkerInfo(
            pid=host.pid if host is not None else 0,
            state=state,
            isolation="process" if process else "inline",
            started_at=host.started_at if host is not None else 0.0,
            restarts=self.restarts,
            last_error=self.last_error,
            last_restart_reason=self.last_restart_reason,
            last_restart_at=self.last_restart_at,
            rss_bytes=host.rss_bytes() if isinstance(host, WorkerHost) and host.running else 0,
            log_lines=tuple(host.log_lines) if debug and isinstance(host, WorkerHost) else (),
        )

    @property
    def base_rss(self) -> int:
        """The worker's resident memory just before its model loaded (0: inline, or not running)."""
        host = self._host
        return host.base_rss if isinstance(host, WorkerHost) else 0

    @property
    def checkpoint_bytes(self) -> tuple[int, ...]:
        """What each of the worker's sequences' checkpoints hold now, by sequence, as it last
        said (empty: none, or no worker running): they live in its heap beside the KV
        (blueprint 0016)."""
        host = self._host
        return host.checkpoint_bytes if host is not None and host.alive else ()
