"""Constrained decoding on llama.cpp: a token mask from llguidance, or llama.cpp's grammar sampler.

What: :class:`LlamaConstraints` (one per loaded model) turns a
:class:`~modeld.decoding.constraints.CompiledConstraint` into a per-decode
:class:`TokenConstraint` that masks the logits in the llama context's own buffer (disallowed
tokens get ``-inf``) before the usual choice: the ``argmax`` fast path when greedy, or the
llama.cpp sampler chain otherwise, unchanged. After a token is chosen, ``accept`` advances the
constraint. Without a constraint nothing here runs and the greedy path stays a bare ``argmax``.

Why llguidance (measured, ``blueprints/0018-constraints-and-tool-calls.md``): on the realistic
32k-vocabulary model, a typical tool-call schema costs about 0.03 ms per token with llguidance's
mask (Rust, computed from the same GBNF) against 6-9 ms per token for llama.cpp's grammar
sampler, which checks every candidate token against the grammar in turn (decode itself is about
18 ms per token on this machine). The llama.cpp grammar sampler is the fallback when the
``llguidance`` package is missing or cannot take a grammar: :func:`grammar_sampler`.

What not: no decode loop (the backend owns it), no text handling. The llguidance tokenizer is
built once per model (0.1-0.4 s for 32k tokens) on the first constrained decode.

How the backend uses it (``generate``)::

    tc = constraints.start(compiled) if compiled is not None else None
    while True:
        if tc is not None:
            tc.apply(logits_view)          # raises ConstraintFailed when no token is allowed
        token = argmax or llama_sampler_sample(chain, ctx, -1)
        if tc is not None:
            tc.accept(token)               # raises ConstraintFailed if it was not allowed
        yield token
"""

from __future__ import annotations

import ctypes
import logging
import threading
from collections import OrderedDict
from typing import Any

import numpy as np
from numpy.typing import NDArray

from modeld.backends._llama_lib import bindings as _llama
from modeld.decoding.constraints import CompiledConstraint, ConstraintFailed
from modeld.decoding.formats import MARKERS
from modeld.errors import UnsupportedError

__all__ = [
    "GrammarSamplerConstraint",
    "LlamaConstraints",
    "LlguidanceConstraint",
    "TokenConstraint",
    "grammar_sampler",
]

log = logging.getLogger("modeld.llama")


class TokenConstraint:
    """The per-decode state of a constraint over one model's tokens."""

    def apply(self, logits: NDArray[np.float32]) -> None:
        """Set the logits of tokens that may not come next to ``-inf`` (in place)."""
        raise NotImplementedError

    def accept(self, token: int) -> None:
        """Advance past the chosen token."""
        raise NotImplementedError

    def forced(self, limit: int) -> list[int]:
        """The tokens that must come next, at most ``limit``, consumed (the constraint advances
        past them): while exactly one token is allowed, it is the only choice plain decoding
        could make there, whatever the logits. ``[]`` where the engine cannot tell cheaply."""
        return []

    def valid_prefix(self, tokens: list[int]) -> int:
        """How many of ``tokens`` (a draft) the constraint would accept in order, without
        advancing; ``len(tokens)`` where the engine cannot tell cheaply."""
        return len(tokens)

    def close(self) -> None:
        """Free native state (idempotent)."""


