"""Constructed weights for TOOLS: a model that runs a coding agent's tool loop.

What: :func:`tools_values` returns every tensor of a small llama-architecture model that, in a
chat with tools (the test template's Hermes format, ``<tool_call>`` JSON):

* answers a user turn with one call reading a file: the file's name is copied from the user
  turn, where it follows the words ``file "`` (``Read the file "calc.py"``). The call is
  Claude Code's ``Read {"file_path": NAME}`` or, when the tools offered include Codex's
  ``exec_command``, ``exec_command {"cmd": "cat NAME"}``; it ends the turn;
* answers a tool result (the prompt ends with ``</tool_response>``) with :data:`ANSWER` and ends
  the turn.

Why: the agents' tool loops (the tool runs, its result comes back, the next turn is warm, the
session compacts) can only be tested end to end with a model that really calls a tool and then
stops; a random model does neither, REPLY never calls.

How (the residual stream is cut into named dimensions, :class:`_Layout`; every weight is
written out, nothing is trained or random):

* a constant dimension (60) dominates the norm, so RMSNorm is a nearly fixed scale; a few dozen
  *marked* tokens (those the chains, flags and signatures use) have one dimension each, and
  every token has a random sign code of :data:`CODE_DIM` dimensions (what the copy moves);
* layer 0's attention has *position heads* (as COPYING's: query and key from the constant, RoPE
  pairs 0-7 in phase at the wanted offset) that bring the marked dimensions of the tokens 1, 2
  and 3 back, and 10 and 11 back (where ``>`` and ``_response`` of ``</tool_response>`` sit
  when the generation prompt follows a tool result);
* its FFN computes AND gates (a pair of SwiGLU units gives a step from 0 to 1 as the sum of
  its inputs crosses a threshold): the FLAG before a file name (``file "`` in a user turn,
  ``file_path":"`` or ``cat `` in a call) and the signature of ``exec_command``;
* layer 1's attention: eight position heads read FLAG 1-8 tokens back (DIST_d: "the flag was d
  tokens ago"), and one content head attends to any ``exec_command`` signature in the context
  (CODEX, with a sink at BOS when there is none); its FFN holds the chains: one AND gate per
  step, keyed on the last three or four tokens (and CODEX, or the copy state), writing the
  next token's dimension;
* layer 2's attention copies: its query is "distance d + 1" where the current token is at
  distance d from a flag, its keys are every position's distance, its values the token codes:
  each step copies the next token of the name after every flag in the context (they vote);
* the output matrix reads the chain's dimensions (:data:`CHAIN_LOGIT`), the copied code
  (:data:`COPY_LOGIT`) and a fallback that closes the name (:data:`FALLBACK_LOGIT`, when
  nothing is copied).

Generated tokens are the canonical tokenization of the call (as REPLY's chain), so a call sent
back in the history tokenizes to the tokens the model generated and the next turn stays warm;
the one exception is Codex's ``cat NAME``, whose space is generated on its own token (the name
is copied token by token from the user turn, where it follows a quote).

What not: a name of more than :data:`MAX_NAME_TOKENS` tokens is cut; when several user turns
name different files after ``file "``, the copy votes between them (a test uses one file per
conversation); nothing here understands language. Measurements: ``blueprints/0008``.
"""

from __future__ import annotations

import functools
import math
import zlib
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Final

import numpy as np
import numpy.typing as npt

from modeld.testmodels._copying import ModelSpec  # what the constructions read of a spec
from modeld.testmodels._tokenizer import TOKEN_TYPE_NORMAL, Vocabulary, encode

__all__ = [
    "ANSWER",
    "FILE_CUE",
    "HEAD_DIM",
    "MAX_NAME_TOKENS",
    "ROPE_FREQ_BASE",
    "TOOLS_VERSION",
    "tools_problems",
    "tools_values",
]

F32 = npt.NDArray[np.float32]


# Bump whenever the bytes written for an unchanged tools spec could change (enters its digest).
TOOLS_VERSION: Final = 1

