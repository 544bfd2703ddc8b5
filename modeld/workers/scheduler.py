"""The engine side of the protocol: one thread runs every request against one runtime.

:class:`Scheduler` owns the runtime. Atomic requests (tokenize, copy, drop, snapshot, restore,
...) run as they arrive; jobs (``Sync``, ``Generate``) advance one engine step at a time in
round robin, so several sessions' operations on different sequences share the engine: a long
prefill does not stall another session's decode for its whole length, and a ``Cancel`` takes
effect before the job's next step. Prefills among themselves go shortest first (the fewest
tokens left to evaluate, then the earliest): of two prefills that arrive together the first
answers after its own work, not after both (round robin ended them together), and a short
turn is not held behind a long cold prefill; the last one ends after the same prefill work,
plus the decode steps of those that finished first. A prefill that waits is still canceled at
once. Every native call happens on the thread that calls
:meth:`Scheduler.run` (llama.cpp's OpenMP team belongs to its calling thread, blueprint 0001).

The same class runs inside a worker process (``modeld/workers/child.py``, replies encoded onto
the socket) and in-process (``modeld/workers/host.py``'s ``InlineHost``, replies handed over
as objects).
"""

from __future__ import annotations

import contextlib
import logging
import os
import queue
import threading
import time
from collections import deque
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

from modeld.backends.base import ModelRuntime, SyncStep
from modeld.cache.snapfile import SnapshotError, verify_payload
from modeld.decoding.speculation import DRAFT_MAX
from modeld.errors import EngineError, ModeldError
from modeld.workers.protocol import (
    REFUSED,
    Cancel,
    Close,
    Copy,
    Drop,
    Failed,
    Finished,
    Generate,
    Grant,
    Load,
    Loaded,
    Message,
    Progress,
    Restore,
    Result,
    Room,
    Save,
    Share,
    Snapshot,
    Sync,
    Tokenize,
    Tokens,
)

__all__ = ["GROW_MARGIN", "Scheduler"]

log = logging.getLogger("modeld.worker")

Send = Callable[[int, Message], None]
Loader = Callable[[Load], tuple[ModelRuntime, int]]
"""Loads a ``Load``'s model: the runtime, and the process's RSS just before it loaded."""

GROW_MARGIN = DRAFT_MAX + 2
"""Cells one step of a generate job may add beyond the tokens it yielded (a verify batch
evaluates a draft before its tokens are yielded); a job with a cell limit pauses when fewer
than this are left."""


@dataclass
class _Job:
    op: int
    seq: int
    steps: Iterator[SyncStep | int]
    generate: bool
    kept: int = 0
    canceled: threading.Event = field(default_factory=threading.Event)
    interval: float = 0.0
    """Generate: seconds within which sampled tokens are sent together (``Generate.interval``)."""
    held: list[int] = field(default_factory=list)
    held_logprobs: list[Any] = field(default_factory=list)
    held_choices: list[int] = field(default_factory=list)
    stopped: set[int] = field(default_factory=set)
    """Generate with forks: the choices the daemon canceled (the others go on)."""
    sent_at: float = float("-inf")
    limit: int = 0
    """Generate: the tokens its sequence may hold before it pauses for a ``Grant`` (0: none)."""
    bound: int = 0
    """Generate with a limit: what its sequence holds at most once every token it yielded is
    evaluated (tokens a constraint forces are yielded before their batch is evaluated)."""
    left: int = 0
    """Sync: tokens it has still to evaluate (its target's length until its first step)."""
    order: int = 0
    """When it started (a count): the earlier of two prefills with as much left goes first."""


