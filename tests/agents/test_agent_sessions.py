"""Long agent sessions never dead-end (issue 33, the protocol side), each point driven by the
vendor's own SDK (``anthropic``, ``openai``, ``ollama``) against a real ``modeld serve --http``
on the memory backend (one token per byte, plus BOS: every count below is exact) with a small
window (``--num-ctx 600``), so a session goes past it in a few requests.

- A prompt beyond the window is answered in each API's own words and channel, before anything
  is computed: Anthropic's ``prompt is too long: N tokens > M maximum`` (what Claude Code parses
  to compact), the Responses API's ``response.failed`` with ``context_length_exceeded`` inside
  the stream (what Codex reads), OpenAI's ``context_length_exceeded``, and Ollama's truncation.
- ``max_tokens`` beyond the window decodes until the window is full and stops with the API's
  own reason.
- Images and documents in earlier messages are named placeholders; the newest message's are refused;
  ``tool_reference`` is text.
- Codex's shapes: namespaced calls, reasoning with its message, integer ``created_at``.
- Errors as each API documents them; model aliases; Ollama as its clients expect.
"""

from __future__ import annotations

import json
import re
import shutil
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import anthropic
import httpx
import ollama
import openai
import pytest
from daemon_proc import serve_http, stop
from memory_chat import chatml, tokens

pytestmark = pytest.mark.wire

MODEL = "modeld-tiny"
WINDOW = 600
BIG = "x" * 700  # alone past the window
IMAGE = {"type": "image", "source": {"type": "base64", "media_type": "image/png", "data": "iVBORw0KGgo="}}
PLACEHOLDER = "[image omitted: this model reads text only]"


class Daemon:
    def __init__(self, tmp: Path, *extra: str) -> None:
        self.proc, record = serve_http(tmp, "--num-ctx", str(WINDOW), *extra)
        self.url = record.http_endpoint
        self.anthropic = anthropic.Anthropic(base_url=self.url, api_key="unused", max_retries=0, timeout=60)
        self.openai = openai.OpenAI(base_url=f"{self.url}/v1", api_key="unused", max_retries=0, timeout=60)
        self.ollama = ollama.Client(host=self.url, timeout=60)

    def close(self) -> str:
        self.anthropic.close()
        self.openai.close()
        self.ollama.close()
        _, err = stop(self.proc)
        return err


@pytest.fixture(scope="module")
def daemon() -> Iterator[Daemon]:
    tmp = Path(tempfile.mkdtemp(prefix="mdas"))
    d = Daemon(tmp, "--alias", "claude-*=modeld-tiny", "--alias", "gpt-5*=modeld-tiny")
    try:
        yield d
    finally:
        err = d.close()
        shutil.rmtree(tmp, ignore_errors=True)
        assert "Traceback" not in err, err[-3000:]


def prompt_tokens_total(url: str) -> float:
    text = httpx.get(f"{url}/metrics", timeout=10).text
    return sum(
        float(line.split()[-1]) for line in text.splitlines() if line.startswith("modeld_prompt_tokens_total")
    )


# --- 1. overflow, in each API's words -------------------------------------------------------------


def test_anthropic_overflow_is_the_error_claude_code_compacts_on(daemon: Daemon) -> None:
    messages: Any = [{"role": "user", "content": BIG}]
    counted = daemon.anthropic.messages.count_tokens(model=MODEL, messages=messages).input_tokens
    assert counted == tokens(chatml([("user", BIG)]))
    before = prompt_tokens_total(daemon.url)
    for stream in (False, True):
        with pytest.raises(anthropic.BadRequestError) as refused:
            daemon.anthropic.messages.create(model=MODEL, max_tokens=64, messages=messages, stream=stream)
        assert refused.value.status_code == 400
        error = refused.value.body["error"]  # type: ignore[index]
        assert error["type"] == "invalid_request_error"
        # Claude Code's own pattern, and the numbers it computes how much to compact from.
        found = re.fullmatch(r"prompt is too long: (\d+) tokens > (\d+) maximum", error["message"])
        assert found is not None, error["message"]
        assert (int(found.group(1)), int(found.group(2))) == (counted, WINDOW - 1)
    assert prompt_tokens_total(daemon.url) == before  # refused before anything was computed


