"""The in-memory reference backend: the contract's test double, shipped as product code.

It behaves like a real engine in everything the contract can observe, deterministically and
without native code, so the contract suite can pin the semantics once and every real backend
can be checked against the same suite.

The model (documented in ``blueprints/0004-memory-backend.md``):

* **Tokens**: one token per UTF-8 byte (ids 0-255), ``BOS = 256``, ``EOS = 257``. So token counts
  are exact byte counts (plus one for BOS) and every byte range maps to a token range.
* **Models**: ``path`` is a name. A path that names an existing file makes a model whose digest
  is the file's xxh3-128; a path that looks like a file (contains ``/``) but does not exist is a
  :class:`~modeld.errors.ModelLoadError`, as on the real backends. Any other name is a virtual
  model whose digest is the hash of the name. Trained context: 32768 tokens.
* **KV**: each of ``n_seq`` sequences is a list of token ids; truncation at any token is exact
  (``can_truncate``); a snapshot is the token list with a checksum, and a restore checks both.
* **Chat**: a ChatML template (markers as plain text) so prompt_format ``chat`` works too.
* **Simulated latency**: ``DecodeConfig.extra["delay_ms"]`` makes each generated token take
  that long (one engine step each), so cancellation and disconnects can be tested mid-decode.
* **Decode**: a reply that is a deterministic function of the resident tokens (so warm equals
  cold by construction, and a changed suffix changes the reply): first an echo of the resident
  text's last line, ``[..tail..] `` (up to 24 bytes), then ``16 + h % 48`` pseudo-random
  characters drawn from a small alphabet (with multi-byte ones, to exercise UTF-8 safe
  streaming), then EOS. The free characters are sampled byte by byte from real logits (an
  xxh3 chain gives each character a logit; a byte's logit is the log of the summed
  probabilities of the characters it leads to) with every DecodeConfig sampler honoured:
  temperature, top_k, top_p, min_p, repeat_penalty, seed, and ``logit_bias``,
  ``presence_penalty``, ``frequency_penalty``, ``logprobs`` (``modeld.decoding.sampling``: a
  forced byte has probability 1). Greedy decoding (temperature 0) is deterministic.
* **Speculation** (``DecodeConfig.speculation == "ngram"``, ``blueprints/0021``): the llama
  backend's rule one position at a time (evaluating costs nothing here): a draft from the
  context covers the next positions, each position's token is chosen exactly as without it (the
  same random draw), and the draft holds while the choices equal it; so the output is the same
  token for token, and the counts (``decode_stats``) say what a real engine would have saved.
  Under a constraint a position where one byte alone is allowed counts as forced.
* **Constraints** (every kind, ``blueprints/0018``): under a constraint there is no echo and
  no character budget; at each step every byte the grammar allows (the byte matcher of
  ``modeld.decoding``) competes with an xxh3 logit, EOS too where the grammar accepts, and the
  same samplers choose. When no byte is allowed the job ends (the daemon reports
  ``constraint_failed``).
"""

from __future__ import annotations

import math
import os
import random
import struct
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass

import psutil
import xxhash

from modeld.backends.base import HeldTokens, Layout, LoadOptions, SyncStep, Vocab
from modeld.backends.probe import ModelFile, open_model_file
from modeld.backends.sizing import effective_context
from modeld.contract import (
    CONSTRAINT_KINDS,
    NUM_BATCH,
    Capabilities,
    Config,
    DecodeConfig,
    ModelInfo,
    OpenSessionRequest,
    SpecialToken,
    TokenLogprob,
)
from modeld.decoding.constraints import runtime_constraint
from modeld.decoding.gbnf_match import ByteMatcher
from modeld.decoding.samplers import SAMPLER_NAMES
from modeld.decoding.sampling import SampledToken, adjust, logit_bias_of, logprob
from modeld.decoding.speculation import DecodeStats, Drafter, DraftLength, drafter_for
from modeld.errors import EngineError, InvalidArgumentError, ModelLoadError
from modeld.manifest import bytes_hash

__all__ = [
    "BACKEND_VERSION",
    "BOS",
    "EOS",
    "MAX_CONTEXT",
    "MemoryBackend",
    "MemoryRuntime",
    "sample",
]

BACKEND_VERSION = "memory-1"
BOS = 256
EOS = 257
VOCAB_SIZE = 258
MAX_CONTEXT = 32768
KV_BYTES_PER_TOKEN = 8
TOKENIZER_DIGEST = bytes_hash("modeld.memory.tokenizer.v1: one token per UTF-8 byte; BOS=256; EOS=257")