class Scheduler:
    """Runs protocol requests against one runtime, on the thread that calls :meth:`run`."""

    def __init__(self, send: Send, loader: Loader) -> None:
        self._send = send
        self._loader = loader
        self._runtime: ModelRuntime | None = None
        self._inbox: queue.SimpleQueue[tuple[int, Message]] = queue.SimpleQueue()
        self._jobs: deque[_Job] = deque()
        self._started = 0
        self._by_op: dict[int, _Job] = {}
        self._lock = threading.Lock()
        self._cancels: set[int] = set()
        self._parked: dict[int, _Job] = {}
        """Generate jobs paused at their cell limit (``Room`` sent), until a ``Grant`` or a cancel."""
        self._closed = False

    # --- any thread ----------------------------------------------------------------------------

    def submit(self, op: int, message: Message) -> None:
        """Queue a request; a ``Cancel`` takes effect at once (before the job's next step)."""
        if isinstance(message, Cancel):
            with self._lock:
                job = self._by_op.get(message.target)
                if job is not None and message.choice >= 0:
                    job.stopped.add(message.choice)
                elif job is not None:
                    job.canceled.set()
                elif message.choice < 0:  # not started yet: cancel it when it arrives
                    self._cancels.add(message.target)
        self._inbox.put((op, message))

    # --- the engine thread -----------------------------------------------------------------------

    def run(self) -> None:
        """Serve until ``Close`` (or a failed ``Load``)."""
        while not self._closed:
            try:
                op, message = self._inbox.get(block=not self._jobs)
            except queue.Empty:
                self._step()
                continue
            self._handle(op, message)
            while not self._closed:  # everything that has arrived runs before the next step
                try:
                    op, message = self._inbox.get_nowait()
                except queue.Empty:
                    break
                self._handle(op, message)
            if self._jobs and not self._closed:
                self._step()

    def _handle(self, op: int, message: Message) -> None:
        if isinstance(message, Cancel | Grant):
            job = self._parked.pop(message.target, None)
            if job is not None:
                if isinstance(message, Grant):
                    if message.cells == 0:
                        self._finish(job, canceled=False)  # no room: it ends where it is
                        return
                    job.limit = job.limit + message.cells if message.cells > 0 else 0
                self._jobs.append(job)  # a cancel takes effect at its next step
            return
        try:
            if isinstance(message, Load):
                self._load(op, message)
                return
            runtime = self._runtime
            if runtime is None:
                raise EngineError("the worker has no model loaded")
            if isinstance(message, Sync):
                steps = runtime.sync(message.seq, message.keep, message.tokens, message.segments)
                self._start(
                    _Job(op, message.seq, steps, generate=False, kept=message.keep, left=len(message.tokens))
                )
            elif isinstance(message, Generate):
                stopped: set[int] = set()
                if message.forks:
                    tokens = runtime.generate(
                        message.seq, message.config, message.max_tokens, message.forks, stopped.__contains__
                    )
                else:
                    tokens = runtime.generate(message.seq, message.config, message.max_tokens)
                job = _Job(op, message.seq, tokens, generate=True, interval=message.interval, stopped=stopped)
                if message.cells > 0:
                    job.bound = len(runtime.resident(message.seq))
                    job.limit = job.bound + message.cells
                self._start(job)
            elif isinstance(message, Tokenize):
                self._send(op, Result(tokens=tuple(runtime.tokenize(message.text, add_bos=message.add_bos))))
            elif isinstance(message, Copy):
                runtime.copy(message.src, message.dst, message.n)
                self._send(op, Result(checkpoint_bytes=runtime.checkpoint_bytes()))
            elif isinstance(message, Drop):
                runtime.drop(message.seq)
                self._send(op, Result(checkpoint_bytes=runtime.checkpoint_bytes()))
            elif isinstance(message, Share):
                ok = runtime.share(message.src, message.dst, message.n)
                self._send(op, Result(ok=ok, checkpoint_bytes=runtime.checkpoint_bytes()))
            elif isinstance(message, Snapshot):
                self._send(op, Result(payload=runtime.snapshot(message.seq)))
            elif isinstance(message, Save):
                self._send(op, _save(runtime, message))
            elif isinstance(message, Restore):
                result = _restore(runtime, message)
                self._send(op, replace(result, checkpoint_bytes=runtime.checkpoint_bytes()))
            elif isinstance(message, Close):
                self._close()
                self._send(op, Result())
            else:
                raise EngineError(f"the worker cannot handle {message.kind!r}")
        except ModeldError as exc:
            self._send(op, Failed(exc.reason, exc.message, dict(exc.details)))
        except Exception as exc:
            log.exception("request %s failed in the engine", message.kind)
            self._send(op, Failed("engine_error", f"the engine failed on {message.kind}: {exc!r}"))

    def _load(self, op: int, message: Load) -> None:
        try:
            runtime, before = self._loader(message)
            self._runtime = runtime
            self._send(op, Loaded.of(runtime.layout, runtime.vocab(), os.getpid(), before))
        except ModeldError as exc:
            self._closed = True
            self._send(op, Failed(exc.reason, exc.message, dict(exc.details)))
        except Exception as exc:
            self._closed = True
            log.exception("loading the model failed")
            self._send(op, Failed("model_load_failed", f"loading the model failed: {exc!r}"))

    def _start(self, job: _Job) -> None:
        with self._lock:
            if job.op in self._cancels:
                self._cancels.discard(job.op)
                job.canceled.set()
            self._by_op[job.op] = job
        self._started += 1
        job.order = self._started
        self._jobs.append(job)

    def _waits(self, job: _Job) -> bool:
        """A prefill waits while another has fewer tokens left (or as many and began first)."""
        return not job.generate and any(
            not other.generate and (other.left, other.order) < (job.left, job.order) for other in self._jobs
        )

    def _step(self) -> None:
        job = self._jobs.popleft()
        if job.canceled.is_set():
            self._finish(job, canceled=True)
            return
        if self._waits(job):
            self._jobs.append(job)
            return
        if job.limit and self._runtime is not None:
            bound = max(job.bound, len(self._runtime.resident(job.seq)))
            if bound + GROW_MARGIN > job.limit:  # its next step could overfill its cells
                self._flush(job, 0.0)
                self._parked[job.op] = job
                self._send(job.op, Room(bound))
                return
        started = time.perf_counter()
        try:
            item = next(job.steps)
        except StopIteration:
            self._finish(job, canceled=False)
            return
        except ModeldError as exc:
            self._flush(job, 0.0)
            self._forget(job)
            self._send(job.op, Failed(exc.reason, exc.message, dict(exc.details)))
            return
        except Exception as exc:
            self._flush(job, 0.0)
            self._forget(job)
            log.exception("a %s job failed in the engine", "generate" if job.generate else "sync")
            self._send(job.op, Failed("engine_error", f"the engine failed: {exc!r}"))
            return
        if isinstance(item, SyncStep):
            job.kept = item.kept
            job.left = item.total - item.evaluated
            seconds = time.perf_counter() - started if item.evaluated else 0.0
            self._send(job.op, Progress(item.kept, item.evaluated, item.total, seconds))
        else:
            job.held.append(int(item))
            job.bound += 1
            logprob = getattr(item, "logprob", None)  # a SampledToken (DecodeConfig.logprobs)
            if logprob is not None:
                job.held_logprobs.append(logprob)
            choice = getattr(item, "choice", None)  # a ChoiceToken (Generate.forks)
            if choice is not None:
                job.held_choices.append(choice)
            now = time.monotonic()
            # Hold the token only until this job's next step, and only if that step comes next:
            # another job's step (a prefill batch) could keep it for seconds.
            if self._jobs or now - job.sent_at >= job.interval:
                self._flush(job, now)
        self._jobs.append(job)

    def _flush(self, job: _Job, now: float) -> None:
        """Send the tokens ``job`` holds (one ``Tokens`` message)."""
        if job.held:
            self._send(job.op, Tokens(tuple(job.held), tuple(job.held_logprobs), tuple(job.held_choices)))
            job.held, job.held_logprobs, job.held_choices = [], [], []
        job.sent_at = now

    def _finish(self, job: _Job, *, canceled: bool) -> None:
        self._flush(job, 0.0)
        close = getattr(job.steps, "close", None)
        if close is not None:
            close()  # a generator's cleanup (evaluates nothing more)
        self._forget(job)
        assert self._runtime is not None
        resident = len(self._runtime.resident(job.seq))
        stats = self._runtime.decode_stats(job.seq) if job.generate else None
        held = self._runtime.checkpoint_bytes()
        self._send(
            job.op,
            Finished(resident=resident, kept=job.kept, canceled=canceled, stats=stats, checkpoint_bytes=held),
        )

    def _forget(self, job: _Job) -> None:
        with self._lock:
            self._by_op.pop(job.op, None)

    def _close(self) -> None:
        for job in [*self._jobs, *self._parked.values()]:
            self._finish(job, canceled=True)
        self._jobs.clear()
        self._parked.clear()
        if self._runtime is not None:
            self._runtime.close()
            self._runtime = None
        self._closed = True


