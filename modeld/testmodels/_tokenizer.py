"""The test models' byte-level BPE vocabulary, learned with the ``tokenizers`` library.

What: :func:`build_vocabulary` trains BPE merges on the synthetic corpus of ``_corpus`` and lays
out a GGUF ``gpt2``-style vocabulary: the 256 byte symbols first (in byte order, in GPT-2's
byte-to-unicode spelling), then one token per merge in merge order, then (only if the corpus
ran out of merges) unused filler tokens, and the three control tokens last::

    <|endoftext|>  bos and padding
    <|im_start|>
    <|im_end|>     eos

Why: a byte-level vocabulary round-trips any byte string exactly (ASCII, accents, CJK, emoji,
tabs, mixed whitespace), OpenVINO GenAI accepts it (it refuses SentencePiece GGUF vocabularies),
and pre-tokenizing with Qwen2's regex during training matches what llama.cpp does at run time
for ``tokenizer.ggml.pre = "qwen2"``. The layout is rebuilt here from the merge list rather than
taken from the trainer's id assignment so that it is explicit and documented.

Determinism: ``tokenizers``' BPE trainer counts pairs in parallel but breaks ties by
(count, pair ids), and its ids come from a sorted alphabet and the merge order, so the same
corpus gives the same merges regardless of thread count or process (checked by the tests and
recorded in ``blueprints/test-models.md``). A different ``tokenizers`` version could in theory
learn different merges; the project pins it.

What not: not a faithful Qwen tokenizer (no added-token normalisation, no digit grouping
beyond the regex); it only needs to be real, code-like and exact.
"""

from __future__ import annotations

import functools
import json
from dataclasses import dataclass
from typing import Final

from tokenizers import Regex, Tokenizer, models, pre_tokenizers, trainers

from modeld.testmodels._corpus import build_corpus

__all__ = [
    "BOS_TOKEN",
    "CONTROL_TOKENS",
    "EOS_TOKEN",
    "IM_START_TOKEN",
    "QWEN2_PRETOKENIZER_REGEX",
    "Vocabulary",
    "build_vocabulary",
    "encode",
]

BOS_TOKEN: Final = "<|endoftext|>"
IM_START_TOKEN: Final = "<|im_start|>"
EOS_TOKEN: Final = "<|im_end|>"
CONTROL_TOKENS: Final = (BOS_TOKEN, IM_START_TOKEN, EOS_TOKEN)

# Qwen2's pre-tokenizer split (llama.cpp's LLAMA_VOCAB_PRE_TYPE_QWEN2 uses the same pattern).
QWEN2_PRETOKENIZER_REGEX: Final = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)

# GGUF token types (gguf.TokenType): kept as plain ints so this module needs no gguf import.
TOKEN_TYPE_NORMAL: Final = 1
TOKEN_TYPE_CONTROL: Final = 3
TOKEN_TYPE_UNUSED: Final = 5

_N_BYTES: Final = 256
# Long runs such as "================" would otherwise become single tokens.
_MAX_TOKEN_CHARS: Final = 16


@dataclass(frozen=True)
class Vocabulary:
    """A GGUF ``gpt2`` vocabulary: ``tokens[i]`` has type ``token_types[i]``."""

    tokens: tuple[str, ...]
    token_types: tuple[int, ...]
    merges: tuple[str, ...]
    bos_id: int
    eos_id: int
    im_start_id: int
    n_unused: int

    @property
    def pad_id(self) -> int:
        return self.bos_id


def bytes_to_unicode() -> dict[int, str]:
    """GPT-2's reversible byte -> printable character mapping (used by byte-level BPE)."""
    printable = [
        *range(ord("!"), ord("~") + 1),
        *range(ord("¡"), ord("¬") + 1),
        *range(ord("®"), ord("ÿ") + 1),
    ]
    mapping = {b: chr(b) for b in printable}
    extra = 0
    for b in range(_N_BYTES):
        if b not in mapping:
            mapping[b] = chr(_N_BYTES + extra)
            extra += 1
    return mapping


