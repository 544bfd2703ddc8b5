"""The OpenVINO GenAI backend, daemon side: describes models without importing OpenVINO.

A GGUF file is described from its metadata (:mod:`modeld.backends.gguf_meta`); an IR directory
by a short-lived child process (reading an IR needs OpenVINO, which the daemon never imports);
the model is loaded by the engine worker (:mod:`modeld.backends.openvino_runtime`). Design
record: ``blueprints/0011-openvino-backend.md``. What the engine-owned cache means for warm
state (logical sequences, no snapshots): ``blueprints/0016-warm-state.md``.

* **Inputs**: a GGUF file (f16/q8_0, byte-level BPE; the same file the llama backend takes) or
  an IR directory (``openvino_model.xml`` + tokenizer/detokenizer IR, as optimum-intel or
  ``enable_save_ov_model`` write them).
* **Numerics**: inference precision f32 by default, so greedy decoding matches llama.cpp on the
  generated models (``MODELD_OPENVINO_PRECISION=bf16`` trades that for speed; it is part of
  ``backend_version``, so changing it is a cold miss).
* **Tokenization**: OpenVINO's GGUF tokenizer keeps only 8192 tokens of a long text; text is
  split for it at newline-before-letter boundaries (:func:`split_for_tokenizer`).
"""

from __future__ import annotations

import importlib.metadata
import importlib.util
import json
import logging
import os
import subprocess
import sys
import threading
from dataclasses import dataclass
from pathlib import Path

import psutil
import xxhash

from modeld.backends.base import LoadOptions, ModelRuntime
from modeld.backends.gguf_meta import KV_TYPE_BYTES, read_gguf
from modeld.backends.probe import open_model_file, probe_model_path
from modeld.backends.sizing import WeightsInUse, check_digest, effective_context
from modeld.contract import (
    CONSTRAINT_KINDS,
    Capabilities,
    Config,
    ModelInfo,
    OpenSessionRequest,
    SpecialToken,
)
from modeld.decoding.tools import detect_format
from modeld.errors import InvalidArgumentError, ModelLoadError, UnsupportedError, error_from_reason
from modeld.manifest import bytes_hash

if importlib.util.find_spec("openvino_genai") is None:  # pragma: no cover - the registry explains it
    raise ImportError("openvino-genai is not installed")

__all__ = ["OpenVINOBackend", "split_for_tokenizer"]

log = logging.getLogger("modeld.openvino")

SAMPLING_FIELDS = (
    "temperature",
    "top_p",
    "top_k",
    "min_p",
    "seed",
    "repeat_penalty",
    "presence_penalty",
    "frequency_penalty",
)
"""What the runtime maps onto ``GenerationConfig``. Not ``logit_bias`` (GenAI has none) and not
``logprobs`` (the streamer sees token ids only): both are refused by name."""
KV_PRECISIONS = {"f32": "f32", "f16": "f16", "bf16": "bf16"}
PRECISIONS = ("f32", "bf16", "f16")
OVERHEAD_BYTES = 512 << 20
TOKENIZER_LIMIT = 8192
"""OpenVINO's GGUF tokenizer keeps at most this many tokens of one text."""
PIECE_BYTES = 6000
"""Text pieces given to the tokenizer at once: fewer bytes than the limit has tokens."""
GGUF_FILE_TYPES = {1: "f16", 7: "q8_0"}
BLOCK_TOKENS = 32
"""OpenVINO's CPU KV block: only full blocks are hashed and reused across requests."""


def _precision() -> str:
    value = os.environ.get("MODELD_OPENVINO_PRECISION", "f32")
    if value not in PRECISIONS:
        raise InvalidArgumentError(
            f"MODELD_OPENVINO_PRECISION must be one of {', '.join(PRECISIONS)}, got {value!r}",
            field="MODELD_OPENVINO_PRECISION",
        )
    return value


def _version() -> str:
    version = importlib.metadata.version("openvino-genai")
    return f"openvino-genai {version.split('-')[0]} {_precision()}"


def split_for_tokenizer(text: str, limit: int = PIECE_BYTES) -> list[str]:
    """Pieces of ``text``, each at most ``limit`` UTF-8 bytes where possible, cut only just
    before a letter that follows a newline: byte-level BPE pre-tokenizers (gpt2, llama3,
    qwen2, ...) always split there, so the pieces' tokens concatenate to the whole text's."""
    pieces: list[str] = []
    start = 0
    while len(text[start:].encode("utf-8")) > limit:
        window = text[start : start + limit]
        cut = -1
        for i in range(len(window) - 1, 0, -1):
            if window[i - 1] == "\n" and window[i].isalpha():
                cut = i
                break
        if cut <= 0:
            break  # no safe boundary: leave the rest whole; the truncation check guards it
        pieces.append(text[start : start + cut])
        start += cut
    pieces.append(text[start:])
    return [p for p in pieces if p]


