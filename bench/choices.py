"""``n`` > 1 choices: decoded together (the prompt's KV forked into ``n`` sequences, one batch
per step) against the same choices decoded one after another, in the same daemon and run.

``python -m bench.choices [--model realistic|tiny] [--n 4] [--rounds 7] [--max-tokens 64]``
runs ``modeld serve --http --backend llama`` on a generated model and, per round, in alternating
order: one request with ``n`` choices (batched: ``timings.choices.batched`` is checked), and the
``n`` one-choice requests with ``seed + i`` on the same warm conversation (what the daemon's own
sequential path does: each reuses the warm prompt and decodes one choice). Where the texts
differ (the rounding of a batch of several sequences moved a draw: blueprint 0019) the report
lists the choice and the character. Reports each side's wall time (median, min-max) and the paired
ratio sequential / batched (median, min-max). Blueprint 0019 keeps the figures.
"""

from __future__ import annotations

import argparse
import json
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import httpx

from modeld.lease import read_lease
from modeld.testmodels import REALISTIC, TINY, ensure_model

_PROMPT = (
    "You are a careful reviewer of a Python code base. Read the change below and list what could "
    "break, one point per line.\n"
    + "".join(f"def handler_{i}(request):\n    return render(request, {i})\n" for i in range(40))
)


def _serve(data: Path, model: Path) -> tuple[subprocess.Popen[str], str]:
    proc = subprocess.Popen(
        [
            str(Path(sys.executable).parent / "modeld"),
            "--data-dir",
            str(data),
            "serve",
            "--backend",
            "llama",
            "--listen",
            f"unix:{data / 's.sock'}",
            "--http",
            "127.0.0.1:0",
            "--model",
            f"bench={model}",
            "--speculation",
            "off",
        ],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=True,
    )
    deadline = time.monotonic() + 300
    while time.monotonic() < deadline:
        record = read_lease(data)
        if record is not None and record.state == "serving" and record.http_endpoint:
            return proc, record.http_endpoint
        if proc.poll() is not None:
            raise RuntimeError(f"modeld serve exited: {proc.stderr.read() if proc.stderr else ''}")
        time.sleep(0.1)
    proc.terminate()
    raise RuntimeError("modeld serve did not start")


def _ask(url: str, n: int, seed: int, max_tokens: int, temperature: float = 0.8) -> dict[str, Any]:
    reply = httpx.post(
        f"{url}/v1/chat/completions",
        json={
            "model": "bench",
            "messages": [{"role": "user", "content": _PROMPT}],
            "n": n,
            "seed": seed,
            "temperature": temperature,
            "max_tokens": max_tokens,
        },
        headers={"X-Modeld-Conversation": "bench-choices"},
        timeout=600,
    )
    reply.raise_for_status()
    data: dict[str, Any] = reply.json()
    return data


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--model", choices=("realistic", "tiny"), default="realistic")
    parser.add_argument("--n", type=int, default=4)
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--temperature", type=float, default=0.8)
    args = parser.parse_args()
    if args.temperature <= 0:
        parser.error("--temperature must be above 0 (greedy choices are decoded once)")
    model = ensure_model(REALISTIC if args.model == "realistic" else TINY)
    data = Path(tempfile.mkdtemp(prefix="mdbc"))
    proc, url = _serve(data, model)
    batched: list[float] = []
    sequential: list[float] = []
    differ: list[str] = []
    prompt_tokens = 0
    try:
        prompt_tokens = _ask(url, 1, 1, 4)["usage"]["prompt_tokens"]  # load the model, warm the prompt
        for r in range(args.rounds):
            seed = 1000 + 10 * r

            def together(seed: int = seed) -> list[str]:
                started = time.perf_counter()
                answer = _ask(url, args.n, seed, args.max_tokens, args.temperature)
                batched.append(time.perf_counter() - started)
                if answer["timings"]["choices"]["decoded"] != "together":
                    raise RuntimeError(f"not decoded together: {answer['timings']['choices']}")
                return [c["message"]["content"] for c in answer["choices"]]

            def one_by_one(seed: int = seed) -> list[str]:
                started = time.perf_counter()
                texts = [
                    _ask(url, 1, seed + i, args.max_tokens, args.temperature)["choices"][0]["message"][
                        "content"
                    ]
                    for i in range(args.n)
                ]
                sequential.append(time.perf_counter() - started)
                return texts

            first, second = (together, one_by_one) if r % 2 == 0 else (one_by_one, together)
            a, b = first(), second()
            for i, (x, y) in enumerate(zip(a, b, strict=True)):
                if x != y:
                    at = next(
                        (k for k, (p, q) in enumerate(zip(x, y, strict=False)) if p != q), min(len(x), len(y))
                    )
                    differ.append(f"round {r} choice {i}: from character {at} of {len(x)}")
    finally:
        proc.terminate()
        proc.wait(timeout=60)
        shutil.rmtree(data, ignore_errors=True)
    ratios = [s / b for s, b in zip(sequential, batched, strict=True)]

    def line(values: list[float]) -> dict[str, float]:
        return {
            "median": round(statistics.median(values), 3),
            "min": round(min(values), 3),
            "max": round(max(values), 3),
        }

    print(
        json.dumps(
            {
                "model": args.model,
                "n": args.n,
                "max_tokens": args.max_tokens,
                "temperature": args.temperature,
                "prompt_tokens": prompt_tokens,
                "rounds": args.rounds,
                "batched_s": line(batched),
                "sequential_s": line(sequential),
                "sequential_over_batched": line(ratios),
                "choices_differing": differ,
            },
            indent=2,
        )
    )


if __name__ == "__main__":
    main()
