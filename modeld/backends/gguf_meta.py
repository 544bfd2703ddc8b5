"""What a GGUF file says about itself, read without loading the weights.

Used by ``describe`` on every backend that takes GGUF files (llama.cpp and OpenVINO GenAI):

* validation with clear errors: missing file, a directory (an OpenVINO IR directory is a
  ``backend_mismatch`` for GGUF backends), wrong magic, unparseable or truncated files;
* the model digest: a documented cheap fingerprint (below), cached per file identity;
* the dimensions that size the KV cache, the trained context, the tokenizer's identity,
  the chat template, the BOS/EOS policy, and whether the model's memory can be cut at an
  arbitrary token (recurrent, hybrid and sliding-window models cannot).

Model fingerprint ``gguf-v1`` (``blueprints/0009-llama-backend.md``): xxh3-128 of
``"modeld.gguf.v1\\0" || u64le(size) || the first 8 MiB || 16 blocks of 64 KiB at evenly spaced
offsets || the last 64 KiB``. It reads about 9 MiB whatever the file's size, covers the whole
header, metadata and tensor table of ordinary models, and samples the weights; a replaced
file with a different size, header or any sampled block gets a new digest.
"""

from __future__ import annotations

import os
import struct
import threading
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import xxhash

from modeld.errors import BackendMismatchError, InvalidArgumentError, ModelLoadError
from modeld.manifest import bytes_hash

__all__ = [
    "KV_TYPE_BYTES",
    "GGUFInfo",
    "fingerprint",
    "kv_bytes_per_token",
    "read_gguf",
]

GGUF_MAGIC = b"GGUF"
_HEAD = 8 << 20
_BLOCK = 64 << 10
_SAMPLES = 16

KV_TYPE_BYTES: dict[str, tuple[int, int]] = {
    # kv_cache_type: (bytes per block, values per block), as ggml stores them
    "f32": (4, 1),
    "f16": (2, 1),
    "bf16": (2, 1),
    "q8_0": (34, 32),
    "q4_0": (18, 32),
}

RECURRENT_ARCHS = frozenset({"mamba", "mamba2", "rwkv6", "rwkv6qwen2", "rwkv7", "arwkv7"})
HYBRID_ARCHS = frozenset({"jamba", "falcon-h1", "plamo2", "granitehybrid", "nemotron_h", "lfm2", "qwen3next"})

_cache_lock = threading.Lock()
_fingerprints: dict[tuple[str, int, int, int, int], str] = {}
_infos: dict[str, GGUFInfo] = {}


@dataclass(frozen=True, slots=True)
class GGUFInfo:
    path: str
    digest: str
    size: int
    architecture: str
    name: str
    context_length: int
    layers: int
    kv_heads: tuple[int, ...]  # per layer
    key_length: int
    value_length: int
    vocab_size: int
    tokenizer_digest: str
    chat_template: str
    template_digest: str
    add_bos: bool
    bos_token: str
    eos_token: str
    recurrent: bool
    hybrid: bool
    sliding_window: int
    weights_bytes: int
    file_type: int
    tokenizer_model: str = ""  # gpt2 (byte-level BPE), llama (SentencePiece), ...

    @property
    def can_truncate(self) -> bool:
        return not (self.recurrent or self.hybrid or self.sliding_window > 0)


def check_path(raw: str) -> Path:
    """The path of a GGUF file, or the clear error for what is there instead."""
    if not raw:
        raise InvalidArgumentError("a model path is required", field="path")
    path = Path(raw).expanduser()
    if not path.exists():
        raise ModelLoadError(f"model file {raw!r} does not exist", path=raw)
    if path.is_dir():
        if (path / "openvino_model.xml").exists():
            raise BackendMismatchError(
                f"{raw!r} is an OpenVINO IR directory; open it with type 'openvino'",
                requested="gguf",
                path=raw,
            )
        raise ModelLoadError(f"{raw!r} is a directory, not a GGUF file", path=raw)
    if not os.access(path, os.R_OK):
        raise ModelLoadError(f"model file {raw!r} is not readable", path=raw)
    with path.open("rb") as f:
        magic = f.read(4)
    if magic != GGUF_MAGIC:
        raise ModelLoadError(f"{raw!r} is not a GGUF file (it starts with {magic!r}, not b'GGUF')", path=raw)
    return path