@dataclass(frozen=True, slots=True)
class _Source:
    """What describe learned about a GGUF file or an IR directory."""

    path: str
    kind: str  # gguf | ir
    digest: str
    name: str
    context_length: int
    layers: int
    architecture: str
    kv_values_per_token: int  # sum over layers of kv_heads * (key_length + value_length)
    vocab_size: int
    tokenizer_digest: str
    chat_template: str
    add_bos: bool
    bos_token: str
    eos_token: str
    weights_bytes: int


def _kv_bytes(values: int, kv_cache_type: str) -> int:
    block_bytes, block_values = KV_TYPE_BYTES[kv_cache_type]
    return -(-values * block_bytes // block_values)


def _dir_digest(path: Path) -> str:
    """``ir-v1``: xxh3-128 over each file's name, size, first 8 MiB and last 64 KiB."""
    h = xxhash.xxh3_128(b"modeld.ir.v1\0")
    for file in sorted(p for p in path.iterdir() if p.is_file()):
        size = file.stat().st_size
        h.update(f"{file.name}\0{size}\0".encode())
        with open_model_file(str(file), what="IR file") as f:
            h.update(f.read_at(0, 8 << 20))
            if size > (8 << 20):
                h.update(f.read_at(size - (64 << 10), 64 << 10))
    return h.hexdigest()


_IR_DESCRIBE_SECONDS = 120.0
_ir_cache: dict[tuple[str, str], _Source] = {}
_ir_lock = threading.Lock()


def _read_ir(raw: str) -> _Source:
    """Describe an IR directory in a short-lived child process (reading an IR needs OpenVINO,
    which the daemon never imports), with a timeout; cached by the directory's digest."""
    digest = _dir_digest(Path(raw).expanduser())
    with _ir_lock:
        cached = _ir_cache.get((raw, digest))
    if cached is not None:
        return cached
    try:
        done = subprocess.run(
            [sys.executable, "-m", "modeld.backends.openvino_runtime", "--describe", raw],
            capture_output=True,
            timeout=_IR_DESCRIBE_SECONDS,
            check=False,
        )
    except subprocess.TimeoutExpired:
        raise ModelLoadError(
            f"describing the OpenVINO IR {raw!r} took longer than {_IR_DESCRIBE_SECONDS:.0f}s", path=raw
        ) from None
    try:
        answer = json.loads(done.stdout.decode("utf-8") or "{}")
    except ValueError:
        answer = {}
    if "error" in answer:
        raise error_from_reason(
            answer["error"]["reason"], answer["error"]["message"], answer["error"]["details"]
        )
    if done.returncode != 0 or "source" not in answer:
        tail = done.stderr.decode("utf-8", errors="replace").strip().splitlines()[-1:] or ["no output"]
        raise ModelLoadError(f"{raw!r} is not a readable OpenVINO IR ({tail[0][:300]})", path=raw)
    source = _Source(**answer["source"])
    with _ir_lock:
        _ir_cache[(raw, digest)] = source
    return source


def _read_source(raw: str) -> _Source:
    if probe_model_path(raw, directory_ok=True).kind == "directory":  # never blocks; no FIFOs inside
        return _read_ir(raw)
    meta = read_gguf(raw)
    if meta.tokenizer_model != "gpt2":
        raise UnsupportedError(
            f"OpenVINO GenAI loads GGUF files with a byte-level BPE (gpt2) vocabulary; {raw!r} has "
            f"{meta.tokenizer_model or 'none'}: use the llama backend",
            field="path",
        )
    if meta.file_type not in GGUF_FILE_TYPES:
        raise UnsupportedError(
            f"OpenVINO GenAI loads f16 or q8_0 GGUF files; {raw!r} has file type {meta.file_type}",
            field="path",
        )
    if meta.recurrent or meta.hybrid or meta.architecture not in ("llama", "qwen2", "qwen3", "mistral"):
        raise UnsupportedError(
            f"OpenVINO GenAI does not load {meta.architecture!r} GGUF models; use the llama backend",
            field="path",
        )
    return _Source(
        path=raw,
        kind="gguf",
        digest=meta.digest,
        name=meta.name,
        context_length=meta.context_length,
        architecture=meta.architecture,
        layers=meta.layers,
        kv_values_per_token=sum(kv * (meta.key_length + meta.value_length) for kv in meta.kv_heads),
        vocab_size=meta.vocab_size,
        tokenizer_digest=meta.tokenizer_digest,
        chat_template=meta.chat_template,
        add_bos=meta.add_bos,
        bos_token=meta.bos_token,
        eos_token=meta.eos_token,
        weights_bytes=meta.weights_bytes,
    )


def _special_tokens(source: _Source) -> tuple[SpecialToken, ...]:
    """A GGUF file's control tokens (an IR directory's are not read: none listed)."""
    if source.kind != "gguf":
        return ()
    return tuple(SpecialToken(i, text, kind) for i, text, kind in read_gguf(source.path).special_tokens)


def _device(config: Config) -> str:
    """CPU by default; ``MODELD_OPENVINO_DEVICE`` (CPU, GPU, NPU, GPU.1, ...) names another one,
    and ``num_gpu_layers > 0`` asks for the GPU. A device this machine lacks is refused (the
    devices come from the hardware inventory, which asks OpenVINO in a child process)."""
    from modeld.observe.hardware import inventory

    available = [d.name for d in inventory().openvino_devices] or ["CPU"]
    wanted = os.environ.get("MODELD_OPENVINO_DEVICE", "GPU" if config.num_gpu_layers > 0 else "CPU")
    if wanted not in available:
        field = "config.num_gpu_layers" if config.num_gpu_layers > 0 else "MODELD_OPENVINO_DEVICE"
        raise UnsupportedError(
            f"OpenVINO device {wanted} is not on this machine (available: {', '.join(available)})",
            field=field,
        )
    return wanted


class OpenVINOBackend:
    """Describes GGUF files and IR directories and loads them into an OpenVINO GenAI pipeline."""

    def __init__(self) -> None:
        self._loaded = WeightsInUse()

    @property
    def name(self) -> str:
        return "openvino"

    def describe(self, request: OpenSessionRequest) -> ModelInfo:
        source = _read_source(request.path)
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
        per_token = _kv_bytes(source.kv_values_per_token, config.kv_cache_type)
        free = psutil.virtual_memory().available
        trained = source.context_length or config.num_ctx
        effective = effective_context(
            trained=trained,
            requested=config.num_ctx,
            free_bytes=free,
            weights_bytes=0 if source.digest in self._loaded else source.weights_bytes,
            kv_bytes_per_token=per_token,
            overhead=OVERHEAD_BYTES,
        )
        return ModelInfo(
            backend="openvino",
            architecture=source.architecture,
            backend_version=_version(),
            path=request.path,
            model_name=request.model_name or source.name,
            model_digest=source.digest,
            model_max_context=trained,
            effective_context=effective,
            kv_bytes_per_token=per_token,
            free_bytes=free,
            weights_bytes=source.weights_bytes,
            vocab_size=source.vocab_size,
            tokenizer_digest=source.tokenizer_digest,
            template_digest=bytes_hash(source.chat_template) if source.chat_template else "",
            chat_template=source.chat_template,
            add_bos=source.add_bos,
            bos_token=source.bos_token,
            eos_token=source.eos_token,
            device=_device(config).lower(),
            capabilities=Capabilities(
                truncation=True,
                reuse="engine",
                sampling=SAMPLING_FIELDS,
                extra=(),
                prompt_formats=("raw", "chat") if source.chat_template else ("raw",),
                # StructuredOutputConfig (xgrammar) takes the compiled GBNF: openvino-genai
                # 2026.4.1, the pinned version, has it (openvino_constraints.py).
                constraints=CONSTRAINT_KINDS,
            ),
            special_tokens=_special_tokens(source),
            tool_format=detect_format(source.chat_template),
        )

    def mark_loaded(self, digest: str, loaded: bool) -> None:
        """A worker mapped (or unmapped) a model's weights: describe counts them once."""
        if loaded:
            self._loaded.add(digest)
        else:
            self._loaded.remove(digest)

    def load(self, request: OpenSessionRequest, info: ModelInfo, options: LoadOptions) -> ModelRuntime:
        """Load the model into an OpenVINO GenAI pipeline (called in the engine worker)."""
        from modeld.backends.openvino_runtime import OpenVINORuntime

        return OpenVINORuntime(info, request.config, options)
