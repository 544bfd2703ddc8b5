"""A loaded model: its runtime, the label of its resident KV, and the lock sessions share."""

from __future__ import annotations

import contextlib
import itertools
import threading
import time
from collections.abc import Callable, Iterator, Sequence

from modeld.backends import Interrupted, ModelRuntime
from modeld.contract import LoadedModelSummary, ModelInfo
from modeld.engine.chat import ChatRenderer
from modeld.errors import BusyError
from modeld.manifest import ContextManifest

__all__ = ["LoadedModel"]


class LoadedModel:
    """A loaded runtime, its resident KV's label, and the lock sessions take turns on."""

    def __init__(self, key: tuple[str, str, str, str], runtime: ModelRuntime, info: ModelInfo) -> None:
        self.key = key
        self.runtime = runtime
        self.info = info
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

    @contextlib.contextmanager
    def turn(self, wait: float, interrupt: Callable[[], bool]) -> Iterator[ModelRuntime]:
        """Hold the model for one operation; wait at most ``wait`` seconds for other sessions."""
        deadline = time.monotonic() + wait
        while not self.lock.acquire(timeout=min(0.05, max(0.0, deadline - time.monotonic()))):
            if interrupt():
                raise Interrupted
            if time.monotonic() >= deadline:
                raise BusyError(
                    f"the model stayed busy with other sessions for {wait:.0f}s",
                    wait_seconds=int(wait),
                )
        try:
            self.last_used_at = time.time()
            yield self.runtime
        finally:
            self.lock.release()

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
