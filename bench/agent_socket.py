"""The Responses WebSocket over a long loop (part of the ``agent_apis`` extra): the bytes Codex's
transport sends per turn over HTTP and over the socket, and the socket's turns on modeld.

The loop is ``bench/agent_apis.py``'s **responses** loop (Codex's first request, then a tool call,
its output and a new instruction per turn), played on modeld alone over one socket
(``GET /v1/responses`` upgraded, as Codex 0.169.0 opens it with ``supports_websockets``): every
turn a ``response.create`` frame; the first carries the whole request, every later one only the
new items and the previous response's id (Codex sends ``store: false`` and the socket keeps its
last response). Against it, per turn, what Codex sends over HTTP for the same turn with
``store: false``: the whole conversation, each answer's output items echoed back (llama-server's
client in the responses loop sends exactly that).

Bytes are exact and do not depend on the machine: the frame's JSON text and the HTTP body, as
sent (compact JSON, UTF-8), before any compression (the socket negotiates permessage-deflate,
HTTP bodies go uncompressed: the socket's wire bytes are fewer still). Per socket turn it also
records the prompt and the cached tokens (the response's usage) and TTFT (frame sent to the first
content event), timing printed and recorded, never asserted.
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable
from typing import Any

from bench.systems.base import Unsupported
from bench.systems.modeld_http import ModeldHttpSystem
from bench.workloads import Workload

__all__ = ["run_socket_loop", "socket_lines"]

Body = dict[str, Any]
Log = Callable[[str], None]

BETA = "responses_websockets=2026-02-06"  # the header Codex 0.169.0 opens its socket with
CONTENT = {
    "response.output_text.delta",
    "response.function_call_arguments.delta",
    "response.reasoning_text.delta",
}
"""Events that carry generated content (what stops the TTFT clock, as in ``bench/agent_apis.py``)."""


def _compact(value: Body) -> bytes:
    return json.dumps(value, ensure_ascii=False, separators=(",", ":")).encode()


def _turn(ws: Any, frame: bytes) -> tuple[Body, float, float]:
    """Send one ``response.create`` frame and read its events to the end: the final response,
    TTFT and the whole turn (seconds)."""
    started = time.perf_counter()
    ws.send(frame.decode())
    first = 0.0
    while True:
        event = json.loads(ws.recv(timeout=600))
        kind = event.get("type", "")
        if kind in ("error", "response.failed"):
            raise RuntimeError(f"socket turn failed: {json.dumps(event)[:500]}")
        if kind in CONTENT and not first:
            first = time.perf_counter()
        if kind in ("response.completed", "response.incomplete"):
            done = time.perf_counter()
            return event["response"], (first or done) - started, done - started


def run_socket_loop(
    model: str,
    threads: int,
    first: Body,
    new: list[list[Body]],
    n_ctx: int,
    *,
    log: Log = print,
) -> dict[str, Any]:
    """The loop over one socket on modeld (``first``: the first request; ``new``: the items each
    turn adds, none for the first; ``n_ctx``: the window): per turn the bytes over HTTP and over
    the socket, and the socket's usage and timing."""
    from websockets.sync.client import connect

    try:
        load = Workload("agent_socket", "agent_socket", "", "", [], n_ctx=n_ctx)
        system = ModeldHttpSystem(model, load, threads)
    except Unsupported as e:
        return {"error": str(e), "rows": []}
    first = {**first, "store": False}  # Codex's: the socket keeps its last response, the store nothing
    history: list[Body] = list(first["input"])  # what HTTP resends: everything, answers echoed
    previous = ""
    echo: list[Body] = []
    rows: list[dict[str, Any]] = []
    try:
        url = system.base_url.replace("http://", "ws://") + "/v1/responses"
        with connect(url, additional_headers={"OpenAI-Beta": BETA}, max_size=None) as ws:
            for k, items in enumerate(new):
                body = {**first, "input": items, "previous_response_id": previous} if k else first
                history += echo + items if k else []
                frame = _compact({"type": "response.create", **body})
                http_body = _compact({**first, "input": history})
                response, ttft, total = _turn(ws, frame)
                usage = response.get("usage") or {}
                prompt = int(usage.get("input_tokens", 0))
                cached = int((usage.get("input_tokens_details") or {}).get("cached_tokens", 0))
                previous, echo = str(response.get("id", "")), list(response.get("output") or [])
                row = {
                    "turn": k,
                    "http_bytes": len(http_body),
                    "socket_bytes": len(frame),
                    "prompt_tokens": prompt,
                    "cached_tokens": cached,
                    "ttft_s": ttft,
                    "total_s": total,
                }
                rows.append(row)
                log(
                    f"  socket    turn {k}  HTTP {row['http_bytes']:>7} B  socket {row['socket_bytes']:>6} B  "
                    f"cached {cached:>5} / {prompt:>5}  TTFT {ttft * 1000:8.1f} ms"
                )
    except Exception as e:  # recorded: the report says where the loop stopped
        return {"error": str(e)[:500], "rows": rows, "n_ctx": n_ctx, "settings": system.settings}
    finally:
        system.close()
    return {"rows": rows, "n_ctx": n_ctx, "settings": system.settings}


def socket_lines(result: dict[str, Any]) -> list[str]:
    """The report's section: bytes per turn over HTTP and over the socket, and their totals."""
    rows = result.get("rows") or []
    lines = [
        "### The Responses WebSocket: bytes per turn against HTTP (`bench/agent_socket.py`)",
        "",
        "The responses loop on modeld over one socket, as Codex 0.169.0 speaks it (`supports_websockets`): "
        "the first frame carries the whole request, every later one only the new items and the previous "
        "response's id. HTTP: what Codex sends for the same turn over HTTP with `store: false` (the whole "
        "conversation, each answer's output echoed). Bytes are exact (the JSON as sent, before compression); "
        "cumulative: all turns so far.",
        "",
    ]
    if result.get("error"):
        lines += [f"- Note: the loop stopped: {result['error']}", ""]
    if not rows:
        return lines
    lines += [
        "| turn | HTTP B | socket B | ratio | cumulative HTTP / socket | cached / prompt tokens | TTFT ms |",
        "|---" * 7 + "|",
    ]
    http_total = socket_total = 0
    for row in rows:
        http_total += row["http_bytes"]
        socket_total += row["socket_bytes"]
        lines.append(
            f"| {row['turn']} | {row['http_bytes']} | {row['socket_bytes']} | "
            f"{row['http_bytes'] / row['socket_bytes']:.1f}x | {http_total / socket_total:.2f}x | "
            f"{row['cached_tokens']} / {row['prompt_tokens']} | {row['ttft_s'] * 1000:.1f} |"
        )
    return [*lines, ""]
