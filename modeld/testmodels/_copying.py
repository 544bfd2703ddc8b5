"""Constructed (not random) weights for the COPYING test model: an n-gram induction circuit.

What: :func:`copying_values` returns the value of every tensor of a llama-architecture model
whose greedy continuation of a span seen earlier in the context copies that span. The circuit
lives in the first :data:`CIRCUIT_LAYERS` layers; the remaining layers are REALISTIC-style
random "filler" layers whose output projections are tiny, so they cost real compute and leave
the residual stream essentially unchanged.

How (details and measurements in ``blueprints/0008-test-models.md``):

* Every token has a random sign code ``e_t`` (entries +-1, :data:`CODE_DIM` of them). The
  residual stream is cut into a constant block and code-sized slots.
* *Previous-token heads* read a code through V and write it, one position later (or 2, 4, 8, 16),
  into a slot. Their q and k come from a constant coordinate only and are set so that every
  low-index RoPE frequency pair is in phase at the wanted offset; a large ``rope.freq_base``
  leaves the other pairs nearly rotation-free.
* *Hashing FFNs* multiply two codes element-wise (a pair of SwiGLU units computes
  ``silu(z)*y + silu(-z)*(-y) = z*y`` exactly), giving a code of the n-gram ending at each
  position: ``h2 = e_i * P(e_{i-1})``, ``h4 = h2_i * P(h2_{i-2})``, ``h8``, ``h16``, ``h32`` (``P`` a fixed
  signed derangement per level). Equal n-grams get equal codes; different ones nearly
  orthogonal codes (an XOR hash), so a partial match earns nothing.
* *Induction heads*, one per level L in (2, 4, 8, 16, 32), compare the query's ``h_L`` with the key
  ``h_L(j-1)`` (moved one position by a previous-token head) in the rotation-free pairs, and
  copy the token code of position ``j`` into the output slot. A sink at BOS absorbs the
  attention when nothing matches. Longer levels write with larger gains, so the longest
  match wins.
* The output (tied embeddings) reads only that slot, plus a penalty on control tokens; where
  nothing matches, a weak code derived from the last two tokens (``h2``) picks a
  deterministic pseudo-random token.

Determinism: codes, permutations and signs come from raw PCG64 streams keyed by
``(seed, name)`` like the random weights; the few real-valued constants (the position-head
weights) are written out here, not solved for at generation time.
"""

from __future__ import annotations

import functools
import math
import zlib
from collections.abc import Hashable
from dataclasses import dataclass
from typing import Final, Protocol

import numpy as np
import numpy.typing as npt

from modeld.testmodels._tokenizer import TOKEN_TYPE_NORMAL, Vocabulary


class ModelSpec(Hashable, Protocol):
    """What the construction reads of a :class:`~modeld.testmodels._spec.ModelSpec` (``_spec``
    imports this module to validate a copying spec, so this one does not import it back)."""

    @property
    def arch(self) -> str: ...
    @property
    def context_length(self) -> int: ...
    @property
    def ff(self) -> int: ...
    @property
    def head_dim(self) -> int: ...
    @property
    def heads(self) -> int: ...
    @property
    def hidden(self) -> int: ...
    @property
    def kv_heads(self) -> int: ...
    @property
    def layers(self) -> int: ...
    @property
    def rope_freq_base(self) -> float: ...
    @property
    def seed(self) -> int: ...
    @property
    def tied_embeddings(self) -> bool: ...
    @property
    def vocab_size(self) -> int: ...


__all__ = [
    "CIRCUIT_LAYERS",
    "CODE_DIM",
    "COPYING_VERSION",
    "LEVELS",
    "ROPE_FREQ_BASE",
    "copying_problems",
    "copying_values",
]

F32 = npt.NDArray[np.float32]

# Bump whenever the bytes written for an unchanged copying spec could change: it enters the
# spec's digest (and so the cache name) of copying specs only.
COPYING_VERSION: Final = 1

