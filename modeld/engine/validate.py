"""Input validation: every malformed or oversized input becomes a clear, typed error.

Validation happens before anything touches a model, so bad input never changes resident state.
"""

from __future__ import annotations

import math

from modeld.contract import (
    CONSTRAINT_KINDS,
    KV_CACHE_TYPES,
    PROMPT_FORMATS,
    TOOL_FORMATS,
    Capabilities,
    Config,
    Constraint,
    DecodeConfig,
    OpenSessionRequest,
)
from modeld.engine.limits import Limits
from modeld.errors import InvalidArgumentError, LimitExceededError, UnsupportedError
from modeld.manifest import ContextManifest

__all__ = [
    "encode_text",
    "validate_config",
    "validate_decode",
    "validate_manifest_size",
    "validate_request",
    "validate_string",
]


def validate_string(value: object, field: str, limits: Limits) -> str:
    if not isinstance(value, str):
        raise InvalidArgumentError(f"{field} must be a string, not {type(value).__name__}", field=field)
    size = len(value.encode("utf-8", errors="surrogatepass"))
    if size > limits.max_string_bytes:
        raise LimitExceededError(
            f"{field} is {size} bytes; the limit is {limits.max_string_bytes}",
            limit="max_string_bytes",
            value=size,
            maximum=limits.max_string_bytes,
        )
    return value


def encode_text(text: object, field: str, limits: Limits, extra_bytes: int = 0) -> bytes:
    """The UTF-8 bytes of a text field, within ``max_text_bytes``."""
    if not isinstance(text, str):
        raise InvalidArgumentError(f"{field} must be a string, not {type(text).__name__}", field=field)
    try:
        data = text.encode("utf-8")
    except UnicodeEncodeError as exc:
        raise InvalidArgumentError(
            f"{field} is not valid Unicode text (a lone surrogate at character {exc.start})",
            field=field,
        ) from exc
    size = len(data) + extra_bytes
    if size > limits.max_text_bytes:
        raise LimitExceededError(
            f"{field} is {size} bytes; the limit per call is {limits.max_text_bytes}",
            limit="max_text_bytes",
            value=size,
            maximum=limits.max_text_bytes,
        )
    return data


def _int_in(value: object, field: str, lo: int, hi: int) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise InvalidArgumentError(f"{field} must be an integer", field=field)
    if not lo <= value <= hi:
        raise InvalidArgumentError(f"{field} must be between {lo} and {hi}, got {value}", field=field)
    return value


def _float_in(value: object, field: str, lo: float, hi: float, *, lo_open: bool = False) -> float:
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise InvalidArgumentError(f"{field} must be a number", field=field)
    v = float(value)
    if math.isnan(v) or v > hi or v < lo or (lo_open and v == lo):
        bracket = "(" if lo_open else "["
        raise InvalidArgumentError(f"{field} must be in {bracket}{lo}, {hi}], got {value}", field=field)
    return v


def validate_config(config: object, limits: Limits) -> Config:
    if not isinstance(config, Config):
        raise InvalidArgumentError("config must be a Config", field="config")
    _int_in(config.num_ctx, "config.num_ctx", 1, limits.max_context_tokens)
    _int_in(config.num_batch, "config.num_batch", 1, limits.max_context_tokens)
    _int_in(config.num_threads, "config.num_threads", 0, 1024)
    _int_in(config.num_gpu_layers, "config.num_gpu_layers", -1, 100_000)
    if not isinstance(config.tensor_split, tuple) or len(config.tensor_split) > 64:
        raise InvalidArgumentError(
            "config.tensor_split must be at most 64 numbers", field="config.tensor_split"
        )
    for i, v in enumerate(config.tensor_split):
        _float_in(v, f"config.tensor_split[{i}]", 0.0, 1e9)
    if not isinstance(config.flash_attn, bool):
        raise InvalidArgumentError("config.flash_attn must be a boolean", field="config.flash_attn")
    if config.kv_cache_type not in KV_CACHE_TYPES:
        raise InvalidArgumentError(
            f"config.kv_cache_type must be one of {', '.join(KV_CACHE_TYPES)}, got {config.kv_cache_type!r}",
            field="config.kv_cache_type",
        )
    if config.prompt_format not in PROMPT_FORMATS:
        raise InvalidArgumentError(
            f"config.prompt_format must be one of {', '.join(PROMPT_FORMATS)}, got {config.prompt_format!r}",
            field="config.prompt_format",
        )
    validate_string(config.prompt_template_digest, "config.prompt_template_digest", limits)
    if not isinstance(config.disable_bos, bool):
        raise InvalidArgumentError("config.disable_bos must be a boolean", field="config.disable_bos")
    return config


