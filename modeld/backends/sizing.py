"""What every file-backed backend's describe computes the same way: identity, context size and
the :class:`~modeld.contract.ModelInfo` of a model file (the llama and openvino backends).

``effective_context = min(trained context, requested num_ctx, (memory budget - weights -
MODEL_OVERHEAD_BYTES) / kv_bytes_per_token)`` (blueprints/0009-llama-backend.md): one sequence
of that window fits in the budget the engine counts a loaded model against (weights, KV and
the same overhead). The memory budget is the daemon's (``--memory-budget``; default
:func:`default_memory_budget`), fixed for its life: the same request is described the same way
whatever else the machine is doing. The effective
context is part of a session's runtime identity, so a size taken from the free memory of the
moment could turn a warm prefix cold when another process came or went, or when the model's own
weights were mapped.
"""

from __future__ import annotations

from typing import Protocol

import psutil

from modeld.backends.probe import MAX_SHOWN_PATH, show_path
from modeld.contract import Capabilities, ModelInfo, OpenSessionRequest, SpecialToken
from modeld.decoding.tools import detect_format
from modeld.errors import ModelLoadError

__all__ = [
    "MODEL_OVERHEAD_BYTES",
    "ModelFacts",
    "check_digest",
    "default_memory_budget",
    "effective_context",
    "model_info",
]

BUDGET_SHARE = 0.9
"""The default memory budget: this share of the machine's RAM (``--memory-budget``)."""
MODEL_OVERHEAD_BYTES = 256 << 20
"""Memory counted per loaded model beyond its weights and KV (compute buffers, the worker
process): by describe when it sizes the context, and by the engine when it loads the model."""


def default_memory_budget() -> int:
    """Weights + KV of every loaded model, by default: 90% of the machine's RAM."""
    return int(psutil.virtual_memory().total * BUDGET_SHARE)


def check_digest(path: str, requested: str, actual: str) -> None:
    """Refuse a request whose digest does not name the file as it is now."""
    if requested and requested != actual:
        raise ModelLoadError(
            f"model {show_path(path)} has digest {actual}, the request asked for {show_path(requested)}",
            path=path[:MAX_SHOWN_PATH],
            expected=requested[:MAX_SHOWN_PATH],
            actual=actual,
        )


def effective_context(
    *,
    trained: int,
    requested: int,
    memory_budget: int | None,
    weights_bytes: int,
    kv_bytes_per_token: int,
) -> int:
    """The context a session gets (see the module docstring; ``memory_budget`` None: the
    default)."""
    budget = default_memory_budget() if memory_budget is None else memory_budget
    if kv_bytes_per_token <= 0:
        fits = requested
    else:
        fits = max(0, (budget - weights_bytes - MODEL_OVERHEAD_BYTES) // kv_bytes_per_token)
    return max(0, min(trained or requested, requested, fits))


class ModelFacts(Protocol):
    """What a backend read from a model file (``GGUFInfo``, an OpenVINO ``Source``)."""

    @property
    def name(self) -> str: ...
    @property
    def digest(self) -> str: ...
    @property
    def context_length(self) -> int: ...
    @property
    def weights_bytes(self) -> int: ...
    @property
    def vocab_size(self) -> int: ...
    @property
    def tokenizer_digest(self) -> str: ...
    @property
    def chat_template(self) -> str: ...
    @property
    def add_bos(self) -> bool: ...
    @property
    def bos_token(self) -> str: ...
    @property
    def eos_token(self) -> str: ...
    @property
    def architecture(self) -> str: ...


def model_info(
    request: OpenSessionRequest,
    facts: ModelFacts,
    *,
    backend: str,
    version: str,
    kv_bytes_per_token: int,
    memory_budget: int | None,
    template_digest: str,
    device: str,
    capabilities: Capabilities,
    special_tokens: tuple[SpecialToken, ...],
) -> ModelInfo:
    """The one assembly of a model file's description (``memory_budget`` None: the default)."""
    config = request.config
    trained = facts.context_length or config.num_ctx
    effective = effective_context(
        trained=trained,
        requested=config.num_ctx,
        memory_budget=memory_budget,
        weights_bytes=facts.weights_bytes,
        kv_bytes_per_token=kv_bytes_per_token,
    )
    return ModelInfo(
        backend=backend,
        backend_version=version,
        path=request.path,
        model_name=request.model_name or facts.name,
        model_digest=facts.digest,
        model_max_context=trained,
        effective_context=effective,
        kv_bytes_per_token=kv_bytes_per_token,
        free_bytes=psutil.virtual_memory().available,
        weights_bytes=facts.weights_bytes,
        vocab_size=facts.vocab_size,
        tokenizer_digest=facts.tokenizer_digest,
        template_digest=template_digest,
        chat_template=facts.chat_template,
        add_bos=facts.add_bos,
        bos_token=facts.bos_token,
        eos_token=facts.eos_token,
        device=device,
        capabilities=capabilities,
        special_tokens=special_tokens,
        tool_format=detect_format(facts.chat_template),
        architecture=facts.architecture,
    )