class LlguidanceConstraint(TokenConstraint):
    """A llguidance matcher: bit mask -> ``-inf`` on the logits, then consume the token."""

    def __init__(self, matcher: Any, n_vocab: int) -> None:
        self._matcher = matcher
        self._n_vocab = n_vocab
        self._mask = np.full(((n_vocab + 31) // 32,), -1, dtype=np.int32)
        self._computed = False  # the mask is the current state's (nothing consumed since)

    def _compute(self) -> NDArray[np.int32]:
        if not self._computed:
            m = self._matcher
            m.unsafe_compute_mask_ptr(self._mask.ctypes.data, self._mask.nbytes)
            if m.is_error():
                raise ConstraintFailed(m.get_error())
            self._computed = True
        return self._mask

    def apply(self, logits: NDArray[np.float32]) -> None:
        mask = self._compute()
        bits = np.unpackbits(mask.view(np.uint8), bitorder="little")[: self._n_vocab]
        if not bits.any():
            raise ConstraintFailed("no token can continue the constrained output")
        logits[: self._n_vocab][bits == 0] = -np.inf

    def accept(self, token: int) -> None:
        self._computed = False
        if not self._matcher.consume_token(token):
            raise ConstraintFailed(self._matcher.get_error() or f"token {token} is not allowed here")

    def forced(self, limit: int) -> list[int]:
        out: list[int] = []
        while len(out) < limit:
            mask = self._compute()
            words = np.flatnonzero(mask)
            if len(words) != 1:
                break
            word = int(mask[words[0]]) & 0xFFFFFFFF
            if word & (word - 1):  # more than one bit in the word
                break
            token = int(words[0]) * 32 + word.bit_length() - 1
            if token >= self._n_vocab:
                break
            self.accept(token)
            out.append(token)
        return out

    def valid_prefix(self, tokens: list[int]) -> int:
        return int(self._matcher.validate_tokens(tokens)) if tokens else 0


class GrammarSamplerConstraint(TokenConstraint):
    """llama.cpp's grammar sampler applied to the whole candidate array (the slow fallback).

    llama.cpp's grammar decodes bytes 0xF8-0xFF as if they started a 4-byte character and so
    lets tokens made of them through (seen on TINY: a "valid" JSON string holding byte 0xF8);
    tokens containing a byte that never occurs in UTF-8 (0xC0, 0xC1, 0xF5-0xFF) are therefore
    masked out first (``banned``).
    """

    def __init__(self, sampler: Any, n_vocab: int, banned: NDArray[np.bool_] | None = None) -> None:
        self._sampler = sampler
        self._n_vocab = n_vocab
        self._banned = banned
        self._data = (_llama.llama_token_data * n_vocab)()
        view = np.ctypeslib.as_array(self._data)
        view["id"] = np.arange(n_vocab, dtype=np.int32)
        self._view = view

    def apply(self, logits: NDArray[np.float32]) -> None:
        view = self._view
        view["logit"] = logits[: self._n_vocab]
        if self._banned is not None:
            view["logit"][self._banned] = -np.inf
        view["p"] = 0.0
        array = _llama.llama_token_data_array(self._data, self._n_vocab, -1, False)
        _llama.llama_sampler_apply(self._sampler, ctypes.byref(array))
        if array.size != self._n_vocab or array.data is None:  # pragma: no cover - grammar keeps the array
            raise ConstraintFailed("the grammar sampler changed the candidate array")
        masked = view["logit"]
        if not np.isfinite(masked).any():
            raise ConstraintFailed("no token can continue the constrained output")
        logits[: self._n_vocab] = masked

    def accept(self, token: int) -> None:
        _llama.llama_sampler_accept(self._sampler, token)

    def close(self) -> None:
        if self._sampler is not None:
            _llama.llama_sampler_free(self._sampler)
            self._sampler = None


def grammar_sampler(vocab: Any, compiled: CompiledConstraint) -> Any:
    """``llama_sampler_init_grammar`` for the compiled GBNF (the caller frees it, or adds it to a
    chain before the temperature/dist samplers, which then owns it)."""
    sampler = _llama.llama_sampler_init_grammar(vocab, compiled.gbnf.encode("utf-8"), b"root")
    if not sampler:
        raise UnsupportedError(
            "llama.cpp's grammar parser refused this constraint (see the daemon log)", field="constraint"
        )
    return sampler


class LlamaConstraints:
    """Per loaded model: makes :class:`TokenConstraint` objects for its vocabulary.

    ``engine``: ``"llguidance"`` (default when installed) or ``"grammar"`` (llama.cpp's sampler).
    """

    def __init__(self, vocab: Any, n_vocab: int, *, engine: str = "auto") -> None:
        self._vocab = vocab
        self._n_vocab = n_vocab
        self._lock = threading.Lock()
        self._tokenizer: Any = None
        self._banned: NDArray[np.bool_] | None = None
        self._templates: OrderedDict[str, Any] = OrderedDict()
        self._llg: Any = None
        if engine not in ("auto", "llguidance", "grammar"):
            raise ValueError(f"unknown constraint engine {engine!r}")
        if engine != "grammar":
            try:
                import llguidance
            except ImportError:
                if engine == "llguidance":
                    raise
                log.warning(
                    "the llguidance package is missing: constraints use llama.cpp's slower grammar sampler"
                )
                engine = "grammar"
            else:
                self._llg = llguidance
                engine = "llguidance"
        self.engine = engine

    def _lltokenizer(self) -> Any:
        """llguidance's view of the vocabulary: every token's bytes, control tokens marked with a
        leading 0xFF (so no grammar text can produce them: an end-of-generation token inside a
        JSON string would end the decode), llama.cpp's tokenizer for its own use. The tool-call
        families' markers (``decoding.formats.MARKERS``) are left unmarked unless they end
        generation: a forcing grammar's ``<tool_call>`` is then the model's own token, not
        ``<``, ``tool``, ``_call``, ``>`` (which the next turn's history, tokenized from text,
        would not reuse). (``llguidance.llamacpp`` does the rest the same way through a
        deprecated llama.cpp call.)"""
        with self._lock:
            if self._tokenizer is None:
                tokens: list[bytes] = []
                buf = ctypes.create_string_buffer(256)
                control = _llama.LLAMA_TOKEN_ATTR_CONTROL
                user = _llama.LLAMA_TOKEN_ATTR_USER_DEFINED
                for token in range(self._n_vocab):
                    n = _llama.llama_token_to_piece(self._vocab, token, buf, len(buf), 0, True)
                    if n < 0:
                        big = ctypes.create_string_buffer(-n)
                        n = _llama.llama_token_to_piece(self._vocab, token, big, len(big), 0, True)
                        piece = big.raw[:n]
                    else:
                        piece = buf.raw[:n]
                    attr = _llama.llama_vocab_get_attr(self._vocab, token)
                    special = attr & control or (
                        attr & user and piece.startswith(b"<") and piece.endswith(b">")
                    )
                    if special and not (
                        piece in _MARKERS and not _llama.llama_vocab_is_eog(self._vocab, token)
                    ):
                        piece = b"\xff" + piece
                    tokens.append(piece)
                tokenize = ctypes.cast(_llama._lib.llama_tokenize, ctypes.c_void_p).value
                self._tokenizer = self._llg.LLTokenizer.from_llamacpp(
                    tokens=tokens,
                    vocab_ptr=self._vocab,
                    tokenize_fptr=tokenize,
                    eos_token=_llama.llama_vocab_eos(self._vocab),
                    slices=None,
                )
            return self._tokenizer

    def start(self, compiled: CompiledConstraint) -> TokenConstraint:
        """A fresh constraint state for one decode (cheap: the grammar is compiled and cached)."""
        if self.engine == "llguidance":
            llg = self._llg
            grammar = _lark_cache.get(compiled.digest)
            if grammar is None:
                try:
                    grammar = llg.grammar_from("gbnf", compiled.gbnf)
                except ValueError as exc:
                    log.warning(
                        "llguidance cannot take constraint %s (%s); using llama.cpp's grammar",
                        compiled.digest,
                        exc,
                    )
                    grammar = ""
                _lark_cache[compiled.digest] = grammar
            if grammar:
                template = self._template(compiled.digest, grammar)
                if not template.is_error():
                    return LlguidanceConstraint(template.deep_copy(), self._n_vocab)
                log.warning("llguidance refused constraint %s: %s", compiled.digest, template.get_error())
        return GrammarSamplerConstraint(
            grammar_sampler(self._vocab, compiled), self._n_vocab, self._non_utf8()
        )

    def _template(self, digest: str, grammar: str) -> Any:
        """A fresh matcher per constraint, kept per model; each decode takes a deep copy (about
        1 us, against 1-5 ms to build a matcher)."""
        with self._lock:
            template = self._templates.get(digest)
            if template is not None:
                self._templates.move_to_end(digest)
                return template
        template = self._llg.LLMatcher(self._lltokenizer(), grammar, log_level=0)
        with self._lock:
            self._templates[digest] = template
            while len(self._templates) > _TEMPLATES_KEPT:
                self._templates.popitem(last=False)
        return template

    def _non_utf8(self) -> NDArray[np.bool_]:
        """Tokens whose bytes contain one that never occurs in UTF-8 (computed once)."""
        with self._lock:
            if self._banned is None:
                banned = np.zeros(self._n_vocab, dtype=bool)
                buf = ctypes.create_string_buffer(256)
                for token in range(self._n_vocab):
                    n = _llama.llama_token_to_piece(self._vocab, token, buf, len(buf), 0, False)
                    piece = buf.raw[: max(0, n)]
                    banned[token] = any(b in _NEVER_UTF8 for b in piece)
                self._banned = banned
            return self._banned


_TEMPLATES_KEPT = 64
_MARKERS = frozenset(m.encode("utf-8") for m in MARKERS)
_NEVER_UTF8 = frozenset({0xC0, 0xC1, *range(0xF5, 0x100)})

_lark_cache: dict[str, str] = {}
"""Constraint digest -> llguidance grammar text (cheap to keep: one entry per distinct schema)."""