ANSWER: Final = "Done."
"""What the model answers a tool result with (then it ends the turn)."""
FILE_CUE: Final = ' file "'
"""The words that precede a file's name in a user turn: ``Read the file "calc.py"``."""
_CLAUDE_CALL: Final = '<tool_call>\n{"name":"Read","arguments":{"file_path":"'
_CODEX_CALL: Final = '<tool_call>\n{"name":"exec_command","arguments":{"cmd":"cat'
_CALL_END: Final = '"}}\n</tool_call>'
_CODEX_TOOL: Final = "exec_command"

# Position heads as COPYING's, at head width 32: with base 10^9.5 the pairs 0-7 turn at exactly
# COPYING's rates (10^9.5 ** (-2p/32) == 1e38 ** (-2p/128)), so its position weights hold (the
# score at the wanted offset beats every other distance up to 32768 by >= 0.147 of the peak).
HEAD_DIM: Final = 32
ROPE_FREQ_BASE: Final = 10**9.5
_POS_WEIGHTS: Final = (0.32, 0.13, 0.13, 0.08, 0.09, 0.11, 0.06, 0.08)
_POS_SCORE: Final = 200.0
# Content pairs of the content heads: pairs 10-15 turn by < 0.04 rad over 32k tokens.
_DIST_PAIR: Final = 10  # the copy head's keys: dims 20-27 (one per distance)
_SIGNATURE_PAIR: Final = 14
_SINK_PAIR: Final = 15
_COPY_SCORE: Final = 40.0  # a distance that matches (the sink scores half)
_SIGNATURE_SCORE: Final = 60.0

CODE_DIM: Final = 2 * HEAD_DIM  # copied by two heads, half each
MAX_NAME_TOKENS: Final = 7
_DISTS: Final = MAX_NAME_TOKENS + 1  # the name, then its closing quote
_CONST: Final = 60.0
_BOS_FLAG: Final = math.sqrt(CODE_DIM)  # BOS has no code: the same norm as any token
_STEP: Final = 40.0  # the AND gates' slope (silu(+-10) is 10 or -5e-4)

CHAIN_LOGIT: Final = 60.0
COPY_LOGIT: Final = 30.0
FALLBACK_LOGIT: Final = 10.0

_LAYERS: Final = 3
_CONTEXT: Final = 3  # tokens a chain step is keyed on (more where three do not decide)


# --- the chains ---------------------------------------------------------------------------------


@dataclass(frozen=True)
class _Step:
    """One chain step: when the last tokens are ``context`` (and ``when`` holds), write ``next``."""

    context: tuple[int, ...]
    next: int
    when: str = ""  # "" always, "claude" (no exec_command), "codex", "copying" (a name was copied)


@dataclass(frozen=True)
class _Chains:
    steps: tuple[_Step, ...]
    marked: tuple[int, ...]  # tokens with a dimension of their own
    prompt_end: tuple[int, ...]  # the generation prompt's last tokens
    answer: tuple[int, ...]
    flags: tuple[tuple[int, ...], ...]  # token sequences whose last token is a FLAG
    signature: tuple[int, ...]  # exec_command's last three tokens
    result_end: tuple[int, int]  # "_response", ">": 11 and 10 tokens before the prompt's end
    quote: int  # the name's closing quote (the fallback)


