"""Input validation: every malformed or oversized input becomes a clear, typed error.

Validation happens before anything touches a model, so bad input never changes resident state.
Every client string has a length limit: names, paths, digests and stop strings
``Limits.max_string_bytes``; enumerated words (``kv_cache_type``, ``prompt_format``, segment
kind, role, cache class) :data:`MAX_WORD_BYTES`; session ids and segment hashes
:data:`MAX_ID_BYTES`. An error that repeats a client value repeats at most a short, escaped
excerpt (:func:`modeld.errors.echo`), so it always fits in gRPC metadata.

A request digest may be ``sha256:<64 hex>`` of the model file (what model registries publish):
it is verified here, once per file identity (device, inode, size, mtime), and then dropped so
the backend sees "whatever the file is". modeld's own fingerprint is checked by the backend.
"""

from __future__ import annotations

import hashlib
import os
import threading
from collections import OrderedDict
from dataclasses import fields, replace
from pathlib import Path

from modeld.contract import (
    KV_CACHE_TYPES,
    PROMPT_FORMATS,
    TOOL_FORMATS,
    Capabilities,
    Config,
    DecodeConfig,
    OpenSessionRequest,
)
from modeld.decoding.constraints import check_constraint
from modeld.decoding.samplers import SAMPLERS, check_float, check_int
from modeld.decoding.speculation import SPECULATION_MODES
from modeld.errors import InvalidArgumentError, LimitExceededError, ModelLoadError, UnsupportedError, echo
from modeld.manifest import ContextManifest
from modeld.settings import Limits

__all__ = [
    "MAX_ID_BYTES",
    "MAX_WORD_BYTES",
    "encode_text",
    "validate_config",
    "validate_decode",
    "validate_logit_bias",
    "validate_manifest_size",
    "validate_request",
    "validate_session_id",
    "validate_string",
    "verify_sha256",
]

MAX_WORD_BYTES = 64
"""An enumerated word: kv_cache_type, prompt_format, a segment's kind, role or cache class."""
MAX_ID_BYTES = 128
"""A session id (16 hex characters when modeld made it) or a segment hash."""
SHA256_PREFIX = "sha256:"


def validate_string(value: object, field: str, limits: Limits, maximum: int | None = None) -> str:
    """A client string within ``maximum`` bytes (default ``limits.max_string_bytes``)."""
    if not isinstance(value, str):
        raise InvalidArgumentError(f"{field} must be a string, not {type(value).__name__}", field=field)
    bound = limits.max_string_bytes if maximum is None else min(maximum, limits.max_string_bytes)
    size = len(value.encode("utf-8", errors="surrogatepass"))
    if size > bound:
        raise LimitExceededError(
            f"{field} is {size} bytes; the limit is {bound}",
            limit="max_string_bytes",
            value=size,
            maximum=bound,
        )
    return value


def validate_session_id(value: object, limits: Limits) -> str:
    """A session id as a client sent it (before any lookup echoes it)."""
    return validate_string(value, "session_id", limits, MAX_ID_BYTES)


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


def validate_config(config: object, limits: Limits) -> Config:
    if not isinstance(config, Config):
        raise InvalidArgumentError("config must be a Config", field="config")
    check_int(config.num_ctx, "config.num_ctx", 0, limits.max_context_tokens)
    check_int(config.num_batch, "config.num_batch", 0, limits.max_context_tokens)
    check_int(config.num_threads, "config.num_threads", 0, 1024)
    check_int(config.num_gpu_layers, "config.num_gpu_layers", -1, 100_000)
    if not isinstance(config.tensor_split, tuple) or len(config.tensor_split) > 64:
        raise InvalidArgumentError(
            "config.tensor_split must be at most 64 numbers", field="config.tensor_split"
        )
    for i, v in enumerate(config.tensor_split):
        check_float(v, f"config.tensor_split[{i}]", 0.0, 1e9)
    if not isinstance(config.flash_attn, bool):
        raise InvalidArgumentError("config.flash_attn must be a boolean", field="config.flash_attn")
    validate_string(config.kv_cache_type, "config.kv_cache_type", limits, MAX_WORD_BYTES)
    if config.kv_cache_type not in KV_CACHE_TYPES:
        raise InvalidArgumentError(
            f"config.kv_cache_type must be one of {', '.join(KV_CACHE_TYPES)}, got {echo(config.kv_cache_type)}",
            field="config.kv_cache_type",
        )
    validate_string(config.prompt_format, "config.prompt_format", limits, MAX_WORD_BYTES)
    if config.prompt_format not in PROMPT_FORMATS:
        raise InvalidArgumentError(
            f"config.prompt_format must be one of {', '.join(PROMPT_FORMATS)}, got {echo(config.prompt_format)}",
            field="config.prompt_format",
        )
    validate_string(config.prompt_template_digest, "config.prompt_template_digest", limits)
    if not isinstance(config.disable_bos, bool):
        raise InvalidArgumentError("config.disable_bos must be a boolean", field="config.disable_bos")
    if config.num_ctx == 0:  # the model's own window, as large as the memory budget allows
        config = replace(config, num_ctx=limits.max_context_tokens)
    return config