def fingerprint(path: Path) -> str:
    """The ``gguf-v1`` fingerprint, cached per (path, device, inode, size, mtime)."""
    st = path.stat()
    key = (str(path.resolve()), st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns)
    with _cache_lock:
        cached = _fingerprints.get(key)
    if cached is not None:
        return cached
    size = st.st_size
    h = xxhash.xxh3_128()
    h.update(b"modeld.gguf.v1\0" + struct.pack("<Q", size))
    with path.open("rb") as f:
        h.update(f.read(_HEAD))
        if size > _BLOCK:
            for i in range(_SAMPLES):
                f.seek((size - _BLOCK) * i // (_SAMPLES - 1))
                h.update(f.read(_BLOCK))
            f.seek(size - _BLOCK)
            h.update(f.read(_BLOCK))
    digest = h.hexdigest()
    with _cache_lock:
        _fingerprints[key] = digest
    return digest


def _field(reader: Any, key: str, default: Any = None) -> Any:
    """A metadata value as a plain Python value (string, number, bool or list)."""
    field = reader.fields.get(key)
    if field is None:
        return default
    return field.contents()


def _tokenizer_digest(reader: Any) -> str:
    h = xxhash.xxh3_128()
    for key in (
        "tokenizer.ggml.model",
        "tokenizer.ggml.pre",
        "tokenizer.ggml.bos_token_id",
        "tokenizer.ggml.eos_token_id",
        "tokenizer.ggml.add_bos_token",
        "tokenizer.ggml.add_eos_token",
    ):
        h.update(f"{key}={_field(reader, key)!r}\0".encode())
    for key in (
        "tokenizer.ggml.tokens",
        "tokenizer.ggml.token_type",
        "tokenizer.ggml.merges",
        "tokenizer.ggml.scores",
    ):
        field = reader.fields.get(key)
        if field is None:
            h.update(f"{key}=None\0".encode())
            continue
        h.update(f"{key}\0".encode())
        for part in field.data:
            h.update(bytes(field.parts[part]))
    return h.hexdigest()


def read_gguf(raw: str) -> GGUFInfo:
    """Read and validate a GGUF file's metadata (cached per fingerprint)."""
    path = check_path(raw)
    digest = fingerprint(path)
    with _cache_lock:
        cached = _infos.get(digest)
    if cached is not None and cached.path == raw:
        return cached
    try:
        import gguf
    except ImportError as exc:  # pragma: no cover - a dependency of the llama/openvino extras
        raise ModelLoadError(f"reading GGUF needs the gguf package ({exc})", path=raw) from exc
    size = path.stat().st_size
    try:
        reader = gguf.GGUFReader(str(path), "r")
    except Exception as exc:
        raise ModelLoadError(f"{raw!r} is not a valid GGUF file: {exc}", path=raw) from exc
    try:
        tensor_end = max((int(t.data_offset) + int(t.n_bytes) for t in reader.tensors), default=0)
        if tensor_end > size:
            raise ModelLoadError(
                f"{raw!r} is truncated: its tensors need {tensor_end} bytes, the file has {size}",
                path=raw,
            )
        arch = str(_field(reader, "general.architecture", ""))
        if not arch:
            raise ModelLoadError(f"{raw!r} has no general.architecture", path=raw)

        def hp(key: str, default: Any = None) -> Any:
            return _field(reader, f"{arch}.{key}", default)

        layers = int(hp("block_count", 0))
        heads_raw = hp("attention.head_count", 0)
        kv_raw = hp("attention.head_count_kv", heads_raw)
        heads = int(max(heads_raw)) if isinstance(heads_raw, list) else int(heads_raw or 0)
        kv_heads = tuple(int(x) for x in kv_raw) if isinstance(kv_raw, list) else (int(kv_raw or 0),) * layers
        embd = int(hp("embedding_length", 0))
        head_dim = embd // heads if heads else 0
        key_length = int(hp("attention.key_length", head_dim))
        value_length = int(hp("attention.value_length", head_dim))
        tokens = _field(reader, "tokenizer.ggml.tokens", []) or []
        model_kind = str(_field(reader, "tokenizer.ggml.model", ""))
        add_bos_default = model_kind == "llama"
        bos_id = _field(reader, "tokenizer.ggml.bos_token_id")
        eos_id = _field(reader, "tokenizer.ggml.eos_token_id")
        template = str(_field(reader, "tokenizer.chat_template", "") or "")
        swa = hp("attention.sliding_window", 0)
        swa = int(max(swa)) if isinstance(swa, list) else int(swa or 0)
        ssm = any(k.startswith(f"{arch}.ssm.") or k.startswith(f"{arch}.rwkv") for k in reader.fields)
        info = GGUFInfo(
            path=raw,
            digest=digest,
            size=size,
            architecture=arch,
            name=str(_field(reader, "general.name", "") or path.stem),
            context_length=int(hp("context_length", 0)),
            layers=layers,
            kv_heads=kv_heads,
            key_length=key_length,
            value_length=value_length,
            vocab_size=int(hp("vocab_size", 0) or len(tokens)),
            tokenizer_digest=_tokenizer_digest(reader),
            chat_template=template,
            template_digest=bytes_hash(template) if template else "",
            add_bos=bool(_field(reader, "tokenizer.ggml.add_bos_token", add_bos_default)),
            bos_token=str(tokens[bos_id]) if isinstance(bos_id, int) and 0 <= bos_id < len(tokens) else "",
            eos_token=str(tokens[eos_id]) if isinstance(eos_id, int) and 0 <= eos_id < len(tokens) else "",
            recurrent=arch in RECURRENT_ARCHS or (ssm and arch not in HYBRID_ARCHS),
            hybrid=arch in HYBRID_ARCHS,
            sliding_window=swa,
            weights_bytes=sum(int(t.n_bytes) for t in reader.tensors),
            file_type=int(_field(reader, "general.file_type", -1) or -1),
            tokenizer_model=model_kind,
        )
    except ModelLoadError:
        raise
    except Exception as exc:
        raise ModelLoadError(f"{raw!r} has unreadable GGUF metadata: {exc}", path=raw) from exc
    with _cache_lock:
        _infos[digest] = info
    return info


def kv_bytes_per_token(info: GGUFInfo, kv_cache_type: str) -> int:
    """``sum over layers of kv_heads * (key_length + value_length) * bytes(kv_cache_type)``.

    That is ``2 * layers * kv_heads * head_dim * bytes`` for the usual model. Quantized types
    are counted honestly (q8_0: 34 bytes per 32 values, q4_0: 18 per 32). Pure recurrent
    models keep a fixed state, not a per-token cache: 0.
    """
    if info.recurrent:
        return 0
    block_bytes, block_values = KV_TYPE_BYTES[kv_cache_type]
    values = sum(kv * (info.key_length + info.value_length) for kv in info.kv_heads)
    return -(-values * block_bytes // block_values)
