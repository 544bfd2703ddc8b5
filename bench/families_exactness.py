"""``python -m bench.families_exactness``: is a warm turn what a fresh prefill computes?

Issue 30/31's KV-shift decision. On the turn after a template re-rendered an earlier turn (the
families' loop, ``bench/families.py``: turn 2, after a new instruction, where Qwen3, GLM, Kimi,
Gemma 4 and gpt-oss drop the earlier reasoning), llama-server with ``--cache-reuse 256`` keeps
the chunk after the divergence by shifting its KV cells to their new positions. Those cells were
computed attending to tokens that are gone, so the turn is not what a fresh prefill computes.
This measures by how much: the same request (greedy, ``logprobs`` with ``top_logprobs`` 5) to

- llama-server ``--cache-reuse 256`` after the earlier turns (warm, shifted),
- llama-server at its default (no ``--cache-reuse``) after the earlier turns (warm, exact prefix),
- modeld after the earlier turns (warm),

each against a fresh server of the same kind given only that request. Per pair: the tokens
computed, whether the greedy tokens agree, and the largest difference of a top-5 logprob at the
first generated position (set by the prefill alone) and over the positions where the tokens
still agree. Greedy on random weights: the logits are flat, so a small error flips tokens sooner
than on a trained model; the first position's logprob difference is the measure that carries over.
Tiny family models by default (seconds a family); ``--realistic`` the bench's model (minutes a
family). Not timed. ``--out bench/results/families/exactness.jsonl`` keeps the lines, and the
families' report shows them.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

from bench.families import MODEL, bodies
from bench.systems.llama_server import LlamaServerSystem
from bench.systems.modeld_http import ModeldHttpSystem
from bench.workloads import Workload

__all__ = ["compare_answers", "exactness"]

SHIFT_TURN = 2  # the turn after the first new instruction: the templates' re-render
FAMILIES = ("qwen3", "gemma4", "kimi-k2", "glm4.6")
ANSWER_TOKENS = 16

Body = dict[str, Any]


def _request(body: Body) -> Body:
    out = {k: v for k, v in body.items() if k not in ("stream", "stream_options")}
    return {**out, "model": MODEL, "stream": False, "logprobs": True, "top_logprobs": 5}


def _post(system: Any, body: Body) -> Body:
    r = system.http.post("/v1/chat/completions", json=_request(body))
    if r.status_code != 200:
        raise RuntimeError(f"{system.name}: HTTP {r.status_code}: {r.text[:300]}")
    answer: Body = r.json()
    return answer


def _positions(answer: Body) -> list[dict[str, float]]:
    """Per generated position: token -> logprob over the top 5 (the chosen token first)."""
    content = ((answer["choices"][0].get("logprobs") or {}).get("content")) or []
    return [
        {c["token"]: c["logprob"], **{t["token"]: t["logprob"] for t in c["top_logprobs"]}} for c in content
    ]


def _computed(answer: Body) -> int | None:
    timings = answer.get("timings") or {}
    if "prompt_n" in timings:
        return int(timings["prompt_n"])
    usage = answer.get("usage") or {}
    cached = (usage.get("prompt_tokens_details") or {}).get("cached_tokens") or 0
    return int(usage["prompt_tokens"]) - int(cached) if "prompt_tokens" in usage else None


def compare_answers(warm: Body, fresh: Body) -> dict[str, Any]:
    """Greedy tokens and top-5 logprobs of a warm answer against a fresh one."""
    a, b = _positions(warm), _positions(fresh)
    agree = 0
    for x, y in zip(a, b, strict=False):
        if next(iter(x)) != next(iter(y)):
            break
        agree += 1

    def gap(x: dict[str, float], y: dict[str, float]) -> float:
        shared = set(x) & set(y)
        return max((abs(x[t] - y[t]) for t in shared), default=float("inf"))

    return {
        "positions": min(len(a), len(b)),
        "tokens_agree": agree,
        "first_logprob_gap": gap(a[0], b[0]) if a and b else None,
        "max_logprob_gap": max((gap(x, y) for x, y in zip(a[:agree], b[:agree], strict=True)), default=None),
        "top5_same_at_first": bool(a and b and set(a[0]) == set(b[0])),
    }


def _pair(make: Callable[[], Any], requests: list[Body]) -> dict[str, Any]:
    warm = make()
    try:
        for body in requests[:-1]:
            _post(warm, body)
        warm_answer = _post(warm, requests[-1])
    finally:
        warm.close()
    fresh = make()
    try:
        fresh_answer = _post(fresh, requests[-1])
    finally:
        fresh.close()
    return {
        "computed_warm": _computed(warm_answer),
        "computed_fresh": _computed(fresh_answer),
        **compare_answers(warm_answer, fresh_answer),
    }


def exactness(name: str, llama_server: str, threads: int, realistic: bool) -> dict[str, Any]:
    from modeld import testmodels
    from modeld.testmodels.families import ensure_family_model

    path = str(ensure_family_model(name, base=testmodels.REALISTIC if realistic else None))
    requests = bodies(name, SHIFT_TURN + 1, ANSWER_TOKENS)
    load = Workload(f"exactness_{name}", name, "", "", [], n_ctx=8192, llama_server_flags=("--jinja",))
    return {
        "model": "realistic" if realistic else "reply",
        "family": name,
        "llama-server --cache-reuse 256": _pair(
            lambda: LlamaServerSystem(llama_server, path, load, threads, cache_reuse=256), requests
        ),
        "llama-server (default)": _pair(
            lambda: LlamaServerSystem(llama_server, path, load, threads, cache_reuse=0), requests
        ),
        "modeld": _pair(lambda: ModeldHttpSystem(path, load, threads), requests),
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m bench.families_exactness", description=__doc__.split("\n")[0]
    )
    parser.add_argument("--llama-server", required=True, help="the llama-server binary")
    parser.add_argument("--family", default=",".join(FAMILIES), help="comma-separated families")
    parser.add_argument(
        "--realistic", action="store_true", help="the bench's realistic model, not the tiny one"
    )
    parser.add_argument("--out", type=Path, help="append each family's line to this file (exactness.jsonl)")
    args = parser.parse_args(argv)
    threads = len(os.sched_getaffinity(0))
    for name in args.family.split(","):
        line = json.dumps(exactness(name, args.llama_server, threads, args.realistic))
        print(line, flush=True)
        if args.out:  # kept beside the families' runs: their report shows it (families_report)
            with args.out.open("a") as f:
                f.write(line + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
