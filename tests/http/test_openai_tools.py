"""Constrained output, tool calls and log-probabilities through the OpenAI endpoint, driven by
the official ``openai`` SDK against a real ``modeld serve --http`` (the memory backend: one
token per byte, so every count is exact; one test runs the generated tiny llama model).

What a coding tool does: ask for a JSON answer (``response_format``), force a tool call
(``tool_choice``), read the call from the stream as deltas, send the call and its result back
in the next request and pay only for the result (the call's tokens are reused as generated),
ask for log-probabilities and bias tokens.
"""

from __future__ import annotations

import json
import shutil
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import openai
import pytest
from daemon_proc import serve_http, stop

from modeld.server.http.openai.answer import finish_reason

jsonschema = pytest.importorskip("jsonschema")

pytestmark = pytest.mark.wire

MODEL = "modeld-tiny"
SCHEMA = {
    "type": "object",
    "properties": {
        "verdict": {"enum": ["fix", "skip", "ask"]},
        "file": {"type": "string", "minLength": 1, "maxLength": 20},
        "line": {"type": "integer", "minimum": 1, "maximum": 999},
    },
    "required": ["verdict", "file", "line"],
    "additionalProperties": False,
}
READ_FILE = {
    "type": "function",
    "function": {
        "name": "read_file",
        "description": "Read a file of the repository",
        "parameters": {
            "type": "object",
            "properties": {"path": {"type": "string", "minLength": 1, "maxLength": 24}},
            "required": ["path"],
            "additionalProperties": False,
        },
    },
}
GREP = {
    "type": "function",
    "function": {
        "name": "grep",
        "parameters": {
            "type": "object",
            "properties": {"pattern": {"type": "string", "maxLength": 12}, "max": {"type": "integer"}},
            "required": ["pattern"],
        },
    },
}


class Daemon:
    def __init__(self, tmp: Path, backend: str = "memory") -> None:
        self.proc, record = serve_http(tmp, backend=backend)
        self.client = openai.OpenAI(
            base_url=f"{record.http_endpoint}/v1", api_key="unused", max_retries=0, timeout=120
        )

    def close(self) -> None:
        self.client.close()
        stop(self.proc)


@pytest.fixture(scope="module")
def daemon() -> Iterator[Daemon]:
    tmp = Path(tempfile.mkdtemp(prefix="mdt"))
    d = Daemon(tmp)
    try:
        yield d
    finally:
        d.close()
        shutil.rmtree(tmp, ignore_errors=True)


def ask(text: str) -> list[dict[str, Any]]:
    return [{"role": "system", "content": "You are a code reviewer.\n"}, {"role": "user", "content": text}]


def test_json_schema_answers_always_validate(daemon: Daemon) -> None:
    response_format = {
        "type": "json_schema",
        "json_schema": {"name": "review", "schema": SCHEMA, "strict": True},
    }
    answers = set()
    for seed in range(10):
        done = daemon.client.chat.completions.create(
            model=MODEL,
            messages=ask(f"Review patch {seed}.\n"),
            temperature=1.0,
            seed=seed,
            response_format=response_format,  # type: ignore[arg-type]
        )
        content = done.choices[0].message.content
        assert content is not None and done.choices[0].finish_reason == "stop"
        jsonschema.validate(json.loads(content), SCHEMA)
        answers.add(content)
    assert len(answers) > 3
    streamed = daemon.client.chat.completions.create(
        model=MODEL,
        messages=ask("Review the last patch.\n"),
        stream=True,
        response_format={"type": "json_object"},
    )
    chunks = list(streamed)
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert isinstance(json.loads(text), dict)
    assert chunks[-1].choices[0].finish_reason == "stop"