CHAT_TEMPLATE = (
    "{%- if tools -%}"
    "{{- '<|im_start|>system\\n' -}}"
    "{%- if messages and messages[0].role == 'system' -%}{{- messages[0].content + '\\n' -}}{%- endif -%}"
    "{{- '# Tools\\n' -}}"
    "{%- for tool in tools -%}{{- (tool | tojson) + '\\n' -}}{%- endfor -%}"
    "{{- '<|im_end|>\\n' -}}"
    "{%- endif -%}"
    "{%- for message in messages -%}"
    "{%- if not (tools and loop.first and message.role == 'system') -%}"
    "{{- '<|im_start|>' + message.role + '\\n' + (message.content or '') -}}"
    "{%- for call in message.tool_calls or [] -%}"
    "{{- ('\\n' if message.content or not loop.first else '') + '<tool_call>\\n{\"name\":' -}}"
    "{{- (call.function.name | tojson) + ',\"arguments\":' -}}"
    "{{- call.function.arguments if call.function.arguments is string else call.function.arguments | tojson -}}"
    "{{- '}\\n</tool_call>' -}}"
    "{%- endfor -%}"
    "{{- '<|im_end|>\\n' -}}"
    "{%- endif -%}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}{{- '<|im_start|>assistant\\n' -}}{%- endif -%}"
)
"""ChatML, with tool definitions in the system turn and an assistant's calls after its text, each
in ``<tool_call>`` as the hermes grammar writes them (arguments text as sent, so a call the model
made comes back byte for byte). Markers are plain text here (bytes)."""

_ALPHABET: tuple[bytes, ...] = tuple(
    c.encode("utf-8") for c in [*"abcdefghijklmnopqrstuvwxyz", " ", " ", ".", ",", "é", "→", "✓"]
)
_ECHO_BYTES = 24
_REPEAT_WINDOW = 64
EXTRA_KEYS = ("delay_ms",)
_MAX_DELAY_MS = 10_000


def _file_digest(model: ModelFile) -> str:
    h = xxhash.xxh3_128()
    for chunk in model.chunks():
        h.update(chunk)
    return h.hexdigest()


class MemoryBackend:
    """Describes and loads in-memory reference models."""

    @property
    def name(self) -> str:
        return "memory"

    def describe(self, request: OpenSessionRequest, *, memory_budget: int | None = None) -> ModelInfo:
        name = request.path or request.model_name
        if not name:
            raise InvalidArgumentError("a model path (or name) is required", field="path")
        weights = 0
        if os.path.isfile(name) or os.sep in name or name.endswith(".gguf"):
            with open_model_file(name) as model:  # regular files only; never blocks
                digest = _file_digest(model)
                weights = model.identity.size
        else:
            digest = bytes_hash(f"modeld.memory.model:{name}")
        if request.digest and request.digest != digest:
            raise ModelLoadError(
                f"model {name!r} has digest {digest}, the request asked for {request.digest}",
                path=name,
                expected=request.digest,
                actual=digest,
            )
        effective = effective_context(
            trained=MAX_CONTEXT,
            requested=request.config.num_ctx,
            memory_budget=memory_budget,
            weights_bytes=weights,
            kv_bytes_per_token=KV_BYTES_PER_TOKEN,
        )
        return ModelInfo(
            backend="memory",
            architecture="memory",
            backend_version=BACKEND_VERSION,
            path=name,
            model_name=request.model_name or name,
            model_digest=digest,
            model_max_context=MAX_CONTEXT,
            effective_context=effective,
            kv_bytes_per_token=KV_BYTES_PER_TOKEN,
            free_bytes=psutil.virtual_memory().available,
            weights_bytes=weights,
            vocab_size=VOCAB_SIZE,
            tokenizer_digest=TOKENIZER_DIGEST,
            template_digest=bytes_hash(CHAT_TEMPLATE),
            chat_template=CHAT_TEMPLATE,
            add_bos=True,
            bos_token="",
            eos_token="<|im_end|>",
            device="cpu",
            capabilities=Capabilities(
                truncation=True,
                reuse="exact",
                sampling=SAMPLER_NAMES,
                extra=EXTRA_KEYS,
                prompt_formats=("raw", "chat"),
                constraints=CONSTRAINT_KINDS,
                speculation=("off", "ngram"),
            ),
            special_tokens=(SpecialToken(BOS, "", "bos"), SpecialToken(EOS, "", "eos")),
            tool_format="hermes",
        )

    def check_decode(self, config: DecodeConfig) -> None:
        """``extra.delay_ms`` is an integer from 0 to 10000 (validation refused other keys)."""
        delay = config.extra.get("delay_ms")
        if delay is not None and not (delay.isdigit() and int(delay) <= _MAX_DELAY_MS):
            raise InvalidArgumentError(
                f"extra.delay_ms must be an integer from 0 to {_MAX_DELAY_MS}, got {delay!r}",
                field="extra.delay_ms",
            )

    def load(self, request: OpenSessionRequest, info: ModelInfo, options: LoadOptions) -> MemoryRuntime:
        return MemoryRuntime(info, request.config, options)


