"""The llama.cpp backend (llama-cpp-python's low-level bindings): real warm-prefix reuse.

modeld drives the KV cache directly: ``truncate`` removes positions with
``llama_memory_seq_rm`` and ``extend`` evaluates only the divergent tail, so a warm turn costs
only the tokens that changed. The design record is ``blueprints/0009-llama-backend.md``; the
points that matter for correctness:

* **Identity**: the model digest is the ``gguf-v1`` fingerprint of the file
  (:mod:`modeld.backends.gguf_meta`); a request whose digest does not match is refused, and a
  replaced file gets a new digest, so it is never served under an old identity.
* **Numerics**: llama.cpp gives bit-identical results for a token whatever multi-token batch it
  is evaluated in, but a *single-token* batch takes another kernel path (~1e-3 relative
  difference). Prefill therefore never evaluates a lone token when it can avoid it: a 1-token
  remainder borrows a token from the previous chunk, and a 1-token tail re-evaluates the token
  before it. Cold and warm prefill then see the same numbers, so warm greedy decoding equals
  cold greedy decoding token for token (tested).
* **Memory that cannot be cut** (recurrent, hybrid, sliding-window models; detected from the
  file and from llama.cpp): ``can_truncate`` is False, so the engine only ever appends or
  starts over; and if ``llama_memory_seq_rm`` ever refuses a cut, the runtime clears the memory
  and reports it kept nothing.
* **GIL**: ctypes releases the GIL during ``llama_decode``; the daemon's threads keep running.
  Cancellation is checked between prefill batches and between generated tokens.
"""

from __future__ import annotations

import ctypes
import logging
import os
import threading
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import numpy as np
import psutil

from modeld.backends.base import Interrupt, Interrupted
from modeld.backends.gguf_meta import GGUFInfo, kv_bytes_per_token, read_gguf
from modeld.backends.sizing import WeightsInUse, check_digest, effective_context
from modeld.contract import Capabilities, Config, DecodeConfig, ModelInfo, OpenSessionRequest
from modeld.errors import EngineError, ModelLoadError, UnsupportedError

try:
    import llama_cpp as _llama
except ImportError as exc:  # pragma: no cover - the registry turns this into backend_unavailable
    raise ImportError(f"llama-cpp-python is not installed: {exc}") from exc

__all__ = ["OVERHEAD_BYTES", "LlamaBackend", "LlamaRuntime", "chunk_sizes"]

log = logging.getLogger("modeld.llama")

OVERHEAD_BYTES = 512 << 20
"""Memory set aside for llama.cpp's compute buffers and the process when sizing the context."""

SAMPLING_FIELDS = ("temperature", "top_p", "top_k", "min_p", "seed", "repeat_penalty")
PENALTY_LAST_N = 64

_GGML_TYPES = {"f32": 0, "f16": 1, "q4_0": 2, "q8_0": 8, "bf16": 30}
_QUANTIZED_KV = ("q8_0", "q4_0")

_init_lock = threading.Lock()
_initialized = False


_GGML_LOG_WARN = 3
_GGML_LOG_ERROR = 4


def _log(level: int, text: bytes | None, _data: Any) -> None:
    """llama.cpp's log lines go to the daemon's log: warnings and errors at WARNING, the rest DEBUG."""
    if text:
        message = text.decode("utf-8", errors="replace").rstrip()
        if message:
            severe = level in (_GGML_LOG_WARN, _GGML_LOG_ERROR)
            log.log(logging.WARNING if severe else logging.DEBUG, "%s", message)


_log_callback: Any = ctypes.CFUNCTYPE(None, ctypes.c_int, ctypes.c_char_p, ctypes.c_void_p)(_log)
"""Module-level: llama.cpp keeps the pointer, so the callback object must never be collected."""


