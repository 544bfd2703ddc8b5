"""A loaded model: its supervised engine host, its warm-state cache, its admission slots.

One :class:`LoadedModel` exists per (backend, file, model digest, runtime config). Its engine
runs in a worker process (or in-process for the memory backend), supervised
(``modeld/workers/supervisor.py``); its warm contexts are owned by a
:class:`~modeld.cache.warm.ModelCache`; its operations are admitted through
:class:`~modeld.engine.admission.Admission`. The vocabulary arrives once, when the worker has
loaded the model, so the daemon turns tokens into text itself.
"""

from __future__ import annotations

import contextlib
import hashlib
import logging
import os
import threading
import time
from array import array
from collections import OrderedDict
from collections.abc import Callable
from pathlib import Path

from modeld.backends.base import Backend, Layout, LoadOptions, Vocab
from modeld.backends.probe import FileIdentity, identify
from modeld.cache.pool import CacheSettings
from modeld.cache.reuse import RuntimeHistory
from modeld.cache.tiers import Tiers
from modeld.cache.warm import ModelCache
from modeld.contract import LoadedModelSummary, ModelInfo, OpenSessionRequest, WarmContextInfo
from modeld.engine.admission import Admission
from modeld.engine.chat import ChatRenderer
from modeld.errors import ModeldError
from modeld.settings import RestartPolicy, Timeouts
from modeld.workers.host import Host, InlineHost
from modeld.workers.protocol import Load
from modeld.workers.proxy import WorkerHost
from modeld.workers.supervisor import Supervisor

__all__ = ["LoadedModel", "ModelKey", "TokenMemo"]


class TokenMemo:
    """The tokens of the longest texts tokenized recently, keyed by a digest of the text.

    A warm turn resends its unchanged prefix; tokenizing it in the worker costs a round trip
    carrying the text and every token id (about 12 ms for 8k tokens before the protocol's fast
    path, 1.3 ms after: ``bench`` overhead rows). Texts shorter than ``MIN_CHARS`` are not worth
    a digest. Bounded by ``MAX_TOKENS`` in all (4 bytes each, least recently used dropped first).
    Tokenizing is a pure function of the model, so the only invalidation is a worker restart."""

    MIN_CHARS = 2048
    MAX_TOKENS = 4 << 20

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._entries: OrderedDict[bytes, array[int]] = OrderedDict()
        self._total = 0

    def key(self, text: str, add_bos: bool) -> bytes | None:
        if len(text) < self.MIN_CHARS:
            return None
        digest = hashlib.blake2b(text.encode("utf-8", "surrogatepass"), digest_size=20)
        digest.update(b"\x01" if add_bos else b"\x00")
        return digest.digest()

    def get(self, key: bytes) -> list[int] | None:
        with self._lock:
            tokens = self._entries.get(key)
            if tokens is None:
                return None
            self._entries.move_to_end(key)
            return tokens.tolist()

    def put(self, key: bytes, tokens: list[int]) -> None:
        if len(tokens) > self.MAX_TOKENS:
            return
        packed = array("I", tokens)
        with self._lock:
            old = self._entries.pop(key, None)
            self._total -= len(old) if old is not None else 0
            self._entries[key] = packed
            self._total += len(packed)
            while self._total > self.MAX_TOKENS:
                _, dropped = self._entries.popitem(last=False)
                self._total -= len(dropped)

    def clear(self) -> None:
        with self._lock:
            self._entries.clear()
            self._total = 0


def _identity_of(path: str) -> FileIdentity | None:
    """The model file's identity when it was loaded (None for a model that is not a file)."""
    if not path or not os.path.isfile(path):
        return None
    try:
        return identify(path)
    except ModeldError:
        return None


log = logging.getLogger("modeld.engine")

ModelKey = tuple[str, str, str, str]
"""(backend, path, model digest, runtime digest)"""


