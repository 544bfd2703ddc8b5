"""The OpenAI facade's own cost per turn: the coding loop through ``/v1/chat/completions``
against the same loop over gRPC, on the memory backend (no engine cost), in one daemon.

Three loops send the same conversation (a ~9 KB system prompt and repo map, a growing history,
32 streamed tokens a turn) and run the same session operations: the gRPC loop
(``runtime_client``) builds its requests with the facade's own mapping (``parse_chat``); the
HTTP loop posts the JSON with a keep-alive ``httpx`` client and reads the SSE stream; the SDK
loop is the official ``openai`` SDK. ``facade_ms`` (HTTP minus gRPC) is what modeld's endpoint
adds: HTTP, JSON, SSE, the thread hand-off and the conversation table; the goal (issue 10) is
at most 5 ms per turn, median. ``sdk_ms`` (SDK minus gRPC) adds the SDK's own client-side work:
it type-walks every request and builds a pydantic object per chunk, and it drops the connection
after each stream (it stops reading at ``[DONE]``), so every turn also pays a new connection.
``python -m bench.openai_overhead [TURNS]``.
"""

from __future__ import annotations

import json
import statistics
import sys
import time
from dataclasses import replace

import httpx
import openai

import runtime_client as rc
from bench.daemon import serve
from modeld.server.http.openai.request import parse_chat
from modeld.server.http.turn import chat_inputs, split_point, template_args_json
from modeld.settings import Limits

__all__ = ["run_openai_overhead"]

MODEL = "modeld-tiny"


def _conversation(turns: int) -> list[list[dict[str, str]]]:
    """The messages of each turn: a ~8 KB system prompt + repo map, then a growing history."""
    repo = "".join(f"src/pkg/module_{i}.py: handler_{i}(), parse_{i}()\n" for i in range(180))
    system = "You are a careful engineer.\n" * 4 + repo
    messages = [{"role": "system", "content": system}]
    out = []
    for i in range(turns):
        messages = [
            *messages,
            {"role": "user", "content": f"Turn {i}: fix the failing test in module_{i}.\n"},
        ]
        out.append(messages)
        messages = [*messages, {"role": "assistant", "content": f"Done with module_{i}.\n"}]
    return out


def _grpc_loop(client: rc.Client, turns: list[list[dict[str, str]]]) -> tuple[list[float], list[float]]:
    request = rc.OpenSessionRequest(
        type="memory", path=MODEL, model_name=MODEL, config=rc.Config(num_ctx=32768, prompt_format="chat")
    )
    ttft, total = [], []
    with client.open_session(request) as session:
        for messages in turns:
            turn = parse_chat(
                {"model": MODEL, "messages": messages, "max_tokens": 32, "temperature": 0}, {}, Limits()
            ).turn
            prefix, suffix = chat_inputs(
                turn.messages,
                split_point(turn.messages),
                turn.tools_json,
                "http.openai.chat",
                template_args_json(turn),
            )
            t0 = time.perf_counter()
            session.ensure_prefix(prefix)
            session.prefill_suffix(suffix)
            first = 0.0
            with session.decode(replace(turn.decode, max_tokens=32)) as stream:
                for chunk in stream:
                    if chunk.token_ids and not first:
                        first = time.perf_counter()
            total.append(time.perf_counter() - t0)
            ttft.append(first - t0)
    return ttft, total


def _raw_loop(url: str, turns: list[list[dict[str, str]]]) -> tuple[list[float], list[float]]:
    ttft, total = [], []
    with httpx.Client(base_url=url, timeout=60) as client:
        for messages in turns:
            body = {
                "model": MODEL,
                "messages": messages,
                "max_tokens": 32,
                "temperature": 0,
                "stream": True,
                "stream_options": {"include_usage": True},
            }
            t0 = time.perf_counter()
            first = 0.0
            with client.stream(
                "POST", "/v1/chat/completions", json=body, headers={"X-Modeld-Conversation": "raw"}
            ) as response:
                for line in response.iter_lines():
                    if not line.startswith("data: {"):
                        continue
                    chunk = json.loads(line[6:])
                    if chunk["choices"] and chunk["choices"][0]["delta"].get("content") and not first:
                        first = time.perf_counter()
            total.append(time.perf_counter() - t0)
            ttft.append(first - t0)
    return ttft, total


def _http_loop(client: openai.OpenAI, turns: list[list[dict[str, str]]]) -> tuple[list[float], list[float]]:
    ttft, total = [], []
    for messages in turns:
        t0 = time.perf_counter()
        first = 0.0
        stream = client.chat.completions.create(  # type: ignore[call-overload]
            model=MODEL,
            messages=messages,
            max_tokens=32,
            temperature=0,
            stream=True,
            stream_options={"include_usage": True},
            extra_headers={"X-Modeld-Conversation": "bench"},
        )
        for chunk in stream:
            if chunk.choices and chunk.choices[0].delta.content and not first:
                first = time.perf_counter()
        total.append(time.perf_counter() - t0)
        ttft.append(first - t0)
    return ttft, total


def run_openai_overhead(turns: int = 20) -> dict[str, float]:
    """Median per-turn times (ms) of both loops and the facade's overhead (their difference)."""
    conversation = _conversation(turns + 2)
    with serve("memory", "--http", "127.0.0.1:0", "--num-ctx", "32768") as (grpc_client, record):
        _grpc_loop(grpc_client, conversation[:2])  # warm both paths up
        grpc_ttft, grpc_total = _grpc_loop(grpc_client, conversation[2:])
        _raw_loop(record.http_endpoint, conversation[:2])
        raw_ttft, raw_total = _raw_loop(record.http_endpoint, conversation[2:])
        sdk = openai.OpenAI(base_url=f"{record.http_endpoint}/v1", api_key="unused", max_retries=0)
        _http_loop(sdk, conversation[:2])
        http_ttft, http_total = _http_loop(sdk, conversation[2:])
        sdk.close()
    med = statistics.median
    return {
        "turns": float(turns),
        "grpc_ttft_ms": med(grpc_ttft) * 1000,
        "grpc_turn_ms": med(grpc_total) * 1000,
        "http_ttft_ms": med(raw_ttft) * 1000,
        "http_turn_ms": med(raw_total) * 1000,
        "sdk_ttft_ms": med(http_ttft) * 1000,
        "sdk_turn_ms": med(http_total) * 1000,
        "facade_ttft_ms": (med(raw_ttft) - med(grpc_ttft)) * 1000,
        "facade_turn_ms": (med(raw_total) - med(grpc_total)) * 1000,
        "sdk_turn_overhead_ms": (med(http_total) - med(grpc_total)) * 1000,
    }


def main(argv: list[str]) -> int:
    result = run_openai_overhead(int(argv[0]) if argv else 20)
    print(json.dumps({k: round(v, 3) for k, v in result.items()}, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
