"""The OpenVINO GenAI backend: the same contract on an engine that owns its KV cache.

OpenVINO GenAI's paged-attention pipeline reuses a prompt's cached blocks by hashing them
(``SchedulerConfig.enable_prefix_caching``); modeld cannot cut or extend that cache directly.
The contract absorbs the difference (``blueprints/0011-openvino-backend.md``):

* **Logical residency**: ``resident`` is what modeld last sent; ``truncate`` only forgets, and
  reuse is reported as the longest common token prefix with it (``Capabilities.reuse ==
  "engine"``). The engine's physical reuse is block-granular and shows as time.
* **Physical work in ensure_prefix**: ``extend`` ends with a one-token warm-up generation on
  the whole resident context, so its blocks are computed and cached before the suffix arrives;
  the next decode's time to first token covers only what is new.
* **Tokenization**: OpenVINO's GGUF tokenizer silently keeps only 8192 tokens of a long text,
  so text is tokenized in pieces split at newline-before-letter boundaries (where the byte-level
  BPE pre-tokenizer always splits, so pieces tokenize exactly as the whole), and a piece that
  comes back at the truncation limit is refused rather than trusted.
* **Inputs**: a GGUF file (f16/q8_0, byte-level BPE; the same file the llama backend takes) or
  an IR directory (``openvino_model.xml`` + tokenizer/detokenizer IR, as optimum-intel or
  ``enable_save_ov_model`` write them).
* **Numerics**: inference precision f32 by default, so greedy decoding matches llama.cpp on the
  generated models (``MODELD_OPENVINO_PRECISION=bf16`` trades that for speed; it is part of
  ``backend_version``, so changing it is a cold miss).
* **Threads**: ``LLMPipeline.generate`` releases the GIL; generation runs on its own thread and
  tokens arrive through a streamer, which stops the engine within one step when asked.
"""

from __future__ import annotations

import json
import logging
import math
import os
import queue
import tempfile
import threading
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import psutil
import xxhash

from modeld.backends.base import Interrupt, Interrupted
from modeld.backends.gguf_meta import KV_TYPE_BYTES, read_gguf
from modeld.backends.probe import open_model_file, probe_model_path
from modeld.backends.sizing import WeightsInUse, check_digest, effective_context
from modeld.contract import Capabilities, Config, DecodeConfig, ModelInfo, OpenSessionRequest
from modeld.errors import EngineError, InvalidArgumentError, ModelLoadError, UnsupportedError
from modeld.manifest import bytes_hash

try:
    import openvino as ov
    import openvino_genai as og
except ImportError as exc:  # pragma: no cover - the registry turns this into backend_unavailable
    raise ImportError(f"openvino-genai is not installed: {exc}") from exc

__all__ = ["OpenVINOBackend", "OpenVINORuntime", "split_for_tokenizer"]

log = logging.getLogger("modeld.openvino")

SAMPLING_FIELDS = ("temperature", "top_p", "top_k", "min_p", "seed", "repeat_penalty")
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
    return f"openvino-genai {og.__version__.split('-')[0]} {_precision()}"


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