class LoadedModel:
    """One loaded model and everything the engine keeps about it."""

    def __init__(
        self,
        key: ModelKey,
        request: OpenSessionRequest,
        info: ModelInfo,
        options: LoadOptions,
        *,
        backend: Backend,
        isolation: str,
        tiers: Tiers | None,
        history: RuntimeHistory,
        cache_settings: CacheSettings,
        timeouts: Timeouts,
        restart: RestartPolicy,
        slots: int,
        max_queue: int,
        wait_seconds: float,
        log_level: str = "INFO",
        on_restart: Callable[[LoadedModel, ModeldError], None] | None = None,
        on_state: Callable[[str, str], None] | None = None,
        on_wait: Callable[[float], None] | None = None,
    ) -> None:
        self.key = key
        self.backend = backend
        """The daemon side of the model's backend (describes, checks a decode's extra values)."""
        self.info = info
        self.options = options
        self.isolation = isolation
        self.sessions = 0
        self.cost = 0
        """Bytes counted against the engine's memory budget (weights, KV pool, overhead)."""
        self.loaded_at = time.time()
        self.last_used_at = self.loaded_at
        self._renderer: ChatRenderer | None = None
        self._tokens = TokenMemo()
        self._on_restart = on_restart
        name = f"{Path(info.path).name or info.backend}"[:40]
        self._file_identity = _identity_of(info.path)
        self.name = name
        load = Load(info.backend, request, info, options)

        def make_host(on_exit: Callable[[WorkerHost], None]) -> Host:
            if isolation == "inline":
                from modeld.workers.child import load_runtime

                return InlineHost(load_runtime, name=name[:12])
            return WorkerHost(name, log_level=log_level, on_exit=on_exit, explain_exit=self._explain_exit)

        self.supervisor = Supervisor(
            name,
            make_host,
            load,
            timeouts=timeouts,
            policy=restart,
            on_reset=self._reset,
            on_state=(lambda state: on_state(info.model_name, state)) if on_state is not None else None,
        )
        host = self.supervisor.start()  # raises ModelLoadError; nothing is registered then
        assert host.layout is not None
        assert host.vocab is not None
        self.layout: Layout = host.layout
        self.vocab: Vocab = host.vocab
        self.cache = ModelCache(
            name=name,
            model_digest=info.model_digest,
            layout=self.layout,
            runtime=self.supervisor.host,
            tiers=tiers,
            settings=cache_settings,
            file_key=(key[0], key[1]),
            history=history,
        )
        self.admission = Admission(
            slots or self.layout.n_seq,
            max_queue=max_queue,
            wait_seconds=wait_seconds,
            name=name,
            on_wait=on_wait,
        )

    @property
    def window(self) -> int:
        return self.layout.window

    def host(self) -> Host:
        return self.supervisor.host()

    def chat_renderer(self) -> ChatRenderer:
        """The model's chat template, compiled once (raises ``unsupported`` if it has none)."""
        if self._renderer is None:
            self._renderer = ChatRenderer(
                self.info.chat_template, bos_token=self.info.bos_token, eos_token=self.info.eos_token
            )
        return self._renderer

    def tokenize(self, text: str, add_bos: bool) -> list[int]:
        """The model's tokens for ``text``; a long text seen recently (the unchanged prefix of a
        warm turn) is answered from the memo, without a round trip to the worker."""
        key = self._tokens.key(text, add_bos)
        if key is not None and (known := self._tokens.get(key)) is not None:
            return known
        tokens = self.host().tokenize(text, add_bos=add_bos)
        if key is not None:
            self._tokens.put(key, tokens)
        return tokens

    def warm_contexts(self) -> tuple[WarmContextInfo, ...]:
        """Every warm context of this model, in the KV and in the tiers."""
        return self.cache.views()

    def _reset(self, error: ModeldError) -> None:
        """The worker died: whatever its KV held is gone (the tiers are not)."""
        self._tokens.clear()  # a worker restarted on a file changed in place may tokenize otherwise
        self.cache.reset(error)
        if self._on_restart is not None:
            self._on_restart(self, error)

    def _explain_exit(self) -> str | None:
        """What modeld knows about why the worker died (a model file changed under it)."""
        from modeld.backends.probe import changed

        if self._file_identity is None:
            return None
        what = changed(self.info.path, self._file_identity)
        return f"the model file was {what} while it was loaded" if what else None

    def close(self, *, persist: bool) -> None:
        """Save warm contexts (to disk when ``persist``), then stop the worker."""
        with contextlib.suppress(ModeldError):
            if persist:
                self.cache.persist_all()
        self.cache.close()
        self.supervisor.stop()

    def summary(self) -> LoadedModelSummary:
        return LoadedModelSummary(
            backend=self.info.backend,
            path=self.info.path,
            model_name=self.info.model_name,
            model_digest=self.info.model_digest,
            n_ctx=self.layout.window,
            resident_tokens=self.cache.used_cells(),
            sessions=self.sessions,
            loaded_at=self.loaded_at,
            last_used_at=self.last_used_at,
        )