def validate_request(request: object, limits: Limits) -> OpenSessionRequest:
    """Check an open/describe request; returns it with a verified ``sha256:`` digest dropped."""
    if not isinstance(request, OpenSessionRequest):
        raise InvalidArgumentError("expected an OpenSessionRequest", field="request")
    for name in ("model_name", "type", "digest", "path"):
        validate_string(getattr(request, name), name, limits)
    validate_string(request.fence.owner_instance_id, "fence.owner_instance_id", limits)
    if request.chat_template:
        encode_text(request.chat_template, "chat_template", limits)
    config = validate_config(request.config, limits)
    if config is not request.config:
        request = replace(request, config=config)
    _check_relative_path(request)
    if request.digest.startswith(SHA256_PREFIX):
        verify_sha256(request.path, request.digest)
        request = replace(request, digest="")
    return request


def _check_relative_path(request: OpenSessionRequest) -> None:
    """A relative model path is resolved by the daemon, against its own working directory."""
    raw = request.path
    if not raw or os.path.isabs(raw) or raw.startswith("~"):
        return
    looks_like_file = request.type in ("llama", "openvino") or os.sep in raw or raw.endswith(".gguf")
    if looks_like_file and not os.path.exists(raw):
        raise ModelLoadError(
            f"model path {echo(raw)} is relative and does not exist: modeld resolves model paths "
            f"itself, against the daemon's working directory ({echo(os.getcwd(), 256)}), not the "
            f"client's; send an absolute path",
            path=raw[:256],
        )


_SHA256_CACHE: OrderedDict[tuple[str, int, int, int, int], str] = OrderedDict()
_SHA256_LOCK = threading.Lock()
_SHA256_KEEP = 64


def verify_sha256(path: str, digest: str) -> None:
    """Check that the file at ``path`` has SHA-256 ``digest`` (``sha256:<64 hex>``).

    The hash is computed once per file identity (device, inode, size, mtime), so a multi-GB
    model is read once per daemon, not at every open.
    """
    hexpart = digest[len(SHA256_PREFIX) :].lower()
    if len(hexpart) != 64 or any(c not in "0123456789abcdef" for c in hexpart):
        raise InvalidArgumentError(
            "digest sha256:... must be followed by 64 hexadecimal characters", field="digest"
        )
    file = Path(path).expanduser()
    try:
        st = file.stat()
    except OSError:
        raise ModelLoadError(
            f"a sha256 digest needs a model file; {echo(path)} is not one", path=path[:256]
        ) from None
    if not file.is_file():
        raise ModelLoadError(
            f"a sha256 digest needs a model file; {echo(path)} is not a regular file", path=path[:256]
        )
    key = (str(file.resolve()), st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns)
    with _SHA256_LOCK:
        actual = _SHA256_CACHE.get(key)
        if actual is not None:
            _SHA256_CACHE.move_to_end(key)
    if actual is None:
        h = hashlib.sha256()
        try:
            with file.open("rb") as f:
                while chunk := f.read(1 << 20):
                    h.update(chunk)
        except OSError as exc:
            raise ModelLoadError(
                f"model file {echo(path)} is not readable ({exc.strerror})", path=path[:256]
            ) from None
        actual = h.hexdigest()
        with _SHA256_LOCK:
            _SHA256_CACHE[key] = actual
            while len(_SHA256_CACHE) > _SHA256_KEEP:
                _SHA256_CACHE.popitem(last=False)
    if actual != hexpart:
        raise ModelLoadError(
            f"model file {echo(path)} has sha256:{actual}, the request asked for sha256:{hexpart}",
            path=path[:256],
            expected=f"sha256:{hexpart}",
            actual=f"sha256:{actual}",
        )