def test_responses_overflow_fails_inside_the_stream_as_codex_reads_it(daemon: Daemon) -> None:
    with daemon.openai.responses.create(model=MODEL, input=BIG, stream=True, store=False) as stream:
        events = list(stream)
    kinds = [e.type for e in events]
    assert kinds[0] == "response.created" and kinds[-1] == "response.failed", kinds
    failed = events[-1].response  # type: ignore[union-attr]
    assert failed.status == "failed" and failed.error is not None
    assert failed.error.code == "context_length_exceeded"
    assert [e.sequence_number for e in events] == list(range(len(events)))
    with pytest.raises(openai.BadRequestError) as refused:  # not streamed: OpenAI's 400
        daemon.openai.responses.create(model=MODEL, input=BIG, store=False)
    assert refused.value.code == "context_length_exceeded"


def test_chat_overflow_is_openais_context_length_exceeded(daemon: Daemon) -> None:
    for stream in (False, True):
        with pytest.raises(openai.BadRequestError) as refused:
            daemon.openai.chat.completions.create(
                model=MODEL, messages=[{"role": "user", "content": BIG}], stream=stream
            )
        assert refused.value.code == "context_length_exceeded"
        assert f"maximum context length is {WINDOW} tokens" in refused.value.message
        assert f"resulted in {tokens(chatml([('user', BIG)]))} tokens" in refused.value.message


def test_ollama_truncates_the_oldest_messages_as_ollama_does(daemon: Daemon) -> None:
    history = [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "a" * 250},
        {"role": "assistant", "content": "b" * 250},
        {"role": "user", "content": "What now?"},
    ]
    body = {"model": MODEL, "messages": history, "stream": False, "options": {"num_predict": 4}}
    answered = httpx.post(f"{daemon.url}/api/chat", json=body, timeout=60).json()
    kept = [("system", "Be brief."), ("assistant", "b" * 250), ("user", "What now?")]
    assert answered["prompt_eval_count"] == tokens(chatml(kept)) < WINDOW  # the oldest user turn left out
    # truncate: false (the ollama package 0.6 has no argument for it yet): Ollama's error
    refused = httpx.post(f"{daemon.url}/api/chat", json={**body, "truncate": False}, timeout=60)
    assert refused.status_code == 400 and "exceeds the context length" in refused.json()["error"]


# --- 2. max_tokens beyond the window ---------------------------------------------------------------


def test_max_tokens_beyond_the_window_decodes_until_the_window_is_full(daemon: Daemon) -> None:
    """Claude Code asks for 32000: the answer runs to the end of the window and stops with
    ``max_tokens`` (no 400 after the prefill), as llama-server does. The prompt leaves 10 tokens
    of the window; the memory model's answers are at least 16."""
    text = "w" * (WINDOW - 10 - tokens(chatml([("user", "")])))
    prompt = tokens(chatml([("user", text)]))
    assert prompt == WINDOW - 10
    done = daemon.anthropic.messages.create(
        model=MODEL,
        max_tokens=32000,
        messages=[{"role": "user", "content": text}],
        extra_body={"temperature": 0},
    )
    usage = done.usage
    assert (
        usage.input_tokens + usage.cache_read_input_tokens + (usage.cache_creation_input_tokens or 0)
        == prompt
    )
    assert (done.stop_reason, usage.output_tokens) == ("max_tokens", 10)
    chat = daemon.openai.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": text}], max_tokens=100_000
    )
    assert chat.choices[0].finish_reason == "length" and chat.usage is not None
    assert chat.usage.completion_tokens == 10
    response = daemon.openai.responses.create(model=MODEL, input=text, max_output_tokens=100_000, store=False)
    assert (
        response.status == "incomplete" and response.usage is not None and response.usage.output_tokens == 10
    )


