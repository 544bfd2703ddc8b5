"""What the request records and an open live page cost a warm turn (issue 35: at most 1% of its
TTFT).

Two daemons, the same flags; two live pages open on one of them (on the first for half of the
run, on the other for the other half: a difference between the daemons cancels out): two clients
reading ``/ui/events``, as the page's script does: the state pushed as records change, at most
every 0.5 s, and at least every 2 s, its status part rebuilt every 2 s. The coding loop of
``bench/openai_overhead.py`` (a ~9 KB system prompt and repo map, a growing chat, 32 streamed
tokens a turn) runs over plain HTTP on both, turn by turn in pairs (the same turn on one, then
on the other, the order swapped every pair), ``rounds`` conversations of ``turns`` turns each
(the first turn of each cold and left out). ``page_cost`` is the median of the pairs' ratios
(page open over no page) minus one: a pair shares the moment, so what the rest of a shared
machine does at that moment cancels out. ``state_ms``: a fresh ``/ui/state`` (the whole state
built at once, and its JSON), median of 10.

Recording is always on (every turn is a record), so its own cost is measured apart, in process:
``recording_us`` is what a turn's record costs before its first token (opening it, handing it
to the session, the prefix's and the suffix's counts, the stage changes), the median of 2000
turns, and ``recording_cost`` that over the median warm TTFT without a page.

``python -m bench.page_overhead [--backend memory|llama] [--turns N] [--rounds N]``.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import statistics
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from typing import Any

import httpx

from bench.daemon import serve
from bench.openai_overhead import _conversation

__all__ = ["page_lines", "run_page_overhead"]


def _ttft(client: httpx.Client, model: str, messages: list[dict[str, str]], key: str) -> float:
    """One streamed turn's time to its first token (s)."""
    body = {"model": model, "messages": messages, "max_tokens": 32, "temperature": 0, "stream": True}
    t0 = time.perf_counter()
    first = 0.0
    with client.stream(
        "POST", "/v1/chat/completions", json=body, headers={"X-Modeld-Conversation": key}
    ) as r:
        for line in r.iter_lines():
            if not first and line.startswith("data: {") and '"content":' in line:
                first = time.perf_counter()
    return first - t0


_READER = """
import sys, httpx
with httpx.Client(timeout=None) as client, client.stream("GET", sys.argv[1] + "/ui/events") as response:
    for line in response.iter_lines():
        if line.startswith("data: "):
            print(1, flush=True)
"""


@contextlib.contextmanager
def _page_open(url: str, pages: int = 2) -> Iterator[dict[str, Any]]:
    """``pages`` live pages reading the state pushed over ``/ui/events``, each a process of its
    own (as a browser is: its work is not the measuring process's)."""
    seen: dict[str, Any] = {"events": 0}
    readers = [
        subprocess.Popen([sys.executable, "-c", _READER, url], stdout=subprocess.PIPE, text=True)
        for _ in range(pages)
    ]

    def count(reader: subprocess.Popen[str]) -> None:
        assert reader.stdout is not None
        for _ in reader.stdout:
            seen["events"] += 1

    counters = [threading.Thread(target=count, args=(r,), daemon=True) for r in readers]
    for t in counters:
        t.start()
    try:
        yield seen
    finally:
        for reader in readers:
            reader.terminate()
            reader.wait(10)
        for t in counters:
            t.join(5)


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
    flags = ("--http", "127.0.0.1:0", "--num-ctx", "32768")
    closed: list[float] = []
    opened: list[float] = []
    ratios: list[float] = []
    state: list[float] = []
    pushed = 0
    with (
        serve(backend, *flags) as (_a, one),
        serve(backend, *flags) as (_b, other),
        httpx.Client(base_url=one.http_endpoint, timeout=120) as to_one,
        httpx.Client(base_url=other.http_endpoint, timeout=120) as to_other,
    ):
        for client in (to_one, to_other):
            for messages in conversation[:3]:
                _ttft(client, model, messages, "warm-up")
        # The pages are open on one daemon for the first half of the rounds, on the other for the
        # second: a difference between the two daemons themselves cancels out too.
        for half, (watched, plain, url) in enumerate(
            ((to_other, to_one, other.http_endpoint), (to_one, to_other, one.http_endpoint))
        ):
            with _page_open(url) as seen:
                time.sleep(1.5)  # the pages' first states (the status part included) are built
                for r in range(half * rounds // 2, (half + 1) * rounds // 2 if half == 0 else rounds):
                    for i, messages in enumerate(conversation):
                        key = f"page-{r}"
                        order = [(plain, closed), (watched, opened)]
                        for client, out in order if (r + i) % 2 == 0 else order[::-1]:
                            out.append(_ttft(client, model, messages, key))
                        if i > 0:  # the first turn of a conversation is cold
                            ratios.append(opened[-1] / closed[-1])
                pushed += seen["events"]
        for _ in range(10):
            t0 = time.perf_counter()
            to_one.get("/ui/state").raise_for_status()
            state.append(time.perf_counter() - t0)
    med = statistics.median
    warm_closed = [t for i, t in enumerate(closed) if i % turns]
    warm_opened = [t for i, t in enumerate(opened) if i % turns]
    recording = _recording_us()
    return {
        "backend": backend,
        "turns": turns,
        "rounds": rounds,
        "closed_ttft_ms": med(warm_closed) * 1000,
        "open_ttft_ms": med(warm_opened) * 1000,
        "page_cost": med(ratios) - 1,
        "pairs": len(ratios),
        "pushes": pushed,
        "state_ms": med(state) * 1000,
        "recording_us": recording,
        "recording_cost": recording / (med(warm_closed) * 1e6),
    }


def page_lines(page: dict[str, Any]) -> list[str]:
    """The report's section."""
    return [
        f"## The live page and the request records (`bench/page_overhead.py`, {page['backend']} backend)",
        "",
        f"The coding loop over HTTP on two daemons, turn by turn in pairs ({page['pairs']} warm pairs: "
        f"{page['rounds']} conversations of {page['turns']} turns), two live pages open on one of them (each "
        "daemon for half of the run) "
        "(an SSE reader of `/ui/events` each, as the page's script reads them), the order swapped every pair. "
        "Warm TTFT, median, ms; the page's cost is the median of the pairs' ratios. Goal (issue 35): the page "
        "and the records cost at most 1% of a warm turn's TTFT.",
        "",
        "| no page | two pages open | page's cost | a record before the first token | its cost |",
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
