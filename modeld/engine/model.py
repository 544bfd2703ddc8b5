"""A loaded model: its supervised engine host, its warm-state cache, its admission slots.

One :class:`LoadedModel` exists per (backend, file, model digest, runtime config). Its engine
runs in a worker process (or in-process for the memory backend), supervised
(``modeld/workers/supervisor.py``); its warm contexts are owned by a
:class:`~modeld.cache.warm.ModelCache`; its operations are admitted through
:class:`~modeld.engine.admission.Admission`. The vocabulary arrives once, when the worker has
loaded the model, so the daemon turns tokens into text itself.

Its :class:`FileWatch` says whether the model file is still the one that was loaded: sessions
ask before every turn that would reuse KV (``blueprints/0013``, "Change detection").
"""

from __future__ import annotations

import contextlib
import dataclasses
import hashlib
import logging
import os
import threading
import time
from array import array
from collections.abc import Callable
from pathlib import Path

from modeld.backends.base import Backend, Layout, LoadOptions, Vocab
from modeld.backends.probe import Probe, changed, probe_model_path, show_path
from modeld.cache.pool import CacheSettings
from modeld.cache.reuse import RuntimeHistory
from modeld.cache.tiers import Tiers
from modeld.cache.warm import ModelCache
from modeld.contract import ModelInfo, OpenSessionRequest, WarmContextInfo
from modeld.engine.admission import Admission
from modeld.engine.chat import ChatRenderer
from modeld.engine.jobs import GenerateEnd, GenerateEvent, RoomAsked, Sampled
from modeld.engine.prepare import BoundedMemo, PrefixMemo
from modeld.errors import ModelChangedError, ModeldError
from modeld.observe.status import LoadedModelSummary
from modeld.settings import RestartPolicy, Timeouts
from modeld.workers.host import Call, Host, InlineHost
from modeld.workers.protocol import Finished, Load, Room, Tokens
from modeld.workers.proxy import WorkerHost
from modeld.workers.supervisor import Supervisor

__all__ = ["FileWatch", "GenerateCall", "LoadedModel", "ModelKey", "TokenMemo"]


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
        self._memo: BoundedMemo[array[int]] = BoundedMemo(lambda: self.MAX_TOKENS, len)

    def key(self, text: str, add_bos: bool) -> bytes | None:
        if len(text) < self.MIN_CHARS:
            return None
        digest = hashlib.blake2b(text.encode("utf-8", "surrogatepass"), digest_size=20)
        digest.update(b"\x01" if add_bos else b"\x00")
        return digest.digest()

    def get(self, key: bytes) -> list[int] | None:
        tokens = self._memo.get(key)
        return None if tokens is None else tokens.tolist()

    def put(self, key: bytes, tokens: list[int]) -> None:
        self._memo.put(key, array("I", tokens))

    def clear(self) -> None:
        self._memo.clear()


log = logging.getLogger("modeld.engine")