def test_a_bad_schema_is_a_400_that_says_where(daemon: Daemon) -> None:
    bad = {"type": "object", "properties": {"a": {"not": {"type": "null"}}}}
    with pytest.raises(openai.BadRequestError) as err:
        daemon.client.chat.completions.create(
            model=MODEL,
            messages=ask("x\n"),
            response_format={"type": "json_schema", "json_schema": {"name": "x", "schema": bad}},
        )
    body = err.value.body
    assert isinstance(body, dict)
    assert (body["param"], body["code"]) == ("response_format", "unsupported_parameter")
    assert "/properties/a/not" in body["message"]
    with pytest.raises(openai.BadRequestError) as err:
        daemon.client.chat.completions.create(
            model=MODEL,
            messages=ask("x\n"),
            tools=[READ_FILE],  # type: ignore[list-item]
            tool_choice={"type": "function", "function": {"name": "write_file"}},
        )
    assert err.value.body["param"] == "tool_choice"  # type: ignore[index]
    assert "read_file" in err.value.body["message"]  # type: ignore[index]


def test_a_forced_call_is_parsed_and_the_next_turn_pays_only_for_the_result(daemon: Daemon) -> None:
    headers = {"X-Modeld-Conversation": "tool-loop"}
    messages = ask("Why does the build fail?\n")
    first = daemon.client.chat.completions.create(
        model=MODEL,
        messages=messages,
        tools=[READ_FILE, GREP],  # type: ignore[list-item]
        tool_choice={"type": "function", "function": {"name": "read_file"}},
        temperature=1.0,
        seed=11,
        extra_headers=headers,
    )
    choice = first.choices[0]
    assert choice.finish_reason == "tool_calls"
    assert choice.message.content is None
    calls = choice.message.tool_calls
    assert calls is not None and len(calls) == 1
    call = calls[0]
    assert call.type == "function" and call.function.name == "read_file" and call.id.startswith("call_")
    jsonschema.validate(json.loads(call.function.arguments), READ_FILE["function"]["parameters"])  # type: ignore[index]
    assert first.usage is not None

    messages += [
        {"role": "assistant", "content": None, "tool_calls": [call.model_dump()]},
        {"role": "tool", "tool_call_id": call.id, "content": "error: missing import\n"},
    ]
    second = daemon.client.chat.completions.create(
        model=MODEL,
        messages=messages,
        tools=[READ_FILE, GREP],
        max_tokens=4,
        extra_headers=headers,  # type: ignore[list-item]
    )
    assert second.usage is not None and second.usage.prompt_tokens_details is not None
    # Every token of the first turn is reused (the call as generated): the second pays only for
    # the end of the assistant turn, the tool result and the generation prompt.
    cached = second.usage.prompt_tokens_details.cached_tokens
    assert cached == first.usage.prompt_tokens + first.usage.completion_tokens
    glue = "<|im_end|>\n<|im_start|>tool\nerror: missing import\n<|im_end|>\n<|im_start|>assistant\n"
    assert second.usage.prompt_tokens - cached == len(glue.encode())


def test_calls_sent_back_by_another_client_are_written_in_the_models_format(daemon: Daemon) -> None:
    arguments = json.dumps({"pattern": "TODO"})
    messages = [
        *ask("Find the TODOs.\n"),
        {
            "role": "assistant",
            "content": "Searching.",
            "tool_calls": [
                {"id": "call_x1", "type": "function", "function": {"name": "grep", "arguments": arguments}}
            ],
        },
        {"role": "tool", "tool_call_id": "call_x1", "content": "a.py:3: TODO\n"},
    ]
    done = daemon.client.chat.completions.create(
        model=MODEL,
        messages=messages,
        tools=[READ_FILE, GREP],
        max_tokens=4,  # type: ignore[list-item]
    )
    assert done.usage is not None
    # The memory model's template writes calls as its hermes grammar does (compact, arguments as sent).
    rendered = f'Searching.\n<tool_call>\n{{"name":"grep","arguments":{arguments}}}\n</tool_call>'
    plain = daemon.client.chat.completions.create(
        model=MODEL,
        messages=[
            *ask("Find the TODOs.\n"),
            {"role": "assistant", "content": rendered},
            {"role": "tool", "content": "a.py:3: TODO\n"},
        ],
        tools=[READ_FILE, GREP],  # type: ignore[list-item]
        max_tokens=4,
    )
    assert plain.usage is not None and plain.usage.prompt_tokens == done.usage.prompt_tokens
    with pytest.raises(openai.BadRequestError) as err:
        daemon.client.chat.completions.create(
            model=MODEL,
            messages=[
                {
                    "role": "assistant",
                    "tool_calls": [
                        {"id": "c", "type": "function", "function": {"name": "grep", "arguments": "[1]"}}
                    ],
                }
            ],
        )
    assert err.value.body["param"] == "messages[0].tool_calls[0].function.arguments"  # type: ignore[index]


