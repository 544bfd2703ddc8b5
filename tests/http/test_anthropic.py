"""Anthropic's Messages API, driven by the official ``anthropic`` SDK against a real
``modeld serve --http`` (the memory backend: one token per byte, so every count is exact).

What Claude Code does: a system prompt in blocks (its first block a per-request billing
header), tools with ``input_schema``, ``metadata.user_id`` holding a session id, streamed
answers, tool calls sent back as ``tool_result``, ``count_tokens``, and usage read as cache
reads and writes.
"""

from __future__ import annotations

import json
import shutil
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import anthropic
import httpx
import pytest
from daemon_proc import serve_http, stop
from memory_chat import chatml, tokens

pytestmark = pytest.mark.wire

MODEL = "modeld-tiny"
SYSTEM = [
    {"type": "text", "text": "x-anthropic-billing-header: cc_version=2.1; cch=0a1b2c;"},
    {"type": "text", "text": "You are a careful engineer.", "cache_control": {"type": "ephemeral"}},
    {"type": "text", "text": "The repository is small.", "cache_control": {"type": "ephemeral"}},
]
READ = {
    "name": "read_file",
    "description": "Read a file",
    "input_schema": {
        "type": "object",
        "properties": {"path": {"type": "string", "minLength": 1, "maxLength": 24}},
        "required": ["path"],
        "additionalProperties": False,
    },
}


class Daemon:
    def __init__(self, tmp: Path, *extra: str) -> None:
        self.proc, record = serve_http(tmp, *extra)
        self.url = record.http_endpoint
        self.client = anthropic.Anthropic(base_url=self.url, api_key="unused", max_retries=0, timeout=60)

    def close(self) -> str:
        self.client.close()
        _, err = stop(self.proc)
        return err


@pytest.fixture(scope="module")
def daemon() -> Iterator[Daemon]:
    tmp = Path(tempfile.mkdtemp(prefix="mda"))
    # Without the prefill ahead (the default; tests/http/test_prefill_ahead.py): these tests read each
    # turn's own reuse and the session's state right after its answer, which a prefill ahead changes.
    d = Daemon(tmp, "--no-prefill-ahead")
    try:
        yield d
    finally:
        d.close()
        shutil.rmtree(tmp, ignore_errors=True)


def system_text() -> str:
    return "You are a careful engineer.\n\nThe repository is small."


def session_meta(session: str) -> dict[str, str]:
    return {"user_id": json.dumps({"device_id": "d", "account_uuid": "", "session_id": session})}


def test_a_message_reports_its_prompt_as_cache_reads_and_writes(daemon: Daemon) -> None:
    """Turn one computes the system prompt (a cache write) and the question; turn two reads the
    whole first turn from warm state. The three input counts add up to the prompt."""
    question = "Why does test_lease fail?"
    first = daemon.client.messages.create(
        model=MODEL,
        max_tokens=16,
        system=SYSTEM,  # type: ignore[arg-type]
        messages=[{"role": "user", "content": question}],
        metadata=session_meta("s-usage"),  # type: ignore[arg-type]
    )
    assert first.type == "message" and first.role == "assistant"
    assert first.stop_reason in ("end_turn", "max_tokens")
    text = "".join(b.text for b in first.content if b.type == "text")
    prompt = tokens(chatml([("system", system_text()), ("user", question)]))
    # The stable prefix: the system turn as the template renders it before a user turn, through
    # that turn's header (blueprint 0010).
    system_tokens = tokens(chatml([("system", system_text())], generation=False) + "<|im_start|>user\n")
    u = first.usage
    assert u.input_tokens + (u.cache_creation_input_tokens or 0) + (u.cache_read_input_tokens or 0) == prompt
    assert u.cache_creation_input_tokens == system_tokens - (u.cache_read_input_tokens or 0)
    assert u.output_tokens == len(text.encode())

    messages: list[Any] = [
        {"role": "user", "content": question},
        {"role": "assistant", "content": [{"type": "text", "text": text}]},
        {"role": "user", "content": [{"type": "text", "text": "Fix it."}]},
    ]
    second = daemon.client.messages.create(
        model=MODEL,
        max_tokens=8,
        system=[
            {**SYSTEM[0], "text": "x-anthropic-billing-header: cc_version=2.1; cch=ffffff;"},
            *SYSTEM[1:],
        ],  # type: ignore[list-item]
        messages=messages,
        metadata=session_meta("s-usage"),  # type: ignore[arg-type]
    )
    turn_one = chatml([("system", system_text()), ("user", question)]) + text
    # Resident after turn one: its prompt and reply, but for the last token sampled when the
    # reply was cut off at max_tokens (never evaluated); a new billing header changes nothing.
    unevaluated = 1 if first.stop_reason == "max_tokens" else 0
    assert second.usage.cache_read_input_tokens == tokens(turn_one) - unevaluated
    assert second.model_extra is not None and second.model_extra["modeld"]["reuse"] == "warm"
    total = tokens(
        chatml([("system", system_text()), ("user", question), ("assistant", text), ("user", "Fix it.")])
    )
    su = second.usage
    assert (
        su.input_tokens + (su.cache_creation_input_tokens or 0) + (su.cache_read_input_tokens or 0) == total
    )