_SNAPSHOT_MAGIC = b"MKV1"


class MemoryRuntime(HeldTokens):
    """A loaded reference model: each KV sequence is a list of token ids."""

    def __init__(self, info: ModelInfo, config: Config, options: LoadOptions) -> None:
        self._info = info
        self._config = config
        window = min(info.model_max_context, options.window)
        self._layout = Layout(
            n_seq=options.n_seq,
            window=window,
            pool_tokens=options.pool_tokens if options.unified else options.n_seq * window,
            shared_cells=options.unified,
            can_truncate=True,
            snapshots=True,
            explicit=True,
            snapshot_format=f"{BACKEND_VERSION} {'unified' if options.unified else 'split'}",
            kv_bytes_per_token=KV_BYTES_PER_TOKEN,
            name=f"unified/{options.n_seq}:{options.pool_tokens}"
            if options.unified
            else f"split/{options.n_seq}",
        )
        self._seqs: list[list[int]] = [[] for _ in range(options.n_seq)]
        self._stats = [DecodeStats() for _ in range(options.n_seq)]
        self._drafters: dict[int, Drafter] = {}  # per sequence: its history's n-gram index

    @property
    def layout(self) -> Layout:
        return self._layout

    def vocab(self) -> Vocab:
        pieces = (*(bytes((t,)) for t in range(256)), b"", b"")
        return Vocab(pieces=pieces, eog=frozenset({EOS}), bos=BOS)

    def tokenize(self, text: str, *, add_bos: bool) -> list[int]:
        data = text.encode("utf-8")
        return [BOS, *data] if add_bos else list(data)

    def sync(
        self, seq: int, keep: int, tokens: Sequence[int], segments: Sequence[int] | None = None
    ) -> Iterator[SyncStep]:
        held = self._seq(seq)
        if keep + len(tokens) > self._layout.window:  # the engine checks first; be safe
            raise InvalidArgumentError("tokens exceed the context window", field="tokens")
        del held[keep:]
        kept = len(held)
        total = len(tokens)
        yield SyncStep(kept, 0, total)
        step = self._config.num_batch or NUM_BATCH
        for start in range(0, total, step):
            held.extend(tokens[start : start + step])
            yield SyncStep(kept, min(total, start + step), total)

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
        data = bytes(t for t in held if t < 256)
        state = xxhash.xxh3_64_intdigest(struct.pack(f"<{len(held)}I", *held))
        rng = random.Random(config.seed if config.seed is not None else int.from_bytes(os.urandom(8)))
        constraint = runtime_constraint(config)
        matcher = constraint.byte_matcher() if constraint is not None else None
        steps = _Steps(config)
        forced = list(_echo(data)) if matcher is None else []
        free = 16 + state % 48
        char: list[tuple[bytes, float]] = []  # the character being written: its candidates' logits
        partial = b""
        delay = int(config.extra.get("delay_ms", "0")) / 1000.0
        stats = self._stats[seq] = DecodeStats()
        # Speculation (blueprint 0021): the reference semantics of the llama backend's, one
        # position at a time (evaluation costs nothing here). A draft covers the next positions;
        # each position's token is chosen as without a draft, and the draft holds while the
        # choices equal it. The first differing choice, or the one after a fully accepted
        # draft, ends the verify step, and the next draft starts after it.
        drafter = drafter_for(self._drafters, seq, held) if config.speculation == "ngram" else None
        lengths = DraftLength()
        draft: list[int] = []
        checked = 0  # draft tokens confirmed so far in this verify step
        for produced in range(max_tokens):
            if delay:
                time.sleep(delay)
            if matcher is not None:
                # Constrained: every byte the grammar allows competes, EOS where it accepts.
                allowed = sorted(matcher.allowed_bytes()) + ([EOS] if matcher.accepting() else [])
                if not allowed:
                    return  # the constraint cannot go on: the daemon reports constraint_failed
                if drafter is not None and len(allowed) == 1:
                    stats.forced += 1  # the only continuation: appended without a choice
                token = steps.choose({i: _logit(state, i) for i in allowed}, rng)
                if token != EOS:
                    matcher.advance(token)
            elif forced:
                token = steps.choose({forced[0]: 0.0}, rng)
                forced.pop(0)
            elif free <= 0 and not partial:
                token = steps.choose({EOS: 0.0}, rng)
            else:
                if not partial:  # a new character: the alphabet's logits at this state
                    char = [(piece, _logit(state, i)) for i, piece in enumerate(_ALPHABET)]
                token = steps.choose(_next_bytes(char, partial), rng)
                partial += bytes((token,))
                if partial in _ALPHABET:
                    partial, free = b"", free - 1
            if draft:
                if checked < len(draft) and token == draft[checked]:
                    checked += 1  # confirmed: the draft goes on
                else:  # the differing choice, or the one after a confirmed draft
                    stats.verifies += 1
                    stats.drafted += len(draft)
                    stats.accepted += checked
                    lengths.record(len(draft), checked)
                    draft, checked = [], 0
            yield steps.token(token)
            if token == EOS or produced + 1 >= max_tokens or len(held) >= self._layout.window:
                return
            # The consumer resumed: the token is evaluated (becomes resident).
            held.append(token)
            state = xxhash.xxh3_64_intdigest(struct.pack("<QI", state, token))
            if drafter is not None:
                drafter.append(token)
                if not draft:
                    draft = drafter.draft(min(max_tokens - produced - 2, self._layout.window - len(held)))
                    del draft[lengths.budget(drafter.matched) :]
                    if draft and matcher is not None:
                        del draft[_valid_prefix(matcher, draft) :]

    def copy(self, src: int, dst: int, n: int) -> None:
        source = self._seq(src)
        self._seq(dst)
        self._drafters.pop(dst, None)  # another context's text: nothing to recall from
        self._seqs[dst] = list(source[:n])

    def drop(self, seq: int) -> None:
        self._seq(seq).clear()
        self._drafters.pop(seq, None)  # the sequence's next text is another context's

    def share(self, src: int, dst: int, n: int) -> bool:
        # Token lists hold no cells: sharing changes nothing but is checked as llama's is.
        source, held = self._seq(src), self._seq(dst)
        return self._layout.shared_cells and 0 < n <= min(len(source), len(held)) and source[:n] == held[:n]

    def snapshot(self, seq: int) -> bytes:
        held = self._seq(seq)
        body = struct.pack(f"<I{len(held)}I", len(held), *held)
        return _SNAPSHOT_MAGIC + body + xxhash.xxh3_64_digest(body)

    def restore(self, seq: int, blob: bytes | bytearray | memoryview, tokens: Sequence[int]) -> bool:
        held = self._seq(seq)
        held.clear()
        self._drafters.pop(seq, None)
        blob = bytes(blob)  # a few bytes per token: a copy costs nothing here
        if len(blob) < 16 or blob[:4] != _SNAPSHOT_MAGIC:
            return False
        body, check = blob[4:-8], blob[-8:]
        if xxhash.xxh3_64_digest(body) != check or len(body) < 4:
            return False
        (n,) = struct.unpack_from("<I", body)
        if len(body) != 4 + 4 * n or n > self._layout.window:
            return False
        restored = list(struct.unpack_from(f"<{n}I", body, 4))
        if restored != list(tokens):
            return False
        held.extend(restored)
        return True

    def save(self, seq: int, path: str) -> int:
        blob = self.snapshot(seq)
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o600)
        with os.fdopen(fd, "wb") as f:
            f.write(blob)
        return len(blob)

    def restore_file(self, seq: int, path: str, size: int, tokens: Sequence[int]) -> bool:
        with open(path, "rb") as f:
            return self.restore(seq, f.read(size), tokens)

    def close(self) -> None:
        for held in self._seqs:
            held.clear()


