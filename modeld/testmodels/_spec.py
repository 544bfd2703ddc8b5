"""The shape of a generated test model (:class:`ModelSpec`) and the three shipped specs.

What: a frozen description of everything that determines the generated file, so that the file
is a pure function of ``(spec, GENERATOR_VERSION)`` and its cache name can be a digest of
exactly that. Two architectures: ``"llama"`` (attention + SwiGLU; TINY, REALISTIC) and
``"mamba"`` (a recurrent state-space model; RECURRENT), whose memory llama.cpp cannot cut at
an arbitrary position.

What not: no tuning knobs for the random weights live here; they are part of the generator
(``_gguf.WeightRecipe``) and covered by ``GENERATOR_VERSION``.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import asdict, dataclass, fields
from typing import Any, Final

__all__ = [
    "COPYING",
    "GENERATOR_VERSION",
    "REALISTIC",
    "RECURRENT",
    "REPLY",
    "THINK",
    "TINY",
    "TOOLS",
    "ModelSpec",
]

# Bump whenever the bytes written for an unchanged spec could change (corpus, tokenizer layout,
# weight recipe, metadata, template). The cache file name includes it.
GENERATOR_VERSION: Final = 1

_DTYPES: Final = ("f16", "q8_0")
_ARCHS: Final = ("llama", "mamba")
_Q8_0_BLOCK: Final = 32
# Fields added after GENERATOR_VERSION 1's specs were published. They enter the digest only when
# they differ from their default, so TINY and REALISTIC keep their digests and (since the digest
# is written into the file) their bytes.
_LATER_FIELDS: Final = ("arch", "ssm_state", "ssm_conv", "weights", "rope_freq_base")
_WEIGHTS: Final = ("random", "copying", "reply", "think", "tools")


@dataclass(frozen=True)
class ModelSpec:
    """A model with random weights and a trained byte-level BPE vocabulary.

    Fields: ``name`` (file name prefix, ``[A-Za-z0-9._-]``), ``hidden`` (embedding width),
    ``layers``, ``heads`` / ``kv_heads`` (query / key-value heads), ``ff`` (SwiGLU width),
    ``vocab_size`` (tokens, including the 256 bytes and 3 control tokens),
    ``context_length`` (the trained context written to the metadata), ``dtype`` (``"f16"`` or
    ``"q8_0"`` for matrices; norms are always f32), ``tied_embeddings`` (no ``output.weight``),
    ``seed`` (weights and tokenizer corpus), ``arch`` (``"llama"`` or ``"mamba"``),
    ``ssm_state`` / ``ssm_conv`` (Mamba's state size per channel and convolution width; 0 for
    llama).

    Invariants (checked on construction), llama: ``hidden`` is a multiple of ``heads``,
    ``heads`` a multiple of ``kv_heads`` (GQA), the head dimension is even (RoPE), the ``ssm_*``
    fields are 0, and for ``q8_0`` every matrix's input dimension is a multiple of 32. Mamba:
    ``heads``, ``kv_heads`` and ``ff`` are 0 (no attention, no FFN), ``ssm_state >= 1``,
    ``ssm_conv >= 2``, and for ``q8_0`` ``hidden`` and :attr:`ssm_dt_rank` are multiples of 32.
    Mamba's inner width is ``2 * hidden`` (the only expansion llama.cpp supports).
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
    arch: str = "llama"
    ssm_state: int = 0
    ssm_conv: int = 0
    weights: str = "random"
    rope_freq_base: float = 10000.0

    def __post_init__(self) -> None:
        problems = []
        if not self.name or not all(c.isalnum() or c in "-_." for c in self.name):
            problems.append(f"name {self.name!r} must be non-empty [A-Za-z0-9._-]")
        if self.arch not in _ARCHS:
            problems.append(f"arch {self.arch!r} is not one of {_ARCHS}")
        elif self.arch == "llama":
            problems += self._llama_problems()
        else:
            problems += self._mamba_problems()
        if self.dtype not in _DTYPES:
            problems.append(f"dtype {self.dtype!r} is not one of {_DTYPES}")
        if self.vocab_size < 256 + 3:
            problems.append("vocab_size must hold 256 byte tokens and 3 control tokens")
        if self.context_length <= 0:
            problems.append("context_length must be positive")
        if not 0 <= self.seed < 2**63:
            problems.append("seed must be in [0, 2**63)")
        if not self.rope_freq_base > 0:
            problems.append("rope_freq_base must be positive")
        if self.weights not in _WEIGHTS:
            problems.append(f"weights {self.weights!r} is not one of {_WEIGHTS}")
        elif self.weights == "copying" and not problems:
            from modeld.testmodels._copying import copying_problems

            problems += copying_problems(self)
        elif self.weights == "tools" and not problems:
            from modeld.testmodels._tools import tools_problems

            problems += tools_problems(self)
        if problems:
            raise ValueError(f"invalid ModelSpec {self.name!r}: " + "; ".join(problems))

    def _llama_problems(self) -> list[str]:
        problems = []
        if min(self.hidden, self.layers, self.heads, self.kv_heads, self.ff) <= 0:
            problems.append("dimensions must be positive")
        elif self.hidden % self.heads or self.heads % self.kv_heads:
            problems.append("hidden must be a multiple of heads, heads a multiple of kv_heads")
        elif self.head_dim % 2:
            problems.append(f"head dimension {self.head_dim} must be even for RoPE")
        if self.ssm_state or self.ssm_conv:
            problems.append("ssm_state and ssm_conv must be 0 for llama")
        if self.dtype == "q8_0" and (self.hidden % _Q8_0_BLOCK or self.ff % _Q8_0_BLOCK):
            problems.append("q8_0 needs hidden and ff to be multiples of 32")
        return problems

    def _mamba_problems(self) -> list[str]:
        problems = []
        if min(self.hidden, self.layers) <= 0:
            problems.append("dimensions must be positive")
        if self.heads or self.kv_heads or self.ff:
            problems.append("heads, kv_heads and ff must be 0 for mamba (no attention, no FFN)")
        if self.ssm_state < 1 or self.ssm_conv < 2:
            problems.append("mamba needs ssm_state >= 1 and ssm_conv >= 2")
        if self.dtype == "q8_0" and (self.hidden % _Q8_0_BLOCK or self.ssm_dt_rank % _Q8_0_BLOCK):
            problems.append("q8_0 needs hidden and ssm_dt_rank to be multiples of 32")
        return problems

    @property
    def head_dim(self) -> int:
        """Attention head width; 0 for an architecture without attention."""
        return self.hidden // self.heads if self.heads else 0

    @property
    def ssm_inner(self) -> int:
        """Mamba's inner (expanded) width: ``2 * hidden``; 0 for llama."""
        return 2 * self.hidden if self.arch == "mamba" else 0

    @property
    def ssm_dt_rank(self) -> int:
        """Mamba's time-step rank, ``ceil(hidden / 16)`` as in the reference Mamba; 0 for llama."""
        return -(-self.hidden // 16) if self.arch == "mamba" else 0

    def digest(self) -> str:
        """A short hex digest of ``(spec, GENERATOR_VERSION)``: the cache identity of the file.
        For constructed weights it also covers their construction's own version
        (``_copying.COPYING_VERSION``), so changing the construction renames only those files."""
        identity: dict[str, Any] = {"generator_version": GENERATOR_VERSION, "spec": self._identity()}
        if self.weights == "copying":
            from modeld.testmodels._copying import COPYING_VERSION

            identity["copying_version"] = COPYING_VERSION
        if self.weights == "tools":
            from modeld.testmodels._tools import TOOLS_VERSION

            identity["tools_version"] = TOOLS_VERSION
        payload = json.dumps(identity, sort_keys=True, separators=(",", ":"))
        return hashlib.sha256(payload.encode()).hexdigest()[:12]

    def _identity(self) -> dict[str, Any]:
        defaults = {f.name: f.default for f in fields(self) if f.name in _LATER_FIELDS}
        return {k: v for k, v in asdict(self).items() if k not in defaults or v != defaults[k]}

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
    # A coding agent's first request is 12-20k tokens of this vocabulary (Claude Code's, Codex's):
    # the default model's window holds one with room for a conversation (KV: 512 B per token).
    context_length=32768,
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

# A recurrent model (llama.cpp arch "mamba") with TINY's vocabulary (same vocab_size and seed):
# its memory holds one state per sequence, not one entry per token, so llama.cpp cannot remove
# a suffix of it (llama_memory_seq_rm(mem, seq, p0 > 0, -1) returns false). Backends test their
# "cannot truncate -> re-prefill from scratch" path on it.
RECURRENT: Final = ModelSpec(
    name="recurrent",
    hidden=128,
    layers=2,
    heads=0,
    kv_heads=0,
    ff=0,
    vocab_size=4096,
    context_length=8192,
    dtype="f16",
    tied_embeddings=False,
    seed=0,
    arch="mamba",
    ssm_state=16,
    ssm_conv=4,
)

# REALISTIC's size and per-token cost with constructed weights that copy earlier context (an
# n-gram induction circuit, ``_copying.py``). 7 query heads of width 128 sharing one KV head
# instead of 14 of width 64 sharing two: the same parameters, KV bytes per token and attention
# FLOPs, but the content match gets 110 rotation-free dimensions per head instead of ~50.
# rope_freq_base 1e38 leaves RoPE pairs 8-63 nearly rotation-free over 32k tokens.
COPYING: Final = ModelSpec(
    name="copying",
    hidden=896,
    layers=24,
    heads=7,
    kv_heads=1,
    ff=4864,
    vocab_size=32000,
    context_length=32768,
    dtype="q8_0",
    tied_embeddings=True,
    seed=0,
    weights="copying",
    rope_freq_base=1e38,
)

# TINY's shape and cost, answering every chat turn with a short reply and ending it (``_reply.py``):
# what a coding agent needs of the model it talks to (it treats an answer cut off at its output
# limit as an error). Faint random blocks, an output matrix with a token chain.
REPLY: Final = ModelSpec(
    name="reply",
    hidden=128,
    layers=2,
    heads=4,
    kv_heads=2,
    ff=384,
    vocab_size=4096,
    context_length=32768,
    dtype="f16",
    tied_embeddings=False,
    seed=0,
    weights="reply",
)

# REPLY with a reasoning format (Qwen3's shape of template): it thinks, then answers and ends the
# turn; earlier turns' thinking is dropped by its template. For tests of reasoning output.
THINK: Final = ModelSpec(
    name="think",
    hidden=128,
    layers=2,
    heads=4,
    kv_heads=2,
    ff=384,
    vocab_size=4096,
    context_length=32768,
    dtype="f16",
    tied_embeddings=False,
    seed=0,
    weights="think",
)

# A tool loop's model (``_tools.py``): it answers a user turn naming a file (``Read the file
# "calc.py"``) with a call reading it (Claude Code's Read, or Codex's exec_command with cat when
# that tool is offered) and a tool result with "Done.", ending its turn each time. Constructed
# weights in 3 layers of width 320 (10 heads of 32 sharing 5 KV heads); TINY's vocabulary and
# template. RoPE base 10^9.5 turns pairs 0-7 of a 32-wide head at COPYING's rates.
TOOLS: Final = ModelSpec(
    name="tools",
    hidden=320,
    layers=3,
    heads=10,
    kv_heads=5,
    ff=128,
    vocab_size=4096,
    context_length=32768,
    dtype="f16",
    tied_embeddings=False,
    seed=0,
    weights="tools",
    rope_freq_base=10**9.5,
)