@functools.lru_cache(maxsize=4)
def chains(vocab: Vocabulary) -> _Chains:
    """The token chains of the calls and the answer, each step keyed on as few tokens as decide
    it (at least :data:`_CONTEXT`, fewer only at the start of the call's closing)."""
    prompt_end = tuple(encode(vocab, "assistant\n"))
    claude = tuple(encode(vocab, _CLAUDE_CALL))
    codex = (*encode(vocab, _CODEX_CALL), encode(vocab, " ")[0])
    end = (*encode(vocab, _CALL_END), vocab.eos_id)
    answer = (*encode(vocab, ANSWER), vocab.eos_id)
    # (history, next, when): next None where the copy starts (no step may fire there)
    raw: list[tuple[tuple[int, ...], int | None, str]] = []
    for call, when in ((claude, "claude"), (codex, "codex")):
        seq = prompt_end + call
        for k in range(len(prompt_end) - 1, len(seq)):
            raw.append((seq[: k + 1], seq[k + 1] if k + 1 < len(seq) else None, when))
    for k in range(len(end) - 1):
        raw.append((end[: k + 1], end[k + 1], "copying" if k == 0 else ""))
    seq = prompt_end + answer
    for k in range(len(prompt_end), len(seq) - 1):
        raw.append((seq[: k + 1], seq[k + 1], ""))
    found: dict[tuple[tuple[int, ...], str], int] = {}
    for history, nxt, when in raw:
        n = min(_CONTEXT, len(history))
        while n < len(history) and _clashes(history[-n:], nxt, when, raw):
            n += 1
        if _clashes(history[-n:], nxt, when, raw):
            raise AssertionError(f"chain step {history[-n:]} -> {nxt} is ambiguous")
        if nxt is not None:
            found[(history[-n:], when)] = nxt
    steps = []
    for (context, when), nxt in found.items():
        other = {"claude": "codex", "codex": "claude"}.get(when)
        if other is not None and found.get((context, other)) == nxt:  # both calls: one step
            if when == "claude":
                steps.append(_Step(context, nxt))
            continue
        steps.append(_Step(context, nxt, when))
    user_flag = tuple(encode(vocab, FILE_CUE))
    flags = (user_flag[-2:], claude[-3:], codex[-3:])
    signature = tuple(encode(vocab, _CODEX_TOOL))
    signature = signature[signature.index(encode(vocab, "_c")[0]) - 1 :][:3]
    tail = encode(vocab, "</tool_response>")
    marked = sorted(
        {t for s in steps for t in (*s.context, s.next)}
        | {t for f in flags for t in f}
        | set(signature)
        | {tail[-2], tail[-1], end[0]}
    )
    return _Chains(
        tuple(steps), tuple(marked), prompt_end, answer, flags, signature, (tail[-2], tail[-1]), end[0]
    )


def _clashes(
    context: tuple[int, ...],
    nxt: int | None,
    when: str,
    raw: Sequence[tuple[tuple[int, ...], int | None, str]],
) -> bool:
    """Whether another step with ``context`` as its last tokens wants another next token under a
    condition that can hold at the same time: the two calls exclude each other, and the step that
    closes a copied name (its context is the closing quote alone) fires only after a flag."""
    for history, other, other_when in raw:
        if other == nxt or len(history) < len(context) or history[-len(context) :] != context:
            continue
        if {when, other_when} == {"claude", "codex"} or "copying" in (when, other_when):
            continue
        return True
    return False


# --- the residual stream ------------------------------------------------------------------------


@dataclass
class _Layout:
    """Named dimensions of the residual stream; a block of marked tokens has one dimension per
    token it holds."""

    hidden: int
    dims: dict[str, int] = field(default_factory=dict)
    blocks: dict[str, tuple[int, ...]] = field(default_factory=dict)
    top: int = 0

    def add(self, name: str, n: int = 1) -> int:
        start = self.top
        self.dims[name] = start
        self.top += n
        return start

    def block(self, name: str, tokens: Sequence[int]) -> None:
        self.blocks[name] = tuple(sorted(set(tokens)))
        self.add(name, len(self.blocks[name]))

    def __getitem__(self, name: str) -> int:
        return self.dims[name]

    def mark(self, block: str, token: int) -> int:
        return self.dims[block] + self.blocks[block].index(token)


_SCALARS: Final = (
    "FLAG",
    "SIG",
    "CODEX",
    "R10",
    "R11",
    "FALLBACK",
    *(f"DIST{d}" for d in range(1, _DISTS + 1)),
)
_BACK: Final = ("E", "P1", "P2", "P3")  # the token, 1, 2 and 3 back


def _keyed(vocab: Vocabulary) -> list[tuple[int, ...]]:
    """Every token sequence a gate is keyed on (last token first)."""
    ch = chains(vocab)
    return [tuple(reversed(s.context)) for s in ch.steps] + [
        tuple(reversed(f)) for f in (*ch.flags, ch.signature)
    ]


@functools.lru_cache(maxsize=4)
def _layout(vocab: Vocabulary) -> _Layout:
    ch = chains(vocab)
    keyed = _keyed(vocab)
    lay = _Layout(0)
    for name in ("CONST", "BOS"):
        lay.add(name)
    for back, block in enumerate(_BACK):
        lay.block(
            block, [k[back] for k in keyed if len(k) > back] + (list(ch.marked) if block == "E" else [])
        )
    lay.block("NEXT", [s.next for s in ch.steps] + [ch.answer[0]])
    for name in _SCALARS:
        lay.add(name)
    lay.add("CODE", CODE_DIM)
    lay.add("COPY", CODE_DIM)
    lay.hidden = lay.top
    return lay