# The construction is solved for this head width and RoPE base: pairs 0-7 (theta 1 ... 7e-5
# per token) are the position pairs, pairs 8-62 (theta <= 1.6e-5, < 0.53 rad over 32k
# tokens) carry the code, pair 63 (theta 1e-37) the sink.
HEAD_DIM: Final = 128
ROPE_FREQ_BASE: Final = 1e38
_POS_PAIRS: Final = 8
_SINK_PAIR: Final = 63
CODE_DIM: Final = 2 * (_SINK_PAIR - _POS_PAIRS)  # 110
# Weights of the position pairs in a previous-token head's score (sum 1). Chosen (max-min over
# offsets 1-16 and every distance up to 32768) so that the score at the wanted offset
# beats every other distance by at least 0.147 of the peak (0.152 at the neighbours).
_POS_WEIGHTS: Final = (0.32, 0.13, 0.13, 0.08, 0.09, 0.11, 0.06, 0.08)
# n-gram lengths of the induction heads and the gain each writes the copied code with: the
# longest match dominates, shorter ones take over where it finds nothing.
LEVELS: Final = (2, 4, 8, 16, 32)
_GAINS: Final = {2: 0.1, 4: 0.15, 8: 0.2, 16: 0.3, 32: 0.45}
_FALLBACK_GAIN: Final = 0.1

# Residual stream: dims 0-31 hold the constant, the BOS flag and the control-token flag; then
# code slots of CODE_DIM dims each.
_CONST_DIM, _BOS_DIM, _CONTROL_DIM = 0, 1, 2
_CONST: Final = 60.0  # dominates the norm, so RMSNorm is nearly a fixed scale
_CONTROL_FLAG: Final = 1.0
_BOS_FLAG: Final = math.sqrt(CODE_DIM - _CONTROL_FLAG**2)  # BOS (no code) has a token's norm
_CONTROL_BIAS: Final = -1.0  # the control dim's value from layer 0 on
_SLOT_NAMES: Final = ("E", "X", "A", "B", "C", "D")
_SLOT0: Final = 32

# Attention score scales (after llama's 1/sqrt(head_dim)): the peak of a previous-token head,
# an induction match (the sink scores half of it).
_POS_SCORE: Final = 200.0
_MATCH_SCORE: Final = 60.0
# Output: a copy on which every level agrees scores _COPY_LOGIT; control tokens lose
# _CONTROL_PENALTY logits.
_COPY_LOGIT: Final = 40.0
_CONTROL_PENALTY: Final = 8.0
# Filler layers: RMS of each block's output per residual dimension (the residual's is ~2.1).
_FILLER_GAIN: Final = 2e-3

CIRCUIT_LAYERS: Final = 11


def _slot(name: str) -> slice:
    start = _SLOT0 + _SLOT_NAMES.index(name) * CODE_DIM
    return slice(start, start + CODE_DIM)


def copying_problems(spec: ModelSpec) -> list[str]:
    """Why ``spec`` cannot carry the circuit (empty if it can)."""
    problems = []
    needed = _SLOT0 + len(_SLOT_NAMES) * CODE_DIM
    if spec.arch != "llama":
        problems.append("copying weights need the llama architecture")
        return problems
    if spec.head_dim != HEAD_DIM:
        problems.append(f"copying weights need head dimension {HEAD_DIM}")
    if spec.heads < 2:
        problems.append("copying weights need at least 2 query heads per layer")
    if spec.kv_heads != 1:
        problems.append("copying weights need one KV head (all query heads read the same K, V)")
    if spec.rope_freq_base != ROPE_FREQ_BASE:
        problems.append(f"copying weights need rope_freq_base {ROPE_FREQ_BASE:g}")
    if spec.hidden < needed:
        problems.append(f"copying weights need hidden >= {needed}")
    if spec.layers < CIRCUIT_LAYERS:
        problems.append(f"copying weights need at least {CIRCUIT_LAYERS} layers")
    if spec.ff < _FFN_UNITS_NEEDED:
        problems.append(f"copying weights need ff >= {_FFN_UNITS_NEEDED}")
    if not spec.tied_embeddings:
        problems.append("copying weights need tied embeddings (the output reads the token codes)")
    if spec.context_length > 32768:
        problems.append(
            "copying weights need context_length <= 32768 (what the position heads are solved for)"
        )
    return problems