def corpus_chars_for(vocab_size: int) -> int:
    """How much synthetic text to train on: enough distinct words for ``vocab_size`` merges."""
    return max(200_000, vocab_size * 100)


def train_merges(documents: list[str], n_merges: int) -> list[tuple[str, str]]:
    """Learn up to ``n_merges`` BPE merges (byte-level, Qwen2 pre-tokenization)."""
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Split(Regex(QWEN2_PRETOKENIZER_REGEX), behavior="isolated"),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ]
    )
    trainer = trainers.BpeTrainer(
        vocab_size=_N_BYTES + n_merges,
        min_frequency=0,
        show_progress=False,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        max_token_length=_MAX_TOKEN_CHARS,
    )
    tokenizer.train_from_iterator(documents, trainer=trainer)
    # tokenizers >= 0.20 serialises each merge as a [left, right] pair.
    merges = json.loads(tokenizer.to_str())["model"]["merges"]
    return [(str(left), str(right)) for left, right in merges]


def build_vocabulary(vocab_size: int, seed: int) -> Vocabulary:
    """The vocabulary of exactly ``vocab_size`` tokens for a model spec (pure function)."""
    n_learnable = vocab_size - _N_BYTES - len(CONTROL_TOKENS)
    if n_learnable < 0:
        raise ValueError(f"vocab_size {vocab_size} is smaller than 256 bytes + 3 control tokens")
    documents = build_corpus(seed, corpus_chars_for(vocab_size))
    pairs = train_merges(documents, n_learnable) if n_learnable else []

    byte_symbols = bytes_to_unicode()
    tokens = [byte_symbols[b] for b in range(_N_BYTES)]
    index = {t: i for i, t in enumerate(tokens)}
    merges: list[str] = []
    for left, right in pairs:
        if left not in index or right not in index:
            raise AssertionError(f"merge {left!r} {right!r} uses an unknown token")
        merged = left + right
        merges.append(f"{left} {right}")
        if merged not in index:
            index[merged] = len(tokens)
            tokens.append(merged)
    types = [TOKEN_TYPE_NORMAL] * len(tokens)

    # Fillers keep the size exact when the corpus yields too few merges. BPE can never produce
    # them (no merge leads to them), and they are typed UNUSED.
    n_unused = n_learnable + _N_BYTES - len(tokens)
    if n_unused < 0:
        raise AssertionError("the trainer learned more merges than asked for")
    tokens += [f"<|unused_{i}|>" for i in range(n_unused)]
    types += [TOKEN_TYPE_UNUSED] * n_unused

    first_control = len(tokens)
    tokens += CONTROL_TOKENS
    types += [TOKEN_TYPE_CONTROL] * len(CONTROL_TOKENS)
    assert len(tokens) == vocab_size == len(set(tokens))
    return Vocabulary(
        tokens=tuple(tokens),
        token_types=tuple(types),
        merges=tuple(merges),
        bos_id=first_control + CONTROL_TOKENS.index(BOS_TOKEN),
        eos_id=first_control + CONTROL_TOKENS.index(EOS_TOKEN),
        im_start_id=first_control + CONTROL_TOKENS.index(IM_START_TOKEN),
        n_unused=n_unused,
    )


@functools.lru_cache(maxsize=8)
def _encoder(vocab: Vocabulary) -> Tokenizer:
    index = {t: i for i, t in enumerate(vocab.tokens)}
    merges = [tuple(m.split(" ", 1)) for m in vocab.merges]
    bpe = Tokenizer(models.BPE(vocab=index, merges=merges))  # type: ignore[arg-type]
    bpe.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Split(Regex(QWEN2_PRETOKENIZER_REGEX), behavior="isolated"),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ]
    )
    return bpe


def encode(vocab: Vocabulary, text: str) -> list[int]:
    """``text``'s canonical token ids in ``vocab`` (as llama.cpp tokenizes it; no control tokens)."""
    ids: list[int] = _encoder(vocab).encode(text).ids
    return ids