def _norm(spec: ModelSpec, extra: float = 0.0) -> float:
    """sqrt(hidden) / the residual's norm: RMSNorm's factor (a token's code, ``extra`` more)."""
    return math.sqrt(spec.hidden / (_CONST**2 + CODE_DIM + extra))


def tools_problems(spec: ModelSpec) -> list[str]:
    """Why ``spec`` cannot carry the construction (empty if it can)."""
    problems = []
    if spec.arch != "llama":
        return ["tools weights need the llama architecture"]
    if spec.head_dim != HEAD_DIM:
        problems.append(f"tools weights need head dimension {HEAD_DIM}")
    if spec.rope_freq_base != ROPE_FREQ_BASE:
        problems.append(f"tools weights need rope_freq_base {ROPE_FREQ_BASE:g}")
    if spec.kv_heads < 5 or spec.heads != 2 * spec.kv_heads:
        problems.append("tools weights need 5 or more KV heads of 2 query heads each")
    if spec.layers != _LAYERS:
        problems.append(f"tools weights need {_LAYERS} layers")
    if spec.tied_embeddings:
        problems.append("tools weights need an output matrix of their own")
    if spec.vocab_size == 4096 and spec.seed == 0:
        from modeld.testmodels._tokenizer import build_vocabulary

        needed = _layout(build_vocabulary(spec.vocab_size, spec.seed)).hidden
        if spec.hidden < needed:
            problems.append(f"tools weights need hidden >= {needed}")
    if spec.context_length > 32768:
        problems.append("tools weights need context_length <= 32768 (the position heads' range)")
    return problems


# --- tensors ------------------------------------------------------------------------------------


def _codes(seed: int, vocab_size: int) -> F32:
    bits = np.random.PCG64(np.random.SeedSequence([seed, zlib.crc32(b"tools.codes")]))
    raw = bits.random_raw(vocab_size * CODE_DIM)
    return (
        np.where(raw >> np.uint64(63), np.float32(1.0), np.float32(-1.0))
        .astype(np.float32)
        .reshape(vocab_size, CODE_DIM)
    )


def tools_values(spec: ModelSpec, vocab: Vocabulary, name: str, shape: tuple[int, ...]) -> F32:
    """The constructed value of tensor ``name``."""
    if _layout(vocab).hidden > spec.hidden:
        raise ValueError(f"the tools model needs hidden >= {_layout(vocab).hidden}")
    if name == "token_embd.weight":
        return _embedding(spec, vocab)
    if name == "output_norm.weight":
        lay = _layout(vocab)
        out = np.zeros(shape, dtype=np.float32)
        out[lay["NEXT"] : lay["NEXT"] + len(lay.blocks["NEXT"])] = 1.0
        out[lay["FALLBACK"]] = 1.0
        out[lay["COPY"] : lay["COPY"] + CODE_DIM] = 1.0
        return out
    if name == "output.weight":
        return _output(spec, vocab)
    layer_text, _, kind = name.removeprefix("blk.").partition(".")
    if kind in ("attn_norm.weight", "ffn_norm.weight"):
        return np.ones(shape, dtype=np.float32)
    tensors = (
        _attention(spec, vocab, int(layer_text))
        if kind.startswith("attn_")
        else _ffn(spec, vocab, int(layer_text))
    )
    return tensors[kind]


def _embedding(spec: ModelSpec, vocab: Vocabulary) -> F32:
    lay = _layout(vocab)
    out = np.zeros((spec.vocab_size, spec.hidden), dtype=np.float32)
    out[:, lay["CONST"]] = _CONST
    out[:, lay["CODE"] : lay["CODE"] + CODE_DIM] = _codes(spec.seed, spec.vocab_size)
    out[vocab.bos_id, lay["CODE"] : lay["CODE"] + CODE_DIM] = 0.0
    out[vocab.bos_id, lay["BOS"]] = _BOS_FLAG
    for t in lay.blocks["E"]:
        out[t, lay.mark("E", t)] = 1.0
    return out