# --- 3. non-text blocks --------------------------------------------------------------------------


def test_an_image_in_history_is_a_named_placeholder_and_the_newest_one_is_refused(daemon: Daemon) -> None:
    earlier: Any = [
        {"role": "user", "content": [{"type": "text", "text": "Look:"}, IMAGE]},
        {"role": "assistant", "content": "Seen."},
        {"role": "user", "content": "And now?"},
    ]
    done = daemon.anthropic.messages.create(model=MODEL, max_tokens=4, messages=earlier)
    expected = chatml([("user", "Look:\n" + PLACEHOLDER), ("assistant", "Seen."), ("user", "And now?")])
    usage = done.usage
    assert usage.input_tokens + usage.cache_read_input_tokens + (
        usage.cache_creation_input_tokens or 0
    ) == tokens(expected)
    assert done.model_extra is not None
    assert done.model_extra["modeld"]["omitted_content"] == ["messages.0.content.1: image"]
    newest: Any = [*earlier[:2], {"role": "user", "content": [{"type": "text", "text": "This one:"}, IMAGE]}]
    with pytest.raises(anthropic.BadRequestError) as refused:
        daemon.anthropic.messages.create(model=MODEL, max_tokens=4, messages=newest)
    assert "messages.2.content.1" in refused.value.message and "newest message" in refused.value.message
    # counting it answers (Claude Code estimates with count_tokens): the image counts as its placeholder
    counted = daemon.anthropic.messages.count_tokens(model=MODEL, messages=newest).input_tokens
    assert counted == tokens(
        chatml(
            [("user", "Look:\n" + PLACEHOLDER), ("assistant", "Seen."), ("user", "This one:\n" + PLACEHOLDER)]
        )
    )
    # The refused turn stays in the agent's history with no answer after it (Claude Code resends
    # it so): the next message goes on, the image now a placeholder.
    after: Any = [*newest, {"role": "user", "content": "Never mind."}]
    went_on = daemon.anthropic.messages.create(model=MODEL, max_tokens=2, messages=after)
    assert went_on.model_extra is not None
    assert went_on.model_extra["modeld"]["omitted_content"] == [
        "messages.0.content.1: image",
        "messages.2.content.1: image",
    ]
    # A Read of a PNG in a tool result, and a document, in history.
    tool_turn: Any = [
        {"role": "user", "content": "Read it."},
        {"role": "assistant", "content": [{"type": "tool_use", "id": "t1", "name": "Read", "input": {}}]},
        {
            "role": "user",
            "content": [
                {"type": "tool_result", "tool_use_id": "t1", "content": [IMAGE]},
                {"type": "document", "source": {"type": "text", "media_type": "text/plain", "data": "d"}},
            ],
        },
        {"role": "assistant", "content": "Done."},
        {"role": "user", "content": "Next."},
    ]
    counted = daemon.anthropic.messages.create(model=MODEL, max_tokens=1, messages=tool_turn)
    assert counted.model_extra is not None
    assert counted.model_extra["modeld"]["omitted_content"] == [
        "messages.2.content.0.content[0]: image",
        "messages.2.content.1: document",
    ]
    # The same tool result as the newest message (the tool loop's next request), and with the
    # agent's next prompt joined to it: the tool returned the image, so it is a placeholder.
    result = tool_turn[2]["content"][0]
    for content in ([result], [result, {"type": "text", "text": "Next."}]):
        looped = [*tool_turn[:2], {"role": "user", "content": content}]
        answered = daemon.anthropic.messages.create(model=MODEL, max_tokens=1, messages=looped)
        assert answered.model_extra is not None
        assert (
            answered.model_extra["modeld"]["omitted_content"][0] == "messages.2.content.0.content[0]: image"
        )


