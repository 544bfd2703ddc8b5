"""What a GGUF file says about itself, read without loading the weights, at a bounded cost.

Used by ``describe`` on every backend that takes GGUF files (llama.cpp and OpenVINO GenAI):

* the file is opened safely (:mod:`modeld.backends.probe`: regular files only, never blocking,
  OS errors as ``model_load_failed``); a directory holding an OpenVINO IR is ``backend_mismatch``;
* the header is parsed by :mod:`modeld.backends.gguf_header` with every count checked against
  explicit limits before anything is walked (``gguf.GGUFReader`` took 44 s and 2.4 GB on a 12 MB
  file of empty strings); only the tokenizer's tokens and merges are kept;
* what would crash llama.cpp is refused by :mod:`modeld.backends.gguf_checks`, naming the field;
* the model digest: a documented cheap fingerprint (below), cached per file identity once the
  file has not changed for two seconds (:meth:`~modeld.backends.probe.FileIdentity.settled`);
* the dimensions that size the KV cache, the trained context, the tokenizer's identity, the
  chat template, the BOS/EOS policy, and whether the model's memory can be cut at an arbitrary
  token (recurrent, hybrid and sliding-window models cannot): which layers keep per-token KV and
  which a recurrent state, and its size, from the keys the engine reads
  (:mod:`modeld.backends.gguf_layers`), not from a list of architecture names.

Model fingerprint ``gguf-v1`` (``blueprints/0009-llama-backend.md``): xxh3-128 of
``"modeld.gguf.v1\\0" || u64le(size) || the first 8 MiB || 16 blocks of 64 KiB at evenly spaced
offsets || the last 64 KiB``. It reads about 9 MiB whatever the file's size, covers the whole
header, metadata and tensor table of ordinary models, and samples the weights; a replaced
file with a different size, header or any sampled block gets a new digest. The tokenizer digest
(:func:`_tokenizer_digest`) is defined over the raw bytes of the tokenizer values and is
byte-identical to the one computed with ``gguf.GGUFReader`` before modeld parsed GGUF itself:
both digests are cache keys.

What not: messages never quote bytes of a file that has not been recognised as GGUF. Limits and
checks: ``blueprints/0013-probing-and-inventory.md``.
"""

from __future__ import annotations

import dataclasses
import os
import struct
import threading
from collections import OrderedDict
from dataclasses import dataclass
from typing import Any, Final

import xxhash

from modeld.backends.gguf_checks import check
from modeld.backends.gguf_header import ARRAY, INTEGERS, LIMITS, STRING, GGUFFormatError, Header
from modeld.backends.gguf_layers import layer_memory, sliding_layers
from modeld.backends.probe import MAX_SHOWN_PATH, FileIdentity, ModelFile, open_model_file, show_path
from modeld.errors import BackendMismatchError, ModelLoadError
from modeld.manifest import bytes_hash

__all__ = [
    "KV_TYPE_BYTES",
    "LIMITS",
    "GGUFInfo",
    "fingerprint",
    "kv_bytes_per_token",
    "read_gguf",
    "swa_kv_bytes_per_token",
]

_HEAD = 8 << 20
_BLOCK = 64 << 10
_SAMPLES = 16
_STEP = 1 << 20

KV_TYPE_BYTES: dict[str, tuple[int, int]] = {
    # kv_cache_type: (bytes per block, values per block), as ggml stores them
    "f32": (4, 1),
    "f16": (2, 1),
    "bf16": (2, 1),
    "q8_0": (34, 32),
    "q4_0": (18, 32),
}

_TOKENIZER_SCALARS: Final = (
    "tokenizer.ggml.model",
    "tokenizer.ggml.pre",
    "tokenizer.ggml.bos_token_id",
    "tokenizer.ggml.eos_token_id",
    "tokenizer.ggml.add_bos_token",
    "tokenizer.ggml.add_eos_token",
)
_TOKENIZER_ARRAYS: Final = (
    "tokenizer.ggml.tokens",
    "tokenizer.ggml.token_type",
    "tokenizer.ggml.merges",
    "tokenizer.ggml.scores",
)
_KEPT_STRINGS: Final = frozenset({"tokenizer.ggml.tokens", "tokenizer.ggml.merges"})

