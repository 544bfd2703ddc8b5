"""What the request records and an open live page cost a warm turn (issue 35: at most 1% of its
TTFT), on one daemon.

The coding loop of ``bench/openai_overhead.py`` (a ~9 KB system prompt and repo map, a growing
chat, 32 streamed tokens a turn) over plain HTTP, in blocks of ``turns`` turns, each block a new
conversation (its first turn cold, the rest warm). Blocks alternate between the page closed and
two pages open and refreshing: two clients reading ``/ui/events`` (the state pushed as records
change, at most every 0.5 s, and at least every 2 s), as the page's script does. The order is
swapped every round. ``state_ms``: a fresh ``/ui/state`` fetched after the blocks (the whole
state built on the observers' pool, and its JSON), median of 10. ``page_cost`` is the median warm TTFT with the
page open over the median with it closed, minus one.

Recording is always on (every turn is a record), so its own cost is measured apart, in process:
``recording_us`` is what a turn's record costs before its first token (opening it, handing it
to the session, the prefix's and the suffix's counts, the stage changes), the median of 2000
turns, and ``recording_cost`` that over the closed blocks' median warm TTFT.

``python -m bench.page_overhead [--backend memory|llama] [--turns N] [--rounds N]``.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import statistics
import sys
import threading
import time
from collections.abc import Iterator
from typing import Any

import httpx

from bench.daemon import serve
from bench.openai_overhead import _conversation

__all__ = ["page_lines", "run_page_overhead"]


def _warm_ttfts(url: str, model: str, conversation: list[list[dict[str, str]]], key: str) -> list[float]:
    """Each turn's TTFT (s) of one conversation; the first (cold) left out."""
    out = []
    with httpx.Client(base_url=url, timeout=120) as client:
        for messages in conversation:
            body = {"model": model, "messages": messages, "max_tokens": 32, "temperature": 0, "stream": True}
            t0 = time.perf_counter()
            first = 0.0
            with client.stream(
                "POST", "/v1/chat/completions", json=body, headers={"X-Modeld-Conversation": key}
            ) as response:
                for line in response.iter_lines():
                    if not first and line.startswith("data: {") and '"content":' in line:
                        first = time.perf_counter()
            out.append(first - t0)
    return out[1:]


@contextlib.contextmanager
def _page_open(url: str, pages: int = 2) -> Iterator[dict[str, Any]]:
    """``pages`` live pages reading the state pushed over ``/ui/events``."""
    stop = threading.Event()
    seen: dict[str, Any] = {"events": 0}

    def events() -> None:
        with (
            httpx.Client(base_url=url, timeout=None) as client,
            client.stream("GET", "/ui/events") as response,
        ):
            for line in response.iter_lines():
                if line.startswith("data: "):
                    seen["events"] += 1
                if stop.is_set():
                    return

    threads = [threading.Thread(target=events, daemon=True) for _ in range(pages)]
    for t in threads:
        t.start()
    time.sleep(0.6)
    try:
        yield seen
    finally:
        stop.set()  # each reader ends at its next event (at most 2 s away)


def _recording_us(turns: int = 2000) -> float:
    """A turn's record before its first token, in process (median, µs)."""
    from modeld.contract import PrefixStatus, ReuseDecision
    from modeld.observe.records import Records
    from modeld.observe.turns import TurnRecorder

    records = Records(None)
    status = PrefixStatus(
        2800, 40, 0, 2840, 2840, 30000, "a", "b", "c", ReuseDecision("warm", "extended", "", tier="kv")
    )
    took = []
    for _ in range(turns):
        t0 = time.perf_counter()
        recording = records.begin(
            "openai", external=True, model="m", job="j", conversation="c", bytes_in=9000
        )
        turn = TurnRecorder(records, "http", "", "s", "m")
        turn.hand(recording)
        turn.start(new_turn=True)
        turn.progress("prefix", None)
        turn.prefix(status, "kv", "")
        turn.suffix(20, 0)
        turn.decoding()
        turn.first_token(0.004)
        took.append(time.perf_counter() - t0)
        turn.end("stop")
        recording.finish(status=200)
    return statistics.median(took) * 1e6


def run_page_overhead(turns: int = 30, rounds: int = 6, backend: str = "memory") -> dict[str, Any]:
    model = "modeld-tiny"
    conversation = _conversation(turns)
    closed: list[float] = []
    opened: list[float] = []
    pushed = 0
    state: list[float] = []
    with serve(backend, "--http", "127.0.0.1:0", "--num-ctx", "32768") as (_client, record):
        url = record.http_endpoint
        _warm_ttfts(url, model, conversation[:3], "warm-up")
        for r in range(rounds):
            for page in (False, True) if r % 2 == 0 else (True, False):
                key = f"page-{r}-{page}"
                if page:
                    with _page_open(url) as seen:
                        opened += _warm_ttfts(url, model, conversation, key)
                    pushed += seen["events"]
                else:
                    closed += _warm_ttfts(url, model, conversation, key)
        with httpx.Client(base_url=url, timeout=60) as client:
            for _ in range(10):
                t0 = time.perf_counter()
                client.get("/ui/state").raise_for_status()
                state.append(time.perf_counter() - t0)
    med = statistics.median
    recording = _recording_us()
    return {
        "backend": backend,
        "turns": turns,
        "rounds": rounds,
        "closed_ttft_ms": med(closed) * 1000,
        "open_ttft_ms": med(opened) * 1000,
        "page_cost": med(opened) / med(closed) - 1,
        "pushes": pushed,
        "state_ms": med(state) * 1000 if state else 0.0,
        "recording_us": recording,
        "recording_cost": recording / (med(closed) * 1e6),
    }


def page_lines(page: dict[str, Any]) -> list[str]:
    """The report's section."""
    return [
        f"## The live page and the request records (`bench/page_overhead.py`, {page['backend']} backend)",
        "",
        f"The coding loop over HTTP, {page['rounds']} rounds of two blocks of {page['turns']} turns (a new "
        "conversation each: its first turn cold), the page closed or two pages open and refreshing (an SSE reader of "
        "`/ui/events` each, as the page's script reads them), the order swapped every round. Warm TTFT, "
        "median, ms. Goal (issue 35): the page and the records cost at most 1% of a warm turn's TTFT.",
        "",
        "| page closed | page open | page's cost | a record before the first token | its cost |",
        "|---|---|---|---|---|",
        f"| {page['closed_ttft_ms']:.2f} | {page['open_ttft_ms']:.2f} | {100 * page['page_cost']:+.1f}% | "
        f"{page['recording_us']:.1f} µs | {100 * page['recording_cost']:.2f}% |",
        "",
        f"({page['pushes']} states pushed while the pages were open; a fresh `/ui/state` took "
        f"{page['state_ms']:.1f} ms to fetch, median.)",
        "",
    ]


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="bench.page_overhead")
    parser.add_argument("--backend", default="memory", choices=["memory", "llama"])
    parser.add_argument("--turns", type=int, default=30)
    parser.add_argument("--rounds", type=int, default=6)
    args = parser.parse_args(argv)
    result = run_page_overhead(args.turns, args.rounds, args.backend)
    print(json.dumps({k: round(v, 4) if isinstance(v, float) else v for k, v in result.items()}, indent=2))
    print("\n".join(page_lines(result)))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