def test_a_tool_reference_is_the_text_claude_code_writes(daemon: Daemon) -> None:
    """Claude Code's ToolSearch answers with ``tool_reference`` blocks in a tool result: the
    model reads ``Tool loaded: NAME``; and a message's text blocks are joined by a newline."""

    def ask(result: list[Any], text: list[Any]) -> list[Any]:
        return [
            {"role": "user", "content": "Find a tool."},
            {
                "role": "assistant",
                "content": [{"type": "tool_use", "id": "s1", "name": "ToolSearch", "input": {}}],
            },
            {
                "role": "user",
                "content": [{"type": "tool_result", "tool_use_id": "s1", "content": result}, *text],
            },
        ]

    reference = [{"type": "tool_reference", "tool_name": "mcp__git__log"}]
    blocks = [{"type": "text", "text": "Use it."}, {"type": "text", "text": "Quickly."}]
    as_given = ask(reference, blocks)
    done = daemon.anthropic.messages.create(model=MODEL, max_tokens=1, messages=as_given)
    usage = done.usage
    prompt = usage.input_tokens + usage.cache_read_input_tokens + (usage.cache_creation_input_tokens or 0)

    def count(messages: list[Any]) -> int:
        return daemon.anthropic.messages.count_tokens(model=MODEL, messages=messages).input_tokens

    written = ask(
        [{"type": "text", "text": "Tool loaded: mcp__git__log"}],
        [{"type": "text", "text": "Use it.\nQuickly."}],
    )
    assert prompt == count(as_given) == count(written)
    unjoined = ask(
        [{"type": "text", "text": "Tool loaded: mcp__git__log"}],
        [{"type": "text", "text": "Use it.Quickly."}],
    )
    assert count(written) - count(unjoined) == 1  # the newline between the two blocks


def test_images_in_history_on_the_other_apis(daemon: Daemon) -> None:
    picture = {"type": "image_url", "image_url": {"url": "data:image/png;base64,iVBORw0KGgo="}}
    chat = daemon.openai.chat.completions.create(
        model=MODEL,
        max_tokens=1,
        messages=[
            {"role": "user", "content": [{"type": "text", "text": "See"}, picture]},  # type: ignore[list-item]
            {"role": "assistant", "content": "Yes."},
            {"role": "user", "content": "Go on."},
        ],
    )
    assert chat.model_extra is not None
    assert chat.model_extra["modeld"]["omitted_content"] == ["messages[0].content[1]: image"]
    seen = [
        {"type": "message", "role": "user", "content": [{"type": "input_image", "image_url": "data:,"}]},
        {"type": "message", "role": "assistant", "content": [{"type": "output_text", "text": "ok"}]},
        {"type": "message", "role": "user", "content": "more"},
    ]
    response = daemon.openai.responses.create(model=MODEL, input=seen, max_output_tokens=1, store=False)  # type: ignore[arg-type]
    assert response.model_extra is not None
    assert response.model_extra["modeld"]["omitted_content"] == ["input[0].content[0]: image"]
    with pytest.raises(openai.BadRequestError):  # Codex's view_image in the newest message
        daemon.openai.responses.create(model=MODEL, input=seen[:1], max_output_tokens=1, store=False)  # type: ignore[arg-type]
    body = {
        "model": MODEL,
        "stream": False,
        "options": {"num_predict": 1},
        "messages": [
            {"role": "user", "content": "look", "images": ["iVBORw0KGgo="]},
            {"role": "assistant", "content": "ok"},
            {"role": "user", "content": "more"},
        ],
    }
    answered = httpx.post(f"{daemon.url}/api/chat", json=body, timeout=60).json()
    assert answered["modeld"]["omitted_content"] == ["messages[0].images[0]: image"]
    with pytest.raises(ollama.ResponseError) as refused:
        daemon.ollama.chat(model=MODEL, messages=body["messages"][:1])  # type: ignore[index]
    assert refused.value.status_code == 400 and "images[0]" in refused.value.error