_CACHE_SIZE = 64
_cache_lock = threading.Lock()
_fingerprints: OrderedDict[FileIdentity, str] = OrderedDict()
_infos: OrderedDict[tuple[str, str], GGUFInfo] = OrderedDict()


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
    heads: int = 0  # query heads (the largest layer's); 0 without attention
    embedding_length: int = 0
    feed_forward_length: int = 0  # the largest layer's
    special_tokens: tuple[tuple[int, str, str], ...] = ()  # (id, text, kind): see special_tokens()
    identity: FileIdentity | None = None  # the file when it was described (see probe.changed)
    recurrent_layers: int = 0  # layers that keep a recurrent state (gguf_layers)
    state_bytes: int = 0  # one sequence's recurrent state, every recurrent layer's (f32)
    swa_layers: tuple[bool, ...] = ()  # per layer: attends over the sliding window (gguf_layers)
    key_length_swa: int = 0  # the local layers' head sizes (0: key_length, value_length)
    value_length_swa: int = 0

    @property
    def can_truncate(self) -> bool:
        return not (self.recurrent or self.hybrid or self.sliding_window > 0)

    @property
    def memory(self) -> str:
        """What the model's memory is: ``attention``, ``sliding-window``, ``hybrid`` (recurrent
        layers beside attention ones) or ``recurrent``."""
        if self.recurrent:
            return "recurrent"
        if self.hybrid:
            return "hybrid"
        return "sliding-window" if self.sliding_window > 0 else "attention"


# --- fingerprint, digests, describe ----------------------------------------------------------------


def _cached(cache: OrderedDict[Any, Any], key: Any) -> Any:
    with _cache_lock:
        value = cache.get(key)
        if value is not None:
            cache.move_to_end(key)
        return value


def _remember(cache: OrderedDict[Any, Any], key: Any, value: Any) -> None:
    with _cache_lock:
        cache[key] = value
        cache.move_to_end(key)
        while len(cache) > _CACHE_SIZE:
            cache.popitem(last=False)