_MANIFEST_STRINGS = tuple(f.name for f in fields(ContextManifest) if f.type == "str")
"""The manifest's text fields (each bounded by ``max_string_bytes``)."""


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
    for name in _MANIFEST_STRINGS:
        validate_string(getattr(manifest, name), f"manifest.{name}", limits)
    for i, seg in enumerate(manifest.segments):
        for name, bound in (
            ("kind", MAX_WORD_BYTES),
            ("role", MAX_WORD_BYTES),
            ("cache_class", MAX_WORD_BYTES),
        ):
            validate_string(getattr(seg, name), f"segments[{i}].{name}", limits, bound)
        validate_string(seg.hash, f"segments[{i}].hash", limits, MAX_ID_BYTES)


def validate_decode(config: object, limits: Limits, capabilities: Capabilities, window: int) -> DecodeConfig:
    """Check ranges, limits, and that the backend honours every sampler that is switched on."""
    if not isinstance(config, DecodeConfig):
        raise InvalidArgumentError("expected a DecodeConfig", field="decode")
    check_int(config.max_tokens, "max_tokens", 1, max(1, window))
    check_int(config.n, "n", 1, 1 << 30)
    limits.check("max_choices", config.n, "choices (n)")
    for sampler in SAMPLERS:  # the one table: ranges, and what this backend honours
        sampler.check(getattr(config, sampler.name))
    if config.top_logprobs and not config.logprobs:
        raise InvalidArgumentError("top_logprobs needs logprobs", field="top_logprobs")
    if config.speculation not in ("", *SPECULATION_MODES):
        raise InvalidArgumentError(
            f"speculation must be one of {', '.join(SPECULATION_MODES)} (or unset), got {echo(config.speculation)}",
            field="speculation",
        )
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
                f"DecodeConfig.extra key {echo(key)} is not supported by this backend "
                f"(supported: {', '.join(capabilities.extra) or 'none'})",
                field=f"extra.{key[:MAX_WORD_BYTES]}",
            )
    _validate_decoding(config, limits, capabilities)
    if config.speculation and config.speculation not in capabilities.speculation:
        why = (
            "; this model's memory cannot be cut at any token (a recurrent state cannot take a "
            "rejected draft back; a sliding window's verify batches round far from single steps), "
            "so it decodes one token per step"
            if not capabilities.truncation
            else ""
        )
        raise UnsupportedError(
            f"this backend cannot honour speculation {echo(config.speculation)} "
            f"(it offers: {', '.join(capabilities.speculation)}){why}",
            field="speculation",
        )
    for sampler in SAMPLERS:
        if sampler.is_on(config) and sampler.name not in capabilities.sampling:
            raise UnsupportedError(
                f"this backend cannot honour DecodeConfig.{sampler.name}; leave it at its default",
                field=sampler.name,
            )
    return config


MAX_REPEATED_LINE = 1 << 20


def _validate_decoding(config: DecodeConfig, limits: Limits, capabilities: Capabilities) -> None:
    """The constraint, tool and guard fields (shapes and ranges; the constraint itself is
    compiled by the decode, see ``modeld.decoding``)."""
    constraint = config.constraint
    if constraint is not None:
        check_constraint(constraint)
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
    check_int(config.repeated_line_min_chars, "repeated_line_min_chars", 0, MAX_REPEATED_LINE)
    check_int(config.repeated_line_max, "repeated_line_max", 0, MAX_REPEATED_LINE)


def validate_logit_bias(config: DecodeConfig, vocab_size: int) -> None:
    """Every ``logit_bias`` token must be in the model's vocabulary (``ModelInfo.vocab_size``;
    0 = unknown, then the backend's range check is all there is)."""
    if vocab_size <= 0:
        return
    for token in config.logit_bias:
        if token >= vocab_size:
            raise InvalidArgumentError(
                f"logit_bias names token {token}; this model's vocabulary has {vocab_size} tokens (0-{vocab_size - 1})",
                field="logit_bias",
            )