def test_tool_choice_none_keeps_the_tools_in_the_prompt(daemon: Daemon) -> None:
    """``tool_choice: none`` forbids calls; the tools stay in the prompt, so the warm prefix of
    the turns that may call them is the same."""
    tool: Any = {
        "name": "read_file",
        "description": "Read",
        "input_schema": {"type": "object", "properties": {}},
    }
    ask: Any = {"model": MODEL, "max_tokens": 1, "messages": [{"role": "user", "content": "Read a file."}]}
    auto = daemon.anthropic.messages.create(**ask, tools=[tool])
    none = daemon.anthropic.messages.create(**ask, tools=[tool], tool_choice={"type": "none"})
    plain = daemon.anthropic.messages.create(**ask)

    def prompt(done: Any) -> int:
        u = done.usage
        return int(u.input_tokens + u.cache_read_input_tokens + (u.cache_creation_input_tokens or 0))

    assert prompt(none) == prompt(auto) > prompt(plain)
    assert none.usage.cache_read_input_tokens == prompt(none)  # all warm from the turn with tools


# --- 4. Codex ------------------------------------------------------------------------------------

SPAWN = {
    "type": "namespace",
    "name": "multi_agent_v1",
    "description": "Sub-agents.",
    "tools": [
        {
            "type": "function",
            "name": "spawn_agent",
            "description": "Spawn one.",
            "strict": False,
            "parameters": {
                "type": "object",
                "properties": {"task": {"type": "string", "minLength": 1, "maxLength": 8}},
                "required": ["task"],
                "additionalProperties": False,
            },
        }
    ],
}


def test_a_namespaced_call_comes_back_with_its_namespace_and_round_trips(daemon: Daemon) -> None:
    first = daemon.openai.responses.create(
        model=MODEL,
        input="Delegate.",
        tools=[SPAWN],  # type: ignore[list-item]
        tool_choice={"type": "function", "name": "multi_agent_v1.spawn_agent"},
        store=False,
        prompt_cache_key="ns-conv",
        max_output_tokens=200,
    )
    calls = [item for item in first.output if item.type == "function_call"]
    assert len(calls) == 1
    assert (calls[0].namespace, calls[0].name) == ("multi_agent_v1", "spawn_agent")  # Codex looks calls up so
    assert isinstance(first.created_at, int) or float(first.created_at).is_integer()
    second = daemon.openai.responses.create(
        model=MODEL,
        input=[
            {"type": "message", "role": "user", "content": "Delegate."},
            {
                "type": "function_call",
                "call_id": calls[0].call_id,
                "namespace": "multi_agent_v1",
                "name": "spawn_agent",
                "arguments": calls[0].arguments,
            },  # type: ignore[typeddict-unknown-key]
            {"type": "function_call_output", "call_id": calls[0].call_id, "output": "spawned"},
        ],
        tools=[SPAWN],  # type: ignore[list-item]
        store=False,
        prompt_cache_key="ns-conv",
        max_output_tokens=2,
    )
    assert first.usage is not None and second.usage is not None
    # the call is written back as the model generated it: every token of the first turn reused
    assert (
        second.usage.input_tokens_details.cached_tokens
        == first.usage.input_tokens + first.usage.output_tokens
    )


def test_a_reasoning_item_and_its_message_are_one_assistant_turn(daemon: Daemon) -> None:
    items: Any = [
        {"type": "message", "role": "user", "content": "Hi."},
        {"type": "reasoning", "summary": [{"type": "summary_text", "text": "thinking"}]},
        {"type": "message", "role": "assistant", "content": [{"type": "output_text", "text": "Hello."}]},
        {"type": "message", "role": "user", "content": "Bye."},
    ]
    done = daemon.openai.responses.create(model=MODEL, input=items, max_output_tokens=1, store=False)
    assert done.usage is not None
    # one assistant turn (the memory template shows no reasoning): not an empty turn and another
    assert done.usage.input_tokens == tokens(
        chatml([("user", "Hi."), ("assistant", "Hello."), ("user", "Bye.")])
    )
    raw = httpx.post(
        f"{daemon.url}/v1/responses",
        json={"model": MODEL, "input": "Hi.", "max_output_tokens": 2, "store": False},
        timeout=30,
    ).json()
    assert isinstance(raw["created_at"], int)  # seconds, an integer
    ids = [item["id"] for item in raw["output"]]
    assert len(ids) == len(set(ids))


