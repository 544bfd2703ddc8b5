"""Harnesses that run one contract suite against every implementation.

A harness gives the suite a Service (the in-process engine, or the runtime client talking to
a real gRPC server on a temporary unix socket), the engine behind it (to revoke ownership or
inspect the KV), and the backend's tokenizer, so that every assertion is exact and
backend-neutral. New backends add a harness here; the suite does not change.
"""

from __future__ import annotations

import shutil
import tempfile
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

from modeld.contract import Config, OpenSessionRequest, Service, Session
from modeld.daemon import Server, parse_listen
from modeld.engine import Engine, Limits, LoadedModel
from modeld.settings import Residency

TEST_LIMITS = Limits(
    max_sessions=8,
    max_text_bytes=256 << 10,
    max_message_bytes=1 << 20,
    max_segments=64,
    model_wait_seconds=10.0,
    attach_timeout_seconds=2.0,
)


@dataclass
class Model:
    """How to name a model of one backend, and how to make files that stand in for one."""

    backend: str
    path: str
    make_variant: Callable[[Path, int], None] | None = None  # write model variant i at a path
    slow_extra: dict[str, str] = field(default_factory=dict)  # DecodeConfig.extra for a slow decode
    window: int = 4096


def memory_model() -> Model:
    def make(path: Path, variant: int) -> None:
        path.write_text(f"memory model variant {variant}\n")

    return Model(backend="memory", path="tiny", make_variant=make, slow_extra={"delay_ms": "20"})


def llama_model() -> Model:
    from modeld.testmodels import TINY, ensure_model

    def make(path: Path, variant: int) -> None:
        shutil.copyfile(ensure_model(replace(TINY, seed=1000 + variant)), path)

    return Model(backend="llama", path=str(ensure_model(TINY)), make_variant=make)


def openvino_model() -> Model:
    return replace(llama_model(), backend="openvino")


def arch_model(name: str) -> Model:
    """The generated model ``name`` of ``modeld.testmodels.ARCH_SPECS`` (sliding-window, hybrid
    and recurrent memory) on the llama backend; variants are the same shape with other seeds."""
    from modeld.testmodels import ARCH_SPECS, ensure_model

    spec = next(s for s in ARCH_SPECS if s.name == name)

    def make(path: Path, variant: int) -> None:
        shutil.copyfile(ensure_model(replace(spec, seed=1000 + variant)), path)

    return Model(backend="llama", path=str(ensure_model(spec)), make_variant=make)


def model_of(key: str) -> Model:
    """``key`` is a backend (``llama``) or ``llama/<arch spec name>`` (``llama/hybrid-qwen35``)."""
    if key.startswith("llama/"):
        return arch_model(key.removeprefix("llama/"))
    return MODELS[key]()


MODELS: dict[str, Callable[[], Model]] = {
    "memory": memory_model,
    "llama": llama_model,
    "openvino": openvino_model,
}


@dataclass
class Harness:
    name: str
    model: Model
    service: Service
    engine: Engine
    wire: bool
    tmp: Path
    server: Any = None  # the gRPC Server (wire harnesses)
    _tokenizer: Any = None

    @property
    def backend(self) -> str:
        return self.model.backend

    def request(
        self, path: str | None = None, digest: str = "", fence: str = "", **config: Any
    ) -> OpenSessionRequest:
        from modeld.contract import Fence

        return OpenSessionRequest(
            type=self.model.backend,
            path=path or self.model.path,
            digest=digest,
            config=replace(Config(), **config),
            fence=Fence(fence),
        )

    def open(self, **config: Any) -> Session:
        return self.service.open_session(self.request(**config))

    def loaded(self) -> LoadedModel:
        """The engine's loaded model of the harness's model (loaded on first use), whose engine
        tokenizes for the assertions exactly as sessions do."""
        if self._tokenizer is None:
            req = self.request()
            self.engine.tokenize(req, "")
            info = self.engine.describe(req)
            self._tokenizer = next(
                m for m in self.engine.models() if m.info.model_digest == info.model_digest
            )
        model: LoadedModel = self._tokenizer
        return model

    def tokenize(self, text: str, add_bos: bool = True) -> list[int]:
        model = self.loaded()
        tokens = model.tokenize(text, False)
        if add_bos and model.info.add_bos and model.vocab.bos >= 0:
            tokens.insert(0, model.vocab.bos)
        return tokens

    def detokenize(self, tokens: list[int]) -> bytes:
        vocab = self.loaded().vocab
        return b"".join(vocab.piece(t) for t in tokens)


@contextmanager
def local_harness(model: Model, limits: Limits = TEST_LIMITS, isolation: str = "auto") -> Iterator[Harness]:
    tmp = Path(tempfile.mkdtemp(prefix="mdt"))
    engine = Engine(backends=(model.backend,), limits=limits, residency=Residency(isolation=isolation))
    name = f"{model.backend}-{'worker' if isolation == 'process' else 'local'}"
    try:
        yield Harness(name, model, engine, engine, False, tmp)
    finally:
        engine.shutdown()
        shutil.rmtree(tmp, ignore_errors=True)


@contextmanager
def wire_harness(model: Model, limits: Limits = TEST_LIMITS) -> Iterator[Harness]:
    from runtime_client import connect

    tmp = Path(tempfile.mkdtemp(prefix="mdt"))  # short: unix socket paths are limited
    engine = Engine(backends=(model.backend,), limits=limits)
    server = Server(engine, parse_listen(f"unix:{tmp}/modeld.sock"), limits)
    endpoint = server.start()
    client = connect(endpoint, max_message_bytes=limits.max_message_bytes)
    try:
        yield Harness(f"{model.backend}-wire", model, client, engine, True, tmp, server)
    finally:
        client.close()
        server.stop(grace=0.2)
        shutil.rmtree(tmp, ignore_errors=True)


def status_answers_during(h: Harness, work: Callable[[], object]) -> int:
    """How many Status calls the daemon answered while ``work`` ran on another thread.

    The engine's native calls must release the GIL: if they held it, Status would wait for the
    work to finish and the count would be 0.
    """
    import threading
    import time

    done = threading.Event()

    def run() -> None:
        try:
            work()
        finally:
            done.set()

    worker = threading.Thread(target=run)
    worker.start()
    answered = 0
    while not done.is_set():
        h.service.status()  # type: ignore[attr-defined]
        if not done.is_set():
            answered += 1
        time.sleep(0.05)
    worker.join()
    return answered
