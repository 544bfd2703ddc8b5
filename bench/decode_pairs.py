"""``python -m bench.decode_pairs``: decode speed through modeld's worker against direct llama-cpp-python, paired.

Issue 9's goal is decode tok/s through the worker / direct llama-cpp-python >= 0.97. The
workloads of ``make bench`` decode 32 tokens a turn, each system in its turn, so their decode
column moves by 5-12% between runs on this shared 2-core machine: wider than the 3% it should
resolve. This measures the ratio itself: the same ~1600-token prompt and 128 greedy tokens,
the limit (``bench.direct.Driver`` in this process) and ``modeld serve --backend llama`` over
gRPC (the engine in its worker, default flags: 50 ms stream interval) back to back, the order
swapped every pair, ``--pairs`` pairs. Both rates are taken the same way: tokens after the
first over the time from the first to the last (modeld's from the client's receive times).
``make bench`` runs it after the workloads (the report's "Decode through the worker, paired");
blueprint 0017 quotes it.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from collections.abc import Callable

import runtime_client as rc
from bench.daemon import serve
from bench.direct import Driver
from modeld.testmodels import REALISTIC, ensure_model

CONTEXT = 3072
WORDS = 400  # ~1600 tokens


def _prefix() -> str:
    return " ".join(f"word{i} line" for i in range(WORDS))


def _modeld_rate(session: rc.ClientSession, prefix: str, suffix: str, n: int) -> float:
    session.ensure_prefix(rc.PrefixInput(text=prefix))
    session.prefill_suffix(rc.SuffixInput(text=suffix))
    times: list[float] = []
    counts: list[int] = []
    with session.decode(rc.DecodeConfig(max_tokens=n)) as stream:
        for chunk in stream:
            if chunk.token_ids:
                times.append(time.perf_counter())
                counts.append(len(chunk.token_ids))
    if len(times) < 2 or sum(counts) < n:
        raise RuntimeError(f"modeld decoded {sum(counts)} of {n} tokens")
    return (sum(counts) - counts[0]) / (times[-1] - times[0])


def run_decode_pairs(
    pairs: int = 10, tokens: int = 128, log: Callable[[str], None] = print
) -> dict[str, float]:
    """The paired measurement (see the module docstring); the figures as a dict."""
    model = str(ensure_model(REALISTIC))
    prefix = _prefix()
    driver = Driver(model, CONTEXT, 512, 2)
    request = rc.OpenSessionRequest(
        type="llama", path=model, config=rc.Config(num_ctx=CONTEXT, num_batch=512)
    )
    limit: list[float] = []
    modeld: list[float] = []
    try:
        with serve("llama") as (client, _), client.open_session(request) as session:
            _modeld_rate(session, prefix, " warm up", 8)  # loads the model, computes the prefix
            driver.turn("a", prefix, " warm up", 8, False)
            for i in range(pairs):
                suffix = f" question {i}: what does line {i * 7} do?"
                first_modeld = i % 2 == 1
                if first_modeld:
                    modeld.append(_modeld_rate(session, prefix, suffix, tokens))
                out = driver.turn("a", prefix, suffix, tokens, False)
                if out["completion_tokens"] < tokens:
                    raise RuntimeError(f"the limit decoded {out['completion_tokens']} of {tokens} tokens")
                limit.append(out["decode_tps"])
                if not first_modeld:
                    modeld.append(_modeld_rate(session, prefix, suffix, tokens))
                log(f"  decode pair {i}: limit {limit[-1]:.1f} tok/s, modeld {modeld[-1]:.1f} tok/s")
    finally:
        driver.close()
    ratios = [m / lim for m, lim in zip(modeld, limit, strict=True)]
    return {
        "pairs": pairs,
        "tokens": tokens,
        "ratio_median": statistics.median(ratios),
        "ratio_min": min(ratios),
        "ratio_max": max(ratios),
        "limit_tps_median": statistics.median(limit),
        "modeld_tps_median": statistics.median(modeld),
    }


def describe(result: dict[str, float]) -> str:
    return (
        f"decode modeld / limit: median {result['ratio_median']:.3f} "
        f"(range {result['ratio_min']:.3f}-{result['ratio_max']:.3f}, {int(result['pairs'])} pairs of "
        f"{int(result['tokens'])} tokens); limit {result['limit_tps_median']:.1f} tok/s, "
        f"modeld {result['modeld_tps_median']:.1f} tok/s"
    )


def main() -> None:
    parser = argparse.ArgumentParser(prog="python -m bench.decode_pairs")
    parser.add_argument("--pairs", type=int, default=10)
    parser.add_argument("--tokens", type=int, default=128)
    parser.add_argument("--json", help="also write the figures to this file")
    args = parser.parse_args()
    result = run_decode_pairs(args.pairs, args.tokens)
    print(describe(result))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=2)


if __name__ == "__main__":
    main()