# --- deterministic randomness (raw PCG64 bits only) -------------------------------------------


def _raw(seed: int, name: str, n: int) -> npt.NDArray[np.uint64]:
    bits = np.random.PCG64(np.random.SeedSequence([seed, zlib.crc32(name.encode())]))
    raw: npt.NDArray[np.uint64] = bits.random_raw(n)
    return raw


def _signs(seed: int, name: str, shape: tuple[int, ...]) -> F32:
    """+-1 values, one bit of the raw stream each (bit 63 of every draw)."""
    raw = _raw(seed, name, math.prod(shape))
    return np.where(raw >> np.uint64(63), np.float32(1.0), np.float32(-1.0)).astype(np.float32).reshape(shape)


def _derangement(seed: int, name: str, n: int) -> npt.NDArray[np.int64]:
    """A cyclic permutation of ``range(n)`` (Sattolo's algorithm): no fixed point."""
    raw = _raw(seed, name, n)
    perm = list(range(n))
    for i in range(n - 1, 0, -1):
        j = int(raw[i] % np.uint64(i))
        perm[i], perm[j] = perm[j], perm[i]
    return np.array(perm, dtype=np.int64)


def token_codes(seed: int, vocab_size: int) -> F32:
    return _signs(seed, "copying.codes", (vocab_size, CODE_DIM))


# --- the schedule -------------------------------------------------------------------------------


@dataclass(frozen=True)
class _Move:
    """A previous-token head: the code ``offset`` positions back, from V, into ``target``."""

    offset: int
    target: str


@dataclass(frozen=True)
class _Attn:
    value: str  # the slot V reads
    moves: tuple[_Move, ...] = ()
    induction: tuple[str, str, int] | None = None  # (query slot, key slot, level)


@dataclass(frozen=True)
class _Ffn:
    # (out, a, b, name): out = signs_name * a * P_name(b), element-wise
    products: tuple[tuple[str, str, str, str], ...] = ()
    erase: tuple[str, ...] = ()
    move_e_to_x: bool = False
    fallback_from: str | None = None
    control_bias: bool = False


_SCHEDULE: Final = (
    # 0: e_{i-1} -> A; h2 = e_i * P(e_{i-1}) -> B; the token code moves from E to X.
    (
        _Attn("E", (_Move(1, "A"),)),
        _Ffn((("B", "E", "A", "h2"),), ("A",), move_e_to_x=True, control_bias=True),
    ),
    # 1: K2 = h2_{i-1} -> A, h2_{i-2} -> C; h4 = h2 * P(h2_{i-2}) -> D; the fallback code into E.
    (_Attn("B", (_Move(1, "A"), _Move(2, "C"))), _Ffn((("D", "B", "C", "h4"),), ("C",), fallback_from="B")),
    # 2: induction on 2-grams (query h2, key K2, value the token code X) into E.
    (_Attn("X", induction=("B", "A", 2)), _Ffn(erase=("A", "B"))),
    # 3: K4 -> A, h4_{i-4} -> C; h8 -> B.
    (_Attn("D", (_Move(1, "A"), _Move(4, "C"))), _Ffn((("B", "D", "C", "h8"),), ("C",))),
    # 4: induction on 4-grams.
    (_Attn("X", induction=("D", "A", 4)), _Ffn(erase=("A", "D"))),
    # 5: K8 -> A, h8_{i-8} -> C; h16 -> D.
    (_Attn("B", (_Move(1, "A"), _Move(8, "C"))), _Ffn((("D", "B", "C", "h16"),), ("C",))),
    # 6: induction on 8-grams.
    (_Attn("X", induction=("B", "A", 8)), _Ffn(erase=("A", "B"))),
    # 7: K16 -> A, h16_{i-16} -> C; h32 -> B.
    (_Attn("D", (_Move(1, "A"), _Move(16, "C"))), _Ffn((("B", "D", "C", "h32"),), ("C",))),
    # 8: induction on 16-grams.
    (_Attn("X", induction=("D", "A", 16)), _Ffn(erase=("A", "D"))),
    # 9: K32 -> A.
    (_Attn("B", (_Move(1, "A"),)), _Ffn()),
    # 10: induction on 32-grams; afterwards only X (and the output in E) remain.
    (_Attn("X", induction=("B", "A", 32)), _Ffn(erase=("A", "B"))),
)
assert len(_SCHEDULE) == CIRCUIT_LAYERS