def _output(spec: ModelSpec, vocab: Vocabulary) -> F32:
    lay = _layout(vocab)
    n = _norm(spec, CODE_DIM / 2)  # the copied code adds up to CODE_DIM to the norm
    out = np.zeros((spec.vocab_size, spec.hidden), dtype=np.float32)
    for t in lay.blocks["NEXT"]:
        out[t, lay.mark("NEXT", t)] = CHAIN_LOGIT / n
    normal = np.array([ty == TOKEN_TYPE_NORMAL for ty in vocab.token_types])
    codes = _codes(spec.seed, spec.vocab_size)
    out[normal, lay["COPY"] : lay["COPY"] + CODE_DIM] = codes[normal] * np.float32(
        COPY_LOGIT / (CODE_DIM * n)
    )
    out[chains(vocab).quote, lay["FALLBACK"]] = FALLBACK_LOGIT / n
    return out


def _theta(pair: int) -> float:
    return float(ROPE_FREQ_BASE ** (-2.0 * pair / HEAD_DIM))


class _Attn:
    """One layer's attention weights, filled head by head."""

    def __init__(self, spec: ModelSpec, n: float) -> None:
        h, hd = spec.hidden, HEAD_DIM
        self.q = np.zeros((spec.heads * hd, h), dtype=np.float32)
        self.k = np.zeros((spec.kv_heads * hd, h), dtype=np.float32)
        self.v = np.zeros((spec.kv_heads * hd, h), dtype=np.float32)
        self.o = np.zeros((h, spec.heads * hd), dtype=np.float32)
        self.n = n
        self.group = spec.heads // spec.kv_heads

    def positional(self, kv: int) -> None:
        """KV head ``kv``'s key: the constant in pairs 0-7 (what a position head's query turns)."""
        amplitude = math.sqrt(_POS_SCORE * math.sqrt(HEAD_DIM))
        for p, w in enumerate(_POS_WEIGHTS):
            self.k[kv * HEAD_DIM + 2 * p, 0] = math.sqrt(w) * amplitude / (_CONST * self.n)

    def offset(self, head: int, offset: int) -> None:
        """Head ``head`` attends to the token ``offset`` positions back."""
        amplitude = math.sqrt(_POS_SCORE * math.sqrt(HEAD_DIM))
        for p, w in enumerate(_POS_WEIGHTS):
            phase = _theta(p) * offset
            row = head * HEAD_DIM + 2 * p
            self.q[row, 0] = math.sqrt(w) * amplitude * math.cos(phase) / (_CONST * self.n)
            self.q[row + 1, 0] = -math.sqrt(w) * amplitude * math.sin(phase) / (_CONST * self.n)

    def value(self, kv: int, slot: int, source: int) -> None:
        """Value dimension ``slot`` of KV head ``kv`` is residual dimension ``source`` (raw)."""
        self.v[kv * HEAD_DIM + slot, source] = 1.0 / self.n

    def write(self, head: int, slot: int, target: int) -> None:
        self.o[target, head * HEAD_DIM + slot] = 1.0

    def kv_of(self, head: int) -> int:
        return head // self.group

    def tensors(self) -> dict[str, F32]:
        return {
            "attn_q.weight": self.q,
            "attn_k.weight": self.k,
            "attn_v.weight": self.v,
            "attn_output.weight": self.o,
        }


