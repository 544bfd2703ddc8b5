"""The OpenVINO GenAI runtime (engine-worker side): logical sequences over an engine-owned cache.

OpenVINO GenAI's paged-attention pipeline reuses a prompt's cached blocks by hashing them
(``SchedulerConfig.enable_prefix_caching``); modeld cannot cut, copy or snapshot that cache.
The seam absorbs the difference (``blueprints/0011-openvino-backend.md``, ``0016``):

* **Logical sequences** (``Layout.explicit`` False): each sequence is the token list modeld
  last sent for it; ``sync`` cuts and appends the list, ``copy`` copies it. The engine's cache,
  sized for every sequence's window, holds whatever blocks were computed, by content; several
  workspaces alternate without evicting each other as long as it has room. No snapshots.
* **Physical work in sync**: a sync that completes new 32-token blocks ends with a one-token
  warm-up generation on the whole sequence, so its blocks are computed before the decode.
* **Tokenization**: OpenVINO's GGUF tokenizer silently keeps only 8192 tokens of a long text,
  so text is tokenized in pieces split at newline-before-letter boundaries, and a piece that
  comes back at the limit is refused rather than trusted.
* **Threads**: ``LLMPipeline.generate`` releases the GIL; generation runs on its own thread and
  tokens arrive through a streamer, which stops the engine within one step when asked.
"""

from __future__ import annotations

import math
import os
import queue
import tempfile
import threading
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any

import numpy as np

from modeld.backends.base import HeldTokens, Layout, LoadOptions, SyncStep, Vocab
from modeld.backends.openvino_constraints import apply_sampling
from modeld.backends.openvino_source import KV_PRECISIONS, device, precision
from modeld.contract import NUM_BATCH, Config, DecodeConfig, ModelInfo
from modeld.decoding.constraints import runtime_constraint
from modeld.decoding.speculation import DecodeStats
from modeld.errors import EngineError, ModelLoadError, UnsupportedError

try:
    import openvino as ov
    import openvino_genai as og
except ImportError as exc:  # pragma: no cover - the registry turns this into backend_unavailable
    raise ImportError(f"openvino-genai is not installed: {exc}") from exc

__all__ = ["OpenVINORuntime", "split_for_tokenizer"]

TOKENIZER_LIMIT = 8192
"""OpenVINO's GGUF tokenizer keeps at most this many tokens of one text."""
PIECE_BYTES = 6000
"""Text pieces given to the tokenizer at once: fewer bytes than the limit has tokens."""
BLOCK_TOKENS = 32
"""OpenVINO's CPU KV block: only full blocks are hashed and reused across requests."""


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


