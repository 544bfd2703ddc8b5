"""The narrow interface between the engine and an inference engine.

A backend describes and loads models; a loaded model (:class:`ModelRuntime`) owns exactly one
resident KV sequence and offers the few operations the engine needs to implement the whole
contract on top: tokenize, cut the KV at a token, evaluate more tokens, generate. Everything
else -- manifests, reuse decisions, accounting, stop strings, UTF-8 safe streaming, fencing,
limits -- is the engine's, written once for every backend (``modeld/engine/``).

Keeping this seam narrow is deliberate: the intended shape is one engine worker process per
loaded model, and moving a backend into a worker must change only the implementation of this
interface (see ``blueprints/0001-the-seam.md``).

Thread-safety: the engine serializes every KV operation (``configure``, ``truncate``, ``extend``,
``generate``) per runtime. ``tokenize``, ``piece`` and ``is_eog`` must be safe to call at any
time from any thread.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from typing import Protocol

from modeld.contract import Config, DecodeConfig, ModelInfo, OpenSessionRequest

__all__ = ["Backend", "Interrupt", "Interrupted", "ModelRuntime"]

Interrupt = Callable[[], bool]
"""Polled between engine steps; returning True asks the runtime to stop as soon as it can."""


class Interrupted(Exception):  # noqa: N818 - a control-flow signal, not an error
    """Raised by :meth:`ModelRuntime.extend` when the interrupt fired part way.

    ``resident`` is then a prefix of what was asked for: the KV stays consistent.
    """


class ModelRuntime(Protocol):
    """One loaded model and its single resident KV sequence."""

    @property
    def info(self) -> ModelInfo:
        """The model's description (as ``Backend.describe`` gave it when loading)."""
        ...

    @property
    def n_ctx(self) -> int:
        """The context window of the current configuration, in tokens."""
        ...

    @property
    def resident(self) -> Sequence[int]:
        """The tokens whose KV is held now, in order (only evaluated tokens)."""
        ...

    @property
    def can_truncate(self) -> bool:
        """Whether :meth:`truncate` may cut at any position (False for recurrent memory)."""
        ...

    def tokenize(self, text: str, *, add_bos: bool) -> list[int]: ...

    def piece(self, token: int) -> bytes:
        """The bytes a token stands for (empty for control tokens such as BOS)."""
        ...

    def is_eog(self, token: int) -> bool:
        """Whether a token ends generation."""
        ...

    def configure(self, config: Config) -> bool:
        """Make the KV ready for ``config``; True if that emptied it (a different runtime)."""
        ...

    def truncate(self, keep: int) -> None:
        """Drop resident tokens after the first ``keep``. ``keep == 0`` always works."""
        ...

    def extend(self, tokens: Sequence[int], interrupt: Interrupt) -> None:
        """Evaluate ``tokens`` after the resident ones (raises :class:`Interrupted`)."""
        ...

    def check_decode(self, config: DecodeConfig) -> None:
        """Raise ``UnsupportedError`` for anything in ``config`` this runtime cannot honour."""
        ...

    def generate(self, config: DecodeConfig, interrupt: Interrupt) -> Iterator[int]:
        """Sample tokens from the resident state.

        Each yielded token is evaluated (becomes resident) when the iterator is resumed, before
        the next one is sampled; so when the consumer stops, the last yielded token is not
        resident. Needs at least one resident token.
        """
        ...

    def close(self) -> None:
        """Free the model and its KV."""
        ...


class Backend(Protocol):
    """Describes and loads models of one kind."""

    @property
    def name(self) -> str: ...

    def describe(self, request: OpenSessionRequest) -> ModelInfo:
        """Read what the model is and what it can do here, without loading the weights."""
        ...

    def load(self, request: OpenSessionRequest, info: ModelInfo) -> ModelRuntime:
        """Load the model described by ``info``; raises ``ModelLoadError`` naming the file."""
        ...