def _read_ir(raw: str) -> _Source:
    path = Path(raw).expanduser()
    model_xml = path / "openvino_model.xml"
    if not model_xml.is_file():
        raise ModelLoadError(f"{raw!r} is a directory without openvino_model.xml", path=raw)
    if not (path / "openvino_tokenizer.xml").is_file():
        raise ModelLoadError(f"{raw!r} has no openvino_tokenizer.xml (convert the tokenizer too)", path=raw)
    config: dict[str, Any] = {}
    if (path / "config.json").is_file():
        try:
            config = json.loads((path / "config.json").read_text())
        except ValueError as exc:
            raise ModelLoadError(f"{raw!r}: config.json is not valid JSON: {exc}", path=raw) from exc
    try:
        core = ov.Core()
        model = core.read_model(str(model_xml))
        tokenizer = og.Tokenizer(str(path))
    except Exception as exc:
        raise ModelLoadError(f"{raw!r} is not a readable OpenVINO IR: {exc}", path=raw) from exc
    states = [op for op in model.get_ops() if op.get_type_name() == "ReadValue"]
    values = 0
    for state in states:
        shape = state.get_output_partial_shape(0)
        if shape.rank.get_length() == 4 and shape[1].is_static and shape[3].is_static:
            values += shape[1].get_length() * shape[3].get_length()
    template = tokenizer.chat_template or ""
    if not template and (path / "tokenizer_config.json").is_file():
        template = str(
            json.loads((path / "tokenizer_config.json").read_text()).get("chat_template", "") or ""
        )
    with_special = list(tokenizer.encode("a", add_special_tokens=True).input_ids.data[0])
    without = list(tokenizer.encode("a", add_special_tokens=False).input_ids.data[0])
    bos_id = int(tokenizer.get_bos_token_id())
    add_bos = len(with_special) > len(without) and with_special[0] == bos_id
    tok_hash = xxhash.xxh3_128()
    for name in (
        "openvino_tokenizer.xml",
        "openvino_tokenizer.bin",
        "openvino_detokenizer.xml",
        "openvino_detokenizer.bin",
    ):
        if (path / name).is_file():
            tok_hash.update((path / name).read_bytes())
    return _Source(
        path=raw,
        kind="ir",
        digest=_dir_digest(path),
        name=str(config.get("_name_or_path") or path.name),
        context_length=int(config.get("max_position_embeddings") or 0),
        layers=int(config.get("num_hidden_layers") or len(states) // 2),
        kv_values_per_token=values,
        vocab_size=int(config.get("vocab_size") or len(tokenizer.get_vocab())),
        tokenizer_digest=tok_hash.hexdigest(),
        chat_template=template,
        add_bos=add_bos,
        bos_token=tokenizer.get_bos_token(),
        eos_token=tokenizer.get_eos_token(),
        weights_bytes=sum(p.stat().st_size for p in path.glob("openvino_model.bin")),
    )


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


def _device(config: Config) -> str:
    """CPU by default; ``MODELD_OPENVINO_DEVICE`` (CPU, GPU, NPU, GPU.1, ...) names another one,
    and ``num_gpu_layers > 0`` asks for the GPU. A device this machine lacks is refused."""
    available = ov.Core().available_devices
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
            ),
        )

    def load(self, request: OpenSessionRequest, info: ModelInfo) -> OpenVINORuntime:
        runtime = OpenVINORuntime(info, request.config, on_close=self._unloaded)
        self._loaded.add(info.model_digest)
        return runtime

    def _unloaded(self, digest: str) -> None:
        self._loaded.remove(digest)


class _Streamer(og.StreamerBase):  # type: ignore[misc]
    """Hands generated token ids to a queue; asks the pipeline to stop when told to."""

    def __init__(self, out: queue.SimpleQueue[object], stop: threading.Event) -> None:
        super().__init__()
        self._out = out
        self._stop = stop

    def write(self, token: Any) -> Any:
        for t in token if isinstance(token, list) else [token]:
            self._out.put(int(t))
        return og.StreamingStatus.STOP if self._stop.is_set() else og.StreamingStatus.RUNNING

    def end(self) -> None:
        return None


_DONE = object()


