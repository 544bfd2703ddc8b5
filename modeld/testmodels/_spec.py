"""The shape of a generated test model (:class:`ModelSpec`) and the two shipped specs.

What: a frozen description of everything that determines the generated file, so that the file
is a pure function of ``(spec, GENERATOR_VERSION)`` and its cache name can be a digest of
exactly that.

What not: no tuning knobs for the random weights live here; they are part of the generator
(``_gguf.WeightRecipe``) and covered by ``GENERATOR_VERSION``.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import asdict, dataclass
from typing import Final

__all__ = ["GENERATOR_VERSION", "REALISTIC", "TINY", "ModelSpec"]

# Bump whenever the bytes written for an unchanged spec could change (corpus, tokenizer layout,
# weight recipe, metadata, template). The cache file name includes it.
GENERATOR_VERSION: Final = 1

_DTYPES: Final = ("f16", "q8_0")
_Q8_0_BLOCK: Final = 32


@dataclass(frozen=True)
class ModelSpec:
    """A llama-architecture model with random weights and a trained byte-level BPE vocabulary.

    Fields: ``name`` (file name prefix, ``[A-Za-z0-9._-]``), ``hidden`` (embedding width),
    ``layers``, ``heads`` / ``kv_heads`` (query / key-value heads), ``ff`` (SwiGLU width),
    ``vocab_size`` (tokens, including the 256 bytes and 3 control tokens),
    ``context_length`` (the trained context written to the metadata), ``dtype`` (``"f16"`` or
    ``"q8_0"`` for matrices; norms are always f32), ``tied_embeddings`` (no ``output.weight``),
    ``seed`` (weights and tokenizer corpus).

    Invariants (checked on construction): ``hidden`` is a multiple of ``heads``, ``heads`` a
    multiple of ``kv_heads`` (GQA), the head dimension is even (RoPE), and for ``q8_0`` every
    matrix's input dimension is a multiple of 32.
    """

    name: str
    hidden: int
    layers: int
    heads: int
    kv_heads: int
    ff: int
    vocab_size: int
    context_length: int
    dtype: str
    tied_embeddings: bool
    seed: int

    def __post_init__(self) -> None:
        problems = []
        if not self.name or not all(c.isalnum() or c in "-_." for c in self.name):
            problems.append(f"name {self.name!r} must be non-empty [A-Za-z0-9._-]")
        if min(self.hidden, self.layers, self.heads, self.kv_heads, self.ff) <= 0:
            problems.append("dimensions must be positive")
        elif self.hidden % self.heads or self.heads % self.kv_heads:
            problems.append("hidden must be a multiple of heads, heads a multiple of kv_heads")
        elif self.head_dim % 2:
            problems.append(f"head dimension {self.head_dim} must be even for RoPE")
        if self.dtype not in _DTYPES:
            problems.append(f"dtype {self.dtype!r} is not one of {_DTYPES}")
        if self.dtype == "q8_0" and (self.hidden % _Q8_0_BLOCK or self.ff % _Q8_0_BLOCK):
            problems.append("q8_0 needs hidden and ff to be multiples of 32")
        if self.vocab_size < 256 + 3:
            problems.append("vocab_size must hold 256 byte tokens and 3 control tokens")
        if self.context_length <= 0:
            problems.append("context_length must be positive")
        if not 0 <= self.seed < 2**63:
            problems.append("seed must be in [0, 2**63)")
        if problems:
            raise ValueError(f"invalid ModelSpec {self.name!r}: " + "; ".join(problems))

    @property
    def head_dim(self) -> int:
        return self.hidden // self.heads

    def digest(self) -> str:
        """A short hex digest of ``(spec, GENERATOR_VERSION)``: the cache identity of the file."""
        payload = json.dumps(
            {"generator_version": GENERATOR_VERSION, "spec": asdict(self)},
            sort_keys=True,
            separators=(",", ":"),
        )
        return hashlib.sha256(payload.encode()).hexdigest()[:12]

    @property
    def file_name(self) -> str:
        return f"{self.name}-{self.digest()}.gguf"


TINY: Final = ModelSpec(
    name="tiny",
    hidden=128,
    layers=2,
    heads=4,
    kv_heads=2,
    ff=384,
    vocab_size=4096,
    context_length=8192,
    dtype="f16",
    tied_embeddings=False,
    seed=0,
)

REALISTIC: Final = ModelSpec(
    name="realistic",
    hidden=896,
    layers=24,
    heads=14,
    kv_heads=2,
    ff=4864,
    vocab_size=32000,
    context_length=32768,
    dtype="q8_0",
    tied_embeddings=True,
    seed=0,
)