def _valid_prefix(matcher: ByteMatcher, tokens: list[int]) -> int:
    """How many of ``tokens`` (bytes, or EOS) the grammar accepts in order from here."""
    probe = matcher.copy()
    for n, token in enumerate(tokens):
        if token == EOS:
            return n + 1 if probe.accepting() else n
        if token > 255 or token not in probe.allowed_bytes():
            return n
        probe.advance(token)
    return len(tokens)


def _logit(state: int, i: int) -> float:
    return 5.0 * xxhash.xxh3_64_intdigest(struct.pack("<QI", state, i)) / 2.0**64


def _next_bytes(char: list[tuple[bytes, float]], partial: bytes) -> dict[int, float]:
    """The logits of the next byte of a character that starts with ``partial``: each byte's is
    the log of the summed probabilities of the characters it leads to (exact byte-level
    semantics for multi-byte characters; a byte with one continuation has probability 1)."""
    grouped: dict[int, list[float]] = {}
    n = len(partial)
    for piece, value in char:
        if len(piece) > n and piece.startswith(partial):
            grouped.setdefault(piece[n], []).append(value)
    out: dict[int, float] = {}
    for byte, values in grouped.items():
        top = max(values)
        out[byte] = top + math.log(sum(math.exp(v - top) for v in values))
    return out