def test_streamed_tool_calls_arrive_as_deltas(daemon: Daemon) -> None:
    stream = daemon.client.chat.completions.create(
        model=MODEL,
        messages=ask("Look at the config.\n"),
        tools=[READ_FILE, GREP],  # type: ignore[list-item]
        tool_choice="required",
        temperature=1.0,
        seed=3,
        stream=True,
        stream_options={"include_usage": True},
        parallel_tool_calls=False,
    )
    chunks = list(stream)
    deltas = [d for c in chunks if c.choices for d in (c.choices[0].delta.tool_calls or [])]
    assert len(deltas) == 2  # the name as soon as it is known, the arguments when complete
    head, tail = deltas
    assert head.index == tail.index == 0
    assert head.id and head.id.startswith("call_") and head.type == "function"
    assert head.function is not None and head.function.name in ("read_file", "grep")
    assert head.function.arguments == "" and tail.id is None
    assert tail.function is not None and tail.function.arguments
    assert isinstance(json.loads(tail.function.arguments), dict)
    assert all(not (c.choices and c.choices[0].delta.content) for c in chunks)  # the call is not content
    finals = [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason]
    assert finals == ["tool_calls"]
    assert chunks[-1].usage is not None and chunks[-1].usage.completion_tokens > 0


def test_logprobs_and_logit_bias(daemon: Daemon) -> None:
    done = daemon.client.chat.completions.create(
        model=MODEL, messages=ask("Say something.\n"), max_tokens=12, logprobs=True, top_logprobs=2
    )
    choice = done.choices[0]
    assert choice.logprobs is not None and choice.logprobs.content is not None
    content = choice.logprobs.content
    assert done.usage is not None and len(content) == done.usage.completion_tokens == 12
    assert b"".join(bytes(t.bytes or []) for t in content) == (choice.message.content or "").encode()
    for t in content:
        assert t.logprob <= 1e-6 and 1 <= len(t.top_logprobs) <= 2
        assert t.top_logprobs[0].token == t.token  # greedy
    streamed = daemon.client.chat.completions.create(
        model=MODEL, messages=ask("Say something.\n"), max_tokens=12, logprobs=True, stream=True
    )
    tokens = [
        t.token
        for c in streamed
        if c.choices and c.choices[0].logprobs
        for t in c.choices[0].logprobs.content or []
    ]
    assert len(tokens) == 12
    legacy = daemon.client.completions.create(model=MODEL, prompt="def f():\n", max_tokens=5, logprobs=2)
    lp = legacy.choices[0].logprobs
    assert lp is not None and lp.tokens is not None and lp.top_logprobs is not None
    assert "".join(lp.tokens) == legacy.choices[0].text and len(lp.top_logprobs) == 5
    # Memory backend: token 98 is the byte "b"; +100 makes the enum's "b" win every time.
    biased = daemon.client.chat.completions.create(
        model=MODEL,
        messages=ask("Pick one.\n"),
        logit_bias={"98": 100},
        response_format={
            "type": "json_schema",
            "json_schema": {
                "name": "pick",
                "schema": {"type": "object", "properties": {"x": {"enum": ["a", "b"]}}, "required": ["x"]},
            },
        },
    )
    assert biased.choices[0].message.content == '{"x":"b"}'
    penalised = daemon.client.chat.completions.create(
        model=MODEL,
        messages=ask("Say something.\n"),
        max_tokens=8,
        presence_penalty=1.5,
        frequency_penalty=0.5,
    )
    assert penalised.usage is not None and penalised.usage.completion_tokens == 8