class FileWatch:
    """Whether a model path still holds the model that was loaded from it. Thread-safe.

    A model file rewritten in place under an open session (a re-download or ``cp`` over it)
    would otherwise go on serving KV computed under the old weights next to new ones: llama.cpp
    maps the file, so the loaded worker itself reads the new bytes. :meth:`check` costs one
    ``stat`` (a directory: one per file in it) while nothing moved. When the identity moved
    (device, inode, size, mtime, ctime), the file is described again (its digest: the
    ``gguf-v1`` fingerprint, cached per identity) and compared: the same digest (``touch``,
    ``chmod``, the same bytes copied over it) adopts the new identity (verified only once the
    file has not changed for two seconds: a write still copying shows its final identity over a
    mix of bytes, so until then every check describes again); another digest, or a path
    that no longer describes as a model (removed, truncated, half written), is
    :class:`~modeld.errors.ModelChangedError`, for good: that model is gone from the path."""

    def __init__(self, path: str, digest: str, describe: Callable[[], str]) -> None:
        """``describe``: the digest of what ``path`` holds now (raises ``ModeldError`` when it
        does not describe). Raises :class:`ModelChangedError` when the file already differs
        from ``digest`` (it changed between describe and load)."""
        self.path = path
        self.digest = digest
        self._describe = describe
        self._lock = threading.Lock()
        self.changed: ModelChangedError | None = None
        self._seen_verified = False
        """The identity seen was described and found to hold the loaded digest (the first
        check verifies the identity taken here against the digest described before)."""
        self._seen: Probe | None = self._probe()
        if self._seen is None:
            raise self._error("removed", "", "it cannot be read now")
        if self.check() is not None:  # the file as it is now: the digest the model was described with?
            assert self.changed is not None
            raise self.changed

    def _probe(self) -> Probe | None:
        try:
            return probe_model_path(self.path, directory_ok=True)
        except ModeldError:
            return None

    def check(self) -> ModelChangedError | None:
        """The change, once the path no longer holds the loaded model; None while it does."""
        if self.changed is not None:
            return self.changed
        now = self._probe()
        if now is not None and now == self._seen and self._seen_verified:
            return None
        with self._lock:
            if self.changed is not None:
                return self.changed
            seen = self._seen
            assert seen is not None
            what = changed(self.path, seen.identity) or (
                "changed (a file inside it)" if seen.kind == "directory" else "changed"
            )
            try:
                digest, why = self._describe(), ""
            except ModeldError as exc:
                digest, why = "", exc.message
            after = self._probe()
            if digest == self.digest:
                if after is not None and after == now:
                    # A file changed within the last seconds may still be being written under
                    # the identity seen: it is described again at the next check until settled.
                    self._seen, self._seen_verified = after, after.settled()
                    if seen != now:
                        log.info("model file %s changed on disk (%s) with the same digest", self.path, what)
                return None  # moved again meanwhile: the next check describes once more
            self.changed = self._error(what, digest, why)
            return self.changed

    def _error(self, what: str, digest: str, why: str) -> ModelChangedError:
        now = f"digest {digest[:12]}" if digest else f"no longer a model: {why}"
        return ModelChangedError(
            f"the model file {show_path(self.path)} was {what} since its model was loaded "
            f"(digest {self.digest[:12]}; now {now}): warm state computed under the old file is "
            "never reused for the new one, so this session has ended. Open a new session (it "
            "loads the file as it is now) and run the turn again",
            path=self.path[:200],
            change=what,
            loaded_digest=self.digest,
            digest=digest,
        )

    @property
    def identity(self) -> Probe | None:
        """The path's identity last verified to hold the loaded model."""
        return self._seen


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
        on_changed: Callable[[LoadedModel, ModelChangedError], None] | None = None,
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
        self._renderers: dict[str, ChatRenderer] = {}
        self._tokens = TokenMemo()
        self.prefixes = PrefixMemo()
        self._heads: dict[tuple[bool, bool, str], tuple[tuple[int, ...], ...]] = {}
        self._on_restart = on_restart
        name = f"{Path(info.path).name or info.backend}"[:40]
        self._on_changed = on_changed
        self._watch: FileWatch | None = None
        if info.path and (backend.name != "memory" or os.path.isfile(info.path)):
            # a memory-backend model named by a word is no file: nothing to watch
            unpinned = dataclasses.replace(request, digest="")  # the file may have another one now
            self._watch = FileWatch(
                info.path, info.model_digest, lambda: backend.describe(unpinned).model_digest
            )
        self._change_told = threading.Lock()
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
        if self.layout.explicit and self.layout.memory != info.footprint.memory:
            # describe read the file; the loaded engine knows (and decides how it is cut).
            log.warning(
                "%s: the engine says its memory is %s, describe read %s from the file",
                info.path,
                self.layout.memory,
                info.footprint.memory,
            )
        self.cache = ModelCache(
            name=name,
            model_digest=info.model_digest,
            layout=self.layout,
            runtime=self.supervisor.host,
            checkpoints=lambda: self.supervisor.checkpoint_bytes,
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

    def chat_renderer(self, template: str | None = None) -> ChatRenderer:
        """A renderer of ``template`` (None: the model file's), made once per template (raises
        ``unsupported`` if there is none). Sessions may render with their own template
        (``OpenSessionRequest.chat_template``)."""
        source = self.info.chat_template if template is None else template
        renderer = self._renderers.get(source)
        if renderer is None:
            renderer = ChatRenderer(source, bos_token=self.info.bos_token, eos_token=self.info.eos_token)
            if len(self._renderers) >= 16:
                self._renderers.clear()
            self._renderers[source] = renderer
        return renderer

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

    def prefix_heads(
        self, chat: bool, add_bos: bool, template: str | None = None
    ) -> tuple[tuple[int, ...], ...]:
        """Token lists every prefix of a format starts with, whatever its text: the BOS token
        (raw), or the chat template's head before the first message's text, for a conversation
        that starts with a system message and for one that starts with a user message (a
        default system turn included). A turn that shares no more than one of these with a warm
        context is a new conversation (``reuse.classify``). Computed once per format: two
        renderings of each, tokenized, and their common start."""
        key = (chat, add_bos, template or "")
        known = self._heads.get(key)
        if known is not None:
            return known
        if not chat:
            heads: tuple[tuple[int, ...], ...] = (tuple(self.tokenize("", add_bos)),)
        else:
            from modeld.cache.reuse import common_prefix_len
            from modeld.engine.chat import Message
            from modeld.engine.chat_env import TemplateRefusedError

            renderer, bos = self.chat_renderer(template), self.info.bos_token
            found = []
            for opening in ([], [Message("user", "x", ())]):
                ab = []
                for text in ("A", "Z"):
                    first = Message("system" if opening else "user", text, ())
                    try:  # a template that refuses this opening has no head for it
                        rendered = renderer.render([first, *opening], None, add_generation_prompt=True)
                    except TemplateRefusedError:
                        break
                    ab.append(self.tokenize(rendered, add_bos and not (bos and rendered.startswith(bos))))
                if len(ab) == 2:
                    found.append(tuple(ab[0][: common_prefix_len(ab[0], ab[1])]))
            heads = tuple(found)
        self._heads[key] = heads
        return heads

    def warm_contexts(self, listed: set[str] | None = None) -> tuple[WarmContextInfo, ...]:
        """Every warm context of this model, in the KV and in the tiers (the snapshots it can
        restore; those keyed in ``listed`` left out: ``ModelCache.views``)."""
        return self.cache.views(listed)

    def file_changed(self) -> ModelChangedError | None:
        """The model file's change, once it no longer holds this model (None while it does).

        One ``stat`` while nothing moved (``FileWatch``). The first caller to see a change
        tells the engine (``on_changed``), which ends every session of this model and retires
        it without saving its warm contexts: KV computed under the old file is never reused for
        the new one (its tier snapshots are keyed by the old digest)."""
        if self._watch is None:
            return None
        problem = self._watch.check()
        if problem is not None and self._change_told.acquire(blocking=False):
            log.warning("%s", problem.message)
            if self._on_changed is not None:
                self._on_changed(self, problem)
        return problem

    def check_file(self) -> None:
        """Raise :class:`ModelChangedError` when the model file no longer holds this model."""
        problem = self.file_changed()
        if problem is not None:
            raise problem

    def _reset(self, error: ModeldError) -> None:
        """The worker died: whatever its KV held is gone (the tiers are not)."""
        self._tokens.clear()  # a worker restarted on a file changed in place may tokenize otherwise
        self.prefixes.clear()
        self.cache.reset(error)
        if self._on_restart is not None:
            self._on_restart(self, error)
        self.file_changed()  # a worker killed by a changed file (SIGBUS) must not restart on it

    def _explain_exit(self) -> str | None:
        """What modeld knows about why the worker died (a model file changed under it)."""
        seen = self._watch.identity if self._watch is not None else None
        if seen is None:
            return None
        what = changed(self.info.path, seen.identity)
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


class GenerateCall:
    """A generate job in flight on a worker host, read as the engine's typed events
    (:class:`~modeld.engine.jobs.GenerateJob`): the one place a worker's ``Tokens``, ``Room``
    and ``Finished`` replies become :class:`~modeld.engine.jobs.Sampled`,
    :class:`~modeld.engine.jobs.RoomAsked` and :class:`~modeld.engine.jobs.GenerateEnd`."""

    def __init__(self, call: Call) -> None:
        self.call = call

    def next_event(self, timeout: float | None = None) -> GenerateEvent | None:
        event = self.call.next_event(timeout)
        if event is None:
            return None
        if isinstance(event, Tokens):
            return Sampled(event.tokens, event.logprobs, event.choices)
        if isinstance(event, Room):
            return RoomAsked(event.resident)
        if isinstance(event, Finished):
            return GenerateEnd(event.resident, event.canceled, event.stats)
        return None  # no other reply answers a generate job (a sync job's Progress is skipped)

    def cancel(self) -> None:
        self.call.cancel()

    def cancel_choice(self, choice: int) -> None:
        self.call.cancel_choice(choice)

    def grant(self, cells: int) -> None:
        self.call.grant(cells)
