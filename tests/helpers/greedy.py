"""A session's greedy answer with each token's log-probability: what the exactness tests compare
(warm against a fresh evaluation, token for token and logprob for logprob).

One token per step, speculation off: a verify batch rounds differently (blueprint 0021), and a
warm turn is compared with a fresh one, not with speculation."""

from __future__ import annotations

from typing import Any

from modeld.contract import DecodeConfig


def greedy_logprobs(session: Any, n: int, **config: Any) -> list[tuple[int, float]]:
    """``n`` greedy tokens of ``session``'s decode, each with its log-probability (``config``:
    further ``DecodeConfig`` fields, e.g. ``tool_choice``)."""
    out: list[tuple[int, float]] = []
    settings = DecodeConfig(max_tokens=n, logprobs=True, speculation="off", **config)
    with session.decode(settings) as stream:
        for chunk in stream:
            out += [(t, lp.logprob) for t, lp in zip(chunk.token_ids, chunk.logprobs, strict=True)]
    return out
