"""The llama.cpp backend, daemon side: describes GGUF models without importing llama.cpp.

Describing reads the file's metadata (:mod:`modeld.backends.gguf_meta`: bounded, safe); loading
happens in the engine worker (:mod:`modeld.backends.llama_runtime`, which imports
llama-cpp-python), so the daemon process never loads a native engine (blueprint 0017). Design
record: ``blueprints/0009-llama-backend.md``; warm sequences, snapshots and numerics:
``blueprints/0016-warm-state.md``.
"""

from __future__ import annotations

import functools
import importlib.metadata
import importlib.util

from modeld.backends.base import LoadOptions, ModelRuntime, default_batch
from modeld.backends.gguf_meta import GGUFInfo, kv_bytes_per_token, read_gguf, swa_kv_bytes_per_token
from modeld.backends.sizing import MODEL_OVERHEAD_BYTES, check_digest, model_info
from modeld.contract import (
    CONSTRAINT_KINDS,
    Capabilities,
    Config,
    DecodeConfig,
    Footprint,
    ModelInfo,
    OpenSessionRequest,
    SpecialToken,
)
from modeld.decoding.samplers import SAMPLER_NAMES
from modeld.errors import BackendUnavailableError, ModelLoadError, UnsupportedError

__all__ = ["CUTS", "LlamaBackend", "backend_version", "model_footprint"]


QUANTIZED_KV = ("q8_0", "q4_0")


def model_footprint(meta: GGUFInfo, config: Config) -> Footprint:
    """The model's own memory figures, from its header (``Footprint``'s first five fields).

    The compute buffer is llama.cpp's worst-case graph for one micro-batch of ``b = num_batch``
    tokens over ``c`` cells: with flash attention off, the attention scores and the mask
    (``b x c x (heads + 1) x 4`` bytes) plus a feed-forward's activations
    (``b x (ff + embedding) x 4``); with it on, the f16 mask (``b x c x 2``) plus
    ``b x ff x 16``; never less than the output logits (``b x (vocab x 4 + embedding x 8)``).
    Checked against llama.cpp's own "compute buffer size" (tests/backends/test_describe_footprint.py):
    within 4% on the test models from 2k to 32k cells, both settings."""
    b = default_batch(config, meta.memory)
    ff, embd = meta.feed_forward_length, meta.embedding_length
    if meta.recurrent:
        per_token, fixed = 0, b * (ff + embd) * 4
    elif config.flash_attn:
        per_token, fixed = b * 2, b * ff * 16
    else:
        per_token, fixed = b * (meta.heads + 1) * 4, b * (ff + embd) * 4
    return Footprint(
        weights_bytes=meta.weights_bytes,
        kv_bytes_per_token=kv_bytes_per_token(meta, config.kv_cache_type),
        compute_floor_bytes=b * (meta.vocab_size * 4 + embd * 8),
        compute_fixed_bytes=fixed,
        compute_bytes_per_token=per_token,
        memory=meta.memory,
        sliding_window=meta.sliding_window,
        state_bytes=meta.state_bytes,
        cuts=CUTS[meta.memory],
        swa_kv_bytes_per_token=swa_kv_bytes_per_token(meta, config.kv_cache_type)
        if meta.memory == "sliding-window"
        else 0,
        micro_batch=b,
    )


CUTS = {
    "attention": "any token",
    "sliding-window": (
        "where the cache still holds the window before the cut, else back to a checkpoint of the "
        "window at or before it"
    ),
    "hybrid": "back to a checkpoint of the recurrent state at or before the cut",
    "recurrent": "back to a checkpoint of the recurrent state at or before the cut",
}
"""Where a warm sequence of each kind of memory can be cut (``Footprint.cuts``; blueprint 0016)."""


@functools.cache
def backend_version() -> str:
    """llama-cpp-python's version, read from its package metadata (no import of the engine)
    once per process: every describe reads it (each session opened, each count of a new
    conversation's prompt), and parsing the metadata cost 5.6 ms a call. The engine a running
    daemon loaded stays the one it loaded, whatever is installed later."""
    try:
        return importlib.metadata.version("llama-cpp-python")
    except importlib.metadata.PackageNotFoundError as exc:
        raise BackendUnavailableError(
            "the llama backend is not available (llama-cpp-python is not installed); "
            "install it with: pip install 'modeld[llama]'",
            backend="llama",
        ) from exc


class LlamaBackend:
    """Describes GGUF models (here) and loads them into llama.cpp (in the worker)."""

    def __init__(self) -> None:
        if importlib.util.find_spec("llama_cpp") is None:
            raise ImportError("llama-cpp-python is not installed")

    @property
    def name(self) -> str:
        return "llama"

    def check_decode(self, config: DecodeConfig) -> None:
        """Nothing beyond ``Capabilities``: no ``DecodeConfig.extra`` key is accepted, and the
        daemon's validation refuses every one by name."""

    def describe(self, request: OpenSessionRequest, *, memory_budget: int | None = None) -> ModelInfo:
        meta = read_gguf(request.path)
        check_digest(request.path, request.digest, meta.digest)
        config = request.config
        if config.kv_cache_type in QUANTIZED_KV and not config.flash_attn:
            raise UnsupportedError(
                f"a {config.kv_cache_type} KV cache needs flash_attn=True in llama.cpp",
                field="config.kv_cache_type",
            )
        return model_info(
            request,
            meta,
            backend="llama",
            version=backend_version(),
            kv_bytes_per_token=kv_bytes_per_token(meta, config.kv_cache_type),
            memory_budget=memory_budget,
            template_digest=meta.template_digest,
            device="gpu" if config.num_gpu_layers > 0 else "cpu",
            capabilities=Capabilities(
                truncation=meta.can_truncate,
                reuse="exact",
                sampling=SAMPLER_NAMES,
                extra=(),
                prompt_formats=("raw", "chat") if meta.chat_template else ("raw",),
                constraints=CONSTRAINT_KINDS,
                # Rejected drafts are cut off again: memory that cannot be cut at any token
                # decodes plainly (blueprint 0016, "Speculation").
                speculation=("off", "ngram") if meta.can_truncate else ("off",),
            ),
            special_tokens=tuple(SpecialToken(i, text, kind) for i, text, kind in meta.special_tokens),
            footprint=model_footprint(meta, config),
        )

    def load(self, request: OpenSessionRequest, info: ModelInfo, options: LoadOptions) -> ModelRuntime:
        """Load the model into llama.cpp (called in the engine worker)."""
        if info.effective_context <= 0:
            raise ModelLoadError(
                f"not enough memory for any context on {request.path!r}: the memory budget, less "
                f"{info.weights_bytes} bytes of weights and {MODEL_OVERHEAD_BYTES >> 20} MiB for the process, holds no KV",
                path=request.path,
            )
        from modeld.backends.llama_runtime import LlamaRuntime

        return LlamaRuntime(info, read_gguf(request.path), request.config, options)
