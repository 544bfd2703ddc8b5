"""A loaded model: its runtime, the label of its resident KV, the lock sessions share, and the
one engine thread every native call for it runs on.

Why one thread: llama.cpp's CPU backend parallelizes with OpenMP, whose thread team belongs to
the calling thread. Calling from a different thread each time leaves the previous team spinning
while a new one works: measured here, decoding the realistic model from a fresh thread ran at
33.6 tok/s against 40 from the thread that prefilled. Running every KV operation of a model on
one thread avoids that, and is the same seam a worker process will later take over.
"""

from __future__ import annotations

import contextlib
import itertools
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from typing import TypeVar

from modeld.backends import Interrupted, ModelRuntime
from modeld.contract import LoadedModelSummary, ModelInfo
from modeld.engine.chat import ChatRenderer
from modeld.errors import BusyError
from modeld.manifest import ContextManifest

__all__ = ["EngineThread", "LoadedModel"]

_T = TypeVar("_T")


class EngineThread:
    """A single thread that runs every native call for one model."""

    def __init__(self, name: str) -> None:
        self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix=f"engine-{name}")
        self._ident: int | None = self._executor.submit(threading.get_ident).result()

    def is_current(self) -> bool:
        return threading.get_ident() == self._ident

    def run(self, fn: Callable[..., _T], *args: object) -> _T:
        """Run ``fn`` on the engine thread and wait for its result (exceptions propagate)."""
        return self._executor.submit(fn, *args).result()

    def submit(self, fn: Callable[..., _T], *args: object) -> Future[_T]:
        return self._executor.submit(fn, *args)

    def shutdown(self) -> None:
        self._executor.shutdown(wait=True)


class LoadedModel:
    """A loaded runtime, its resident KV's label, and the lock sessions take turns on."""

    def __init__(
        self, key: tuple[str, str, str, str], runtime: ModelRuntime, info: ModelInfo, thread: EngineThread
    ) -> None:
        self.key = key
        self.runtime = runtime
        self.info = info
        self.thread = thread
        self.lock = threading.Lock()
        self.manifest: ContextManifest | None = None  # what the resident KV was computed under
        self.prefix_tokens = 0  # length of the prefix part of the resident context
        self.reset_reason = ""
        self.sessions = 0
        self.loaded_at = time.time()
        self.last_used_at = self.loaded_at
        self._piece_len: dict[int, int] = {}
        self._renderer: ChatRenderer | None = None

    def chat_renderer(self) -> ChatRenderer:
        """The model's chat template, compiled once (raises ``unsupported`` if it has none)."""
        if self._renderer is None:
            self._renderer = ChatRenderer(
                self.info.chat_template, bos_token=self.info.bos_token, eos_token=self.info.eos_token
            )
        return self._renderer

    def piece_len(self, token: int) -> int:
        n = self._piece_len.get(token)
        if n is None:
            n = self._piece_len[token] = len(self.runtime.piece(token))
        return n

    def byte_ends(self, tokens: Sequence[int], *, added_bos: bool) -> list[int]:
        """Cumulative byte end offset of each token in the text it was tokenized from.

        A BOS token that tokenize added (``added_bos``) is not in the text: it takes no bytes.
        Control tokens parsed *from* the text (``<|im_start|>`` in a rendered template) do.
        """
        lengths = (self.piece_len(t) for t in tokens)
        ends = list(itertools.accumulate(lengths))
        if added_bos and ends:
            first = ends[0]
            ends = [e - first for e in ends]
        return ends

    def acquire(self, wait: float, interrupt: Callable[[], bool]) -> ModelRuntime:
        """Take the model for one operation; wait at most ``wait`` seconds for other sessions.

        Always called on a session's (caller's) thread, never on the engine thread, so that a
        waiting operation can never block the thread the holder needs.
        """
        deadline = time.monotonic() + wait
        while not self.lock.acquire(timeout=min(0.05, max(0.0, deadline - time.monotonic()))):
            if interrupt():
                raise Interrupted
            if time.monotonic() >= deadline:
                raise BusyError(
                    f"the model stayed busy with other sessions for {wait:.0f}s",
                    wait_seconds=int(wait),
                )
        self.last_used_at = time.time()
        return self.runtime

    def release(self) -> None:
        self.last_used_at = time.time()
        self.lock.release()

    @contextlib.contextmanager
    def turn(self, wait: float, interrupt: Callable[[], bool]) -> Iterator[ModelRuntime]:
        """Hold the model for one operation (see :meth:`acquire`)."""
        runtime = self.acquire(wait, interrupt)
        try:
            yield runtime
        finally:
            self.release()

    def close(self) -> None:
        """Free the runtime on its engine thread, then stop the thread."""
        with contextlib.suppress(Exception):
            self.thread.run(self.runtime.close)
        self.thread.shutdown()

    def summary(self) -> LoadedModelSummary:
        return LoadedModelSummary(
            backend=self.info.backend,
            path=self.info.path,
            model_name=self.info.model_name,
            model_digest=self.info.model_digest,
            n_ctx=self.runtime.n_ctx,
            resident_tokens=len(self.runtime.resident),
            sessions=self.sessions,
            loaded_at=self.loaded_at,
            last_used_at=self.last_used_at,
        )