def _save(runtime: ModelRuntime, message: Save) -> Result:
    """A snapshot written into the daemon's temporary file (removed again if it failed)."""
    try:
        size = runtime.save(message.seq, message.path)
    except (OSError, ModeldError) as exc:
        with contextlib.suppress(OSError):
            os.unlink(message.path)
        if isinstance(exc, ModeldError):
            raise
        return Result(ok=False, detail=str(exc), errno=exc.errno or 0)
    return Result(size=size)


def _restore(runtime: ModelRuntime, message: Restore) -> Result:
    """A restore from the RAM tier's blob, or from a snapshot file verified here (read a
    chunk at a time) and then read by the engine itself."""
    if not message.path:
        ok = runtime.restore(message.seq, message.payload, message.tokens)
        return Result(ok=ok, detail="" if ok else REFUSED)
    assert message.header is not None  # Restore checks it
    try:
        verify_payload(Path(message.path), message.header)
        ok = runtime.restore_file(message.seq, message.path, message.header.payload_bytes, message.tokens)
    except SnapshotError as exc:
        return Result(ok=False, detail=str(exc))
    except OSError as exc:
        return Result(ok=False, detail=f"unreadable ({exc.strerror or exc})")
    return Result(ok=ok, detail="" if ok else REFUSED)