@functools.lru_cache(maxsize=2)
def _attention(spec: ModelSpec, vocab: Vocabulary, layer: int) -> dict[str, F32]:
    lay = _layout(vocab)
    ch = chains(vocab)
    if layer == 0:
        attn = _Attn(spec, _norm(spec))
        # The marked tokens 1, 2 and 3 back, ">" 10 back and "_response" 11 back. A KV head's
        # value holds at most HEAD_DIM tokens and serves two query heads: pack the moves.
        moves: list[tuple[int, tuple[int, ...], str]] = [
            (back, lay.blocks[f"P{back}"], f"P{back}") for back in (1, 2, 3)
        ]
        moves += [(10, (ch.result_end[1],), "R10"), (11, (ch.result_end[0],), "R11")]
        chunks = [
            (offset, tokens[i : i + HEAD_DIM], target)
            for offset, tokens, target in moves
            for i in range(0, len(tokens), HEAD_DIM)
        ]
        kv_tokens: list[list[int]] = []  # per KV head: its value's tokens
        kv_heads: list[int] = []  # per KV head: query heads used
        for offset, tokens, target in sorted(chunks, key=lambda c: -len(c[1])):
            kv = next(
                (
                    i
                    for i, held in enumerate(kv_tokens)
                    if kv_heads[i] < attn.group and len(set(held) | set(tokens)) <= HEAD_DIM
                ),
                None,
            )
            if kv is None:
                kv = len(kv_tokens)
                kv_tokens.append([])
                kv_heads.append(0)
            held = kv_tokens[kv]
            held += [t for t in tokens if t not in held]
            head = kv * attn.group + kv_heads[kv]
            kv_heads[kv] += 1
            attn.offset(head, offset)
            for t in tokens:
                dim = lay[target] if target.startswith("R") else lay.mark(target, t)
                attn.write(head, held.index(t), dim)
        if len(kv_tokens) > spec.kv_heads:
            raise ValueError(f"the tools model needs {len(kv_tokens)} KV heads")
        for kv, held in enumerate(kv_tokens):
            attn.positional(kv)
            for slot, t in enumerate(held):
                attn.value(kv, slot, lay.mark("E", t))
        return attn.tensors()
    if layer == 1:
        attn = _Attn(spec, _norm(spec, 4.0))
        # heads 0-7: FLAG 1-8 tokens back; head 8: any exec_command signature (sink at BOS)
        for d in range(1, _DISTS + 1):
            head = d - 1
            kv = attn.kv_of(head)
            attn.positional(kv)
            attn.value(kv, 0, lay["FLAG"])
            attn.offset(head, d)
            attn.write(head, 0, lay[f"DIST{d}"])
        head = _DISTS
        kv = attn.kv_of(head)
        alpha = math.sqrt(_SIGNATURE_SCORE * math.sqrt(HEAD_DIM))
        sink = math.sqrt(_SIGNATURE_SCORE / 2 * math.sqrt(HEAD_DIM))
        attn.q[head * HEAD_DIM + 2 * _SIGNATURE_PAIR, lay["CONST"]] = alpha / (_CONST * attn.n)
        attn.k[kv * HEAD_DIM + 2 * _SIGNATURE_PAIR, lay["SIG"]] = alpha / attn.n
        attn.q[head * HEAD_DIM + 2 * _SINK_PAIR, lay["CONST"]] = sink / (_CONST * attn.n)
        attn.k[kv * HEAD_DIM + 2 * _SINK_PAIR, lay["BOS"]] = sink / (_BOS_FLAG * attn.n)
        # value 1 at every token but BOS (which has the constant and the BOS flag)
        attn.v[kv * HEAD_DIM, lay["CONST"]] = 1.0 / (_CONST * attn.n)
        attn.v[kv * HEAD_DIM, lay["BOS"]] = -1.0 / (_BOS_FLAG * attn.n)
        attn.write(head, 0, lay["CODEX"])
        return attn.tensors()
    attn = _Attn(spec, _norm(spec, 4.0))
    # heads 0 and 2 (KV heads 0 and 1): the copy, half of the code each
    alpha = math.sqrt(_COPY_SCORE * math.sqrt(HEAD_DIM))
    sink = math.sqrt(_COPY_SCORE / 2 * math.sqrt(HEAD_DIM))
    # The token at distance d wants the one at d + 1, up to the name's last (MAX_NAME_TOKENS);
    # beyond it nothing is copied and the fallback closes the name.
    wants = ["FLAG", *(f"DIST{d}" for d in range(1, MAX_NAME_TOKENS))]
    for half, head in enumerate((0, 2)):
        kv = attn.kv_of(head)
        for d in range(1, MAX_NAME_TOKENS + 1):
            attn.k[kv * HEAD_DIM + 2 * _DIST_PAIR + d - 1, lay[f"DIST{d}"]] = alpha / attn.n
            attn.q[head * HEAD_DIM + 2 * _DIST_PAIR + d - 1, lay[wants[d - 1]]] = alpha / attn.n
        attn.q[head * HEAD_DIM + 2 * _SINK_PAIR, lay["CONST"]] = sink / (_CONST * attn.n)
        attn.k[kv * HEAD_DIM + 2 * _SINK_PAIR, lay["BOS"]] = sink / (_BOS_FLAG * attn.n)
        for i in range(HEAD_DIM):
            attn.value(kv, i, lay["CODE"] + half * HEAD_DIM + i)
            attn.write(head, i, lay["COPY"] + half * HEAD_DIM + i)
    return attn.tensors()