def _init() -> None:
    global _initialized
    with _init_lock:
        if not _initialized:
            _llama.llama_log_set(_log_callback, ctypes.c_void_p(0))  # module-level: stays referenced
            _llama.llama_backend_init()
            _initialized = True


class _Memory:
    """Cutting and clearing the KV, with whichever API this llama-cpp-python offers.

    0.3.3x has ``llama_memory_*`` on ``llama_get_memory(ctx)``; older releases had
    ``llama_kv_self_*`` and before that ``llama_kv_cache_*`` on the context itself.
    """

    def __init__(self, ctx: Any) -> None:
        self.seq_rm: Callable[[int], bool]
        self.clear: Callable[[], None]
        self.pos_max: Callable[[], int]
        if hasattr(_llama, "llama_get_memory") and hasattr(_llama, "llama_memory_seq_rm"):
            mem = _llama.llama_get_memory(ctx)
            self.seq_rm = lambda p0: bool(_llama.llama_memory_seq_rm(mem, 0, p0, -1))
            self.clear = lambda: _llama.llama_memory_clear(mem, True)
            self.pos_max = lambda: int(_llama.llama_memory_seq_pos_max(mem, 0))
            return
        prefix = "llama_kv_self_" if hasattr(_llama, "llama_kv_self_seq_rm") else "llama_kv_cache_"
        seq_rm, clear = getattr(_llama, f"{prefix}seq_rm", None), getattr(_llama, f"{prefix}clear", None)
        pos_max = getattr(_llama, f"{prefix}seq_pos_max", None)
        if seq_rm is None or clear is None or pos_max is None:
            raise ImportError(f"llama-cpp-python {_llama.__version__} has no KV cache API modeld knows")
        self.seq_rm = lambda p0: bool(seq_rm(ctx, 0, p0, -1))
        self.clear = lambda: clear(ctx)
        self.pos_max = lambda: int(pos_max(ctx, 0))


def _threads(config: Config) -> int:
    if config.num_threads > 0:
        return config.num_threads
    try:
        return max(1, len(os.sched_getaffinity(0)))
    except AttributeError:  # pragma: no cover - not Linux
        return max(1, os.cpu_count() or 1)


def chunk_sizes(n: int, batch: int) -> list[int]:
    """Split ``n`` tokens into batches of at most ``batch``, never leaving a 1-token last batch.

    A lone token in a batch is computed by a different kernel than the same token inside a
    larger batch; moving one token from the previous batch keeps every prefill batch >= 2 tokens
    (when ``n >= 2`` and ``batch >= 2``), so where a prefill starts does not change its numbers.
    """
    if n <= 0:
        return []
    sizes = [batch] * (n // batch)
    if n % batch:
        sizes.append(n % batch)
    if len(sizes) >= 2 and sizes[-1] == 1 and batch >= 3:
        sizes[-2] -= 1
        sizes[-1] = 2
    return sizes


class LlamaBackend:
    """Describes GGUF models and loads them into llama.cpp."""

    def __init__(self) -> None:
        self._loaded = WeightsInUse()

    @property
    def name(self) -> str:
        return "llama"

    def describe(self, request: OpenSessionRequest) -> ModelInfo:
        meta = read_gguf(request.path)
        check_digest(request.path, request.digest, meta.digest)
        config = request.config
        if config.tensor_split and not _llama.llama_supports_gpu_offload():
            raise UnsupportedError(
                "tensor_split splits layers across GPUs; this llama.cpp build has no GPU offload",
                field="config.tensor_split",
            )
        if config.kv_cache_type in _QUANTIZED_KV and not config.flash_attn:
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
            backend_version=_llama.__version__,
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
            device="gpu" if config.num_gpu_layers and _llama.llama_supports_gpu_offload() else "cpu",
            capabilities=Capabilities(
                truncation=meta.can_truncate,
                reuse="exact",
                sampling=SAMPLING_FIELDS,
                extra=(),
                prompt_formats=("raw", "chat") if meta.chat_template else ("raw",),
            ),
        )

    def load(self, request: OpenSessionRequest, info: ModelInfo) -> LlamaRuntime:
        if info.effective_context <= 0:
            raise ModelLoadError(
                f"not enough free memory for any context on {request.path!r} "
                f"({info.free_bytes} bytes free, {info.weights_bytes} bytes of weights)",
                path=request.path,
            )
        runtime = LlamaRuntime(info, read_gguf(request.path), request.config, on_close=self._unloaded)
        self._loaded.add(info.model_digest)
        return runtime

    def _unloaded(self, digest: str) -> None:
        self._loaded.remove(digest)