# --- 7. errors as each API documents them -----------------------------------------------------------


def test_a_failure_inside_an_anthropic_stream_is_an_error_event(tmp_path: Path) -> None:
    """With a keep-alive interval shorter than the window check, the stream has begun when the
    overflow is found: it arrives as Anthropic's ``error`` event (with its ``event:`` line), which
    the SDK raises, and pings kept the stream alive before it."""
    d = Daemon(tmp_path, "--keepalive-interval", "1ms")
    huge = "x" * 300_000  # counting it takes longer than the interval, whatever the machine
    try:
        with httpx.stream(
            "POST",
            f"{d.url}/v1/messages",
            json={
                "model": MODEL,
                "max_tokens": 8,
                "stream": True,
                "messages": [{"role": "user", "content": huge}],
            },
            timeout=60,
        ) as r:
            assert r.status_code == 200
            lines = [line for line in r.iter_lines() if line]
        names = [line[7:] for line in lines if line.startswith("event: ")]
        assert names[-1] == "error" and set(names[:-1]) <= {"ping"}, names
        data = json.loads(lines[-1][6:])
        assert data["error"]["type"] == "invalid_request_error" and data["request_id"].startswith("req_")
        assert data["error"]["message"].startswith("prompt is too long: ")
        with (
            pytest.raises(anthropic.APIStatusError) as raised,
            d.anthropic.messages.stream(
                model=MODEL, max_tokens=8, messages=[{"role": "user", "content": huge}]
            ) as stream,
        ):
            for _ in stream:
                pass
        assert "prompt is too long" in str(raised.value)
    finally:
        d.close()


def test_a_stream_silent_for_the_interval_is_kept_alive_in_each_apis_form(tmp_path: Path) -> None:
    """A decode with gaps (the memory backend's ``delay_ms``: 300 ms a token) against a 50 ms
    keep-alive interval: OpenAI's stream carries SSE comments between its chunks, which the SDK
    skips (the answer is the same as without them)."""
    d = Daemon(tmp_path, "--keepalive-interval", "50ms")
    try:
        ask: dict[str, Any] = {
            "model": MODEL,
            "messages": [{"role": "user", "content": "Slowly."}],
            "max_tokens": 3,
            "stream": True,
            "delay_ms": 300,
        }
        with httpx.stream("POST", f"{d.url}/v1/chat/completions", json=ask, timeout=60) as r:
            lines = [line for line in r.iter_lines() if line]
        comments = [line for line in lines if line.startswith(":")]
        assert len(comments) >= 3, lines
        streamed = d.openai.chat.completions.create(
            model=MODEL, messages=ask["messages"], max_tokens=3, stream=True, extra_body={"delay_ms": 300}
        )
        text = "".join(c.choices[0].delta.content or "" for c in streamed if c.choices)
        whole = d.openai.chat.completions.create(model=MODEL, messages=ask["messages"], max_tokens=3)
        assert text == whole.choices[0].message.content
    finally:
        d.close()


# --- 8. aliases ----------------------------------------------------------------------------------