class OpenVINORuntime:
    """An LLMPipeline with prefix caching, and the token list modeld last sent it."""

    def __init__(self, info: ModelInfo, config: Config, on_close: Any = None) -> None:
        self._info = info
        self._on_close = on_close
        self._pipe: Any = None
        self._config: Config | None = None
        self._tokens: list[int] = []
        self._warm = 0
        self._link_dir: tempfile.TemporaryDirectory[str] | None = None
        pipe = self._build(config)
        tokenizer = pipe.get_tokenizer()
        self._tokenizer = tokenizer
        vocab: dict[Any, int] = tokenizer.get_vocab()
        size = max(vocab.values()) + 1 if vocab else 0
        self._pieces: list[bytes] = [b""] * size
        for key, index in vocab.items():
            self._pieces[index] = key if isinstance(key, bytes) else str(key).encode("utf-8")
        self._bos = int(tokenizer.get_bos_token_id())
        gen = pipe.get_generation_config()
        self._eog = {int(tokenizer.get_eos_token_id()), *(int(t) for t in gen.stop_token_ids)}
        self._eog.discard(-1)

    def _build(self, config: Config) -> Any:
        """Create the pipeline for ``config`` (the resident list starts empty) and return it."""
        scheduler = og.SchedulerConfig()
        scheduler.enable_prefix_caching = True
        scheduler.max_num_batched_tokens = max(config.num_batch, 32)
        kv_bytes = 2 * config.num_ctx * max(1, self._info.kv_bytes_per_token)
        scheduler.cache_size = max(1, math.ceil(kv_bytes / (1 << 30)))
        properties: dict[str, Any] = {
            "INFERENCE_PRECISION_HINT": _precision(),
            "KV_CACHE_PRECISION": KV_PRECISIONS[config.kv_cache_type],
            "ATTENTION_BACKEND": "PA",
        }
        if config.num_threads > 0:
            properties["INFERENCE_NUM_THREADS"] = config.num_threads
        try:
            self._pipe = og.LLMPipeline(
                self._load_path(), _device(config), scheduler_config=scheduler, **properties
            )
        except Exception as exc:
            raise ModelLoadError(
                f"OpenVINO GenAI could not load {self._info.path!r}: {exc}", path=self._info.path
            ) from exc
        self._config = config
        self._tokens = []
        self._warm = 0  # how many resident tokens the last warm-up covered
        return self._pipe

    def _load_path(self) -> str:
        """OpenVINO recognizes GGUF by its extension; a GGUF named otherwise is loaded through a
        private ``.gguf`` symlink (the file's magic was already checked by describe)."""
        path = Path(self._info.path).expanduser()
        if path.is_dir() or path.suffix == ".gguf":
            return str(path)
        if self._link_dir is None:
            self._link_dir = tempfile.TemporaryDirectory(prefix="modeld-ov-")
        link = Path(self._link_dir.name) / f"{self._info.model_digest}.gguf"
        if not link.exists():
            link.symlink_to(path.resolve())
        return str(link)

    # --- ModelRuntime -----------------------------------------------------------------------

    @property
    def info(self) -> ModelInfo:
        return self._info

    @property
    def n_ctx(self) -> int:
        assert self._config is not None
        return self._config.num_ctx

    @property
    def resident(self) -> Sequence[int]:
        return self._tokens

    @property
    def can_truncate(self) -> bool:
        return True

    def tokenize(self, text: str, *, add_bos: bool) -> list[int]:
        tokens: list[int] = [self._bos] if add_bos and self._bos >= 0 else []
        for piece in split_for_tokenizer(text):
            ids = self._tokenizer.encode(piece, add_special_tokens=False).input_ids.data[0]
            if len(ids) >= TOKENIZER_LIMIT:
                raise UnsupportedError(
                    f"a run of {len(piece.encode())} bytes without a line break reached OpenVINO's "
                    f"{TOKENIZER_LIMIT}-token tokenizer limit; it would be truncated",
                    field="text",
                )
            tokens.extend(int(t) for t in ids)
        return tokens

    def piece(self, token: int) -> bytes:
        return self._pieces[token] if 0 <= token < len(self._pieces) else b""

    def is_eog(self, token: int) -> bool:
        return token in self._eog

    def configure(self, config: Config) -> bool:
        assert self._config is not None
        if _pipeline_key(config) == _pipeline_key(self._config):
            self._config = config
            return False
        self._pipe = None
        self._build(config)
        return True

    def truncate(self, keep: int) -> None:
        del self._tokens[keep:]
        self._warm = min(self._warm, keep)

    def extend(self, tokens: Sequence[int], interrupt: Interrupt) -> None:
        """Append, and compute the new full blocks now (a warm-up generation of one token).

        Tokens that do not complete a new block are left for the next request: OpenVINO caches
        only full blocks, so warming them would compute a partial block twice.
        """
        if not tokens:
            return
        if interrupt():
            raise Interrupted
        self._tokens.extend(tokens)
        if len(self._tokens) // BLOCK_TOKENS > self._warm // BLOCK_TOKENS:
            self._warm_up()
            self._warm = len(self._tokens)

    def check_decode(self, config: DecodeConfig) -> None:
        for key in config.extra:
            raise UnsupportedError(
                f"the openvino backend accepts no DecodeConfig.extra keys (got {key!r})", field=f"extra.{key}"
            )

    def generate(self, config: DecodeConfig, interrupt: Interrupt) -> Iterator[int]:
        if not self._tokens:
            raise EngineError("nothing resident to decode from")
        out: queue.SimpleQueue[object] = queue.SimpleQueue()
        stop = threading.Event()
        streamer = _Streamer(out, stop)
        gen = self._generation_config(config, max_new=self.n_ctx - len(self._tokens))
        prompt = ov.Tensor(np.array([self._tokens], dtype=np.int64))
        result: dict[str, Any] = {}

        def run() -> None:
            try:
                result["value"] = self._pipe.generate(prompt, gen, streamer)
            except Exception as exc:
                result["error"] = exc
            out.put(_DONE)

        worker = threading.Thread(target=run, name="openvino-generate", daemon=True)
        worker.start()
        previous: int | None = None
        try:
            while True:
                item = out.get()
                if item is _DONE:
                    break
                assert isinstance(item, int)
                if previous is not None:
                    self._tokens.append(previous)
                yield item
                previous = item
                if interrupt():
                    stop.set()
            if "error" in result:
                raise EngineError(f"OpenVINO generation failed: {result['error']}")
            reasons = getattr(result.get("value"), "finish_reasons", [])
            if not stop.is_set() and reasons and reasons[0] == og.GenerationFinishReason.STOP:
                yield next(iter(self._eog))  # the model ended its turn: tell the engine
        finally:
            stop.set()
            worker.join()

    def close(self) -> None:
        if self._pipe is not None and self._on_close is not None:
            self._on_close(self._info.model_digest)
        self._pipe = None
        self._tokens = []
        if self._link_dir is not None:
            self._link_dir.cleanup()
            self._link_dir = None

    # --- internals ----------------------------------------------------------------------------

    def _warm_up(self) -> None:
        """Compute the resident context's blocks now (a one-token generation, discarded)."""
        gen = og.GenerationConfig()
        gen.max_new_tokens = 1
        gen.do_sample = False
        try:
            self._pipe.generate(ov.Tensor(np.array([self._tokens], dtype=np.int64)), gen)
        except Exception as exc:
            self._tokens = []
            raise EngineError(f"OpenVINO prefill failed: {exc}") from exc

    def _generation_config(self, config: DecodeConfig, max_new: int) -> Any:
        gen = og.GenerationConfig()
        gen.max_new_tokens = max(1, min(config.max_tokens, max_new))
        gen.do_sample = config.temperature > 0
        if gen.do_sample:
            gen.temperature = config.temperature
            gen.top_p = config.top_p
            gen.top_k = config.top_k if config.top_k > 0 else 0
            gen.min_p = config.min_p
            gen.rng_seed = config.seed if config.seed is not None else int.from_bytes(os.urandom(4))
        gen.repetition_penalty = config.repeat_penalty
        gen.stop_token_ids = set(self._eog)
        return gen


def _pipeline_key(config: Config) -> tuple[object, ...]:
    return (
        config.num_ctx,
        config.num_batch,
        config.num_gpu_layers,
        config.kv_cache_type,
        config.num_threads,
    )