class LlamaRuntime:
    """One llama.cpp model and context with a single resident sequence (seq 0)."""

    def __init__(
        self, info: ModelInfo, meta: GGUFInfo, config: Config, on_close: Callable[[str], None] | None = None
    ) -> None:
        _init()
        self._on_close = on_close
        self._info = info
        self._meta = meta
        self._model: Any = None
        self._ctx: Any = None
        self._config: Config | None = None
        self._gpu_layers = config.num_gpu_layers
        self._tensor_split = config.tensor_split
        self._split: Any = None
        self._load_model()
        self._vocab = _llama.llama_model_get_vocab(self._model)
        self._n_vocab = int(_llama.llama_vocab_n_tokens(self._vocab))
        self._bos = int(_llama.llama_vocab_bos(self._vocab))
        recurrent = bool(_llama.llama_model_is_recurrent(self._model))
        hybrid = bool(_llama.llama_model_is_hybrid(self._model))
        swa = int(_llama.llama_model_n_swa(self._model))
        self._can_truncate = meta.can_truncate and not (recurrent or hybrid or swa > 0)
        self._tokens: list[int] = []
        self._logits_fresh = False  # logits of the last resident token are in the context
        self._pieces: dict[int, bytes] = {}
        self._piece_lock = threading.Lock()
        self._configure_context(config)

    # --- loading ----------------------------------------------------------------------------

    def _load_model(self) -> None:
        params = _llama.llama_model_default_params()
        params.n_gpu_layers = self._gpu_layers
        params.use_mmap = True
        if self._tensor_split:
            self._split = (ctypes.c_float * len(self._tensor_split))(*self._tensor_split)  # kept alive
            params.tensor_split = self._split
        model = _llama.llama_model_load_from_file(self._meta.path.encode(), params)
        if not model:
            raise ModelLoadError(
                f"llama.cpp could not load {self._meta.path!r} (see the daemon log)", path=self._meta.path
            )
        self._model = model

    def _configure_context(self, config: Config) -> None:
        if self._ctx:
            _llama.llama_free(self._ctx)
            self._ctx = None
        params = _llama.llama_context_default_params()
        params.n_ctx = config.num_ctx
        params.n_batch = config.num_batch
        params.n_ubatch = config.num_batch
        params.n_seq_max = 1
        threads = _threads(config)
        params.n_threads = threads
        params.n_threads_batch = threads
        params.type_k = _GGML_TYPES[config.kv_cache_type]
        params.type_v = _GGML_TYPES[config.kv_cache_type]
        params.flash_attn_type = (
            _llama.LLAMA_FLASH_ATTN_TYPE_ENABLED
            if config.flash_attn
            else _llama.LLAMA_FLASH_ATTN_TYPE_DISABLED
        )
        params.no_perf = True
        ctx = _llama.llama_init_from_model(self._model, params)
        if not ctx:
            raise ModelLoadError(
                f"llama.cpp could not create a {config.num_ctx}-token context for {self._meta.path!r} "
                f"(kv {config.kv_cache_type}, batch {config.num_batch}; see the daemon log)",
                path=self._meta.path,
            )
        self._ctx = ctx
        self._mem = _Memory(ctx)
        self._config = config
        self._tokens = []
        self._logits_fresh = False

    # --- ModelRuntime -------------------------------------------------------------------------

    @property
    def info(self) -> ModelInfo:
        return self._info

    @property
    def n_ctx(self) -> int:
        return int(_llama.llama_n_ctx(self._ctx))

    @property
    def resident(self) -> Sequence[int]:
        return self._tokens

    @property
    def can_truncate(self) -> bool:
        return self._can_truncate

    def tokenize(self, text: str, *, add_bos: bool) -> list[int]:
        data = text.encode("utf-8")
        capacity = len(data) + 8
        buf = (_llama.llama_token * capacity)()
        n = _llama.llama_tokenize(self._vocab, data, len(data), buf, capacity, False, True)
        if n < 0:  # pragma: no cover - a token is never shorter than a byte
            capacity = -n
            buf = (_llama.llama_token * capacity)()
            n = _llama.llama_tokenize(self._vocab, data, len(data), buf, capacity, False, True)
        tokens = list(buf[:n])
        if add_bos and self._bos >= 0:
            tokens.insert(0, self._bos)
        return tokens

    def piece(self, token: int) -> bytes:
        cached = self._pieces.get(token)
        if cached is not None:
            return cached
        buf = ctypes.create_string_buffer(64)
        n = _llama.llama_token_to_piece(self._vocab, token, buf, len(buf), 0, True)
        if n < 0:
            buf = ctypes.create_string_buffer(-n)
            n = _llama.llama_token_to_piece(self._vocab, token, buf, len(buf), 0, True)
        out = buf.raw[: max(0, n)]
        with self._piece_lock:
            self._pieces[token] = out
        return out

    def is_eog(self, token: int) -> bool:
        return bool(_llama.llama_vocab_is_eog(self._vocab, token))

    def configure(self, config: Config) -> bool:
        assert self._config is not None
        if _context_key(config) == _context_key(self._config):
            self._config = config
            return False
        if config.num_gpu_layers != self._gpu_layers or config.tensor_split != self._tensor_split:
            self._free()
            self._gpu_layers, self._tensor_split = config.num_gpu_layers, config.tensor_split
            self._load_model()
            self._vocab = _llama.llama_model_get_vocab(self._model)
        self._configure_context(config)
        log.info("recreated the llama.cpp context for %s (n_ctx %d)", self._meta.path, config.num_ctx)
        return True

    def truncate(self, keep: int) -> None:
        if keep >= len(self._tokens):
            return
        if keep <= 0:
            self._mem.clear()
            self._tokens = []
        elif self._mem.seq_rm(keep):
            del self._tokens[keep:]
        else:  # llama.cpp cannot cut this memory here: start over (the engine sees keep == 0)
            log.warning("llama.cpp refused to cut the memory at token %d; clearing it", keep)
            self._mem.clear()
            self._tokens = []
        self._logits_fresh = False

    def extend(self, tokens: Sequence[int], interrupt: Interrupt) -> None:
        pending = list(tokens)
        if not pending:
            return
        assert self._config is not None
        if len(pending) == 1 and len(self._tokens) >= 1 and self._can_truncate:
            # A lone token would take the single-token kernel: evaluate it with its predecessor.
            back = self._tokens[-1]
            self.truncate(len(self._tokens) - 1)
            pending.insert(0, back)
        for size in chunk_sizes(len(pending), self._config.num_batch):
            if interrupt():
                raise Interrupted
            self._decode(pending[:size])
            del pending[:size]

    def check_decode(self, config: DecodeConfig) -> None:
        for key in config.extra:
            raise UnsupportedError(
                f"the llama backend accepts no DecodeConfig.extra keys (got {key!r})", field=f"extra.{key}"
            )

    def generate(self, config: DecodeConfig, interrupt: Interrupt) -> Iterator[int]:
        if not self._tokens:
            raise EngineError("nothing resident to decode from")
        if not self._logits_fresh:
            # Re-evaluate the last tokens (two, so the batch is not a lone token) for fresh logits.
            back = min(2, len(self._tokens)) if self._can_truncate else 0
            if back:
                tail = self._tokens[-back:]
                self.truncate(len(self._tokens) - back)
                self._decode(tail)
            else:
                raise EngineError("the model's memory cannot re-evaluate its last token")
        sampler = self._sampler(config)
        try:
            while True:
                if sampler is None:
                    logits = np.ctypeslib.as_array(
                        _llama.llama_get_logits_ith(self._ctx, -1), shape=(self._n_vocab,)
                    )
                    token = int(np.argmax(logits))
                else:
                    token = int(_llama.llama_sampler_sample(sampler, self._ctx, -1))
                yield token
                if interrupt() or len(self._tokens) >= self.n_ctx:
                    return
                self._decode([token])
        finally:
            if sampler is not None:
                _llama.llama_sampler_free(sampler)

    def close(self) -> None:
        if self._model and self._on_close is not None:
            self._on_close(self._info.model_digest)
        self._free()

    # --- internals ------------------------------------------------------------------------------

    def _free(self) -> None:
        if self._ctx:
            _llama.llama_free(self._ctx)
            self._ctx = None
        if self._model:
            _llama.llama_model_free(self._model)
            self._model = None
        self._tokens = []

    def _decode(self, tokens: list[int]) -> None:
        arr = (_llama.llama_token * len(tokens))(*tokens)
        batch = _llama.llama_batch_get_one(arr, len(tokens))
        rc = _llama.llama_decode(self._ctx, batch)
        if rc != 0:
            kept = self._mem.pos_max() + 1
            evaluated = self._tokens + tokens
            self._tokens = evaluated[: max(0, kept)]
            self._logits_fresh = False
            raise EngineError(f"llama_decode failed with code {rc} after {kept} resident tokens")
        self._tokens.extend(tokens)
        self._logits_fresh = True

    def _sampler(self, config: DecodeConfig) -> Any:
        """A llama.cpp sampler chain, or None for plain greedy decoding (argmax of the logits)."""
        if config.temperature <= 0 and config.repeat_penalty == 1.0:
            return None
        chain = _llama.llama_sampler_chain_init(_llama.llama_sampler_chain_default_params())
        if config.repeat_penalty != 1.0:
            _llama.llama_sampler_chain_add(
                chain,
                _llama.llama_sampler_init_penalties(
                    self._n_vocab, PENALTY_LAST_N, config.repeat_penalty, 0.0, 0.0
                ),
            )
            for token in self._tokens[-PENALTY_LAST_N:]:
                _llama.llama_sampler_accept(chain, token)
        if config.temperature <= 0:
            _llama.llama_sampler_chain_add(chain, _llama.llama_sampler_init_greedy())
            return chain
        if config.top_k > 0:
            _llama.llama_sampler_chain_add(chain, _llama.llama_sampler_init_top_k(config.top_k))
        if config.top_p < 1.0:
            _llama.llama_sampler_chain_add(chain, _llama.llama_sampler_init_top_p(config.top_p, 1))
        if config.min_p > 0.0:
            _llama.llama_sampler_chain_add(chain, _llama.llama_sampler_init_min_p(config.min_p, 1))
        _llama.llama_sampler_chain_add(chain, _llama.llama_sampler_init_temp(config.temperature))
        seed = 0xFFFFFFFF if config.seed is None else config.seed % 0xFFFFFFFF  # 0xFFFFFFFF = random
        _llama.llama_sampler_chain_add(chain, _llama.llama_sampler_init_dist(seed))
        return chain


def _context_key(config: Config) -> tuple[object, ...]:
    return (
        config.num_ctx,
        config.num_batch,
        config.num_gpu_layers,
        config.tensor_split,
        config.flash_attn,
        config.kv_cache_type,
        config.num_threads,
    )