def test_an_agents_default_model_names_reach_a_model_through_an_alias(daemon: Daemon) -> None:
    done = daemon.anthropic.messages.create(
        model="claude-opus-5", max_tokens=2, messages=[{"role": "user", "content": "hi"}]
    )
    assert done.model == "claude-opus-5"  # the name asked for, served by the alias's model
    response = daemon.openai.responses.create(
        model="gpt-5.1-codex", input="hi", max_output_tokens=2, store=False
    )
    assert response.model == "gpt-5.1-codex"
    listed = {m.id: m.model_extra for m in daemon.openai.models.list()}
    assert listed["claude-*"] is not None and listed["claude-*"]["modeld"]["alias_of"] == MODEL
    assert listed["gpt-5*"] is not None and listed["gpt-5*"]["context_length"] == WINDOW
    with pytest.raises(openai.NotFoundError):
        daemon.openai.responses.create(model="o3", input="hi", store=False)


# --- 6. Ollama as its clients expect ------------------------------------------------------------------


def test_ollama_answers_as_ollama_clients_expect(daemon: Daemon) -> None:
    root = httpx.get(daemon.url + "/", timeout=10)
    assert root.status_code == 200 and root.text == "Ollama is running"
    assert httpx.head(daemon.url + "/", timeout=10).status_code == 200
    # curl -d (a form content type, no Origin), as every example of Ollama's docs sends it
    form = httpx.post(
        f"{daemon.url}/api/chat",
        content=json.dumps(
            {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "stream": False}
        ),
        headers={"Content-Type": "application/x-www-form-urlencoded"},
        timeout=30,
    )
    assert form.status_code == 200 and form.json()["done"] is True
    # Open WebUI's tool results carry tool_call_id; unknown options and fields are ignored
    answered = daemon.ollama.chat(
        model=MODEL,
        messages=[
            {"role": "user", "content": "List."},
            {
                "role": "assistant",
                "content": "",
                "tool_calls": [{"function": {"name": "ls", "arguments": {}}}],
            },
            {"role": "tool", "content": "a.py", "tool_call_id": "call_1"},  # type: ignore[typeddict-unknown-key]
        ],
        options={"num_predict": 2, "mirostat": 2, "repeat_last_n": 64},
    )
    assert answered.done
    extra = httpx.post(
        f"{daemon.url}/api/generate",
        json={
            "model": MODEL,
            "prompt": "hi",
            "stream": False,
            "shift": True,
            "logprobs": False,
            "options": {"num_predict": 1},
        },
        timeout=30,
    )
    assert extra.status_code == 200, extra.text


def test_ollama_keep_alive_zero_unloads_the_model(tmp_path: Path) -> None:
    """``keep_alive: 0`` unloads the model once answered (and an empty generate with it unloads
    at once), and computes nothing ahead of a next turn (it did, then unloaded it); an unknown
    option is answered, with a warning in the daemon's log."""
    d = Daemon(tmp_path)
    err = ""
    try:
        d.ollama.chat(
            model=MODEL,
            messages=[{"role": "user", "content": "hi"}],
            options={"num_predict": 1, "mirostat": 2},
        )
        assert [m.model for m in d.ollama.ps().models] == [MODEL]
        d.ollama.chat(
            model=MODEL,
            messages=[{"role": "user", "content": "bye"}],
            options={"num_predict": 1},
            keep_alive=0,
        )
        assert _unloaded(d)
        records = httpx.get(f"{d.url}/v1/requests", timeout=30).json()["data"]
        assert [r["finish"] for r in sorted(records, key=lambda r: r["started_at"])] == [
            "length",
            "ahead",
            "length",
        ]
        d.ollama.chat(model=MODEL, messages=[{"role": "user", "content": "hi"}], options={"num_predict": 1})
        gone = d.ollama.generate(model=MODEL, keep_alive=0)  # Ollama's "unload it now"
        assert gone.done_reason == "unload" and _unloaded(d)
    finally:
        err = d.close()
    assert "ollama: ignored unknown options: 'mirostat'" in err, err[-2000:]


def _unloaded(d: Daemon) -> bool:
    import time

    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        if not d.ollama.ps().models:
            return True
        time.sleep(0.05)
    return False