class OpenVINORuntime(HeldTokens):
    """An LLMPipeline with prefix caching, and the token list modeld last sent per sequence."""

    def __init__(self, info: ModelInfo, config: Config, options: LoadOptions) -> None:
        self._info = info
        self._config = config
        self._link_dir: tempfile.TemporaryDirectory[str] | None = None
        n_seq = max(1, options.n_seq)
        self._seqs: list[list[int]] = [[] for _ in range(n_seq)]
        self._warm = [0] * n_seq  # how many tokens of each sequence the last warm-up covered
        self._layout = Layout(
            n_seq=n_seq,
            window=options.window,
            pool_tokens=n_seq * options.window,
            shared_cells=False,
            can_truncate=True,
            snapshots=False,
            explicit=False,
            snapshot_format="",
            kv_bytes_per_token=info.kv_bytes_per_token,
            name=f"openvino/{n_seq}",
        )
        self._pipe = self._build(config, n_seq * options.window, options.threads)
        tokenizer = self._pipe.get_tokenizer()
        self._tokenizer = tokenizer
        vocab: dict[Any, int] = tokenizer.get_vocab()
        size = max(vocab.values()) + 1 if vocab else 0
        pieces: list[bytes] = [b""] * size
        for key, index in vocab.items():
            pieces[index] = key if isinstance(key, bytes) else str(key).encode("utf-8")
        self._pieces = tuple(pieces)
        self._bos = int(tokenizer.get_bos_token_id())
        gen = self._pipe.get_generation_config()
        self._eog = {int(tokenizer.get_eos_token_id()), *(int(t) for t in gen.stop_token_ids)}
        self._eog.discard(-1)

    def _build(self, config: Config, cache_tokens: int, threads: int) -> Any:
        scheduler = og.SchedulerConfig()
        scheduler.enable_prefix_caching = True
        scheduler.max_num_batched_tokens = max(config.num_batch or NUM_BATCH, 32)
        kv_bytes = 2 * cache_tokens * max(1, self._info.kv_bytes_per_token)
        scheduler.cache_size = max(1, math.ceil(kv_bytes / (1 << 30)))
        properties: dict[str, Any] = {
            "INFERENCE_PRECISION_HINT": precision(),
            "KV_CACHE_PRECISION": KV_PRECISIONS[config.kv_cache_type],
            "ATTENTION_BACKEND": "PA",
        }
        if threads > 0:
            properties["INFERENCE_NUM_THREADS"] = threads
        try:
            return og.LLMPipeline(self._load_path(), device(config), scheduler_config=scheduler, **properties)
        except Exception as exc:
            raise ModelLoadError(
                f"OpenVINO GenAI could not load {self._info.path!r}: {exc}", path=self._info.path
            ) from exc

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
    def layout(self) -> Layout:
        return self._layout

    def vocab(self) -> Vocab:
        return Vocab(pieces=self._pieces, eog=frozenset(self._eog), bos=self._bos)

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

    def sync(
        self, seq: int, keep: int, tokens: Sequence[int], segments: Sequence[int] | None = None
    ) -> Iterator[SyncStep]:
        """Cut and append the sequence's token list; compute its new full blocks now (a warm-up
        generation of one token). Tokens that do not complete a new block are left for the next
        request: OpenVINO caches only full blocks, so warming them would compute one twice."""
        held = self._seq(seq)
        del held[keep:]
        self._warm[seq] = min(self._warm[seq], keep)
        kept = len(held)
        yield SyncStep(kept, 0, len(tokens))
        if not tokens:
            return
        held.extend(tokens)
        if len(held) // BLOCK_TOKENS > self._warm[seq] // BLOCK_TOKENS:
            self._warm_up(held)
            self._warm[seq] = len(held)
        yield SyncStep(kept, len(tokens), len(tokens))

    def generate(
        self,
        seq: int,
        config: DecodeConfig,
        max_tokens: int,
        forks: Sequence[int] = (),
        stopped: Callable[[int], bool] | None = None,
    ) -> Iterator[int]:
        if forks:  # Layout.forks is False: the daemon decodes choices one after another
            raise EngineError("this backend decodes one choice at a time")
        held = self._seq(seq)
        if not held:
            raise EngineError("nothing resident to decode from")
        if max_tokens <= 0:
            return
        out: queue.SimpleQueue[object] = queue.SimpleQueue()
        stop = threading.Event()
        streamer = _Streamer(out, stop)
        gen = self._generation_config(config, max_new=min(max_tokens, self._layout.window - len(held)))
        apply_sampling(gen, config, runtime_constraint(config))  # penalties, the compiled grammar
        prompt = ov.Tensor(np.array([held], dtype=np.int64))
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
                    held.append(previous)
                yield item
                previous = item
            if "error" in result:
                raise EngineError(f"OpenVINO generation failed: {result['error']}")
            reasons = getattr(result.get("value"), "finish_reasons", [])
            if not stop.is_set() and reasons and reasons[0] == og.GenerationFinishReason.STOP:
                yield next(iter(self._eog))  # the model ended its turn: tell the engine
        finally:
            stop.set()
            worker.join()

    def decode_stats(self, seq: int) -> DecodeStats:
        """Always zeros: this pipeline decodes plainly (blueprint 0021 says why)."""
        self._seq(seq)
        return DecodeStats()

    def copy(self, src: int, dst: int, n: int) -> None:
        self._seqs[dst] = list(self._seq(src)[:n])
        self._warm[dst] = min(self._warm[src], n)

    def drop(self, seq: int) -> None:
        self._seq(seq).clear()
        self._warm[seq] = 0

    def share(self, src: int, dst: int, n: int) -> bool:
        return False  # the pipeline's block cache shares by content itself

    def snapshot(self, seq: int) -> bytes:
        raise UnsupportedError("the openvino backend cannot snapshot a sequence (its engine owns the cache)")

    def restore(self, seq: int, blob: bytes | bytearray | memoryview, tokens: Sequence[int]) -> bool:
        raise UnsupportedError("the openvino backend cannot restore a sequence (its engine owns the cache)")

    def save(self, seq: int, path: str) -> int:
        raise UnsupportedError("the openvino backend cannot snapshot a sequence (its engine owns the cache)")

    def restore_file(self, seq: int, path: str, size: int, tokens: Sequence[int]) -> bool:
        raise UnsupportedError("the openvino backend cannot restore a sequence (its engine owns the cache)")

    def close(self) -> None:
        self._pipe = None
        for held in self._seqs:
            held.clear()
        if self._link_dir is not None:
            self._link_dir.cleanup()
            self._link_dir = None

    # --- internals ----------------------------------------------------------------------------

    def _warm_up(self, tokens: list[int]) -> None:
        """Compute a sequence's blocks now (a one-token generation, discarded)."""
        gen = og.GenerationConfig()
        gen.max_new_tokens = 1
        gen.do_sample = False
        try:
            self._pipe.generate(ov.Tensor(np.array([tokens], dtype=np.int64)), gen)
        except Exception as exc:
            tokens.clear()
            raise EngineError(f"OpenVINO prefill failed: {exc}") from exc

    def _generation_config(self, config: DecodeConfig, max_new: int) -> Any:
        gen = og.GenerationConfig()
        gen.max_new_tokens = max(1, max_new)
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