def test_finish_reasons_map_to_openai() -> None:
    def reason(finish: str) -> str:
        return finish_reason(finish)

    assert [reason(f) for f in ("stop", "stop_sequence", "length", "tool_calls", "signal")] == [
        "stop",
        "stop",
        "length",
        "tool_calls",
        "tool_calls",
    ]
    assert reason("malformed_tool_call") == "stop"  # the raw call text is the content
    # Not valid output: passed through, never "stop".
    assert (reason("constraint_failed"), reason("repeated_line")) == ("constraint_failed", "repeated_line")


@pytest.mark.llama
def test_the_generated_llama_model_always_writes_a_well_formed_call() -> None:
    tmp = Path(tempfile.mkdtemp(prefix="mdt"))
    d = Daemon(tmp, backend="llama")
    try:
        for seed in range(4):
            done = d.client.chat.completions.create(
                model=MODEL,
                messages=ask(f"Open file {seed}.\n"),
                tools=[READ_FILE],  # type: ignore[list-item]
                tool_choice="required",
                temperature=1.0,
                seed=seed,
                max_tokens=200,
            )
            choice = done.choices[0]
            assert choice.finish_reason == "tool_calls", choice
            assert choice.message.tool_calls is not None
            call = choice.message.tool_calls[0]
            assert call.function.name == "read_file"
            jsonschema.validate(json.loads(call.function.arguments), READ_FILE["function"]["parameters"])  # type: ignore[index]
        answer = d.client.chat.completions.create(
            model=MODEL,
            messages=ask("Review it.\n"),
            response_format={"type": "json_schema", "json_schema": {"name": "r", "schema": SCHEMA}},
            max_tokens=200,
        )
        content = answer.choices[0].message.content
        assert content is not None and answer.choices[0].finish_reason == "stop"
        jsonschema.validate(json.loads(content), SCHEMA)
    finally:
        d.close()
        shutil.rmtree(tmp, ignore_errors=True)


def test_a_forced_call_cut_off_by_max_tokens_never_leaks_markup(daemon: Daemon) -> None:
    """At every cut-off point of a forced call: no template markup in the content, the call in
    tool_calls as far as it got (once its name is written), finish_reason length, and the
    stream says what the response says."""
    request: dict[str, Any] = {
        "model": MODEL,
        "messages": ask("Open the config.\n"),
        "tools": [READ_FILE],
        "tool_choice": {"type": "function", "function": {"name": "read_file"}},
    }
    full = daemon.client.chat.completions.create(**request)
    assert full.choices[0].finish_reason == "tool_calls" and full.usage is not None
    length = full.usage.completion_tokens
    for cut in range(1, length):
        done = daemon.client.chat.completions.create(**request, max_tokens=cut)
        choice = done.choices[0]
        assert choice.finish_reason == "length", cut
        content = choice.message.content or ""
        assert "<tool_call>" not in content and "read_file" not in content, (cut, content)
        calls = choice.message.tool_calls or []
        assert len(calls) <= 1 and all(c.function.name == "read_file" for c in calls), cut
        chunks = list(daemon.client.chat.completions.create(**request, max_tokens=cut, stream=True))
        streamed = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
        assert streamed == content, cut
        names = [
            d.function.name
            for c in chunks
            if c.choices
            for d in c.choices[0].delta.tool_calls or []
            if d.function and d.function.name
        ]
        args = "".join(
            d.function.arguments or ""
            for c in chunks
            if c.choices
            for d in c.choices[0].delta.tool_calls or []
            if d.function
        )
        assert names == [c.function.name for c in calls], cut
        assert args == "".join(c.function.arguments for c in calls), cut