def test_the_stream_follows_the_documented_event_sequence_and_says_what_the_message_says(
    daemon: Daemon,
) -> None:
    request: dict[str, Any] = {
        "model": MODEL,
        "max_tokens": 24,
        "system": "Be brief.",
        "messages": [{"role": "user", "content": "Name a prime."}],
        "metadata": session_meta("s-stream"),
    }
    whole = daemon.client.messages.create(**request)
    with daemon.client.messages.stream(**request) as stream:
        kinds = [event.type for event in stream]
        streamed = stream.get_final_message()
    assert kinds[0] == "message_start"
    assert kinds[-2:] == ["message_delta", "message_stop"]
    # The wire itself (the SDK hides pings): each event's name matches its data's type.
    with httpx.stream(
        "POST", f"{daemon.url}/v1/messages", json={**request, "stream": True}, timeout=30
    ) as raw:
        lines = [line for line in raw.iter_lines() if line]
    names = [line.removeprefix("event: ") for line in lines if line.startswith("event: ")]
    datas = [json.loads(line.removeprefix("data: ")) for line in lines if line.startswith("data: ")]
    assert names == [d["type"] for d in datas]
    blocks = [n for n in names if n.startswith("content_block")]
    assert names[:2] == ["message_start", "ping"] and names[-2:] == ["message_delta", "message_stop"]
    assert blocks[0] == "content_block_start" and blocks[-1] == "content_block_stop"
    assert set(blocks[1:-1]) == {"content_block_delta"}
    assert [b.model_dump() for b in streamed.content] == [b.model_dump() for b in whole.content]
    assert streamed.stop_reason == whole.stop_reason
    assert streamed.usage.output_tokens == whole.usage.output_tokens
    total = lambda u: u.input_tokens + (u.cache_creation_input_tokens or 0) + (u.cache_read_input_tokens or 0)  # noqa: E731
    assert total(streamed.usage) == total(whole.usage)


def test_a_forced_tool_call_round_trips_and_the_result_turn_reuses_the_call(daemon: Daemon) -> None:
    """tool_choice {type: tool} forces a well-formed call (a grammar), streamed as an
    input_json_delta; the tool_result sent back reuses every generated token."""
    request: dict[str, Any] = {
        "model": MODEL,
        "max_tokens": 200,
        "system": "Use the tools.",
        "tools": [READ],
        "tool_choice": {"type": "tool", "name": "read_file"},
        "messages": [{"role": "user", "content": "Show me setup.py"}],
        "metadata": session_meta("s-tools"),
    }
    with daemon.client.messages.stream(**request) as stream:
        events = list(stream)
        first = stream.get_final_message()
    assert first.stop_reason == "tool_use"
    calls = [b for b in first.content if b.type == "tool_use"]
    assert len(calls) == 1 and calls[0].name == "read_file" and isinstance(calls[0].input, dict)
    assert any(e.type == "content_block_delta" and e.delta.type == "input_json_delta" for e in events)
    follow = {
        **request,
        "tool_choice": {"type": "auto"},
        "max_tokens": 4,
        "messages": [
            *request["messages"],
            {"role": "assistant", "content": [b.model_dump(exclude_none=True) for b in first.content]},
            {
                "role": "user",
                "content": [
                    {
                        "type": "tool_result",
                        "tool_use_id": calls[0].id,
                        "content": "no such file",
                        "is_error": True,
                    }
                ],
            },
        ],
    }
    second = daemon.client.messages.create(**follow)
    prompt_one = (
        first.usage.input_tokens
        + (first.usage.cache_creation_input_tokens or 0)
        + (first.usage.cache_read_input_tokens or 0)
    )
    assert second.usage.cache_read_input_tokens == prompt_one + first.usage.output_tokens
    assert second.model_extra is not None and second.model_extra["modeld"]["reuse"] == "warm"


def test_count_tokens_counts_what_a_message_would_take(daemon: Daemon) -> None:
    request: dict[str, Any] = {
        "model": MODEL,
        "system": SYSTEM,
        "tools": [READ],
        "messages": [{"role": "user", "content": "How many tokens is this?"}],
    }
    counted = daemon.client.messages.count_tokens(**request)
    done = daemon.client.messages.create(max_tokens=1, **request)
    u = done.usage
    assert counted.input_tokens == u.input_tokens + (u.cache_creation_input_tokens or 0) + (
        u.cache_read_input_tokens or 0
    )