class _Gates:
    """AND gates of SwiGLU unit pairs: ``[silu(s(x - m + 0.75)) - silu(s(x - m + 0.25))] * 2/s``
    is 0 below ``m - 1`` and 1 from ``m`` on, where ``x`` is the weighted sum of the inputs
    (raw residual values: 1 for a marked token, a flag ...)."""

    def __init__(self, spec: ModelSpec, n: float) -> None:
        self.gate = np.zeros((spec.ff, spec.hidden), dtype=np.float32)
        self.up = np.zeros((spec.ff, spec.hidden), dtype=np.float32)
        self.down = np.zeros((spec.hidden, spec.ff), dtype=np.float32)
        self.n = n
        self.next = 0

    def add(self, inputs: Sequence[tuple[int, float]], needed: float, target: int, gain: float = 1.0) -> None:
        if self.next + 2 > self.gate.shape[0]:
            raise ValueError(f"the tools model needs ff > {self.gate.shape[0]}")
        for u, edge in ((self.next, needed - 0.75), (self.next + 1, needed - 0.25)):
            for dim, w in inputs:
                self.gate[u, dim] += _STEP * w / self.n
            self.gate[u, 0] = -_STEP * edge / (_CONST * self.n)
            self.up[u, 0] = 2.0 / (_STEP * _CONST * self.n)
        self.down[target, self.next] = gain
        self.down[target, self.next + 1] = -gain
        self.next += 2

    def tensors(self) -> dict[str, F32]:
        return {"ffn_gate.weight": self.gate, "ffn_up.weight": self.up, "ffn_down.weight": self.down}


@functools.lru_cache(maxsize=2)
def _ffn(spec: ModelSpec, vocab: Vocabulary, layer: int) -> dict[str, F32]:
    lay = _layout(vocab)
    ch = chains(vocab)
    blocks = _BACK
    if layer == 0:
        gates = _Gates(spec, _norm(spec, 4.0))
        for flag in ch.flags:
            inputs = [(lay.mark(blocks[i], t), 1.0) for i, t in enumerate(reversed(flag))]
            gates.add(inputs, len(inputs), lay["FLAG"])
        inputs = [(lay.mark(blocks[i], t), 1.0) for i, t in enumerate(reversed(ch.signature))]
        gates.add(inputs, len(inputs), lay["SIG"])
        return gates.tensors()
    if layer == 1:
        gates = _Gates(spec, _norm(spec, 4.0))
        dists = [(lay[f"DIST{d}"], 1.0) for d in range(1, _DISTS + 1)]
        for step in ch.steps:
            inputs = [(lay.mark(blocks[i], t), 1.0) for i, t in enumerate(reversed(step.context))]
            needed = float(len(inputs))
            if step.when == "codex":
                inputs.append((lay["CODEX"], 1.0))
                needed += 1
            elif step.when == "claude":
                inputs.append((lay["CODEX"], -1.0))
            elif step.when == "copying":
                inputs += dists
                needed += 1
            gates.add(inputs, needed, lay.mark("NEXT", step.next))
        # after a tool result the answer, not a call: twice the call's first token
        end = ch.prompt_end[-3:]
        inputs = [(lay.mark(blocks[i], t), 1.0) for i, t in enumerate(reversed(end))]
        inputs += [(lay["R10"], 1.0), (lay["R11"], 1.0)]
        gates.add(inputs, len(inputs), lay.mark("NEXT", ch.answer[0]), gain=2.0)
        # the fallback: at a flag or in a name, close the name when nothing is copied
        gates.add([(lay["FLAG"], 1.0), *dists[:MAX_NAME_TOKENS]], 1.0, lay["FALLBACK"])
        return gates.tensors()
    return _Gates(spec, 1.0).tensors()
