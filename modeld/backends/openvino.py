"""The OpenVINO GenAI backend, daemon side: describes models without importing OpenVINO.

The model's source (a GGUF file or an IR directory) is read by
:mod:`modeld.backends.openvino_source`, which it shares with the worker side; the model is
loaded by the engine worker (:mod:`modeld.backends.openvino_runtime`). Design record:
``blueprints/0011-openvino-backend.md``. What the engine-owned cache means for warm state
(logical sequences, no snapshots): ``blueprints/0016-warm-state.md``.

* **Numerics**: inference precision f32 by default, so greedy decoding matches llama.cpp on the
  generated models (``MODELD_OPENVINO_PRECISION=bf16`` trades that for speed; it is part of
  ``backend_version``, so changing it is a cold miss).
* **Tokenization**: OpenVINO's GGUF tokenizer keeps only 8192 tokens of a long text; the
  runtime splits text for it (``openvino_runtime.split_for_tokenizer``).
"""

from __future__ import annotations

import importlib.metadata
import importlib.util

from modeld.backends.base import LoadOptions, ModelRuntime
from modeld.backends.openvino_source import (
    KV_PRECISIONS,
    device,
    kv_bytes,
    precision,
    read_source,
    special_tokens,
)
from modeld.backends.sizing import check_digest, model_info
from modeld.contract import CONSTRAINT_KINDS, Capabilities, DecodeConfig, ModelInfo, OpenSessionRequest
from modeld.decoding.samplers import SAMPLER_NAMES
from modeld.errors import UnsupportedError
from modeld.manifest import bytes_hash

if importlib.util.find_spec("openvino_genai") is None:  # pragma: no cover - the registry explains it
    raise ImportError("openvino-genai is not installed")

__all__ = ["OpenVINOBackend"]

SAMPLING_FIELDS = tuple(n for n in SAMPLER_NAMES if n not in ("logit_bias", "logprobs", "top_logprobs"))
"""What the runtime maps onto ``GenerationConfig``. Not ``logit_bias`` (GenAI has none) and not
``logprobs`` (the streamer sees token ids only): both are refused by name."""


def _version() -> str:
    version = importlib.metadata.version("openvino-genai")
    return f"openvino-genai {version.split('-')[0]} {precision()}"


class OpenVINOBackend:
    """Describes GGUF files and IR directories and loads them into an OpenVINO GenAI pipeline."""

    @property
    def name(self) -> str:
        return "openvino"

    def check_decode(self, config: DecodeConfig) -> None:
        """Nothing beyond ``Capabilities``: no ``DecodeConfig.extra`` key is accepted, and the
        daemon's validation refuses every one by name."""

    def describe(self, request: OpenSessionRequest, *, memory_budget: int | None = None) -> ModelInfo:
        source = read_source(request.path)
        check_digest(request.path, request.digest, source.digest)
        config = request.config
        if config.kv_cache_type not in KV_PRECISIONS:
            raise UnsupportedError(
                f"the openvino backend keeps its KV cache in f32, f16 or bf16, not {config.kv_cache_type}",
                field="config.kv_cache_type",
            )
        if config.flash_attn:
            raise UnsupportedError(
                "flash_attn is a llama.cpp setting; leave it off for openvino", field="config.flash_attn"
            )
        if config.tensor_split:
            raise UnsupportedError(
                "the openvino backend does not split a model across devices", field="config.tensor_split"
            )
        return model_info(
            request,
            source,
            backend="openvino",
            version=_version(),
            kv_bytes_per_token=kv_bytes(source.kv_values_per_token, config.kv_cache_type),
            memory_budget=memory_budget,
            template_digest=bytes_hash(source.chat_template) if source.chat_template else "",
            device=device(config).lower(),
            capabilities=Capabilities(
                truncation=True,
                reuse="engine",
                sampling=SAMPLING_FIELDS,
                extra=(),
                prompt_formats=("raw", "chat") if source.chat_template else ("raw",),
                # StructuredOutputConfig (xgrammar) takes the compiled GBNF: openvino-genai
                # 2026.4.1, the pinned version, has it (openvino_constraints.py).
                constraints=CONSTRAINT_KINDS,
                speculation=("off",),  # blueprint 0021: why GenAI's prompt lookup is not used
            ),
            special_tokens=special_tokens(source),
        )

    def load(self, request: OpenSessionRequest, info: ModelInfo, options: LoadOptions) -> ModelRuntime:
        """Load the model into an OpenVINO GenAI pipeline (called in the engine worker)."""
        from modeld.backends.openvino_runtime import OpenVINORuntime

        return OpenVINORuntime(info, request.config, options)
