"""The reference semantics of the extra sampling parameters: logit bias, presence and frequency
penalties, log-probabilities.

What: pure functions over ``{token: logit}`` dicts (the reference backend's shape) and the
same over NumPy arrays (llama.cpp's logits view), so every backend that lists these fields in
``Capabilities.sampling`` means the same thing by them (OpenAI's definitions):

* ``logit_bias``: added to the token's logit (-100..100; -100 in practice bans it);
* ``presence_penalty``: subtracted once from every token already generated in this decode;
* ``frequency_penalty``: subtracted once per earlier occurrence in this decode;
* ``logprobs``: the natural log of the chosen token's probability under the adjusted logits
  (temperature 1, before top-k/top-p/min-p), and the ``top_logprobs`` most likely tokens.

Order in a decode: constraint mask, then these adjustments, then the usual samplers.

What not: sampling itself (``memory.sample``, llama.cpp's chain), and no NumPy import unless the
array functions are used.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

from modeld.contract import TokenLogprob, TopLogprob

if TYPE_CHECKING:
    import numpy as np
    from numpy.typing import NDArray

__all__ = [
    "ChoiceToken",
    "SampledToken",
    "adjust",
    "adjust_array",
    "choice_seed",
    "logit_bias_of",
    "logprob",
    "logprob_array",
]


class SampledToken(int):
    """A sampled token id that carries its log-probabilities (``DecodeConfig.logprobs``).

    ``ModelRuntime.generate`` yields token ids; a runtime that computes log-probabilities
    yields these instead (still ints), and the worker's scheduler sends ``logprob`` along with
    the token (``Tokens.logprobs``)."""

    logprob: TokenLogprob

    def __new__(cls, token: int, logprob: TokenLogprob) -> SampledToken:
        self = super().__new__(cls, token)
        self.logprob = logprob
        return self


class ChoiceToken(int):
    """A sampled token id of one choice of a decode that forks into several (``DecodeConfig.n``):
    ``choice`` is its index, ``logprob`` its log-probabilities when asked for (else None)."""

    choice: int
    logprob: TokenLogprob | None

    def __new__(cls, token: int, choice: int, logprob: TokenLogprob | None = None) -> ChoiceToken:
        self = super().__new__(cls, token)
        self.choice = choice
        self.logprob = logprob
        return self


def choice_seed(seed: int | None, index: int) -> int | None:
    """Choice ``index``'s seed: a set seed moves by the index (choices differ, each is
    reproducible: choice ``i`` is what a one-choice request with ``seed + i`` gives); without
    a seed each choice draws its own."""
    if seed is None or index == 0:
        return seed
    return (seed + index) % (1 << 64)


def logit_bias_of(bias: Mapping[Any, float]) -> dict[int, float]:
    """``DecodeConfig.logit_bias`` with int keys (JSON object keys arrive as strings)."""
    return {int(k): float(v) for k, v in bias.items()}


def adjust(
    logits: Mapping[int, float],
    *,
    counts: Mapping[int, int],
    logit_bias: Mapping[int, float],
    presence_penalty: float,
    frequency_penalty: float,
) -> dict[int, float]:
    """The logits after bias and penalties (``counts``: how often each token came so far)."""
    out = dict(logits)
    for token, value in out.items():
        n = counts.get(token, 0)
        if n:
            value -= presence_penalty + frequency_penalty * n
        out[token] = value + logit_bias.get(token, 0.0)
    return out


def logprob(logits: Mapping[int, float], chosen: int, top: int) -> TokenLogprob:
    """Log-probability of ``chosen`` under softmax(logits), and the ``top`` best alternatives."""
    finite = {t: v for t, v in logits.items() if v != -math.inf}
    peak = max(finite.values())
    norm = peak + math.log(sum(math.exp(v - peak) for v in finite.values()))
    best = sorted(finite.items(), key=lambda kv: (-kv[1], kv[0]))[:top]
    value = logits.get(chosen, -math.inf)
    return TokenLogprob(chosen, value - norm, tuple(TopLogprob(t, v - norm) for t, v in best))


def adjust_array(
    logits: NDArray[np.float32],
    *,
    counts: Mapping[int, int],
    logit_bias: Mapping[int, float],
    presence_penalty: float,
    frequency_penalty: float,
) -> None:
    """:func:`adjust` in place on a vocabulary-sized array."""
    for token, n in counts.items():
        if n:
            logits[token] -= presence_penalty + frequency_penalty * n
    for token, bias in logit_bias.items():
        if 0 <= token < logits.shape[0]:
            logits[token] += bias


def logprob_array(logits: NDArray[Any], chosen: int, top: int) -> TokenLogprob:
    """:func:`logprob` on a vocabulary-sized array (-inf entries are masked tokens)."""
    import numpy as np

    values = logits.astype(np.float64)
    peak = float(np.max(values))
    norm = peak + math.log(float(np.sum(np.exp(values - peak))))
    best: list[TopLogprob] = []
    if top:
        idx = np.argpartition(-values, min(top, values.shape[0] - 1))[:top]
        ranked = sorted(((int(i), float(values[i])) for i in idx), key=lambda kv: (-kv[1], kv[0]))
        best = [TopLogprob(t, v - norm) for t, v in ranked if v != -math.inf]
    return TokenLogprob(chosen, float(values[chosen]) - norm, tuple(best))
