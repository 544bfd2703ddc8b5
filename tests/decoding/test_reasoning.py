"""A reasoning model's thinking, split from its answer on every API, and what its template does to
warm reuse (a real ``modeld serve --http`` on THINK: a generated model with a Qwen3-style template
whose generation prompt opens ``<think>``; it thinks "Reading the request", then answers
"Understood." and ends the turn).

The template drops earlier turns' thinking, so the KV holds thinking the next turn's rendering
does not: the next turn may diverge there, at the last assistant message, and never earlier.
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
import jinja2
import llama_cpp
import openai
import pytest
from daemon_proc import serve_http, stop

from modeld.testmodels import THINK, ensure_model
from modeld.testmodels._reply import REPLY_TEXT, THOUGHT

pytestmark = [pytest.mark.wire, pytest.mark.llama]

MODEL = "modeld-think"


@pytest.fixture(scope="module")
def url() -> Iterator[str]:
    tmp = Path(tempfile.mkdtemp(prefix="mdth"))
    proc, record = serve_http(tmp, "--model", f"{MODEL}={ensure_model(THINK)}", backend="llama", timeout=300)
    try:
        yield record.http_endpoint
    finally:
        stop(proc)
        shutil.rmtree(tmp, ignore_errors=True)


def test_openai_chat_returns_reasoning_content_streamed_and_not(url: str) -> None:
    client = openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0)
    messages: list[Any] = [{"role": "user", "content": "Why does test_lease fail?"}]
    whole = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=32)
    message = whole.choices[0].message
    assert message.content == REPLY_TEXT and whole.choices[0].finish_reason == "stop"
    assert message.model_extra is not None and message.model_extra["reasoning_content"] == THOUGHT
    assert whole.usage is not None and whole.usage.completion_tokens_details is not None
    assert 0 < whole.usage.completion_tokens_details.reasoning_tokens < whole.usage.completion_tokens
    chunks = list(client.chat.completions.create(model=MODEL, messages=messages, max_tokens=32, stream=True))
    deltas = [c.choices[0].delta for c in chunks if c.choices]
    assert "".join(d.content or "" for d in deltas) == REPLY_TEXT
    assert "".join((d.model_extra or {}).get("reasoning_content") or "" for d in deltas) == THOUGHT
    client.close()


def test_the_next_turn_diverges_at_the_last_assistant_message_and_never_before(url: str) -> None:
    """The client sends the answer back without its thinking (as chat clients do); the template
    renders it so too. The KV held the thinking: the conversation diverges inside the last
    assistant message, so everything before that message is reused. The prefill ahead of the
    next turn (the default) meets that divergence while the user reads; the next turn then
    reuses all it computed."""
    client = openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0)
    messages: list[Any] = [
        {"role": "system", "content": "You are a careful engineer. " * 20},
        {"role": "user", "content": "Why does test_lease fail?"},
    ]
    headers = {"X-Modeld-Conversation": "think-reuse"}
    first = client.chat.completions.create(
        model=MODEL, messages=messages, max_tokens=32, extra_headers=headers
    )
    messages += [
        {"role": "assistant", "content": first.choices[0].message.content},
        {"role": "user", "content": "Fix it."},
    ]
    second = client.chat.completions.create(
        model=MODEL, messages=messages, max_tokens=32, extra_headers=headers
    )
    extension = second.model_extra["modeld"] if second.model_extra else {}
    # The oracle: what turn one left in the KV (its prompt, its thinking and answer) against what
    # turn two's template renders (the answer without its thinking), token by token.
    vocab = llama_cpp.Llama(model_path=str(ensure_model(THINK)), vocab_only=True, verbose=False)
    env = jinja2.Environment(trim_blocks=True, lstrip_blocks=True)  # as the engine renders
    render = env.from_string(vocab.metadata["tokenizer.chat_template"]).render
    resident = render(messages=messages[:2], add_generation_prompt=True) + THOUGHT + "</think>" + REPLY_TEXT
    again = render(messages=messages[:3], add_generation_prompt=False)
    a, b = (vocab.tokenize(t.encode(), add_bos=True, special=True) for t in (resident, again))
    common = next((i for i, (x, y) in enumerate(zip(a, b, strict=False)) if x != y), min(len(a), len(b)))
    assert (
        again[: len(render(messages=messages[:2], add_generation_prompt=True)) - len("<think>\n")] in resident
    )
    # The prefill ahead that turn one left (its own record: finish "ahead") diverged there.
    records = httpx.get(f"{url}/v1/requests", params={"limit": 1000}, timeout=30).json()["data"]
    mine = sorted(
        (r for r in records if r["conversation"] == records_of(records, second.id)["conversation"]),
        key=lambda r: r["started_at"],
    )
    ahead = mine[1]
    assert [r["finish"] for r in mine[:3]] == [
        first.choices[0].finish_reason,
        "ahead",
        second.choices[0].finish_reason,
    ]
    assert ahead["reused_tokens"] == common, (ahead, common)
    assert first.usage is not None and common == first.usage.prompt_tokens - len(
        vocab.tokenize(b"<think>\n", add_bos=False, special=True)
    )  # everything before the assistant's answer: the last assistant message, and not before
    # Turn two reused all the prefill ahead computed: the answer as history, and what the
    # template puts before the next message.
    assert extension["reused_tokens"] == ahead["prefix_tokens"] >= len(b), (extension, ahead)
    vocab.close()
    client.close()


def records_of(records: list[dict[str, Any]], response_id: str) -> dict[str, Any]:
    """The request record of the response ``response_id`` (a record's id is its turn's)."""
    return next(r for r in records if response_id.endswith(r["id"]))


def test_anthropic_thinking_blocks_follow_the_request(url: str) -> None:
    client = anthropic.Anthropic(base_url=url, api_key="unused", max_retries=0)
    ask: dict[str, Any] = {"model": MODEL, "max_tokens": 64, "messages": [{"role": "user", "content": "hi"}]}
    shown = client.messages.create(**ask, thinking={"type": "enabled", "budget_tokens": 1024})
    assert [(b.type, getattr(b, "thinking", getattr(b, "text", None))) for b in shown.content] == [
        ("thinking", THOUGHT),
        ("text", REPLY_TEXT),
    ]
    omitted = client.messages.create(**ask, thinking={"type": "adaptive", "display": "omitted"})  # type: ignore[typeddict-item]
    assert [(b.type, getattr(b, "thinking", getattr(b, "text", None))) for b in omitted.content] == [
        ("thinking", ""),
        ("text", REPLY_TEXT),
    ]
    plain = client.messages.create(**ask)
    assert [b.type for b in plain.content] == ["text"]
    with client.messages.stream(**ask, thinking={"type": "enabled", "budget_tokens": 1024}) as stream:
        kinds = [(e.type, getattr(getattr(e, "delta", None), "type", None)) for e in stream]
        final = stream.get_final_message()
    assert ("content_block_delta", "thinking_delta") in kinds
    assert [b.model_dump() for b in final.content] == [b.model_dump() for b in shown.content]
    client.close()


def test_responses_return_a_reasoning_item(url: str) -> None:
    client = openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0)
    done = client.responses.create(
        model=MODEL, input="hi", max_output_tokens=64, reasoning={"summary": "auto"}
    )
    kinds = [item.type for item in done.output]
    assert kinds == ["reasoning", "message"] and done.output_text == REPLY_TEXT
    reasoning = done.output[0]
    assert reasoning.type == "reasoning" and reasoning.content is not None
    assert reasoning.content[0].text == THOUGHT
    assert done.usage is not None and done.usage.output_tokens_details.reasoning_tokens > 0
    client.close()


def test_ollama_thinking_and_think_false(url: str) -> None:
    body = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "stream": False}
    shown = httpx.post(f"{url}/api/chat", json=body, timeout=60).json()
    assert (shown["message"]["thinking"], shown["message"]["content"]) == (THOUGHT, REPLY_TEXT)
    hidden = httpx.post(f"{url}/api/chat", json={**body, "think": False}, timeout=60).json()
    assert "thinking" not in hidden["message"] and hidden["message"]["content"] == REPLY_TEXT
    with httpx.stream("POST", f"{url}/api/chat", json={**body, "stream": True}, timeout=60) as r:
        lines = [json.loads(line) for line in r.iter_lines() if line]
    assert "".join(line["message"].get("thinking", "") for line in lines) == THOUGHT
