"""The llama.cpp backend, daemon side: describes GGUF models without importing llama.cpp.

Describing reads the file's metadata (:mod:`modeld.backends.gguf_meta`: bounded, safe); loading
happens in the engine worker (:mod:`modeld.backends.llama_runtime`, which imports
llama-cpp-python), so the daemon process never loads a native engine (blueprint 0017). Design
record: ``blueprints/0009-llama-backend.md``; warm sequences, snapshots and numerics:
``blueprints/0016-warm-state.md``.
"""

from __future__ import annotations

import importlib.metadata
import importlib.util

import psutil

from modeld.backends.base import LoadOptions, ModelRuntime
from modeld.backends.gguf_meta import GGUFInfo, kv_bytes_per_token, read_gguf
from modeld.backends.sizing import WeightsInUse, check_digest, effective_context
from modeld.contract import (
    CONSTRAINT_KINDS,
    Capabilities,
    Config,
    Footprint,
    ModelInfo,
    OpenSessionRequest,
    SpecialToken,
)
from modeld.decoding.tools import detect_format
from modeld.errors import BackendUnavailableError, ModelLoadError, UnsupportedError

__all__ = [
    "OVERHEAD_BYTES",
    "SAMPLING_FIELDS",
    "LlamaBackend",
    "backend_version",
    "cpu_has_amx",
    "model_footprint",
]

OVERHEAD_BYTES = 512 << 20
"""Memory set aside for llama.cpp's compute buffers and the process when sizing the context."""

SAMPLING_FIELDS = (
    "temperature",
    "top_p",
    "top_k",
    "min_p",
    "seed",
    "repeat_penalty",
    "logit_bias",
    "presence_penalty",
    "frequency_penalty",
    "logprobs",
    "top_logprobs",
)
QUANTIZED_KV = ("q8_0", "q4_0")


def model_footprint(meta: GGUFInfo, config: Config) -> Footprint:
    """The model's own memory figures, from its header (``Footprint``'s first five fields).

    The compute buffer is llama.cpp's worst-case graph for one micro-batch of ``b = num_batch``
    tokens over ``c`` cells: with flash attention off, the attention scores and the mask
    (``b x c x (heads + 1) x 4`` bytes) plus a feed-forward's activations
    (``b x (ff + embedding) x 4``); with it on, the f16 mask (``b x c x 2``) plus
    ``b x ff x 16``; never less than the output logits (``b x (vocab x 4 + embedding x 8)``).
    Checked against llama.cpp's own "compute buffer size" (tests/test_describe_footprint.py):
    within 4% on the test models from 2k to 32k cells, both settings."""
    b = config.num_batch
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
    )


def backend_version() -> str:
    """llama-cpp-python's version, read from its package metadata (no import of the engine)."""
    try:
        return importlib.metadata.version("llama-cpp-python")
    except importlib.metadata.PackageNotFoundError as exc:
        raise BackendUnavailableError(
            "the llama backend is not available (llama-cpp-python is not installed); "
            "install it with: pip install 'modeld[llama]'",
            backend="llama",
        ) from exc


def cpu_has_amx() -> bool:
    """Whether the CPU advertises Intel AMX (``amx_int8`` in ``/proc/cpuinfo``).

    On such a CPU llama.cpp puts quantized weights in its AMX buffer type, and its AMX matmul
    (``ggml_backend_amx_mul_mat``) dies of a general protection fault at ``ldtilecfg`` in this
    build (measured on a Xeon with AMX: every q8_0 model crashed the process at its first
    decode; llama.cpp #20824 reports the same crash with another GCC). So the runtime loads
    weights without llama.cpp's extra buffer types there (``use_extra_bufts``; llama-server's
    ``--no-repack``), which also skips CPU repacking."""
    try:
        with open("/proc/cpuinfo", encoding="utf-8", errors="replace") as f:
            for line in f:
                if line.startswith("flags"):
                    return "amx_int8" in line.split(":", 1)[1].split()
    except OSError:
        pass
    return False


class LlamaBackend:
    """Describes GGUF models (here) and loads them into llama.cpp (in the worker)."""

    def __init__(self) -> None:
        if importlib.util.find_spec("llama_cpp") is None:
            raise ImportError("llama-cpp-python is not installed")
        self._loaded = WeightsInUse()

    @property
    def name(self) -> str:
        return "llama"

    def mark_loaded(self, digest: str, loaded: bool) -> None:
        """A model's weights were mapped (or unmapped) by a worker: describe counts them once."""
        if loaded:
            self._loaded.add(digest)
        else:
            self._loaded.remove(digest)

    def describe(self, request: OpenSessionRequest) -> ModelInfo:
        meta = read_gguf(request.path)
        check_digest(request.path, request.digest, meta.digest)
        config = request.config
        if config.kv_cache_type in QUANTIZED_KV and not config.flash_attn:
            raise UnsupportedError(
                f"a {config.kv_cache_type} KV cache needs flash_attn=True in llama.cpp",
                field="config.kv_cache_type",
            )
        per_token = kv_bytes_per_token(meta, config.kv_cache_type)
        free = psutil.virtual_memory().available
        trained = meta.context_length or config.num_ctx
        effective = effective_context(
            trained=trained,
            requested=config.num_ctx,
            free_bytes=free,
            weights_bytes=0 if meta.digest in self._loaded else meta.weights_bytes,
            kv_bytes_per_token=per_token,
            overhead=OVERHEAD_BYTES,
        )
        return ModelInfo(
            backend="llama",
            backend_version=backend_version(),
            path=request.path,
            model_name=request.model_name or meta.name,
            model_digest=meta.digest,
            model_max_context=trained,
            effective_context=effective,
            kv_bytes_per_token=per_token,
            free_bytes=free,
            weights_bytes=meta.weights_bytes,
            vocab_size=meta.vocab_size,
            tokenizer_digest=meta.tokenizer_digest,
            template_digest=meta.template_digest,
            chat_template=meta.chat_template,
            add_bos=meta.add_bos,
            bos_token=meta.bos_token,
            eos_token=meta.eos_token,
            device="gpu" if config.num_gpu_layers > 0 else "cpu",
            capabilities=Capabilities(
                truncation=meta.can_truncate,
                reuse="exact",
                sampling=SAMPLING_FIELDS,
                extra=(),
                prompt_formats=("raw", "chat") if meta.chat_template else ("raw",),
                constraints=CONSTRAINT_KINDS,
            ),
            special_tokens=tuple(SpecialToken(i, text, kind) for i, text, kind in meta.special_tokens),
            tool_format=detect_format(meta.chat_template),
            footprint=model_footprint(meta, config),
        )

    def load(self, request: OpenSessionRequest, info: ModelInfo, options: LoadOptions) -> ModelRuntime:
        """Load the model into llama.cpp (called in the engine worker)."""
        if info.effective_context <= 0:
            raise ModelLoadError(
                f"not enough free memory for any context on {request.path!r} "
                f"({info.free_bytes} bytes free, {info.weights_bytes} bytes of weights)",
                path=request.path,
            )
        from modeld.backends.llama_runtime import LlamaRuntime

        return LlamaRuntime(info, read_gguf(request.path), request.config, options)
