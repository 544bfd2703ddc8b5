"""The samplers a decode can switch on: one table, read by the backends, validation and the APIs.

Each row (:class:`Sampler`) names a :class:`~modeld.contract.DecodeConfig` field, its default
(``DecodeConfig``'s: the sampler is off), the OpenAI request field that carries it (``""`` for a
modeld extension OpenAI lacks: an HTTP client sends it under its own name) and its range. A
backend lists the samplers it honours in ``Capabilities.sampling`` (:data:`SAMPLER_NAMES`, or
fewer); validation (``modeld/engine/validate.py``) checks every value with :meth:`Sampler.check`
and refuses, by name, a sampler switched on that the backend does not list.

| name | OpenAI name | range |
|---|---|---|
| temperature | temperature | 0..100 (OpenAI's own: 0..2) |
| top_p | top_p | (0, 1] |
| top_k | (extension) | 0..2^30 (0: off) |
| min_p | (extension) | 0..1 |
| seed | seed | 0..2^64-1, or unset (random) |
| repeat_penalty | (extension) | (0, 100] (1: off) |
| logit_bias | logit_bias | token 0..2^31-1 -> bias -100..100, at most 1024 entries |
| presence_penalty | presence_penalty | -2..2 |
| frequency_penalty | frequency_penalty | -2..2 |
| logprobs | logprobs | true or false |
| top_logprobs | top_logprobs | 0..20 (needs logprobs) |

What each means: ``modeld/decoding/sampling.py`` (the reference semantics) and llama.cpp's
sampler chain.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass

from modeld.contract import DecodeConfig
from modeld.errors import InvalidArgumentError, LimitExceededError

__all__ = [
    "MAX_LOGIT_BIAS_ENTRIES",
    "SAMPLERS",
    "SAMPLER_NAMES",
    "Sampler",
    "check_float",
    "check_int",
    "sampler",
]

MAX_LOGIT_BIAS_ENTRIES = 1024

_DEFAULTS = DecodeConfig()


def check_int(value: object, field: str, lo: int, hi: int) -> int:
    """``value`` as an integer in ``[lo, hi]``, or ``invalid_argument`` naming ``field``."""
    if isinstance(value, bool) or not isinstance(value, int):
        raise InvalidArgumentError(f"{field} must be an integer", field=field)
    if not lo <= value <= hi:
        raise InvalidArgumentError(f"{field} must be between {lo} and {hi}, got {value}", field=field)
    return value


def check_float(value: object, field: str, lo: float, hi: float, *, lo_open: bool = False) -> float:
    """``value`` as a number in ``[lo, hi]`` (``(lo, hi]`` when ``lo_open``; never NaN)."""
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise InvalidArgumentError(f"{field} must be a number", field=field)
    v = float(value)
    if math.isnan(v) or v > hi or v < lo or (lo_open and v == lo):
        bracket = "(" if lo_open else "["
        raise InvalidArgumentError(f"{field} must be in {bracket}{lo}, {hi}], got {value}", field=field)
    return v


@dataclass(frozen=True, slots=True)
class Sampler:
    """One sampler: ``name`` (the DecodeConfig field), ``openai`` (the OpenAI request field, ""
    for an extension), ``kind`` (``float``, ``int``, ``bool``, or ``token_map``: logit_bias, whose
    range is each bias's) and its range ``low``..``high`` (``low_open``: ``low`` excluded)."""

    name: str
    openai: str
    kind: str
    low: float = 0.0
    high: float = 0.0
    low_open: bool = False
    optional: bool = False
    """Unset (None) is allowed: the seed, random when unset."""

    @property
    def default(self) -> object:
        """``DecodeConfig``'s default: the sampler is off."""
        return getattr(_DEFAULTS, self.name)

    def is_on(self, config: DecodeConfig) -> bool:
        return bool(getattr(config, self.name) != self.default)

    def check(self, value: object) -> None:
        """Raise ``invalid_argument`` (or ``limit_exceeded``) for a value out of this range."""
        name = self.name
        if value is None and self.optional:
            return
        if self.kind == "bool":
            if not isinstance(value, bool):
                raise InvalidArgumentError(f"{name} must be a boolean", field=name)
        elif self.kind == "int":
            check_int(value, name, int(self.low), int(self.high))
        elif self.kind == "float":
            check_float(value, name, self.low, self.high, lo_open=self.low_open)
        else:
            self._check_bias(value)

    def _check_bias(self, value: object) -> None:
        if not isinstance(value, Mapping):
            raise InvalidArgumentError(f"{self.name} must map token ids to numbers", field=self.name)
        if len(value) > MAX_LOGIT_BIAS_ENTRIES:
            raise LimitExceededError(
                f"{len(value)} logit_bias entries; the limit is {MAX_LOGIT_BIAS_ENTRIES}",
                limit="max_logit_bias_entries",
                value=len(value),
                maximum=MAX_LOGIT_BIAS_ENTRIES,
            )
        for token, bias in value.items():
            check_int(token, "logit_bias token", 0, (1 << 31) - 1)
            check_float(bias, f"logit_bias[{token}]", self.low, self.high)


SAMPLERS: tuple[Sampler, ...] = (
    Sampler("temperature", "temperature", "float", 0.0, 100.0),
    Sampler("top_p", "top_p", "float", 0.0, 1.0, low_open=True),
    Sampler("top_k", "", "int", 0, 1 << 30),
    Sampler("min_p", "", "float", 0.0, 1.0),
    Sampler("seed", "seed", "int", 0, (1 << 64) - 1, optional=True),
    Sampler("repeat_penalty", "", "float", 0.0, 100.0, low_open=True),
    Sampler("logit_bias", "logit_bias", "token_map", -100.0, 100.0),
    Sampler("presence_penalty", "presence_penalty", "float", -2.0, 2.0),
    Sampler("frequency_penalty", "frequency_penalty", "float", -2.0, 2.0),
    Sampler("logprobs", "logprobs", "bool"),
    Sampler("top_logprobs", "top_logprobs", "int", 0, 20),
)
"""Every sampler, in the order validation checks them."""

SAMPLER_NAMES: tuple[str, ...] = tuple(s.name for s in SAMPLERS)
"""What a backend that honours every sampler lists in ``Capabilities.sampling``."""

_BY_NAME = {s.name: s for s in SAMPLERS}


def sampler(name: str) -> Sampler:
    """The row of ``name`` (a DecodeConfig field); ``KeyError`` for anything else."""
    return _BY_NAME[name]