def test_max_tokens_zero_warms_the_prompt_without_generating(daemon: Daemon) -> None:
    request: dict[str, Any] = {
        "model": MODEL,
        "system": "A long stable prompt. " * 20,
        "messages": [{"role": "user", "content": "Later question."}],
        "metadata": session_meta("s-warm"),
    }
    warmed = daemon.client.messages.create(max_tokens=0, **request)
    assert warmed.content == [] and warmed.stop_reason == "max_tokens" and warmed.usage.output_tokens == 0
    done = daemon.client.messages.create(max_tokens=2, **request)
    prefix = tokens(chatml([("system", "A long stable prompt. " * 20)], generation=False))
    assert (done.usage.cache_read_input_tokens or 0) >= prefix


def test_stop_sequence_names_the_one_that_matched_streamed_and_not(daemon: Daemon) -> None:
    messages = [{"role": "user", "content": "alpha beta gamma"}]
    free = daemon.client.messages.create(model=MODEL, max_tokens=40, messages=messages)  # greedy
    text = "".join(b.text for b in free.content if b.type == "text")
    k = len(text) // 2
    short, long = text[k : k + 2], text[k : k + 5]
    at = text.find(short)  # the earliest match; at one place the shorter completes first
    request: dict[str, Any] = {
        "model": MODEL,
        "max_tokens": 40,
        "messages": messages,
        "stop_sequences": ["never-there", short, long],
    }
    done = daemon.client.messages.create(**request)
    assert done.stop_reason == "stop_sequence" and done.stop_sequence == short
    assert "".join(b.text for b in done.content if b.type == "text") == text[:at]
    with daemon.client.messages.stream(**request) as stream:
        final = stream.get_final_message()
    assert final.stop_reason == "stop_sequence" and final.stop_sequence == short


def test_thinking_is_accepted_and_yields_none_on_a_model_without_a_reasoning_format(daemon: Daemon) -> None:
    done = daemon.client.messages.create(
        model=MODEL,
        max_tokens=4,
        thinking={"type": "adaptive", "display": "omitted"},  # type: ignore[typeddict-item]
        messages=[{"role": "user", "content": "Think."}],
        extra_body={"context_management": {"edits": [{"type": "clear_thinking_20251015", "keep": "all"}]}},
        extra_headers={"anthropic-beta": "claude-code-20250219,interleaved-thinking-2025-05-14"},
    )
    assert all(b.type == "text" for b in done.content)


def test_errors_use_anthropics_envelope_and_types(daemon: Daemon) -> None:
    with pytest.raises(anthropic.NotFoundError) as missing:
        daemon.client.messages.create(
            model="claude-opus", max_tokens=4, messages=[{"role": "user", "content": "hi"}]
        )
    assert missing.value.body == {
        "type": "error",
        "error": {"type": "not_found_error", "message": missing.value.body["error"]["message"]},
        "request_id": missing.value.request_id,  # the body's request_id is the request-id header's
    }  # type: ignore[index]
    assert str(missing.value.request_id).startswith("req_")
    image = {"type": "image", "source": {"type": "base64", "media_type": "image/png", "data": "iVBORw0KGgo="}}
    with pytest.raises(anthropic.BadRequestError) as refused:
        daemon.client.messages.create(
            model=MODEL, max_tokens=4, messages=[{"role": "user", "content": [image]}]
        )  # type: ignore[list-item]
    body = refused.value.body
    assert isinstance(body, dict) and body["error"]["type"] == "invalid_request_error"
    assert "messages.0.content.0" in body["error"]["message"] and "text only" in body["error"]["message"]
    with pytest.raises(anthropic.BadRequestError):
        daemon.client.messages.create(
            model=MODEL,
            max_tokens=4,
            messages=[{"role": "user", "content": "hi"}],
            extra_body={"temperature": 1.5},
        )
    raw = httpx.post(
        f"{daemon.url}/v1/messages",
        json={"model": MODEL, "max_tokens": 4, "messages": [{"role": "user", "content": "hi"}], "mystery": 1},
        timeout=10,
    )
    assert raw.status_code == 400 and "mystery" in raw.json()["error"]["message"]


def test_an_api_key_is_taken_from_x_api_key_or_bearer() -> None:
    tmp = Path(tempfile.mkdtemp(prefix="mdk"))
    d = Daemon(tmp, "--api-key", "sekret")
    try:
        with pytest.raises(anthropic.AuthenticationError) as err:
            d.client.messages.create(model=MODEL, max_tokens=1, messages=[{"role": "user", "content": "hi"}])
        assert err.value.body["error"]["type"] == "authentication_error"  # type: ignore[index]
        good = anthropic.Anthropic(base_url=d.url, api_key="sekret", max_retries=0)
        assert good.messages.create(
            model=MODEL, max_tokens=1, messages=[{"role": "user", "content": "hi"}]
        ).content
        bearer = anthropic.Anthropic(base_url=d.url, auth_token="sekret", max_retries=0)
        assert bearer.messages.create(
            model=MODEL, max_tokens=1, messages=[{"role": "user", "content": "hi"}]
        ).content
    finally:
        d.close()
        shutil.rmtree(tmp, ignore_errors=True)