def validate_request(request: object, limits: Limits) -> OpenSessionRequest:
    if not isinstance(request, OpenSessionRequest):
        raise InvalidArgumentError("expected an OpenSessionRequest", field="request")
    for name in ("model_name", "type", "digest", "path"):
        validate_string(getattr(request, name), name, limits)
    validate_string(request.fence.owner_instance_id, "fence.owner_instance_id", limits)
    validate_config(request.config, limits)
    return request


def validate_manifest_size(manifest: ContextManifest | None, limits: Limits) -> None:
    if manifest is None:
        return
    if not isinstance(manifest, ContextManifest):
        raise InvalidArgumentError("manifest must be a ContextManifest", field="manifest")
    if len(manifest.segments) > limits.max_segments:
        raise LimitExceededError(
            f"the manifest has {len(manifest.segments)} segments; the limit is {limits.max_segments}",
            limit="max_segments",
            value=len(manifest.segments),
            maximum=limits.max_segments,
        )
    for name in (
        "profile_id",
        "backend",
        "backend_version",
        "model_digest",
        "tokenizer_digest",
        "prompt_format",
        "prompt_template_digest",
        "runtime_digest",
    ):
        validate_string(getattr(manifest, name), f"manifest.{name}", limits)


_DEFAULTS = DecodeConfig()


def validate_decode(config: object, limits: Limits, capabilities: Capabilities, window: int) -> DecodeConfig:
    """Check ranges, limits, and that the backend honours every sampler that is switched on."""
    if not isinstance(config, DecodeConfig):
        raise InvalidArgumentError("expected a DecodeConfig", field="decode")
    _int_in(config.max_tokens, "max_tokens", 1, max(1, window))
    _float_in(config.temperature, "temperature", 0.0, 100.0)
    _float_in(config.top_p, "top_p", 0.0, 1.0, lo_open=True)
    _int_in(config.top_k, "top_k", 0, 1 << 30)
    _float_in(config.min_p, "min_p", 0.0, 1.0)
    _float_in(config.repeat_penalty, "repeat_penalty", 0.0, 100.0, lo_open=True)
    if config.seed is not None:
        _int_in(config.seed, "seed", 0, (1 << 64) - 1)
    if not isinstance(config.stop, tuple):
        raise InvalidArgumentError("stop must be a tuple of strings", field="stop")
    if len(config.stop) > limits.max_stop_strings:
        raise LimitExceededError(
            f"{len(config.stop)} stop strings; the limit is {limits.max_stop_strings}",
            limit="max_stop_strings",
            value=len(config.stop),
            maximum=limits.max_stop_strings,
        )
    for i, s in enumerate(config.stop):
        validate_string(s, f"stop[{i}]", limits)
        if not s:
            raise InvalidArgumentError(f"stop[{i}] is empty", field=f"stop[{i}]")
    if len(config.extra) > limits.max_extra_entries:
        raise LimitExceededError(
            f"{len(config.extra)} extra entries; the limit is {limits.max_extra_entries}",
            limit="max_extra_entries",
            value=len(config.extra),
            maximum=limits.max_extra_entries,
        )
    for key, value in config.extra.items():
        validate_string(key, "extra key", limits)
        validate_string(value, f"extra.{key}", limits)
        if key not in capabilities.extra:
            raise UnsupportedError(
                f"DecodeConfig.extra key {key!r} is not supported by this backend "
                f"(supported: {', '.join(capabilities.extra) or 'none'})",
                field=f"extra.{key}",
            )
    _validate_decoding(config, limits, capabilities)
    for name in SAMPLING_FIELDS:
        if getattr(config, name) != getattr(_DEFAULTS, name) and name not in capabilities.sampling:
            raise UnsupportedError(
                f"this backend cannot honour DecodeConfig.{name}; leave it at its default",
                field=name,
            )
    return config


