"""How a llama.cpp decode chooses a token from a logits row (engine-worker side).

A constrained decode masks the logits in the context's own buffer (llguidance's token mask over
the compiled GBNF, :mod:`modeld.backends.llama_constraints`), then ``logit_bias`` and
presence/frequency penalties are applied there (``modeld.decoding.sampling``), then the usual
choice reads the buffer: the bare ``argmax`` when greedy (unchanged without a constraint), else
llama.cpp's sampler chain (:func:`sampler_chain`). Plain decoding, every verified position of a
speculative step and every choice of an ``n``-choice decode (:mod:`modeld.backends.llama_runtime`)
choose through one :class:`Step` each. Design record: ``blueprints/0018``.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from modeld.backends._llama_lib import bindings as _llama
from modeld.backends.llama_constraints import TokenConstraint
from modeld.contract import DecodeConfig, TokenLogprob, TopLogprob
from modeld.decoding.sampling import SampledToken, adjust_array, logit_bias_of, logprob_array

__all__ = ["PENALTY_LAST_N", "Step", "sampler_chain"]

PENALTY_LAST_N = 64
"""The tokens llama.cpp's repeat penalty looks back over."""


def sampler_chain(n_vocab: int, config: DecodeConfig, held: list[int]) -> Any:
    """A llama.cpp sampler chain, or None for plain greedy decoding (argmax of the logits)."""
    if config.temperature <= 0 and config.repeat_penalty == 1.0:
        return None
    chain = _llama.llama_sampler_chain_init(_llama.llama_sampler_chain_default_params())
    if config.repeat_penalty != 1.0:
        _llama.llama_sampler_chain_add(
            chain,
            _llama.llama_sampler_init_penalties(n_vocab, PENALTY_LAST_N, config.repeat_penalty, 0.0, 0.0),
        )
        for token in held[-PENALTY_LAST_N:]:
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


class Step:
    """One decode's choice of a token from a logits row: the constraint's mask, logit bias and
    penalties (in the context's own buffer, so the sampler chain reads the result too), then the
    bare ``argmax`` when greedy, else the sampler chain (its random draw, its penalty window).
    Plain decoding and every verified position of a speculative step choose through here."""

    def __init__(self, ctx: Any, vocab: Any, n_vocab: int, config: DecodeConfig, held: list[int]) -> None:
        self._ctx = ctx
        self._vocab = vocab
        self._n_vocab = n_vocab
        self._config = config
        self.tc: TokenConstraint | None = None
        self._sampler = sampler_chain(n_vocab, config, held)
        self._bias = logit_bias_of(config.logit_bias)
        self._penalties = bool(config.presence_penalty or config.frequency_penalty)
        self._counts: dict[int, int] = {}
        self._logprob: TokenLogprob | None = None

    @property
    def adjusted(self) -> bool:
        """The logits buffer was masked or adjusted in place."""
        return self.tc is not None or bool(self._bias) or self._penalties

    def choose(self, row: int) -> int:
        """The token at batch index ``row`` (-1: the last evaluated)."""
        config = self._config
        logits = None
        if self.adjusted or config.logprobs or self._sampler is None:
            logits = np.ctypeslib.as_array(
                _llama.llama_get_logits_ith(self._ctx, row), shape=(self._n_vocab,)
            )
            if self.tc is not None:
                self.tc.apply(logits)
            if self._bias or self._penalties:
                adjust_array(
                    logits,
                    counts=self._counts,
                    logit_bias=self._bias,
                    presence_penalty=config.presence_penalty,
                    frequency_penalty=config.frequency_penalty,
                )
        if self._sampler is None:
            assert logits is not None
            token = int(np.argmax(logits))
        else:
            token = int(_llama.llama_sampler_sample(self._sampler, self._ctx, row))
        if self.tc is not None:
            self.tc.accept(token)
        self._counts[token] = self._counts.get(token, 0) + 1
        self._logprob = (
            logprob_array(logits, token, config.top_logprobs)
            if config.logprobs and logits is not None
            else None
        )
        return token

    def forced(self, limit: int) -> list[int]:
        """Tokens the constraint forces next (consumed), counted as chosen ones are. Each had
        probability 1 for plain decoding: its log-probability is 0 and it is its own only
        alternative. (The sampler's random draw is not spent on them, so a seeded sampled
        decode may continue differently from a plain one; its distribution is the same.)"""
        if self.tc is None:
            return []
        tokens = self.tc.forced(limit)
        for token in tokens:
            self._counts[token] = self._counts.get(token, 0) + 1
            if self._sampler is not None:
                _llama.llama_sampler_accept(self._sampler, token)  # its penalty window
        return tokens

    def out(self, token: int, *, forced: bool = False) -> int:
        """The token as the scheduler wants it: with its log-probabilities when asked for."""
        if not self._config.logprobs:
            return token
        if forced:
            top = (TopLogprob(token, 0.0),) if self._config.top_logprobs else ()
            return SampledToken(token, TokenLogprob(token, 0.0, top))
        return SampledToken(token, self._logprob) if self._logprob is not None else token

    def eog(self, token: int) -> bool:
        return bool(_llama.llama_vocab_is_eog(self._vocab, token))

    def close(self) -> None:
        if self._sampler is not None:
            _llama.llama_sampler_free(self._sampler)
            self._sampler = None
        if self.tc is not None:
            self.tc.close()