def _fingerprint(f: ModelFile) -> str:
    cached: str | None = _cached(_fingerprints, f.identity)
    if cached is not None:
        return cached
    size = f.identity.size
    h = xxhash.xxh3_128()
    h.update(b"modeld.gguf.v1\0" + struct.pack("<Q", size))
    for offset in range(0, min(size, _HEAD), _STEP):  # in steps: what is held stays small
        h.update(f.read_at(offset, min(_STEP, _HEAD - offset)))
    if size > _BLOCK:
        for i in range(_SAMPLES):
            h.update(f.read_at((size - _BLOCK) * i // (_SAMPLES - 1), _BLOCK))
        h.update(f.read_at(size - _BLOCK, _BLOCK))
    digest = h.hexdigest()
    if f.identity.settled():  # a file still being written may show its final identity early
        _remember(_fingerprints, f.identity, digest)
    return digest


def fingerprint(path: os.PathLike[str] | str) -> str:
    """The ``gguf-v1`` fingerprint of a file, cached per :class:`FileIdentity`."""
    with open_model_file(os.fspath(path)) as f:
        return _fingerprint(f)


def _tokenizer_digest(h: Header) -> str:
    x = xxhash.xxh3_128()
    for key in _TOKENIZER_SCALARS:
        x.update(f"{key}={h.py(key)!r}\0".encode())
    for key in _TOKENIZER_ARRAYS:
        if key not in h.kvs:
            x.update(f"{key}=None\0".encode())
            continue
        x.update(f"{key}\0".encode())
        for part in h.leaf_bytes(key):
            x.update(part)
    return x.hexdigest()


def _open(raw: str) -> ModelFile:
    try:
        return open_model_file(raw)
    except ModelLoadError as exc:
        if exc.details.get("kind") == "a directory":
            ir = os.path.join(os.path.expanduser(raw), "openvino_model.xml")
            if os.path.isfile(ir):
                raise BackendMismatchError(
                    f"{show_path(raw)} is an OpenVINO IR directory; open it with type 'openvino'",
                    requested="gguf",
                    path=raw[:MAX_SHOWN_PATH],
                ) from None
        raise


def read_gguf(raw: str) -> GGUFInfo:
    """Read and validate a GGUF file's metadata (cached per path and fingerprint)."""
    with _open(raw) as f:
        try:
            digest = _fingerprint(f)
            cached: GGUFInfo | None = _cached(_infos, (raw, digest))
            if cached is not None:
                return dataclasses.replace(cached, identity=f.identity)
            info = _describe(f, digest)
        except GGUFFormatError as bad:
            raise ModelLoadError(
                f"{show_path(raw)} {bad}", path=raw[:MAX_SHOWN_PATH], **bad.details
            ) from None
        except OSError as exc:
            raise ModelLoadError(
                f"{show_path(raw)} could not be read ({os.strerror(exc.errno or 0)})",
                path=raw[:MAX_SHOWN_PATH],
            ) from None
        if not f.still_same():
            raise ModelLoadError(
                f"{show_path(raw)} changed while it was being read; try again when it is complete",
                path=raw[:MAX_SHOWN_PATH],
            )
    if f.identity.settled():
        _remember(_infos, (raw, digest), info)
    return info


def _describe(f: ModelFile, digest: str) -> GGUFInfo:
    h = Header(f, keep=_KEPT_STRINGS)
    h.parse()
    size = f.identity.size
    if h.tensor_end > size:
        raise GGUFFormatError(f"is truncated: its tensors need {h.tensor_end} bytes, the file has {size}")
    arch_value = h.get("general.architecture")
    if arch_value is None or arch_value.type != STRING:
        raise GGUFFormatError("has no general.architecture", field="general.architecture")
    arch = h.py("general.architecture")
    if not arch:
        raise GGUFFormatError("has no general.architecture", field="general.architecture")

    def hp(key: str) -> str:
        return f"{arch}.{key}"

    layers = h.integer(hp("block_count"))
    tokens = h.tokens()
    check(h, arch, layers, tokens)
    heads_raw = h.integers(hp("attention.head_count")) or [0]
    kv_raw = h.integers(hp("attention.head_count_kv"))
    heads = max(heads_raw)
    if kv_raw is None:
        kv_heads = tuple(heads_raw) if len(heads_raw) > 1 else (heads_raw[0],) * layers
    else:
        kv_heads = (
            tuple(kv_raw) if h.kvs[hp("attention.head_count_kv")].type == ARRAY else (kv_raw[0],) * layers
        )
    embd = h.integer(hp("embedding_length"))
    head_dim = embd // heads if heads else 0
    model_kind = str(h.py("tokenizer.ggml.model", ""))
    bos_id = h.py("tokenizer.ggml.bos_token_id")
    eos_id = h.py("tokenizer.ggml.eos_token_id")
    template = str(h.py("tokenizer.chat_template", "") or "")
    swa_raw = h.integers(hp("attention.sliding_window")) or [0]
    layout = layer_memory(h, arch, layers, kv_heads)
    # A layer without attention keeps no KV, whatever head_count_kv says for the model.
    kv_heads = tuple(kv if att else 0 for kv, att in zip(kv_heads, layout.attention, strict=True))
    n_recurrent = sum(layout.recurrent)
    return GGUFInfo(
        path=f.raw,
        digest=digest,
        size=size,
        architecture=arch,
        name=str(h.py("general.name", "") or f.path.stem),
        context_length=h.integer(hp("context_length")),
        layers=layers,
        kv_heads=kv_heads,
        key_length=h.integer(hp("attention.key_length"), head_dim),
        value_length=h.integer(hp("attention.value_length"), head_dim),
        vocab_size=h.integer(hp("vocab_size")) or len(tokens),
        tokenizer_digest=_tokenizer_digest(h),
        chat_template=template,
        template_digest=bytes_hash(template) if template else "",
        add_bos=bool(h.py("tokenizer.ggml.add_bos_token", model_kind == "llama")),
        bos_token=_token(tokens, bos_id),
        eos_token=_token(tokens, eos_id),
        recurrent=n_recurrent > 0 and not any(layout.attention),
        hybrid=n_recurrent > 0 and any(layout.attention),
        sliding_window=max(swa_raw),
        weights_bytes=h.weights_bytes,
        file_type=int(h.py("general.file_type", -1) or -1),
        tokenizer_model=model_kind,
        heads=heads,
        embedding_length=embd,
        feed_forward_length=max(h.integers(hp("feed_forward_length")) or [0]),
        special_tokens=special_tokens(h, tokens),
        identity=f.identity,
        recurrent_layers=n_recurrent,
        state_bytes=layout.sequence_state_bytes,
        swa_layers=sliding_layers(h, arch, layers, max(swa_raw)),
        key_length_swa=h.integer(hp("attention.key_length_swa")),
        value_length_swa=h.integer(hp("attention.value_length_swa")),
    )


MAX_SPECIAL_TOKENS = 1024
"""Control tokens listed at most (a vocabulary with more lists the first ones)."""
_CONTROL = 3  # llama.cpp's LLAMA_TOKEN_TYPE_CONTROL in tokenizer.ggml.token_type


def special_tokens(h: Header, tokens: list[bytes]) -> tuple[tuple[int, str, str], ...]:
    """The vocabulary's control tokens as ``(id, text, kind)``: ``kind`` is bos, eos or eot
    (the tokenizer's ids for them) or control (``token_type`` CONTROL). For ``ModelInfo``."""
    kinds: dict[int, str] = {}
    for kind in ("bos", "eos", "eot"):
        value = h.get(f"tokenizer.ggml.{kind}_token_id")
        if value is not None and value.type in INTEGERS and 0 <= int(value.scalar) < len(tokens):
            kinds.setdefault(int(value.scalar), kind)
    types = h.integers("tokenizer.ggml.token_type") if "tokenizer.ggml.token_type" in h.kvs else None
    ids = set(kinds)
    for token, token_type in enumerate(types or []):
        if token_type == _CONTROL and token < len(tokens):
            ids.add(token)
            if len(ids) >= MAX_SPECIAL_TOKENS:
                break
    return tuple((t, _token(tokens, t), kinds.get(t, "control")) for t in sorted(ids))


def _token(tokens: list[bytes], index: Any) -> str:
    if isinstance(index, int) and 0 <= index < len(tokens):
        return tokens[index].decode("utf-8", errors="replace")
    return ""


def kv_bytes_per_token(info: GGUFInfo, kv_cache_type: str) -> int:
    """``sum over layers of kv_heads * (key_length + value_length) * bytes(kv_cache_type)``.

    That is ``2 * layers * kv_heads * head_dim * bytes`` for the usual model. Quantized types
    are counted honestly (q8_0: 34 bytes per 32 values, q4_0: 18 per 32). Pure recurrent
    models keep a fixed state, not a per-token cache: 0.
    """
    if info.recurrent:
        return 0
    block_bytes, block_values = KV_TYPE_BYTES[kv_cache_type]
    swa = info.swa_layers or (False,) * len(info.kv_heads)
    values = sum(kv * _head_values(info, local) for kv, local in zip(info.kv_heads, swa, strict=True))
    return -(-values * block_bytes // block_values)


def swa_kv_bytes_per_token(info: GGUFInfo, kv_cache_type: str) -> int:
    """The local (sliding-window) layers' part of :func:`kv_bytes_per_token`: what a token's
    KV costs in llama.cpp's SWA cache (a ring of cells with ``--no-swa-full``); 0 without a
    sliding window."""
    if info.recurrent or not any(info.swa_layers):
        return 0
    block_bytes, block_values = KV_TYPE_BYTES[kv_cache_type]
    values = sum(
        kv * _head_values(info, True)
        for kv, local in zip(info.kv_heads, info.swa_layers, strict=True)
        if local
    )
    return -(-values * block_bytes // block_values)


def _head_values(info: GGUFInfo, local: bool) -> int:
    """K and V values per KV head of a layer (a local layer's own sizes where the header has them)."""
    if local and info.key_length_swa:
        return info.key_length_swa + (info.value_length_swa or info.key_length_swa)
    return info.key_length + info.value_length