SAMPLING_FIELDS: tuple[str, ...] = (
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
"""DecodeConfig fields a backend honours only if it lists them in ``Capabilities.sampling``."""

MAX_LOGIT_BIAS_ENTRIES = 1024
MAX_TOP_LOGPROBS = 20
MAX_REPEATED_LINE = 1 << 20


def _validate_decoding(config: DecodeConfig, limits: Limits, capabilities: Capabilities) -> None:
    """The constraint, tool and guard fields, and the extra sampling parameters (shapes and
    ranges; the constraint itself is compiled by the decode, see ``modeld.decoding``)."""
    constraint = config.constraint
    if constraint is not None:
        if not isinstance(constraint, Constraint):
            raise InvalidArgumentError("constraint must be a Constraint", field="constraint")
        if constraint.kind not in CONSTRAINT_KINDS:
            raise InvalidArgumentError(
                f"constraint.kind must be one of {', '.join(CONSTRAINT_KINDS)}, got {constraint.kind!r}",
                field="constraint.kind",
            )
        encode_text(constraint.value, "constraint.value", limits)
        if constraint.kind not in capabilities.constraints:
            raise UnsupportedError(
                f"this backend cannot enforce a {constraint.kind!r} constraint "
                f"(supported: {', '.join(capabilities.constraints) or 'none'})",
                field="constraint.kind",
            )
    validate_string(config.tool_choice, "tool_choice", limits)
    if not config.tool_choice:
        raise InvalidArgumentError(
            "tool_choice must be auto, none, required or a tool's name", field="tool_choice"
        )
    if config.tool_choice not in ("auto", "none") and "grammar" not in capabilities.constraints:
        raise UnsupportedError(
            f"tool_choice {config.tool_choice!r} forces a call with a grammar, which this backend cannot enforce",
            field="tool_choice",
        )
    encode_text(config.tools_json, "tools_json", limits)
    encode_text(config.exit_tools_json, "exit_tools_json", limits)
    if not isinstance(config.stop_on_signal, bool):
        raise InvalidArgumentError("stop_on_signal must be a boolean", field="stop_on_signal")
    if config.tool_format not in TOOL_FORMATS:
        raise InvalidArgumentError(
            f"tool_format must be one of {', '.join(repr(f) for f in TOOL_FORMATS)}, got {config.tool_format!r}",
            field="tool_format",
        )
    _int_in(config.repeated_line_min_chars, "repeated_line_min_chars", 0, MAX_REPEATED_LINE)
    _int_in(config.repeated_line_max, "repeated_line_max", 0, MAX_REPEATED_LINE)
    if len(config.logit_bias) > MAX_LOGIT_BIAS_ENTRIES:
        raise LimitExceededError(
            f"{len(config.logit_bias)} logit_bias entries; the limit is {MAX_LOGIT_BIAS_ENTRIES}",
            limit="max_logit_bias_entries",
            value=len(config.logit_bias),
            maximum=MAX_LOGIT_BIAS_ENTRIES,
        )
    for token, bias in config.logit_bias.items():
        _int_in(token, "logit_bias token", 0, (1 << 31) - 1)
        _float_in(bias, f"logit_bias[{token}]", -100.0, 100.0)
    _float_in(config.presence_penalty, "presence_penalty", -2.0, 2.0)
    _float_in(config.frequency_penalty, "frequency_penalty", -2.0, 2.0)
    if not isinstance(config.logprobs, bool):
        raise InvalidArgumentError("logprobs must be a boolean", field="logprobs")
    _int_in(config.top_logprobs, "top_logprobs", 0, MAX_TOP_LOGPROBS)
    if config.top_logprobs and not config.logprobs:
        raise InvalidArgumentError("top_logprobs needs logprobs", field="top_logprobs")