class _Steps:
    """One decode's choices: logit bias and presence/frequency penalties on the candidates
    (``modeld.decoding.sampling``), the samplers (:func:`sample`), log-probabilities."""

    def __init__(self, config: DecodeConfig) -> None:
        self._config = config
        self._bias = logit_bias_of(config.logit_bias)
        self._counts: dict[int, int] = {}
        self._recent: list[int] = []
        self._extra = bool(self._bias or config.presence_penalty or config.frequency_penalty)
        self._logprob: TokenLogprob | None = None

    def choose(self, logits: dict[int, float], rng: random.Random) -> int:
        config = self._config
        if self._extra:
            logits = adjust(
                logits,
                counts=self._counts,
                logit_bias=self._bias,
                presence_penalty=config.presence_penalty,
                frequency_penalty=config.frequency_penalty,
            )
        token = sample(logits, config, rng, self._recent) if len(logits) > 1 else next(iter(logits))
        self._recent = [*self._recent, token][-_REPEAT_WINDOW:]
        self._counts[token] = self._counts.get(token, 0) + 1
        if config.logprobs:
            self._logprob = logprob(logits, token, config.top_logprobs)
        return token

    def token(self, token: int) -> int:
        """The token to yield: with its log-probabilities when the decode asked for them."""
        return SampledToken(token, self._logprob) if self._logprob is not None else token


def _echo(data: bytes) -> bytes:
    """``[tail] ``: the last non-empty line of the text, at most 24 bytes, cut at a character."""
    lines = [ln for ln in data.split(b"\n") if ln.strip()]
    if not lines:
        return b"[] "
    tail = lines[-1].strip()[-_ECHO_BYTES:]
    while tail and (tail[0] & 0xC0) == 0x80:  # do not start inside a UTF-8 character
        tail = tail[1:]
    return b"[" + tail + b"] "


@dataclass(frozen=True, slots=True)
class _Candidate:
    index: int
    logit: float


def sample(logits: dict[int, float], config: DecodeConfig, rng: random.Random, recent: Sequence[int]) -> int:
    """Pick a candidate with the reference semantics of every DecodeConfig sampler.

    In order: repeat penalty on candidates seen in ``recent`` (positive logits divided, negative
    multiplied, as llama.cpp does); greedy when ``temperature == 0`` (ties to the lowest index);
    otherwise top-k, softmax at the temperature, top-p (smallest set reaching the mass), min-p
    (drop candidates below ``min_p`` times the best probability), then a draw from ``rng``.
    """
    adjusted = dict(logits)
    if config.repeat_penalty != 1.0:
        for idx in set(recent):
            if idx in adjusted:
                value = adjusted[idx]
                adjusted[idx] = value / config.repeat_penalty if value > 0 else value * config.repeat_penalty
    ranked = sorted((_Candidate(i, v) for i, v in adjusted.items()), key=lambda c: (-c.logit, c.index))
    if config.temperature <= 0.0:
        return ranked[0].index
    if config.top_k > 0:
        ranked = ranked[: config.top_k]
    top = ranked[0].logit
    weights = [math.exp((c.logit - top) / config.temperature) for c in ranked]
    total = sum(weights)
    probs = [w / total for w in weights]
    if config.top_p < 1.0:
        mass, keep = 0.0, 0
        for p in probs:
            keep += 1
            mass += p
            if mass >= config.top_p:
                break
        ranked, probs = ranked[:keep], probs[:keep]
    if config.min_p > 0.0:
        floor = config.min_p * probs[0]
        kept = [(c, p) for c, p in zip(ranked, probs, strict=True) if p >= floor]
        ranked, probs = [c for c, _ in kept], [p for _, p in kept]
    return rng.choices([c.index for c in ranked], weights=probs, k=1)[0]