def _occupied() -> list[tuple[tuple[str, ...], tuple[str, ...]]]:
    """Per layer, the slots holding a code at the attention's and at the FFN's input (E's
    small output code excepted): what RMSNorm divides by."""
    held = {"E"}
    result = []
    for attn, ffn in _SCHEDULE:
        before_attn = tuple(sorted(held))
        held |= {move.target for move in attn.moves}
        before_ffn = tuple(sorted(held))
        if ffn.move_e_to_x:
            held = (held - {"E"}) | {"X"}
        held = (held | {out for out, *_ in ffn.products}) - set(ffn.erase)
        result.append((before_attn, before_ffn))
    return result


_OCCUPIED: Final = _occupied()


def _units_needed(ffn: _Ffn) -> int:
    """SwiGLU units of an FFN (as ``_ffn`` allocates them): 2 per coordinate of each product,
    erased slot, move and fallback, each group aligned to 32; 4 for the control dim."""
    groups = len(ffn.products) + len(ffn.erase) + int(ffn.move_e_to_x) + int(ffn.fallback_from is not None)
    return groups * -(-2 * CODE_DIM // 32) * 32 + 4 * int(ffn.control_bias)


_FFN_UNITS_NEEDED: Final = max(_units_needed(ffn) for _, ffn in _SCHEDULE)


def _norm_gain(spec: ModelSpec, slots: tuple[str, ...], control_bias: bool = True) -> float:
    """sqrt(hidden) / norm of the residual when ``slots`` hold codes: the factor RMSNorm
    multiplies it by (the small output slot is left out; ``control_bias``: the control dim
    holds its constant, from layer 0's FFN on)."""
    squared = _CONST**2 + CODE_DIM * len(slots) + (_CONTROL_BIAS**2 if control_bias else 0.0)
    return math.sqrt(spec.hidden / squared)


def _theta(pair: int) -> float:
    return float(ROPE_FREQ_BASE ** (-2.0 * pair / HEAD_DIM))


# --- tensors ------------------------------------------------------------------------------------


def copying_values(spec: ModelSpec, vocab: Vocabulary, name: str, shape: tuple[int, ...]) -> F32 | None:
    """The constructed value of tensor ``name``, or None for a filler-layer tensor that takes the
    random recipe (see :func:`filler_gain`)."""
    if name == "token_embd.weight":
        return _embedding(spec, vocab)
    if name == "output_norm.weight":
        return _output_norm(spec)
    layer_text, _, kind = name.removeprefix("blk.").partition(".")
    layer = int(layer_text)
    if layer >= CIRCUIT_LAYERS:
        return None
    if kind in ("attn_norm.weight", "ffn_norm.weight"):
        return np.ones(shape, dtype=np.float32)
    if kind.startswith("attn_"):
        return _layer_tensors(spec, layer, "attn")[kind]
    return _layer_tensors(spec, layer, "ffn")[kind]


@functools.lru_cache(maxsize=1)  # the writer asks for a sublayer's tensors one after another
def _layer_tensors(spec: ModelSpec, layer: int, sublayer: str) -> dict[str, F32]:
    attn, ffn = _SCHEDULE[layer]
    attn_slots, ffn_slots = _OCCUPIED[layer]
    first = layer == 0
    if sublayer == "attn":
        return _attention(spec, attn, _norm_gain(spec, attn_slots, not first))
    return _ffn(spec, ffn, _norm_gain(spec, ffn_slots, not first), layer)


def _embedding(spec: ModelSpec, vocab: Vocabulary) -> F32:
    out = np.zeros((spec.vocab_size, spec.hidden), dtype=np.float32)
    out[:, _CONST_DIM] = _CONST
    out[:, _slot("E")] = token_codes(spec.seed, spec.vocab_size)
    control = np.array([ty != TOKEN_TYPE_NORMAL for ty in vocab.token_types])
    out[control, _CONTROL_DIM] = _CONTROL_FLAG
    out[vocab.bos_id, _slot("E")] = 0.0  # BOS copies as nothing: the induction heads' sink
    out[vocab.bos_id, _BOS_DIM] = _BOS_FLAG
    return out


def _output_norm(spec: ModelSpec) -> F32:
    """The final RMSNorm weights: the logits read only the output slot and the control dim."""
    gain = math.sqrt(spec.hidden / (_CONST**2 + CODE_DIM + _CONTROL_BIAS**2))
    out = np.zeros(spec.hidden, dtype=np.float32)
    out[_slot("E")] = _COPY_LOGIT / (gain * CODE_DIM * sum(_GAINS.values()))
    out[_CONTROL_DIM] = _CONTROL_PENALTY / (_CONTROL_FLAG * -_CONTROL_BIAS * gain)
    return out


def _attention(spec: ModelSpec, attn: _Attn, n: float) -> dict[str, F32]:
    h, hd = spec.hidden, HEAD_DIM
    wq = np.zeros((spec.heads * hd, h), dtype=np.float32)
    wk = np.zeros((hd, h), dtype=np.float32)
    wv = np.zeros((hd, h), dtype=np.float32)
    wo = np.zeros((h, spec.heads * hd), dtype=np.float32)
    wv[:CODE_DIM, _slot(attn.value)] = np.eye(CODE_DIM) / n  # v = the raw code (+-1)
    scale = math.sqrt(hd)  # llama multiplies q.k by 1/sqrt(head_dim)
    if attn.induction is None:
        amplitude = math.sqrt(_POS_SCORE * scale)
        for p, w in enumerate(_POS_WEIGHTS):
            wk[2 * p, _CONST_DIM] = math.sqrt(w) * amplitude / (_CONST * n)
        for head, move in enumerate(attn.moves):
            for p, w in enumerate(_POS_WEIGHTS):
                phase = _theta(p) * move.offset
                row = head * hd + 2 * p
                wq[row, _CONST_DIM] = math.sqrt(w) * amplitude * math.cos(phase) / (_CONST * n)
                wq[row + 1, _CONST_DIM] = -math.sqrt(w) * amplitude * math.sin(phase) / (_CONST * n)
            wo[_slot(move.target), head * hd : head * hd + CODE_DIM] = np.eye(CODE_DIM)
    else:
        query, key, level = attn.induction
        first = 2 * _POS_PAIRS
        alpha = math.sqrt(_MATCH_SCORE * scale / CODE_DIM)
        wq[first : first + CODE_DIM, _slot(query)] = np.eye(CODE_DIM) * alpha / n
        wk[first : first + CODE_DIM, _slot(key)] = np.eye(CODE_DIM) * alpha / n
        sink = math.sqrt(_MATCH_SCORE / 2 * scale)
        wq[2 * _SINK_PAIR, _CONST_DIM] = sink / (_CONST * n)
        wk[2 * _SINK_PAIR, _BOS_DIM] = sink / (_BOS_FLAG * n)
        wo[_slot("E"), :CODE_DIM] = np.eye(CODE_DIM) * _GAINS[level]
    return {"attn_q.weight": wq, "attn_k.weight": wk, "attn_v.weight": wv, "attn_output.weight": wo}


class _Units:
    """SwiGLU units allocated in pairs; ``silu(z)*y + silu(-z)*(-y) = z*y`` exactly."""

    def __init__(self, spec: ModelSpec, n: float) -> None:
        self.gate = np.zeros((spec.ff, spec.hidden), dtype=np.float32)
        self.up = np.zeros((spec.ff, spec.hidden), dtype=np.float32)
        self.down = np.zeros((spec.hidden, spec.ff), dtype=np.float32)
        self.n = n
        self.next = 0

    def pair(self, gate_dim: int, gate_w: float, up_dim: int, up_w: float) -> int:
        """Two units whose summed output is ``(gate_w*x[gate_dim]) * (up_w*x[up_dim])`` in
        normalised units, times the down weight the caller puts in both columns."""
        u = self.next
        self.next += 2
        self.gate[u, gate_dim], self.gate[u + 1, gate_dim] = gate_w, -gate_w
        self.up[u, up_dim], self.up[u + 1, up_dim] = up_w, -up_w
        return u

    def write(self, u: int, out_dim: int, value: float) -> None:
        self.down[out_dim, u : u + 2] = value

    def linear(self, in_dim: int) -> tuple[int, float]:
        """Units whose output is ``x[in_dim]`` (raw) times the returned down weight's factor."""
        u = self.pair(in_dim, 1.0, _CONST_DIM, 1.0 / _CONST)
        return u, 1.0 / self.n**2

    def align(self) -> None:
        self.next = -(-self.next // 32) * 32  # keep groups in separate q8_0 blocks


def _ffn(spec: ModelSpec, ffn: _Ffn, n: float, layer: int) -> dict[str, F32]:
    units = _Units(spec, n)
    for out, a, b, level in ffn.products:
        perm = _derangement(spec.seed, f"copying.perm.{level}", CODE_DIM)
        signs = _signs(spec.seed, f"copying.signs.{level}", (CODE_DIM,))
        for k in range(CODE_DIM):
            u = units.pair(_slot(a).start + k, 1.0, _slot(b).start + int(perm[k]), 1.0)
            units.write(u, _slot(out).start + k, float(signs[k]) / n**2)
        units.align()
    for name in ffn.erase:
        for k in range(CODE_DIM):
            u, factor = units.linear(_slot(name).start + k)
            units.write(u, _slot(name).start + k, -factor)
        units.align()
    if ffn.move_e_to_x:
        for k in range(CODE_DIM):
            u, factor = units.linear(_slot("E").start + k)
            units.write(u, _slot("E").start + k, -factor)
            units.write(u, _slot("X").start + k, factor)
        units.align()
    if ffn.fallback_from is not None:
        perm = _derangement(spec.seed, "copying.perm.fallback", CODE_DIM)
        signs = _signs(spec.seed, "copying.signs.fallback", (CODE_DIM,))
        for k in range(CODE_DIM):
            u, factor = units.linear(_slot(ffn.fallback_from).start + int(perm[k]))
            units.write(u, _slot("E").start + k, float(signs[k]) * _FALLBACK_GAIN * factor)
        units.align()
    if ffn.control_bias:
        # x[control] := _CONTROL_BIAS: remove the input flag, add the constant.
        u, factor = units.linear(_CONTROL_DIM)
        units.write(u, _CONTROL_DIM, -factor)
        u = units.pair(_CONST_DIM, 1.0 / _CONST, _CONST_DIM, 1.0 / _CONST)
        units.write(u, _CONTROL_DIM, _CONTROL_BIAS / n**2)
    assert units.next == _units_needed(ffn) <= spec.ff, (layer, units.next)
    return {"ffn_gate.weight": units.gate, "ffn_up.weight": units.up, "ffn_down.weight": units.down}


def filler_gain() -> float:
    """RMS per residual dimension of a filler layer's attention and FFN output."""
    return _FILLER_GAIN
